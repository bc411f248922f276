"""Run a (tile, shape, config) many times on the same inputs: does it give the same bits every time?

    python3 tools/determinism_probe.py --json $OUT/determinism.json \
        --case 'sparse_attn_bf16:decode_b64_s1:{"schedule": "pipelined", "heads_per_block": 32, "threads": 128}' ...

The lab's gate (tiles.core.harness) runs a kernel twice and calls it nondeterministic when the two outputs differ; a race
that strikes one launch in ten passes that gate most of the time. Here each case is built once for the GPU's arch
(the config over the tile's default), its output NaN-poisoned and computed ``--runs`` times on one input set, and the
script reports how many runs differ bitwise from the first, the largest difference between runs, and the error of
the first and of the worst run against the torch reference (tile.compare), so that a race shows as a count and a
size, not as a single pass or fail.

Runs from the repo root on a GPU machine; without a CUDA GPU it exits with status 2 and says so.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _parse_case(text: str) -> tuple[str, str, dict]:
    """'tile:shape:{json}' (the config part optional) -> (tile, shape, config)."""
    tile, _, rest = text.partition(":")
    shape, _, cfg = rest.partition(":")
    if not tile or not shape:
        raise SystemExit(f"determinism_probe: a case is 'tile:shape[:json config]', got {text!r}")
    return tile, shape, json.loads(cfg) if cfg else {}


def probe(tile_name: str, shape_name: str, override: dict, runs: int, seed: int) -> dict:
    """One case: ``runs`` launches on one input set; counts of differing runs and errors against the reference."""
    from tiles.core.arch import detect
    from tiles.core.harness import first_difference
    from tiles.core.registry import get_tile

    arch = detect()
    tile = get_tile(tile_name)
    shape = tile.shape(shape_name)
    config = tile.with_defaults(arch, override)
    kernel = tile.build(shape, config, arch)
    inputs = tile.make_inputs(shape, seed, "cuda")
    ref = tile.reference(inputs)
    first = tile.run(kernel, inputs)  # each run's outputs NaN-poisoned before its launch
    differing, max_diff, worst = 0, 0.0, first  # only the run that differs most is kept
    for _ in range(runs - 1):
        out = tile.run(kernel, inputs)
        if first_difference(first, out) is None:
            continue
        differing += 1
        diff = max((out[k].float() - first[k].float()).abs().nan_to_num(float("inf")).max().item() for k in first)
        if diff > max_diff:
            max_diff, worst = diff, out
    cmp_first, cmp_worst = tile.compare(first, ref), tile.compare(worst, ref)
    return {
        "tile": tile_name,
        "shape": shape_name,
        "override": override,
        "config": config,
        "runs": runs,
        "runs_differing_from_first": differing,
        "max_abs_diff_between_runs": max_diff,
        "first_vs_reference": {"ok": cmp_first.ok, "error": cmp_first.error, "text": str(cmp_first)},
        "worst_vs_reference": {"ok": cmp_worst.ok, "error": cmp_worst.error, "text": str(cmp_worst)},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", action="append", required=True, help="tile:shape[:json config over the default]")
    parser.add_argument("--runs", type=int, default=20, help="launches per case on one input set (default 20)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", default=None)
    args = parser.parse_args(argv)
    cases = [_parse_case(c) for c in args.case]

    import torch

    if not torch.cuda.is_available():
        print("determinism_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    from tiles.core.timing import describe_environment

    rows = []
    print(f"{'tile':18s} {'shape':16s} {'differing':>10s} {'max diff':>10s} {'err first':>10s} {'err worst':>10s}  override")
    for tile_name, shape_name, override in cases:
        try:
            row = probe(tile_name, shape_name, override, args.runs, args.seed)
        except Exception as exc:  # noqa: BLE001 - one case's failure is reported, the others still run
            row = {"tile": tile_name, "shape": shape_name, "override": override, "error": f"{type(exc).__name__}: {exc}"[:500]}
            print(f"{tile_name:18s} {shape_name:16s} failed: {row['error']}")
            rows.append(row)
            continue
        rows.append(row)
        print(
            f"{tile_name:18s} {shape_name:16s} {row['runs_differing_from_first']:>4d} / {row['runs'] - 1:<3d} "
            f"{row['max_abs_diff_between_runs']:10.3g} {row['first_vs_reference']['error']:10.3g} "
            f"{row['worst_vs_reference']['error']:10.3g}  {json.dumps(override)}",
            flush=True,
        )
    if args.json:
        cmd = "python3 tools/determinism_probe.py --json $OUT/determinism.json" + "".join(f" --case '{c}'" for c in args.case)
        cmd += f" --runs {args.runs}" + (f" --seed {args.seed}" if args.seed else "")
        Path(args.json).write_text(json.dumps({"environment": describe_environment(), "command": cmd, "rows": rows}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
