"""The GPU session's queued specs are valid on the CPU: a typo must not cost a device call.

Device time is scarce (one batched call per session), so every ``TILE:SHAPE[:CONFIG_JSON]`` that
``gpu/session.sh`` hands to ``gpu/profile_tiles.py`` is parsed, validated (tile, shape, config keys) and checked
against the tile's constraints for sm90 here, with the config merged over the default as the profiler does.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tiles.arch import get_arch
from tiles.registry import all_tiles, get_tile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "gpu"))

import profile_tiles  # gpu/ is not a package: imported from the path above
import sparse_attn_check

# The phases whose profile lists are parsed: ``profile`` (its default list) always, ``queued`` (the next session's
# list, when one is written) where gpu/session.sh defines it.
PROFILE_PHASES = ("profile", "queued")
REQUIRED_PHASES = ("profile",)


def _phase_bodies() -> dict[str, str]:
    """The bodies of the phases in PROFILE_PHASES that gpu/session.sh defines (a required one missing is an error)."""
    text = (ROOT / "gpu" / "session.sh").read_text()
    bodies = {}
    for phase in PROFILE_PHASES:
        m = re.search(rf"^phase_{phase}\(\) {{.*?^}}", text, re.DOTALL | re.MULTILINE)
        if m:
            bodies[phase] = m.group(0)
        elif phase in REQUIRED_PHASES:
            raise AssertionError(f"gpu/session.sh has no phase_{phase}")
    return bodies


def _specs(body: str) -> list[str]:
    """Every TILE:SHAPE[:JSON] token of a phase body."""
    names = "|".join(sorted(all_tiles(), key=len, reverse=True))
    return [m.group(0) for m in re.finditer(rf"\b(?:{names}):[a-z0-9_]+(?::\{{[^'\s]*\}})?", body)]


BODIES = _phase_bodies()
SPECS = [spec for body in BODIES.values() for spec in _specs(body)]


def test_the_session_has_profile_specs():
    # the default profile list's 9 specs (the pattern also reads the example in the phase's comment): it finds them
    assert len(_specs(BODIES["profile"])) >= 9
    # a queued phase that hands the profiler a list: the pattern finds at least one spec in it
    if "PROFILE_ARGS" in BODIES.get("queued", ""):
        assert _specs(BODIES["queued"])


@pytest.mark.parametrize("text", SPECS)
def test_session_profile_spec_is_valid_for_sm90(text):
    spec = profile_tiles.parse_spec(text)
    profile_tiles.validate([spec])
    tile, arch = get_tile(spec.tile), get_arch("sm90")
    config = tile.with_defaults(arch, spec.config)
    assert tile.search_space(arch).violations(config, tile.shape(spec.shape), arch) == [], text


@pytest.mark.parametrize("row", sparse_attn_check.CHECKS, ids=lambda r: f"{r[0]}-{r[1] if isinstance(r[1], str) else r[1][0]}-{r[2]}")
def test_attention_check_row_is_valid_for_sm90(row):
    """Every (tile, shape, label) gpu/sparse_attn_check.py compiles, checks and times: the label exists and its
    config, merged over the default as the script does, passes sm90's constraints at that shape."""
    tile_name, spec, label = row
    tile, arch = get_tile(tile_name), get_arch("sm90")
    config = tile.with_defaults(arch, sparse_attn_check._override(tile_name, label))
    assert tile.search_space(arch).violations(config, sparse_attn_check._shape(tile, spec), arch) == [], row


def _attn_labels(text: str) -> set[str]:
    """The attention labels a session.sh text names as ATTN_LABELS defaults (``ATTN_LABELS=...`` or ``${ATTN_LABELS:-...}``)."""
    return {label for m in re.finditer(r"ATTN_LABELS(?::-|=)([a-z0-9_,]+)", text) for label in m.group(1).split(",")}


def test_session_attention_labels_exist():
    """The attention labels gpu/session.sh names (ATTN_LABELS defaults in its phases) are labels of the check script."""
    # the pattern reads both forms (a session may name none: the attn phase then runs every label)
    assert _attn_labels("ATTN_LABELS=${ATTN_LABELS:-default,bi32} phase_attn") == {"default", "bi32"}
    named = _attn_labels((ROOT / "gpu" / "session.sh").read_text())
    assert named <= set(sparse_attn_check.LABELS), named - set(sparse_attn_check.LABELS)


