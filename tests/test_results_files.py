"""Results files that survive mistakes: every reader names the file and the key it cannot use (no traceback), no
report is rewritten before all inputs are read, writes keep normal file modes, concurrent writers merge, and a
corrupt file is moved aside, never dropped."""

from __future__ import annotations

import json
import multiprocessing
import os
import stat

import pytest
import yaml
from test_results import ENV, _summary

from lab.cli import main
from tiles.core.arch import get_arch
from tiles.core.config_store import SCHEMA, ResultsError, read_results, results_path
from tiles.core.registry import get_tile
from tuning.export import export_results

SM90 = get_arch("sm90")


def _winner_file(root, tile_name="fp4_quant_main", **config_changes):
    """A valid H200 results file of ``tile_name`` (its first shape), with ``config_changes`` over the winner."""
    tile = get_tile(tile_name)
    shape = tile.shapes()[0]
    config = {**tile.default_config(SM90), "threads": 128, **config_changes}
    entry = {"phase": shape.phase, "dims": dict(shape.dims), "config": config, "ms": 0.001, "default_ms": 0.002, "speedup": 2.0}
    entry["default_config"] = tile.default_config(SM90)
    doc = {"schema": SCHEMA, "tile": tile.name, "arch": "sm90", "environment": {"gpu": "NVIDIA H200"}, "shapes": {shape.name: entry}}
    path = results_path(tile.name, SM90, "NVIDIA H200", root)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc))
    return path, shape


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"colour": "red"}, "shapes.decode_b64.config.colour: not a parameter of fp4_quant_main"),
        ({"threads": "128"}, "shapes.decode_b64.config.threads: '128' is not one of"),
        ({"threads": 100}, "shapes.decode_b64.config.threads: 100 is not one of"),
    ],
    ids=["unknown_key", "wrong_type", "not_a_choice"],
)
def test_a_bad_entry_is_named_by_file_and_key(tmp_path, change, message):
    path, _ = _winner_file(tmp_path, **change)
    with pytest.raises(ResultsError, match=f"results file {path}: {message}"):
        read_results(path, "fp4_quant_main", SM90)


def test_a_bad_latency_is_named(tmp_path):
    path, shape = _winner_file(tmp_path)
    doc = yaml.safe_load(path.read_text())
    doc["shapes"][shape.name]["ms"] = "fast"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ResultsError, match=r"shapes.decode_b64.ms: 'fast' is not a positive number"):
        read_results(path, "fp4_quant_main", SM90)


