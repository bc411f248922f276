"""The tuner's logic on CPU: seeding, constraint pruning, transfer, isolation of faulty trials, resume, replay, bad input.

GPU evaluation is replaced by ``test_tuning_toys.fake_evaluate`` (same signature, run in the
same isolated worker process), so everything but the kernel launch is the real code path.
The ``gpu`` test at the end runs a real TileLang kernel that faults, hangs and miscomputes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import optuna
import pytest
import test_tuning_toys as toys
from optuna.trial import TrialState

from lab.cli import main as lab_main
from tiles.core import arch as arch_mod
from tiles.core.arch import ArchError, get_arch
from tiles.core.config_store import read_results
from tiles.core.contract import Constraint, SearchSpace
from tuning import space as space_mod
from tuning import study as study_mod
from tuning.export import export_results
from tuning.rematch import REMATCH_MARGIN
from tuning.replay import replay
from tuning.space import NearbyValidConfigs, ValidConfigs, config_key, seed_configs, similarity_order
from tuning.study import TuneError, TuneOptions, counts_toward_budget, open_storage, tune, uses_budget

SM90 = get_arch("sm90")
REPO = Path(__file__).resolve().parent.parent


def _opts(tmp_path: Path, **kw) -> TuneOptions:
    base = {
        "arch": SM90,
        "trials": 10,
        "storage": f"sqlite:///{tmp_path / 'tune.db'}",
        "compile_jobs": 1,
        "evaluator": "test_tuning_toys:fake_evaluate",
        "require_gpu": False,
        "results_root": tmp_path / "results",
        "trial_timeout_s": 20,
        "command": "pytest",
    }
    return TuneOptions(**(base | kw))


def _table_text(summary) -> str:
    """``lab tune``'s final table for one study, as text."""
    from rich.console import Console

    from tuning.progress import TuneProgress

    console = Console(record=True, width=240)
    console.print(TuneProgress().final_table([summary]))
    return console.export_text()


def _study(opts: TuneOptions, name: str) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=open_storage(opts.storage))


def _by_mode(study: optuna.Study) -> dict:
    return {t.params["mode"]: t for t in study.get_trials() if counts_toward_budget(t) and "repeat_of" not in t.user_attrs}


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """One exhaustive toy study (the grid fits the budget), shared by the tests that read it."""
    tmp = tmp_path_factory.mktemp("tuned")
    opts = _opts(tmp, trials=36)
    [summary] = tune([toys.ScaleToy()], opts, shapes="decode")
    return opts, summary, _study(opts, summary.study)


def test_default_enqueued_first_and_winner_beats_it(tuned):
    opts, summary, study = tuned
    first = study.trials[0]
    assert first.params == toys.ScaleToy().default_config(SM90) and first.user_attrs["source"] == "default"
    assert summary.default_ms == pytest.approx(1.5)
    assert summary.best.params == {"block": 256, "schedule": "ws", "stages": 3} and summary.speedup == pytest.approx(1.5)
    # the winner went to results/sm90/toy_scale.yaml with its environment and command
    text = (opts.results_root / "sm90" / "tuned" / "unknown" / "toy_scale.yaml").read_text()
    assert "command: pytest" in text and "decode_n4k" in text


def test_a_winner_that_beats_the_default_again_in_its_rematch_is_kept(tuned):
    """The exhaustive toy study's winner is timed against the default REMATCH rounds more times each (alternating, on
    fresh seeds) before it is stored; it beats it every time, so it stays, and the file records the rematch."""
    opts, summary, _ = tuned
    assert summary.rematch["kept"] and summary.rematch["error"] is None
    assert summary.rematch["challenger"] == {"block": 256, "schedule": "ws", "stages": 3}
    assert summary.rematch["challenger_ms"] == [pytest.approx(1.0)] * 3 and summary.rematch["default_ms"] == [pytest.approx(1.5)] * 3
    entry = read_results(opts.results_root / "sm90" / "tuned" / "unknown" / "toy_scale.yaml", "toy_scale", SM90)["shapes"]["decode_n4k"]
    assert entry["config"] == {"block": 256, "schedule": "ws", "stages": 3} and entry["rematch"]["kept"] is True
    assert summary.rematch["rounds_won"] == 3 and "1.500x 3/3 kept" in _table_text(summary)