def test_ncu_roles_cuts_a_flat_kernel_at_its_barriers(tmp_path, capsys, monkeypatch):
    """``gpu/ncu_roles.py --cut barrier`` (how session 9 split the compressor's samples into its phases): a segment
    ends with its BAR, and each prints its share of the samples and of the executed instructions and its commonest
    opcodes weighted by executions."""
    import ncu_roles

    head = '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_long_sb","stall_wait"'
    lines = [
        ("0x10", "MUFU.EX2 R1, R2", 30, 100, 20, 10),
        ("0x20", "@!P0 LDG.E.128 R4, desc[UR4][R2.64]", 10, 100, 10, 0),
        ("0x30", "BAR.SYNC.DEFER_BLOCKING 0x0", 0, 100, 0, 0),
        ("0x40", "HMMA.1688.F32.TF32 R8, R4, R2, R8", 60, 600, 0, 60),
        ("0x50", "EXIT", 0, 100, 0, 0),
    ]
    csv_path = tmp_path / "sass.csv"
    csv_path.write_text('"Kernel Name","k",\n' + head + "\n" + "\n".join(",".join(f'"{v}"' for v in r) for r in lines) + "\n")
    monkeypatch.setattr(sys, "argv", ["ncu_roles.py", str(csv_path), "--cut", "barrier", "--top", "0"])
    assert ncu_roles.main() == 0
    out = capsys.readouterr().out
    assert "100 samples, 1000 warp instructions executed" in out
    assert "(3 lines): 40.0% of samples, 30.0% of instructions (MUFU 33%, LDG 33%, BAR 33%) | long_sb 75%, wait 25%" in out
    assert "(2 lines): 60.0% of samples, 70.0% of instructions (HMMA 86%, EXIT 14%) | wait 100%" in out


def test_ncu_roles_compares_two_exports_role_by_role(tmp_path, capsys, monkeypatch):
    """``gpu/ncu_roles.py A --against B`` (session 16: the attention default against its producer alone): per role
    (cut at each setmaxnreg) both sample counts, the change, and each stall reason's change with its share of the
    growth, largest first; exports with different role layouts are refused."""
    import ncu_roles

    head = '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_long_sb","stall_not_selected"'

    def export(name, rows):
        path = tmp_path / name
        body = "\n".join(",".join(f'"{v}"' for v in r) for r in rows)
        path.write_text('"Kernel Name","k",\n' + head + "\n" + body + "\n")
        return path

    a = export(
        "a.csv",
        [
            ("0x10", "S2R R0, SR_TID.X", 2, 8, 2, 0),
            ("0x20", "USETMAXREG.DEALLOC.CTAPOOL 0x60", 0, 4, 0, 0),
            ("0x30", "LDG.E.128 R4, desc[UR4][R2.64]", 150, 40, 120, 30),
        ],
    )
    b = export(
        "b.csv",
        [
            ("0x10", "S2R R0, SR_TID.X", 2, 8, 2, 0),
            ("0x20", "USETMAXREG.DEALLOC.CTAPOOL 0x60", 0, 4, 0, 0),
            ("0x30", "LDG.E.128 R4, desc[UR4][R2.64]", 100, 40, 100, 0),
        ],
    )
    monkeypatch.setattr(sys, "argv", ["ncu_roles.py", str(a), "--against", str(b)])
    assert ncu_roles.main() == 0
    out = capsys.readouterr().out
    assert "== USETMAXREG.DEALLOC.CTAPOOL 0x60: A 150 samples, B 100 (+50, +50%)" in out
    producer = out[out.index("== USETMAXREG") :]
    assert producer.index("not_selected") < producer.index("long_sb")  # +30 before +20
    assert "+30     60% of the change" in out and "+20     40% of the change" in out
    flat = export("c.csv", [("0x10", "S2R R0, SR_TID.X", 2, 8, 2, 0)])
    with pytest.raises(SystemExit, match="not the same kernel layout"):
        ncu_roles.compare(a, flat)


