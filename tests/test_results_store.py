"""The results tree (lab.results_store): reports and the data they render from, nothing else; bench rows merged one per
shape and GPU model; `lab report` names a corrupt file and rewrites no report before every input has been read."""

from __future__ import annotations

import json

import pytest

from lab.cli import main
from lab.results_store import BENCH_SCHEMA, merge_bench, read_bench, unaccounted
from tiles.core.config_store import results_dir
from tiles.core.gpu import gpu_slug


def _run(gpu: str, date: str, shapes: dict[str, float]) -> dict:
    """A `lab bench --json` document of fp4_quant_main at ``shapes`` (name -> ms)."""
    env = {"gpu": gpu, "date": date, "driver": "1", "cuda": "13.0", "torch": "2.11", "tilelang": "0.1.15"}
    rows = [
        {"shape": s, "outcome": "ok", "check": "ok", "ms": ms, "timing": "cuda-graph", "config_source": "default"}
        for s, ms in shapes.items()
    ]
    return {
        "tile": "fp4_quant_main",
        "arch": "sm90",
        "command": f"lab bench ({date})",
        "environment": env,
        "copy_gbps": 4000.0,
        "rows": rows,
    }


def test_the_labs_results_tree_holds_reports_and_their_data_only():
    """Anything in results/ that no report renders and no run reads (probe dumps, logs, old runs) fails here."""
    assert unaccounted(results_dir()) == []


def test_a_stray_file_is_unaccounted(tmp_path):
    (tmp_path / "sm90" / "bench").mkdir(parents=True)
    (tmp_path / "sm90" / "tuned" / "h200").mkdir(parents=True)
    for name in (
        "bench.md",
        "tuned/h200/compressor.yaml",
        "compressor.yaml",  # the layout before configs were kept per GPU model: not read any more
        "bench/compressor_tuned.json",
        "notes.txt",
        "bench/compressor_session9.json",
        "bench/nope.json",
        "compressor.db",  # a tuning study and its side file: local state, not a result
        "compressor.db-wal",
    ):
        (tmp_path / "sm90" / name).write_text("x")
    assert [p.name for p in unaccounted(tmp_path)] == ["compressor_session9.json", "nope.json", "compressor.yaml", "notes.txt"]


def test_merge_keeps_the_latest_row_per_shape_and_gpu(tmp_path):
    arch_dir = tmp_path / "sm90"
    merge_bench(_run("NVIDIA H200", "2026-01-01", {"bulk_1m": 1.0, "decode_b64": 2.0}), arch_dir, tuned=False)
    merge_bench(_run("NVIDIA H100 80GB HBM3", "2026-01-02", {"bulk_1m": 3.0}), arch_dir, tuned=False)
    path = merge_bench(_run("NVIDIA H200", "2026-01-03", {"bulk_1m": 4.0}), arch_dir, tuned=False)
    assert path == arch_dir / "bench" / "fp4_quant_main.json"
    rows = {(r["shape"], r["gpu"]): (r["ms"], r["environment"]["date"]) for r in read_bench(path)["rows"]}
    assert rows == {
        ("bulk_1m", "NVIDIA H200"): (4.0, "2026-01-03"),
        ("bulk_1m", "NVIDIA H100 80GB HBM3"): (3.0, "2026-01-02"),
        ("decode_b64", "NVIDIA H200"): (2.0, "2026-01-01"),
    }
    tuned = merge_bench(_run("NVIDIA H200", "2026-01-04", {"bulk_1m": 0.5}), arch_dir, tuned=True)
    assert tuned.name == "fp4_quant_main_tuned.json" and len(read_bench(path)["rows"]) == 3


def test_gpu_slugs():
    assert gpu_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3" and gpu_slug("NVIDIA H200") == "h200" and gpu_slug(None) == "unknown"


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "not valid JSON"),
        (json.dumps({"rows": []}), f"schema {BENCH_SCHEMA}"),
        (json.dumps({"schema": BENCH_SCHEMA, "rows": [{}]}), "'rows' must"),
    ],
    ids=["truncated", "old-format", "row-without-shape"],
)
def test_report_names_a_corrupt_bench_file_and_rewrites_nothing(tmp_path, capsys, text, message):
    arch_dir = tmp_path / "sm90"
    merge_bench(_run("NVIDIA H200", "2026-01-01", {"bulk_1m": 1.0}), arch_dir, tuned=False)
    assert main(["report", "--results", str(tmp_path)]) == 0
    before = (arch_dir / "bench.md").read_text()
    assert "| fp4_quant_main | bulk_1m | NVIDIA H200 | default | 1.0000 |" in before
    (arch_dir / "bench" / "fp4_quant_main_tuned.json").write_text(text)
    capsys.readouterr()
    assert main(["report", "--results", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "fp4_quant_main_tuned.json" in err and message in err and "Traceback" not in err
    assert (arch_dir / "bench.md").read_text() == before


def test_bench_save_refuses_an_experiments_config(capsys):
    assert main(["bench", "--tile", "fp4_quant_main", "--config", "threads=128", "--save"]) == 2
    assert "--save stores the default config's or the stored winners' figures" in capsys.readouterr().err
