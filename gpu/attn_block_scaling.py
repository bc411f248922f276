"""How much of a sparse-attention CTA's time is per block, and how much is fixed per CTA?

    python3 gpu/attn_block_scaling.py --out $OUT [--tile sparse_attn_prefill] [--config '{"wg1_rows": 16}']

The ws kernel runs one CTA per token (per head block and split) and, at ~205 KiB of shared memory, one CTA per
SM: a CTA's prologue (Q load, the producer's first gather and dequant) and epilogue (sink, O store) overlap
nothing. This times the tile's default (or ``--config`` over it) at prefill S=4096 for top-k lengths 256, 512,
1024 and 2048 (6, 10, 18 and 34 blocks of 64 rows per CTA with the 128-entry window), checks every size against
the reference first (no time for a wrong kernel), and fits

    time = waves x (blocks_per_cta x t_block + t_fixed),  waves = CTAs / SMs

by least squares: ``t_block`` is the steady-state time of one block on one SM, ``t_fixed`` the per-CTA cost a
persistent kernel (CTAs that loop over tokens, the producer running into the next token while the consumers
finish this one) could hide. Prints the table and the fit; writes attn_block_scaling.json (rows, fit,
environment, command) under --out. Without a CUDA GPU it exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TOPKS = (256, 512, 1024, 2048)


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = a * x + b``: returns (a, b)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    a = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return a, my - a * mx


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--tile", default="sparse_attn_prefill")
    parser.add_argument("--config", default="{}", help="JSON over the tile's default config")
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("attn_block_scaling: needs a CUDA GPU", file=sys.stderr)
        return 2

    from tiles.arch import detect
    from tiles.contract import Shape
    from tiles.registry import get_tile
    from tiles.timing import describe_environment, time_cuda, time_cuda_graph

    arch, tile = detect(), get_tile(args.tile)
    override = json.loads(args.config)
    rows = []
    for k in TOPKS:
        dims = {"B": 1, "S": 4096, "Nc": 4096, "Nw": 4096, "H": 64, "W": 128, "K": k, "D": 512}
        shape = Shape(f"prefill_s4k_k{k}", "prefill", dims)
        kernel = tile.build(shape, tile.with_defaults(arch, override), arch)
        inputs = tile.make_inputs(shape, seed=11)
        cmp = tile.compare(tile.run(kernel, inputs), tile.reference(inputs))  # outputs NaN-poisoned by run()
        row = {"K": k, "check": "ok" if cmp.ok else "WRONG", "detail": str(cmp)}
        if cmp.ok:
            out = {"out": torch.empty_like(inputs["q"])}
            launch = lambda _j, o=out, kk=kernel, x=inputs: tile.launch(kk, x, o)
            timing = time_cuda_graph(launch, n_sets=1) or time_cuda(launch, n_sets=1)  # graph replay: device time
            ms = timing.median_ms
            blocks = -(-dims["W"] // 64) + -(-k // 64)
            ctas = dims["S"] * (dims["H"] // 64)
            row.update(ms=ms, blocks_per_cta=blocks, waves=ctas / arch.sm_count, us_per_cta=1e3 * ms / (ctas / arch.sm_count))
        rows.append(row)
        print(
            f"K={k:5d} {row['check']:5s} " + (f"{row['ms']:.4f} ms  {row['us_per_cta']:.2f} us per CTA slot" if cmp.ok else row["detail"])
        )

    timed = [r for r in rows if r["check"] == "ok"]
    fit = None
    if len(timed) >= 2:
        t_block, t_fixed = _fit([r["blocks_per_cta"] for r in timed], [r["us_per_cta"] for r in timed])
        fit = {"t_block_us": t_block, "t_fixed_us": t_fixed}
        print(f"fit: {t_block:.3f} us per 64-row block per SM + {t_fixed:.2f} us fixed per CTA")
    cmd = "python3 gpu/attn_block_scaling.py --out $OUT --tile " + args.tile + (f" --config '{args.config}'" if override else "")
    env = describe_environment()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "attn_block_scaling.json").write_text(
        json.dumps({"environment": env, "command": cmd, "config": override, "rows": rows, "fit": fit}, indent=1)
    )
    return 0 if all(r["check"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
