"""The compressor with one piece of its pooling phase made cheaper or removed: how much could each piece still give?

    python3 gpu/compressor_ablation.py prefill_r2_s64k '{"block_g": 32, "ctas_per_sm": 2, ...}' [more configs] \\
        --variants base,ex2_ftz,scale_mul,encode_cheap,all --json $OUT/ablation.json

Variants (each patches the CUDA the kernel imports, then builds a fresh kernel):

- ``base``: the kernel as it is.
- ``ex2_ftz``: the fast pooling's ``__expf`` as ``ex2.approx.ftz`` of ``x * log2(e)``: the same values except where the
  smaller gate's weight would be subnormal (gate gaps past 87), without the non-ftz range fix-ups.
- ``scale_mul``: the main cache's E4M3 scale ``amax / 6`` by one multiply by ``RN(1/6)`` instead of the IEEE division (a
  bound: a few scales change by one ulp before the fp8 cast).
- ``encode_cheap``: the E2M1 codes of the main cache from four bits of each float, not the threshold search (wrong
  codes: an upper bound on what a cheaper exact encode could save).
- ``all``: the three together.
- ``ld_cs`` / ``ld_na`` / ``ld_lu``: the kv/gate loads of ``kv_load="direct"`` as ``ld.global.cs`` (streaming: evict
  first), ``ld.global.nc.L1::no_allocate`` or ``ld.global.lu`` (last use), by rewriting the generated CUDA (TileLang's
  post-processing hook; its kernel cache is off for these builds). The same values: checked like ``base``. Only builds
  with TileLang's plain kv/gate loads have them to rewrite: since session 31 those at two CTAs an SM stream their rows
  already (``csa2_load_row_stream``), and the variant reports that it found no load.
- ``proj_x1`` / ``proj_none``: the f16x3 projection with only its hi x hi product (the two correction products
  removed) / with none of its three (wrong index keys): what the three-product emulation, and the projection's tensor
  work as a whole, cost. The fragment loads stay where their results are still read.
- ``wk_l1``: every warp of the f16x3 projection reads column group 0's Wk fragments (32 KB a CTA instead of 256 KB:
  L1 hits after the first warp) -- wrong keys; what the projection's Wk traffic through L2 costs.

The variants that keep the values (``base``, ``ex2_ftz``, ``ld_*``) are checked against the reference; the others write
wrong bytes on purpose. Every variant is timed the way ``lab bench`` times (CUDA-graph replay over rotating input sets),
base first, in one process. The JSON carries the environment (``tiles.timing.describe_environment``) and the command.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

EX2_FTZ_CUDA = r"""
__device__ __forceinline__ float csa2_exp_ftz(float x) {  // __expf's arithmetic with ex2.approx.ftz
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
  return y;
}
"""

ENCODE_CHEAP_CUDA = r"""
__device__ __forceinline__ unsigned csa2_e2m1_pair_bounded(float x0, float x1, float s) {
  return ((__float_as_uint(x0) >> 28) & 0xFu) | ((__float_as_uint(x1) >> 24) & 0xF0u);
}
"""

VARIANTS = ("base", "ex2_ftz", "scale_mul", "encode_cheap", "all", "wk_l1", "proj_x1", "proj_none", "ld_cs", "ld_na", "ld_lu")
CHECKED = ("base", "ex2_ftz", "ld_cs", "ld_na", "ld_lu")
LOAD_HINTS = {
    "ld_cs": "__ldcs",
    "ld_lu": "__ldlu",
    "ld_na": "csa2_ld_na",
}
LD_NA_CUDA = r"""
__device__ __forceinline__ float4 csa2_ld_na(const float4* p) {
  float4 v;
  asm("ld.global.nc.L1::no_allocate.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
  return v;
}
"""
# one f16 MMA line of the projection's k-step loop; the SPLIT ones are the two correction products (lo x hi, hi x lo)
# (an emptied line keeps its loop with an empty body: the enclosing m loop has no braces)
_PROJ_MMA_LINE = re.compile(r"(\n[^\n]*for \(int n = 0; n < NT; \+\+n\) )csa2_mma_f16\((SPLIT)?[^\n]*")
_KV_LOAD = re.compile(r"= \*\(float4\*\)\(((?:kv|gate) \+ .*?)\);\n")


def _load_hint_postproc(fn: str):
    """A CUDA post-processing hook: each kv/gate float4 load through ``fn`` (and csa2_ld_na defined up front)."""

    def postproc(code, _target):
        out, n = _KV_LOAD.subn(lambda m: f"= {fn}((const float4*)({m.group(1)}));\n", code)
        if n == 0:
            raise RuntimeError("no kv/gate float4 load found in the generated CUDA: the pattern is out of date")
        at = out.index('extern "C" __global__')
        return out[:at] + LD_NA_CUDA + out[at:]

    return postproc


_ORIG: dict = {}  # the sources and functions as imported, filled by main()
PROJ_SOURCES = ("_PROJ_F16X3_CUDA", "_PROJ_F16X3_DEEP_CUDA")


def cut_projection_products(src: str, keep_hi: bool, name: str = "projection") -> str:
    """``src`` (an f16x3 projection's CUDA) with its two correction MMAs emptied, and its hi x hi one too unless
    ``keep_hi``. Refuses a source whose k-step loop no longer has exactly three MMA lines."""
    out, n = _PROJ_MMA_LINE.subn(lambda m: m.group(1) + "{}" if not keep_hi or m.group(2) else m.group(0), src)
    if n != 3:
        raise RuntimeError(f"{name}: found {n} MMA lines, not 3: the projection's loop changed, update the pattern")
    return out


def _patch(variant: str) -> None:
    """Point the compressor's CUDA sources and pooling at ``variant``'s (``base`` restores them)."""
    import tilelang.language as T

    import tiles.compressor.kernel as kernel_mod
    import tiles.compressor.pool_encode as pe

    parts = {"ex2_ftz", "scale_mul", "encode_cheap"} if variant == "all" else {variant}
    main_rows = _ORIG["main_rows"]
    if "scale_mul" in parts:
        main_rows = main_rows.replace("/ 0x1.8p+2f)", "* 0x1.555556p-3f)")
    bounds = _ORIG["bounds"]()
    if "encode_cheap" in parts:
        bounds = bounds[: bounds.index("// Values 2j and 2j + 1")] + ENCODE_CHEAP_CUDA
    if "ex2_ftz" in parts:
        bounds = EX2_FTZ_CUDA + bounds

    def pool_pair(x0, x1, kv0, kv1, pool_math):
        if pool_math != "fast" or "ex2_ftz" not in parts:
            return _ORIG["pool_pair"](x0, x1, kv0, kv1, pool_math)
        first_larger = x0 >= x1
        t = T.call_extern("float32", "csa2_exp_ftz", T.min(x0, x1) - T.max(x0, x1))
        inv = T.call_extern("float32", "__fdividef", T.float32(1.0), t + T.float32(1.0))
        w_small = t * inv
        return T.if_then_else(first_larger, inv, w_small) * kv0 + T.if_then_else(first_larger, w_small, inv) * kv1

    for name in PROJ_SOURCES:
        src = _ORIG[name]
        if "wk_l1" in parts:
            for per_warp in ("cg * 32 * NT * 32 + lane", "warp * 32 * NT * 32 + lane"):
                src = src.replace(per_warp, "lane")
        if parts & {"proj_x1", "proj_none"}:
            src = cut_projection_products(src, keep_hi="proj_x1" in parts, name=name)
        setattr(kernel_mod, name, src)
    import tilelang
    from tilelang.engine.callback import register_cuda_postproc

    if variant in LOAD_HINTS:
        register_cuda_postproc(_load_hint_postproc(LOAD_HINTS[variant]))
        tilelang.disable_cache()  # the cache key does not see the post-processing
    else:
        register_cuda_postproc(lambda code, _target: code)
        tilelang.enable_cache()
    kernel_mod._bounds_cuda = lambda: bounds
    kernel_mod._MAIN_FROM_ROWS_CUDA = main_rows
    pe._MAIN_FROM_ROWS_CUDA = main_rows  # main_from_rows_f16_split_cuda derives from it
    kernel_mod._pool_pair = pool_pair
    kernel_mod._compress_kernel.cache_clear()  # its cache is keyed by the config alone


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", help="a compressor shape, e.g. prefill_r2_s64k")
    parser.add_argument("configs", nargs="+", help="JSON overrides of the tile's default, one per config")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:  # before asking for a GPU
        parser.error(f"unknown variants {unknown}: use some of {', '.join(VARIANTS)}")

    import torch

    if not torch.cuda.is_available():
        print("error: no CUDA GPU: this script times kernels", file=sys.stderr)
        return 2
    import tiles.compressor.kernel as kernel_mod
    from tiles.arch import detect
    from tiles.compressor import COMPRESSOR
    from tiles.timing import describe_environment, input_sets_for_l2, time_cuda_graph

    _ORIG.update(bounds=kernel_mod._bounds_cuda, main_rows=kernel_mod._MAIN_FROM_ROWS_CUDA, pool_pair=kernel_mod._pool_pair)
    _ORIG.update({name: getattr(kernel_mod, name) for name in PROJ_SOURCES})
    arch = detect()
    shape = COMPRESSOR.shape(args.shape)
    n_sets = input_sets_for_l2(COMPRESSOR.bytes_moved(shape), arch.l2_bytes, max_sets=4)
    sets = [COMPRESSOR.make_inputs(shape, 11 + i) for i in range(n_sets)]
    expected = COMPRESSOR.reference(sets[0])
    rows = []
    for raw in args.configs:
        cfg = COMPRESSOR.with_defaults(arch, json.loads(raw))
        base_ms = None
        for variant in variants:
            _patch(variant)
            try:
                kernel = COMPRESSOR.build(shape, cfg, arch)
            except Exception as exc:  # noqa: BLE001 -- a variant that does not build is reported, the rest run
                print(f"{raw[:70]:<70} {variant:<13} build failed: {str(exc)[:200]}")
                continue
            outs = [COMPRESSOR.alloc_outputs(kernel, s) for s in sets]
            check = "-"
            if variant in CHECKED:
                COMPRESSOR.launch(kernel, sets[0], outs[0])
                check = str(COMPRESSOR.compare(outs[0], expected))[:60]
            t = time_cuda_graph(lambda i, k=kernel, o=outs: COMPRESSOR.launch(k, sets[i], o[i]), n_sets=n_sets, launches=8, replays=30)
            ms = t.median_ms if t else float("nan")
            base_ms = ms if variant == "base" else base_ms
            rel = f"{ms / base_ms:6.3f}x" if base_ms else "-"
            print(f"{raw[:70]:<70} {variant:<13} {ms:9.5f} ms {rel}  check: {check}", flush=True)
            rows.append({"config": json.loads(raw), "variant": variant, "ms": ms, "check": check})
    _patch("base")
    if args.json:
        command = " ".join(["python3", *sys.argv])
        doc = {"environment": describe_environment(), "command": command, "shape": args.shape, "rows": rows}
        args.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
