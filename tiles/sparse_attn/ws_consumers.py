"""The ws kernel's consumer warpgroups, as TileLang macros: warpgroup 0's scores and online softmax with warpgroup 1
on P V (wg0_scores), the balanced, seesaw and paired schedules, each token's prologue and epilogue (Q in, O out,
the sink), and the fused split combine."""

from typing import Any, NamedTuple

import tilelang.language as T

from tiles.sparse_attn.online_softmax import LOG2E, online_softmax
from tiles.sparse_attn.ws_producer import ws_fetch_rows, ws_issue_main_loads, ws_wg1_fill

# The fused combine's release fence (see _ws_fused_combine). TileLang 0.1.15 has atomics with a memory order
# (T.atomic_add(..., memory_order=, return_prev=)) but no standalone fence.
FUSE_CUDA = r"""
// Orders this thread's earlier global stores before its later operations at GPU scope (a release fence, cheaper
// than __threadfence's fence.sc.gpu).
__device__ __forceinline__ void csa2_fence_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
// Keeps the compiler from moving loads across it (no instruction): bounds the loads in flight, hence the registers.
__device__ __forceinline__ void csa2_compiler_fence() { asm volatile("" ::: "memory"); }
"""


@T.macro
def _ws_softmax_step(sm, buf, it, HB, BI, D2, scale2, early_p=False, ovl=None):
    """Warpgroup 0's step on one KV buffer: S = Q K^T, online softmax, its half of O += P V.

    ``early_p`` (``handoff="before_pv"``): P and alpha go to warpgroup 1 before this warpgroup's P V instead of
    after it, so both halves of P V run together and the buffer frees one P V earlier; the shared-memory stores
    are fenced for the async proxy first (warpgroup 1's wgmma reads them).

    ``ovl``: see :func:`_ws_hand_back`."""
    Q_l, Q_r, S_shared, alpha_shared, acc_s, acc_o, sumexp, sumexp_i, alpha, m_i, m_i_prev, bar_s_ready, bar_s_free = sm
    KV_l, KV_r, valid, bar_ready, bar_free = buf[:5]
    T.barrier_wait(bar_ready, (it // 2) & 1)
    for h, bi in T.Parallel(HB, BI):
        acc_s[h, bi] = T.if_then_else(valid[bi], 0, -T.infinity("float32"))
    T.wgmma_gemm(Q_l, KV_l, acc_s, transpose_B=True)
    T.wgmma_gemm(Q_r, KV_r, acc_s, transpose_B=True)
    T.wait_wgmma(0)
    if it != 0:
        # S_shared and alpha_shared are reused: warpgroup 1 must be done with the previous step.
        T.barrier_arrive(bar_s_free)
        T.barrier_wait(bar_s_free, (it & 1) ^ 1)
    online_softmax(acc_s, acc_o, sumexp, sumexp_i, alpha, m_i, m_i_prev, HB, BI, D2, scale2)
    T.copy(alpha, alpha_shared)
    T.copy(acc_s, S_shared)
    if early_p:
        T.fence_proxy_async()
        T.barrier_arrive(bar_s_ready)
        T.gemm(S_shared, KV_l, acc_o)
    else:
        T.gemm(S_shared, KV_l, acc_o)
        T.barrier_arrive(bar_s_ready)
    _ws_hand_back(bar_free, ovl)


@T.macro
def _ws_hand_back(bar_free, ovl):
    """A consumer warpgroup is done with a KV buffer: arrive on its free barrier. ``ovl`` (``io="overlapped"``: the
    WsCta, the token j, its block it): the token's last block's buffer is kept, O is staged into it
    (:func:`_ws_ovl_stage_o` hands it back)."""
    if ovl is None:
        T.barrier_arrive(bar_free)
    else:
        if ovl[2] != ovl[0].n_blk - 1:
            T.barrier_arrive(bar_free)


BALANCED_NREG = 200  # per consumer thread under consumers="balanced": O half (128) + S half (16) + softmax + addresses


class WsHalf(NamedTuple):
    """One consumer warpgroup's part under ``consumers="balanced"``: which half it is, the Q half it loads (and, with
    one split, stages its O half through), and its own fragments."""

    w: int  # 0: rows [0, BI/2) of each block and the left half of O; 1: rows [BI/2, BI) and the right half
    Q_own: Any
    acc_s: Any  # [HB, BI/2] its scores, then its P columns
    acc_o: Any  # [HB, D/2] its half of O
    sumexp: Any  # partial row sums over its columns (both warpgroups share the running max)
    sumexp_i: Any
    alpha: Any
    m_i: Any
    m_i_prev: Any


class WsPair(NamedTuple):
    """What the two balanced consumer warpgroups share: Q, the outputs, the P tile, and the exchange buffers/barriers."""

    Q: Any
    Q_l: Any
    Q_r: Any
    Out: Any
    LsePart: Any
    Sink: Any
    S_shared: Any  # [HB, BI] bf16: P, warpgroup w writing columns [w BI/2, (w+1) BI/2)
    rowmax_shared: Any  # [2, HB] each warpgroup's row max of the current block
    rowsum_shared: Any  # [2, HB] each warpgroup's final partial row sum
    bar_q: Any
    bar_max: Any
    bar_p: Any
    bar_final: Any


@T.macro
def ws_balanced_consumer(half, pair, bufs, b_i, s_i, h0, bz, n_blk, HB, BI, D2, NS, scale2, io, overlap, fuse):
    """Consumer warpgroup ``half.w`` under ``consumers="balanced"`` (or ``"balanced_overlap"``: ``overlap``): Q load,
    the block loop, the sink and the O store (``fuse``: the fused combine's :class:`WsFuse`, else None)."""
    Sink, Out, LsePart = pair.Sink, pair.Out, pair.LsePart
    _ws_halves_prologue(half, pair.Q, pair.bar_q, b_i, s_i, h0, HB, D2, io)
    for it in T.serial(n_blk):
        if it % 2 == 0:
            _ws_balanced_step(half, pair, bufs[0], bufs[1], it, HB, BI // 2, D2, scale2, overlap)
        else:
            _ws_balanced_step(half, pair, bufs[1], bufs[0], it, HB, BI // 2, D2, scale2, overlap)
    if overlap:  # the last block's P V is still in flight
        T.wait_wgmma(0)
    _ws_halves_epilogue(half, pair.rowsum_shared, pair.bar_final, Sink, Out, LsePart, b_i, s_i, h0, bz, HB, D2, NS, scale2, io, fuse)


@T.macro
def _ws_halves_prologue(half, Q, bar_q, b_i, s_i, h0, HB, D2, io, j=0):
    """The start of a token for the consumer schedules of :func:`_ws_halves_epilogue`: with ``io="staged"`` this
    warpgroup's Q half in 16-byte vectors (``io="direct"``: all threads loaded Q before the roles split; ``"overlapped"``
    (paired_halves): the CTA's first token's like staged, later ones' came by cp.async in the token before, their
    arrivals counting); O, the row sum and the running max cleared; then the wait until both Q halves are in (``j``:
    the CTA's token, the barrier's phase)."""
    w, Q_own, _, acc_o, sumexp, _, _, m_i, _ = half
    if io == "staged":
        T.copy(Q[b_i, s_i, h0 : h0 + HB, w * D2 : (w + 1) * D2], Q_own)
        T.fence_proxy_async()  # generic-proxy stores, read by wgmma (async proxy) after the barrier
        T.barrier_arrive(bar_q)
    elif io == "overlapped":  # noqa: SIM102  (a Python flag around a TileLang condition)
        if j == 0:
            T.copy(Q[b_i, s_i, h0 : h0 + HB, w * D2 : (w + 1) * D2], Q_own)
            T.fence_proxy_async()
            T.barrier_arrive(bar_q)
    T.fill(sumexp, 0)
    T.fill(m_i, -(2**30))
    T.fill(acc_o, 0)
    T.barrier_wait(bar_q, j & 1)


@T.macro
def _ws_halves_epilogue(
    half, rowsum_shared, bar_final, Sink, Out, LsePart, b_i, s_i, h0, bz, HB, D2, NS, scale2, io, fuse=None, j=0, ptile=None
):
    """The end of a token for the consumer schedules whose warpgroups each keep a partial row sum under one shared
    running max (``balanced``, ``seesaw``, ``paired``): the two sums meet (past this barrier both warpgroups' last
    QK^T is done, so Q is free), then the sink, the final scale and this warpgroup's half of O (or the split's
    partial), staged through its Q half with ``io="staged"``; ``fuse``: the fused combine's (balanced only). ``j``: the
    CTA's token (the final barrier's phase). ``ptile`` (paired_halves with io="overlapped", where Q already holds the
    next token's and both KV buffers the next pair's rows): (this warpgroup's [HB, BI] P tile, the barrier the other's
    P V of it completes on, that wait's phase, a 128-arrival barrier of this warpgroup): O goes out through the P tile
    in chunks of BI columns, in 16-byte vectors."""
    w, Q_own, _, acc_o, sumexp, sumexp_i, alpha, m_i, _ = half
    for h in T.Parallel(HB):
        rowsum_shared[w, h] = sumexp[h]
    T.barrier_arrive(bar_final)
    T.barrier_wait(bar_final, j & 1)
    for h in T.Parallel(HB):
        sumexp[h] = rowsum_shared[0, h] + rowsum_shared[1, h]  # the same order in both warpgroups
    if NS == 1:
        for h in T.Parallel(HB):  # alpha: first M = max(m, sink) (no overflow for a large sink), then the final scale
            alpha[h] = T.max(m_i[h] * scale2, Sink[h0 + h] * LOG2E)
            sumexp_i[h] = sumexp[h] * T.exp2(m_i[h] * scale2 - alpha[h]) + T.exp2(Sink[h0 + h] * LOG2E - alpha[h])
            alpha[h] = T.if_then_else(sumexp_i[h] > 0, T.exp2(m_i[h] * scale2 - alpha[h]) / sumexp_i[h], 0.0)
    else:
        for h in T.Parallel(HB):
            alpha[h] = T.if_then_else(sumexp[h] > 0, 1.0 / sumexp[h], 0.0)
        if w == 0:
            for h in T.Parallel(HB):
                LsePart[b_i, s_i, bz, h0 + h] = T.if_then_else(
                    sumexp[h] > 0, T.log2(T.max(sumexp[h], 1e-30)) + m_i[h] * scale2, -T.infinity("float32")
                )
    for h, d in T.Parallel(HB, D2):
        acc_o[h, d] = acc_o[h, d] * alpha[h]
    if ptile is not None:
        tile, bar_tile_free, phase, bar_own = ptile
        T.barrier_wait(bar_tile_free, phase)  # the other warpgroup's P V of the token's last pair has read the tile
        BI = tile.shape[1]
        for c in T.unroll(D2 // BI):
            for h, d in T.Parallel(HB, BI):
                tile[h, d] = acc_o[h, c * BI + d]
            T.barrier_arrive(bar_own)
            T.barrier_wait(bar_own, 0)  # every chunk's writes are in (phases 2c)
            T.copy(tile, Out[b_i, s_i, h0 : h0 + HB, w * D2 + c * BI : w * D2 + (c + 1) * BI])
            T.barrier_arrive(bar_own)
            T.barrier_wait(bar_own, 1)  # ... and read before the next chunk overwrites them (phases 2c + 1)
    elif NS == 1 and io == "staged":
        T.copy(acc_o, Q_own)
        T.copy(Q_own, Out[b_i, s_i, h0 : h0 + HB, w * D2 : (w + 1) * D2])
    elif NS == 1:
        T.copy(acc_o, Out[b_i, s_i, h0 : h0 + HB, w * D2 : (w + 1) * D2])
    elif fuse is None:
        T.copy(acc_o, Out[b_i, s_i, bz, h0 : h0 + HB, w * D2 : (w + 1) * D2])
    else:
        T.copy(acc_o, fuse.OPart[b_i, s_i, bz, h0 : h0 + HB, w * D2 : (w + 1) * D2])
        _ws_fused_combine(fuse, w, acc_o, Q_own, b_i, s_i, h0, bz, HB, D2, NS, io)


@T.macro
def _ws_balanced_step(half, pair, buf, prev_buf, it, HB, BI2, D2, scale2, overlap):
    """Warpgroup ``half.w``'s step on one KV buffer: S for its BI2 rows, the block row max shared with the other
    warpgroup, its P columns into S_shared, then its half of O += P V over all 2 BI2 rows.

    ``overlap``: P V is issued without waiting; it completes together with the next step's QK^T (one wgmma wait per
    block instead of two, the tensor cores fed back to back), and the previous buffer is released there.
    """
    w, _, acc_s, acc_o, sumexp, sumexp_i, alpha, m_i, m_i_prev = half
    KV_l, KV_r, valid, bar_ready, bar_free = buf[:5]
    r0 = w * BI2
    T.barrier_wait(bar_ready, (it // 2) & 1)
    for h, j in T.Parallel(HB, BI2):
        acc_s[h, j] = T.if_then_else(valid[r0 + j], 0, -T.infinity("float32"))
    T.wgmma_gemm(pair.Q_l, KV_l[r0 : r0 + BI2, :], acc_s, transpose_B=True)
    T.wgmma_gemm(pair.Q_r, KV_r[r0 : r0 + BI2, :], acc_s, transpose_B=True)
    T.wait_wgmma(0)  # overlap: the previous step's P V too (wgmma groups complete in order)
    if overlap:  # noqa: SIM102  (a Python flag around a TileLang condition)
        if it != 0:
            T.barrier_arrive(prev_buf.free)
    T.copy(m_i, m_i_prev)
    T.reduce_max(acc_s, sumexp_i, dim=1)  # sumexp_i holds this half's block row max for a moment
    for h in T.Parallel(HB):
        pair.rowmax_shared[w, h] = sumexp_i[h]
    # Safe to overwrite rowmax_shared[w] here: the other warpgroup read it last step before arriving on bar_p.
    T.barrier_arrive(pair.bar_max)
    T.barrier_wait(pair.bar_max, it & 1)
    for h in T.Parallel(HB):
        m_i[h] = T.max(m_i[h], T.max(pair.rowmax_shared[0, h], pair.rowmax_shared[1, h]))  # the same in both
        alpha[h] = T.exp2((m_i_prev[h] - m_i[h]) * scale2)
    for h, j in T.Parallel(HB, BI2):
        acc_s[h, j] = T.exp2(acc_s[h, j] * scale2 - m_i[h] * scale2)
    T.reduce_sum(acc_s, sumexp_i, dim=1)
    for h in T.Parallel(HB):
        sumexp[h] = sumexp[h] * alpha[h] + sumexp_i[h]
    for h, d in T.Parallel(HB, D2):
        acc_o[h, d] = acc_o[h, d] * alpha[h]
    # Safe to overwrite S_shared here: the other warpgroup's P V of the last step (a synchronous gemm) finished
    # before it arrived on bar_max.
    T.copy(acc_s, pair.S_shared[:, r0 : r0 + BI2])
    T.fence_proxy_async()  # P goes to the other warpgroup's wgmma (async proxy)
    T.barrier_arrive(pair.bar_p)
    T.barrier_wait(pair.bar_p, it & 1)
    if overlap:
        # In flight past this step: the other warpgroup overwrites S_shared only after bar_max of the next step,
        # which this one reaches after waiting for this P V.
        T.wgmma_gemm(pair.S_shared, KV_l if w == 0 else KV_r, acc_o)
    else:
        T.gemm(pair.S_shared, KV_l if w == 0 else KV_r, acc_o)
        T.barrier_arrive(bar_free)


SEESAW_NREG = 208  # per consumer thread under consumers="seesaw": O half (128) + all of S (32) + softmax + addresses


class WsSeesaw(NamedTuple):
    """What the two seesaw consumer warpgroups share: Q, the outputs, each one's P tile and hand-over values, barriers."""

    Q: Any
    Q_l: Any
    Q_r: Any
    Out: Any
    LsePart: Any
    Sink: Any
    P: Any  # (warpgroup 0's, warpgroup 1's) [HB, BI] bf16 P of its latest block
    handed: Any  # [2, 2, HB] f32: [w, 0] warpgroup w's latest block's rescale of O and the sums, [w, 1] the max after it
    rowsum_shared: Any  # [2, HB] each warpgroup's final partial row sum
    bar_q: Any
    bar_p: Any  # (warpgroup 0's, warpgroup 1's) P, rescale and max handed over: 128 arrivals
    bar_p_free: Any  # (for warpgroup 0's P, for warpgroup 1's) the other's P V with it completed: 128 arrivals
    bar_final: Any
    bar_m: Any = None  # consumers="paired": (warpgroup 0's, warpgroup 1's) new running max handed over: 128 arrivals


@T.macro
def _ws_seesaw_take(half, see, other_buf, kp, HB, D2):
    """Warpgroup ``half.w`` takes the other's block (its ``kp``-th): wait for its P, rescale O and the row sum by the
    block's rescale, adopt the running max after it, and issue this half of O += P V (left in flight)."""
    w, _, _, acc_o, sumexp, _, alpha, m_i, _ = half
    T.barrier_wait(see.bar_p[1 - w], kp & 1)
    for h in T.Parallel(HB):
        alpha[h] = see.handed[1 - w, 0, h]
        m_i[h] = see.handed[1 - w, 1, h]
        sumexp[h] = sumexp[h] * alpha[h]
    for h, d in T.Parallel(HB, D2):
        acc_o[h, d] = acc_o[h, d] * alpha[h]
    T.wgmma_gemm(see.P[1 - w], other_buf.KV_l if w == 0 else other_buf.KV_r, acc_o)


@T.macro
def ws_seesaw_consumer(half, see, bufs, b_i, s_i, h0, bz, n_blk, max_blk, HB, BI, D2, NS, scale2, io):
    """Consumer warpgroup ``half.w`` under ``consumers="seesaw"``: Q load, its blocks g = w, w + 2, ... (in buffer w),
    the other's blocks in between, the sink and the O store. ``n_blk``: the split's blocks, at most ``max_blk`` (a
    Python int).

    Per own block g (the ``k``-th, g = 2 k + w): issue S = Q K^T; take the other's block g - 1 (its P V in flight,
    :func:`_ws_seesaw_take`), which also brings the running max m after g - 1; wait for S only (wgmma groups complete
    in order); the online softmax from that max; wait until the other has finished with this warpgroup's previous
    P; hand over P, the rescale and the new max; wait for the taken P V, release that buffer and P; rescale O; its
    half of O += P V for g. Both warpgroups see every block's rescale in the same order, so both carry the same
    running max and scale their own row sums alike; the sums meet at the end as under ``balanced``."""
    w, _, acc_s, acc_o, sumexp, sumexp_i, alpha, m_i, m_i_prev = half
    Sink, Out, LsePart = see.Sink, see.Out, see.LsePart
    own, other = bufs[w], bufs[1 - w]
    _ws_halves_prologue(half, see.Q, see.bar_q, b_i, s_i, h0, HB, D2, io)
    # A static trip count (the most blocks a split has) and a guard: with the trip count (n_blk + 1 - w) // 2, where it
    # can only be 0 or 1 (splits of 1-2 blocks) TileLang 0.1.15 replaced the loop by one unguarded pass, and a guard
    # inside it was proven true from the loop's own bound (the H200 hung on a buffer never filled, 77c213d).
    for k in T.serial((max_blk + 1 - w) // 2):
        if 2 * k + w < n_blk:
            T.barrier_wait(own.ready, k & 1)
            for h, bi in T.Parallel(HB, BI):
                acc_s[h, bi] = T.if_then_else(own.valid[bi], 0, -T.infinity("float32"))
            T.wgmma_gemm(see.Q_l, own.KV_l, acc_s, transpose_B=True)
            T.wgmma_gemm(see.Q_r, own.KV_r, acc_s, transpose_B=True)
            if w == 1 or k > 0:  # the other's block g - 1 (its (k + w - 1)-th) comes first in the running max
                _ws_seesaw_take(half, see, other, k + w - 1, HB, D2)
                T.wait_wgmma(1)  # S only: the taken P V stays in flight
            else:
                T.wait_wgmma(0)
            T.copy(m_i, m_i_prev)
            T.reduce_max(acc_s, m_i, dim=1, clear=False)
            for h in T.Parallel(HB):
                alpha[h] = T.exp2((m_i_prev[h] - m_i[h]) * scale2)
            for h, bi in T.Parallel(HB, BI):
                acc_s[h, bi] = T.exp2(acc_s[h, bi] * scale2 - m_i[h] * scale2)
            T.reduce_sum(acc_s, sumexp_i, dim=1)
            for h in T.Parallel(HB):
                sumexp[h] = sumexp[h] * alpha[h] + sumexp_i[h]
            if k > 0:  # the other's P V with this warpgroup's previous P (and its read of the hand-over values) is done
                T.barrier_wait(see.bar_p_free[w], (k - 1) & 1)
            T.copy(acc_s, see.P[w])
            for h in T.Parallel(HB):
                see.handed[w, 0, h] = alpha[h]
                see.handed[w, 1, h] = m_i[h]
            T.fence_proxy_async()  # P goes to the other warpgroup's wgmma (async proxy)
            T.barrier_arrive(see.bar_p[w])
            T.wait_wgmma(0)
            if w == 1 or k > 0:
                T.barrier_arrive(other.free)
                T.barrier_arrive(see.bar_p_free[1 - w])
            for h, d in T.Parallel(HB, D2):
                acc_o[h, d] = acc_o[h, d] * alpha[h]
            T.gemm(see.P[w], own.KV_l if w == 0 else own.KV_r, acc_o)
            T.barrier_arrive(own.free)
    if n_blk > 0:  # noqa: SIM102  (a Python flag around a TileLang condition)
        if (n_blk - 1) % 2 == 1 - w:  # the last block is the other's: take it after the loop
            _ws_seesaw_take(half, see, other, (n_blk - 2 + w) // 2, HB, D2)
            T.wait_wgmma(0)
            T.barrier_arrive(other.free)
            T.barrier_arrive(see.bar_p_free[1 - w])
    _ws_halves_epilogue(half, see.rowsum_shared, see.bar_final, Sink, Out, LsePart, b_i, s_i, h0, bz, HB, D2, NS, scale2, io)


PAIRED_NREG = 208  # per consumer thread under consumers="paired": O half (128) + S (32) + P in bf16 (16) + softmax + addresses
# ... with io="overlapped" (several tokens per CTA: the Q prefetch and the chunked O store besides): ptxas spilled 104
# bytes at 208 and 48 at 216, none at 224 (the producer, 504 - 2 x 224 = 56 registers, copies bf16 rows only)
PAIRED_OVL_NREG = 224


@T.macro
def _ws_paired_consumer(
    half, see, P_own, bufs, b_i, s_i, h0, bz, n_blk, max_blk, HB, BI, D2, NS, scale2, io, halves=False, j=0, nxt=None, bar_own=None
):
    """Consumer warpgroup ``half.w`` under ``consumers="paired"`` (FlashMLA's sparse prefill schedule): the two
    warpgroups take the two blocks of a pair at once, warpgroup w block g = 2 k + w (in buffer w). ``P_own``: its
    [HB, BI] bf16 register fragment of P, the A operand of its own P V.

    Per pair k: both compute S = Q K^T of their block at the same time. Warpgroup 0's softmax runs from its own running
    max and hands the new max m0 to warpgroup 1, whose softmax runs from m0: m1 = max(m0, its block's) is the pair's
    max. Each rescales its half of O by its own step (old max -> its new max) and issues its own P V from registers.
    Warpgroup 0 then takes m1, brings its P, O and row sum to it (one factor per row), and stores P for warpgroup 1;
    warpgroup 1 stores its P (already at m1). Each adds the other's block to its half of O from shared memory, then
    releases it. A buffer is free once its owner's own P V and the other's P V of it completed (256 arrivals, as
    for the other schedules). In the last pair of an odd block count warpgroup 1 has no block: it takes m0 as m1,
    scores nothing and stores a zero P that nobody reads. Each keeps the row sum of its own blocks (at the same max);
    they meet at the end (:func:`_ws_halves_epilogue`).

    ``halves`` (consumers="paired_halves"): each half of a KV buffer is handed over on its own barriers
    (:func:`ws_produce_halves`). Warpgroup w's own half (the one its P V reads: left for 0, right for 1) has two
    readers, its QK^T and its own P V, and warpgroup w frees it right after that P V; the other half is read last by
    the other warpgroup's P V, which frees it. Each warpgroup's QK^T starts on its own half, which the producer
    refills first.

    ``nxt`` (io="overlapped", paired_halves, an even block count; the prefill default since 8e69e80): token ``j`` of the CTA's run
    (the WsTokens), its pairs numbered on from the tokens before (barrier phases). In a token's last pair each
    warpgroup, once both QK^T are done (past its wait for the other's max), copies its half of the next token's Q by
    cp.async, arriving on the Q barrier as it lands. Its O half goes out through its own P tile (``bar_own``: its
    128-arrival barrier), so that no KV half waits for O: the producer refills them for the next token's first pair
    as they are freed. (Staging O in two KV halves for the producer to store measured no faster on the H200: a token's
    first pair needs all four halves; eec44d0. Each chunk out of the P tile by one TMA store, O straight from the
    accumulator fragments, and the chunks without the warpgroup's mbarrier (TileLang's bar.sync alone) all ran right and
    measured slower or level: 4f21e06, e364589. So did O left in the accumulator and stored in the next token's first
    pair, under its QK^T: 4K 0.672 -> 0.726 ms, f9ee630; the store at a token's end overlaps the producer's refill of the
    next token's first pair, and deferred it held that pair's buffers longer. notes/sparse_attn.md.)"""
    w, Q_own, acc_s, acc_o, sumexp, sumexp_i, alpha, m_i, m_i_prev = half
    own, other = bufs[w], bufs[1 - w]
    ovl = nxt is not None
    npairs = (max_blk + 1) // 2  # with io=overlapped: n_blk == max_blk, even
    _ws_halves_prologue(half, see.Q, see.bar_q, b_i, s_i, h0, HB, D2, io, j)
    # A static trip count and a guard, as in ws_seesaw_consumer (TileLang 0.1.15 unrolls a trip count of 0 or 1).
    for kk in T.serial(npairs):
        k = j * npairs + kk  # the CTA's pair index: barrier phases run on across its tokens
        if 2 * kk < n_blk:
            mine = 2 * kk + w < n_blk  # warpgroup 1 has no block in the last pair of an odd count
            if mine:
                if halves:
                    first, second = ((own.ready, see.Q_l, own.KV_l), (own.ready_r, see.Q_r, own.KV_r))[:: 1 - 2 * w]
                    T.barrier_wait(first[0], k & 1)  # the row-valid flags come with the first half
                    for h, bi in T.Parallel(HB, BI):
                        acc_s[h, bi] = T.if_then_else(own.valid[bi], 0, -T.infinity("float32"))
                    T.wgmma_gemm(first[1], first[2], acc_s, transpose_B=True)
                    T.barrier_wait(second[0], k & 1)
                    T.wgmma_gemm(second[1], second[2], acc_s, transpose_B=True)
                else:
                    T.barrier_wait(own.ready, k & 1)
                    for h, bi in T.Parallel(HB, BI):
                        acc_s[h, bi] = T.if_then_else(own.valid[bi], 0, -T.infinity("float32"))
                    T.wgmma_gemm(see.Q_l, own.KV_l, acc_s, transpose_B=True)
                    T.wgmma_gemm(see.Q_r, own.KV_r, acc_s, transpose_B=True)
                T.wait_wgmma(0)
            else:
                T.fill(acc_s, -T.infinity("float32"))
            T.copy(m_i, m_i_prev)
            if w == 1:  # start from warpgroup 0's new max (>= this warpgroup's old one: both end each pair at m1)
                T.barrier_wait(see.bar_m[0], k & 1)
                for h in T.Parallel(HB):
                    m_i[h] = see.handed[0, 1, h]
                if ovl:
                    _ws_paired_prefetch_q(see, nxt, Q_own, b_i, w, j, kk == npairs - 1, HB, D2)
            T.reduce_max(acc_s, m_i, dim=1, clear=False)
            for h in T.Parallel(HB):
                alpha[h] = T.exp2((m_i_prev[h] - m_i[h]) * scale2)
            for h, bi in T.Parallel(HB, BI):
                acc_s[h, bi] = T.exp2(acc_s[h, bi] * scale2 - m_i[h] * scale2)
            T.reduce_sum(acc_s, sumexp_i, dim=1)
            for h in T.Parallel(HB):
                sumexp[h] = sumexp[h] * alpha[h] + sumexp_i[h]
                see.handed[w, 1, h] = m_i[h]
            T.barrier_arrive(see.bar_m[w])
            for h, d in T.Parallel(HB, D2):
                acc_o[h, d] = acc_o[h, d] * alpha[h]
            T.copy(acc_s, P_own)
            if mine:
                T.wgmma_gemm(P_own, own.KV_l if w == 0 else own.KV_r, acc_o)  # its own block, P from registers
            if w == 0:
                # its own P V completes under warpgroup 1's softmax; then its half (the whole buffer: its share) is freed
                T.wait_wgmma(0)
                T.barrier_arrive(own.free)
                T.barrier_wait(see.bar_m[1], k & 1)
                if ovl:
                    _ws_paired_prefetch_q(see, nxt, Q_own, b_i, w, j, kk == npairs - 1, HB, D2)
                for h in T.Parallel(HB):
                    alpha[h] = T.exp2((m_i[h] - see.handed[1, 1, h]) * scale2)  # m0 -> m1
                    m_i[h] = see.handed[1, 1, h]
                    sumexp[h] = sumexp[h] * alpha[h]
                for h, bi in T.Parallel(HB, BI):
                    acc_s[h, bi] = acc_s[h, bi] * alpha[h]
            if k > 0:  # the other's P V with this warpgroup's previous P is done
                T.barrier_wait(see.bar_p_free[w], (k - 1) & 1)
            T.copy(acc_s, see.P[w])
            T.fence_proxy_async()  # P goes to the other warpgroup's wgmma (async proxy)
            T.barrier_arrive(see.bar_p[w])
            if w == 1 and mine:
                T.wait_wgmma(0)
                T.barrier_arrive(own.free_r if halves else own.free)  # halves: its own half only
            if w == 0:
                for h, d in T.Parallel(HB, D2):
                    acc_o[h, d] = acc_o[h, d] * alpha[h]
            if 2 * kk + 1 - w < n_blk:  # the other's block of this pair
                T.barrier_wait(see.bar_p[1 - w], k & 1)
                T.wgmma_gemm(see.P[1 - w], other.KV_l if w == 0 else other.KV_r, acc_o)
                T.wait_wgmma(0)
                T.barrier_arrive(other.free_r if halves and w == 1 else other.free)  # halves: the half it just read
                T.barrier_arrive(see.bar_p_free[1 - w])
    args = (see.rowsum_shared, see.bar_final, see.Sink, see.Out, see.LsePart, b_i, s_i, h0, bz, HB, D2, NS, scale2, io, None, j)
    if ovl:  # O out through this warpgroup's P tile, once the other's P V of the token's last pair has read it
        _ws_halves_epilogue(half, *args, (see.P[w], see.bar_p_free[w], (j * npairs + npairs - 1) & 1, bar_own))
    else:
        _ws_halves_epilogue(half, *args)


@T.macro
def ws_paired_warpgroup(half, P_own, bar_own, seesaw_args, halves, TPC, bx, S, REP, nxt):
    """Consumer warpgroup ``half.w`` under the paired consumers: its one token (:func:`_ws_paired_consumer`), or, with
    paired_halves and io="overlapped", the CTA's run of tokens one after another (``bar_own``: its barrier for the O
    store through its P tile)."""
    see, bufs, b_i, s_i, h0, bz, n_blk, max_blk, HB, BI, D2, NS, scale2, io = seesaw_args
    if TPC == 1:
        _ws_paired_consumer(half, see, P_own, bufs, b_i, s_i, h0, bz, n_blk, max_blk, HB, BI, D2, NS, scale2, io, halves)
    else:
        for j in T.serial(TPC):
            if bx * TPC + j < S * REP:
                s_j, h_j = (bx * TPC + j) // REP, ((bx * TPC + j) % REP) * HB
                tail = (bz, n_blk, max_blk, HB, BI, D2, NS, scale2, io, True, j, nxt, bar_own)
                _ws_paired_consumer(half, see, P_own, bufs, b_i, s_j, h_j, *tail)


@T.macro
def _ws_paired_prefetch_q(see, nxt, Q_own, b_i, w, j, last, HB, D2):
    """paired_halves with io="overlapped": in the token's last pair (``last``), once both warpgroups' QK^T are done,
    warpgroup ``w``'s half of the next token's Q by 16-byte cp.async copies that arrive on the Q barrier as they land
    (cp.async.mbarrier.arrive.noinc: one arrival per thread). Each warp copies whole 512-byte rows."""
    copies = HB * D2 // 8 // 128
    if last:  # noqa: SIM102  (TileLang conditions)
        if j + 1 < nxt.count:
            item = nxt.first + j + 1
            s_n, h_n = item // nxt.REP, (item % nxt.REP) * HB
            for i in T.unroll(copies):
                r = i * (128 // (D2 // 8)) + nxt.t // (D2 // 8)
                col = (nxt.t % (D2 // 8)) * 8
                T.ptx_cp_async(T.access_ptr(Q_own[r, col], "w", 8), T.access_ptr(see.Q[b_i, s_n, h_n + r, w * D2 + col], "r", 8), 8)
            T.cp_async_barrier_noinc(see.bar_q)


class WsCta(NamedTuple):
    """What the ws consumer warpgroups share for the whole CTA: tensors, shared tiles, barriers, the split's block range."""

    Q: Any
    Q_l: Any
    Q_r: Any
    Out: Any
    LsePart: Any
    Sink: Any
    S_shared: Any
    alpha_shared: Any
    final_shared: Any
    bufs: Any  # the two WsBuffer
    bar_q: Any
    bar_final: Any
    bar_s_ready: Any
    bar_s_free: Any
    b_i: Any
    bz: Any  # the split
    lo: Any  # its first block
    n_blk: Any  # its blocks per token
    HB: int
    BI: int
    D2: int
    NS: int
    scale2: float
    io: str
    fuse: Any = None  # combine="fused": the WsFuse of the fused combine
    early_p: bool = False  # handoff="before_pv": warpgroup 1 gets P before warpgroup 0's own P V (see _ws_softmax_step)
    bf16_parts: bool = False  # partials="bf16": the split's partial O staged out as bf16 through the freed Q half
    nxt: Any = None  # io="overlapped": the WsTokens of the CTA's run of tokens


class WsTokens(NamedTuple):
    """``io="overlapped"``: the CTA's run of (token, head block) items, for the next token's Q and the previous O."""

    first: Any  # the CTA's first item, bx * tokens_per_cta (token item // REP, head block item % REP)
    count: Any  # how many it runs: tokens_per_cta, fewer in the last CTA
    REP: int  # head blocks per token
    t: Any  # the thread's index in its consumer warpgroup, 0..127


@T.macro
def _ws_ovl_prefetch_q(cta, j, it):
    """``io="overlapped"``, consumer warpgroup 1 once warpgroup 0's last QK^T of the CTA's token ``j`` (block ``it``
    of it) has completed: 16-byte cp.async copies of both Q halves for the next token, which arrive on ``bar_q`` as
    they land (cp.async.mbarrier.arrive.noinc, one arrival per thread; warpgroup 0 arrives itself). Warpgroup 1 waits
    for P most of a block, so warpgroup 0's loop gains no instructions. Each warp copies whole 512-byte rows."""
    HB, D2, nxt = cta.HB, cta.D2, cta.nxt
    if it == cta.n_blk - 1:  # noqa: SIM102  (TileLang conditions)
        if j + 1 < nxt.count:
            item = nxt.first + j + 1
            s_n, h_n = item // nxt.REP, (item % nxt.REP) * HB
            for i in T.unroll(HB * D2 // 8 // 128):
                r = i * (128 // (D2 // 8)) + nxt.t // (D2 // 8)
                col = (nxt.t % (D2 // 8)) * 8
                T.ptx_cp_async(T.access_ptr(cta.Q_l[r, col], "w", 8), T.access_ptr(cta.Q[cta.b_i, s_n, h_n + r, col], "r", 8), 8)
                T.ptx_cp_async(T.access_ptr(cta.Q_r[r, col], "w", 8), T.access_ptr(cta.Q[cta.b_i, s_n, h_n + r, D2 + col], "r", 8), 8)
            T.cp_async_barrier_noinc(cta.bar_q)


@T.macro
def _ws_ovl_stage_o(cta, acc, w, j):
    """``io="overlapped"``, after token ``j``'s final scale: warpgroup ``w``'s O half into its half of the token's
    last KV buffer (both P V of that block are done), which is then handed back. The producer stores it to Out before
    it refills that buffer (:func:`ws_ovl_store_o`, one block into the next token; after its last block for the
    CTA's last tokens). Storing here instead costs warpgroup 1 spills (ptxas), and the time on the consumers' path."""
    if (j * cta.n_blk + cta.n_blk - 1) % 2 == 0:
        _ws_ovl_stage_into(cta, cta.bufs[0], acc, w, j)
    else:
        _ws_ovl_stage_into(cta, cta.bufs[1], acc, w, j)


@T.macro
def _ws_ovl_stage_into(cta, buf, acc, w, j):
    """Warpgroup ``w``'s O half (the [HB, D/2] fragment ``acc``) into its half of ``buf``; then hand ``buf`` back."""
    T.copy(acc, buf.KV_l if w == 0 else buf.KV_r)
    T.barrier_arrive(buf.free)


class WsHelper(NamedTuple):
    """Consumer warpgroup 1's producer registers and sources under ``wg1_rows`` (see :func:`ws_wg1_fill`)."""

    src: Any
    regs: Any
    dims: Any
    q: Any  # its thread index 0..127


@T.macro
def ws_wg0_token(cta, sm, s_i, h0, j):
    """Consumer warpgroup 0 on token ``s_i`` (head block ``h0``), the CTA's ``j``-th: Q_l, the block loop (S, online
    softmax, left half of O), the sink and the O_l store. Block ``it`` of the token is the CTA's ``j * n_blk + it``-th:
    buffer and barrier phases run on across the CTA's tokens."""
    Q, Out, LsePart, Sink, HB, D2, NS, scale2 = cta.Q, cta.Out, cta.LsePart, cta.Sink, cta.HB, cta.D2, cta.NS, cta.scale2
    b_i, bz, n_blk, final_shared = cta.b_i, cta.bz, cta.n_blk, cta.final_shared
    Q_l, acc_o_l, sumexp, sumexp_i, alpha, m_i = sm.Q_l, sm.acc_o, sm.sumexp, sm.sumexp_i, sm.alpha, sm.m_i
    BI = cta.BI
    ovl = cta.io == "overlapped"
    if cta.io == "staged":
        T.copy(Q[b_i, s_i, h0 : h0 + HB, 0:D2], Q_l)
        T.fence_proxy_async()  # generic-proxy stores, read by wgmma (async proxy) after the barrier
        T.barrier_arrive(cta.bar_q)
    elif cta.io == "overlapped":
        if j == 0:
            T.copy(Q[b_i, s_i, h0 : h0 + HB, 0:D2], Q_l)
            T.fence_proxy_async()
        # a later token's Q came by warpgroup 1's cp.async under the last block of the one before (_ws_ovl_prefetch_q)
        T.barrier_arrive(cta.bar_q)
    T.fill(sumexp, 0)
    T.fill(m_i, -(2**30))
    T.fill(acc_o_l, 0)
    T.barrier_wait(cta.bar_q, j & 1)
    for it in T.serial(n_blk):
        if (j * n_blk + it) % 2 == 0:
            _ws_softmax_step(sm, cta.bufs[0], j * n_blk + it, HB, BI, D2, scale2, cta.early_p, (cta, j, it) if ovl else None)
        else:
            _ws_softmax_step(sm, cta.bufs[1], j * n_blk + it, HB, BI, D2, scale2, cta.early_p, (cta, j, it) if ovl else None)
    if NS == 1:
        for h in T.Parallel(HB):
            alpha[h] = T.max(m_i[h] * scale2, Sink[h0 + h] * LOG2E)
            sumexp_i[h] = sumexp[h] * T.exp2(m_i[h] * scale2 - alpha[h]) + T.exp2(Sink[h0 + h] * LOG2E - alpha[h])
            final_shared[h] = T.if_then_else(sumexp_i[h] > 0, T.exp2(m_i[h] * scale2 - alpha[h]) / sumexp_i[h], 0.0)
    else:
        for h in T.Parallel(HB):
            final_shared[h] = T.if_then_else(sumexp[h] > 0, 1.0 / sumexp[h], 0.0)
            LsePart[b_i, s_i, bz, h0 + h] = T.if_then_else(
                sumexp[h] > 0, T.log2(T.max(sumexp[h], 1e-30)) + m_i[h] * scale2, -T.infinity("float32")
            )
    T.barrier_arrive(cta.bar_final)
    for h, d in T.Parallel(HB, D2):
        acc_o_l[h, d] = acc_o_l[h, d] * final_shared[h]
    if ovl:
        _ws_ovl_stage_o(cta, acc_o_l, 0, j)
    elif NS == 1 and cta.io == "staged":
        T.copy(acc_o_l, Q_l)  # this warpgroup's last QK^T has completed: Q_l is free
        T.copy(Q_l, Out[b_i, s_i, h0 : h0 + HB, 0:D2])
    elif cta.bf16_parts and cta.io == "staged":
        T.copy(acc_o_l, Q_l)
        T.copy(Q_l, Out[b_i, s_i, bz, h0 : h0 + HB, 0:D2])
    elif NS == 1:
        T.copy(acc_o_l, Out[b_i, s_i, h0 : h0 + HB, 0:D2])
    elif cta.fuse is None:
        T.copy(acc_o_l, Out[b_i, s_i, bz, h0 : h0 + HB, 0:D2])
    else:
        T.copy(acc_o_l, cta.fuse.OPart[b_i, s_i, bz, h0 : h0 + HB, 0:D2])
        _ws_fused_combine(cta.fuse, 0, acc_o_l, Q_l, b_i, s_i, h0, bz, HB, D2, NS, cta.io)


@T.macro
def ws_wg1_token(cta, acc_o_r, helper, s_i, h0, j):
    """Consumer warpgroup 1 on token ``s_i``, the CTA's ``j``-th: Q_r, the right half of O += P V per block (P and
    its rescale from warpgroup 0 through S_shared/alpha_shared), the final scale and the O_r store. ``helper``
    (``wg1_rows``, one token per CTA only): also fill the last 16 rows of each main block, one block ahead."""
    Q, Out, HB, D2, NS, b_i, bz, lo, n_blk = cta.Q, cta.Out, cta.HB, cta.D2, cta.NS, cta.b_i, cta.bz, cta.lo, cta.n_blk
    Q_r, S_shared, alpha_shared, final_shared, bufs = cta.Q_r, cta.S_shared, cta.alpha_shared, cta.final_shared, cta.bufs
    ovl = cta.io == "overlapped"
    if cta.io == "staged":
        T.copy(Q[b_i, s_i, h0 : h0 + HB, D2 : 2 * D2], Q_r)
        T.fence_proxy_async()
        T.barrier_arrive(cta.bar_q)
    elif ovl:  # noqa: SIM102  (a Python flag around a TileLang condition)
        if j == 0:  # a later token's Q is issued under the last block of the one before (cp.async onto bar_q)
            T.copy(Q[b_i, s_i, h0 : h0 + HB, D2 : 2 * D2], Q_r)
            T.fence_proxy_async()
            T.barrier_arrive(cta.bar_q)
    T.fill(acc_o_r, 0)
    if helper is not None:
        hsrc, hregs, hdims, q = helper
        last = (hdims.BI // hdims.ROWS - 1,)
        ws_fetch_rows(hsrc, hdims, hregs.rows_cur, b_i, s_i, lo, q, last)
        ws_fetch_rows(hsrc, hdims, hregs.rows_next, b_i, s_i, lo + 1, q, last)
        if lo >= hdims.NBW:
            ws_issue_main_loads(hsrc, hregs, hdims, b_i, q, last)
        # the CTA's first block: both buffers start free
        ws_wg1_fill(hsrc, hregs, hdims, bufs[0], b_i, s_i, lo, q, n_blk > 1)
    for it in T.serial(n_blk):
        if helper is not None:  # noqa: SIM102  (a Python flag around a TileLang condition)
            # block it + 1 goes to the buffer block it - 1 used: free once both P V of it - 1 are done
            if it + 1 < n_blk:
                if it % 2 == 0:
                    T.barrier_wait(bufs[1].free, (((it + 1) // 2) & 1) ^ 1)
                    ws_wg1_fill(hsrc, hregs, hdims, bufs[1], b_i, s_i, lo + it + 1, q, it + 2 < n_blk)
                else:
                    T.barrier_wait(bufs[0].free, (((it + 1) // 2) & 1) ^ 1)
                    ws_wg1_fill(hsrc, hregs, hdims, bufs[0], b_i, s_i, lo + it + 1, q, it + 2 < n_blk)
        T.barrier_arrive(cta.bar_s_ready)
        T.barrier_wait(cta.bar_s_ready, (j * n_blk + it) & 1)
        if ovl:  # warpgroup 0's last QK^T of the token has completed: Q is free for the next token's
            _ws_ovl_prefetch_q(cta, j, it)
        for h, d in T.Parallel(HB, D2):
            acc_o_r[h, d] = acc_o_r[h, d] * alpha_shared[h]
        if (j * n_blk + it) % 2 == 0:
            T.gemm(S_shared, bufs[0].KV_r, acc_o_r)
            _ws_hand_back(bufs[0].free, (cta, j, it) if ovl else None)
        else:
            T.gemm(S_shared, bufs[1].KV_r, acc_o_r)
            _ws_hand_back(bufs[1].free, (cta, j, it) if ovl else None)
        T.barrier_arrive(cta.bar_s_free)
    T.barrier_arrive(cta.bar_final)
    T.barrier_wait(cta.bar_final, j & 1)
    for h, d in T.Parallel(HB, D2):
        acc_o_r[h, d] = acc_o_r[h, d] * final_shared[h]
    if ovl:
        _ws_ovl_stage_o(cta, acc_o_r, 1, j)
    elif NS == 1 and cta.io == "staged":
        T.copy(acc_o_r, Q_r)  # warpgroup 0 arrived on bar_final after its last QK^T: Q_r is free
        T.copy(Q_r, Out[b_i, s_i, h0 : h0 + HB, D2 : 2 * D2])
    elif cta.bf16_parts and cta.io == "staged":
        T.copy(acc_o_r, Q_r)
        T.copy(Q_r, Out[b_i, s_i, bz, h0 : h0 + HB, D2 : 2 * D2])
    elif NS == 1:
        T.copy(acc_o_r, Out[b_i, s_i, h0 : h0 + HB, D2 : 2 * D2])
    elif cta.fuse is None:
        T.copy(acc_o_r, Out[b_i, s_i, bz, h0 : h0 + HB, D2 : 2 * D2])
    else:
        T.copy(acc_o_r, cta.fuse.OPart[b_i, s_i, bz, h0 : h0 + HB, D2 : 2 * D2])
        _ws_fused_combine(cta.fuse, 1, acc_o_r, Q_r, b_i, s_i, h0, bz, HB, D2, NS, cta.io)


class WsFuse(NamedTuple):
    """What the fused combine (``combine="fused"``) needs besides a warpgroup's own accumulator."""

    OPart: Any  # fp32 [B, S, NS, H, D]: every split's partial O, normalised by its own sum (global scratch, in L2)
    LsePart: Any  # fp32 [B, S, NS, H]: every split's log2-sum-exp (-inf: nothing valid)
    Counter: Any  # int32 [B, S, REP]: split CTAs arrived per (token, head block); 0 between launches
    Sink: Any  # fp32 [H]
    Out: Any  # bf16 [B, S, H, D]: the merged output
    comb_shared: Any  # fp32 [2, NS + 2, HB]: per consumer warpgroup, each split's weight, the max, 1 / denominator
    last_shared: Any  # int32 [1]: the counter's value before this CTA's arrival
    bar_arrived: Any  # 256 arrivals: each consumer thread's partial stores are done and fenced
    bar_last: Any  # 1 arrival: thread 0 has counted the CTA in and left the old value in last_shared
    tx: Any  # the thread index


def _split_max(LsePart, b_i, s_i, h, NS, sink2):
    """max(sink2, -1e30, lse_0 .. lse_{NS-1}) for head h (a PrimExpr, the splits unrolled): combine_kernel's m."""
    m = T.max(sink2, -1e30)  # finite even without a sink (-inf), so exp2 never sees -inf - -inf
    for k in range(NS):
        m = T.max(m, LsePart[b_i, s_i, k, h])
    return m


def _split_den(comb, w, NS, h, sink2):
    """exp2(sink2 - m) + w_0 + .. + w_{NS-1} for row h of warpgroup w's weights, in combine_kernel's order."""
    den = T.exp2(sink2 - comb[w, NS, h])
    for k in range(NS):
        den = den + comb[w, k, h]
    return den


@T.macro
def _ws_fused_combine(fz, w, acc_o, Q_own, b_i, s_i, h0, bz, HB, D2, NS, io):
    """``combine="fused"``: after consumer warpgroup ``w`` stored its half of this split's partial O (acc_o [HB, D2],
    still in registers, normalised by the split's own sum; warpgroup 0 also its lse), count the CTA in on the
    (token, head block)'s arrival counter; the CTA that arrives last merges every split with the sink as
    :func:`combine_kernel` does, every split read from OPart in ascending order (its own too: the result must not
    depend on which CTA arrives last), and writes bf16 Out [b_i, s_i, h0 : h0 + HB, w D2 : (w + 1) D2]. It resets the counter, so
    the next launch (a CUDA-graph replay) starts from 0.

    Ordering: each thread's release fence orders its partial stores before its mbarrier arrival; thread 0 waits for
    all 256, then its acq_rel atomic publishes the CTA's partial at GPU scope (the fence, the CTA barrier and the
    release form the usual cumulative chain) and, in the last CTA, acquires the others'. The producer warpgroup
    takes no part (it has finished), so CTA-wide __syncthreads would hang: mbarriers only."""
    T.call_extern("handle", "csa2_fence_gpu")
    T.barrier_arrive(fz.bar_arrived)
    if w == 0:  # noqa: SIM102  (a Python flag around a TileLang condition)
        if fz.tx == 0:
            T.barrier_wait(fz.bar_arrived, 0)
            fz.last_shared[0] = T.atomic_add(fz.Counter[b_i, s_i, h0 // HB], 1, memory_order="acq_rel", return_prev=True)
            if fz.last_shared[0] == NS - 1:
                fz.Counter[b_i, s_i, h0 // HB] = 0  # every split has arrived: nothing else touches it this launch
            T.barrier_arrive(fz.bar_last)
    T.barrier_wait(fz.bar_last, 0)
    if fz.last_shared[0] == NS - 1:
        comb = fz.comb_shared  # warpgroup w's rows: [w, k] split k's weight, [w, NS] the max, [w, NS + 1] 1 / denominator
        for h in T.Parallel(HB):
            comb[w, NS, h] = _split_max(fz.LsePart, b_i, s_i, h0 + h, NS, fz.Sink[h0 + h] * LOG2E)
        for k, h in T.Parallel(NS, HB):
            comb[w, k, h] = T.exp2(fz.LsePart[b_i, s_i, k, h0 + h] - comb[w, NS, h])
        # One reciprocal per row, not combine_kernel's acc / den per element: a precise fp32 division has a
        # slow-path call, and with the 128-register accumulator live it spills (ptxas, 24 bytes). The results are
        # at most one fp32 rounding apart, far below the bf16 output's.
        for h in T.Parallel(HB):
            den = _split_den(comb, w, NS, h, fz.Sink[h0 + h] * LOG2E)
            comb[w, NS + 1, h] = T.if_then_else(den > 0, 1.0 / den, 0.0)  # no sink, no valid index: zeros
        # acc = sum_k w_k O_k over every split in ascending k, this CTA's own split read back from OPart too: the
        # same sequence of roundings whichever split arrives last (taking its own split from registers first made
        # the result depend on the arrival order: two runs differed in the last bit on the H200, 84d7a8c).
        # A quarter of the columns at a time with a compiler fence between quarters, so at most 32 loaded registers
        # are live beside the 128 of the accumulator (warpgroup 1 has 168; loaded all at once, ptxas spilled 8-1200
        # bytes). Rolled over k (ptxas, decode B=64: no spills at 2 and 8 splits, 8 bytes at 4; unrolled at 4: 612).
        T.clear(acc_o)
        for k in T.serial(NS):
            for c in T.unroll(4, explicit=True):
                for h, d in T.Parallel(HB, D2 // 4):
                    acc_o[h, c * (D2 // 4) + d] = (
                        acc_o[h, c * (D2 // 4) + d] + fz.OPart[b_i, s_i, k, h0 + h, w * D2 + c * (D2 // 4) + d] * comb[w, k, h]
                    )
                T.call_extern("handle", "csa2_compiler_fence")
        for h, d in T.Parallel(HB, D2):
            acc_o[h, d] = acc_o[h, d] * comb[w, NS + 1, h]
        if io == "staged":  # Q_own is free: both warpgroups' last QK^T completed before bar_arrived
            T.copy(acc_o, Q_own)
            T.copy(Q_own, fz.Out[b_i, s_i, h0 : h0 + HB, w * D2 : (w + 1) * D2])
        else:
            T.copy(acc_o, fz.Out[b_i, s_i, h0 : h0 + HB, w * D2 : (w + 1) * D2])


class WsSoftmax(NamedTuple):
    """Warpgroup 0's operands and online-softmax state (and the S/alpha hand-over barriers to warpgroup 1)."""

    Q_l: Any
    Q_r: Any
    S_shared: Any
    alpha_shared: Any
    acc_s: Any
    acc_o: Any
    sumexp: Any
    sumexp_i: Any
    alpha: Any
    m_i: Any
    m_i_prev: Any
    bar_s_ready: Any
    bar_s_free: Any
