"""tiles.core.config_store: nearest-bucket lookup, default fallback, clear errors for corrupt or foreign files; tuning.export writes atomically."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import yaml
from test_tuning_toys import ScaleToy

from tiles.core.arch import get_arch
from tiles.core.config_store import SCHEMA, ResultsError, config_for, load_winner, results_path
from tiles.core.contract import Constraint, SearchSpace, Shape
from tuning.export import export_results

SM90 = get_arch("sm90")
ENV = {"date": "2026-01-01T00:00:00Z", "gpu": "test", "torch": "x"}


def _summary(shape: str, config: dict, ms: float, default_ms: float, default: dict | None = None):
    """A tuning.study.StudySummary stand-in; ``default``: the default config the study timed."""
    best = SimpleNamespace(params=config, user_attrs={"ms": ms, "tflops": None, "gbps": 100.0})
    return SimpleNamespace(
        shape=shape,
        best=best,
        best_ms=ms,
        default_ms=default_ms,
        speedup=default_ms / ms,
        trials=9,
        outcomes={"ok": 9},
        study="s",
        default=default,
    )


@pytest.fixture
def written(tmp_path):
    toy = ScaleToy()
    cfg = {"block": 256, "schedule": "ws", "stages": 3}
    summary = _summary("decode_n4k", cfg, 1.0, 1.5, toy.default_config(SM90))
    path = export_results(toy, SM90, [summary], "lab tune --arch sm90", tmp_path, environment=ENV)
    return toy, tmp_path, path, cfg


def test_export_round_trip_and_nearest_bucket(written):
    toy, root, path, cfg = written
    assert path == results_path("toy_scale", "sm90", "test", root)
    data = yaml.safe_load(path.read_text())
    assert data["schema"] == SCHEMA and data["environment"]["command"] == "lab tune --arch sm90"
    assert data["shapes"]["decode_n4k"]["speedup"] == 1.5
    # N=8192 is nearest to the stored N=4096 bucket
    config, source = load_winner("toy_scale", SM90, Shape("other", "decode", {"N": 8192}), default=toy.default_config(SM90), root=root)
    assert config == cfg and source == f"tuned:{path}#decode_n4k"
    # 64x away is too far for a winner to be evidence: the default runs there
    far = Shape("far", "decode", {"N": 4096 * 64})
    assert load_winner("toy_scale", SM90, far, default=toy.default_config(SM90), root=root) == (toy.default_config(SM90), "default")


def test_sources_in_the_labs_results_are_repo_relative(written, monkeypatch):
    """A winner from the lab's own results/ is named repo-relative (sources land in JSON reports: no checkout path)."""
    toy, root, _, cfg = written
    from tiles.core import config_store as results

    monkeypatch.setattr(results, "RESULTS_DIR", root)  # as if root were <repo>/results
    config, source = load_winner("toy_scale", SM90, toy.shapes()[0], default=toy.default_config(SM90), root=root)
    assert config == cfg and source == f"tuned:{root.name}/sm90/tuned/test/toy_scale.yaml#decode_n4k"


def test_default_when_no_file_or_no_comparable_bucket(written, tmp_path):
    toy, root, _, _ = written
    default = toy.default_config(SM90)
    assert load_winner("toy_scale", "sm100", Shape("x", "decode", {"N": 1}), default=default, root=root) == (default, "default")
    assert load_winner("toy_scale", SM90, Shape("x", "decode", {"M": 1}), default=default, root=root) == (default, "default")


def test_config_for_reads_CSA2_RESULTS_DIR(written, monkeypatch):
    toy, root, path, cfg = written
    monkeypatch.setenv("CSA2_RESULTS_DIR", str(root))
    assert config_for(toy, toy.shapes()[0], SM90) == (cfg, f"tuned:{path}#decode_n4k")


