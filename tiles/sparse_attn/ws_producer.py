"""The ws kernel's producer warpgroup, as TileLang macros: the row fetch, the serial, batched and prefetching fills
of a KV buffer (FP4/FP8 rows dequantised, bf16 rows by cp.async), the halves of paired_halves, warpgroup 1's share
under ``wg1_rows``, and the overlapped O store."""

from typing import Any, NamedTuple

import tilelang.language as T

from tiles.sparse_attn.dequant import FP4X8_FUNCTIONS, e2m1_value, e8m0_value


@T.macro
def ws_ovl_store_o(Out, buf, dims, b_i, nxt, j, it, n_blk, p):
    """``io="overlapped"``, producer thread ``p`` after the wait for a free buffer, before filling it with block
    ``it`` of the CTA's token ``j``: when the buffer's last user was the last block of an earlier token (global block
    index g - 2 for g = j * n_blk + it), it holds that token's O staged by the consumers; store it to Out first. Each
    thread stores the rows and 16-byte chunks it is about to overwrite by cp.async (those of
    :func:`ws_produce_batched` for bf16 rows), so no other thread's copy can land on a chunk before it is read."""
    ROWS, D2, lanes, BI = dims.ROWS, dims.D2, dims.lanes, dims.BI
    g = j * n_blk + it
    if g >= n_blk + 1:  # noqa: SIM102  (TileLang conditions)
        if (g - 1) % n_blk == 0:
            item = nxt.first + (g - 1) // n_blk - 1
            s_o, h_o = item // nxt.REP, (item % nxt.REP) * BI  # heads_per_block == block_I: O fills the buffer
            c = lane_col(p, lanes)
            for rr in T.serial(BI // ROWS):
                r = rr * ROWS + lane_row(p, lanes)
                for u in T.unroll(4):
                    col = 64 * u + c * 8
                    for v in T.vectorized(8):
                        Out[b_i, s_o, h_o + r, col + v] = buf.KV_l[r, col + v]
                    for v in T.vectorized(8):
                        Out[b_i, s_o, h_o + r, D2 + col + v] = buf.KV_r[r, col + v]


class WsBuffer(NamedTuple):
    """One of the ws kernel's two KV buffers: its halves, row-valid flags, and the barriers that hand it over."""

    KV_l: Any
    KV_r: Any
    valid: Any
    ready: Any  # producer -> consumers: the rows have landed (consumers="paired_halves": the left half's)
    free: Any  # consumers -> producer: both GEMMs are done with it (paired_halves: with the left half)
    ready_r: Any = None  # consumers="paired_halves": the right half's rows have landed (128 arrivals: the producer)
    free_r: Any = None  # ... its last reader is done with the right half (128 arrivals: one consumer warpgroup)


class WsSources(NamedTuple):
    """The kernel's KV and index tensors, as the batched producer macros take them."""

    WinA: Any
    WinB: Any
    WinIdx: Any
    MainA: Any
    MainB: Any
    TopkIdx: Any


class WsRegisters(NamedTuple):
    """The batched producer's per-thread registers: this and the next block's rows, one batch of raw codes and
    scale bytes, eight dequantised values."""

    rows_cur: Any
    rows_next: Any
    raw: Any
    rawsc: Any
    vals: Any


class WsDims(NamedTuple):
    """List lengths, block geometry and cache sizes (Nw, Nc dynamic) of the ws kernel."""

    W: int
    K: int
    BI: int
    NBW: int
    ROWS: int
    D2: int
    Nw: Any
    Nc: Any
    lanes: str  # producer lane -> (row, column slice) map: lane_row, lane_col
    fp4_decode: str = "fma"  # the FP4 main-word dequant: a key of FP4X8_FUNCTIONS
    unused_rows: str = "row0"  # bf16 KV: what the batched producer's cp.async puts in an unused slot's row (UNUSED_ROWS)


def lane_row(p, lanes):
    """Row (within a pass of 16) of producer lane p (0..127): see ``lanes`` in :func:`sparse_attn_ws`."""
    return p // 8 if lanes == "row" else p % 8 + 8 * (p // 64)


def lane_col(p, lanes):
    """32-column slice (0..7, of each half of a row) of producer lane p: see ``lanes`` in :func:`sparse_attn_ws`."""
    return p % 8 if lanes == "row" else (p // 8) % 8


@T.macro
def ws_fetch_rows(src, dims, rows, b_i, s_i, blk, p, passes=None):
    """Producer thread p's cache rows of block ``blk`` (rows rr * ROWS + lane_row(p)): -1 where the slot is unused,
    past the end of its list, or holds an index outside the cache (masked, never read: the batched
    kernel is built without TileLang's bounds guards). ``passes``: the rr to fetch (default all), ``rows[j]``
    holding the j-th of them."""
    W, K, BI, NBW, ROWS, _, Nw, Nc, lanes = dims[:9]
    WinIdx, TopkIdx = src.WinIdx, src.TopkIdx
    if passes is None:
        passes = tuple(range(BI // ROWS))
    for j, rr in enumerate(passes):
        r = rr * ROWS + lane_row(p, lanes)
        if blk < NBW:
            rows[j] = T.if_then_else(blk * BI + r < W, WinIdx[b_i, s_i, T.min(blk * BI + r, W - 1)], -1)
            rows[j] = T.if_then_else(rows[j] < Nw, rows[j], -1)
        else:
            rows[j] = T.if_then_else((blk - NBW) * BI + r < K, TopkIdx[b_i, s_i, T.min((blk - NBW) * BI + r, K - 1)], -1)
            rows[j] = T.if_then_else(rows[j] < Nc, rows[j], -1)


@T.macro
def ws_produce_into(src, regs, dims, kv_buf, bar_free, it, b_i, s_i, blk, p, fp4, main_passes, prefetch: bool, n_blk):
    """One block of the producer's loop (one token per CTA): wait until ``kv_buf`` (block ``it`` of ``n_blk``, the
    buffer of parity ``it % 2``) is free, then fill it with block ``blk``, by the prefetching or the batched producer."""
    T.barrier_wait(bar_free, ((it // 2) & 1) ^ 1)
    if prefetch:
        _ws_produce_prefetch(src, regs, dims, kv_buf, b_i, s_i, blk, p, it + 1 < n_blk)
    else:
        ws_produce_batched(src, regs, dims, kv_buf, b_i, s_i, blk, p, fp4, main_passes)


@T.macro
def ws_produce_batched(src, regs, dims, kv_buf, b_i, s_i, blk, p, fp4, main_passes=None, s_next=None, blk_next=None):
    """Fill one KV buffer with block ``blk`` (batched producer), fetching block ``blk + 1``'s rows meanwhile.

    Thread p owns rows rr * ROWS + lane_row(p) and, of each half of a row, the 32 columns from c * 32
    (FP4/FP8) or the four 8-column chunks at 64 u + c * 8 (bf16), c = lane_col(p). An unused row (-1) gets zeros (FP4/FP8: its scale is zeroed;
    bf16 with ``unused_rows="zeros"``: the cp.async predicate zero-fills it) or a copy of row 0 (bf16, ``"row0"``);
    either way its score is -inf, so it adds nothing. ``s_next``/``blk_next``: the token and
    block whose rows to fetch next (default: block ``blk + 1`` of the same token; ``tokens_per_cta`` crosses into
    the next token).
    """
    WinA, WinB, _, MainA, _, _ = src
    if s_next is None:
        s_next, blk_next = s_i, blk + 1
    rows_cur, rows_next, raw, rawsc, vals = regs
    KV_l, KV_r, valid, bar_ready = kv_buf.KV_l, kv_buf.KV_r, kv_buf.valid, kv_buf.ready
    _, _, BI, NBW, ROWS, D2, _, _, lanes = dims[:9]
    R = BI // ROWS
    c = lane_col(p, lanes)
    for rr in T.unroll(R):
        valid[rr * ROWS + lane_row(p, lanes)] = rows_cur[rr] >= 0
    if not fp4:
        for rr in T.unroll(R):
            r = rr * ROWS + lane_row(p, lanes)
            row = T.max(rows_cur[rr], 0)
            # unused_rows="zeros": an unused slot's cp.async reads nothing and zero-fills (its predicate); "row0": it
            # copies row 0, as every unused slot of every CTA does (its score is -inf either way)
            used = (rows_cur[rr] >= 0,) if dims.unused_rows == "zeros" else ()
            for u in T.unroll(4):
                col = 64 * u + c * 8
                if blk < NBW:
                    _ws_copy16(KV_l[r, col], WinA[b_i, row, col], used)
                    _ws_copy16(KV_r[r, col], WinA[b_i, row, D2 + col], used)
                else:
                    _ws_copy16(KV_l[r, col], MainA[b_i, row, col], used)
                    _ws_copy16(KV_r[r, col], MainA[b_i, row, D2 + col], used)
        ws_fetch_rows(src, dims, rows_next, b_i, s_next, blk_next, p)
        T.cp_async_barrier_noinc(bar_ready)
    else:
        if blk < NBW:
            # FP8 window rows are 512 B: two batches of R / 2 rows keep the loads in registers
            for bt in T.unroll(2):
                for q in T.unroll(R // 2):
                    row = T.max(rows_cur[bt * (R // 2) + q], 0)
                    for h in T.unroll(2):
                        for v in T.vectorized(8):
                            raw[(q * 2 + h) * 8 + v] = WinA[b_i, row, (h * D2 + c * 32) // 4 + v]
                        rawsc[q * 2 + h] = WinB[b_i, row, (h * D2 + c * 32) // 32]
                if bt == 0:
                    ws_fetch_rows(src, dims, rows_next, b_i, s_next, blk_next, p)
                for q in T.unroll(R // 2):
                    rr = bt * (R // 2) + q
                    for h, buf in ((0, KV_l), (1, KV_r)):
                        s2 = T.call_extern("uint32", "csa2_e8m0_scale2", T.cast(rawsc[q * 2 + h], "uint32"))
                        s2 = T.if_then_else(rows_cur[rr] >= 0, s2, T.uint32(0))
                        for w in T.unroll(4):
                            T.call_extern("handle", "csa2_e4m3x4_bf16", T.address_of(vals[0]), raw[(q * 2 + h) * 8 + 2 * w], s2)
                            T.call_extern("handle", "csa2_e4m3x4_bf16", T.address_of(vals[4]), raw[(q * 2 + h) * 8 + 2 * w + 1], s2)
                            for v in T.vectorized(8):
                                buf[rr * ROWS + lane_row(p, lanes), c * 32 + w * 8 + v] = vals[v]
        else:
            # FP4 rows are 288 B: the whole block's loads (R rows x 2 halves x 16 B + scales) in flight at once
            # (main_passes: the passes this warpgroup fills, when consumer warpgroup 1 fills the last one)
            ws_issue_main_loads(src, regs, dims, b_i, p, main_passes)
            ws_fetch_rows(src, dims, rows_next, b_i, s_next, blk_next, p)
            _ws_store_main(regs, dims, kv_buf, p, main_passes)
        # generic-proxy stores must be visible to wgmma's async-proxy reads
        T.fence_proxy_async()
        T.barrier_arrive(bar_ready)
    for rr in T.unroll(R):
        rows_cur[rr] = rows_next[rr]


@T.macro
def _ws_copy16(dst, src, used):
    """One 16-byte cp.async of a bf16 row piece ``src`` (global) to ``dst`` (shared); ``used``: () or (predicate,),
    which zero-fills when false."""
    T.ptx_cp_async(T.access_ptr(dst, "w", 8), T.access_ptr(src, "r", 8), 8, *used)


@T.macro
def _ws_fill_half(src, dims, kv_buf, h, rows, b_i, blk, p, flags: bool):
    """consumers="paired_halves" (bf16 rows): producer thread p's cp.async copies of block ``blk``'s half ``h`` (0:
    KV_l, dims 0..D/2; 1: KV_r) for the rows in ``rows``, arriving on that half's ready barrier as they land;
    ``flags``: also write the block's row-valid flags (with the half its owner reads first)."""
    WinA, MainA = src.WinA, src.MainA
    _, _, BI, NBW, ROWS, D2, _, _, lanes = dims[:9]
    c = lane_col(p, lanes)
    buf = kv_buf.KV_r if h else kv_buf.KV_l
    for rr in T.unroll(BI // ROWS):
        r = rr * ROWS + lane_row(p, lanes)
        if flags:
            kv_buf.valid[r] = rows[rr] >= 0
        row = T.max(rows[rr], 0)
        used = (rows[rr] >= 0,) if dims.unused_rows == "zeros" else ()
        for u in T.unroll(4):
            col = 64 * u + c * 8
            if blk < NBW:
                _ws_copy16(buf[r, col], WinA[b_i, row, h * D2 + col], used)
            else:
                _ws_copy16(buf[r, col], MainA[b_i, row, h * D2 + col], used)
    T.cp_async_barrier_noinc(kv_buf.ready_r if h else kv_buf.ready)


@T.macro
def ws_produce_halves(src, dims, bufs, pair_rows, b_i, s_i, lo, n_blk, max_blk, p):
    """The producer under consumers="paired_halves" (bf16 rows, one token per CTA): per pair k (blocks 2 k in buffer 0,
    2 k + 1 in buffer 1) the four halves in the order their last readers free them (FlashMLA's): buffer 0's left
    (warpgroup 0's own half: its QK^T and own P V), buffer 1's right (warpgroup 1's own half), buffer 0's right
    (read last by warpgroup 1's P V of block 2 k), buffer 1's left. The next pair's rows are fetched after the first
    two halves went out, into the second pair of row registers."""
    rows_a, rows_b, rows_a2, rows_b2 = pair_rows
    b0, b1 = bufs
    ws_fetch_rows(src, dims, rows_a, b_i, s_i, lo, p)
    ws_fetch_rows(src, dims, rows_b, b_i, s_i, lo + 1, p)
    # A static trip count and a guard (as the consumers': TileLang 0.1.15 unrolls a trip count of 0 or 1).
    for k in T.serial((max_blk + 1) // 2):
        if 2 * k < n_blk:
            second = 2 * k + 1 < n_blk
            T.barrier_wait(b0.free, (k & 1) ^ 1)
            _ws_fill_half(src, dims, b0, 0, rows_a, b_i, lo + 2 * k, p, True)
            if second:
                T.barrier_wait(b1.free_r, (k & 1) ^ 1)
                _ws_fill_half(src, dims, b1, 1, rows_b, b_i, lo + 2 * k + 1, p, True)
            ws_fetch_rows(src, dims, rows_a2, b_i, s_i, lo + 2 * k + 2, p)
            ws_fetch_rows(src, dims, rows_b2, b_i, s_i, lo + 2 * k + 3, p)
            T.barrier_wait(b0.free_r, (k & 1) ^ 1)
            _ws_fill_half(src, dims, b0, 1, rows_a, b_i, lo + 2 * k, p, False)
            if second:
                T.barrier_wait(b1.free, (k & 1) ^ 1)
                _ws_fill_half(src, dims, b1, 0, rows_b, b_i, lo + 2 * k + 1, p, False)
            for rr in T.unroll(dims.BI // dims.ROWS):
                rows_a[rr] = rows_a2[rr]
                rows_b[rr] = rows_b2[rr]


@T.macro
def ws_produce_halves_tokens(src, dims, bufs, pair_rows, b_i, lo, n_blk, TPC, p, nxt):
    """The producer under paired_halves with io="overlapped": :func:`ws_produce_halves` over the CTA's run of tokens
    (n_blk even, one split), the pair index and the barrier phases running on across them and the row fetch crossing
    into the next token (the prefill default since 8e69e80: consumers="auto")."""
    rows_a, rows_b, rows_a2, rows_b2 = pair_rows
    b0, b1 = bufs
    npairs = n_blk // 2
    ws_fetch_rows(src, dims, rows_a, b_i, nxt.first // nxt.REP, lo, p)
    ws_fetch_rows(src, dims, rows_b, b_i, nxt.first // nxt.REP, lo + 1, p)
    for j in T.serial(TPC):
        if j < nxt.count:
            s_j = (nxt.first + j) // nxt.REP
            s_n = T.if_then_else(j + 1 < nxt.count, (nxt.first + j + 1) // nxt.REP, s_j)  # past the last: unused
            for kk in T.serial(npairs):
                k = j * npairs + kk
                T.barrier_wait(b0.free, (k & 1) ^ 1)
                _ws_fill_half(src, dims, b0, 0, rows_a, b_i, lo + 2 * kk, p, True)
                T.barrier_wait(b1.free_r, (k & 1) ^ 1)
                _ws_fill_half(src, dims, b1, 1, rows_b, b_i, lo + 2 * kk + 1, p, True)
                last = kk + 1 == npairs
                s_f = T.if_then_else(last, s_n, s_j)
                ws_fetch_rows(src, dims, rows_a2, b_i, s_f, T.if_then_else(last, lo, lo + 2 * kk + 2), p)
                ws_fetch_rows(src, dims, rows_b2, b_i, s_f, T.if_then_else(last, lo + 1, lo + 2 * kk + 3), p)
                T.barrier_wait(b0.free_r, (k & 1) ^ 1)
                _ws_fill_half(src, dims, b0, 1, rows_a, b_i, lo + 2 * kk, p, False)
                T.barrier_wait(b1.free, (k & 1) ^ 1)
                _ws_fill_half(src, dims, b1, 0, rows_b, b_i, lo + 2 * kk + 1, p, False)
                for rr in T.unroll(dims.BI // dims.ROWS):
                    rows_a[rr] = rows_a2[rr]
                    rows_b[rr] = rows_b2[rr]


@T.macro
def ws_issue_main_loads(src, regs, dims, b_i, p, passes=None):
    """Load thread p's packed FP4 words and scale bytes of the rows in ``rows_cur`` into ``raw``/``rawsc`` (issue only:
    nothing reads them here, so all R x 2 x (16 B + 2 B) loads are in flight together). ``passes``: as in
    :func:`ws_fetch_rows` (the registers hold only those passes, in order)."""
    MainA, MainB = src.MainA, src.MainB
    rows_cur, raw, rawsc = regs.rows_cur, regs.raw, regs.rawsc
    _, _, BI, _, ROWS, D2, _, _, lanes = dims[:9]
    c = lane_col(p, lanes)
    if passes is None:
        passes = tuple(range(BI // ROWS))
    for j in range(len(passes)):
        row = T.max(rows_cur[j], 0)
        for h in T.unroll(2):
            for v in T.vectorized(4):
                raw[(j * 2 + h) * 4 + v] = MainA[b_i, row, (h * D2 + c * 32) // 8 + v]
            for v in T.unroll(2):
                rawsc[(j * 2 + h) * 2 + v] = MainB[b_i, row, (h * D2 + c * 32) // 16 + v]


@T.macro
def _ws_store_main(regs, dims, kv_buf, p, passes=None):
    """Dequantise ``raw``/``rawsc`` (the rows in ``rows_cur``; an unused row's scale is zeroed) into the KV buffer.
    ``passes``: as in :func:`ws_fetch_rows`."""
    rows_cur, raw, rawsc, vals = regs.rows_cur, regs.raw, regs.rawsc, regs.vals
    _, _, BI, _, ROWS, _, _, _, lanes = dims[:9]
    c = lane_col(p, lanes)
    if passes is None:
        passes = tuple(range(BI // ROWS))
    for j, rr in enumerate(passes):
        for h, buf in ((0, kv_buf.KV_l), (1, kv_buf.KV_r)):
            for q in T.unroll(4):  # word q: columns c * 32 + 8 q .. + 8, scale group q // 2
                s2 = T.call_extern("uint32", "csa2_e4m3_scale2", T.cast(rawsc[(j * 2 + h) * 2 + q // 2], "uint32"))
                s2 = T.if_then_else(rows_cur[j] >= 0, s2, T.uint32(0))
                T.call_extern("handle", FP4X8_FUNCTIONS[dims.fp4_decode], T.address_of(vals[0]), raw[(j * 2 + h) * 4 + q], s2)
                for v in T.vectorized(8):
                    buf[rr * ROWS + lane_row(p, lanes), c * 32 + q * 8 + v] = vals[v]


@T.macro
def ws_wg1_fill(src, hregs, dims, kv_buf, b_i, s_i, blk, q, more):
    """Consumer warpgroup 1's share of block ``blk`` (``wg1_rows``): for a main block, dequantise the last pass of
    rows (rows 48..63; their loads were issued a block earlier) into ``kv_buf``; arrive on its ready barrier in any
    case (the producer fills window blocks whole); then issue the next block's loads and fetch the rows of the one
    after. Invariant at entry: ``hregs.rows_cur`` holds this block's rows (and ``raw`` their data for a main block),
    ``rows_next`` the next block's. ``more``: true when this CTA has a block after ``blk``."""
    _, _, BI, NBW, ROWS, _, _, _, _ = dims[:9]
    last = (BI // ROWS - 1,)
    if blk >= NBW:
        _ws_store_main(hregs, dims, kv_buf, q, last)
        T.fence_proxy_async()  # generic-proxy stores must be visible to wgmma's async-proxy reads
    T.barrier_arrive(kv_buf.ready)
    hregs.rows_cur[0] = hregs.rows_next[0]
    if more:
        if blk + 1 >= NBW:
            ws_issue_main_loads(src, hregs, dims, b_i, q, last)
        ws_fetch_rows(src, dims, hregs.rows_next, b_i, s_i, blk + 2, q, last)


@T.macro
def _ws_produce_prefetch(src, regs, dims, kv_buf, b_i, s_i, blk, p, more):
    """Fill one KV buffer with block ``blk`` (FP4, ``produce='prefetch'``), then issue block ``blk + 1``'s loads.

    The batched producer issues a main block's loads only after its buffer is free, so every block pays one
    global-memory latency on the critical path. Here a main block's packed words are already in ``raw`` when
    its buffer frees (issued at the end of the previous step), and the loads of the next block fly while this
    thread waits for the next free buffer. Same registers: ``raw`` is read by the dequantisation before the next
    loads overwrite it. Window (FP8) blocks are filled as by the batched producer. Invariant at entry: ``rows_cur``
    holds this block's rows; for a main block also ``raw``/``rawsc`` its data and ``rows_next`` the next block's rows.
    ``more``: a boolean expression, true when this CTA has a block after ``blk`` (something to prefetch).
    """
    rows_cur, rows_next = regs.rows_cur, regs.rows_next
    _, _, BI, NBW, ROWS, _, _, _, lanes = dims[:9]
    R = BI // ROWS
    if blk < NBW:
        ws_produce_batched(src, regs, dims, kv_buf, b_i, s_i, blk, p, True)  # ends with rows_cur = rows of blk + 1
        if (blk + 1 >= NBW) & more:
            ws_issue_main_loads(src, regs, dims, b_i, p)
            ws_fetch_rows(src, dims, rows_next, b_i, s_i, blk + 2, p)
    else:
        for rr in T.unroll(R):
            kv_buf.valid[rr * ROWS + lane_row(p, lanes)] = rows_cur[rr] >= 0
        _ws_store_main(regs, dims, kv_buf, p)
        T.fence_proxy_async()  # generic-proxy stores must be visible to wgmma's async-proxy reads
        T.barrier_arrive(kv_buf.ready)
        for rr in T.unroll(R):
            rows_cur[rr] = rows_next[rr]
        if more:
            ws_issue_main_loads(src, regs, dims, b_i, p)
            ws_fetch_rows(src, dims, rows_next, b_i, s_i, blk + 2, p)


@T.macro
def ws_produce_row(WinA, WinB, MainA, MainB, KV_l, KV_r, valid, row_local, b_i, r, c, is_window, fp4, D2):
    """Producer thread c (0..7) of row r: 32 columns of each half of the gathered row, dequantised to bf16."""
    ok = row_local[0] >= 0
    row = T.max(row_local[0], 0)
    valid[r] = ok
    zero = T.cast(0, "bfloat16")
    for half, buf in ((0, KV_l), (1, KV_r)):
        d0 = half * D2 + c * 32
        if is_window:
            for v in T.vectorized(32):
                if fp4:
                    val = T.cast(WinA[b_i, row, d0 + v], "float32") * e8m0_value(WinB[b_i, row, (d0 + v) // 32])
                    buf[r, c * 32 + v] = T.if_then_else(ok, T.cast(val, "bfloat16"), zero)
                else:
                    buf[r, c * 32 + v] = T.if_then_else(ok, WinA[b_i, row, d0 + v], zero)
        else:
            for v in T.vectorized(32):
                if fp4:
                    nib = T.shift_right(MainA[b_i, row, (d0 + v) // 8], ((d0 + v) % 8) * 4) & 15
                    val = e2m1_value(nib) * T.cast(MainB[b_i, row, (d0 + v) // 16], "float32")
                    buf[r, c * 32 + v] = T.if_then_else(ok, T.cast(val, "bfloat16"), zero)
                else:
                    buf[r, c * 32 + v] = T.if_then_else(ok, MainA[b_i, row, d0 + v], zero)
