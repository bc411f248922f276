"""The attention kernel builders: ``sparse_attn_kernel`` (checks the options, builds the pipelined schedule, hands the
warp-specialised one to :mod:`tiles.sparse_attn.ws_kernel`) and ``combine_kernel`` (merges split partials with the sink)."""

import tilelang.language as T

from tiles.sparse_attn.dequant import e2m1_value, e8m0_value
from tiles.sparse_attn.kv_layout import kv_buffer
from tiles.sparse_attn.online_softmax import LOG2E, online_softmax
from tiles.sparse_attn.options import IOS, PARTIALS, UNUSED_ROWS, blocks_per_token, halves_refusal, overlapped_refusal
from tiles.sparse_attn.ws_kernel import sparse_attn_ws


def sparse_attn_kernel(
    heads: int,
    dim: int,
    window: int,
    topk: int,
    sm_scale: float,
    kv_format: str = "fp4",
    n_split: int = 1,
    block_I: int = 64,
    num_stages: int = 2,
    threads: int = 256,
    heads_per_block: int = 64,
    dequant: str = "direct",
    schedule: str = "pipelined",
    produce: str = "serial",
    io: str = "direct",
    consumers: str = "wg0_scores",
    wg1_rows: int = 0,
    tokens_per_cta: int = 1,
    combine: str = "separate",
    handoff: str = "after_pv",
    lanes: str = "row",
    fp4_decode: str = "fma",
    partials: str = "fp32",
    unused_rows: str = "row0",
    window_shared: bool = False,
    main_shared: bool = False,
):
    """Build the attention prim_func (B, S, Nw, Nc are dynamic; everything else is specialised).

    Inputs (``kv_format="fp4"``): Q bf16 [B, S, H, D]; WinCodes float8_e4m3fn [B, Nw, D];
    WinScales uint8 [B, Nw, D/32] (E8M0); WinIdx int32 [B, S, W]; MainPacked int32 [B, Nc, D/8] (the packed bytes viewed as words);
    MainScales float8_e4m3fn [B, Nc, D/16]; TopkIdx int32 [B, S, K]; Sink fp32 [H].
    ``kv_format="bf16"``: WinKV bf16 [B, Nw, D] and MainKV bf16 [B, Nc, D] instead of codes/scales.
    Outputs: ``n_split == 1``: Out bf16 [B, S, H, D]; else OPart fp32 [B, S, n_split, H, D] (each
    split normalised by its own sum) and LsePart fp32 [B, S, n_split, H] (log2 domain, -inf = empty).
    ``schedule="ws", produce="batched"`` takes the FP8 window codes as int32 words [B, Nw, D/4] and the
    E4M3 main scales as uint8 [B, Nc, D/16] (see :func:`ws_argument_views`).
    ``combine="fused"`` (ws, ``n_split > 1``): Out is bf16 [B, S, H, D], then LsePart fp32 [B, S, NS, H],
    OPart fp32 [B, S, NS, H, D] (scratch) and Counter int32 [B, S, H / heads_per_block] (zero before the launch,
    left zero after it).
    ``partials="bf16"`` (ws, ``consumers="wg0_scores"``, separate combine): OPart is bf16, staged out like O.
    ``window_shared`` / ``main_shared``: that cache is one pool read by every batch row, passed with batch stride 0
    (:mod:`tiles.sparse_attn.kv_layout`); its indices are rows of the pool.
    """
    if consumers == "auto":
        raise ValueError("consumers='auto' is resolved per call first: resolve_consumers")
    if combine == "fused" and (schedule != "ws" or n_split == 1 or tokens_per_cta != 1):
        raise ValueError("combine='fused' merges split partials in the ws kernel: schedule='ws', n_split > 1, tokens_per_cta=1")
    if partials not in PARTIALS:
        raise ValueError(f"unknown partials {partials!r}: use one of {', '.join(PARTIALS)}")
    if unused_rows not in UNUSED_ROWS or (unused_rows != "row0" and (kv_format != "bf16" or schedule != "ws" or produce != "batched")):
        raise ValueError(f"unused_rows {unused_rows!r}: one of {', '.join(UNUSED_ROWS)}; 'zeros' is the ws batched producer's bf16 KV copy")
    if partials == "bf16" and (schedule != "ws" or consumers != "wg0_scores" or combine != "separate"):
        raise ValueError("partials='bf16' is built into the ws kernel's wg0_scores consumers with the separate combine")
    if io not in IOS:
        raise ValueError(f"unknown io {io!r}: use one of {', '.join(IOS)} ('auto' is resolved per call first: resolve_io)")
    blocks = blocks_per_token(window, topk, block_I)
    if io == "overlapped" and (
        why := overlapped_refusal(schedule, produce, consumers, wg1_rows, tokens_per_cta, n_split, block_I, kv_format, blocks)
    ):
        raise ValueError(why)
    if consumers == "paired_halves" and (why := halves_refusal(schedule, produce, tokens_per_cta, kv_format, io)):
        raise ValueError(why)
    if schedule == "ws":
        return sparse_attn_ws(
            heads,
            dim,
            window,
            topk,
            sm_scale,
            kv_format,
            n_split,
            block_I,
            heads_per_block,
            produce,
            io,
            consumers,
            wg1_rows,
            tokens_per_cta,
            combine,
            handoff,
            lanes,
            fp4_decode,
            partials,
            unused_rows,
            window_shared,
            main_shared,
        )
    B, S, Nw, Nc = T.dynamic("B"), T.dynamic("S"), T.dynamic("Nw"), T.dynamic("Nc")
    H, D, W, K, BI, HB, NS = heads, dim, window, topk, block_I, heads_per_block, n_split
    REP = H // HB
    NBW, NBK = -(-W // BI), -(-K // BI)
    EW, EK = -(-NBW // NS), -(-NBK // NS)
    scale2 = sm_scale * LOG2E
    bf16, f32 = "bfloat16", "float32"
    fp4 = kv_format == "fp4"
    staged = dequant == "staged" and fp4
    out_shape = [B, S, H, D] if NS == 1 else [B, S, NS, H, D]
    # Staged schedule, spelled out (the inferred one cannot order the raw buffers' write/read pair); 16 statements =
    # index load, 2 raw copies, dequant, the 12 of _attend. num_stages=2 prefetches the next block's raw bytes.
    k_order = list(range(16)) if staged else None
    k_stage = [0, 0, 0] + [num_stages - 1] * 13 if staged else None

    win_args = ([B, Nw, D], "float8_e4m3fn", [B, Nw, D // 32], "uint8") if fp4 else ([B, Nw, D], bf16, [1], "uint8")
    # Packed FP4 is read as int32 words (8 codes each, inside one 16-wide scale group): one load per 8 values.
    main_args = ([B, Nc, D // 8], "int32", [B, Nc, D // 16], "float8_e4m3fn") if fp4 else ([B, Nc, D], bf16, [1], "uint8")

    @T.prim_func
    def main(
        Q: T.Tensor([B, S, H, D], bf16),
        WinA: kv_buffer(win_args[0], win_args[1], window_shared),
        WinB: kv_buffer(win_args[2], win_args[3], window_shared),
        WinIdx: T.Tensor([B, S, W], "int32"),
        MainA: kv_buffer(main_args[0], main_args[1], main_shared),
        MainB: kv_buffer(main_args[2], main_args[3], main_shared),
        TopkIdx: T.Tensor([B, S, K], "int32"),
        Sink: T.Tensor([H], f32),
        Out: T.Tensor(out_shape, bf16 if NS == 1 else f32),
        LsePart: T.Tensor([B, S, NS, H], f32),
    ):
        with T.Kernel(S * REP, B, NS, threads=threads) as (bx, by, bz):
            Q_shared = T.alloc_shared([HB, D], bf16)
            KV_shared = T.alloc_shared([BI, D], bf16)
            S_shared = T.alloc_shared([HB, BI], bf16)
            idx_shared = T.alloc_shared([BI], "int32")
            # The staged top-k loop's indices in their own buffer: its explicit pipeline double-buffers them, and with
            # one window block per split (n_split > 1: the window loop has one iteration and is not pipelined) TileLang
            # kept the shared [BI] buffer at one version while the top-k loop addressed two: the second block's indices
            # landed in the first 256 bytes of KV_shared (wrong outputs on the H200, caught by the tuner's check, 5f78fe9;
            # generated CUDA: idx_shared at +32768, KV_shared at +33024, 6587138).
            # (Only the staged path allocates it; the others name idx_shared at each use: binding an alias renames the
            # buffer in the generated source.)
            idx_k_shared = T.alloc_shared([BI], "int32") if staged else None
            if staged:
                raw_shared = T.alloc_shared([BI, D // 8], "int32")
                rawsc_shared = T.alloc_shared([BI, D // 16], "float8_e4m3fn")
            acc_o = T.alloc_fragment([HB, D], f32)
            acc_s = T.alloc_fragment([HB, BI], f32)
            sumexp = T.alloc_fragment([HB], f32)
            sumexp_i = T.alloc_fragment([HB], f32)
            alpha = T.alloc_fragment([HB], f32)
            m_i = T.alloc_fragment([HB], f32)
            m_i_prev = T.alloc_fragment([HB], f32)

            b_i, s_i = by, bx // REP
            h0 = (bx % REP) * HB
            # This split's share of each list: EW window blocks from bz * EW and EK top-k blocks from bz * EK.
            # Static trip counts: dynamic ones made T.Pipelined emit wrong code at 8 splits and fail to compile
            # at 2 or 4 (GPU runs 1-2). A block past the end of its list is masked by ``pos < W`` / ``pos < K``.
            w_lo, k_lo = bz * EW, bz * EK

            T.fill(acc_o, 0)
            T.fill(sumexp, 0)
            T.fill(m_i, -(2**30))  # finite so that an all-masked block gives exp2(-inf) = 0, not NaN
            T.copy(Q[b_i, s_i, h0 : h0 + HB, :], Q_shared)

            for i in T.Pipelined(EW, num_stages=num_stages):
                blk = w_lo + i
                for bi in T.Parallel(BI):
                    pos = blk * BI + bi
                    idx_shared[bi] = T.if_then_else(pos < W, WinIdx[b_i, s_i, T.min(pos, W - 1)], -1)
                if fp4:
                    for bi, d in T.Parallel(BI, D):
                        row = T.max(idx_shared[bi], 0)
                        val = T.cast(WinA[b_i, row, d], f32) * e8m0_value(WinB[b_i, row, d // 32])
                        KV_shared[bi, d] = T.if_then_else(idx_shared[bi] >= 0, T.cast(val, bf16), T.cast(0, bf16))
                else:
                    for bi, d in T.Parallel(BI, D):
                        row = T.max(idx_shared[bi], 0)
                        KV_shared[bi, d] = T.if_then_else(idx_shared[bi] >= 0, WinA[b_i, row, d], T.cast(0, bf16))
                _attend(Q_shared, KV_shared, S_shared, idx_shared, acc_s, acc_o, sumexp, sumexp_i, alpha, m_i, m_i_prev, HB, BI, D, scale2)

            for i in T.Pipelined(EK, num_stages=0 if staged else num_stages, order=k_order, stage=k_stage):
                blk = k_lo + i
                for bi in T.Parallel(BI):
                    pos = blk * BI + bi
                    (idx_k_shared if staged else idx_shared)[bi] = T.if_then_else(pos < K, TopkIdx[b_i, s_i, T.min(pos, K - 1)], -1)
                if staged:
                    # the raw copies take their rows from global, not idx_shared: both are cp.async in one stage
                    for bi, j in T.Parallel(BI, D // 8):
                        raw_shared[bi, j] = MainA[b_i, T.max(TopkIdx[b_i, s_i, T.min(blk * BI + bi, K - 1)], 0), j]
                    for bi, j in T.Parallel(BI, D // 16):
                        rawsc_shared[bi, j] = MainB[b_i, T.max(TopkIdx[b_i, s_i, T.min(blk * BI + bi, K - 1)], 0), j]
                    for bi, d in T.Parallel(BI, D):
                        nib = T.shift_right(raw_shared[bi, d // 8], (d % 8) * 4) & 15
                        val = e2m1_value(nib) * T.cast(rawsc_shared[bi, d // 16], f32)
                        KV_shared[bi, d] = T.if_then_else(idx_k_shared[bi] >= 0, T.cast(val, bf16), T.cast(0, bf16))
                elif fp4:
                    for bi, d in T.Parallel(BI, D):
                        row = T.max(idx_shared[bi], 0)
                        nib = T.shift_right(MainA[b_i, row, d // 8], (d % 8) * 4) & 15
                        val = e2m1_value(nib) * T.cast(MainB[b_i, row, d // 16], f32)
                        KV_shared[bi, d] = T.if_then_else(idx_shared[bi] >= 0, T.cast(val, bf16), T.cast(0, bf16))
                else:
                    for bi, d in T.Parallel(BI, D):
                        row = T.max(idx_shared[bi], 0)
                        KV_shared[bi, d] = T.if_then_else(idx_shared[bi] >= 0, MainA[b_i, row, d], T.cast(0, bf16))
                _attend(
                    Q_shared,
                    KV_shared,
                    S_shared,
                    idx_k_shared if staged else idx_shared,
                    acc_s,
                    acc_o,
                    sumexp,
                    sumexp_i,
                    alpha,
                    m_i,
                    m_i_prev,
                    HB,
                    BI,
                    D,
                    scale2,
                )

            if NS == 1:
                # Final normalisation with the sink: max over (scores, sink) keeps exp2 in range.
                for h in T.Parallel(HB):
                    alpha[h] = T.max(m_i[h] * scale2, Sink[h0 + h] * LOG2E)
                    sumexp_i[h] = sumexp[h] * T.exp2(m_i[h] * scale2 - alpha[h]) + T.exp2(Sink[h0 + h] * LOG2E - alpha[h])
                    # zero denominator only without a sink (sink = -inf) and no valid index: the row is zeros
                    sumexp_i[h] = T.if_then_else(sumexp_i[h] > 0, T.exp2(m_i[h] * scale2 - alpha[h]) / sumexp_i[h], 0.0)
                for h, d in T.Parallel(HB, D):
                    acc_o[h, d] = acc_o[h, d] * sumexp_i[h]
                T.copy(acc_o, Out[b_i, s_i, h0 : h0 + HB, :])
            else:
                for h in T.Parallel(HB):
                    alpha[h] = T.if_then_else(sumexp[h] > 0, 1.0 / sumexp[h], 0.0)
                    LsePart[b_i, s_i, bz, h0 + h] = T.if_then_else(
                        sumexp[h] > 0, T.log2(T.max(sumexp[h], 1e-30)) + m_i[h] * scale2, -T.infinity(f32)
                    )
                for h, d in T.Parallel(HB, D):
                    acc_o[h, d] = acc_o[h, d] * alpha[h]
                T.copy(acc_o, Out[b_i, s_i, bz, h0 : h0 + HB, :])

    return main


@T.macro
def _attend(Q_shared, KV_shared, S_shared, idx_shared, acc_s, acc_o, sumexp, sumexp_i, alpha, m_i, m_i_prev, HB, BI, D, scale2):
    """One block of BI gathered rows: scores, online-softmax update, PV accumulate."""
    for h, bi in T.Parallel(HB, BI):
        acc_s[h, bi] = T.if_then_else(idx_shared[bi] >= 0, 0, -T.infinity("float32"))
    T.gemm(Q_shared, KV_shared, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
    online_softmax(acc_s, acc_o, sumexp, sumexp_i, alpha, m_i, m_i_prev, HB, BI, D, scale2)
    # When a row of S spans warps (e.g. 32 heads over 4 warps), the softmax's row max and sum go through a shared
    # workspace that TileLang's planner places on S_shared's bytes, and no barrier separates the last read of it
    # (inside tl::AllReduce, after its own bar.sync) from a faster warp's store of P below: a race that changed
    # outputs run to run (H200: 19 of 19 runs of the sm89-style decode config differed, 0 of 19 after it; 21556ef). One
    # barrier orders them.
    T.sync_threads()
    T.copy(acc_s, S_shared)
    T.gemm(S_shared, KV_shared, acc_o, policy=T.GemmWarpPolicy.FullRow)


def combine_kernel(heads: int, dim: int, n_split: int, threads: int = 128, partials: str = "fp32"):
    """Merge split partials with the sink: OPart fp32 (``partials="bf16"``: bf16) [B, S, NS, H, D], LsePart fp32
    [B, S, NS, H], Sink fp32 [H] -> Out bf16 [B, S, H, D]. One block per (token, head); the sum in fp32."""
    B, S = T.dynamic("B"), T.dynamic("S")
    H, D, NS = heads, dim, n_split
    f32 = "float32"

    # named apart from the attention kernel ("main_kernel") so profilers report the two separately
    @T.prim_func
    def combine(
        OPart: T.Tensor([B, S, NS, H, D], "bfloat16" if partials == "bf16" else f32),
        LsePart: T.Tensor([B, S, NS, H], f32),
        Sink: T.Tensor([H], f32),
        Out: T.Tensor([B, S, H, D], "bfloat16"),
    ):
        with T.Kernel(H, S, B, threads=threads) as (h, s, b):
            w = T.alloc_local([NS], f32)
            m = T.alloc_local([1], f32)
            den = T.alloc_local([1], f32)
            acc = T.alloc_fragment([D], f32)
            m[0] = T.max(Sink[h] * LOG2E, -1e30)  # finite even without a sink (-inf), so exp2 never sees -inf - -inf
            for k in T.serial(NS):
                m[0] = T.max(m[0], LsePart[b, s, k, h])
            den[0] = T.exp2(Sink[h] * LOG2E - m[0])
            for k in T.serial(NS):
                w[k] = T.exp2(LsePart[b, s, k, h] - m[0])
                den[0] = den[0] + w[k]
            T.fill(acc, 0)
            for k in T.serial(NS):
                for d in T.Parallel(D):
                    acc[d] = acc[d] + OPart[b, s, k, h, d] * w[k]
            for d in T.Parallel(D):
                Out[b, s, h, d] = T.cast(T.if_then_else(den[0] > 0, acc[d] / den[0], 0.0), "bfloat16")

    return combine