@pytest.mark.parametrize("rematch", ["slower", "tie", "split", "fails"])
@pytest.mark.slow
def test_a_lucky_winner_gives_the_study_back_to_the_default(tmp_path, monkeypatch, rematch):
    """A config that won its study by luck (the serial schedule, timed 1.2 ms under its cost in its trials) is slower
    than the default in its rematch, ahead by less than REMATCH_MARGIN, ahead by its median but behind in one round,
    or fails its check there: the default is
    stored, at its study time, speedup 1, with the rematch that decided it. Without a rematch (--rematch 0) the lucky
    config would have been stored."""
    monkeypatch.setenv("TOY_LUCKY", rematch)
    fails = rematch == "fails"
    opts = _opts(tmp_path, trials=36, evaluator="test_tuning_toys:lucky_evaluate")
    [summary] = tune([toys.ScaleToy()], opts, shapes="decode")
    default = toys.ScaleToy().default_config(SM90)
    assert summary.rematch["challenger"]["schedule"] == "serial" and not summary.rematch["kept"]
    assert (summary.rematch["error"] is not None) == fails
    if rematch == "slower":
        assert summary.rematch["challenger_ms"] and all(ms > 1.5 for ms in summary.rematch["challenger_ms"])
    if rematch == "tie":  # ahead of the default, by less than the margin
        assert all(1.5 * (1 - REMATCH_MARGIN) < ms < 1.5 for ms in summary.rematch["challenger_ms"])
    if rematch == "split":  # a median 5% ahead, well past the margin, and round 2 lost
        assert summary.rematch["speedup"] == pytest.approx(1 / 0.95, rel=1e-3) and summary.rematch["rounds_won"] == 2
        assert "2/3 lost" in _table_text(summary)
    assert summary.best.params == default and summary.speedup == pytest.approx(1.0)
    entry = read_results(opts.results_root / "sm90" / "tuned" / "unknown" / "toy_scale.yaml", "toy_scale", SM90)["shapes"]["decode_n4k"]
    assert entry["config"] == default and entry["speedup"] == 1.0 and entry["rematch"]["kept"] is False
    assert ("failed" if fails else "/3 lost") in _table_text(summary)

    (tmp_path / "no_rematch").mkdir()
    unchecked = _opts(tmp_path / "no_rematch", trials=36, evaluator="test_tuning_toys:lucky_evaluate", rematch_rounds=0)
    [as_measured] = tune([toys.ScaleToy()], unchecked, shapes="decode")
    assert as_measured.rematch is None and as_measured.best.params["schedule"] == "serial"


def test_every_trial_records_outcome_and_metrics(tuned):
    _, summary, study = tuned
    for t in study.get_trials():
        assert t.user_attrs["outcome"] in ("ok", "invalid", "duplicate")
        if t.state == TrialState.COMPLETE:
            assert t.value == t.user_attrs["ms"] and t.user_attrs["compile_s"] is not None and "load_s" in t.user_attrs
    assert summary.outcomes["ok"] + summary.outcomes["invalid"] == summary.trials


def test_constraint_pruning_before_compile(tmp_path, monkeypatch):
    log = tmp_path / "compiled.jsonl"
    monkeypatch.setenv("TOY_COMPILE_LOG", str(log))
    opts = _opts(tmp_path, arch=get_arch("sm89"), trials=12, compiler="test_tuning_toys:recording_compile")
    [summary] = tune([toys.ScaleToy()], opts, shapes="decode")
    study = _study(opts, summary.study)
    invalid = [t for t in study.get_trials() if t.user_attrs.get("outcome") == "invalid"]
    assert invalid and all(t.state == TrialState.PRUNED and "shared memory" in t.user_attrs["message"] for t in invalid)
    compiled = {json.dumps(json.loads(line), sort_keys=True) for line in log.read_text().splitlines()}
    assert not compiled & {config_key(t.params) for t in invalid}
    assert summary.best.user_attrs["outcome"] == "ok"


def test_invalid_proposals_are_replaced_by_the_nearest_valid_config(tmp_path):
    """1.6% of the toy's space is valid: without the replacement a 6-trial study stops at its invalid limit
    having measured about three configs; with it the study measures 6 distinct configs (a repeat, answered from the
    record, uses no budget)."""
    opts = _opts(tmp_path, trials=6)
    [summary] = tune([toys.SparseToy()], opts, shapes="decode")
    trials = _study(opts, summary.study).get_trials()
    measured = [t for t in trials if uses_budget(t)]
    assert len(measured) == 6 and all(t.user_attrs["outcome"] == "ok" and "repeat_of" not in t.user_attrs for t in measured)
    assert len({config_key(t.params) for t in measured}) == 6
    invalid = {t.number for t in trials if t.user_attrs.get("outcome") == "invalid"}
    replaced = [t for t in measured if str(t.user_attrs.get("source", "")).startswith("nearest valid to trial ")]
    assert replaced and all(int(t.user_attrs["source"].rsplit(" ", 1)[1]) in invalid for t in replaced)


