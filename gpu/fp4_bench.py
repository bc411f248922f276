"""`lab bench --json` of each FP4 tile at all its shapes, a structural sweep at bulk_1m, and a summary table.

Writes ``<out>/fp4_<tile>.json`` (the bench documents), ``<out>/fp4_sweep.json`` and ``<out>/summary.md``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time
from pathlib import Path

# Overrides merged onto each tile's default at bulk_1m (keys a tile does not have are dropped): the first
# kernels (`thread` mapping, `divide` codes), the `lanes` / `thresholds` / `packed` paths and their sizes
# (the newest first: a run with a deadline times those before it runs out).
SWEEP = [
    {"code": "packed"},
    {"code": "packed", "chunks_per_thread": 2},
    {"code": "packed", "threads": 128},
    {"code": "packed", "threads": 512},
    {"mapping": "thread", "code": "divide"},
    {"mapping": "thread", "code": "thresholds"},
    {"mapping": "lanes", "code": "divide"},
    {"chunks_per_thread": 1},
    {"chunks_per_thread": 4},
    {"threads": 128},
    {"threads": 512},
    {"grid": "persistent"},
]
TILES = ["fp4_quant_main", "fp4_quant_index", "fp4_dequant_main", "fp4_dequant_index"]
SWEEP_TILES = os.environ.get("FP4_TILES", ",".join(TILES)).split(",")  # a subset when device time is short


def bench(out: Path) -> list[dict]:
    from lab.cli import main

    docs = []
    for tile in TILES:
        argv = ["bench", "--tile", tile, "--json"]
        sys.argv = ["lab", *argv]  # the command recorded in the document is the one this call is equivalent to
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = main(argv)
        text = buf.getvalue()
        (out / f"fp4_{tile}.json").write_text(text)
        print(f"{tile}: rc={rc}", file=sys.stderr)
        try:
            docs.append(json.loads(text))
        except json.JSONDecodeError:
            print(text[-2000:], file=sys.stderr)
    return docs


def sweep(out: Path) -> list[dict]:
    import torch

    from tiles.arch import detect
    from tiles.harness import evaluate
    from tiles.registry import get_tile

    arch, rows = detect(), []
    deadline = float(os.environ.get("FP4_DEADLINE", "inf"))  # the batch has a hard wall-clock limit: stop sweeping in time
    for name in SWEEP_TILES:
        tile = get_tile(name)
        shape = tile.shape("bulk_1m")
        space = tile.search_space(arch)
        names = {p.name for p in space.params}
        configs = [tile.default_config(arch)] + [{**tile.default_config(arch), **{k: v for k, v in o.items() if k in names}} for o in SWEEP]
        for config in list({json.dumps(c, sort_keys=True): c for c in configs}.values()):
            if space.violations(config, shape, arch):
                continue
            if time.time() > deadline:
                rows.append(
                    {
                        "tile": name,
                        "shape": shape.name,
                        "config": config,
                        "outcome": "skipped",
                        "ms": None,
                        "gbps": None,
                        "message": "out of time",
                    }
                )
                continue
            ev = evaluate(tile, shape, config, arch, seed=11, runs=30)
            rows.append(
                {
                    "tile": name,
                    "shape": shape.name,
                    "config": config,
                    "outcome": ev.outcome,
                    "ms": ev.ms,
                    "gbps": ev.gbps,
                    "message": ev.message,
                }
            )
            torch.cuda.empty_cache()
    from tiles.timing import describe_environment

    env = " ".join(f"{k}={os.environ[k]}" for k in ("FP4_SWEEP_ONLY", "FP4_TILES") if k in os.environ)
    command = f"{env} python3 -m gpu.fp4_bench OUT".strip()
    doc = {"environment": describe_environment(), "command": command, "rows": rows}
    (out / "fp4_sweep.json").write_text(json.dumps(doc, indent=1, default=str))
    return rows


def summary(docs: list[dict], rows: list[dict]) -> str:
    lines = []
    if docs:
        env = docs[0]["environment"]
        head = f"GPU {env.get('gpu')} (cc {env.get('capability')}), driver {env.get('driver')}, CUDA {env.get('cuda')}, "
        lines += [head + f"torch {env.get('torch')}, tilelang {env.get('tilelang')}, {env.get('date')}", ""]
        lines += ["| tile | shape | ms | GB/s | of copy | torch ms | speedup | check |", "|---|---|---|---|---|---|---|---|"]
        for d in docs:
            for r in d["rows"]:
                if r["outcome"] == "ok":
                    ref = f"{r['ref_ms']:.4f}" if r.get("ref_ms") else "n/a"
                    sp = f"{r['speedup']:.1f}x" if r.get("speedup") else "n/a"
                    lines.append(
                        f"| {d['tile']} | {r['shape']} | {r['ms']:.4f} | {r['gbps']:.0f} | {100 * r['copy_fraction']:.0f}% | {ref} | {sp} | ok |"
                    )
                else:
                    lines.append(f"| {d['tile']} | {r['shape']} | - | - | - | - | - | {r['outcome']}: {r['check'][:80]} |")
            lines.append(f"\n{d['tile']}: copy {d['copy_gbps']:.0f} GB/s, config {d['config']}, command `{d['command']}`\n")
    if rows:
        lines += ["", "| sweep tile (bulk_1m) | config | ms | GB/s | outcome |", "|---|---|---|---|---|"]
        for r in rows:
            c = r["config"]
            cfg = "/".join(f"{k}={v}" for k, v in sorted(c.items()))
            ms = f"{r['ms']:.4f}" if r["ms"] else "-"
            gb = f"{r['gbps']:.0f}" if r["gbps"] else "-"
            lines.append(f"| {r['tile']} | {cfg} | {ms} | {gb} | {r['outcome']} {r['message'][:60]} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    out = Path(sys.argv[1])
    docs = bench(out) if os.environ.get("FP4_SWEEP_ONLY") != "1" else []
    (out / "summary.md").write_text(summary(docs, []))
    rows = sweep(out)
    (out / "summary.md").write_text(summary(docs, rows))