def test_export_merges_buckets(written):
    toy, root, path, cfg = written
    other = {"block": 128, "schedule": "serial", "stages": 1}
    export_results(toy, SM90, [_summary("prefill_n1m", other, 2.0, 2.0)], "lab tune", root, environment=ENV)
    shapes = yaml.safe_load(path.read_text())["shapes"]
    assert shapes["decode_n4k"]["config"] == cfg and shapes["prefill_n1m"]["config"] == other


def test_merged_entries_keep_their_own_run(written):
    """The file-level environment is the latest run's: each entry carries the date and command that made it."""
    toy, root, path, _ = written
    later = {**ENV, "date": "2026-02-02T00:00:00Z"}
    other = {"block": 128, "schedule": "serial", "stages": 1}
    export_results(toy, SM90, [_summary("prefill_n1m", other, 2.0, 2.0)], "lab tune --later", root, environment=later)
    data = yaml.safe_load(path.read_text())
    assert data["environment"]["date"] == later["date"]
    assert (data["shapes"]["decode_n4k"]["date"], data["shapes"]["decode_n4k"]["command"]) == (ENV["date"], "lab tune --arch sm90")
    assert (data["shapes"]["prefill_n1m"]["date"], data["shapes"]["prefill_n1m"]["command"]) == (later["date"], "lab tune --later")


def test_export_is_atomic(written, monkeypatch):
    toy, root, path, _ = written
    before = path.read_text()

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        export_results(
            toy, SM90, [_summary("decode_n4k", {"block": 64, "schedule": "ws", "stages": 1}, 0.5, 1.5)], "x", root, environment=ENV
        )
    assert path.read_text() == before
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left behind


