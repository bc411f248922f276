"""How much of a sparse-attention CTA's time is per block, and how much is fixed per CTA?

    python3 gpu/attn_block_scaling.py --out $OUT [--tile sparse_attn_prefill] [--config '{"wg1_rows": 16}']
    python3 gpu/attn_block_scaling.py --out $OUT --tile sparse_attn_bf16 --variants default,no_q_load,no_o_store

The ws kernel runs one CTA per token (per head block and split) and, at ~205 KiB of shared memory, one CTA per
SM: a CTA's prologue (Q load, the producer's first gather and dequant) and epilogue (sink, O store) overlap
nothing. This times the tile's default (or ``--config`` over it) at prefill S=4096 for top-k lengths 256, 512,
1024 and 2048 (6, 10, 18 and 34 blocks of 64 rows per CTA with the 128-entry window), checks every size against
the reference first (no time for a wrong kernel), and fits

    time = waves x (blocks_per_cta x t_block + t_fixed),  waves = CTAs / SMs

by least squares: ``t_block`` is the steady-state time of one block on one SM, ``t_fixed`` the per-CTA cost a
persistent kernel (CTAs that loop over tokens, the producer running into the next token while the consumers
finish this one) could hide.

``--variants``: besides ``default``, timing ablations of ``tiles.sparse_attn.ABLATIONS`` (e.g. ``no_q_load``,
``no_o_store``, ``no_softmax``, ``producer_idle``), each fitted the same way in the same run: how much of t_block or
t_fixed the piece it removes holds. An ablated kernel computes garbage by design and is only timed; it is built on
the gathering kernel, so a tile whose default expands the caches first needs ``--tile sparse_attn_bf16`` (the
kernel behind the expansion) or ``--config '{"kv_staging": "gather"}'``. All kernels compile first, in parallel.

Prints the table and each fit; writes attn_block_scaling.json (rows, fits, environment, command) under --out.
Without a CUDA GPU it exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import traceback
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


def _shape(k: int):
    """Prefill S=4096, H=64, window 128, top-k ``k``."""
    from tiles.contract import Shape

    dims = {"B": 1, "S": 4096, "Nc": 4096, "Nw": 4096, "H": 64, "W": 128, "K": k, "D": 512}
    return Shape(f"prefill_s4k_k{k}", "prefill", dims)


def _kernel(tile_name: str, k: int, override: dict, variant: str, arch_name: str):
    """The tile's default (``override`` over it) at top-k ``k``: through the tile for ``default``, else the gathering
    kernel built directly with the timing ablation ``variant``."""
    import tiles.sparse_attn as sa
    from tiles.arch import get_arch
    from tiles.registry import get_tile

    tile, arch, shape = get_tile(tile_name), get_arch(arch_name), _shape(k)
    cfg = tile.with_defaults(arch, override)
    if variant == "default":
        return tile.build(shape, cfg, arch)
    if cfg.get("kv_staging", "gather") != "gather":
        raise ValueError(f"{variant}: ablations cut the gathering kernel; use --tile sparse_attn_bf16 or kv_staging=gather")
    return sa.timing_ablation(tile, shape, arch, variant, override)


def _compile_job(job):
    """Worker: build one (variant, top-k) kernel so that TileLang's disk cache holds it. Returns (job, error or None)."""
    try:
        _kernel(*job)
        return job, None
    except Exception as exc:  # noqa: BLE001 - reported, never fatal
        return job, "".join(traceback.format_exception_only(type(exc), exc)).strip()[-300:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--tile", default="sparse_attn_prefill")
    parser.add_argument("--config", default="{}", help="JSON over the tile's default config")
    parser.add_argument("--variants", default="default", help="comma-separated: 'default' and ablation names")
    parser.add_argument("--workers", type=int, default=14, help="compile processes")
    args = parser.parse_args()
    override = json.loads(args.config)
    from tiles.sparse_attn import ABLATIONS

    variants = tuple(v for v in args.variants.split(",") if v)
    unknown = [v for v in variants if v != "default" and v not in ABLATIONS]
    if unknown or not variants:  # a typo must not cost a device call
        print(f"attn_block_scaling: unknown variants {unknown}; use default and {', '.join(ABLATIONS)}", file=sys.stderr)
        return 2

    import torch

    if not torch.cuda.is_available():
        print("attn_block_scaling: needs a CUDA GPU", file=sys.stderr)
        return 2

    from tiles.arch import detect
    from tiles.registry import get_tile
    from tiles.timing import describe_environment, time_cuda, time_cuda_graph

    arch, tile = detect(), get_tile(args.tile)
    jobs = [(args.tile, k, override, v, arch.name) for v in variants for k in TOPKS]
    if len(jobs) > 1:
        with multiprocessing.get_context("spawn").Pool(min(args.workers, len(jobs))) as pool:  # fills TileLang's disk cache
            for job, err in pool.imap_unordered(_compile_job, jobs):
                print(f"compiled {job[3]} K={job[1]}: {err or 'ok'}", flush=True)
    rows, fits = [], {}
    for variant in variants:
        for k in TOPKS:
            shape = _shape(k)
            dims = shape.dims
            inputs = tile.make_inputs(shape, seed=11)
            row = {"variant": variant, "K": k}
            try:
                kernel = _kernel(args.tile, k, override, variant, arch.name)
            except Exception as exc:  # noqa: BLE001 - one variant that does not build leaves the others' rows
                row.update(check="BUILD", detail=str(exc)[-300:])
                rows.append(row)
                print(f"{variant:14s} K={k:5d} build failed: {row['detail']}")
                continue
            if variant == "default":
                cmp = tile.compare(tile.run(kernel, inputs), tile.reference(inputs))  # outputs NaN-poisoned by run()
                row.update(check="ok" if cmp.ok else "WRONG", detail=str(cmp))
            else:
                row.update(check="ablation", detail="timed only: wrong results by design")
            if row["check"] != "WRONG":
                out = tile.alloc_outputs(kernel, inputs)
                launch = lambda _j, o=out, kk=kernel, x=inputs: tile.launch(kk, x, o)
                timing = time_cuda_graph(launch, n_sets=1) or time_cuda(launch, n_sets=1)  # graph replay: device time
                ms = timing.median_ms
                blocks = -(-dims["W"] // 64) + -(-k // 64)
                ctas = dims["S"] * (dims["H"] // 64)
                row.update(ms=ms, blocks_per_cta=blocks, waves=ctas / arch.sm_count, us_per_cta=1e3 * ms / (ctas / arch.sm_count))
            rows.append(row)
            print(
                f"{variant:14s} K={k:5d} {row['check']:8s} "
                + (f"{row['ms']:.4f} ms  {row['us_per_cta']:.2f} us per CTA slot" if "ms" in row else row["detail"])
            )
        timed = [r for r in rows if r["variant"] == variant and "ms" in r]
        if len(timed) >= 2:
            t_block, t_fixed = _fit([r["blocks_per_cta"] for r in timed], [r["us_per_cta"] for r in timed])
            fits[variant] = {"t_block_us": t_block, "t_fixed_us": t_fixed}
            print(f"{variant}: {t_block:.3f} us per 64-row block per SM + {t_fixed:.2f} us fixed per CTA")
    cmd = "python3 gpu/attn_block_scaling.py --out $OUT --tile " + args.tile + (f" --config '{args.config}'" if override else "")
    cmd += f" --variants {args.variants}" if variants != ("default",) else ""
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "attn_block_scaling.json").write_text(
        json.dumps(
            {
                "environment": describe_environment(),
                "command": cmd,
                "config": override,
                "rows": rows,
                "fit": fits.get("default"),
                "fits": fits,
            },
            indent=1,
        )
    )
    return 0 if all(r["check"] in ("ok", "ablation") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
