"""The warp-specialised CTA: its shared buffers, barriers and fragments, and the three warpgroups' roles (two
consumers, one producer) dispatched to the macros of :mod:`.ws_consumers` and :mod:`.ws_producer`."""

import tilelang.language as T

from tiles.sparse_attn.dequant import decode_helpers_cuda
from tiles.sparse_attn.kv_layout import kv_buffer
from tiles.sparse_attn.online_softmax import LOG2E
from tiles.sparse_attn.ws_consumers import (
    BALANCED_NREG,
    FUSE_CUDA,
    PAIRED_NREG,
    PAIRED_OVL_NREG,
    SEESAW_NREG,
    WsCta,
    WsFuse,
    WsHalf,
    WsHelper,
    WsPair,
    WsSeesaw,
    WsSoftmax,
    WsTokens,
    ws_balanced_consumer,
    ws_paired_warpgroup,
    ws_seesaw_consumer,
    ws_wg0_token,
    ws_wg1_token,
)
from tiles.sparse_attn.ws_producer import (
    WsBuffer,
    WsDims,
    WsRegisters,
    WsSources,
    lane_col,
    lane_row,
    ws_fetch_rows,
    ws_issue_main_loads,
    ws_ovl_store_o,
    ws_produce_batched,
    ws_produce_halves,
    ws_produce_halves_tokens,
    ws_produce_into,
    ws_produce_row,
)


