"""The score kernel: per (batch, token, run of ``block_n`` entries) the packed FP4 index K dequantised, multiplied with
the token's 32 x 128 query on the tensor cores, ReLU'd, weighted and summed over heads (contiguous entries, or a
candidate pool's with ``gather``)."""

import functools

import tilelang
import tilelang.language as T
import tvm

from tiles.core.arch import cuda_target
from tiles.indexer.common import GROUP, HEAD_DIM, HEADS
from tiles.indexer.dequant import (
    FMA_PAIR_CUDA,
    FP8_CUDA,
    FP8_GROUPS,
    FP8_MAX_BLOCK_N,
    HOPPER_ONLY_DEQUANTS,
    PRMT_CUDA,
    PRMT_PAIR2_CUDA,
    PRMT_PAIR_CUDA,
    PRMT_RS_DEQUANTS,
    REGISTER_A_DEQUANTS,
    RS_DEQUANTS,
    build_rs_tables,
    dequant_fragment_fma,
    dequant_fragment_prmt,
    dequant_fragment_prmt2,
    dequant_groups_prmt,
    dequant_words_bits,
    e2m1_bf16_bits,
    load_q_fp8,
    load_q_rs,
    load_q_rs_fma,
    rs_register_split,
    score_fp8_groups,
)

EPILOGUES = ("per_tile", "hoisted", "fused")  # per-CTA constants per tile or once; (fused) + the head sum by hand
# hidden_tiles: what the contiguous score kernel does with the entry tiles past the token's visible count. "score"
# dequantises, multiplies and masks them like any other; "skip" ends the CTA's tile loop at the last tile holding a
# visible entry and writes -inf over the rest of its span. Why: at prefill each token sees the cache up to itself, so
# about half the (token, tile) pairs hold no visible entry, and timing the prefill kernel with its FP4 dequant taken
# out put the dequant alone at 39% of its time (H200, 181 of 466 us, efc6840). Decode rows see (nearly) the whole
# cache: the same loop less at most its last tiles.
HIDDEN_TILES = ("score", "skip")


# epilogue="hoisted" (RS dequants): the tile loop's fixed work that does not change within a CTA, done once per CTA.
# Why: the RS score kernel is issue/ALU-bound, and of prmt_rs's 310 SASS instructions per consumer thread and tile ~150
# are not dequant work. per_tile's epilogue reloads w from shared memory (4 LDS.64) and halves it (8 FMUL) every tile
# (w_s is written by TMA, so nvcc cannot keep it in registers), and each of the 2 stores rebuilds the int64 index of
# (b, s, j) (~16 instructions each). Here:
# * w / 2 goes to a register fragment (8 floats per thread: the accumulator's columns) once, straight from global
#   memory: no w_s, no TMA of it, no mbarrier wait on it in the first tile.
# * The CTA's part of its output row is a buffer of its own (a pointer built once); a store indexes it by the
#   32-bit t * block_n + row. nvcc's address sinking (CodeGenPrepare) moved that pointer's int64 arithmetic back next
#   to each store inside the loop; an empty asm that "redefines" it (csa2_pin_ptr) hides its origin, so it stays one
#   64-bit register. (Through the global window: a generic pointer made the stores generic ST instead of STG.)
# * Not done: the wgmma descriptors. T.gemm emits initialize_wgmma_descriptor and desc + offset per k-step inside the
#   loop and ptxas rebuilds each UR pair per HGMMA (~20 uniform instructions per tile); only a hand-written wgmma
#   would change that, and T.gemm is what lays out the A fragment and the accumulator for the rest of the kernel.
# Exactness: the same fp32 operations on the same values, in the same order ((acc + |acc|) * (w * 0.5), the head sum,
# the 4-lane shuffle sum); checked on the SASS (notes), and on the GPU by tests/test_indexer.py (bitwise vs per_tile).
_PIN_CUDA = r"""
__device__ __forceinline__ void* csa2_pin_ptr(void* p) {
  size_t g = __cvta_generic_to_global(p);  // through the global window: the stores stay STG, not generic ST
  asm("" : "+l"(g));
  return __cvta_global_to_generic(g);
}
"""