CORRUPT = {
    "truncated": lambda text: text[: len(text) // 2] + "\n  - [",
    "not_yaml": lambda text: "{{{{ not yaml",
    "unknown_key": lambda text: text.replace("threads: 128", "threads: 128\n      colour: red"),
    "wrong_type": lambda text: text.replace("threads: 128", "threads: lots"),
}


@pytest.mark.parametrize("kind", list(CORRUPT))
def test_lab_report_names_a_bad_tuned_file_and_rewrites_nothing(tmp_path, capsys, kind):
    path, _ = _winner_file(tmp_path)
    (tmp_path / "sm90" / "tuning.md").write_text("old report\n")
    path.write_text(CORRUPT[kind](path.read_text()))
    assert main(["report", "--results", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"lab report: error: results file {path}") and "\n" not in err, err
    assert (tmp_path / "sm90" / "tuning.md").read_text() == "old report\n"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{", "not valid JSON"),
        ('{"schema": "other"}', "not a bench file of schema"),
        ('{"schema": "csa2-lab/bench/v2", "rows": [{"shape": "s"}]}', "each with its 'shape' and 'environment'"),
        ('{"schema": "csa2-lab/bench/v2", "rows": [{"shape": "s", "environment": {}, "ms": "quick"}]}', r"rows\[0\].ms is 'quick'"),
    ],
    ids=["truncated", "foreign", "no_environment", "wrong_type"],
)
def test_lab_report_names_a_bad_bench_file_and_rewrites_nothing(tmp_path, capsys, content, message):
    """A bad file of a later arch folder stops the report before the earlier folder's reports are rewritten."""
    _winner_file(tmp_path)
    (tmp_path / "sm90" / "tuning.md").write_text("old report\n")
    bad = tmp_path / "sm99" / "bench" / "fp4_quant_main.json"
    bad.parent.mkdir(parents=True)
    bad.write_text(content)
    assert main(["report", "--results", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"lab report: error: {bad}:") and "\n" not in err and __import__("re").search(message, err), err
    assert (tmp_path / "sm90" / "tuning.md").read_text() == "old report\n"


def test_written_files_have_normal_modes(tmp_path):
    from test_tuning_toys import ScaleToy

    old = os.umask(0o022)
    try:
        path = export_results(ScaleToy(), SM90, [_summary("decode_n4k", {"block": 256}, 1.0, 1.5)], "c", tmp_path, environment=ENV)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def _export_one(root: str, shape: str, block: int) -> None:
    from test_results import ENV, _summary
    from test_tuning_toys import ScaleToy

    from tuning.export import export_results

    root = __import__("pathlib").Path(root)
    for _ in range(20):  # many rounds of read-merge-write, interleaved with the other writer's
        export_results(ScaleToy(), SM90, [_summary(shape, {"block": block}, 1.0, 1.5)], f"lab tune {shape}", root, environment=ENV)


def test_concurrent_writers_both_keep_their_shapes(tmp_path):
    spawn = multiprocessing.get_context("spawn")
    writers = [spawn.Process(target=_export_one, args=(str(tmp_path), s, b)) for s, b in (("decode_n4k", 256), ("prefill_n1m", 512))]
    for w in writers:
        w.start()
    for w in writers:
        w.join(120)
        assert w.exitcode == 0
    stored = read_results(results_path("toy_scale", SM90, "test", tmp_path), "toy_scale", SM90)
    assert sorted(stored["shapes"]) == ["decode_n4k", "prefill_n1m"]


def test_a_corrupt_file_is_moved_aside_not_dropped(tmp_path, capsys):
    from test_tuning_toys import ScaleToy

    path = results_path("toy_scale", SM90, "test", tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text("schema: [truncated")
    export_results(ScaleToy(), SM90, [_summary("decode_n4k", {"block": 256}, 1.0, 1.5)], "c", tmp_path, environment=ENV)
    (kept,) = path.parent.glob("toy_scale.yaml.corrupt-*")
    assert kept.read_text() == "schema: [truncated"
    assert f"kept as {kept}" in capsys.readouterr().err
    assert list(read_results(path, "toy_scale", SM90)["shapes"]) == ["decode_n4k"]


def test_compile_only_check_builds_the_stored_winners(tmp_path, monkeypatch, capsys):
    """`lab check --compile-only` compiles every stored winner of the arch (each GPU model's) beside the defaults; a
    corrupt file is a one-line error."""
    path, shape = _winner_file(tmp_path)
    monkeypatch.setenv("CSA2_RESULTS_DIR", str(tmp_path))
    assert main(["check", "--compile-only", "--arch", "sm90", "--tile", "fp4_quant_main", "--jobs", "1", "--json"]) == 0
    cells = json.loads(capsys.readouterr().out)["cells"]
    tuned = [c for c in cells if c["label"] == "tuned:h200"]
    assert [(c["shape"], c["config"]["threads"], c["outcome"]) for c in tuned] == [(shape.name, 128, "ok")]
    path.write_text(path.read_text().replace("threads: 128", "threads: 100"))
    assert main(["check", "--compile-only", "--arch", "sm90", "--tile", "fp4_quant_main", "--jobs", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"lab check: error: results file {path}: shapes.{shape.name}.config.threads: 100") and "\n" not in err