def sparse_attn_ws(
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
    io="direct",
    consumers="wg0_scores",
    wg1_rows=0,
    tokens_per_cta=1,
    combine="separate",
    handoff="after_pv",
    lanes="row",
    fp4_decode="fma",
    partials="fp32",
    unused_rows="row0",
    window_shared=False,
    main_shared=False,
):
    """Warp-specialised schedule (384 threads): warpgroup 0 computes S = Q K^T, the online softmax and
    the left half of O; warpgroup 1 the right half of O; warpgroup 2 (the producer) gathers and
    dequantises the next block into the other of two KV buffers. Same tensors as sparse_attn_kernel.

    ``produce`` is how the producer fills a buffer:

    * ``serial``: 16 rows at a time, each load waited for before the next pass (four global-memory
      latencies per block, one more for the indices).
    * ``batched``: every index of the block, then every load of the block (or of half of it, FP8 rows
      being twice as wide) is issued before the first is used, so one latency covers the block; the next
      block's indices are fetched while this one is dequantised, with the packed-integer helpers of
      ``_DEQUANT_CUDA``. bf16 rows go by cp.async straight into the buffer, signalled through the
      mbarrier (``cp.async.mbarrier.arrive.noinc``) as in TileLang's sparse_mla_fwd_pipelined.
    * ``prefetch`` (FP4): ``batched``, but a main block's loads are issued at the end of the previous
      step, before its buffer frees, so the load latency leaves the critical path (see
      :func:`_ws_produce_prefetch`). H200, gathered FP4 prefill 4K 1.0181 against batched's 1.0306 ms, decode level
      (a2d725b): the producer's load latency is not what limits it.

    ``io`` is how the CTA reads Q and writes O:

    * ``direct``: all 384 threads copy the [64, 512] Q tile; 64 x 256 values per half do not split
      into 16-byte vectors over 384 threads, so TileLang lowers it to 2-byte loads and stores (86 per
      thread, each store waiting on its load: a third of the prefill kernel's stall samples in Nsight
      Compute, H200, 95a6be9). O goes from the accumulator fragments straight to global.
    * ``staged``: each consumer warpgroup copies its own half of Q (128 threads, 16-byte vectors) and
      arrives on the Q barrier after a proxy fence; with one split, each writes its O half into the Q
      half it no longer needs and copies that out in 16-byte vectors (as the TileLang example does).
    * ``overlapped`` (``tokens_per_cta`` > 1, one split, bf16 rows, ``wg0_scores`` with the batched producer): the
      CTA's first Q as ``staged``; every later one by 16-byte cp.async copies that consumer warpgroup 1 issues once
      warpgroup 0's last QK^T of the token before has completed (warpgroup 1 waits for P most of a block; the copies
      arrive on the Q barrier as they land). Each consumer warpgroup writes its O half into its half of the token's
      last KV buffer (both P V of that block are done) and hands the buffer back; the producer stores O from it before
      it refills that buffer one block into the next token (each thread storing the chunks it is about to overwrite),
      and after its last block for the CTA's last tokens. Neither the Q load nor the O store is on the consumers'
      path: with io=staged they measured ~1.7 and ~2.5 us of the 5.75 us fixed per CTA (H200, 0ce975d).
    * ``auto`` (the prefill and bf16 tiles' Hopper default): resolved per call by :func:`resolve_io`.

    ``consumers`` is how the two consumer warpgroups share a block's work:

    * ``wg0_scores``: warpgroup 0 computes all of S = Q K^T (half the block's FLOPs) and the softmax, then both
      compute their half of O += P V. Warpgroup 1 idles through QK^T and the softmax: in Nsight Compute (prefill 4K,
      io=staged) 24% of all stall samples sat on its wait for P, and warpgroup 0 is the critical path.
    * ``balanced``: each warpgroup computes S for half of the block's rows (N = block_I / 2), the two exchange their
      row maxima through shared memory (one mbarrier phase), each writes its P columns into the shared P tile
      (a second phase), and both compute their half of O from the whole P. Both carry the same running max, so
      each keeps its own partial row sum; the two sums meet once at the end. Each warpgroup does half the FLOPs.
    * ``balanced_overlap``: ``balanced`` with P V left in flight; it completes under the next block's QK^T.
    * ``seesaw`` (FlashMLA's decode schedule): the warpgroups take whole blocks in turn, warpgroup w the blocks
      g = w, w + 2, ... (always in buffer w): each computes all of S for its block (N = block_I) and the softmax with
      the running max the other left after block g - 1, hands P, its rescale and the new max to the other through
      shared memory, and both add their half of O += P V for every block. The softmaxes still run one after the
      other, but each warpgroup's QK^T of its next block runs on the tensor cores under the other's softmax, and
      both do the same work (warpgroup 1 no longer idles through QK^T and the softmax). Each keeps the row sum of
      its own blocks; the two meet once at the end. See :func:`ws_seesaw_consumer`.
    * ``paired`` (FlashMLA's sparse prefill schedule): the warpgroups take the two blocks of a pair at once (block
      2 k + w in buffer w), so both QK^T run together; warpgroup 0's softmax hands its new max to warpgroup 1, whose
      max is the pair's and goes back; each adds its own block by an RS wgmma from its P registers and the other's
      from shared memory. See :func:`_ws_paired_consumer`.

    ``wg1_rows`` (0 or 16, FP4 with the batched producer and ``wg0_scores``): rows of each main block that consumer
    warpgroup 1 gathers and dequantises itself. In Nsight Compute (H200, prefill 4K, io=staged; 54a4781)
    the producer warp issued ~1150 instructions per block at ~0.2 IPC while warpgroup 0 waited 26% of its time for
    a filled buffer, and warpgroup 1 waited 67% of its time for P. With 16: warpgroup 1 fills the last 16 rows of
    block i + 1 while warpgroup 0 computes block i's scores (its loads issued a block ahead), the producer the first
    48, both arriving on the buffer's ready barrier.

    ``tokens_per_cta`` (1, 2, 4, 8; batched producer, ``wg0_scores``, io=staged or overlapped): each CTA runs that many consecutive
    (token, head block) items in turn. At ~205 KiB of shared memory one CTA holds an SM, so a CTA's prologue (Q
    load, the producer's first gather and dequant) and epilogue (sink, O store) overlap nothing; with several tokens
    per CTA the producer runs on into the next token's blocks (its index prefetch crosses the boundary) while the
    consumers finish this one, and buffer and barrier phases run on across tokens. Measured on the H200 (84d7a8c):
    2 and 4 are 1-4% slower than 1 at every shape. The block-scaling fit of the same runs (2.76 us per 64-row block
    per SM + 5.29 us per CTA) says the fixed cost is real; this overlap does not recover it.

    ``combine`` (``n_split > 1``): ``separate`` writes the splits' fp32 partials for :func:`combine_kernel`;
    ``fused`` also counts each split CTA in on a per-(token, head block) counter, and the last to arrive merges
    the splits with the sink and writes bf16 Out itself (:func:`_ws_fused_combine`): no second launch. Measured
    slower than ``separate`` on the H200 (decode B=64/S=1 0.0369 vs 0.0316 ms; 84d7a8c): the merge lengthens the last
    CTA more than the launch it saves.

    ``handoff`` (``wg0_scores``): ``after_pv`` hands P to warpgroup 1 once warpgroup 0's own half of P V has
    completed; ``before_pv`` before it (see :func:`_ws_softmax_step`). Measured on the H200 (34010dc): no gain with FP4
    KV, 6% at bf16 decode B=128/S=2.

    ``lanes`` is which of a block's (row, 32-column slice) pairs each producer lane owns (:func:`lane_row`):

    * ``row``: the 8 lanes of a quarter-warp share a row, lane c its columns 32 c .. 32 c + 31 of each half. The KV
      buffers are 128-byte swizzled for wgmma (64-column atoms, 16-byte chunk k of row r at k ^ (r % 8)), so at one
      store the 8 lanes hit only two chunk positions of their row: a 4-way bank conflict on every 16-byte store of
      dequantised values. Nsight Compute (H200, prefill 4K, io=staged; 54a4781, 9765af3) counted 4x
      the ideal wavefronts on each such STS.128: 63M excess of the kernel's 164M shared-memory wavefronts, with
      L1/TEX throughput at 79% of peak (9765af3).
    * ``column``: the 8 lanes of a quarter-warp take 8 consecutive rows (row r % 8 all different) at the same columns,
      so the swizzle spreads their stores over all 32 banks. Each lane still loads 16 contiguous bytes per row half;
      a warp's load touches 8 rows x 64 B instead of 4 rows x 128 B (the same sectors).

    ``fp4_decode`` (FP4, batched/prefetch producer, and warpgroup 1's ``wg1_rows``) is how a packed main-KV word becomes 8
    bf16: ``fma`` (``csa2_fp4x8_bf16``: shifts and masks into the bf16 field, two exact bf16x2 multiplies per pair) or
    ``prmt`` (``csa2_fp4x8_bf16_prmt``: byte-permute lookups into constant tables of the 8 magnitudes' bf16 bytes, the
    signs merged, one exact multiply by the scale pair). The same output bits; fewer producer instructions per block.
    H200: prmt 1.3-3.4% faster than fma (5f78fe9).

    ``partials`` (``n_split > 1``, ``wg0_scores``, separate combine): the dtype of the splits' partial O. ``fp32``, or
    ``bf16``: half the bytes each split CTA writes at its end (at decode B=64/S=1 every CTA of the one wave stores its
    128 KiB of fp32 partials at about the same moment, 16 MiB in all) and half what the combine reads; each partial is
    staged through the freed Q half and stored in 16-byte vectors like O. One more bf16 rounding of each partial
    before the fp32 merge.
    """
    B, S, Nw, Nc = T.dynamic("B"), T.dynamic("S"), T.dynamic("Nw"), T.dynamic("Nc")
    H, D, W, K, BI, HB, NS = heads, dim, window, topk, block_I, heads_per_block, n_split
    REP = H // HB
    NBW, NBK = -(-W // BI), -(-K // BI)
    NB = NBW + NBK
    D2 = D // 2
    ROWS = 16  # producer rows per pass: 128 threads, 8 per row, each 32 columns of each half
    # batched producer registers: a batch is all BI / ROWS rows of FP4 (4 words + 2 scales per half) or
    # half of them for FP8 (8 words + 1 scale per half)
    RAW_WORDS, RAW_SCALES = (BI // ROWS) * 8, (BI // ROWS) * 4
    scale2 = sm_scale * LOG2E
    bf16, f32 = "bfloat16", "float32"
    fp4 = kv_format == "fp4"
    out_shape = [B, S, H, D] if NS == 1 else [B, S, NS, H, D]
    out_dtype = bf16 if NS == 1 or partials == "bf16" else f32
    bf16_parts = NS > 1 and partials == "bf16"  # split partials staged out as bf16 like O
    prefetch = produce == "prefetch"  # the batched producer with the next main block's loads issued early
    helped = wg1_rows > 0  # consumer warpgroup 1 fills the last pass of rows of each main block
    TPC = tokens_per_cta
    main_passes = tuple(range(BI // ROWS - 1)) if helped else None  # the producer's passes over a main block
    balanced = consumers in ("balanced", "balanced_overlap")  # both consumer warpgroups compute S (half the rows each)
    overlap = consumers == "balanced_overlap"  # ... with P V completing under the next block's QK^T
    seesaw = consumers == "seesaw"  # the consumer warpgroups take whole blocks in turn (both compute S)
    paired = consumers in ("paired", "paired_halves")  # ... the two blocks of a pair at once (both compute S)
    halves = consumers == "paired_halves"  # ... each KV buffer handed over in halves (bf16 rows)
    batched = produce in ("batched", "prefetch")
    fused = combine == "fused"  # the last split CTA of each (token, head block) merges the partials itself
    # the producer's packed-integer helpers (bound here, outside the kernel macro, so the macro sees one name)
    dequant_cuda = decode_helpers_cuda(fp4_decode) if batched and fp4 else ""
    win_args = ([B, Nw, D], "float8_e4m3fn", [B, Nw, D // 32], "uint8") if fp4 else ([B, Nw, D], bf16, [1], "uint8")
    # Packed FP4 is read as int32 words (8 codes each, inside one 16-wide scale group): one load per 8 values.
    main_args = ([B, Nc, D // 8], "int32", [B, Nc, D // 16], "float8_e4m3fn") if fp4 else ([B, Nc, D], bf16, [1], "uint8")
    if batched and fp4:  # the packed-integer helpers read FP8 codes as words and scales as bytes
        win_args = ([B, Nw, D // 4], "int32", [B, Nw, D // 32], "uint8")
        main_args = ([B, Nc, D // 8], "int32", [B, Nc, D // 16], "uint8")

    # The kernel body is a macro so that the two signatures below (with and without the fused combine's
    # scratch and counter) share it; it inlines, the default's generated source is what it was.
    @T.macro
    def body(Q, WinA, WinB, WinIdx, MainA, MainB, TopkIdx, Sink, Out, LsePart, OPart, Counter):
        """The whole CTA; OPart and Counter are None unless ``combine="fused"``."""
        with T.Kernel(T.ceildiv(S * REP, TPC) if TPC > 1 else S * REP, B, NS, threads=384) as (bx, by, bz):
            if (batched and fp4) or fused:  # one import: the producer's and the fused combine's helpers
                T.import_source(dequant_cuda + (FUSE_CUDA if fused else ""))
            Q_l = T.alloc_shared([HB, D2], bf16)
            Q_r = T.alloc_shared([HB, D2], bf16)
            KV0_l = T.alloc_shared([BI, D2], bf16)
            KV0_r = T.alloc_shared([BI, D2], bf16)
            KV1_l = T.alloc_shared([BI, D2], bf16)
            KV1_r = T.alloc_shared([BI, D2], bf16)
            valid0 = T.alloc_shared([BI], "bool", scope="shared")
            valid1 = T.alloc_shared([BI], "bool", scope="shared")
            S_shared = T.alloc_shared([HB, BI], bf16)
            alpha_shared = T.alloc_shared([HB], f32, scope="shared")
            final_shared = T.alloc_shared([HB], f32, scope="shared")
            # one accumulator per consumer warpgroup: a fragment's layout belongs to one thread range
            acc_o_l = T.alloc_fragment([HB, D2], f32)
            acc_o_r = T.alloc_fragment([HB, D2], f32)
            acc_s = T.alloc_fragment([HB, BI // 2 if balanced else BI], f32)
            sumexp = T.alloc_fragment([HB], f32)
            sumexp_i = T.alloc_fragment([HB], f32)
            alpha = T.alloc_fragment([HB], f32)
            m_i = T.alloc_fragment([HB], f32)
            m_i_prev = T.alloc_fragment([HB], f32)
            row_local = T.alloc_local([1], "int32")
            if balanced or seesaw or paired:
                # warpgroup 1's scores and softmax state (warpgroup 0 uses acc_s, m_i, ...): a fragment's layout
                # belongs to one thread range
                acc_s1 = T.alloc_fragment([HB, BI // 2 if balanced else BI], f32)
                sumexp1 = T.alloc_fragment([HB], f32)
                sumexp_i1 = T.alloc_fragment([HB], f32)
                alpha1 = T.alloc_fragment([HB], f32)
                m_i1 = T.alloc_fragment([HB], f32)
                m_i_prev1 = T.alloc_fragment([HB], f32)
                rowmax_shared = T.alloc_shared([2, HB], f32, scope="shared")  # each warpgroup's row max of the block
                rowsum_shared = T.alloc_shared([2, HB], f32, scope="shared")  # each warpgroup's partial row sums
            if seesaw or paired:
                P1_shared = T.alloc_shared([HB, BI], bf16)  # warpgroup 1's P (warpgroup 0's goes to S_shared)
                handed_shared = T.alloc_shared([2, 2, HB], f32, scope="shared")  # per warpgroup: its block's rescale, new max
            if paired:  # each warpgroup's P in registers, the A operand of its own P V
                P0_frag = T.alloc_fragment([HB, BI], bf16)
                P1_frag = T.alloc_fragment([HB, BI], bf16)
            if batched:
                rows_cur = T.alloc_local([BI // ROWS], "int32")  # this thread's rows of the block being filled
                rows_next = T.alloc_local([BI // ROWS], "int32")  # ... and of the next one, fetched early
                raw = T.alloc_local([RAW_WORDS], "int32")  # packed codes of one batch of rows
                rawsc = T.alloc_local([RAW_SCALES], "uint8")  # their scale bytes
                vals = T.alloc_local([8], bf16)
            if helped:  # warpgroup 1's registers for its pass of rows (see ws_wg1_fill)
                h_rows_cur = T.alloc_local([1], "int32")
                h_rows_next = T.alloc_local([1], "int32")
                h_raw = T.alloc_local([8], "int32")
                h_rawsc = T.alloc_local([4], "uint8")
                h_vals = T.alloc_local([8], bf16)

            bar_q = T.alloc_barrier(arrive_count=384 if io == "direct" else 256)
            bar_k0_ready = T.alloc_barrier(arrive_count=256 if helped else 128)  # the producer (and warpgroup 1)
            bar_k1_ready = T.alloc_barrier(arrive_count=256 if helped else 128)
            # paired_halves: the left halves' barriers (the right halves' below); one consumer warpgroup frees a half
            bar_k0_free = T.alloc_barrier(arrive_count=128 if halves else 256)
            bar_k1_free = T.alloc_barrier(arrive_count=128 if halves else 256)
            if halves:
                bar_k0r_ready = T.alloc_barrier(arrive_count=128)
                bar_k1r_ready = T.alloc_barrier(arrive_count=128)
                bar_k0r_free = T.alloc_barrier(arrive_count=128)
                bar_k1r_free = T.alloc_barrier(arrive_count=128)
                rows_pair = T.alloc_local([BI // ROWS], "int32")  # the producer's rows of the next pair's first block
                rows_pair_next = T.alloc_local([BI // ROWS], "int32")  # ... and of its second
            bar_o0 = bar_o1 = None
            if halves and TPC > 1:  # io=overlapped: each warpgroup's own barrier for storing its O half through its P tile
                bar_o0 = T.alloc_barrier(arrive_count=128)
                bar_o1 = T.alloc_barrier(arrive_count=128)
            bar_s_ready = T.alloc_barrier(arrive_count=256)
            bar_s_free = T.alloc_barrier(arrive_count=256)
            bar_final = T.alloc_barrier(arrive_count=256)
            if balanced:
                bar_max = T.alloc_barrier(arrive_count=256)  # both warpgroups' block row maxima are in rowmax_shared
                bar_p = T.alloc_barrier(arrive_count=256)  # both halves of P are in S_shared
            if seesaw or paired:
                bar_p0 = T.alloc_barrier(arrive_count=128)  # warpgroup 0's P, rescale and max are in shared memory
                bar_p1 = T.alloc_barrier(arrive_count=128)  # warpgroup 1's
                bar_p0_free = T.alloc_barrier(arrive_count=128)  # warpgroup 1 is done with warpgroup 0's P (its P V completed)
                bar_p1_free = T.alloc_barrier(arrive_count=128)  # warpgroup 0 is done with warpgroup 1's
            if paired:
                bar_m0 = T.alloc_barrier(arrive_count=128)  # warpgroup 0's new running max is in handed_shared
                bar_m1 = T.alloc_barrier(arrive_count=128)  # warpgroup 1's (the pair's)
            if fused:  # see _ws_fused_combine
                comb_shared = T.alloc_shared([2, NS + 2, HB], f32, scope="shared")  # per warpgroup: weights, max, denominator
                last_shared = T.alloc_shared([1], "int32", scope="shared")  # the counter's old value: NS - 1 in the last CTA
                bar_arrived = T.alloc_barrier(arrive_count=256)  # every consumer thread's partial is stored and fenced
                bar_last = T.alloc_barrier(arrive_count=1)  # thread 0 has counted the CTA's arrival
            # the two KV buffers, used in turn: block it goes to buffer it % 2
            bufs = (
                WsBuffer(KV0_l, KV0_r, valid0, bar_k0_ready, bar_k0_free, *((bar_k0r_ready, bar_k0r_free) if halves else ())),
                WsBuffer(KV1_l, KV1_r, valid1, bar_k1_ready, bar_k1_free, *((bar_k1r_ready, bar_k1r_free) if halves else ())),
            )

            b_i, s_i = by, bx // REP
            h0 = (bx % REP) * HB
            lo = bz * NB // NS
            n_blk = (bz + 1) * NB // NS - lo
            tx = T.get_thread_binding()
            nxt = None
            if io == "overlapped":
                nxt = WsTokens(bx * TPC, T.min(TPC, S * REP - bx * TPC), REP, tx % 128)
            fuse = None
            if fused:
                fuse = WsFuse(OPart, LsePart, Counter, Sink, Out, comb_shared, last_shared, bar_arrived, bar_last, tx)

            if io == "direct":
                T.copy(Q[b_i, s_i, h0 : h0 + HB, 0:D2], Q_l)
                T.copy(Q[b_i, s_i, h0 : h0 + HB, D2:D], Q_r)
                T.barrier_arrive(bar_q)

            cta = WsCta(
                Q,
                Q_l,
                Q_r,
                Out,
                LsePart,
                Sink,
                S_shared,
                alpha_shared,
                final_shared,
                bufs,
                bar_q,
                bar_final,
                bar_s_ready,
                bar_s_free,
                b_i,
                bz,
                lo,
                n_blk,
                HB,
                BI,
                D2,
                NS,
                scale2,
                io,
                fuse,
                handoff == "before_pv",
                bf16_parts,
                nxt,
            )
            if balanced:  # what both balanced consumer warpgroups are given besides their own fragments
                pair = WsPair(Q, Q_l, Q_r, Out, LsePart, Sink, S_shared, rowmax_shared, rowsum_shared, bar_q, bar_max, bar_p, bar_final)
                balanced_args = (pair, bufs, b_i, s_i, h0, bz, n_blk, HB, BI, D2, NS, scale2, io, overlap, fuse)
            if seesaw or paired:  # what both seesaw (paired) consumer warpgroups share
                see = WsSeesaw(
                    Q,
                    Q_l,
                    Q_r,
                    Out,
                    LsePart,
                    Sink,
                    (S_shared, P1_shared),
                    handed_shared,
                    rowsum_shared,
                    bar_q,
                    (bar_p0, bar_p1),
                    (bar_p0_free, bar_p1_free),
                    bar_final,
                    (bar_m0, bar_m1) if paired else None,
                )
                seesaw_args = (see, bufs, b_i, s_i, h0, bz, n_blk, -(-NB // NS), HB, BI, D2, NS, scale2, io)

            if balanced or seesaw or paired:  # each consumer warpgroup's own fragments (warpgroup 1's exist only here)
                wg_half = (
                    WsHalf(0, Q_l, acc_s, acc_o_l, sumexp, sumexp_i, alpha, m_i, m_i_prev),
                    WsHalf(1, Q_r, acc_s1, acc_o_r, sumexp1, sumexp_i1, alpha1, m_i1, m_i_prev1),
                )

            if tx < 128:
                if paired:
                    T.set_max_nreg(PAIRED_NREG if TPC == 1 else PAIRED_OVL_NREG, 1)
                    ws_paired_warpgroup(wg_half[0], P0_frag, bar_o0, seesaw_args, halves, TPC, bx, S, REP, nxt)
                elif seesaw:
                    T.set_max_nreg(SEESAW_NREG, 1)
                    ws_seesaw_consumer(wg_half[0], *seesaw_args)
                elif balanced:
                    T.set_max_nreg(BALANCED_NREG, 1)
                    ws_balanced_consumer(wg_half[0], *balanced_args)
                else:
                    T.set_max_nreg(240, 1)
                    sm = WsSoftmax(
                        Q_l, Q_r, S_shared, alpha_shared, acc_s, acc_o_l, sumexp, sumexp_i, alpha, m_i, m_i_prev, bar_s_ready, bar_s_free
                    )
                    if TPC == 1:
                        ws_wg0_token(cta, sm, s_i, h0, 0)
                    else:
                        for j in T.serial(TPC):
                            if bx * TPC + j < S * REP:
                                ws_wg0_token(cta, sm, (bx * TPC + j) // REP, ((bx * TPC + j) % REP) * HB, j)
            elif tx < 256:
                if paired:
                    T.set_max_nreg(PAIRED_NREG if TPC == 1 else PAIRED_OVL_NREG, 1)
                    ws_paired_warpgroup(wg_half[1], P1_frag, bar_o1, seesaw_args, halves, TPC, bx, S, REP, nxt)
                elif seesaw:
                    T.set_max_nreg(SEESAW_NREG, 1)
                    ws_seesaw_consumer(wg_half[1], *seesaw_args)
                elif balanced:
                    T.set_max_nreg(BALANCED_NREG, 1)
                    ws_balanced_consumer(wg_half[1], *balanced_args)
                else:
                    T.set_max_nreg(168, 1)
                    if helped:
                        q = tx - 128
                        hsrc = WsSources(WinA, WinB, WinIdx, MainA, MainB, TopkIdx)
                        hregs = WsRegisters(h_rows_cur, h_rows_next, h_raw, h_rawsc, h_vals)
                        hdims = WsDims(W, K, BI, NBW, ROWS, D2, Nw, Nc, lanes, fp4_decode)
                        helper = WsHelper(hsrc, hregs, hdims, q)
                    else:
                        helper = None
                    if TPC == 1:
                        ws_wg1_token(cta, acc_o_r, helper, s_i, h0, 0)
                    else:
                        for j in T.serial(TPC):
                            if bx * TPC + j < S * REP:
                                ws_wg1_token(cta, acc_o_r, helper, (bx * TPC + j) // REP, ((bx * TPC + j) % REP) * HB, j)
            elif batched:
                # 240 + 168 + 96 (balanced: 200 + 200 + 104; seesaw: 2 x SEESAW_NREG + the rest) = 504 registers per
                # thread slot: what the 384-thread launch allocates (168 x 3)
                consumer_nreg = {"balanced": BALANCED_NREG, "balanced_overlap": BALANCED_NREG, "seesaw": SEESAW_NREG}
                consumer_nreg.update(paired=PAIRED_NREG, paired_halves=PAIRED_NREG if TPC == 1 else PAIRED_OVL_NREG)
                T.set_max_nreg(504 - 2 * consumer_nreg[consumers] if consumers in consumer_nreg else 96, 0)
                p = tx - 256
                src = WsSources(WinA, WinB, WinIdx, MainA, MainB, TopkIdx)
                regs = WsRegisters(rows_cur, rows_next, raw, rawsc, vals)
                dims = WsDims(W, K, BI, NBW, ROWS, D2, Nw, Nc, lanes, fp4_decode, unused_rows)
                if TPC > 1 and halves:  # io=overlapped (the constraints)
                    pair_rows = (rows_cur, rows_next, rows_pair, rows_pair_next)
                    ws_produce_halves_tokens(src, dims, bufs, pair_rows, b_i, lo, n_blk, TPC, p, nxt)
                elif TPC > 1:
                    # the CTA's tokens in turn, the row prefetch crossing into the next token (past the last one it
                    # reads a clamped token's rows, never used)
                    ws_fetch_rows(src, dims, rows_cur, b_i, (bx * TPC) // REP, lo, p)
                    for j in T.serial(TPC):
                        if bx * TPC + j < S * REP:
                            for it in T.serial(n_blk):
                                s_cur = (bx * TPC + j) // REP
                                s_nxt = T.if_then_else(it + 1 < n_blk, s_cur, T.min((bx * TPC + j + 1) // REP, S - 1))
                                b_nxt = T.if_then_else(it + 1 < n_blk, lo + it + 1, lo)
                                if (j * n_blk + it) % 2 == 0:
                                    T.barrier_wait(bar_k0_free, (((j * n_blk + it) // 2) & 1) ^ 1)
                                    if io == "overlapped":
                                        ws_ovl_store_o(Out, bufs[0], dims, b_i, nxt, j, it, n_blk, p)
                                    ws_produce_batched(src, regs, dims, bufs[0], b_i, s_cur, lo + it, p, fp4, None, s_nxt, b_nxt)
                                else:
                                    T.barrier_wait(bar_k1_free, (((j * n_blk + it) // 2) & 1) ^ 1)
                                    if io == "overlapped":
                                        ws_ovl_store_o(Out, bufs[1], dims, b_i, nxt, j, it, n_blk, p)
                                    ws_produce_batched(src, regs, dims, bufs[1], b_i, s_cur, lo + it, p, fp4, None, s_nxt, b_nxt)
                    if io == "overlapped":
                        # the O staged in the last tokens' buffers, which no block refills: as if blocks
                        # count * n_blk and count * n_blk + 1 were acquired (the second-to-last token's too when n_blk == 1)
                        for e in T.serial(2):
                            g = nxt.count * n_blk + e
                            if g % 2 == 0:
                                T.barrier_wait(bar_k0_free, ((g // 2) & 1) ^ 1)
                                ws_ovl_store_o(Out, bufs[0], dims, b_i, nxt, 0, g, n_blk, p)
                            else:
                                T.barrier_wait(bar_k1_free, ((g // 2) & 1) ^ 1)
                                ws_ovl_store_o(Out, bufs[1], dims, b_i, nxt, 0, g, n_blk, p)
                else:
                    ws_fetch_rows(src, dims, rows_cur, b_i, s_i, lo, p)
                if prefetch:  # noqa: SIM102  (a Python flag around a TileLang condition: they cannot be joined with `and`)
                    if lo >= NBW:  # the first block is a main one: its loads go out before the first free buffer
                        ws_issue_main_loads(src, regs, dims, b_i, p)
                        ws_fetch_rows(src, dims, rows_next, b_i, s_i, lo + 1, p)
                if TPC == 1 and halves:
                    pair_rows = (rows_cur, rows_next, rows_pair, rows_pair_next)
                    ws_produce_halves(src, dims, bufs, pair_rows, b_i, s_i, lo, n_blk, -(-NB // NS), p)
                elif TPC == 1:
                    for it in T.serial(n_blk):
                        blk = lo + it
                        if it % 2 == 0:
                            ws_produce_into(src, regs, dims, bufs[0], bar_k0_free, it, b_i, s_i, blk, p, fp4, main_passes, prefetch, n_blk)
                        else:
                            ws_produce_into(src, regs, dims, bufs[1], bar_k1_free, it, b_i, s_i, blk, p, fp4, main_passes, prefetch, n_blk)
            else:
                T.set_max_nreg(80, 0)
                p = tx - 256
                c = lane_col(p, lanes)
                for it in T.serial(n_blk):
                    blk = lo + it
                    if it % 2 == 0:
                        T.barrier_wait(bar_k0_free, ((it // 2) & 1) ^ 1)
                    else:
                        T.barrier_wait(bar_k1_free, ((it // 2) & 1) ^ 1)
                    for rr in T.serial(BI // ROWS):
                        r = rr * ROWS + lane_row(p, lanes)
                        if blk < NBW:
                            pos = blk * BI + r
                            row_local[0] = T.if_then_else(pos < W, WinIdx[b_i, s_i, T.min(pos, W - 1)], -1)
                        else:
                            pos = (blk - NBW) * BI + r
                            row_local[0] = T.if_then_else(pos < K, TopkIdx[b_i, s_i, T.min(pos, K - 1)], -1)
                        if it % 2 == 0:
                            ws_produce_row(WinA, WinB, MainA, MainB, KV0_l, KV0_r, valid0, row_local, b_i, r, c, blk < NBW, fp4, D2)
                        else:
                            ws_produce_row(WinA, WinB, MainA, MainB, KV1_l, KV1_r, valid1, row_local, b_i, r, c, blk < NBW, fp4, D2)
                    # generic-proxy stores must be visible to wgmma's async-proxy reads
                    T.fence_proxy_async()
                    if it % 2 == 0:
                        T.barrier_arrive(bar_k0_ready)
                    else:
                        T.barrier_arrive(bar_k1_ready)

    if fused:

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
            Out: T.Tensor([B, S, H, D], bf16),
            LsePart: T.Tensor([B, S, NS, H], f32),
            OPart: T.Tensor([B, S, NS, H, D], f32),
            Counter: T.Tensor([B, S, REP], "int32"),
        ):
            body(Q, WinA, WinB, WinIdx, MainA, MainB, TopkIdx, Sink, Out, LsePart, OPart, Counter)

        return main

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
        Out: T.Tensor(out_shape, out_dtype),
        LsePart: T.Tensor([B, S, NS, H], f32),
    ):
        body(Q, WinA, WinB, WinIdx, MainA, MainB, TopkIdx, Sink, Out, LsePart, None, None)

    return main