# epilogue="fused" (RS dequants, one consumer warpgroup): hoisted's per-CTA constants, and the ReLU-weighted head sum,
# its quad reduction and the store written by hand on the accumulator registers.
# Why: at the 256-entry default each consumer thread spends 216 SASS per tile on the epilogue and 56 on the store, of
# 872 (nvcc 13, sm_90a). ptxas fuses the weight multiply into the head sum for one of the thread's 8 rows only (the PTX
# has mul.f32 + add.f32 and ptxas picks), so 56 FMUL + 56 FADD stay; the 8 rows are then each summed over the quad by
# the 4-lane AllReduce (2 SHFL + 2 FADD a row) and quad lane 0 alone stores all 8 (8 STG with their bounds, while 3 of
# 4 lanes idle). Here, per thread and tile:
# * the head sum as one explicit FFMA chain a row: s = fma(x + |x|, w / 2, s) (64 FADD + 56 FFMA + 8 FMUL);
# * the quad sum as a reduce-scatter: exchange half of the rows with lane ^ 2, then half of the rest with lane ^ 1, so
#   each quad lane ends with 2M / 4 finished rows (M m-tiles: 2M rows a thread) and stores them itself (M = 4: 6 SHFL
#   + 6 FADD + 12 FSEL, and 2 STG a lane, instead of 16 + 16 and 8 STG on one lane).
# Layout: the thread's accumulator is wgmma's D fragment (PTX m64nNk16, N = 32 heads, 16 floats a 64-row m-tile):
# element a of m-tile m is row 64m + 16 warp + 8 ((a >> 1) & 1) + lane / 4, head 8 (a >> 2) + 2 (lane % 4) + (a & 1);
# TileLang hands it over as the local array acc[16 M] (T.gemm's wgmma call gets acc + 16 m). w_loc[2k + j] = w / 2 of
# head 8k + 2 (lane % 4) + j. Only with one consumer warpgroup (threadIdx.x & 127 is then the warpgroup lane whether
# TileLang puts the producer first or builds no producer).
# Exactness: the products and sums of the same fp32 values; each product x w is rounded once inside the FFMA instead
# of once more on its own (hoisted's rows other than the fused one), so scores are not bitwise hoisted's (a few ulps);
# the quad sum is bitwise the AllReduce's: lane l gets (v_l + v_l^2) + (v_l^1 + v_l^3), which IEEE commutativity makes
# equal to lane 0's (v0 + v2) + (v1 + v3) for every l.
_FUSED_EPI_CUDA = r"""
__device__ __forceinline__ void csa2_load_w_half(float* w, const float* wrow) {
  const int q = threadIdx.x & 3;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 p = *(const float2*)(wrow + 8 * k + 2 * q);
    w[2 * k] = p.x * 0.5f;
    w[2 * k + 1] = p.y * 0.5f;
  }
}
// acc: the thread's 16 M accumulator floats; rows of the tile at out[off + row] for off + row < n_left, -inf where
// not visible (off + row >= vis_left, or pos[row] < 0 when gather)
template <int M>
__device__ __forceinline__ void csa2_relu_wsum_store(const float* acc, const float* w, void* out_, const int* pos,
                                                     int off, int n_left, int vis_left, int gather) {
  float* out = (float*)out_;
  const int l = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
  float v[2 * M];  // v[2m + hi]: this thread's 8 heads of row 64m + 16 warp + 8 hi + l / 4
#pragma unroll
  for (int r = 0; r < 2 * M; ++r) {
    const int base = (r >> 1) * 16 + (r & 1) * 2;
    float s = 0.0f;
#pragma unroll
    for (int rv = 0; rv < 8; ++rv) {  // hoisted's order: head block rv & 3, pair element rv >> 2
      const float x = acc[base + (rv & 3) * 4 + (rv >> 2)];
      const float t = x + fabsf(x);
      const float wh = w[(rv & 3) * 2 + (rv >> 2)];
      s = rv == 0 ? t * wh : fmaf(t, wh, s);
    }
    v[r] = s;
  }
  const bool b = (l >> 1) & 1, c = l & 1;
  float u[M];  // step 1 (lane ^ 2): keep v[p + M b] (p < M), send the other half
#pragma unroll
  for (int p = 0; p < M; ++p) {
    const float send = b ? v[p] : v[p + M], keep = b ? v[p + M] : v[p];
    u[p] = keep + __shfl_xor_sync(0xffffffffu, send, 2);
  }
  if constexpr (M >= 2) {  // step 2 (lane ^ 1): keep u[p + c M / 2] (p < M / 2): value p + c M / 2 + b M
#pragma unroll
    for (int p = 0; p < M / 2; ++p) {
      const float send = c ? u[p] : u[p + M / 2], keep = c ? u[p + M / 2] : u[p];
      const float z = keep + __shfl_xor_sync(0xffffffffu, send, 1);
      const int vi = p + c * (M / 2) + b * M;
      const int row = (vi >> 1) * 64 + warp * 16 + (vi & 1) * 8 + (l >> 2);
      if (off + row < n_left) out[off + row] = (gather ? pos[row] >= 0 : off + row < vis_left) ? z : -__int_as_float(0x7f800000);
    }
  } else {  // one m-tile: both lanes of a pair hold the same row (value b); the even one stores it
    const float z = u[0] + __shfl_xor_sync(0xffffffffu, u[0], 1);
    const int row = warp * 16 + b * 8 + (l >> 2);
    if (!c && off + row < n_left) out[off + row] = (gather ? pos[row] >= 0 : off + row < vis_left) ? z : -__int_as_float(0x7f800000);
  }
}
"""