def test_a_study_ends_when_every_valid_config_is_measured(tmp_path):
    """8 of the toy's 512 configs are valid: asked for 20, the study measures all 8 once and stops (no loop of repeats
    and refused proposals up to the invalid limit)."""
    opts = _opts(tmp_path, trials=20)
    t0 = time.monotonic()
    [summary] = tune([toys.SparseToy()], opts, shapes="decode")
    trials = _study(opts, summary.study).get_trials()
    measured = {config_key(t.params) for t in trials if uses_budget(t)}
    assert len(measured) == 8 and sum(uses_budget(t) for t in trials) == 8
    assert sum(t.user_attrs.get("outcome") == "invalid" for t in trials) < study_mod.MAX_INVALID_PER_TRIAL * 20
    assert time.monotonic() - t0 < 60


def test_valid_configs_nearest_and_exhaustion():
    toy = toys.SparseToy()
    space, shape = toy.search_space(SM90), toy.shapes()[0]
    valid = ValidConfigs(space, shape, SM90, seed=0)
    assert len(valid) == 8
    # one parameter away from the 64-cube, two from every other: the 64-cube, then (once excluded) a random other
    proposal = {"block_m": 64, "block_n": 64, "block_k": 2048}
    assert valid.nearest(proposal, exclude=set()) == {"block_m": 64, "block_n": 64, "block_k": 64}
    seen = {config_key({"block_m": 64, "block_n": 64, "block_k": 64})}
    other = valid.nearest(proposal, exclude=seen)
    assert other is not None and not space.violations(other, shape, SM90) and config_key(other) not in seen
    everything = {config_key({n: s for n in ("block_m", "block_n", "block_k")}) for s in toy.SIZES}
    assert valid.nearest(proposal, exclude=everything) is None


def test_configs_of_one_kernel_are_measured_once(tmp_path):
    """An "auto" choice and the choice it resolves to build one kernel (Tile.kernel_key): given the whole grid, the
    study measures each distinct kernel once and answers the other config of each pair from that record (a repeat
    naming the trial it shares the kernel with, no budget)."""
    toy = toys.AutoToy()
    space, shape = toy.search_space(SM90), toy.shapes()[0]  # decode: auto -> ws
    opts = _opts(tmp_path, trials=space.size())
    [summary] = tune([toy], opts, shapes="decode")
    trials = _study(opts, summary.study).get_trials()
    valid = [c for c in space.all_configs() if not space.violations(c, shape, SM90)]
    kernels = {toy.kernel_key(shape, c, SM90) for c in valid}
    measured = [t for t in trials if uses_budget(t)]
    assert len(kernels) < len(valid) and len(measured) == len(kernels)
    assert {t.user_attrs["kernel_key"] for t in measured} == kernels
    shared = [t for t in trials if "same_kernel_as" in t.user_attrs]  # (the budget past the grid asks again: repeats)
    assert len({config_key(t.params) for t in shared}) == len(valid) - len(kernels)
    by_number = {t.number: t for t in trials}
    for t in shared:
        src = by_number[t.user_attrs["same_kernel_as"]]
        assert t.value == src.value and t.user_attrs["kernel_key"] == src.user_attrs["kernel_key"] and t.params != src.params
        assert {t.params["schedule"], src.params["schedule"]} == {"auto", "ws"}
    assert summary.best.params["schedule"] != "auto" or "repeat_of" not in summary.best.user_attrs


def test_valid_configs_count_kernels_not_configs():
    """ValidConfigs keyed by the tile's kernel key: ``len`` counts distinct kernels, and ``nearest`` skips a config whose
    kernel was tried under another config."""
    toy = toys.AutoToy()
    space, shape = toy.search_space(SM90), toy.shapes()[0]
    valid = ValidConfigs(space, shape, SM90, seed=0, kernel_key=lambda c: toy.kernel_key(shape, c, SM90))
    configs = [c for c in space.all_configs() if not space.violations(c, shape, SM90)]
    assert len(valid) == len({toy.kernel_key(shape, c, SM90) for c in configs}) == len(configs) * 3 // 4
    ws = {"block": 256, "schedule": "ws", "stages": 3}
    proposal = {"block": 256, "schedule": "auto", "stages": 3}
    assert valid.nearest(proposal, exclude=set()) == proposal
    assert valid.nearest(proposal, exclude=set(), exclude_kernels={toy.kernel_key(shape, ws, SM90)}) not in (proposal, ws)


