"""What ``results/<arch>/`` holds: the reports ``lab report`` renders and the data they render from, nothing else.

::

    results/<arch>/
        tuned/<gpu>/<tile>.yaml         tuned configs per GPU model (``lab tune``; read at run time)  -> tuning.md
        bench/<tile>.json               ``lab bench --save`` rows with the default config           -> bench.md
        bench/<tile>_tuned.json         ``lab bench --config tuned --save`` rows (stored winners)    -> bench.md
        e2e/<gpu>.json                  ``lab e2e`` documents, the latest run per GPU model          -> e2e.md
        e2e/<gpu>_latency.png, e2e/<gpu>_breakdown.png                                    (plots of e2e.md)
        bench.md  tuning.md  e2e.md

A bench file keeps one row per (shape, GPU model): the latest run's, each row with its own environment, date and
command, so ``bench.md`` shows the current figure of every tile x shape x GPU. :func:`unaccounted` lists what a
results tree holds beyond this (a test keeps the lab's own tree clean).
"""

from __future__ import annotations

import json
from pathlib import Path

from lab.cli import LabError
from tiles.core.gpu import gpu_slug

BENCH_SCHEMA = "csa2-lab/bench/v2"
REPORTS = ("bench.md", "tuning.md", "e2e.md")
PLOTS = ("latency", "breakdown")


def bench_path(arch_dir: Path, tile: str, tuned: bool) -> Path:
    return arch_dir / "bench" / f"{tile}{'_tuned' if tuned else ''}.json"


def e2e_path(arch_dir: Path, gpu: str | None) -> Path:
    return arch_dir / "e2e" / f"{gpu_slug(gpu)}.json"


def e2e_plot_prefix(json_path: Path) -> str:
    """Plots of ``e2e/<gpu>.json`` are ``e2e/<gpu>_latency.png`` and ``e2e/<gpu>_breakdown.png``."""
    return f"{json_path.stem}_"


def read_bench(path: Path) -> dict:
    """A bench file, checked: a :class:`LabError` naming the file and what is wrong."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise LabError(f"{path}: cannot read ({exc})") from None
    except json.JSONDecodeError as exc:
        raise LabError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(doc, dict) or doc.get("schema") != BENCH_SCHEMA:
        raise LabError(f"{path}: not a bench file of schema {BENCH_SCHEMA} (written by `lab bench --save`)")
    rows = doc.get("rows")
    if not isinstance(rows, list) or not all(isinstance(r, dict) and "shape" in r and isinstance(r.get("environment"), dict) for r in rows):
        raise LabError(f"{path}: 'rows' must be a list of rows, each with its 'shape' and 'environment'")
    for i, row in enumerate(rows):
        for key in ROW_NUMBERS:
            value = row.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
                raise LabError(f"{path}: rows[{i}].{key} is {value!r}, not a number")
    return doc


# The figures of a bench row (numbers or null): what bench.md formats as numbers.
ROW_NUMBERS = (
    "ms",
    "p10_ms",
    "p90_ms",
    "eager_ms",
    "gbps",
    "tflops",
    "copy_fraction",
    "ref_ms",
    "speedup",
    "host_us",
    "tilelang_call_us",
    "copy_gbps",
    "flops",
    "bytes",
    "compile_s",
)


def merge_bench(run: dict, arch_dir: Path, tuned: bool) -> Path:
    """Merge the rows of one ``lab bench`` run (its JSON document) into ``bench/<tile>[_tuned].json``.

    A row replaces the stored row of the same shape and GPU model; the other rows stay. Returns the file written.
    """
    from tuning.export import locked

    path = bench_path(arch_dir, run["tile"], tuned)
    with locked(path.parent):  # another run saving to this file waits, then merges over what this one wrote
        _merge_rows(run, path)
    return path


def _merge_rows(run: dict, path: Path) -> None:
    from tuning.export import write_atomic

    stored = read_bench(path) if path.exists() else {"schema": BENCH_SCHEMA, "tile": run["tile"], "arch": run["arch"], "rows": []}
    env = run["environment"]
    new = [
        {**row, "gpu": env.get("gpu"), "copy_gbps": run["copy_gbps"], "tilelang_call_us": run.get("tilelang_call_us"), "environment": env}
        | {"command": run["command"]}
        for row in run["rows"]
    ]
    replaced = {(r["shape"], r["gpu"]) for r in new}
    rows = [r for r in stored["rows"] if (r["shape"], r.get("gpu")) not in replaced] + new
    stored["rows"] = sorted(rows, key=lambda r: (r["shape"], str(r.get("gpu"))))
    write_atomic(path, json.dumps(stored, indent=1) + "\n")


def accounted(arch_dir: Path) -> set[Path]:
    """Every file of ``arch_dir`` that belongs there: tuned configs and bench files of registered tiles, e2e documents
    with their plots, and the three reports."""
    from tiles.core.registry import all_tiles

    names = set(all_tiles())
    keep = {arch_dir / r for r in REPORTS}
    keep |= {p for p in arch_dir.glob("tuned/*/*.yaml") if p.stem in names}
    keep |= {p for p in arch_dir.glob("bench/*.json") if p.stem.removesuffix("_tuned") in names}
    for doc in arch_dir.glob("e2e/*.json"):
        keep |= {doc} | {doc.with_name(f"{e2e_plot_prefix(doc)}{plot}.png") for plot in PLOTS}
    return keep


# Local state a run leaves beside the results (git-ignored, never published): tuning studies and their side files.
LOCAL_STATE = ("*.db", "*.db-journal", "*.db-wal", "*.db-shm", "*.log")


def unaccounted(root: Path) -> list[Path]:
    """Files under the results tree ``root`` that :func:`accounted` does not name, local state (:data:`LOCAL_STATE`)
    aside (sorted)."""
    if not root.is_dir():
        return []
    keep: set[Path] = set()
    for arch_dir in (p for p in root.iterdir() if p.is_dir()):
        keep |= accounted(arch_dir)
    files = (p for p in root.rglob("*") if p.is_file() and not any(p.match(pattern) for pattern in LOCAL_STATE))
    return sorted(p for p in files if p not in keep)