@T.macro
def _load_half_weights(weights, w_half, b, s, H: int):
    """weights [B, S, H] fp32 -> ``w_half`` [H] (a register fragment laid out like the accumulator's columns): w / 2."""
    for h in T.Parallel(H):
        w_half[h] = weights[b, s, h] * 0.5


@T.macro
def _store_row_hoisted(out_cta, row, pos_s, off, n_left, vis_left, block_n: int, gather: bool):
    """row [block_n] -> out_cta[off + i] (``out_cta`` [span]: the CTA's part of its output row) for off + i < n_left,
    -inf where not visible (off + i >= vis_left, or pos_s[i] < 0 with ``gather``). ``n_left``, ``vis_left`` are per CTA,
    so per tile only ``off`` = t * block_n changes (per_tile rebuilds the int64 index of (b, s, j) every tile)."""
    for i in T.Parallel(block_n):
        if off + i < n_left:
            visible = pos_s[i] >= 0 if gather else off + i < vis_left
            out_cta[off + i] = T.if_then_else(visible, row[i], -T.infinity("float32"))


_PAGE_COPIES = (0, 1, 2, 3, 4, 5, 6, 7)  # copies of one tile of a paged cache: block_n / page of them, at most 8


def pool_row(block_table, b, j, page: int):
    """The pool row of logical entry ``j`` of batch row ``b``: its page from the block table, then the offset in the
    page. A masked slot's ``j`` = -1 reads entry 0, and a -1 page (past the sequence's pages) page 0: both in bounds,
    their scores masked by the caller."""
    j = T.max(j, 0)
    return T.max(block_table[b, j // page], 0) * page + j % page


@functools.cache
def build_score_kernel(
    target: str,
    block_n: int,
    threads: int,
    stages: int,
    tiles_per_cta: int,
    dequant: str,
    gather: bool,
    pool_block: int = 8,
    min_ctas: int = 0,
    epilogue: str = "per_tile",
    hidden_tiles: str = "score",
    page: int = 0,
):
    """Build the score kernel (see module docstring); ``gather`` selects the Reindex variant.

    ``page`` > 0: the index K is a paged cache's pool, ``k_words`` int32 [1, R, 16] and ``k_scales`` [1, R] (R pool
    rows), and ``block_table`` int32 [B, MP] gives each sequence's pages: logical entry j of batch row b is pool row
    ``block_table[b, j // page] * page + j % page``; the logical width is MP * page. A contiguous tile of ``block_n``
    entries is then ``block_n / page`` page copies (or a part of one page), each as wide a copy as the contiguous
    kernel's. ``page`` = 0: ``k_words`` [B, N, 16], ``k_scales`` [B, N], and ``block_table`` [1, 1] is not read.

    ``epilogue`` (RS dequants only): "per_tile" reloads the weights from shared memory, halves them and rebuilds the
    output address in every tile; "hoisted" does that once per CTA (see the comment above ``_PIN_CUDA``).
    ``hidden_tiles`` (contiguous variant): "skip" runs a CTA's tile loop only over the tiles that hold an entry the
    token sees and writes -inf over the rest of its span (see ``HIDDEN_TILES``); "score" scores and masks them.

    Dims B, S, N (and the pool width P) are dynamic, so one compiled kernel serves every
    decode step as the cache grows.
    """
    if epilogue not in EPILOGUES or (epilogue != "per_tile" and dequant not in REGISTER_A_DEQUANTS):
        raise ValueError(f"epilogue={epilogue!r} with dequant={dequant!r}: 'hoisted' / 'fused' are built for {REGISTER_A_DEQUANTS} only")
    if epilogue == "fused" and threads != 128:
        raise ValueError(f"epilogue='fused' needs one consumer warpgroup (threads 128), got threads={threads}")
    if dequant in HOPPER_ONLY_DEQUANTS and not target.startswith("sm_90"):
        raise ValueError(f"dequant={dequant!r} is built for sm_90a only, got target {target!r}")
    if hidden_tiles not in HIDDEN_TILES or (hidden_tiles == "skip" and gather):
        raise ValueError(f"hidden_tiles={hidden_tiles!r}: one of {HIDDEN_TILES}, 'skip' for the contiguous variant only")
    skip_hidden = hidden_tiles == "skip"
    if page < 0 or (page and page % block_n and block_n % page) or (page and block_n // page > len(_PAGE_COPIES)):
        raise ValueError(
            f"page={page}: a paged index cache needs a page size that block_n={block_n} divides, or that divides it at most 8 times"
        )
    fp8 = dequant == "fp8_rs"
    if fp8 and (epilogue != "fused" or block_n > FP8_MAX_BLOCK_N):
        raise ValueError(f"dequant='fp8_rs' is built with epilogue='fused' and block_n <= {FP8_MAX_BLOCK_N}, got {epilogue!r}, {block_n}")
    H, D = HEADS, HEAD_DIM
    W = D // 8  # int32 words per packed entry (8 nibbles each)
    B, S, N, P, MP = T.dynamic("B, S, N, P, MP")
    C = P * pool_block  # candidate slots of one pool row (gather variant)
    n_entries = MP * page if page else N  # the logical width of a sequence's index cache
    n_out = C if gather else n_entries
    chunk = min(page, block_n) if page else block_n  # rows of one contiguous copy: a page, or the whole tile
    kw_shape, ks_shape, table_shape = ((1, N, W), (1, N), (B, MP)) if page else ((B, N, W), (B, N), (1, 1))
    span = block_n * tiles_per_cta
    cta_pages = -(-span // page) + 1 if page else 0  # pages one CTA's span of entries touches (+1: a span not page-aligned)

    def dequant_value(word, scale_word, d):
        """FP4 nibble ``d`` of an entry (in ``word``) times its E8M0 scale, as fp32 (exact)."""
        code = (word >> ((d % 8) * 4)) & 0xF
        mag = code & 7
        e, m = mag >> 1, mag & 1
        half_units = T.if_then_else(e == 0, m, (2 + m) << T.max(e - 1, 0))  # |value| in units of 0.5
        sbyte = (scale_word >> ((d // GROUP) * 8)) & 0xFF
        scale = T.reinterpret(T.Cast("uint32", sbyte) << 23, "float32")  # 2^(byte - 127), byte >= 1
        val = T.Cast("float32", half_units) * 0.5 * scale
        return T.if_then_else((code & 8) != 0, -val, val)

    @T.macro
    def copy_page(k_words, k_scales, kw_s, ks_s, pages_s, e0, at):
        """``chunk`` entries from the span-relative entry ``e0`` (inside one page) into rows ``at ..`` of the tile."""
        row0 = T.max(pages_s[e0 // page], 0) * page + e0 % page
        T.copy(k_words[0, row0 : row0 + chunk, :], kw_s[at : at + chunk, :])
        T.copy(k_scales[0, row0 : row0 + chunk], ks_s[at : at + chunk], annotations={"disable_tma": True})

    @T.prim_func
    def score(
        q: T.Tensor((B, S, H, D), "bfloat16"),
        weights: T.Tensor((B, S, H), "float32"),
        k_words: T.Tensor(kw_shape, "int32"),
        k_scales: T.Tensor(ks_shape, "int32"),
        n_visible: T.Tensor((B, S), "int32"),
        pool: T.Tensor((B, S, P), "int32"),
        block_table: T.Tensor(table_shape, "int32"),
        out: T.Tensor((B, S, n_out), "float32"),
    ):
        # Tokens in grid x (grid y/z stop at 65535 and a 64K prefill has 65536 tokens), entry tiles in y (<= 512
        # for a 1M-entry cache). Folding tokens and tiles into x instead cost a dynamic div/mod that TileLang
        # re-derived inside the pipelined loop: the decode score kernel ran 1.27 ms against 0.83 ms before it.
        with T.Kernel(S, T.ceildiv(n_out, span), B, threads=threads) as (s, bx, b):
            if min_ctas > 0:
                # __launch_bounds__(threads incl. TileLang's producer, min_ctas): ptxas keeps registers low enough
                # that min_ctas CTAs fit one SM (64K registers), e.g. <= 64 per thread for 2 x 512 threads
                T.annotate_min_blocks_per_sm(min_ctas)
                if dequant in REGISTER_A_DEQUANTS and min_ctas > 1:
                    # the A fragment lives in the consumers' registers: move the producer's share to them (setmaxnreg)
                    producer_regs, consumer_regs = rs_register_split(threads, min_ctas)
                    T.annotate_producer_reg_dealloc(producer_regs)
                    T.annotate_consumer_reg_alloc(consumer_regs)
            hoisted = epilogue == "hoisted"
            fused = epilogue == "fused"
            if not fp8:
                q_s = T.alloc_shared((H, D), "bfloat16")
            if hoisted:
                w_half = T.alloc_fragment((H,), "float32")  # w / 2 of the heads a thread's accumulator columns hold
            elif fused:
                w_loc = T.alloc_local((8,), "float32")  # w / 2 of the thread's 8 heads (_FUSED_EPI_CUDA's order)
            else:
                w_s = T.alloc_shared((H,), "float32")
            kw_s = T.alloc_shared((block_n, W), "int32")
            ks_s = T.alloc_shared((block_n,), "int32")
            pos_s = T.alloc_shared((block_n,), "int32")
            acc = T.alloc_fragment((block_n, H), "float32")
            if not fused:
                row = T.alloc_fragment((block_n,), "float32")
            if fp8:  # per scale group: the queries (B operand), the keys' E4M3 codes (A fragment), an accumulator
                q8_s = [T.alloc_shared((H, GROUP), "float8_e4m3fn") for _ in FP8_GROUPS]
                k8 = [T.alloc_fragment((block_n, GROUP), "float8_e4m3fn") for _ in FP8_GROUPS]
                accs = [acc] + [T.alloc_fragment((block_n, H), "float32") for _ in FP8_GROUPS[1:]]
                q_fac = T.alloc_shared((H,), "float32")
            elif dequant in ("registers", "fragment_bits", *RS_DEQUANTS):
                k_deq = T.alloc_fragment((block_n, D), "bfloat16")
            else:
                k_deq = T.alloc_shared((block_n, D), "bfloat16")
            if dequant == "prmt":
                T.import_source(PRMT_CUDA)
            pin = _PIN_CUDA if hoisted else ""  # one import_source per kernel: TileLang refuses a second one
            if fused:
                pin = _PIN_CUDA + _FUSED_EPI_CUDA
            if dequant in PRMT_RS_DEQUANTS:
                T.import_source((PRMT_PAIR_CUDA if dequant == "prmt_rs" else PRMT_PAIR2_CUDA) + pin)
                rs_tab = T.alloc_shared((256, 4), "uint32")
                build_rs_tables(rs_tab)
            if dequant == "fma_rs":
                T.import_source(FMA_PAIR_CUDA + pin)
            if fp8:
                T.import_source(FP8_CUDA + pin)
            if dequant == "lut":
                # byte -> both nibbles' bf16 bit patterns at unit scale (low half = even element).
                lut = T.alloc_shared((256,), "uint32")
                for v in T.Parallel(256):
                    lut[v] = e2m1_bf16_bits(v & 0xF) | (e2m1_bf16_bits(v >> 4) << 16)
            nvis = n_visible[b, s]
            if page and not gather:  # the block-table entries of this CTA's span, read once
                first_page = bx * span // page
                pages_s = T.alloc_shared((cta_pages,), "int32")
                for i in T.Parallel(cta_pages):
                    pages_s[i] = T.if_then_else(first_page + i < MP, block_table[b, T.min(first_page + i, MP - 1)], 0)
            if dequant in PRMT_RS_DEQUANTS:
                load_q_rs(q, q_s, b, s, H, D)
            elif dequant == "fma_rs":
                load_q_rs_fma(q, q_s, b, s, H, D)
            elif fp8:
                load_q_fp8(q, q8_s, q_fac, b, s, H, D)
            else:
                T.copy(q[b, s, :, :], q_s)
            if hoisted:
                # Every thread wrote q_s (and rs_tab) above and the consumers read them in the loop. per_tile gets this
                # barrier from TileLang ahead of the weights' TMA load; without that load TileLang placed none.
                T.sync_threads()
                _load_half_weights(weights, w_half, b, s, H)
                # this CTA's span of its output row as a buffer of its own: the int64 (b, s, j) index is built once
                out_ptr = T.call_extern("handle", "csa2_pin_ptr", T.access_ptr(out[b, s, bx * span], "w", span))
                out_cta = T.make_tensor_from_addr(out_ptr, (span,), "float32")
            elif fused:
                T.sync_threads()  # as hoisted: every thread wrote q_s (and rs_tab), the consumers read them
                T.call_extern("handle", "csa2_load_w_half", T.address_of(w_loc[0]), T.access_ptr(weights[b, s, 0], "r", H))
                if fp8:
                    T.call_extern("handle", "csa2_fp8_scale_w", T.address_of(w_loc[0]), T.address_of(q_fac[0]))
                    # TileLang does not see that read of q_fac and may give its shared bytes to ks_s, which the producer
                    # starts writing at once: every thread has read q_fac before any goes on
                    T.sync_threads()
                out_ptr = T.call_extern("handle", "csa2_pin_ptr", T.access_ptr(out[b, s, bx * span], "w", span))
            else:
                T.copy(weights[b, s, :], w_s)
            # skip: the tiles up to the last one holding an entry < nvis (a prefill token sees the cache up to itself)
            n_tiles = T.max(0, T.min(tiles_per_cta, T.ceildiv(nvis - bx * span, block_n))) if skip_hidden else tiles_per_cta
            for t in T.Pipelined(n_tiles, num_stages=stages):
                n0 = (bx * tiles_per_cta + t) * block_n
                if gather:
                    # The pool's block ids give each slot its cache position; an unused (-1)
                    # block or an entry past n_visible reads nothing and scores -inf.
                    for i in T.Parallel(block_n):
                        slot = n0 + i
                        blk = T.if_then_else(slot < C, pool[b, s, T.min(slot, C - 1) // pool_block], -1)
                        pos = blk * pool_block + slot % pool_block
                        pos_s[i] = T.if_then_else((blk >= 0) & (pos < nvis) & (pos < n_entries), pos, -1)
                    if page:
                        for i, c in T.Parallel(block_n, W):
                            kw_s[i, c] = T.if_then_else(pos_s[i] >= 0, k_words[0, pool_row(block_table, b, pos_s[i], page), c], 0)
                        for i in T.Parallel(block_n):
                            ks_s[i] = T.if_then_else(pos_s[i] >= 0, k_scales[0, pool_row(block_table, b, pos_s[i], page)], 0x7F7F7F7F)
                    else:
                        for i, c in T.Parallel(block_n, W):
                            kw_s[i, c] = T.if_then_else(pos_s[i] >= 0, k_words[b, T.max(pos_s[i], 0), c], 0)
                        for i in T.Parallel(block_n):
                            ks_s[i] = T.if_then_else(pos_s[i] >= 0, k_scales[b, T.max(pos_s[i], 0)], 0x7F7F7F7F)
                elif page:
                    # page by page, each page's id from the CTA's copy of its block-table row (a page past the table or
                    # the sequence's pages reads page 0: its entries are past n_visible and score -inf)
                    # one statement per page (a TIR loop of copies would cost the TMA producer: TileLang then lowers
                    # every copy of the tile to synchronous loads)
                    for c in _PAGE_COPIES:
                        if c < block_n // chunk:
                            copy_page(k_words, k_scales, kw_s, ks_s, pages_s, n0 + c * chunk - first_page * page, c * chunk)
                else:
                    T.copy(k_words[b, n0 : n0 + block_n, :], kw_s)
                    # Not TMA: the [B, N] int32 scale rows are only 4-byte aligned for N not a multiple of 4.
                    T.copy(k_scales[b, n0 : n0 + block_n], ks_s, annotations={"disable_tma": True})
                if dequant == "bits":
                    dequant_words_bits(kw_s, ks_s, k_deq, block_n, W)
                elif dequant == "prmt":
                    dequant_groups_prmt(kw_s, ks_s, k_deq, block_n, W)
                elif dequant == "prmt_rs":
                    dequant_fragment_prmt(kw_s, ks_s, rs_tab, k_deq, block_n, D)
                elif dequant == "prmt_rs2":
                    dequant_fragment_prmt2(kw_s, ks_s, rs_tab, k_deq, block_n, D)
                elif dequant == "fma_rs":
                    dequant_fragment_fma(kw_s, ks_s, k_deq, block_n, D)
                elif fp8:
                    score_fp8_groups(kw_s, k8, q8_s, accs, block_n)
                elif dequant == "fragment_bits":
                    # the bits path's bf16 patterns, built per value straight into the MMA's A fragment: no bf16 tile
                    # in shared memory (TileLang multi-buffers it per stage), so deeper pipelines and more CTAs fit
                    for i, d in T.Parallel(block_n, D):
                        code = (kw_s[i, d // 8] >> ((d % 8) * 4)) & 0xF
                        mag = code & 7
                        base = (((ks_s[i] >> ((d // GROUP) * 8)) & 0xFF) - 1) << 7
                        bits = T.if_then_else(mag == 0, 0, base + T.if_then_else(mag == 1, 0, mag << 6)) | ((code & 8) << 12)
                        k_deq[i, d] = T.reinterpret(T.Cast("uint16", bits), "bfloat16")
                elif dequant == "lut":
                    for i, d in T.Parallel(block_n, D):
                        pair = lut[(kw_s[i, d // 8] >> ((d % 8) // 2 * 8)) & 0xFF]
                        unit = T.reinterpret(T.Cast("uint16", (pair >> ((d % 2) * 16)) & 0xFFFF), "bfloat16")
                        sbyte = (ks_s[i] >> ((d // GROUP) * 8)) & 0xFF
                        scale = T.reinterpret(T.Cast("uint32", sbyte) << 23, "float32")
                        k_deq[i, d] = T.Cast("bfloat16", T.Cast("float32", unit) * scale)
                else:
                    for i, d in T.Parallel(block_n, D):
                        k_deq[i, d] = T.Cast("bfloat16", dequant_value(kw_s[i, d // 8], ks_s[i], d))
                if fp8:  # the four group sums, each times its E8M0 scale, into acc
                    T.call_extern(
                        "handle",
                        f"csa2_fp8_combine<{block_n // 64}>",
                        *(a.access_ptr("r") for a in accs),
                        T.address_of(ks_s[0]),
                        T.address_of(kw_s[0, 0]),
                    )
                else:
                    T.gemm(k_deq, q_s, acc, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                if fused:  # the ReLU-weighted head sum, its quad reduction and the store, by hand (_FUSED_EPI_CUDA)
                    T.call_extern(
                        "handle",
                        f"csa2_relu_wsum_store<{block_n // 64}>",
                        acc.access_ptr("r"),
                        T.address_of(w_loc[0]),
                        out_ptr,
                        T.address_of(pos_s[0]) if gather else 0,  # (a pointer argument would count as a shared write)
                        t * block_n,
                        n_out - bx * span,
                        nvis - bx * span,
                        int(gather),
                    )
                else:
                    if hoisted:
                        for i, h in T.Parallel(block_n, H):
                            acc[i, h] = (acc[i, h] + T.abs(acc[i, h])) * w_half[h]  # per_tile's product, w / 2 hoisted
                    elif dequant in RS_DEQUANTS:
                        # ReLU as x + |x| = 2 max(x, 0) (exact) on the FMA pipe: FMNMX issues to the integer/ALU pipe,
                        # which the dequant saturates. Times w / 2: the same product up to power-of-two scaling.
                        for i, h in T.Parallel(block_n, H):
                            acc[i, h] = (acc[i, h] + T.abs(acc[i, h])) * (w_s[h] * 0.5)
                    else:
                        for i, h in T.Parallel(block_n, H):
                            acc[i, h] = T.max(acc[i, h], 0.0) * w_s[h]
                    T.reduce_sum(acc, row, dim=1)
                    if hoisted:
                        _store_row_hoisted(out_cta, row, pos_s, t * block_n, n_out - bx * span, nvis - bx * span, block_n, gather)
                    else:
                        for i in T.Parallel(block_n):
                            j = n0 + i
                            if j < n_out:
                                if gather:
                                    out[b, s, j] = T.if_then_else(pos_s[i] >= 0, row[i], -T.infinity("float32"))
                                else:
                                    out[b, s, j] = T.if_then_else(j < nvis, row[i], -T.infinity("float32"))
            if skip_hidden:  # the span's skipped tiles: no entry visible, every score -inf
                for i in T.Parallel(span):
                    if i >= n_tiles * block_n and bx * span + i < n_out:
                        out[b, s, bx * span + i] = -T.infinity("float32")

    return tilelang.compile(score, target=tvm.target.Target(cuda_target(target)))