def test_nearby_valid_configs_search_around_the_proposal():
    """Without enumerating the space: the untried valid config fewest parameters away (the same answer as
    ValidConfigs.nearest up to the tie-break), None once every valid one is excluded; a raising constraint ends the
    search with its reason, not the study."""
    toy = toys.SparseToy()
    space, shape = toy.search_space(SM90), toy.shapes()[0]
    nearby = NearbyValidConfigs(space, shape, SM90, seed=0)
    assert not nearby.exhaustible and nearby.ready
    proposal = {"block_m": 64, "block_n": 64, "block_k": 2048}
    cube64 = {"block_m": 64, "block_n": 64, "block_k": 64}
    assert nearby.nearest(proposal, exclude=set()) == cube64
    other = nearby.nearest(proposal, exclude={config_key(cube64)})
    assert other is not None and not space.violations(other, shape, SM90) and other != cube64
    assert nearby.nearest(proposal, exclude=set(), exclude_kernels={config_key(cube64)}) not in (None, cube64)
    everything = {config_key({n: s for n in ("block_m", "block_n", "block_k")}) for s in toy.SIZES}
    assert nearby.nearest(proposal, exclude=everything) is None

    def broken(c, s, a):
        raise KeyError("block_x")

    raising = NearbyValidConfigs(SearchSpace(space.params, (Constraint("broken", broken),)), shape, SM90)
    assert raising.nearest(proposal, exclude=set()) is None and "KeyError" in raising.error


def test_spaces_too_large_to_enumerate_still_replace_invalid_proposals(tmp_path, monkeypatch):
    """With the enumeration limit below the toy's 512 points the study searches around each invalid proposal
    (the attention and indexer spaces, 6.9-29M points, are all past the real limit): 6 distinct configs measured."""
    monkeypatch.setattr(space_mod, "MAX_ENUMERATED", 100)
    opts = _opts(tmp_path, trials=6)
    [summary] = tune([toys.SparseToy()], opts, shapes="decode")
    trials = _study(opts, summary.study).get_trials()
    measured = [t for t in trials if uses_budget(t)]
    assert len(measured) == 6 and len({config_key(t.params) for t in measured}) == 6
    assert any(str(t.user_attrs.get("source", "")).startswith("nearest valid to trial ") for t in measured)


def test_nearby_search_on_the_attention_space_finds_valid_configs():
    """The prefill attention's space at 4K (4.1M points) and the FP4 decode's at B=64/S=1 (13.8M): a random proposal
    is replaced by a valid config in seconds at most on one core, including those whose valid configs lie past the
    radius search's checks (7 of 30 such decode proposals before the greedy repair, session 23; none since)."""
    from tiles.core.registry import get_tile

    for name, shape_name, proposals in (("sparse_attn_prefill", "prefill_s4k", 3), ("sparse_attn_decode", "decode_b64_s1", 8)):
        tile = get_tile(name)
        space, shape = tile.search_space(SM90), tile.shape(shape_name)
        assert space.size() > space_mod.MAX_ENUMERATED
        nearby = NearbyValidConfigs(space, shape, SM90, seed=0, kernel_key=lambda c, t=tile, s=shape: t.kernel_key(s, c, SM90))
        rng = np.random.default_rng(3)
        for _ in range(proposals):
            proposal = {p.name: p.choices[int(rng.integers(len(p.choices)))] for p in space.params}
            t0 = time.monotonic()
            found = nearby.nearest(proposal, exclude=set())
            assert found is not None and space.violations(found, shape, SM90) == [] and time.monotonic() - t0 < 10, name


