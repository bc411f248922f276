"""The compressor kernel: kv/gate in, pooled and normalised latent on chip, RoPE, the FP4 main cache, the index-K
projection with its norm and RoPE, the FP4 index cache, in one pass per group of ``block_g`` groups."""

import functools

import tilelang
import tilelang.language as T
import tvm
from tilelang.layout import make_linear_layout

from tiles.compressor.common import DI, DIRECT_ROWS, INDEX_GROUP, MAIN_GROUP, MULTI_CTA_CHUNK, MULTI_CTA_STAGES, NORM_LANES, ROPE, D
from tiles.compressor.pool_encode import (
    LOAD_CHUNK,
    MAIN_FROM_ROWS_CUDA,
    ROW_LOAD_CUDA,
    bounds_cuda,
    e2m1_code,
    e2m1_code_search,
    main_from_rows_f16_split_cuda,
    pool_pair,
    staged_pool,
)
from tiles.compressor.projection import (
    F16_SPLIT_CUDA,
    PROJ_F16X3_CUDA,
    PROJ_F16X3_DEEP_CUDA,
    PROJ_REGS_CUDA,
    PROJ_REGS_K2_CUDA,
    PROJ_WARPS,
    PROJ_WGMMA_CUDA,
    rot_pad,
    split_accumulator_cuda,
    split_tf32_tile,
)
from tiles.compressor.space import (
    ENCODES,
    KV_LOADS,
    MAIN_PASSES,
    MAIN_STORES,
    MMA_PROJS,
    NORM_PASSES,
    POOL_MATHS,
    PROJ_ACCUMULATORS,
    PROJ_K_SPLITS,
    PROJ_LATENTS,
    PROJ_OPERANDS,
    PROJ_OUTS,
    PROJ_PIPELINES,
    SCHEDULES,
    WK_LOADS,
)
from tiles.core.arch import cuda_target
from tiles.core.contract import TileError