def test_determinism_probe_parses_its_cases_and_needs_a_gpu(capsys):
    """gpu/determinism_probe.py: 'tile:shape[:json]' cases parse (a bad one stops the script before any device time is
    spent), and without a CUDA GPU it exits with status 2 and says so."""
    import determinism_probe

    assert determinism_probe._parse_case('sparse_attn_decode:decode_b64_s1:{"n_split": 2}') == (
        "sparse_attn_decode",
        "decode_b64_s1",
        {"n_split": 2},
    )
    assert determinism_probe._parse_case("indexer_topk:decode_b1_n8k") == ("indexer_topk", "decode_b1_n8k", {})
    with pytest.raises(SystemExit, match="tile:shape"):
        determinism_probe._parse_case("sparse_attn_decode")
    if not __import__("torch").cuda.is_available():
        assert determinism_probe.main(["--case", "indexer_topk:decode_b1_n8k"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err


def test_determinism_probe_counts_the_runs_that_differ(monkeypatch):
    """probe() on a fake tile whose output drifts from its fifth launch: of 8 runs, 4 differ from the first, by 0.5,
    and the worst one is what is compared with the reference."""
    import determinism_probe
    import test_harness

    import tiles.arch
    import tiles.registry

    tile = test_harness.CountingTile(flip_at=5)
    tile.shape = lambda name: test_harness.SHAPE
    tile.with_defaults = lambda arch, override: dict(override)
    tile.build = lambda shape, config, arch: object()
    monkeypatch.setattr(tiles.registry, "get_tile", lambda name: tile)
    monkeypatch.setattr(tiles.arch, "detect", lambda: get_arch("sm90"))
    row = determinism_probe.probe("toy_counting", "n64", {}, runs=8, seed=0)
    assert row["runs_differing_from_first"] == 4 and row["max_abs_diff_between_runs"] == 0.5
    assert row["first_vs_reference"]["error"] == 0.0 and row["worst_vs_reference"]["error"] == 0.5


@pytest.mark.parametrize(
    "script, flag, message",
    [
        ("attn_ablation.py", "--variants", "unknown ['no_such_cut']"),
        ("attn_block_scaling.py", "--variants", "unknown variants ['no_such_cut']"),
        ("attn_prefill_lengths.py", "--labels", "unknown labels ['no_such_cut']"),
    ],
)
def test_attention_timing_scripts_refuse_an_unknown_variant_before_asking_for_a_gpu(script, flag, message):
    import subprocess

    res = subprocess.run(
        [sys.executable, str(ROOT / "gpu" / script), flag, "default,no_such_cut"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert res.returncode == 2 and message in res.stderr


@pytest.mark.parametrize("tile_name", ["sparse_attn_prefill", "sparse_attn_bf16"])
def test_prefill_lengths_span_every_choice_of_io_auto(tile_name):
    """gpu/attn_prefill_lengths.py's default lengths cover each choice io="auto" makes on the H200 (staged, overlapped
    with 2, 4 and 8 tokens per CTA: tiles.sparse_attn.policy._io_cost); the staged wg0_scores labels are valid at every length, the
    overlapped and paired_halves ones wherever the call's rows are bf16 (the FP4 prefill gathers below 512 tokens)."""
    import attn_prefill_lengths as apl

    tile, sm90 = get_tile(tile_name), get_arch("sm90")
    chosen = set()
    for s in apl.LENGTHS:
        shape = apl.shape_at(s)
        resolved = tile.resolve_call(tile.with_defaults(sm90, {}), shape.dims, sm90)
        chosen.add((resolved["io"], resolved["tokens_per_cta"]))
        bf16_rows = tile.kv_format == "bf16" or resolved["kv_staging"] == "expand"
        valid = {label for label in apl.LABELS if apl._refusal(tile_name, s, label, "sm90") is None}
        assert valid == (set(apl.LABELS) if bf16_rows else {"default", "wg0", "staged1", "staged4"}), s
    assert chosen == {("staged", 1), ("overlapped", 2), ("overlapped", 4), ("overlapped", 8)}


def test_unstarted_tests_lists_only_the_deadline_skips(tmp_path):
    import unstarted_tests  # gpu/ is on the path (above)

    junit = tmp_path / "run.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_sparse_attn" name="test_a[x y-1]">'
        '<skipped type="pytest.skip" message="--deadline 340 s passed before this test started"/></testcase>'
        '<testcase classname="tests.test_sparse_attn" name="test_b"><skipped message="needs a CUDA GPU"/></testcase>'
        '<testcase classname="tests.test_indexer" name="test_c"/>'
        "</testsuite></testsuites>"
    )
    assert unstarted_tests.unstarted_ids(junit) == ["tests/test_sparse_attn.py::test_a[x y-1]"]
    with pytest.raises(SystemExit, match="cannot read junit"):
        unstarted_tests.unstarted_ids(tmp_path / "missing.xml")


def test_unstarted_tests_adds_the_collected_ids_a_cut_off_run_never_reported(tmp_path, capsys):
    """A run interrupted at its limit has no junit entry for the tests still queued: --collected names them too,
    after the deadline skips, and leaves out what the file reports (run, or skipped for another reason)."""
    import unstarted_tests

    junit = tmp_path / "run.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_compressor" name="test_a[x]">'
        '<skipped message="--deadline 250 s passed before this test started"/></testcase>'
        '<testcase classname="tests.test_compressor" name="test_b"/>'
        '<testcase classname="tests.test_compressor" name="test_c"><skipped message="needs sm_90a"/></testcase>'
        '<testcase classname="" name="internal"><error message="KeyboardInterrupt"/></testcase>'
        "</testsuite></testsuites>"
    )
    collected = tmp_path / "collected.txt"
    ids = ["tests/test_compressor.py::" + n for n in ("test_b", "test_a[x]", "test_c", "test_d[one two]")]
    collected.write_text("\n".join(ids) + "\n\n4/9 tests collected (5 deselected) in 1.0s\n")
    assert unstarted_tests.main([str(junit), "--collected", str(collected)]) == 0
    out = capsys.readouterr()
    assert out.out.splitlines() == ["tests/test_compressor.py::test_a[x]", "tests/test_compressor.py::test_d[one two]"]
    assert "1 collected and not reported at all" in out.err
    with pytest.raises(SystemExit, match="cannot read the collected ids"):
        unstarted_tests.main([str(junit), "--collected", str(tmp_path / "missing.txt")])


def test_compressor_ablation_refuses_an_unknown_variant_before_asking_for_a_gpu():
    import subprocess

    res = subprocess.run(
        [sys.executable, str(ROOT / "gpu" / "compressor_ablation.py"), "prefill_r2_s64k", "{}", "--variants", "base,no_such_cut"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert res.returncode == 2 and "unknown variants ['no_such_cut']" in res.stderr


def test_the_projection_ablations_find_the_three_products_they_cut():
    """gpu/compressor_ablation.py's proj_x1 / proj_none rewrite the f16x3 projection's three MMA lines: proj_x1 keeps
    only the hi x hi one, proj_none none, and an emptied line keeps its loop (the enclosing m loop has no braces, so
    deleting the line would hand it the next statement). A source without exactly three is refused."""
    import compressor_ablation as ca

    import tiles.compressor.kernel as kernel_mod

    for name in ca.PROJ_SOURCES:
        src = getattr(kernel_mod, name)
        assert src.count(") csa2_mma_f16(") == 3
        x1 = ca.cut_projection_products(src, keep_hi=True, name=name)
        assert x1.count(") csa2_mma_f16(") == 1 and x1.count("for (int n = 0; n < NT; ++n) {}") == 2
        assert "csa2_mma_f16(acc[m][n], ah[" in x1  # the hi x hi product is the one kept
        none = ca.cut_projection_products(src, keep_hi=False, name=name)
        assert none.count(") csa2_mma_f16(") == 0 and none.count("for (int n = 0; n < NT; ++n) {}") == 3
    with pytest.raises(RuntimeError, match="found 0 MMA lines"):
        ca.cut_projection_products("no projection here", keep_hi=True)


def test_the_score_store_ablation_guards_both_stores_of_the_fused_epilogue():
    """gpu/score_ablation.py's no_store guards each of the fused epilogue's two score stores, and only those."""
    import score_ablation as sa

    from tiles.indexer import dequant, score_kernel

    original_pair, original_epi = dequant._PRMT_PAIR_CUDA, score_kernel._FUSED_EPI_CUDA
    try:
        sa._use_kernel(False, True, original_pair, original_epi)
        epi = score_kernel._FUSED_EPI_CUDA
        assert epi.count(sa._NO_STORE_GUARD) == 2 and epi.count("out[off + row] =") == 2
        assert all(epi.count(g) == 0 for g in sa._STORE_GUARDS)
        assert score_kernel._PRMT_PAIR_CUDA == original_pair
    finally:
        sa._use_kernel(False, False, original_pair, original_epi)
    assert score_kernel._FUSED_EPI_CUDA == original_epi