def test_greedy_repair_never_adds_a_failing_constraint():
    """NearbyValidConfigs' fallback: each step of the repair leaves at most as many constraints failing as before, and
    on the FP4 decode space it ends with fewer than the random proposal had."""
    from tiles.core.registry import get_tile

    tile = get_tile("sparse_attn_decode")
    space, shape = tile.search_space(SM90), tile.shape("decode_b64_s1")
    nearby = NearbyValidConfigs(space, shape, SM90, seed=0)
    rng = np.random.default_rng(5)
    for _ in range(5):
        proposal = {p.name: p.choices[int(rng.integers(len(p.choices)))] for p in space.params}
        before = nearby._failing(proposal)
        repaired = nearby._repair(proposal)
        assert set(repaired) == set(proposal) and all(repaired[p.name] in p.choices for p in space.params)
        assert nearby._failing(repaired) <= before
        if before:
            assert nearby._failing(repaired) < before


def test_valid_configs_survive_a_constraint_that_raises():
    """A constraint that raises on some point stops the enumeration, not the study: nothing is replaced, the reason kept."""
    toy = toys.SparseToy()
    space, shape = toy.search_space(SM90), toy.shapes()[0]

    def broken(c, s, a):
        raise KeyError("block_x")

    valid = ValidConfigs(SearchSpace(space.params, (Constraint("broken", broken),)), shape, SM90)
    assert len(valid) == 0 and valid.nearest({"block_m": 16}, exclude=set()) is None and "KeyError" in valid.error


@pytest.mark.slow
def test_valid_configs_match_the_constraints_on_a_real_space():
    from tiles.core.registry import get_tile

    tile = get_tile("compressor")
    full, shape = tile.search_space(SM90), tile.shape("decode_r2_b64")
    # The compressor's grid without its four newest parameters (left at their defaults): all_configs() holds every point
    # as a dict, and the whole grid (53.7 M points since session 30) needs more than a CI machine's 24 GiB.
    newest = {"proj_latent", "proj_out", "main_store", "proj_pipeline"}
    space = SearchSpace(tuple(p for p in full.params if p.name not in newest), full.constraints)
    assert 1_000_000 < space.size() < full.size() // 10
    brute = [c for c in space.all_configs() if not space.violations(c, shape, SM90)]
    valid = ValidConfigs(space, shape, SM90)
    assert 0 < len(valid) == len(brute) < space.size() // 100  # the sparse case the replacement exists for
    default = {k: v for k, v in tile.default_config(SM90).items() if k not in newest}
    assert valid.nearest(default, exclude=set()) == default


def test_similarity_order():
    assert [a.name for a in similarity_order(SM90)][:1] == ["sm100"]
    assert [a.name for a in similarity_order(get_arch("sm86"))][:2] == ["sm89", "sm80"]


def test_transfer_seeding_from_nearer_archs(tmp_path):
    toy = toys.ScaleToy()
    root = tmp_path / "results"
    env = {"date": "d"}
    far, near = {"block": 64, "schedule": "serial", "stages": 1}, {"block": 512, "schedule": "ws", "stages": 1}

    def summary(cfg):
        best = SimpleNamespace(params=cfg, user_attrs={"ms": 1.0})
        return SimpleNamespace(
            shape="decode_n4k", best=best, best_ms=1.0, default_ms=1.0, speedup=1.0, trials=1, outcomes={}, study="s", default=None
        )

    export_results(toy, get_arch("sm80"), [summary(far)], "x", root, environment=env)
    export_results(toy, get_arch("sm100"), [summary(near)], "x", root, environment=env)
    # an sm89 winner that sm90's constraints accept is seeded too; one they reject is not
    export_results(toy, get_arch("sm89"), [summary({"block": 512, "schedule": "serial", "stages": 3})], "x", root, environment=env)
    opts = _opts(tmp_path, trials=3)
    [s] = tune([toy], opts, shapes="decode")
    trials = _study(opts, s.study).trials
    assert [t.user_attrs["source"] for t in trials[:3]] == ["default", "transfer:sm100", "transfer:sm80"]
    assert trials[1].params == near and trials[2].params == far


class _CandidateToy(toys.ScaleToy):
    """ScaleToy with two candidates: one its constraints accept, one they reject."""

    def candidates(self, arch, shape):
        return [({"schedule": "ws", "stages": 3}, "ws measured faster"), ({"block": 512, "stages": 3}, "too much shared memory")]


def test_tile_candidates_are_seeded_after_the_default(tmp_path):
    """A tile's candidates join the seeds merged over the default, with their reason as the source; one the arch's
    constraints reject is dropped before it compiles."""
    tile, shape = _CandidateToy(), toys.TOY_SHAPES[0]
    assert tile.search_space(SM90).violations({"block": 512, "schedule": "pipelined", "stages": 3}, shape, SM90)
    seeds = seed_configs(tile, shape, SM90, tmp_path / "results")
    assert seeds == [
        ({"block": 128, "schedule": "pipelined", "stages": 2}, "default"),
        ({"block": 128, "schedule": "ws", "stages": 3}, "candidate: ws measured faster"),
    ]