@T.macro
def _rmsnorm_in_smem(rot_s, w_s, part, ss, inv_s, eps, block_g: int):
    """RMSNorm of the pooled latent in place in ``rot_s`` fp32 [block_g, 512] (``w_s`` fp32 [512]).

    ``part`` fragment fp32 [block_g, NORM_LANES], ``ss`` fragment fp32 [block_g], ``inv_s`` shared fp32
    [block_g]. The latent is not held in registers (the default path keeps it as a 64-float fragment per
    thread; at 2-3 CTAs per SM a thread has at most 128 or 85 registers), and each row's sum of squares is NORM_LANES
    per-thread partial sums (float4 reads, a quarter-warp per 128 contiguous bytes: no bank conflicts)
    folded by one shuffle reduction, instead of one 128-thread all-reduce with its barriers per row.
    """
    for i, t in T.Parallel(block_g, NORM_LANES):
        part[i, t] = 0.0
        for e in T.serial(D // (4 * NORM_LANES)):
            for v in T.serial(4):
                x = rot_s[i, e * 4 * NORM_LANES + t * 4 + v]
                part[i, t] += x * x
    T.reduce_sum(part, ss, dim=1)
    for i in T.Parallel(block_g):
        inv_s[i] = T.rsqrt(ss[i] / D + eps[0])
    for i, d in T.Parallel(block_g, D):
        rot_s[i, d] = rot_s[i, d] * inv_s[i] * w_s[d]


@T.macro
def _rope_last_dims(buf, width: int, block_g: int, g0, G, cos, sin, kept_ev=None, kept_od=None):
    """RoPE on the last 64 of the ``width`` columns of ``buf`` [block_g, *] at each row's group position (``cos``/``sin``
    [G, 32]), interleaved pairs; each pair is read and written by one thread. ``kept_ev``/``kept_od`` (fragments
    [block_g, 32]): the pairs before the rotation, for :func:`_restore_rope_dims`."""
    for i, p in T.Parallel(block_g, ROPE // 2):
        g = T.min(g0 + i, G - 1)
        ev, od = buf[i, width - ROPE + 2 * p], buf[i, width - ROPE + 2 * p + 1]
        if kept_ev is not None:
            kept_ev[i, p] = ev
            kept_od[i, p] = od
        c, s = cos[g, p], sin[g, p]
        buf[i, width - ROPE + 2 * p] = ev * c - od * s
        buf[i, width - ROPE + 2 * p + 1] = ev * s + od * c


@T.macro
def _restore_rope_dims(buf, width: int, block_g: int, kept_ev, kept_od):
    """Write back the pre-RoPE pairs that :func:`_rope_last_dims` kept (fragments [block_g, 32], the same loop shape, so
    each thread writes what it read): the separate main pass encodes the main cache from the rotated latent, then the
    index-K projection reads the unrotated one."""
    for i, p in T.Parallel(block_g, ROPE // 2):
        buf[i, width - ROPE + 2 * p] = kept_ev[i, p]
        buf[i, width - ROPE + 2 * p + 1] = kept_od[i, p]


@functools.cache
def compress_kernel(
    target: str,
    ratio: int,
    block_g: int,
    threads: int,
    proj: str,
    k_chunk: int = 64,
    load: str = "direct",
    encode: str = "divide",
    ctas_per_sm: int = 1,
    wk: str = "hi_lo",
    schedule: str = "ws",
    wk_stages: int = 2,
    kv_load: str = "slabs",
    proj_operands: str = "smem",
    pool_math: str = "ieee",
    proj_accumulators: str = "shared",
    norm_pass: str = "separate",
    proj_k_split: int = 1,
    main_pass: str = "separate",
    proj_latent: str = "fp32",
    proj_out: str = "k_s",
    main_store: str = "bulk",
    proj_pipeline: str = "near",
):
    """Build the one-pass compressor for ``ratio`` (1 or 2); dims B and G are dynamic.

    ``load``: "direct" reads kv/gate with per-thread loads straight into the pooling registers;
    "staged" streams them through shared memory by double-buffered bulk copies (and the Wk
    chunks likewise, for tf32x3), see :func:`staged_pool`.
    ``encode``: "divide" codes ``clamp(x / s)`` by IEEE division and seven midpoint comparisons (the
    reference's expression); "thresholds" gives the same codes without a division: main cache by
    comparing ``|x|`` with per-scale fp32 bounds (:func:`_e2m1_thresholds`), index cache by multiplying
    with the exact inverse of its power-of-two scale; both by a 3-level search instead of 7 comparisons.
    ``ctas_per_sm`` > 1 (staged tf32x3 only): several CTAs share an SM, so that one CTA's kv/gate stream
    overlaps another's post-pooling compute (with one CTA per SM, HBM idles through norm, encodes and
    projection) and each scheduler has 4+ warps to hide latency instead of 2. For that the kernel gives up
    the producer warpgroup (its setmaxnreg split assumes the whole register file: the bulk copies are
    issued by all threads, ``MULTI_CTA_STAGES`` deep), keeps the latent in shared memory only
    (:func:`_rmsnorm_in_smem`), stores the main cache before the projection so its buffers can hold the Wk
    stages, and uses narrower kv/gate slabs; ``smem_compress``/``occupancy_compress`` say what fits.
    ``wk`` (with ctas_per_sm > 1): "hi_lo" streams the host-split TF32 high part and remainder of Wk (512 KiB
    from L2 per CTA); "fp32" streams Wk itself through the ``wk_hi`` argument (``wk_lo`` unread, 256 KiB per
    CTA) and splits each chunk in shared memory: the same operands bit for bit (:func:`split_tf32`).
    ``schedule`` (one CTA per SM): "ws" is the warp-specialised kernel; "flat" is the kernel of ctas_per_sm > 1 at one
    CTA per SM, for ``block_g`` 64: twice the groups per pass over Wk (half the Wk bytes from L2 and half the Wk splits
    per group) where rot_s (128 KiB) no longer fits two CTAs. ctas_per_sm > 1 is always "flat".
    ``wk_stages`` (flat kernel): depth of the Wk chunk pipeline; each chunk is an L2 round trip, so 2 stages (one
    chunk in flight) make the projection loop latency-bound; 3-4 keep 2-3 chunks in flight (8 KiB of shared memory per
    extra stage with wk=fp32, 16 KiB with hi_lo).
    ``kv_load`` (flat kernel, ratio 1): "slabs" streams kv through 16-channel slabs (2 KiB per slab at block_g 32:
    32 HBM round trips per CTA, two in flight); "whole" copies the block's kv rows straight into rot_s (ratio 1 pools
    nothing), all in flight at once: one round trip, and no slab buffers. "direct" (flat kernel, both ratios): no slabs and
    no barriers in the pooling: each thread reads its kv/gate float4s from global memory straight into the softmax and
    writes the pooled latent to rot_s (the arithmetic of :func:`staged_pool`, expression for expression); the loads of
    one thread's 16 float4 outputs are independent, so many more bytes are in flight than the slabs' two stages. With
    norm_pass="in_pool" at two CTAs an SM or fewer they load past L1 (:data:`ROW_LOAD_CUDA`).
    ``proj_operands`` (flat kernel, wk=fp32): "smem" splits each 16-wide chunk of the latent and of Wk into TF32 high
    and low tiles in shared memory (cp.async Wk stages, three barriers per chunk) and T.gemm reads them by ldmatrix;
    "registers" runs the projection out of registers (PROJ_REGS_CUDA): each warp owns 16 output columns, reads its
    latent words from rot_s (padded rows) and its Wk words from L2 (host order :func:`wk_fragment_order`), splits each
    once and issues the same MMAs in the same order; the result goes to k_s. No Wk stages, a_hi/a_lo/b_hi/b_lo or
    barriers in the loop. "wgmma" (sm_90a, block_g 16) computes the transposed product on wgmma (PROJ_WGMMA_CUDA): Wk
    from registers as the register projection reads and splits it, the latent split once per CTA into wgmma's shared
    layout (its high part over rot_s) instead of once per warp; the same three products, summed in the tensor cores'
    order (the index keys may differ from "registers" in the last bits).
    ``proj_accumulators`` (register projection): "shared" accumulates the three products of each output tile in one
    accumulator, in T.gemm's order (the shared-memory projection's bits); "split" keeps the small products (lo*hi, hi*lo)
    in a second one, added at the end (:func:`split_accumulator_cuda`): two independent MMA chains per tile.
    ``pool_math`` (ratio 2; ratio 1 pools nothing): how each channel's softmax over the group's two tokens is computed,
    see :func:`pool_pair`: "ieee" (two expf, two IEEE divisions: the reference's expression) or "fast" (ex2.approx and
    one approximate reciprocal: a few ulps off).
    ``norm_pass`` (kv_load=direct): "separate" normalises rot_s after the pooling (:func:`_rmsnorm_in_smem`: a pass that
    sums the squares from rot_s, a barrier, a pass that reads, scales and writes it back); "in_pool" sums each pooled
    row's squares in registers (one warp-wide shuffle reduction) and writes rot_s once, normalised: no rot_s round trip
    and no barriers for the norm (the latent moves by a few ulps: another summation order).
    ``main_pass`` (norm_pass="in_pool", encode="thresholds"): "separate" applies the RoPE and encodes the main cache in
    passes over rot_s (RoPE; amax; scale; codes, with barriers between); "in_pool" does all of it from the normalised
    rows in registers (:data:`MAIN_FROM_ROWS_CUDA`: the same arithmetic, the group max by two shuffles) and writes
    rot_s the pre-RoPE latent; bytes_m and sbyte_m get plain layouts (the TMA stores read them unswizzled).
    ``proj_k_split`` (register projection, one accumulator): 1, every warp covers all 512 k for 16 output columns; 2, a
    warp covers half of them for 32 columns (:data:`PROJ_REGS_K2_CUDA`: half the latent reads and splits per warp, Wk in
    ``wk_fragment_order(Wk, 32)``, the two halves added in k_s).
    ``proj`` "f16x3" (register projection only): the three products in fp16 on m16n8k16 (:data:`PROJ_F16X3_CUDA`:
    half the MMAs, the latent split into fp16 pairs, Wk split and scaled on the host by :func:`wk_fragment_order_f16`,
    its unscale passed in ``wk_lo``), with every ``proj_k_split`` / ``proj_accumulators`` layout of "registers".
    ``proj_latent`` (proj="f16x3"): "fp32" keeps the pre-RoPE latent in rot_s as fp32 and every projection warp splits the
    words it reads (8 warps: each latent word split 8 times, or 4 with ``proj_k_split=2``); "f16_split" (main_pass="in_pool")
    has the main pass store it once as fp16 high parts and remainders (:func:`main_from_rows_f16_split_cuda`), which the
    projection reads by ldmatrix: the same operands, no splits in the projection.
    ``proj_out`` (proj="f16x3"): "k_s" writes the keys into their own [block_g, 128] buffer; "rot_s" writes them over
    rot_s's first 128 columns once every warp has read the latent (a barrier): block_g x 512 B less shared memory.
    ``main_store`` (main_pass="in_pool"): "bulk" writes the main cache's bytes and scales into shared memory and copies
    them out with bulk stores (and a barrier); "registers" writes them from the main pass's registers into the caches
    (a warp's row: 64 contiguous bytes per store instruction): block_g x 288 B less shared memory. Both together let three
    CTAs of 32 groups share an SM (24 warps an SM instead of 16; ptxas: 80 registers, no spills).
    ``proj_pipeline`` (proj_latent="f16_split", proj_k_split=1): "near" loads each chunk's Wk fragments two chunks ahead
    and copies them into the MMA registers, the latent fragments right before their MMAs; "deep" keeps four chunks of Wk
    in flight in a ring the MMAs read in place and loads the latent one chunk ahead (:data:`PROJ_F16X3_DEEP_CUDA`: the
    same MMAs in the same order; ptxas: no more registers than "near", the pooling sets the peak).
    """
    if encode not in ENCODES:
        raise TileError(f"unknown encode {encode!r}: use one of {', '.join(ENCODES)}")
    if schedule not in SCHEDULES:
        raise TileError(f"unknown schedule {schedule!r}: use one of {', '.join(SCHEDULES)}")
    # The flat kernel: no producer warpgroup. Several CTAs per SM need it; one CTA may pick it (schedule="flat").
    flat = ctas_per_sm > 1 or schedule == "flat"
    f16x3 = proj == "f16x3"
    if f16x3 and proj_operands != "registers":
        raise TileError(f"proj='f16x3' is built in the register projection only (proj_operands='registers', got {proj_operands!r})")
    if proj_latent not in PROJ_LATENTS or (proj_latent == "f16_split" and (not f16x3 or main_pass != "in_pool")):
        raise TileError(f"proj_latent {proj_latent!r}: use 'fp32', or 'f16_split' with proj='f16x3' and main_pass='in_pool'")
    presplit = proj_latent == "f16_split"
    if proj_out not in PROJ_OUTS or (proj_out == "rot_s" and not f16x3):
        raise TileError(f"proj_out {proj_out!r}: use 'k_s', or 'rot_s' with proj='f16x3'")
    if proj_pipeline not in PROJ_PIPELINES or (proj_pipeline == "deep" and (not presplit or proj_k_split != 1)):
        raise TileError(f"proj_pipeline {proj_pipeline!r}: use 'near', or 'deep' with proj_latent='f16_split' and proj_k_split=1")
    if main_store not in MAIN_STORES or (main_store == "registers" and main_pass != "in_pool"):
        raise TileError(f"main_store {main_store!r}: use 'bulk', or 'registers' with main_pass='in_pool'")
    if flat and (load != "staged" or proj not in MMA_PROJS):
        raise TileError(f"ctas_per_sm {ctas_per_sm}, schedule {schedule} is built for load=staged, proj=tf32x3 (got {load}, {proj})")
    if (wk_stages != 2 or kv_load != "slabs") and not flat:
        raise TileError(f"wk_stages {wk_stages} / kv_load {kv_load!r} exist only in the flat kernel (ctas_per_sm > 1 or schedule=flat)")
    if kv_load not in KV_LOADS or (kv_load == "whole" and ratio != 1):
        raise TileError(f"kv_load={kv_load!r}: use one of {', '.join(KV_LOADS)}; 'whole' only at ratio 1 (ratio 2 pools pairs)")
    if kv_load == "direct" and threads != 256:
        raise TileError(f"kv_load='direct' is built for 256 threads (got {threads})")
    if proj_accumulators not in PROJ_ACCUMULATORS:
        raise TileError(f"unknown proj_accumulators {proj_accumulators!r}: use one of {', '.join(PROJ_ACCUMULATORS)}")
    if proj_accumulators == "split" and proj_operands != "registers":
        raise TileError("proj_accumulators='split' exists in the register projection only (proj_operands='registers')")
    if pool_math not in POOL_MATHS:
        raise TileError(f"unknown pool_math {pool_math!r}: use one of {', '.join(POOL_MATHS)}")
    if proj_k_split not in PROJ_K_SPLITS or (proj_k_split == 2 and (proj_operands != "registers" or proj_accumulators != "shared")):
        raise TileError(f"proj_k_split {proj_k_split}: use 1, or 2 with proj_operands='registers', proj_accumulators='shared'")
    if norm_pass not in NORM_PASSES:
        raise TileError(f"unknown norm_pass {norm_pass!r}: use one of {', '.join(NORM_PASSES)}")
    if norm_pass == "in_pool" and kv_load != "direct":
        raise TileError(f"norm_pass='in_pool' normalises the direct loads' pooled rows: it needs kv_load='direct' (got {kv_load!r})")
    if main_pass not in MAIN_PASSES or (main_pass == "in_pool" and (norm_pass != "in_pool" or encode != "thresholds")):
        raise TileError(f"main_pass {main_pass!r}: use 'separate', or 'in_pool' with norm_pass='in_pool' and encode='thresholds'")
    if proj_operands not in PROJ_OPERANDS:
        raise TileError(f"unknown proj_operands {proj_operands!r}: use one of {', '.join(PROJ_OPERANDS)}")
    # "wgmma" reads Wk like "registers" (fragment order from L2, no Wk stages): the same refusals, and then its own.
    regs, wgmma = proj_operands in ("registers", "wgmma"), proj_operands == "wgmma"
    if regs and (not flat or wk != "fp32" or kv_load == "whole" or threads != PROJ_WARPS * 32 or block_g not in (16, 32, 64)):
        raise TileError(
            f"proj_operands={proj_operands!r} is built for the flat kernel with wk=fp32, 256 threads, block_g 16/32/64 and "
            f"kv_load slabs/direct (got schedule {schedule}, ctas_per_sm {ctas_per_sm}, wk {wk}, threads {threads}, "
            f"block_g {block_g}, kv_load {kv_load})"
        )
    if regs and wk_stages != 2:
        raise TileError(f"proj_operands={proj_operands!r} has no Wk stages (wk_stages {wk_stages}: use 2)")
    if wgmma and (block_g != 16 or not target.startswith("sm_90")):
        raise TileError(f"proj_operands='wgmma' is built for sm_90a at block_g 16 (got {target}, block_g {block_g})")
    if wk not in WK_LOADS or (wk == "fp32" and not flat):
        raise TileError(f"wk={wk!r}: use one of {', '.join(WK_LOADS)}; 'fp32' only with the flat kernel (ctas_per_sm > 1 or schedule=flat)")
    B, G = T.dynamic("B, G")
    S = G * ratio
    R = ROPE // 2

    @T.prim_func
    def compress(
        kv: T.Tensor((B, S, D), "float32"),
        gate: T.Tensor((B, S, D), "float32"),
        norm_w: T.Tensor((D,), "float32"),
        cos: T.Tensor((G, R), "float32"),
        sin: T.Tensor((G, R), "float32"),
        wk_hi: T.Tensor((DI, D), "float32"),
        wk_lo: T.Tensor((DI, D), "float32"),
        k_norm_w: T.Tensor((DI,), "float32"),
        eps: T.Tensor((1,), "float32"),
        main_packed: T.Tensor((B, G, D // 2), "uint8"),
        main_scales: T.Tensor((B, G, D // MAIN_GROUP), "uint8"),
        idx_packed: T.Tensor((B, G, DI // 2), "uint8"),
        idx_scales: T.Tensor((B, G, DI // INDEX_GROUP), "uint8"),
    ):
        with T.Kernel(T.ceildiv(G, block_g), B, threads=threads) as (bx, b):
            g0 = bx * block_g
            if flat:
                # __launch_bounds__(threads, ctas_per_sm): ptxas keeps registers to 65536 / (threads * ctas_per_sm).
                T.annotate_min_blocks_per_sm(ctas_per_sm)
                part = T.alloc_fragment((block_g, NORM_LANES), "float32")
                inv_s = T.alloc_shared((block_g,), "float32")
            else:
                lat = T.alloc_fragment((block_g, D), "float32")
                sq = T.alloc_fragment((block_g, D), "float32")
            ss = T.alloc_fragment((block_g,), "float32")
            row_pad = rot_pad(proj, proj_latent)
            rot_s = T.alloc_shared((block_g, D + row_pad if regs else D), "float32")
            w_s = T.alloc_shared((D,), "float32")
            if main_pass == "separate":
                # the latent's last 64 dims before RoPE (even and odd elements of each pair)
                kept_ev = T.alloc_fragment((block_g, ROPE // 2), "float32")
                kept_od = T.alloc_fragment((block_g, ROPE // 2), "float32")
            amax_m = T.alloc_fragment((block_g, D // MAIN_GROUP), "float32")
            scale_m = T.alloc_shared((block_g, D // MAIN_GROUP), "float32")
            sbyte_m = T.alloc_shared((block_g, D // MAIN_GROUP), "uint8")
            bytes_m = T.alloc_shared((block_g, D // 2), "uint8")
            kacc = None if regs else T.alloc_fragment((block_g, DI), "float32")
            ksq = T.alloc_fragment((block_g, DI), "float32")
            kss = T.alloc_fragment((block_g,), "float32")
            if wgmma:
                # The latent's TF32 remainder for the wgmmas; the projection's result then lands in the same bytes
                # (after a barrier): k_s is its first DI columns, rows D words apart. Keeps three CTAs per SM.
                lo_s = T.alloc_shared((block_g, D), "float32")
                k_s = lo_s
            elif proj_out == "rot_s":
                k_s = rot_s  # the keys over the latent's first DI columns, rows D + row_pad words apart (see proj_out)
            else:
                k_s = T.alloc_shared((block_g, DI), "float32")
            kw_s = T.alloc_shared((DI,), "float32")
            amax_i = T.alloc_fragment((block_g, DI // INDEX_GROUP), "float32")
            scale_i = T.alloc_shared((block_g, DI // INDEX_GROUP), "float32")
            sbyte_i = T.alloc_shared((block_g, DI // INDEX_GROUP), "uint8")
            bytes_i = T.alloc_shared((block_g, DI // 2), "uint8")
            a_hi = T.alloc_shared((block_g, k_chunk), "float32")
            a_lo = T.alloc_shared((block_g, k_chunk), "float32")
            b_hi = T.alloc_shared((DI, k_chunk), "float32")
            b_lo = T.alloc_shared((DI, k_chunk), "float32")
            if wk == "fp32":
                w_st = T.alloc_shared((DI, k_chunk), "float32")
            # The flat kernel: half-width slabs, three stages (ratio 2: 3 x 8 KiB of kv+gate instead of 2 x 16 KiB), for
            # the shared-memory budget; two stay in flight while one is pooled.
            chunk, stages = (MULTI_CTA_CHUNK, MULTI_CTA_STAGES) if flat else (LOAD_CHUNK, 2)
            if load == "staged" and kv_load != "direct":
                kv_s = T.alloc_shared((block_g * ratio, chunk), "float32")
                gate_s = T.alloc_shared((block_g * ratio, chunk), "float32") if ratio == 2 else kv_s
            else:
                kv_s = gate_s = None
            if kv_load == "direct":
                # Each row of the group's tokens in its own [DIRECT_ROWS, 512] register fragment (one layout for the
                # load and the pool); ratio 1 needs only the first.
                kv_f = [T.alloc_fragment((DIRECT_ROWS, D), "float32") for _ in range(ratio)]
                gate_f = [T.alloc_fragment((DIRECT_ROWS, D), "float32") for _ in range(ratio if ratio == 2 else 0)]
                if norm_pass == "in_pool":
                    pooled_f = T.alloc_fragment((DIRECT_ROWS, D), "float32")
                    sq_f = T.alloc_fragment((DIRECT_ROWS, D), "float32")
                    ss_f = T.alloc_fragment((DIRECT_ROWS,), "float32")
                    rope_c = T.alloc_local((4,), "float32")  # main_pass=in_pool: csa2_rope_coeffs
                    # One warp per row (lane l holds columns 128 j + 4 l .. + 3): the row sums are shuffle reductions
                    # inside a warp. TileLang's own choice spreads a row over 128 threads (a barrier-synchronised
                    # all-reduce through shared memory per row).
                    row_per_warp = T.Fragment(
                        (DIRECT_ROWS, D),
                        forward_thread_fn=lambda i, d: i * 32 + (d // 4) % 32,
                        forward_index_fn=lambda i, d: (d // 128) * 4 + d % 4,
                    )
                    T.annotate_layout({buf: row_per_warp for buf in (*kv_f, *gate_f, pooled_f, sq_f)})
                    if main_pass == "in_pool":  # the helper writes plain rows (the TMA stores read them unswizzled)
                        T.annotate_layout({bytes_m: make_linear_layout(bytes_m), sbyte_m: make_linear_layout(sbyte_m)})
            # The one-warp-per-row layout above, loaded past L1 at two CTAs an SM or fewer (see ROW_LOAD_CUDA)
            stream_rows = kv_load == "direct" and norm_pass == "in_pool" and ctas_per_sm <= 2
            if encode == "thresholds" or regs or stream_rows:  # one import_source per kernel
                extra = split_accumulator_cuda() if proj_accumulators == "split" else (PROJ_WGMMA_CUDA if wgmma else "")
                extra += PROJ_REGS_K2_CUDA if proj_k_split == 2 else ""
                deep = PROJ_F16X3_DEEP_CUDA if proj_pipeline == "deep" else ""
                projection = "" if not regs else (PROJ_F16X3_CUDA + deep if f16x3 else PROJ_REGS_CUDA + extra)
                main_rows = (MAIN_FROM_ROWS_CUDA + (main_from_rows_f16_split_cuda() if presplit else "")) if main_pass == "in_pool" else ""
                bounds = (bounds_cuda() + main_rows) if encode == "thresholds" else ""
                row_load = ROW_LOAD_CUDA if stream_rows else ""
                T.import_source(row_load + (F16_SPLIT_CUDA if f16x3 else "") + bounds + projection)
            T.copy(norm_w, w_s)
            T.copy(k_norm_w, kw_s)

            # 1. pooling (softmax over the group's tokens, per channel).
            if load == "staged":
                # Bulk async copies of channel slabs, double-buffered: the kv/gate stream (the
                # kernel's HBM traffic) is in flight while the previous slab is pooled, instead
                # of each thread waiting on its own scalar loads (see staged_pool).
                if kv_load == "whole":
                    # Ratio 1 pools nothing: the block's rows straight into rot_s, every load in flight at once (one HBM
                    # round trip instead of 32 slab round trips two deep); rows past G are zero-filled by the copy.
                    T.copy(kv[b, g0 : g0 + block_g, :], rot_s)
                elif kv_load == "direct":
                    # No slabs, no barrier per slab: each thread's kv/gate float4s straight from global memory into the
                    # softmax (the same expressions as staged_pool, so the same latent bits). Rows past G read row G - 1
                    # (their results are never stored).
                    for r in T.serial(block_g // DIRECT_ROWS):
                        row = r * DIRECT_ROWS + T.get_thread_binding() // 32  # main_pass=in_pool: this warp's row
                        grow = T.max(T.min(g0 + row, G - 1), 0)
                        if main_pass == "in_pool":  # its RoPE coefficients in flight with the kv/gate loads
                            T.call_extern(
                                "handle",
                                "csa2_rope_coeffs",
                                T.address_of(cos[0, 0]),
                                T.address_of(sin[0, 0]),
                                grow,
                                T.address_of(rope_c[0]),
                            )
                        if stream_rows:  # this warp's row of each token, streamed past L1 (csa2_load_row_stream)
                            load_row = "csa2_load_row_stream"
                            T.call_extern("handle", load_row, T.address_of(kv[b, grow * ratio, 0]), T.address_of(kv_f[0][0, 0]))
                            if ratio == 2:
                                T.call_extern("handle", load_row, T.address_of(kv[b, grow * 2 + 1, 0]), T.address_of(kv_f[1][0, 0]))
                                T.call_extern("handle", load_row, T.address_of(gate[b, grow * 2, 0]), T.address_of(gate_f[0][0, 0]))
                                T.call_extern("handle", load_row, T.address_of(gate[b, grow * 2 + 1, 0]), T.address_of(gate_f[1][0, 0]))
                        else:
                            for i, d in T.Parallel(DIRECT_ROWS, D):
                                g = T.max(T.min(g0 + r * DIRECT_ROWS + i, G - 1), 0)
                                kv_f[0][i, d] = kv[b, g * ratio, d]
                                if ratio == 2:
                                    kv_f[1][i, d] = kv[b, g * 2 + 1, d]
                                    gate_f[0][i, d] = gate[b, g * 2, d]
                                    gate_f[1][i, d] = gate[b, g * 2 + 1, d]
                        if norm_pass == "in_pool":
                            # The pooled rows stay in registers: their squares summed per row (the lanes of a row share
                            # one warp: a shuffle reduction), then written once, normalised.
                            for i, d in T.Parallel(DIRECT_ROWS, D):
                                if ratio == 1:
                                    pooled_f[i, d] = kv_f[0][i, d]
                                else:
                                    x0, x1 = gate_f[0][i, d], gate_f[1][i, d]
                                    pooled_f[i, d] = pool_pair(x0, x1, kv_f[0][i, d], kv_f[1][i, d], pool_math)
                            for i, d in T.Parallel(DIRECT_ROWS, D):
                                sq_f[i, d] = pooled_f[i, d] * pooled_f[i, d]
                            T.reduce_sum(sq_f, ss_f, dim=1)
                            if main_pass == "in_pool":
                                # Normalised in place; then RoPE, rot_s and the main cache from the registers.
                                for i, d in T.Parallel(DIRECT_ROWS, D):
                                    inv = T.rsqrt(ss_f[i] / D + eps[0])
                                    pooled_f[i, d] = pooled_f[i, d] * inv * w_s[d]
                                # The main cache's row: in the caches themselves (main_store="registers"; a row past G
                                # stores nothing) or in bytes_m / sbyte_m for the bulk stores.
                                direct = main_store == "registers"
                                T.call_extern(
                                    "handle",
                                    "csa2_main_from_rows_f16" if presplit else "csa2_main_from_rows",
                                    T.address_of(pooled_f[0, 0]),
                                    T.address_of(rope_c[0]),
                                    T.address_of(rot_s[row, 0]),
                                    T.address_of(main_packed[b, grow, 0] if direct else bytes_m[row, 0]),
                                    T.address_of(main_scales[b, grow, 0] if direct else sbyte_m[row, 0]),
                                    g0 + row < G if direct else T.bool(True),
                                )
                            else:
                                for i, d in T.Parallel(DIRECT_ROWS, D):
                                    inv = T.rsqrt(ss_f[i] / D + eps[0])
                                    rot_s[r * DIRECT_ROWS + i, d] = pooled_f[i, d] * inv * w_s[d]
                        else:
                            for i, d in T.Parallel(DIRECT_ROWS, D):
                                if ratio == 1:
                                    rot_s[r * DIRECT_ROWS + i, d] = kv_f[0][i, d]
                                else:
                                    x0, x1 = gate_f[0][i, d], gate_f[1][i, d]
                                    rot_s[r * DIRECT_ROWS + i, d] = pool_pair(x0, x1, kv_f[0][i, d], kv_f[1][i, d], pool_math)
                else:
                    staged_pool(kv, gate, kv_s, gate_s, rot_s, b, g0, ratio, block_g, chunk, stages, pool_math)
                if not flat:
                    for i, d in T.Parallel(block_g, D):
                        lat[i, d] = rot_s[i, d]
            else:
                for i, d in T.Parallel(block_g, D):
                    g = T.min(g0 + i, G - 1)
                    if ratio == 1:
                        lat[i, d] = kv[b, g, d]
                    else:
                        x0, x1 = gate[b, 2 * g, d], gate[b, 2 * g + 1, d]
                        lat[i, d] = pool_pair(x0, x1, kv[b, 2 * g, d], kv[b, 2 * g + 1, d], pool_math)
            # 2. RMSNorm.
            if flat and norm_pass == "separate":
                _rmsnorm_in_smem(rot_s, w_s, part, ss, inv_s, eps, block_g)
            elif not flat:
                for i, d in T.Parallel(block_g, D):
                    sq[i, d] = lat[i, d] * lat[i, d]
                T.reduce_sum(sq, ss, dim=1)
                for i, d in T.Parallel(block_g, D):
                    rot_s[i, d] = lat[i, d] * T.rsqrt(ss[i] / D + eps[0]) * w_s[d]
            if main_pass == "in_pool":
                T.sync_threads()  # the rows' bytes (written by csa2_main_from_rows, unseen by TileLang) before the stores
            else:
                # 3. RoPE on the last 64 dims (main_pass="in_pool": done with 4. from the rows in registers), the
                # unrotated values kept for the projection.
                _rope_last_dims(rot_s, D, block_g, g0, G, cos, sin, kept_ev, kept_od)
                # 4. FP4 into the main cache: E4M3 scale per 16 (the stored scale divides).
                for i, q in T.Parallel(block_g, D // MAIN_GROUP):
                    amax_m[i, q] = 0.0
                    for e in T.serial(MAIN_GROUP):
                        # Rotated start per group: neighbouring threads' groups sit 16 words apart, so
                        # reading e in lockstep hit 2 banks (16-way conflicts); max ignores the order.
                        amax_m[i, q] = T.max(amax_m[i, q], T.abs(rot_s[i, q * MAIN_GROUP + (e + q) % MAIN_GROUP]))
                for i, q in T.Parallel(block_g, D // MAIN_GROUP):
                    raw = T.min(T.max(amax_m[i, q], 6.0 * 2.0**-9) / 6.0, 448.0)
                    code8 = T.Cast("float8_e4m3fn", raw)
                    scale_m[i, q] = T.Cast("float32", code8)
                    sbyte_m[i, q] = T.reinterpret(code8, "uint8")
                for i, j in T.Parallel(block_g, D // 2):
                    sc = scale_m[i, j // (MAIN_GROUP // 2)]
                    if encode == "thresholds":
                        pair = T.call_extern("uint32", "csa2_e2m1_pair_bounded", rot_s[i, 2 * j], rot_s[i, 2 * j + 1], sc)
                        bytes_m[i, j] = T.Cast("uint8", pair)
                    else:
                        lo = e2m1_code(T.clamp(rot_s[i, 2 * j] / sc, -6.0, 6.0))
                        hi = e2m1_code(T.clamp(rot_s[i, 2 * j + 1] / sc, -6.0, 6.0))
                        bytes_m[i, j] = T.Cast("uint8", lo | (hi << 4))
                _restore_rope_dims(rot_s, D, block_g, kept_ev, kept_od)  # the pre-RoPE latent back for the projection
            if flat and main_store == "bulk":
                # Stored now, not at the end: bytes_m's shared memory is then free for the Wk stages.
                T.copy(bytes_m, main_packed[b, g0 : g0 + block_g, :])
                T.copy(sbyte_m, main_scales[b, g0 : g0 + block_g, :])
                # The allocator reuses bytes_m/sbyte_m for b_lo/a_hi right after these bulk stores, but only
                # the electing thread waits for the stores to have read shared memory: everyone waits for it.
                T.sync_threads()
            # 5. Index-K projection of the latent before RoPE (fp32 accuracy, see module docstring).
            if not regs:
                T.clear(kacc)
            if regs:
                # Out of registers (see PROJ_REGS_CUDA) or on wgmma (PROJ_WGMMA_CUDA: the latent's high part overwrites
                # rot_s, its remainder goes to lo_s) into k_s; rot_s is final (barrier after the main stores).
                if wgmma:
                    fn, operands = f"csa2_proj_tf32x3_wgmma<{block_g}, {D + row_pad}, {D}>", (rot_s, lo_s, wk_hi, k_s)
                elif f16x3:  # wk_hi: the fp16 fragments; wk_lo: the unscale 2^-e
                    split, pre = ("true" if flag else "false" for flag in (proj_accumulators == "split", presplit))
                    over = ", true" if proj_out == "rot_s" else ""  # OVER_ROT (false by default)
                    fn = f"csa2_proj_f16x3_regs<{block_g // 16}, {D + row_pad}, {proj_k_split}, {split}, {pre}{over}>"
                    if proj_pipeline == "deep":
                        fn = f"csa2_proj_f16x3_regs_deep<{block_g // 16}, {D + row_pad}, {split}{over}>"
                    operands = (rot_s, wk_hi, wk_lo, k_s)
                else:
                    variant = "_split" if proj_accumulators == "split" else ("_k2" if proj_k_split == 2 else "")
                    fn, operands = f"csa2_proj_tf32x3_regs{variant}<{block_g // 16}, {D + row_pad}>", (rot_s, wk_hi, k_s)
                T.call_extern("handle", fn, *[T.address_of(buf[0, 0]) for buf in operands])
                T.sync_threads()
            elif wk == "fp32":
                # Half the L2 -> SM bytes of "hi_lo": the chunk of Wk itself, split here like the latent.
                for kc in T.Pipelined(D // k_chunk, num_stages=wk_stages):
                    T.copy(wk_hi[:, kc * k_chunk : (kc + 1) * k_chunk], w_st)
                    split_tf32_tile(rot_s, a_hi, a_lo, kc, block_g, k_chunk)
                    split_tf32_tile(w_st, b_hi, b_lo, 0, DI, k_chunk)
                    T.gemm(a_lo, b_hi, kacc, transpose_B=True)
                    T.gemm(a_hi, b_lo, kacc, transpose_B=True)
                    T.gemm(a_hi, b_hi, kacc, transpose_B=True)
            elif proj == "tf32x3" and load == "staged":
                # The weight chunks by async copies, double-buffered, so the L2 -> SM stream of Wk (512 KiB
                # hi + lo per CTA) overlaps the split and the MMAs instead of stalling each chunk.
                for kc in T.Pipelined(D // k_chunk, num_stages=wk_stages):
                    T.copy(wk_hi[:, kc * k_chunk : (kc + 1) * k_chunk], b_hi)
                    T.copy(wk_lo[:, kc * k_chunk : (kc + 1) * k_chunk], b_lo)
                    split_tf32_tile(rot_s, a_hi, a_lo, kc, block_g, k_chunk)
                    T.gemm(a_lo, b_hi, kacc, transpose_B=True)
                    T.gemm(a_hi, b_lo, kacc, transpose_B=True)
                    T.gemm(a_hi, b_hi, kacc, transpose_B=True)
            else:
                for kc in T.serial(D // k_chunk):
                    if proj == "tf32x3":
                        for n, kk in T.Parallel(DI, k_chunk):
                            b_hi[n, kk] = wk_hi[n, kc * k_chunk + kk]
                            b_lo[n, kk] = wk_lo[n, kc * k_chunk + kk]
                        for i, kk in T.Parallel(block_g, k_chunk):
                            x = rot_s[i, kc * k_chunk + kk]
                            xh = T.reinterpret(T.reinterpret(x, "uint32") & T.uint32(0xFFFFE000), "float32")
                            a_hi[i, kk] = xh
                            a_lo[i, kk] = x - xh
                        T.gemm(a_lo, b_hi, kacc, transpose_B=True)
                        T.gemm(a_hi, b_lo, kacc, transpose_B=True)
                        T.gemm(a_hi, b_hi, kacc, transpose_B=True)
                    else:
                        for n, kk in T.Parallel(DI, k_chunk):
                            b_hi[n, kk] = wk_hi[n, kc * k_chunk + kk] + wk_lo[n, kc * k_chunk + kk]
                        for kk in T.serial(k_chunk):
                            for i, n in T.Parallel(block_g, DI):
                                kacc[i, n] += rot_s[i, kc * k_chunk + kk] * b_hi[n, kk]
            # 6. k_norm, RoPE, FP4 into the index cache: E8M0 (power of two) scale per 32.
            if block_g >= 32 and not regs:
                for i, n in T.Parallel(block_g, DI):
                    ksq[i, n] = kacc[i, n] * kacc[i, n]
                T.reduce_sum(ksq, kss, dim=1)
                for i, n in T.Parallel(block_g, DI):
                    k_s[i, n] = kacc[i, n] * T.rsqrt(kss[i] / DI + eps[0]) * kw_s[n]
            else:
                # A 16-row MMA accumulator layout cannot feed TileLang's row reduction directly:
                # stage the projection through shared memory and reduce a fresh fragment (proj_operands=registers:
                # the projection is in k_s already).
                if not regs:
                    T.copy(kacc, k_s)
                for i, n in T.Parallel(block_g, DI):
                    ksq[i, n] = k_s[i, n] * k_s[i, n]
                T.reduce_sum(ksq, kss, dim=1)
                for i, n in T.Parallel(block_g, DI):
                    k_s[i, n] = k_s[i, n] * T.rsqrt(kss[i] / DI + eps[0]) * kw_s[n]
            _rope_last_dims(k_s, DI, block_g, g0, G, cos, sin)
            for i, q in T.Parallel(block_g, DI // INDEX_GROUP):
                amax_i[i, q] = 0.0
                for e in T.serial(INDEX_GROUP):
                    # Same reason: 32-word groups put every thread of a warp on one bank without the rotation.
                    amax_i[i, q] = T.max(amax_i[i, q], T.abs(k_s[i, q * INDEX_GROUP + (e + q * 8 + i) % INDEX_GROUP]))
            for i, q in T.Parallel(block_g, DI // INDEX_GROUP):
                v = T.max(amax_i[i, q], 6.0 * 2.0**-126) / 6.0
                bits = T.reinterpret(v, "uint32")
                byte = T.Cast("int32", (bits >> 23) & 0xFF) + T.Cast("int32", (bits & 0x7FFFFF) != 0)  # ceil(log2 v) + 127
                byte = T.min(T.max(byte, 1), 254)
                sbyte_i[i, q] = T.Cast("uint8", byte)
                if encode == "thresholds":
                    # The exact inverse 2^(127 - byte): normal for byte <= 253, the denormal 2^-127 for 254.
                    # x * 2^-e and x / 2^e are the same real number, so both round to the same fp32.
                    inv = T.if_then_else(byte <= 253, T.Cast("uint32", 254 - byte) << 23, T.uint32(0x00400000))
                    scale_i[i, q] = T.reinterpret(inv, "float32")
                else:
                    scale_i[i, q] = T.reinterpret(T.Cast("uint32", byte) << 23, "float32")
            for i, j in T.Parallel(block_g, DI // 2):
                sc = scale_i[i, j // (INDEX_GROUP // 2)]
                if encode == "thresholds":
                    lo = e2m1_code_search(k_s[i, 2 * j] * sc)
                    hi = e2m1_code_search(k_s[i, 2 * j + 1] * sc)
                else:
                    lo = e2m1_code(T.clamp(k_s[i, 2 * j] / sc, -6.0, 6.0))
                    hi = e2m1_code(T.clamp(k_s[i, 2 * j + 1] / sc, -6.0, 6.0))
                bytes_i[i, j] = T.Cast("uint8", lo | (hi << 4))
            # 7. Stores (rows past G are masked by the copy's bounds).
            if not flat:
                T.copy(bytes_m, main_packed[b, g0 : g0 + block_g, :])
                T.copy(sbyte_m, main_scales[b, g0 : g0 + block_g, :])
            T.copy(bytes_i, idx_packed[b, g0 : g0 + block_g, :])
            T.copy(sbyte_i, idx_scales[b, g0 : g0 + block_g, :])

    # The flat kernel (ctas_per_sm > 1 or schedule=flat): no warp specialisation (no producer warpgroup whose
    # setmaxnreg would assume the whole register file); the staged copies are issued by the same threads, num_stages ahead.
    pass_configs = {"tl.disable_warp_specialized": True} if flat else None
    kernel = tilelang.compile(compress, target=tvm.target.Target(cuda_target(target)), pass_configs=pass_configs)
    # what the launchers pass as (wk_hi, wk_lo): see wk_args
    kernel.csa2_wk = ("fragments_k2" if proj_k_split == 2 else "fragments") if regs else wk
    if f16x3:
        kernel.csa2_wk = "fragments_f16_k2" if proj_k_split == 2 else "fragments_f16"
    return kernel