@pytest.mark.parametrize(
    "text, match",
    [
        pytest.param("shapes: [unclosed", "corrupt", id="not-yaml"),
        pytest.param("- a list", "corrupt", id="not-a-mapping"),
        pytest.param("schema: other/v9\ntile: toy_scale\narch: sm90\nshapes: {}", "schema", id="foreign-schema"),
        pytest.param(f"schema: {SCHEMA}\ntile: another_tile\narch: sm90\nshapes: {{}}", "another_tile", id="foreign-tile"),
        pytest.param(f"schema: {SCHEMA}\ntile: toy_scale\narch: sm80\nshapes: {{}}", "sm80", id="foreign-arch"),
        pytest.param(f"schema: {SCHEMA}\ntile: toy_scale\narch: sm90\nshapes: {{a: {{ms: 1}}}}", "config", id="entry-without-config"),
    ],
)
def test_bad_file_errors_name_the_file(tmp_path, text, match):
    path = results_path("toy_scale", "sm90", "test", tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(text)
    with pytest.raises(ResultsError, match=match) as info:
        load_winner("toy_scale", "sm90", Shape("x", "decode", {"N": 1}), default={}, root=tmp_path)
    assert str(path) in str(info.value)


def test_stale_config_is_refused(written, monkeypatch):
    toy, root, path, _ = written
    data = yaml.safe_load(path.read_text())
    data["shapes"]["decode_n4k"]["config"]["block"] = 1024  # no longer a choice
    path.write_text(yaml.safe_dump(data))
    os.utime(path, ns=(1, 1))  # a different mtime, so the cached parse is not reused
    monkeypatch.setenv("CSA2_RESULTS_DIR", str(root))
    with pytest.raises(ResultsError, match="no longer accepts"):
        config_for(toy, toy.shapes()[0], SM90)


class ShapeBoundToy(ScaleToy):
    """ScaleToy whose ``ws`` schedule needs N >= 4096: a constraint that depends on the shape."""

    def search_space(self, arch):
        small = Constraint("ws_needs_n4k", lambda c, s, a: "ws needs N >= 4096" if c["schedule"] == "ws" and s["N"] < 4096 else None)
        space = super().search_space(arch)
        return SearchSpace(space.params, (*space.constraints, small))


def test_a_winner_that_does_not_apply_to_a_nearby_shape_gives_the_default(tmp_path):
    """A winner valid where it was tuned but refused at a nearby shape (the constraint depends on the shape) is not
    evidence there: the default runs and the source says why. The same config refused at its own bucket's shape
    is a stale file and raises."""
    toy = ShapeBoundToy()
    winner = {"block": 256, "schedule": "ws", "stages": 3}
    path = export_results(toy, SM90, [_summary("decode_n4k", winner, 1.0, 1.5, toy.default_config(SM90))], "x", tmp_path, environment=ENV)
    near = Shape("decode_n2k", "decode", {"N": 2048})  # distance 1: within the transfer distance
    config, source = load_winner(toy.name, SM90, near, default=toy.default_config(SM90), root=tmp_path, tile=toy)
    assert config == toy.default_config(SM90)
    assert source == f"default (tuned:{path}#decode_n4k does not apply to decode_n2k: ws_needs_n4k: ws needs N >= 4096)"
    at_its_shape = load_winner(toy.name, SM90, toy.shapes()[0], default=toy.default_config(SM90), root=tmp_path, tile=toy)
    assert at_its_shape == (winner, f"tuned:{path}#decode_n4k")
    data = yaml.safe_load(path.read_text())
    data["shapes"]["decode_n4k"]["dims"]["N"] = 1024  # now refused at its own bucket's shape: the file is stale
    path.write_text(yaml.safe_dump(data))
    os.utime(path, ns=(2, 2))
    with pytest.raises(ResultsError, match="no longer accepts"):
        load_winner(toy.name, SM90, near, default=toy.default_config(SM90), root=tmp_path, tile=toy)


def test_unknown_arch_lists_known_ones():
    with pytest.raises(ValueError, match="sm80, sm86, sm89, sm90, sm100, sm120"):
        load_winner("toy_scale", "sm99", Shape("x", "decode", {}), default={})


def test_a_winner_tuned_before_a_new_option_is_stale(tmp_path):
    """A stored config that lacks a parameter of the tile's current search space won nothing over that
    parameter: the default runs instead and the source says why; the tuner may still seed with it."""
    from tiles.core.registry import get_tile

    tile = get_tile("sparse_attn_decode")
    # a winner from before `produce` existed (and the later `io`, `ptxas_level`): a pipelined schedule
    old = {k: v for k, v in tile.default_config(SM90).items() if k not in ("produce", "io", "ptxas_level")}
    # the ws producer's prmt decode and the ws consumers' bf16 split partials do not exist there
    old |= {"schedule": "pipelined", "fp4_decode": "fma", "partials": "fp32"}
    summary = _summary("decode_b64_s1", old, 0.2, 0.3, tile.default_config(SM90))
    export_results(tile, SM90, [summary], "lab tune --arch sm90", tmp_path, environment=ENV)
    shape = tile.shape("decode_b64_s1")
    config, source = load_winner(tile.name, SM90, shape, root=tmp_path)
    assert config == tile.default_config(SM90)
    assert source.startswith("default (stale:") and "predates io, produce, ptxas_level" in source
    assert load_winner(tile.name, SM90, shape, root=tmp_path, allow_stale=True)[0] == old


@pytest.mark.parametrize("timed_against", ["current", "another", "unrecorded"])
def test_a_winner_timed_against_another_default_is_stale(tmp_path, timed_against):
    """A winner beat the default of its day; once the default changes (or the entry predates recording it) it has
    not been shown to beat the current one: the default runs, and the source says why."""
    from tiles.core.registry import get_tile

    tile = get_tile("fp4_quant_main")
    shape = tile.shapes()[0]
    winner = {**tile.default_config(SM90), "threads": 128}
    timed = {"current": tile.default_config(SM90), "another": {**tile.default_config(SM90), "threads": 512}, "unrecorded": None}
    summary = _summary(shape.name, winner, 1.0, 1.5, timed[timed_against])
    export_results(tile, SM90, [summary], "lab tune", tmp_path, environment=ENV)
    config, source = load_winner(tile.name, SM90, shape, root=tmp_path)
    if timed_against == "current":
        assert config == winner and source.startswith("tuned:")
    else:
        assert config == tile.default_config(SM90)
        assert source.startswith("default (stale:") and "predates the current default" in source
    stored = yaml.safe_load(results_path(tile.name, "sm90", "test", tmp_path).read_text())["shapes"][shape.name]
    assert stored["default_config"] == timed[timed_against]


def test_winners_are_kept_per_gpu_model(tmp_path):
    """Tuning on an H100 writes the H100's file and leaves the H200's alone; a call on each model gets its own winner,
    a model of the same family with none gets its family's (then any model of the arch), each source naming the file
    and, when borrowed, the model it was tuned on."""
    toy = ScaleToy()
    h200_cfg, h100_cfg = {"block": 256, "schedule": "ws", "stages": 3}, {"block": 512, "schedule": "ws", "stages": 2}
    h200 = export_results(toy, SM90, [_summary("decode_n4k", h200_cfg, 1.0, 1.5)], "c", tmp_path, environment={**ENV, "gpu": "NVIDIA H200"})
    before = h200.read_text()
    h100 = export_results(
        toy, SM90, [_summary("decode_n4k", h100_cfg, 1.0, 1.2)], "c", tmp_path, environment={**ENV, "gpu": "NVIDIA H100 80GB HBM3"}
    )
    assert h200 == tmp_path / "sm90" / "tuned" / "h200" / "toy_scale.yaml" and h200.read_text() == before
    assert h100 == tmp_path / "sm90" / "tuned" / "h100-80gb-hbm3" / "toy_scale.yaml"
    shape, default = toy.shapes()[0], toy.default_config(SM90)

    def winner(gpu):
        return load_winner("toy_scale", SM90, shape, default=default, root=tmp_path, gpu=gpu)

    assert winner("NVIDIA H200") == (h200_cfg, f"tuned:{h200}#decode_n4k")
    assert winner("NVIDIA H100 80GB HBM3") == (h100_cfg, f"tuned:{h100}#decode_n4k")
    assert winner("NVIDIA H100 PCIe") == (h100_cfg, f"tuned:{h100}#decode_n4k (nearest GPU: h100-80gb-hbm3)")
    assert winner("NVIDIA GH200 480GB") == (h100_cfg, f"tuned:{h100}#decode_n4k (nearest GPU: h100-80gb-hbm3)")
    h100.unlink()
    assert winner("NVIDIA H100 PCIe") == (h200_cfg, f"tuned:{h200}#decode_n4k (nearest GPU: h200)")
    assert load_winner("toy_scale", get_arch("sm100"), shape, default=default, root=tmp_path, gpu="NVIDIA B200") == (default, "default")


def test_an_installed_package_finds_its_shipped_configs(tmp_path, monkeypatch):
    """Outside a source tree, the tuned configs come from the package's data (``csa2_lab_results``), behind the
    user's own results tree."""
    from tiles.core import config_store

    toy = ScaleToy()
    shipped = tmp_path / "site" / "csa2_lab_results"
    cfg = {"block": 256, "schedule": "ws", "stages": 3}
    export_results(toy, SM90, [_summary("decode_n4k", cfg, 1.0, 1.5)], "c", shipped, environment={**ENV, "gpu": "NVIDIA H200"})
    monkeypatch.setattr(config_store, "RESULTS_DIR", tmp_path / "no-checkout" / "results")
    monkeypatch.setattr(config_store, "packaged_dir", lambda: shipped)
    monkeypatch.delenv("CSA2_RESULTS_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    assert config_store.results_dir() == tmp_path / "results"
    assert config_store.tuned_roots() == [tmp_path / "results", shipped]
    monkeypatch.setenv("CSA2_RESULTS_DIR", str(tmp_path / "mine"))
    assert config_store.tuned_roots() == [tmp_path / "mine"]  # an explicit tree hides the shipped configs
    monkeypatch.delenv("CSA2_RESULTS_DIR")
    config, source = load_winner("toy_scale", SM90, toy.shapes()[0], default=toy.default_config(SM90), gpu="NVIDIA H200")
    assert config == cfg and source == "tuned:csa2_lab_results/sm90/tuned/h200/toy_scale.yaml#decode_n4k"