def test_the_log_has_a_line_per_measured_trial_with_its_source(tmp_path):
    """Each measured trial prints what ran (its difference from the default), where it came from (the default, a
    candidate's reason) and its time or what went wrong, so a log tells whether a candidate was tried and how it timed."""
    import io
    from types import SimpleNamespace

    from rich.console import Console

    from tuning.progress import TuneProgress, trial_line

    buf = io.StringIO()
    with TuneProgress(Console(file=buf, width=200)) as progress:
        tune([toys.ScaleToy()], _opts(tmp_path, trials=4), shapes="decode", progress=progress)
    lines = [line for line in buf.getvalue().splitlines() if line.startswith("toy_scale decode_n4k #")]
    assert any(" ok 1.5" in line and line.endswith("the default  (default)") for line in lines), lines  # 1.5 ms
    assert len(lines) == 4 and all(" ok " in line for line in lines), lines
    runner = SimpleNamespace(tile=toys.ScaleToy(), shape=toys.TOY_SHAPES[0], default={"block": 128, "schedule": "pipelined", "stages": 2})
    config = {"block": 128, "schedule": "ws", "stages": 3}
    ok = trial_line(runner, 3, {"outcome": "ok", "ms": 0.0612}, config, "candidate: ws measured faster")
    assert ok == "toy_scale decode_n4k #3 ok 61.2 us  schedule=ws stages=3  (candidate: ws measured faster)"
    wrong = trial_line(runner, 4, {"outcome": "wrong", "message": "rel_l2 0.5 > 0.01"}, config, None)
    assert wrong == "toy_scale decode_n4k #4 wrong rel_l2 0.5 > 0.01  schedule=ws stages=3"


def test_faults_hangs_and_wrong_results_never_end_the_study(tmp_path):
    opts = _opts(tmp_path, trials=7, trial_timeout_s=12)
    [summary] = tune([toys.FaultToy()], opts)
    modes = _by_mode(_study(opts, summary.study))
    outcomes = {m: t.user_attrs["outcome"] for m, t in modes.items()}
    assert outcomes == {
        "good_fast": "ok",
        "good_slow": "ok",
        "compile_error": "compile_error",
        "fault": "runtime_fault",
        "hang": "timeout",
        "wrong": "wrong_result",
        "invalid": "invalid",
    }
    assert modes["wrong"].state == TrialState.FAIL and modes["wrong"].user_attrs["error"] == 0.5
    assert summary.best.params == {"mode": "good_fast"} and summary.speedup == pytest.approx(2.0)


def test_resume_after_a_killed_run_loses_no_trial(tmp_path, monkeypatch):
    monkeypatch.setattr(study_mod, "ORPHAN_GRACE_S", 0.0)  # a trial killed right after ask() is reclaimed at once
    opts = _opts(tmp_path, trials=24)
    script = textwrap.dedent(
        f"""
        import sys
        sys.path[:0] = [{str(REPO)!r}, {str(REPO / "tests")!r}]
        from pathlib import Path
        import test_tuning_toys as toys
        from tiles.core.arch import get_arch
        from tuning.study import TuneOptions, tune
        if __name__ == "__main__":
            tune([toys.ScaleToy()], TuneOptions(arch=get_arch("sm90"), trials=24, storage={opts.storage!r}, compile_jobs=1,
                 evaluator="test_tuning_toys:fake_evaluate", require_gpu=False, export=False, results_root=Path({str(opts.results_root)!r})), "decode")
        """
    )
    (tmp_path / "run.py").write_text(script)
    env = os.environ | {"TOY_EVAL_SLEEP": "0.4"}
    proc = subprocess.Popen([sys.executable, str(tmp_path / "run.py")], env=env, start_new_session=True)
    name = "toy_scale:sm90:decode_n4k"
    deadline = time.monotonic() + 120
    before: dict[int, tuple] = {}
    while time.monotonic() < deadline:
        time.sleep(0.5)
        try:
            study = _study(opts, name)
        except KeyError:
            continue
        done = [t for t in study.get_trials() if counts_toward_budget(t)]
        if len(done) >= 5:
            break
    os.killpg(proc.pid, signal.SIGKILL)  # the whole run: tuner, compile pool and GPU worker
    proc.wait()
    study = _study(opts, name)
    before = {t.number: (t.state, t.params, t.value) for t in study.get_trials() if counts_toward_budget(t)}
    assert 5 <= len(before) < 24
    [summary] = tune([toys.ScaleToy()], opts, shapes="decode")
    after = _study(opts, name).get_trials()
    assert all((after[n].state, after[n].params, after[n].value) == v for n, v in before.items())
    # the budget counts compiled or run configs; configs pruned by constraints come on top
    assert sum(uses_budget(t) for t in after) == 24 and summary.trials == sum(counts_toward_budget(t) for t in after)
    # a trial the kill left RUNNING is marked interrupted and its config tried again: every choice it recorded (ask()
    # writes the params one by one, so a kill inside it leaves some; one killed before sampling has none, and the
    # retry's sampler fills in what was not recorded)
    assert not [t for t in after if t.state == TrialState.RUNNING]
    for t in (t for t in after if t.user_attrs.get("outcome") == "interrupted" and t.params):
        retried = [u for u in after if u.number > t.number and counts_toward_budget(u)]
        assert any(t.params.items() <= u.params.items() for u in retried), (t.params, [u.params for u in retried])


