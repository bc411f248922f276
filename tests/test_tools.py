"""The tools of tools/ (a GPU session runner and the probes a user runs on a GPU machine): their parsing, their
arithmetic and their refusals, on the CPU; and the session runner names only tools and lab commands that exist."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from lab.cli import build_parser
from tiles.core.arch import get_arch
from tiles.core.registry import get_tile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import profile_tiles  # tools/ is not a package: imported from the path above

SESSION = (ROOT / "tools" / "gpu_session.sh").read_text()


def test_the_session_runs_only_lab_commands_and_tools_that_exist():
    """Every `$LAB <command>` of tools/gpu_session.sh is a lab subcommand and every `python3 tools/X.py` a file there."""
    commands = set(build_parser()._subparsers._group_actions[0].choices)
    used = set(re.findall(r"\$LAB ([a-z0-9]+)", SESSION))
    assert used and used <= commands, used - commands
    scripts = set(re.findall(r"python3 (tools/[a-z_]+\.py)", SESSION))
    assert scripts and all((ROOT / s).is_file() for s in scripts), scripts


@pytest.mark.parametrize(
    "text", ["indexer_topk:decode_b64_n128k", 'compressor:prefill_r2_s64k:{"main_pass": "in_pool", "norm_pass": "in_pool"}']
)
def test_profile_specs_parse_and_validate(text):
    spec = profile_tiles.parse_spec(text)
    profile_tiles.validate([spec])
    tile, arch = get_tile(spec.tile), get_arch("sm90")
    config = tile.with_defaults(arch, spec.config)
    assert tile.search_space(arch).violations(config, tile.shape(spec.shape), arch) == [], text


def test_profile_specs_refuse_a_typo():
    with pytest.raises(SystemExit):
        profile_tiles.validate([profile_tiles.parse_spec("indexer_topk:decode_b64_n128")])


def test_ncu_roles_cuts_a_flat_kernel_at_its_barriers(tmp_path, capsys, monkeypatch):
    """``tools/ncu_roles.py --cut barrier`` (how the compressor's samples were split into its phases): a segment
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
    """``tools/ncu_roles.py A --against B`` (the attention default against its producer alone): per role
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
    """tools/determinism_probe.py: 'tile:shape[:json]' cases parse (a bad one stops the script before any device time is
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

    import tiles.core.arch
    import tiles.core.registry

    tile = test_harness.CountingTile(flip_at=5)
    tile.shape = lambda name: test_harness.SHAPE
    tile.with_defaults = lambda arch, override: dict(override)
    tile.build = lambda shape, config, arch: object()
    monkeypatch.setattr(tiles.core.registry, "get_tile", lambda name: tile)
    monkeypatch.setattr(tiles.core.arch, "detect", lambda: get_arch("sm90"))
    row = determinism_probe.probe("toy_counting", "n64", {}, runs=8, seed=0)
    assert row["runs_differing_from_first"] == 4 and row["max_abs_diff_between_runs"] == 0.5
    assert row["first_vs_reference"]["error"] == 0.0 and row["worst_vs_reference"]["error"] == 0.5


def test_unstarted_tests_lists_only_the_deadline_skips(tmp_path):
    import unstarted_tests  # tools/ is on the path (above)

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