def test_replay_reports_trials_to_within_3_percent(tuned):
    opts, summary, _ = tuned
    report = replay(opts.storage, summary.study, seeds=2)
    assert report.best_ms == pytest.approx(1.0) and report.recorded == 36
    by = {r.sampler: r for r in report.results}
    assert set(by) == {"tpe", "random", "gp", "cmaes"}
    for name in ("tpe", "random"):
        assert by[name].reached == 2 and 1 <= by[name].mean <= report.budget
    for name in ("gp", "cmaes"):
        assert by[name].needed or by[name].note.startswith("skipped")


def test_compile_only_compiles_the_whole_space_with_tilelang(tmp_path):
    opts = _opts(tmp_path, compile_only=True, compile_jobs=2, evaluator="unused:unused")
    [summary] = tune([toys.FaultToy()], opts)
    modes = _by_mode(_study(opts, summary.study))
    assert summary.study.endswith(":compile") and len(modes) == 7
    assert {m: t.user_attrs["outcome"] for m, t in modes.items() if t.user_attrs["outcome"] != "ok"} == {
        "compile_error": "compile_error",
        "invalid": "invalid",
    }
    assert all(t.user_attrs["compile_s"] > 0 for t in modes.values() if t.user_attrs["outcome"] == "ok")
    assert not (opts.results_root / "sm90").exists()  # compile-only exports nothing


def test_compile_only_never_compiles_a_trial_the_sampler_made_up(tmp_path):
    """Compile-only runs the enqueued grid. When lanes or processes sharing a study find the queue empty at once, ask()
    makes trials up; two processes with the same seed make up the same config, each before the other's params are
    written, and both compiled it (CI, PostgreSQL). A made-up trial is dropped as a duplicate, never compiled (no
    compile pool here: a compile would raise)."""
    opts = _opts(tmp_path, compile_only=True, trials=None)  # no --trials: the walk of the whole grid
    tile = toys.ScaleToy()
    runner = study_mod.StudyRunner(tile, tile.shapes()[0], opts, open_storage(opts.storage), compile_pool=None, gpu_pool=None)
    made_up = runner.study.ask(runner.dists)  # nothing enqueued: the sampler's own proposal
    runner.run_trial(made_up)
    [frozen] = runner.study.get_trials()
    assert frozen.state == TrialState.PRUNED and frozen.user_attrs["outcome"] == study_mod.DUPLICATE
    assert not counts_toward_budget(frozen)


# --- bad input ---------------------------------------------------------------------------------


def test_unknown_arch_lists_known_ones(capsys):
    assert lab_main(["tune", "--arch", "sm99", "--compile-only"]) == 2
    err = capsys.readouterr().err
    assert "unknown arch 'sm99'" in err and "sm80, sm86, sm89, sm90, sm100, sm120" in err


def test_unknown_tile_lists_known_ones(capsys):
    assert lab_main(["tune", "--arch", "sm90", "--tile", "no_such_tile", "--compile-only"]) == 2
    assert "unknown tile 'no_such_tile'" in capsys.readouterr().err


def test_timing_a_mismatched_arch_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(arch_mod, "detect", lambda: get_arch("sm80"))
    with pytest.raises(ArchError, match="asked to time for sm90 but the GPU present is sm80"):
        tune([toys.ScaleToy()], _opts(tmp_path, require_gpu=True))


def test_bad_storage_trials_and_replay_errors(tmp_path):
    with pytest.raises(TuneError, match="not an Optuna storage URL"):
        tune([toys.ScaleToy()], _opts(tmp_path, storage="results/tune.db"))
    with pytest.raises(TuneError, match="at least 1"):
        tune([toys.ScaleToy()], _opts(tmp_path, trials=0))
    with pytest.raises(TuneError, match="--shapes"):
        tune([toys.ScaleToy()], _opts(tmp_path), shapes="huge")
    with pytest.raises(TuneError, match="--rematch -1"):
        tune([toys.ScaleToy()], _opts(tmp_path, rematch_rounds=-1))
    with pytest.raises(TuneError, match="no study 'missing'"):
        replay(f"sqlite:///{tmp_path / 'empty.db'}", "missing")


# --- GPU ---------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_fault_injection_real_kernels(tmp_path):
    """A real illegal memory access, a hang, a wrong kernel and a failed build: each recorded, the study picks a correct winner."""
    present = arch_mod.detect()
    opts = _opts(
        tmp_path, arch=present, trials=7, evaluator="tuning.workers:evaluate_on_gpu", require_gpu=True, trial_timeout_s=25, compile_jobs=4
    )
    [summary] = tune([toys.FaultToy()], opts)
    modes = _by_mode(_study(opts, summary.study))
    outcomes = {m: t.user_attrs["outcome"] for m, t in modes.items()}
    assert outcomes == {
        "good_fast": "ok",
        "good_slow": "ok",
        "compile_error": "compile_error",
        "fault": "runtime_fault",
        "hang": "timeout",
        "wrong": "wrong_result",
        "invalid": "invalid",
    }, {m: t.user_attrs.get("message") for m, t in modes.items()}
    assert summary.best.params["mode"] in ("good_fast", "good_slow") and summary.best.user_attrs["error"] <= 1e-6
    # the GPU worker found the pool's kernels in TileLang's disk cache instead of compiling again
    ok = [t for t in modes.values() if t.user_attrs["outcome"] == "ok"]
    assert all(t.user_attrs["load_s"] < t.user_attrs["compile_s"] for t in ok)


def test_configs_pruned_by_constraints_do_not_use_the_budget(tmp_path):
    """sm89's shared memory rejects many ScaleToy configs: the study still measures --trials configs."""
    opts = _opts(tmp_path, arch=get_arch("sm89"), trials=8)
    [summary] = tune([toys.ScaleToy()], opts, shapes="decode")
    trials = _study(opts, summary.study).get_trials()
    assert any(t.user_attrs.get("outcome") == "invalid" for t in trials)
    assert sum(uses_budget(t) for t in trials) == 8


def test_gpu_workers_stay_inside_the_visible_gpus(monkeypatch):
    """``CUDA_VISIBLE_DEVICES=2,3 lab tune --workers 2`` runs on GPUs 2 and 3, not 0 and 1."""
    from tuning.workers import visible_gpus

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 3")
    assert visible_gpus(2) == ["2", "3"] and visible_gpus(1) == ["2"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-7468b308")
    assert visible_gpus(1) == ["GPU-7468b308"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert visible_gpus(2) == ["0", "1"]


def test_closing_a_worker_pool_lets_idle_workers_exit_and_kills_busy_ones():
    """WorkerPool.close() ends an idle worker by closing its pipe, so it exits normally (exit code 0): a killed worker
    left the semaphores it held (tqdm's lock, made when TileLang logs a compile) to multiprocessing's resource
    tracker, which warned about them when `lab tune` exited. A worker still busy past the grace time is killed."""
    from tuning.workers import IsolatedWorker, WorkerPool

    idle, busy = IsolatedWorker("idle"), IsolatedWorker("busy")
    assert idle.call("os:getpid", (), 60) > 0
    busy.call("os:getpid", (), 60)
    idle_proc, busy_proc = idle._proc, busy._proc
    busy._conn.send(("time:sleep", (60,)))  # a task the close will not wait for
    WorkerPool([idle]).close()
    busy.stop(grace_s=0.5)
    assert idle_proc.exitcode == 0 and busy_proc.exitcode == -signal.SIGKILL
