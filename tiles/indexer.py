"""The lightning indexer on the GPU (spec section 2): scores over the packed FP4 index K,
top-k, the candidate pool of layer 20 and the Reindex search inside the pool.

Three tiles share two kernels:

* a **score kernel**: per (batch, token, run of ``block_n`` entries) it loads the packed FP4
  index K (``uint8 [B, N, 64]`` read as 16 int32 words per entry, plus the 4 E8M0 scale
  bytes read as one int32), dequantises it to bf16 in shared memory (or straight into the
  MMA's register fragment), multiplies it with the 32 x 128 query on the tensor cores
  (``acc[entries, heads] = K @ q^T``, so the entry tile is the M side of wgmma), applies ReLU
  and the per-head weight and sums over heads. FP4 values times a power-of-two scale are
  exact in bf16 and their products exact in fp32, so the only difference from the fp32
  reference is the order of the sums. With ``gather`` it reads the entries of a candidate
  pool instead of a contiguous run (Reindex: the pool is gathered first, nothing else is
  scored).
* a **select kernel**: one CTA per score row finds the exact k-th largest score by radix
  select on the order-preserving 32-bit key of each fp32 score (``radix_bits`` per pass, the
  row re-read from L2 each pass, warp-aggregated histogram atomics), then writes the chosen positions in position order (a
  block-wide prefix count over contiguous per-thread segments), -1 fill. Ties at the k-th
  key go to the lower positions, the reference's rule, so the selection is deterministic.

Comparison rules (also in each tile's ``compare``): scores by relative L2 <= 1e-5 with -inf
exactly where the reference has it; top-k as index SETS: positions missing from either side
must have reference scores equal to the k-th largest reference score within 1e-5 relative
(their order cannot differ: both are sorted by position). Candidate pools must equal the
reference exactly when both are computed from the same scores. NaN scores are not part of the
contract (the reference lets a NaN take a slot; the kernel skips it).
"""

import functools
import math
from typing import Any

import tilelang
import tilelang.language as T
import torch
import tvm

from model import formats
from model.ops.indexer import candidate_blocks, indexer_scores, pool_mask, topk_positions
from tiles import radix_select
from tiles.arch import Arch, get_arch
from tiles.compare import relative_l2
from tiles.contract import (
    Comparison,
    Config,
    Constraint,
    Inputs,
    Param,
    SearchSpace,
    Shape,
    Tile,
    TileError,
    canonical_key,
    kernel_sources_of,
    poisoned,
)
from tiles.fp4 import PRMT_ASM_CUDA
from tiles.shapes import flash, indexer_shapes, reindex_shapes

HEADS, HEAD_DIM, GROUP = 32, 128, 32  # indexer heads, dims, FP4 group (E8M0 scales)
SCORE_RTOL = 1e-5  # relative L2 of scores: fp32 sums in another order
TIE_RTOL = 1e-5  # a top-k set difference is a tie when its scores equal the k-th within this
NEG_INF = float("-inf")


# --------------------------------------------------------------------------------------
# kernel builders
# --------------------------------------------------------------------------------------


def _e2m1_bf16_bits(code):
    """bf16 bit pattern (uint32) of an E2M1 code 0..15 at unit scale: +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}."""
    mag = code & 7
    # mag >= 2: exponent 126 + (mag >> 1), mantissa bit 6 = mag & 1, i.e. (mag << 6) + (126 << 7); mag 1 is 0.5.
    bits = T.if_then_else(mag >= 2, (mag << 6) + (126 << 7), T.if_then_else(mag == 1, 126 << 7, 0))
    return T.Cast("uint32", bits | ((code & 8) << 12))


@T.macro
def _dequant_words_bits(kw_s, ks_s, k_deq, block_n: int, W: int):
    """FP4 words -> scaled bf16 by integer arithmetic only: one thread per packed word (8 values).

    ``kw_s`` int32 [block_n, W] packed codes, ``ks_s`` int32 [block_n] the 4 E8M0 bytes of each
    entry, ``k_deq`` bf16 [block_n, 8 * W] out. Why: the per-value paths ("shared", "lut") spend
    ~20 instructions per FP4 value (a word load, nibble extract, float convert, multiply, round)
    on one value per thread per iteration, and their loops got a named barrier per iteration.
    Here the word and its group's scale are read once per 8 values, and a value is its bf16 bit
    pattern built directly: for a magnitude code ``mag`` = 2e+m (value 2^(e-1)(1+m/2) for e >= 1)
    at scale 2^(s-127) the exponent field is s-1+e and the top mantissa bit m, i.e.
    ``((s - 1) << 7) + (mag << 6)``; the subnormal code 1 (0.5) is ``(s - 1) << 7``; 0 is 0. Exact
    (FP4 x 2^k is a bf16) for scale bytes 2..252; byte 1 (scale 2^-126) only occurs for an all-zero
    group under the spec's scale rule, where every code is 0.
    """
    for i, c in T.Parallel(block_n, W):
        vals = T.alloc_local((8,), "bfloat16")
        word = kw_s[i, c]
        base = (((ks_s[i] >> ((c // (GROUP // 8)) * 8)) & 0xFF) - 1) << 7  # 8 codes per word, 4 words per scale group
        for e in T.unroll(8):
            code = (word >> (e * 4)) & 0xF
            mag = code & 7
            bits = T.if_then_else(mag == 0, 0, base + T.if_then_else(mag == 1, 0, mag << 6)) | ((code & 8) << 12)
            vals[e] = T.reinterpret(T.Cast("uint16", bits), "bfloat16")
        for e in T.vectorized(8):  # one 16-byte store: 8 bf16 are one unit of the 128-byte swizzle
            k_deq[i, c * 8 + e] = vals[e]


# FP4 -> bf16 of one scale group (4 packed words, 32 values) by byte permutes (dequant="prmt").
# The bits path spends ~12 integer instructions per value (shift, mask, two compares, two selects, add,
# or, ...): on Hopper those all issue to the 16-lane integer pipe (half the FP32 rate), and the SASS of
# the bits score kernel has 779 such instructions per thread per 128-entry tile, which at 2 warp
# instructions per clock per SM is ~3100 cycles per tile: the measured 3300 cycles per tile (0.83 ms).
# Here the group's 8 bf16 magnitude patterns at its scale (t[0] = 0, t[1] = (s-1) << 7, t[m] = t[1] +
# (m << 6)) are built once as a byte table (low bytes, high bytes: 2 registers each), and each word
# becomes 4 table lookups (prmt: 4 nibble-indexed bytes per instruction), 2 sign merges and 4
# interleaves: ~15 integer instructions per 8 values instead of ~97. Same bit patterns as the bits
# path (the scores are bitwise equal). Selector nibbles keep bit 3 clear (prmt's sign-replicate flag).
_PRMT_CUDA = r"""
__device__ __forceinline__ void csa2_fp4_group_bf16(void* dst_, const void* src_, unsigned sbyte) {
  const unsigned* src = (const unsigned*)src_;
  unsigned* dst = (unsigned*)dst_;
  const unsigned base = (sbyte - 1u) << 7;               // bf16 bits of 0.5 * 2^(s - 127)
  const unsigned b2 = base * 0x10001u;
  const unsigned r0 = base << 16;                        // t0 = 0, t1 = base
  const unsigned r1 = b2 + 0x00C00080u;                  // t2 = base + 0x80, t3 = base + 0xC0
  const unsigned r2 = b2 + 0x01400100u;                  // t4, t5
  const unsigned r3 = b2 + 0x01C00180u;                  // t6, t7
  const unsigned lo0 = __byte_perm(r0, r1, 0x6420), lo1 = __byte_perm(r2, r3, 0x6420);  // low bytes of t0..t7
  const unsigned hi0 = __byte_perm(r0, r1, 0x7531), hi1 = __byte_perm(r2, r3, 0x7531);  // high bytes
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const unsigned w = src[k];
    const unsigned m = w & 0x77777777u;                  // magnitude codes: the lookup selectors
    const unsigned mh = m >> 16;
    const unsigned w4 = w << 4;
    const unsigned l0 = __byte_perm(lo0, lo1, m), l1 = __byte_perm(lo0, lo1, mh);
    // sign of nibble j (bit 4j + 3) to bit 7 of high byte j: from w << 4 (even j) or w (odd j)
    const unsigned h0 = __byte_perm(hi0, hi1, m) | (__byte_perm(w, w4, 0x1504) & 0x80808080u);
    const unsigned h1 = __byte_perm(hi0, hi1, mh) | (__byte_perm(w, w4, 0x3726) & 0x80808080u);
    dst[4 * k + 0] = __byte_perm(l0, h0, 0x5140);      // values 8k + 0 (low half), 8k + 1
    dst[4 * k + 1] = __byte_perm(l0, h0, 0x7362);
    dst[4 * k + 2] = __byte_perm(l1, h1, 0x5140);
    dst[4 * k + 3] = __byte_perm(l1, h1, 0x7362);
  }
}
"""


@T.macro
def _dequant_groups_prmt(kw_s, ks_s, k_deq, block_n: int, W: int):
    """FP4 words -> scaled bf16 by byte permutes (``_PRMT_CUDA``): one thread per scale group (4 words, 32 values)."""
    for i, g in T.Parallel(block_n, W // 4):
        words = T.alloc_local((4,), "int32")
        vals = T.alloc_local((32,), "bfloat16")
        for e in T.vectorized(4):  # one 16-byte shared load
            words[e] = kw_s[i, g * 4 + e]
        sbyte = T.Cast("uint32", (ks_s[i] >> (g * 8)) & 0xFF)
        T.call_extern("handle", "csa2_fp4_group_bf16", T.address_of(vals[0]), T.address_of(words[0]), sbyte)
        for u in T.unroll(4):
            for e in T.vectorized(8):  # 16-byte stores: 8 bf16 are one unit of the 128-byte swizzle
                k_deq[i, g * 32 + u * 8 + e] = vals[u * 8 + e]


# dequant="prmt_rs": the prmt lookups straight into the wgmma A fragment (RS form), no bf16 tile in shared memory.
# Why: after prmt the SS kernel writes a 32 KiB bf16 tile per 128 entries to shared memory and wgmma reads it back
# (~64 KiB of shared traffic per tile, ~500 cycles per SM at 128 B/clk), behind two named barriers per tile.
# The A fragment of a 64-row wgmma (bf16, k16 slices) gives lane l of a warp rows 16w + l/4 (+8) and, in every
# 8-column block j, the column pair 2 (l % 4) + {0, 1}. The dot product over the 128 dims does not care which dim
# sits in which column as long as q uses the same order, so the kernel stores K and q with fragment column c holding
# dim ``_rs_dim(c)`` = 32 (c % 8 // 2) + 2 (c // 8) + c % 2: quad lane t then holds dims 32t .. 32t + 31 of its rows,
# i.e. exactly one scale group = 4 packed words (one 16-byte shared load) and one scale byte, and its fragment
# register j is byte j % 4 of word 4t + j // 4 turned into a bf16 pair by the prmt tables (one interleaving prmt per
# register). The scores sum the same exact products, in another order (so not bitwise the prmt kernel's scores).
# The group's four table words (lo0, lo1, hi0, hi1: the prmt path's byte tables) depend only on the scale byte, so they
# come from a 256 x 16-byte shared table built once per CTA (csa2_fp4_table_word, the prmt path's arithmetic): one
# 16-byte load per row and thread instead of ~10 integer instructions (178 -> 159 per thread per 128-entry tile).
# csa2_fp4_pair_bf16(dst, w, lo0, lo1, hi0, hi1, k) stores the bf16 bits of nibbles 2k (low half) and 2k + 1 (high
# half) of w as one 32-bit word at dst. All but the last prmt depends on (w) or (w, k / 2) only, so nvcc shares it
# between the 4 registers of a word (pure expressions, the loop fully unrolled). One 32-bit store, not two 16-bit
# halves: with halves nvcc rebuilt each register by a shift and a prmt (64 extra integer instructions per tile).
# csa2_fp4_pair_bf16 and its prmt_rs2 variant differ only in how the high-half selectors m >> 16 are made (one
# template, so the variant cannot drift from the default it must equal bit for bit).
_FP4_PAIR_TEMPLATE = r"""
  const unsigned w = (unsigned)w_;
  const unsigned m = w & 0x77777777u;                    // magnitude codes: the lookup selectors
  const unsigned w4 = w << 4;
  unsigned l, h;
  if (k < 2) {                                           // nibbles 0..3
    l = csa2_prmt(lo0, lo1, m);
    h = csa2_prmt(hi0, hi1, m) | (__byte_perm(w, w4, 0x1504) & 0x80808080u);
  } else {                                               // nibbles 4..7
@HIGH_HALF@    l = csa2_prmt(lo0, lo1, mh);
    h = csa2_prmt(hi0, hi1, mh) | (__byte_perm(w, w4, 0x3726) & 0x80808080u);
  }
  *(unsigned*)dst = __byte_perm(l, h, (k & 1) ? 0x7362 : 0x5140);
}
"""
_SHR16_SELECTORS = r"""    unsigned mh;
    asm("shr.b32 %0, %1, 16;" : "=r"(mh) : "r"(m));     // opaque too: else nvcc re-masks w for it
"""


def _fp4_pair_function(name: str, high_half: str) -> str:
    """The CUDA of ``name(dst, w, lo0, lo1, hi0, hi1, k)`` with ``high_half`` making ``mh`` (the selectors of nibbles
    4..7) from ``m`` (the magnitude codes)."""
    head = "__device__ __forceinline__ void "
    args = (
        "(void* dst, int w_, unsigned lo0, unsigned lo1, unsigned hi0,\n" + " " * (len(head) + len(name) + 1) + "unsigned hi1, int k) {\n"
    )
    return head + name + args + _FP4_PAIR_TEMPLATE.lstrip("\n").replace("@HIGH_HALF@", high_half)


_PRMT_PAIR_CUDA = (
    PRMT_ASM_CUDA
    + r"""
// word e (0: lo0, 1: lo1, 2: hi0, 3: hi1) of scale byte sbyte's tables, as csa2_fp4_group_bf16 builds them
__device__ __forceinline__ unsigned csa2_fp4_table_word(int sbyte, int e) {
  const unsigned base = ((unsigned)sbyte - 1u) << 7;     // bf16 bits of 0.5 * 2^(s - 127)
  const unsigned b2 = base * 0x10001u;
  const unsigned r0 = base << 16, r1 = b2 + 0x00C00080u, r2 = b2 + 0x01400100u, r3 = b2 + 0x01C00180u;
  const unsigned sel = (e & 2) ? 0x7531 : 0x6420;        // high or low bytes of t0..t7
  return (e & 1) ? __byte_perm(r2, r3, sel) : __byte_perm(r0, r1, sel);
}
"""
    + _fp4_pair_function("csa2_fp4_pair_bf16", _SHR16_SELECTORS)
)


# dequant="prmt_rs2": prmt_rs's A registers, bit for bit (the same tables, lookups, sign gathers, merges and
# interleaves), with the work that does not need the ALU pipe moved off it. Why: the RS score kernel's ALU pipe (PRMT,
# LOP3, SHF issue there at half the warp rate) carries 489 of the default's 769 SASS per consumer thread and tile, and
# the fused-epilogue run (245.4 us) sat nearer the ALU-pipe estimate than the issue one. Per packed word prmt_rs issues
# 15: mask (LOP3), high-half selectors m >> 16 (SHF), w << 4 (IMAD.SHL), 4 lookups, 2 sign gathers, 2 sign merges, 4
# interleaves (14 ALU). Here:
# * m >> 16 is the high word of m x 2^16 (mul.hi.u32, IMAD.HI on the FMA pipe) instead of a shift: 13 ALU a word.
# * The row's scale byte t -> its 16-byte table row: byte t of the scale word by one PRMT with a per-thread selector
#   (0x4440 | t: byte t, zeros above) instead of shift, x16, mask (SHF, IMAD.SHL, LOP3): with ptxas's LEA (x16 + the
#   table base) 2 instructions a row instead of 3, both ALU as before.
# Not cheaper, and why (sm_90a SASS and the bit algebra, notes/indexer.md session 8): the 4 lookups + 4 interleaves are a
# floor for byte tables (the hi byte needs all 8 magnitude slots of a PRMT, so lo and hi cannot share one table); a
# lookup cannot carry the sign (bit 7 of a PRMT output is bit 7 of the selected byte in both selector modes) and a LOP3
# cannot move bits, so the 8 sign bits need a byte spread (the 2 gathers) and 2 merges; the selectors need the mask.
_PRMT_PAIR2_CUDA = (
    _PRMT_PAIR_CUDA
    + r"""
// x >> 16 as the high word of x * 2^16: IMAD.HI on the FMA pipe instead of SHF on the ALU pipe
__device__ __forceinline__ unsigned csa2_hi16(unsigned x) {
  unsigned d;
  asm("mul.hi.u32 %0, %1, 65536;" : "=r"(d) : "r"(x));
  return d;
}
// byte t (0..3) of the scale word, zero-extended: one PRMT (selector nibble 4 picks the zero operand's byte 0)
__device__ __forceinline__ int csa2_scale_byte(int sw, int t) {
  return (int)csa2_prmt((unsigned)sw, 0u, 0x4440u | (unsigned)t);
}
// csa2_fp4_pair_bf16's word, bit for bit, with the high-half selectors from csa2_hi16
"""
    + _fp4_pair_function("csa2_fp4_pair2_bf16", "    const unsigned mh = csa2_hi16(m);\n")
)


# dequant="fp8_rs": no FP4 -> bf16 conversion at all. An E2M1 code placed into an E4M3 byte by shifts alone is exact
# at the fixed factor 2^-6 (s e1 e0 m -> s 0 0 e1 e0 m 0 0: code 0.5 becomes the E4M3 subnormal 2^-7, the rest normals),
# so each packed word becomes two A registers of an FP8 wgmma (m64n32k32) in 7 integer instructions, against prmt_rs's
# 15 for the same 8 values. The E8M0 scale of K differs per (entry, group) and an FP8 wgmma cannot apply it, so each
# of the 4 scale groups is its own k32 wgmma into its own accumulator, and the epilogue combines them:
# acc = sum_g 2^(s_g - 127) acc_g (1 FMUL + 3 FFMA per element, on the FMA pipe). Why: gpu/score_ablation.py put the
# dequant at 70 of the default's 250 us at decode B=64 (28%) and 181 of 466 us at prefill 4K (39%), and the
# conversion's share of it is on the ALU pipe, which issues at half the FMA pipe's rate on Hopper.
# q: the index queries are FP4 fake-quantised (spec: E2M1 codes x an E8M0 scale per 32), so q x 2^k is exact in E4M3
# when the head's power-of-two factor 2^k puts its largest |q| in [128, 256) and its four group scales span <= 2^12
# (smaller groups would round in E4M3's subnormal range). 2^6 / 2^k (the K placement and this factor) folds into the
# head's weight: ReLU(c x) = c ReLU(x) for c > 0.
# Exactness of the sums: within one k32 wgmma all 32 products share one scale (one K group, one q group), each an
# exact multiple of 1/4 of it below 36, so a group sum needs 13 significant bits. On the H200 the scores met the
# reference (rel L2 1e-5, top-k sets by the tie rule) at every layout and shape tested (pytest_gpu_run64.xml).
# Measured (score_fp8_rs_session17_run2.json): right, and slower than prmt_rs at every layout tried (decode B=64 x 128K
# 291-472 us against 249; prefill 4K 514-697 against 471). Four accumulators cap the tile at 128 entries, and each tile
# pays four wgmma groups and a 64-FFMA combine per m-tile: more than the conversion saves. Kept as a search-space
# option (the tuner may find a layout; other FP8-capable GPUs may differ), not a default.
# A fragment (TileLang's layout for an m64k32 8-bit operand, PTX's): each 32-bit register holds 4 consecutive columns
# of one row, columns 4t..4t + 3 or 16 + 4t..16 + 4t + 3, t = lane % 4. Column c of group g holds dim ``_fp8_dim(g, c)``:
# quad lane t takes packed word 4g + t of its rows, the even nibbles in the low 16 columns and the odd ones in the
# high 16.
_FP8_CUDA = r"""
// nibbles 0, 2, 4, 6 (half 0) or 1, 3, 5, 7 (half 1) of w as four E4M3 bytes (code x 2^-6, exact)
__device__ __forceinline__ void csa2_fp8_word(void* dst, int w_, int half) {
  const unsigned w = (unsigned)w_;
  *(unsigned*)dst = half ? (w & 0x80808080u) | ((w >> 2) & 0x1C1C1C1Cu) : ((w << 4) & 0x80808080u) | ((w << 2) & 0x1C1C1C1Cu);
}
// the power of two 2^k that puts amax x 2^k in [128, 256) (1 for a zero head)
__device__ __forceinline__ float csa2_fp8_q_factor(float amax) {
  const int e = (int)(__float_as_uint(amax) >> 23);  // amax >= 0: its biased exponent
  return e == 0 ? 1.0f : __uint_as_float((unsigned)min(254, max(1, 261 - e)) << 23);
}
// acc0 = sum_g 2^(s_g - 127) acc_g over the thread's 16 M accumulator floats (csa2_relu_wsum_store's layout), s_g: byte
// g of the row's scale word in ks (the tile's [block_n] scale words in shared memory). stage_words: the tile's packed
// words, not read: passed so that TileLang counts this call as a use of the stage and releases it to the producer
// only after it (the producer writes the next tile's scales into ks then)
template <int M>
__device__ __forceinline__ void csa2_fp8_combine(float* acc0, const float* acc1, const float* acc2, const float* acc3,
                                                 const int* ks, const void* stage_words) {
  const int l = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
#pragma unroll
  for (int r = 0; r < 2 * M; ++r) {
    const unsigned sw = (unsigned)ks[(r >> 1) * 64 + warp * 16 + (r & 1) * 8 + (l >> 2)];
    const float s0 = __uint_as_float((sw << 23) & 0x7F800000u), s1 = __uint_as_float((sw << 15) & 0x7F800000u);
    const float s2 = __uint_as_float((sw << 7) & 0x7F800000u), s3 = __uint_as_float((sw >> 1) & 0x7F800000u);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int a = (r >> 1) * 16 + (e >> 1) * 4 + (r & 1) * 2 + (e & 1);
      acc0[a] = fmaf(acc3[a], s3, fmaf(acc2[a], s2, fmaf(acc1[a], s1, acc0[a] * s0)));
    }
  }
}
// w / 2 of the thread's 8 heads (csa2_load_w_half's order) times 2^6 / factor[head]: undoes the K placement and q's factor
__device__ __forceinline__ void csa2_fp8_scale_w(float* w, const float* factor) {
  const int q = threadIdx.x & 3;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    w[2 * k] *= 64.0f / factor[8 * k + 2 * q];
    w[2 * k + 1] *= 64.0f / factor[8 * k + 2 * q + 1];
  }
}
"""
FP8_GROUPS = (0, 1, 2, 3)  # the scale groups of an entry: a Python tuple, unrolled while tracing


def _fp8_dim(g, c):
    """K dim held in column ``c`` (0..31) of group ``g``'s A fragment by dequant="fp8_rs": the word's even nibbles in
    columns 0..15, its odd ones in 16..31 (quad lane t's 4 columns 4t.. of each half are word 4g + t's; see _FP8_CUDA)."""
    return 32 * g + 2 * (c % 16) + c // 16


@T.macro
def _load_q_fp8(q, q8_s, q_fac, b, s, H: int, D: int):
    """q [B, S, H, D] bf16 (FP4 fake-quantised) -> q8_s[g] float8_e4m3 [H, 32] (``_fp8_dim`` order) = q x q_fac[h], and
    q_fac [H] fp32: the power of two that puts the head's largest |q| in [128, 256)."""
    q_f = T.alloc_fragment((H, D), "float32")
    q_max = T.alloc_fragment((H,), "float32")
    for h, d in T.Parallel(H, D):
        q_f[h, d] = q[b, s, h, d]
    T.reduce_absmax(q_f, q_max, dim=1)
    for h in T.Parallel(H):
        q_fac[h] = T.call_extern("float32", "csa2_fp8_q_factor", q_max[h])
    for g in FP8_GROUPS:
        for h, c in T.Parallel(H, GROUP):
            q8_s[g][h, c] = T.Cast("float8_e4m3fn", T.Cast("float32", q[b, s, h, _fp8_dim(g, c)]) * q_fac[h])


@T.macro
def _score_fp8_groups(kw_s, k8, q8_s, accs, block_n: int):
    """One k32 FP8 wgmma per scale group: k8[g] (the packed words' codes as E4M3, ``_fp8_dim`` order) x q8_s[g] -> accs[g].
    The first three are left in flight (no wait: the next group's conversion writes other registers); the last one's
    wait covers all four."""
    for g in FP8_GROUPS:
        for i, c in T.Parallel(block_n, GROUP):
            if c % 4 == 0:  # one 32-bit A register: 4 columns of one row
                T.call_extern("handle", "csa2_fp8_word", T.address_of(k8[g][i, c]), kw_s[i, 4 * g + (c % 16) // 4], c // 16)
        in_flight = {"wg_wait": -1} if g != FP8_GROUPS[-1] else None
        T.gemm(k8[g], q8_s[g], accs[g], transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow, annotations=in_flight)


RS_PRODUCER_REGS = 24  # setmaxnreg floor: TileLang's producer only waits on mbarriers, loads scales and issues TMA
REGISTERS_PER_SM = 65536  # sm_80 .. sm_120 alike (tiles.arch registers_per_sm); the kernel builder sees only the target


def _rs_register_split(threads: int, min_ctas: int) -> tuple[int, int]:
    """(producer, consumer) registers per thread for dequant="prmt_rs" at ``min_ctas`` CTAs of 2 x ``threads``.

    ``__launch_bounds__`` gives every thread of the CTA the same cap, 64K / (min_ctas x 2 x threads) rounded down to
    8: 64 for the 2 x 256-thread default at 2 CTAs per SM. The RS consumers hold the A fragment (32 registers per
    64-row m-tile) and the accumulator (16), and at that cap ptxas spilled and serialised the wgmmas (C7512:
    "wgmma.mma_async instructions are serialized due to insufficient register resources"); TileLang's producer needs
    ~24. setmaxnreg moves the difference: the producer warpgroups drop to 24, the consumers take the rest (104 at
    the default cap; 0 spills, one wgmma wait per tile in the SASS). Used only for min_ctas > 1, where the cap binds.
    """
    cap = REGISTERS_PER_SM // (max(1, min_ctas) * 2 * threads) // 8 * 8
    return RS_PRODUCER_REGS, min(240, (2 * cap - RS_PRODUCER_REGS) // 8 * 8)


def _rs_dim(c):
    """K dim held in A-fragment column ``c`` (0..127) by dequant="prmt_rs": quad lane (c % 8) // 2 gets one scale group."""
    return 32 * ((c % 8) // 2) + 2 * (c // 8) + c % 2


@T.macro
def _load_q_rs(q, q_s, b, s, H: int, D: int):
    """q [B, S, H, D] bf16 -> q_s [H, D] with column c holding dim ``_rs_dim(c)``: the order prmt_rs gives K."""
    for h, c in T.Parallel(H, D):
        q_s[h, c] = q[b, s, h, _rs_dim(c)]


@T.macro
def _build_rs_tables(tab):
    """tab uint32 [256, 4]: the prmt byte tables (lo0, lo1, hi0, hi1) of every scale byte, once per CTA."""
    for v, e in T.Parallel(256, 4):
        tab[v, e] = T.call_extern("uint32", "csa2_fp4_table_word", v, e)


@T.macro
def _dequant_fragment_prmt(kw_s, ks_s, tab, k_deq, block_n: int, D: int):
    """Packed words ``kw_s`` int32 [block_n, D / 8] + scales ``ks_s`` int32 [block_n] -> A fragment ``k_deq`` bf16
    [block_n, D] in the ``_rs_dim`` column order (``tab``: ``_build_rs_tables``).

    Element (i, c) with c even writes the 32-bit pair (i, c), (i, c + 1). That pair is one A register in whatever
    layout TileLang picks: wgmma's RS operand is 32-bit registers of two consecutive-k bf16 of one row (low half the
    lower k) and TileLang hands ``k_deq`` to it as ``uint32_t*``, so elements c, c + 1 are adjacent in the thread's
    array. Which thread holds which pair only decides speed: with the wgmma layout one group per row and thread.
    """
    for i, c in T.Parallel(block_n, D):
        if c % 2 == 0:
            t, j = (c % 8) // 2, c // 8  # scale group, and the 8-column block (byte j % 4 of word 4t + j // 4)
            sb = (ks_s[i] >> (t * 8)) & 0xFF
            tables = (tab[sb, 0], tab[sb, 1], tab[sb, 2], tab[sb, 3])  # one 16-byte load per row (nvcc merges them)
            T.call_extern("handle", "csa2_fp4_pair_bf16", T.address_of(k_deq[i, c]), kw_s[i, t * 4 + j // 4], *tables, j % 4)


@T.macro
def _dequant_fragment_prmt2(kw_s, ks_s, tab, k_deq, block_n: int, D: int):
    """``_dequant_fragment_prmt`` for dequant="prmt_rs2": the same A fragment (same columns, tables and words), the scale
    byte by ``csa2_scale_byte`` and the pair by ``csa2_fp4_pair2_bf16`` (``_PRMT_PAIR2_CUDA``)."""
    for i, c in T.Parallel(block_n, D):
        if c % 2 == 0:
            t, j = (c % 8) // 2, c // 8  # scale group, and the 8-column block (byte j % 4 of word 4t + j // 4)
            sb = T.call_extern("int32", "csa2_scale_byte", ks_s[i], t)
            tables = (tab[sb, 0], tab[sb, 1], tab[sb, 2], tab[sb, 3])  # one 16-byte load per row (nvcc merges them)
            T.call_extern("handle", "csa2_fp4_pair2_bf16", T.address_of(k_deq[i, c]), kw_s[i, t * 4 + j // 4], *tables, j % 4)


# dequant="fma_rs": prmt_rs's A fragment built with half its integer work moved to the FMA pipe.
# Why: prmt_rs spends ~1.9 integer-ALU instructions per FP4 value (lookups, sign merges, interleaves), and on Hopper
# the ALU pipe issues at half the rate of the FMA pipe, where IMAD and the packed bf16 multiply issue. Here:
# * Pairing. A register pairs nibbles k and k + 4 of a word (bits 4k and 4k + 16: the two bf16 halves' distance), not
#   2k and 2k + 1 as prmt_rs does, so both halves need the same bit moves and one integer multiply does both.
# * Unit-scale bf16 by an integer multiply (IMAD). E2M1 magnitude bits e1 e0 m placed at bf16 bits 8..6 read as the bf16
#   e2m1 x 2^-126 (exponent field e, mantissa m; e = 0 is the bf16 subnormal m x 2^-127, i.e. code 1 = 0.5 x 2^-126).
#   x = nibble pair (isolated by one AND) times 2^6 + 2^12 puts the magnitude at 6..8 and the sign at 15 (plus copies
#   at 9 and 12..14 that one more AND clears): 2 ALU + 1 IMAD per register. Nibbles 2, 3, 6, 7 come from w >> 8.
# * Scale by packed bf16 multiplies (mul.rn.bf16x2, FMA pipe): times m1 = 2^(min(s, 128) - 1), then m2 = 2^(max(s, 128)
#   - 128). Both factors are powers of two inside bf16's normal range and every product is a bf16 (v x 2^(s - 127) for
#   scale bytes 0..252; at 253, 254 the values past bf16's range become inf, as the reference's fp32 ones do), so
#   nothing rounds; bf16 multiplies have no flush-to-zero mode (PTX: subnormal inputs and results are supported), so
#   the subnormal code-1 input is read exactly. Two multiplies because one factor cannot exceed 2^127: a single one
#   covers scale bytes <= 128 only (skipping the second behind a warp vote made TileLang move the scale loads into
#   the consumers, with two named barriers per tile).
# The A operands equal prmt_rs's bit for bit for scale bytes 2..252 (and 0 with the zero words of an out-of-range row);
# at byte 1 code +-1 is the exact +-2^-127 where prmt_rs has +-0 (byte 1 only scales all-zero groups). K and q use the
# column order ``_rs_fma_dim``; the products are prmt_rs's, summed by the same MMA in another dim order.
# Cost (sm_90a SASS, per consumer thread and 128-entry tile at the default's config): 119 ALU-pipe of 363 instructions
# against prmt_rs's 159 of 310. It can only win where the ALU pipe, not instruction issue, limits the kernel.
_FMA_PAIR_CUDA = r"""
__device__ __forceinline__ unsigned csa2_mul_bf16x2(unsigned a, unsigned b) {
  unsigned d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
// dst <- bf16x2 of nibbles k (low half) and k + 4 (high half) of w times 2^(sbyte - 127), k = 0..3
__device__ __forceinline__ void csa2_fp4_pair_fma(void* dst, int w_, int sbyte, int k) {
  const unsigned s = (unsigned)sbyte;
  const unsigned m1 = ((s < 128u ? s : 128u) + 126u) * 0x00800080u;      // bf16x2 2^(min(s, 128) - 1)
  const unsigned m2 = ((s > 128u ? s : 128u) - 1u) * 0x00800080u;        // bf16x2 2^(max(s, 128) - 128)
  // nibbles 2, 3, 6, 7 -> 0, 1, 4, 5: w >> 8 as the high word of w x 2^24 (IMAD.HI, FMA pipe; a shift is ALU)
  const unsigned w = k < 2 ? (unsigned)w_ : __umulhi((unsigned)w_, 1u << 24);
  const unsigned x = w & ((k & 1) ? 0x00F000F0u : 0x000F000Fu);          // nibble pair at bits 4(k & 1) + {0, 16}
  const unsigned u = (x * ((k & 1) ? 0x104u : 0x1040u)) & 0x81C081C0u;   // magnitude -> 8..6, sign -> 15 (IMAD, AND)
  *(unsigned*)dst = csa2_mul_bf16x2(csa2_mul_bf16x2(u, m1), m2);
}
"""


def _rs_fma_dim(c):
    """K dim held in A-fragment column ``c`` (0..127) by dequant="fma_rs": quad lane t = (c % 8) // 2 gets scale group t,
    column block j = c // 8 word j // 4 of it, and the register's halves (c even, c + 1) nibbles j % 4 and j % 4 + 4."""
    return 32 * ((c % 8) // 2) + 8 * (c // 32) + (c // 8) % 4 + 4 * (c % 2)


@T.macro
def _load_q_rs_fma(q, q_s, b, s, H: int, D: int):
    """q [B, S, H, D] bf16 -> q_s [H, D] with column c holding dim ``_rs_fma_dim(c)``: the order fma_rs gives K."""
    for h, c in T.Parallel(H, D):
        q_s[h, c] = q[b, s, h, _rs_fma_dim(c)]


@T.macro
def _dequant_fragment_fma(kw_s, ks_s, k_deq, block_n: int, D: int):
    """Packed words ``kw_s`` int32 [block_n, D / 8] + scales ``ks_s`` int32 [block_n] -> A fragment ``k_deq`` bf16
    [block_n, D] in the ``_rs_fma_dim`` column order (``_FMA_PAIR_CUDA``; no table).

    As in ``_dequant_fragment_prmt``, element (i, c) with c even writes the 32-bit pair (i, c), (i, c + 1), one wgmma A
    register whatever thread TileLang gives it to; with the wgmma layout a thread holds one scale group per row.
    """
    for i, c in T.Parallel(block_n, D):
        if c % 2 == 0:
            t, j = (c % 8) // 2, c // 8  # scale group; column block j: word 4t + j // 4, nibbles j % 4 and j % 4 + 4
            sb = (ks_s[i] >> (t * 8)) & 0xFF
            T.call_extern("handle", "csa2_fp4_pair_fma", T.address_of(k_deq[i, c]), kw_s[i, t * 4 + j // 4], sb, j % 4)


RS_DEQUANTS = ("prmt_rs", "fma_rs", "prmt_rs2")  # the bf16 A fragment built in the consumers' registers, q in a permuted dim order
REGISTER_A_DEQUANTS = (*RS_DEQUANTS, "fp8_rs")  # every wgmma RS path: the A fragment (bf16, or E4M3 per scale group) in registers
PRMT_RS_DEQUANTS = ("prmt_rs", "prmt_rs2")  # the shared scale -> prmt table, q in the _rs_dim order
HOPPER_ONLY_DEQUANTS = ("prmt_rs2", "fp8_rs")  # built for sm_90a only (the kernel builder refuses other targets)
FP8_MAX_BLOCK_N = 128  # fp8_rs keeps four accumulators (one per scale group): 256 entries would need 256 of them a thread
EPILOGUES = ("per_tile", "hoisted", "fused")  # per-CTA constants per tile or once; (fused) + the head sum by hand
# hidden_tiles: what the contiguous score kernel does with the entry tiles past the token's visible count. "score"
# dequantises, multiplies and masks them like any other; "skip" ends the CTA's tile loop at the last tile holding a
# visible entry and writes -inf over the rest of its span. Why: at prefill each token sees the cache up to itself, so
# about half the (token, tile) pairs hold no visible entry, and gpu/score_ablation.py put the prefill kernel's dequant
# alone at 39% of its time. Decode rows see (nearly) the whole cache: the same loop less at most its last tiles.
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


@functools.cache
def _score_kernel(
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
):
    """Build the score kernel (see module docstring); ``gather`` selects the Reindex variant.

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
    fp8 = dequant == "fp8_rs"
    if fp8 and (epilogue != "fused" or block_n > FP8_MAX_BLOCK_N):
        raise ValueError(f"dequant='fp8_rs' is built with epilogue='fused' and block_n <= {FP8_MAX_BLOCK_N}, got {epilogue!r}, {block_n}")
    H, D = HEADS, HEAD_DIM
    W = D // 8  # int32 words per packed entry (8 nibbles each)
    B, S, N, P = T.dynamic("B, S, N, P")
    C = P * pool_block  # candidate slots of one pool row (gather variant)
    n_out = C if gather else N
    span = block_n * tiles_per_cta

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

    @T.prim_func
    def score(
        q: T.Tensor((B, S, H, D), "bfloat16"),
        weights: T.Tensor((B, S, H), "float32"),
        k_words: T.Tensor((B, N, W), "int32"),
        k_scales: T.Tensor((B, N), "int32"),
        n_visible: T.Tensor((B, S), "int32"),
        pool: T.Tensor((B, S, P), "int32"),
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
                    producer_regs, consumer_regs = _rs_register_split(threads, min_ctas)
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
                T.import_source(_PRMT_CUDA)
            pin = _PIN_CUDA if hoisted else ""  # one import_source per kernel: TileLang refuses a second one
            if fused:
                pin = _PIN_CUDA + _FUSED_EPI_CUDA
            if dequant in PRMT_RS_DEQUANTS:
                T.import_source((_PRMT_PAIR_CUDA if dequant == "prmt_rs" else _PRMT_PAIR2_CUDA) + pin)
                rs_tab = T.alloc_shared((256, 4), "uint32")
                _build_rs_tables(rs_tab)
            if dequant == "fma_rs":
                T.import_source(_FMA_PAIR_CUDA + pin)
            if fp8:
                T.import_source(_FP8_CUDA + pin)
            if dequant == "lut":
                # byte -> both nibbles' bf16 bit patterns at unit scale (low half = even element).
                lut = T.alloc_shared((256,), "uint32")
                for v in T.Parallel(256):
                    lut[v] = _e2m1_bf16_bits(v & 0xF) | (_e2m1_bf16_bits(v >> 4) << 16)
            nvis = n_visible[b, s]
            if dequant in PRMT_RS_DEQUANTS:
                _load_q_rs(q, q_s, b, s, H, D)
            elif dequant == "fma_rs":
                _load_q_rs_fma(q, q_s, b, s, H, D)
            elif fp8:
                _load_q_fp8(q, q8_s, q_fac, b, s, H, D)
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
                        pos_s[i] = T.if_then_else((blk >= 0) & (pos < nvis) & (pos < N), pos, -1)
                    for i, c in T.Parallel(block_n, W):
                        kw_s[i, c] = T.if_then_else(pos_s[i] >= 0, k_words[b, T.max(pos_s[i], 0), c], 0)
                    for i in T.Parallel(block_n):
                        ks_s[i] = T.if_then_else(pos_s[i] >= 0, k_scales[b, T.max(pos_s[i], 0)], 0x7F7F7F7F)
                else:
                    T.copy(k_words[b, n0 : n0 + block_n, :], kw_s)
                    # Not TMA: the [B, N] int32 scale rows are only 4-byte aligned for N not a multiple of 4.
                    T.copy(k_scales[b, n0 : n0 + block_n], ks_s, annotations={"disable_tma": True})
                if dequant == "bits":
                    _dequant_words_bits(kw_s, ks_s, k_deq, block_n, W)
                elif dequant == "prmt":
                    _dequant_groups_prmt(kw_s, ks_s, k_deq, block_n, W)
                elif dequant == "prmt_rs":
                    _dequant_fragment_prmt(kw_s, ks_s, rs_tab, k_deq, block_n, D)
                elif dequant == "prmt_rs2":
                    _dequant_fragment_prmt2(kw_s, ks_s, rs_tab, k_deq, block_n, D)
                elif dequant == "fma_rs":
                    _dequant_fragment_fma(kw_s, ks_s, k_deq, block_n, D)
                elif fp8:
                    _score_fp8_groups(kw_s, k8, q8_s, accs, block_n)
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

    return tilelang.compile(score, target=tvm.target.Target(_target_dict(target)))


LOADS_IN_FLIGHT = 16  # score loads each select thread issues before using the first (memory-level parallelism)

# Warp-aggregated histogram increment for the radix passes. A pass over fp32 scores puts most of a row
# in a handful of bins (the top bits are the sign and exponent), and shared-memory atomics to one
# address serialise: lanes with the same bin elect a leader that adds the group's count instead.
# Convergent: every lane of the warp calls it, inactive lanes with active = 0.
_HIST_CUDA = r"""
__device__ __forceinline__ void csa2_hist_add(int* hist, int bin, int active) {
  const unsigned voters = __ballot_sync(0xffffffffu, active);
  if (!active) return;
  const unsigned peers = __match_any_sync(voters, bin);
  if ((int)(threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(hist + bin, __popc(peers));
}
"""


@functools.cache
def _select_kernel(target: str, k: int, threads: int, radix_bits: int, remap_block: int):
    """Build the select kernel: exact top-k of each row by radix select, sorted by position.

    ``values [R, L]`` fp32, ``n_valid [R]`` int32 (columns >= n_valid are not candidates),
    ``blocks [R, Pb]`` int32 used only when ``remap_block`` > 0: column ``i`` is then reported
    as ``blocks[r, i // remap_block] * remap_block + i % remap_block`` (Reindex's compact
    candidate slots back to cache positions; ascending blocks keep the order).
    Output ``out [R, k]`` int32. -inf and NaN values are never chosen.
    """
    R, L, Pb = T.dynamic("R, L, Pb")
    radix = 1 << radix_bits
    per_thread = max(1, radix // threads)  # bins each thread sums in the threshold scan
    scan_threads = radix // per_thread
    widths = []
    left = 32
    while left > 0:
        widths.append(min(radix_bits, left))
        left -= widths[-1]
    log_threads = int(math.log2(threads))

    def ordered_key(x):
        bits = T.reinterpret(x, "uint32")
        return T.if_then_else(x < 0, ~bits, bits | T.uint32(0x80000000))

    @T.prim_func
    def select(
        values: T.Tensor((R, L), "float32"),
        n_valid: T.Tensor((R,), "int32"),
        blocks: T.Tensor((R, Pb), "int32"),
        out: T.Tensor((R, k), "int32"),
    ):
        with T.Kernel(R, threads=threads) as r:
            T.import_source(_HIST_CUDA)
            tx = T.get_thread_binding()
            hist = T.alloc_shared((radix,), "int32")
            xs = T.alloc_local((LOADS_IN_FLIGHT,), "float32")
            part = T.alloc_shared((threads + 1,), "int32")
            part2 = T.alloc_shared((threads + 1,), "int32")
            found = T.alloc_shared((2,), "int32")
            prefix = T.alloc_var("uint32")
            mask = T.alloc_var("uint32")
            remaining = T.alloc_var("int32")
            take_all = T.alloc_var("int32")
            run = T.alloc_var("int32")
            v = T.alloc_var("int32")
            cnt = T.alloc_var("int32")
            n_gt = T.alloc_var("int32")
            n_eq = T.alloc_var("int32")
            gt_before = T.alloc_var("int32")
            eq_before = T.alloc_var("int32")
            o = T.alloc_var("int32")
            eq_rank = T.alloc_var("int32")
            cnt = T.min(n_valid[r], L)
            prefix = T.uint32(0)
            mask = T.uint32(0)
            remaining = k
            take_all = 0
            shift = 32
            for width in widths:
                shift -= width
                if take_all == 0:
                    for i in T.serial(per_thread):
                        if tx * per_thread + i < radix:
                            hist[tx * per_thread + i] = 0
                    T.sync_threads()
                    # One CTA per row: with one 4-byte load in flight per thread a pass was latency-bound
                    # (~1 us per iteration, 1.4 ms per call on the H200); LOADS_IN_FLIGHT independent
                    # coalesced loads per thread are issued before any is used.
                    for it in T.serial(T.ceildiv(cnt, threads * LOADS_IN_FLIGHT)):
                        for e in T.unroll(LOADS_IN_FLIGHT):
                            j = (it * LOADS_IN_FLIGHT + e) * threads + tx
                            xs[e] = T.if_then_else(j < cnt, values[r, T.max(T.min(j, cnt - 1), 0)], -T.infinity("float32"))
                        for e in T.unroll(LOADS_IN_FLIGHT):
                            key = ordered_key(xs[e])
                            active = (xs[e] > -T.infinity("float32")) & ((key & mask) == prefix)
                            T.call_extern(
                                "handle",
                                "csa2_hist_add",
                                T.address_of(hist[0]),
                                T.Cast("int32", (key >> shift) & ((1 << width) - 1)),
                                T.Cast("int32", active),
                            )
                    T.sync_threads()
                    # Suffix sums per thread chunk of bins, then across threads (Hillis-Steele).
                    run = 0
                    if tx < scan_threads:
                        for i in T.serial(per_thread):
                            run = run + hist[tx * per_thread + i]
                        part[tx] = run
                    else:
                        part[tx] = 0
                    if tx == 0:
                        part[threads] = 0
                        found[0] = -1
                    T.sync_threads()
                    for lvl in T.serial(log_threads):
                        off = 1 << lvl
                        v = part[tx] + T.if_then_else(tx + off < threads, part[T.min(tx + off, threads - 1)], 0)
                        T.sync_threads()
                        part[tx] = v
                        T.sync_threads()
                    if part[0] <= remaining:
                        # Fewer candidates than slots left: everything matching the prefix is chosen.
                        take_all = 1
                    else:
                        if tx < scan_threads:
                            run = T.if_then_else(tx + 1 < threads, part[T.min(tx + 1, threads - 1)], 0)
                            for i in T.serial(per_thread):
                                bin_ = tx * per_thread + per_thread - 1 - i
                                if (run < remaining) & (run + hist[bin_] >= remaining):
                                    found[0] = bin_
                                    found[1] = run
                                run = run + hist[bin_]
                        T.sync_threads()
                        prefix = prefix | (T.Cast("uint32", found[0]) << shift)
                        mask = mask | (T.uint32((1 << width) - 1) << shift)
                        remaining = remaining - found[1]
                        T.sync_threads()
            T.sync_threads()  # every thread has read part[0] before the counts below overwrite it
            if take_all == 1:
                # Everything valid above the current prefix level is chosen: compare with key > 0
                # only inside the prefix, i.e. keep the prefix and take all equal-prefix keys.
                remaining = cnt + 1
            # Position-ordered output: contiguous segments per thread, exclusive prefix counts.
            seg = T.ceildiv(cnt, threads)
            n_gt = 0
            n_eq = 0
            for i in T.serial(seg):
                j = tx * seg + i
                if j < cnt:
                    x = values[r, j]
                    key = ordered_key(x)
                    if x > -T.infinity("float32"):
                        if (key & mask) > prefix:
                            n_gt = n_gt + 1
                        elif (key & mask) == prefix:
                            n_eq = n_eq + 1
            part[tx] = n_gt
            part2[tx] = n_eq
            T.sync_threads()
            for lvl in T.serial(log_threads):
                off = 1 << lvl
                gt_before = T.if_then_else(tx >= off, part[T.max(tx - off, 0)], 0)
                eq_before = T.if_then_else(tx >= off, part2[T.max(tx - off, 0)], 0)
                T.sync_threads()
                part[tx] = part[tx] + gt_before
                part2[tx] = part2[tx] + eq_before
                T.sync_threads()
            gt_before = part[tx] - n_gt
            eq_before = part2[tx] - n_eq
            o = gt_before + T.min(eq_before, remaining)
            eq_rank = eq_before
            for i in T.serial(seg):
                j = tx * seg + i
                if j < cnt:
                    x = values[r, j]
                    key = ordered_key(x)
                    if x > -T.infinity("float32"):
                        if ((key & mask) > prefix) | (((key & mask) == prefix) & (eq_rank < remaining)):
                            if remap_block > 0:
                                out[r, o] = blocks[r, j // max(remap_block, 1)] * remap_block + j % max(remap_block, 1)
                            else:
                                out[r, o] = j
                            o = o + 1
                        if (key & mask) == prefix:
                            eq_rank = eq_rank + 1
            total = part[threads - 1] + T.min(part2[threads - 1], remaining)
            for it in T.serial(T.ceildiv(k, threads)):
                j = it * threads + tx
                if (j < k) & (j >= total):
                    out[r, j] = -1

    return tilelang.compile(select, target=tvm.target.Target(_target_dict(target)))


@functools.cache
def _block_max_kernel(target: str, block: int, threads: int):
    """Block scores of the candidate pool: max over ``block`` positions, the newest visible block forced to +inf.

    ``scores [R, N]`` fp32, ``n_visible [R]`` int32 -> ``out [R, ceil(N / block)]`` fp32.
    """
    R, N, NB = T.dynamic("R, N, NB")

    @T.prim_func
    def block_max(scores: T.Tensor((R, N), "float32"), n_visible: T.Tensor((R,), "int32"), out: T.Tensor((R, NB), "float32")):
        with T.Kernel(R, T.ceildiv(NB, threads), threads=threads) as (r, bx):  # rows in x: a 64K prefill has 65536
            best = T.alloc_var("float32")
            nb = bx * threads + T.get_thread_binding()
            if nb < NB:
                best = -T.infinity("float32")
                for i in T.serial(block):
                    j = nb * block + i
                    if j < N:
                        best = T.max(best, scores[r, j])
                newest = (n_visible[r] - 1) // block
                out[r, nb] = T.if_then_else((n_visible[r] > 0) & (nb == newest), T.infinity("float32"), best)

    return tilelang.compile(block_max, target=tvm.target.Target(_target_dict(target)))


def _target_dict(target: str) -> dict:
    return {"kind": "cuda", "arch": target}


# --------------------------------------------------------------------------------------
# config lookup and input checks
# --------------------------------------------------------------------------------------


def _device_arch(t: torch.Tensor) -> Arch:
    if t.device.type != "cuda":
        raise TileError(f"the indexer kernels run on a CUDA GPU, got tensors on {t.device}: move them with .cuda()")
    major, minor = torch.cuda.get_device_capability(t.device)
    for name in (f"sm{major}{minor}", f"sm{major}0"):
        try:
            return get_arch(name)
        except ValueError:
            continue
    raise TileError(f"GPU with compute capability {major}.{minor} is not in tiles.arch: add it there first")


def _pick_config(tile: Tile, shape: Shape, arch: Arch, config: Config | None) -> Config:
    """An explicit config (checked), else the tuned winner from results/, else the tile's default."""
    if config is None:
        try:
            from tiles.results import load_winner
        except ImportError:
            config = tile.default_config(arch)
        else:
            config, _ = load_winner(tile.name, arch, shape, default=tile.default_config(arch))
    full = tile.with_defaults(arch, config)
    reasons = tile.search_space(arch).violations(full, shape, arch)
    if reasons:
        raise TileError(f"{tile.name}: config {config} is not usable here: {'; '.join(reasons)}")
    return full


def _check(t: torch.Tensor, name: str, shape: tuple, dtypes: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in dtypes:
        raise TileError(f"{name} must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if t.dim() != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape)):
        want = tuple("*" if w is None else w for w in shape)
        raise TileError(f"{name} must have shape {want}, got {tuple(t.shape)}")


def _index_k_words(k_packed: torch.Tensor, k_scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [B, N, 64] + [B, N, 4] -> int32 [B, N, 16] + int32 [B, N] (same bytes, 4 per word)."""
    B, N = k_packed.shape[:2]
    words = k_packed.contiguous().view(torch.int32)  # [B, N, 16]
    scales = k_scales.contiguous().view(torch.int32).view(B, N)  # [B, N]
    return words, scales


def _check_indexer_inputs(q, weights, k_packed, k_scales, n_visible) -> tuple[int, int, int]:
    if q.dim() != 4:
        raise TileError(f"q must be [B, S, {HEADS}, {HEAD_DIM}], got {tuple(q.shape)}")
    B, S = q.shape[:2]
    _check(q, "q", (B, S, HEADS, HEAD_DIM), (torch.bfloat16, torch.float32))
    _check(weights, "weights", (B, S, HEADS), (torch.float32,))
    if k_packed.dim() != 3:
        raise TileError(f"k_packed must be uint8 [B, N, {HEAD_DIM // 2}], got {tuple(k_packed.shape)}")
    N = k_packed.shape[1]
    _check(k_packed, "k_packed", (B, N, HEAD_DIM // 2), (torch.uint8,))
    _check(k_scales, "k_scales", (B, N, HEAD_DIM // GROUP), (torch.uint8,))
    _check(n_visible, "n_visible", (B, S), (torch.int32, torch.int64))
    for name, t in (("weights", weights), ("k_packed", k_packed), ("k_scales", k_scales), ("n_visible", n_visible)):
        if t.device != q.device:
            raise TileError(f"{name} is on {t.device} but q is on {q.device}")
    if N == 0:
        raise TileError("the index cache is empty (N = 0): nothing to score")
    return B, S, N


# --------------------------------------------------------------------------------------
# public functions
# --------------------------------------------------------------------------------------


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_packed: torch.Tensor,
    k_scales: torch.Tensor,
    n_visible: torch.Tensor,
    topk: int,
    return_scores: bool = False,
    config: Config | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Indexer scores over the packed FP4 index K, then the top-k positions.

    Args:
        q: bf16 or fp32 [B, S, 32, 128] indexer queries, FP4 fake-quantised (E8M0 group 32):
            such values are exact in bf16, so fp32 queries are converted to bf16 losslessly.
        weights: fp32 [B, S, 32] per-head weights (already scaled by 128^-0.5 * 32^-0.5).
        k_packed: uint8 [B, N, 64] packed FP4 index K (even element in the low nibble).
        k_scales: uint8 [B, N, 4] E8M0 scale bytes, one per 32 dims. Both are read as int32
            words; a strided view of a larger cache (``buf[:, :n]``) is made contiguous first
            (a copy), so pass contiguous caches on the hot path.
        n_visible: int32/int64 [B, S]; entries j >= n_visible[b, s] are not visible.
        topk: how many positions to keep (512 in v4.1-flash).
        return_scores: also return the scores.
        config: tile parameters (see :class:`IndexerTopkTile`); None = tuned winner or default.
    Returns:
        int32 [B, S, topk]: ascending positions, -1 fill (ties: lower position wins);
        with ``return_scores`` also fp32 [B, S, N] scores, -inf where not visible.
    """
    B, S, N = _check_indexer_inputs(q, weights, k_packed, k_scales, n_visible)
    if topk <= 0:
        raise TileError(f"topk must be positive, got {topk}")
    arch = _device_arch(q)
    shape = Shape("call", "any", {"B": B, "S": S, "N": N, "Hi": HEADS, "Di": HEAD_DIM, "K": topk})
    cfg = _pick_config(INDEXER_TOPK, shape, arch, config)
    words, scales = _index_k_words(k_packed, k_scales)
    nvis = n_visible.to(torch.int32).contiguous()
    scores = torch.empty(B, S, N, dtype=torch.float32, device=q.device)  # [B, S, N]
    out = torch.empty(B, S, topk, dtype=torch.int32, device=q.device)  # [B, S, K]
    _launch_topk(cfg, arch, q, weights, words, scales, nvis, scores, out)
    return (out, scores) if return_scores else out


TILES_PER_CTA = (1, 4, 16)
AUTO_CTAS_PER_SM = 0.75  # tiles_per_cta="auto": the most tiles per CTA that still give the grid this many CTAs per SM


def resolve_tiles_per_cta(setting, rows: int, n_out: int, block_n: int, arch: Arch) -> int:
    """Entry tiles per score CTA: ``setting`` itself, or for ``"auto"`` the most of :data:`TILES_PER_CTA` whose grid
    (``rows`` token rows x ``ceil(n_out / (block_n x tiles))``) still has ``AUTO_CTAS_PER_SM`` CTAs per SM, else 1.

    Fewer tiles per CTA pay the CTA's prologue (q, weights, tables) more often; too many leave SMs idle when the rows
    are few. H200 (results/sm90/profile_indexer_b1_tiles_session12.json), one sequence over 128K entries: 16 tiles
    (32 CTAs) 20.9 us of score kernel, 4 tiles (128 CTAs) 6.7 us, 1 tile (512 CTAs) 7.7 us; auto picks 4 there, and 16
    at decode B=64 x 128K (2048 CTAs) and prefill, as before.
    """
    if setting != "auto":
        return int(setting)
    for tiles in sorted(TILES_PER_CTA, reverse=True):
        if rows * -(-n_out // (block_n * tiles)) >= AUTO_CTAS_PER_SM * arch.sm_count:
            return tiles
    return min(TILES_PER_CTA)


def _score(cfg: Config, arch: Arch, gather: bool, block: int, q, weights, words, scales, nvis, pool, scores) -> None:
    """Launch the score kernel the config names (scores [B, S, n_out] give ``tiles_per_cta="auto"`` its grid)."""
    B, S, n_out = scores.shape
    score = _build_score(arch, cfg, gather, block, B * S, n_out)
    score(q.to(torch.bfloat16).contiguous(), weights.float().contiguous(), words, scales, nvis, pool, scores)


def _build_score(arch: Arch, cfg: Config, gather: bool, block: int, rows: int | None = None, n_out: int | None = None):
    """The score kernel for ``cfg``; ``tiles_per_cta="auto"`` is resolved for ``rows`` token rows of ``n_out`` scores."""
    if cfg["tiles_per_cta"] == "auto" and (rows is None or n_out is None):
        raise ValueError("tiles_per_cta='auto' is resolved per grid: give the score rows and their length")
    tiles = resolve_tiles_per_cta(cfg["tiles_per_cta"], rows, n_out, cfg["block_n"], arch)
    common = (arch.nvcc_arch, cfg["block_n"], cfg["threads"], cfg["stages"], tiles)
    hidden = cfg.get("hidden_tiles", "score") if not gather else "score"  # Reindex's slots are not in position order
    # every argument named, so a config with or without an optional key at its default is one cache entry
    return _score_kernel(*common, cfg["dequant"], gather, block, cfg.get("min_ctas", 0), cfg.get("epilogue", "per_tile"), hidden)


def _launch_topk(cfg: Config, arch: Arch, q, weights, words, scales, nvis, scores, out) -> None:
    B, S, N = scores.shape
    dummy_pool = torch.empty(B, S, 1, dtype=torch.int32, device=q.device)  # the contiguous variant reads no pool
    _score(cfg, arch, False, 8, q, weights, words, scales, nvis, dummy_pool, scores)
    if cfg.get("select_algo", "multipass") == "two_pass":
        # tiles.radix_select: two passes over each row in global memory, the rest in shared memory
        radix_select.select_launcher(B * S, N, out.shape[-1], q.device, arch=arch, config=radix_config(cfg))(
            scores.view(B * S, N), nvis.view(B * S), out.view(B * S, -1)
        )
        return
    select = _select_kernel(arch.nvcc_arch, out.shape[-1], cfg["select_threads"], cfg["radix_bits"], 0)
    parts = resolve_select_split(cfg.get("select_split", 1), B * S, N, out.shape[-1], arch)
    _select_in_parts(select, parts, scores.view(B * S, N), nvis.view(B * S), out.view(B * S, -1))


SELECT_SPLITS = (1, 2, 4, 8)


def resolve_select_split(setting, rows: int, n: int, k: int, arch: Arch) -> int:
    """Parts per score row for the select: ``setting`` itself, or for ``"auto"`` the fewest parts that give
    two CTAs per SM (the kernel runs one CTA per row part), keeping each part at least 4k entries wide so the
    second stage's candidates stay a small fraction of the row.

    On the H200, decode B=64 x 128K (64 rows): 1 part 1.32 ms of select, 4 parts 0.70 ms, 8 parts 0.44 ms
    (results/sm90/profile_indexer_select_split.json); auto picks 8 there and 1 for prefill-sized row counts.
    """
    if setting != "auto":
        return int(setting)
    parts = 1
    while parts < SELECT_SPLITS[-1] and rows * parts < 2 * arch.sm_count and n % (2 * parts) == 0 and n // (2 * parts) >= 4 * k:
        parts *= 2
    return parts


def _select_in_parts(select, parts: int, scores: torch.Tensor, nvis: torch.Tensor, out: torch.Tensor) -> None:
    """Top-k of each score row by the select kernel, the row cut into ``parts`` equal parts first.

    The kernel runs one CTA per row, so B = 64 decode rows of 128K scores kept 64 of 132 SMs busy for
    1.3 ms on the H200 (notes/indexer.md). With parts: a top-k of every part (R x parts CTAs), then a
    top-k of the parts x k candidates of each row. Exact, with the same tie rule: an entry the whole
    row keeps is among the k best of its part, ties going to lower positions in both stages, and the
    candidates stay in position order (parts in order, each sorted). Rows whose length is not a
    multiple of ``parts`` run in one piece.

    Args: scores fp32 [R, N]; nvis int32 [R] (columns >= nvis are not candidates); out int32 [R, k].
    """
    R, N = scores.shape
    k = out.shape[1]
    dummy_blocks = torch.empty(R, 1, dtype=torch.int32, device=scores.device)
    if parts <= 1 or N % parts:
        select(scores, nvis, dummy_blocks, out)
        return
    width = N // parts
    offsets = torch.arange(parts, device=scores.device, dtype=torch.int32) * width  # [parts]
    part_nvis = (nvis.view(R, 1) - offsets.view(1, parts)).clamp(0, width).to(torch.int32)  # [R, parts]
    local = torch.empty(R * parts, k, dtype=torch.int32, device=scores.device)  # [R * parts, k]
    select(scores.view(R * parts, width), part_nvis.view(-1), dummy_blocks.new_empty(R * parts, 1), local)
    local = local.view(R, parts, k)
    pos = torch.where(local >= 0, local + offsets.view(1, parts, 1), -1).view(R, parts * k)  # [R, parts * k], ascending
    cand = torch.where(pos >= 0, scores.gather(1, pos.clamp(min=0).long()), float("-inf"))  # [R, parts * k]
    n_cand = torch.full((R,), parts * k, dtype=torch.int32, device=scores.device)  # [R]
    pick = torch.empty(R, k, dtype=torch.int32, device=scores.device)  # [R, k] candidate slots, ascending
    select(cand, n_cand, dummy_blocks, pick)
    out.copy_(torch.where(pick >= 0, pos.gather(1, pick.clamp(min=0).long()), -1))


def candidate_pool(
    scores: torch.Tensor, n_visible: torch.Tensor, block: int = 8, max_blocks: int = 2048, config: Config | None = None
) -> torch.Tensor:
    """The candidate pool of layer 20: the best blocks of ``block`` positions by their max score.

    The newest (possibly partial) visible block is always kept; ties: lower block id wins.
    Equal to :func:`model.ops.indexer.candidate_blocks` on the same scores, exactly.

    Args:
        scores: fp32 [B, S, N] indexer scores, -inf where not visible.
        n_visible: int32/int64 [B, S].
        block: positions per block (8); max_blocks: pool size cap (2048).
    Returns:
        int32 [B, S, min(max_blocks, ceil(N / block))]: ascending block ids, -1 fill.
    """
    if scores.dim() != 3 or scores.dtype != torch.float32:
        raise TileError(f"scores must be float32 [B, S, N], got {scores.dtype} {tuple(scores.shape)}")
    B, S, N = scores.shape
    _check(n_visible, "n_visible", (B, S), (torch.int32, torch.int64))
    if block <= 0 or max_blocks <= 0:
        raise TileError(f"block and max_blocks must be positive, got {block} and {max_blocks}")
    if N == 0:
        raise TileError("scores have no entries (N = 0)")
    arch = _device_arch(scores)
    nb = -(-N // block)
    P = min(max_blocks, nb)
    shape = Shape("call", "decode", {"B": B, "S": S, "N": N, "Hi": HEADS, "Di": HEAD_DIM, "K": 512, "P": max_blocks, "block": block})
    cfg = _pick_config(CANDIDATE_POOL, shape, arch, config)
    nvis = n_visible.to(torch.int32).contiguous().view(B * S)
    block_scores = torch.empty(B * S, nb, dtype=torch.float32, device=scores.device)  # [B*S, nb]
    out = torch.empty(B, S, P, dtype=torch.int32, device=scores.device)  # [B, S, P]
    _launch_pool(cfg, arch, scores.contiguous().view(B * S, N), nvis, block, block_scores, out)
    return out


def _launch_pool(cfg: Config, arch: Arch, scores2d, nvis, block: int, block_scores, out) -> None:
    R, nb = block_scores.shape
    _block_max_kernel(arch.nvcc_arch, block, cfg["block_threads"])(scores2d, nvis, block_scores)
    nvis_blocks = torch.full_like(nvis, nb)  # every block id is a candidate; -inf blocks are skipped
    if cfg.get("select_algo", "multipass") == "two_pass":
        radix_select.select_launcher(R, nb, out.shape[-1], out.device, arch=arch)(block_scores, nvis_blocks, out.view(R, -1))
        return
    dummy = torch.empty(R, 1, dtype=torch.int32, device=out.device)
    _select_kernel(arch.nvcc_arch, out.shape[-1], cfg["select_threads"], cfg["radix_bits"], 0)(
        block_scores, nvis_blocks, dummy, out.view(R, -1)
    )


def reindex_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_packed: torch.Tensor,
    k_scales: torch.Tensor,
    n_visible: torch.Tensor,
    pool_blocks: torch.Tensor,
    block: int,
    topk: int,
    config: Config | None = None,
    return_scores: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Reindex: indexer scores and top-k only inside the candidate pool.

    The pool's ``block``-entry runs are gathered first (P * block candidates are scored,
    never the whole cache), then the top-k of those candidates is mapped back to cache
    positions. Equal in selection to scoring everything, masking with
    :func:`model.ops.indexer.pool_mask` and :func:`model.ops.indexer.topk_positions`.

    Args:
        q, weights, k_packed, k_scales, n_visible: as :func:`indexer_topk`.
        pool_blocks: int32 [B, S, P] ascending block ids, -1 fill (from :func:`candidate_pool`).
        block: positions per block (8).
        topk: positions to keep (512).
        return_scores: also return the candidates' scores.
    Returns:
        int32 [B, S, topk]: ascending cache positions, -1 fill; with ``return_scores`` also
        fp32 [B, S, P * block] scores of the pool's slots (-inf for unused or invisible slots).
    """
    B, S, N = _check_indexer_inputs(q, weights, k_packed, k_scales, n_visible)
    if pool_blocks.dim() != 3:
        raise TileError(f"pool_blocks must be int32 [B, S, P], got {tuple(pool_blocks.shape)}")
    _check(pool_blocks, "pool_blocks", (B, S, None), (torch.int32,))
    if block <= 0 or topk <= 0:
        raise TileError(f"block and topk must be positive, got {block} and {topk}")
    arch = _device_arch(q)
    P = pool_blocks.shape[-1]
    shape = Shape("call", "decode", {"B": B, "S": S, "N": N, "Hi": HEADS, "Di": HEAD_DIM, "K": topk, "P": P, "block": block})
    cfg = _pick_config(REINDEX_TOPK, shape, arch, config)
    words, scales = _index_k_words(k_packed, k_scales)
    nvis = n_visible.to(torch.int32).contiguous()
    pool = pool_blocks.contiguous()
    scores = torch.empty(B, S, P * block, dtype=torch.float32, device=q.device)  # [B, S, P*block]
    out = torch.empty(B, S, topk, dtype=torch.int32, device=q.device)  # [B, S, K]
    _launch_reindex(cfg, arch, q, weights, words, scales, nvis, pool, block, scores, out)
    return (out, scores) if return_scores else out


def _launch_reindex(cfg: Config, arch: Arch, q, weights, words, scales, nvis, pool, block: int, scores, out) -> None:
    B, S, C = scores.shape
    _score(cfg, arch, True, block, q, weights, words, scales, nvis, pool, scores)
    if cfg.get("select_algo", "multipass") == "two_pass":
        # slot c -> cache position pool[c // block] * block + c % block, in the select's output (an unused block's
        # slots map to negative positions; their scores are -inf, never chosen)
        R = B * S
        dummy = torch.empty(R, 1, dtype=torch.float32, device=q.device)
        select = radix_select.remapped_kernel(arch, out.shape[-1], R, block=block)
        select(scores.view(R, C), nvis.view(R), pool.view(R, -1), out.view(R, -1), dummy)
        return
    select = _select_kernel(arch.nvcc_arch, out.shape[-1], cfg["select_threads"], cfg["radix_bits"], block)
    n_cand = torch.full((B * S,), C, dtype=torch.int32, device=q.device)
    select(scores.view(B * S, C), n_cand, pool.view(B * S, -1), out.view(B * S, -1))


# --------------------------------------------------------------------------------------
# tiles
# --------------------------------------------------------------------------------------


def _random_fp4(shape: tuple[int, ...], gen: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed FP4 rows with E8M0 scales: uint8 [..., 64] and uint8 [..., 4].

    Every code appears; scale bytes 121..127 (2^-6..1) give the magnitudes of a normalised key.
    Drawn directly in packed form so a 1M-entry cache costs no fp32 staging.
    """
    packed = torch.randint(0, 256, (*shape, HEAD_DIM // 2), generator=gen, device=device, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(121, 128, (*shape, HEAD_DIM // GROUP), generator=gen, device=device, dtype=torch.int32).to(torch.uint8)
    return packed, scales


def _indexer_inputs(B: int, S: int, N: int, seed: int, device, causal: bool) -> Inputs:
    gen = torch.Generator(device=device).manual_seed(seed)
    k_packed, k_scales = _random_fp4((B, N), gen, device)  # [B, N, 64], [B, N, 4]
    q_packed, q_scales = _random_fp4((B, S, HEADS), gen, device)
    q = formats.fp4_dequantize(q_packed, q_scales, GROUP, "e8m0").to(torch.bfloat16)  # [B, S, Hi, Di], exact
    weights = torch.randn(B, S, HEADS, generator=gen, device=device) * (HEAD_DIM**-0.5 * HEADS**-0.5)  # [B, S, Hi]
    if causal:
        n_visible = (torch.arange(S, device=device) + 1).clamp(max=N).expand(B, S).contiguous()  # ratio-1 prefill
    else:
        # Most rows see (nearly) the whole cache; with three rows or more, one sees less than top-k and one nothing
        # (a single row, as at decode B=1, sees the cache: its timing must be the full score and select).
        n_visible = N - torch.randint(0, max(1, N // 16), (B, S), generator=gen, device=device)
        if B * S > 2:
            n_visible[0, 0] = min(N, 300)
            n_visible.view(-1)[-1] = 0
    return {"q": q, "weights": weights, "k_packed": k_packed, "k_scales": k_scales, "n_visible": n_visible.to(torch.int32)}


def _reference_scores(inputs: Inputs) -> torch.Tensor:
    index_k = formats.fp4_dequantize(inputs["k_packed"], inputs["k_scales"], GROUP, "e8m0")  # [B, N, Di]
    return indexer_scores(inputs["q"], inputs["weights"], index_k, inputs["n_visible"])  # [B, S, N]


def compare_topk_sets(out: torch.Tensor, ref: torch.Tensor, ref_scores: torch.Tensor, rtol: float = TIE_RTOL) -> Comparison:
    """Top-k lists as index sets, with ties allowed to differ.

    ``out``/``ref`` int32 [B, S, K] (ascending, -1 fill), ``ref_scores`` fp32 [B, S, N] the
    reference scores the lists were chosen from. Both lists must be ascending with the same
    number of entries; a position in one set but not the other must have a reference score
    equal to the k-th largest chosen reference score within ``rtol`` (relative).
    """
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return Comparison(False, "topk-set", 1.0, f"got {tuple(out.shape)} {out.dtype}, want {tuple(ref.shape)} {ref.dtype}")
    R, K = out.shape[0] * out.shape[1], out.shape[-1]
    N = ref_scores.shape[-1]
    o, r, sc = out.reshape(R, K).long(), ref.reshape(R, K).long(), ref_scores.reshape(R, N)
    n_o, n_r = (o >= 0).sum(-1), (r >= 0).sum(-1)
    if not torch.equal(n_o, n_r):
        bad = int((n_o != n_r).sum())
        return Comparison(False, "topk-set", bad / R, f"{bad} rows choose a different number of entries")
    valid = o >= 0
    if bool(((o < -1) | (o >= N)).any()):
        return Comparison(False, "topk-set", 1.0, "positions out of range")
    srt = torch.where(valid, o, torch.full_like(o, N))
    if bool((srt[:, 1:] <= srt[:, :-1])[valid[:, 1:]].any()) or bool((valid[:, 1:] & ~valid[:, :-1]).any()):
        return Comparison(False, "topk-set", 1.0, "positions are not strictly ascending followed by -1 fill")
    mask_o = torch.zeros(R, N + 1, dtype=torch.bool, device=out.device).scatter_(1, srt, True)[:, :N]
    mask_r = torch.zeros(R, N + 1, dtype=torch.bool, device=out.device).scatter_(1, torch.where(r >= 0, r, N), True)[:, :N]
    diff = mask_o ^ mask_r
    kth = torch.where(mask_r, sc, torch.full_like(sc, float("inf"))).amin(-1, keepdim=True)  # [R, 1]
    close = (sc - kth).abs() <= rtol * kth.abs().clamp(min=1e-30)
    bad = diff & ~close
    n_diff, n_bad = int(diff.sum()), int(bad.sum())
    total = max(1, int(n_r.sum()))
    ok = n_bad == 0
    return Comparison(ok, "topk-set", n_diff / total, f"{n_diff} tie swaps, {n_bad} non-tie differences")


def _merge(*comparisons: Comparison) -> Comparison:
    ok = all(c.ok for c in comparisons)
    return Comparison(
        ok, " + ".join(c.metric for c in comparisons), max(c.error for c in comparisons), "; ".join(str(c) for c in comparisons)
    )


def _smem_score(config: Config, shape: Shape, arch: Arch) -> str | None:
    config = {**_SCORE_DEFAULT, **config}  # a partial config is judged with the defaults filled in
    bn = config["block_n"]
    # TileLang's pipeline multi-buffers every shared tile written inside the loop: the packed
    # words, scales and positions, and the dequantised bf16 tile too (an estimate without that
    # factor let a 253 KiB lut config through to a launch failure on the H200).
    per_stage = bn * (HEAD_DIM // 2 + 4 + 4) + (bn * HEAD_DIM * 2 if config["dequant"] in ("shared", "lut", "bits", "prmt") else 0)
    tables = {"lut": 1024, "prmt_rs": 4096, "prmt_rs2": 4096}.get(config["dequant"], 0)  # lut: byte -> bf16x2; prmt_rs(2): tables
    need = HEADS * HEAD_DIM * 2 + HEADS * 4 + max(1, config["stages"]) * per_stage + tables
    if need > arch.smem_per_block:
        return f"shared memory {need // 1024} KiB > {arch.smem_per_block // 1024} KiB"
    ctas = config.get("min_ctas", 0)
    if ctas > 1:
        if config["dequant"] in ("bits", "prmt"):
            # Compiled sizes: the warp-specialised lowering multi-buffers only what the producer writes; the
            # consumer-written bf16 tile is single (bits, block_n 128: 59392 B at 2 stages; prmt: 76800 B at 4).
            need = HEADS * HEAD_DIM * 2 + 128 + max(1, config["stages"]) * bn * (HEAD_DIM // 2 + 8) + bn * HEAD_DIM * 2
        if ctas * (need + 1024) > arch.smem_per_sm:  # + the 1 KiB the runtime reserves per CTA
            return f"min_ctas={ctas} x shared memory {need // 1024} KiB > {arch.smem_per_sm // 1024} KiB per SM"
    return None


def _register_cap(config: Config, shape: Shape, arch: Arch) -> str | None:
    """min_ctas CTAs of (consumers + TileLang's producer: 2 x threads) threads must leave ptxas enough registers.

    ptxas caps a thread at 64K / (min_ctas x threads), rounded down to a multiple of 8; the score kernel's wgmma
    and its dequant need about 48 (min_ctas 3 at 256 consumer threads, a cap of 40, fails to assemble:
    "Insufficient registers (40) to compile instruction").
    """
    config = {**_SCORE_DEFAULT, **config}
    ctas = config.get("min_ctas", 0)
    if ctas <= 1:
        return None
    cap = (arch.registers_per_sm // (ctas * 2 * config["threads"])) // 8 * 8
    return None if cap >= 48 else f"min_ctas={ctas} x {2 * config['threads']} threads leaves {cap} registers per thread (< 48)"


def _fragment_rows(config: Config, shape: Shape, arch: Arch) -> str | None:
    """The register-fragment paths (wgmma RS) need exactly one 64-row wgmma tile per warpgroup when there are two.

    With block_n 256 and two warpgroups TileLang gives the A fragment (k_deq) to each warpgroup as rows
    {wg*64 + i*128} (its m-tiles interleaved across warpgroups: the generated dequant reads kw_s rows
    ``((i_1 & 7) >> 2) * 128 + warp * 16``) while the accumulator and the output store use rows
    {wg*128 + i*64} (``(threadIdx.x >> 7) * 128 + (i_5 >> 1) * 64``): a warpgroup multiplies K rows of the other
    warpgroup into its own score rows. That is the 0.92 relative error the H200 showed for
    {"dequant": "fragment_bits", "block_n": 256, "stages": 4, "tiles_per_cta": 4}. One warpgroup, or one m-tile each, has
    no such mismatch.
    """
    config = {**_SCORE_DEFAULT, **config}
    wgs = config["threads"] // 128
    if config["dequant"] in ("registers", "fragment_bits", *RS_DEQUANTS) and wgs > 1 and config["block_n"] // wgs > 64:
        return f"dequant={config['dequant']} with {wgs} warpgroups needs block_n = {64 * wgs} (one 64-row wgmma tile each), got {config['block_n']}"
    return None


def _rs_registers(config: Config, shape: Shape, arch: Arch) -> str | None:
    """dequant="prmt_rs" / "fma_rs" under min_ctas: the consumers' setmaxnreg share must hold the A fragment and accumulator.

    A consumer thread holds 32 A + 16 accumulator registers per 64-row m-tile of its warpgroup, plus ~32 of
    addresses and tables (ptxas, sm_90a: 74 registers for one m-tile, 122 for two, with no cap). Below that ptxas
    spills and serialises the wgmmas (C7512), e.g. 128 threads, block_n 128, min_ctas 4 (104 registers).
    """
    config = {**_SCORE_DEFAULT, **config}
    if config["dequant"] not in REGISTER_A_DEQUANTS or config.get("min_ctas", 0) <= 1:
        return None
    mtiles = max(1, config["block_n"] // (config["threads"] // 128) // 64)
    # fp8_rs: 16 A + 64 accumulator registers an m-tile (four groups), all live while the four wgmmas are in flight;
    # at one m-tile and min_ctas 4 (104 registers) ptxas serialised them (C7512)
    need = 32 + (80 if config["dequant"] == "fp8_rs" else 48) * mtiles
    have = _rs_register_split(config["threads"], config["min_ctas"])[1]
    if have >= need:
        return None
    return f"{config['dequant']}: {mtiles} m-tiles per warpgroup need ~{need} registers, min_ctas={config['min_ctas']} leaves {have}"


def _epilogue_fits(config: Config, shape: Shape | None, arch: Arch) -> str | None:
    """epilogue="hoisted" / "fused" are built for the RS dequants only (their weights and store live in the consumer
    registers); "fused" also for one consumer warpgroup only (its hand-written epilogue reads the wgmma accumulator
    layout of one warpgroup: threads 128)."""
    config = {**_SCORE_DEFAULT, **config}
    epilogue = config.get("epilogue", "per_tile")
    if epilogue != "per_tile" and config["dequant"] not in REGISTER_A_DEQUANTS:
        return f"epilogue={epilogue} needs dequant in {list(REGISTER_A_DEQUANTS)}, got {config['dequant']}"
    if epilogue == "fused" and config["threads"] != 128:
        return f"epilogue=fused needs one consumer warpgroup (threads 128), got threads={config['threads']}"
    if config["dequant"] == "fp8_rs" and (epilogue != "fused" or config["block_n"] > FP8_MAX_BLOCK_N):
        return f"dequant=fp8_rs is built with epilogue=fused and block_n <= {FP8_MAX_BLOCK_N} (four accumulators a thread)"
    return None


def _dequant_arch(config: Config, shape: Shape, arch: Arch) -> str | None:
    """dequant="prmt_rs2" and "fp8_rs" are built for sm_90a only; the kernel builder refuses other targets."""
    config = {**_SCORE_DEFAULT, **config}
    if config["dequant"] in HOPPER_ONLY_DEQUANTS and arch.family != "hopper":
        return f"dequant={config['dequant']} is built for Hopper (sm_90a) only, got {arch.family}"
    return None


def _warps_fit(config: Config, shape: Shape, arch: Arch) -> str | None:
    config = {**_SCORE_DEFAULT, **config}
    # FullRow splits the entry tile across warpgroups: each needs at least 64 rows for wgmma.
    rows = config["block_n"] // (config["threads"] // 128)
    return None if rows >= 64 else f"block_n={config['block_n']} gives {rows} rows per warpgroup (< 64)"


def _score_params() -> tuple[Param, ...]:
    return (
        Param("block_n", (64, 128, 256), "entries per MMA tile (the wgmma M side)"),
        Param("threads", (128, 256), "consumer threads (one or two warpgroups; the TMA producer is added by TileLang)"),
        Param("stages", (1, 2, 3, 4), "software-pipeline depth of the packed-K loads"),
        Param(
            "tiles_per_cta",
            ("auto", *TILES_PER_CTA),
            "entry tiles per CTA: how finely N is split across CTAs (auto: the most that still fill the SMs, see resolve_tiles_per_cta)",
        ),
        Param(
            "min_ctas",
            (0, 2, 3, 4),
            "CTAs per SM the compiler must fit (__launch_bounds__ second argument: registers capped at 64K / (ctas x "
            "threads incl. the producer)); 0 = TileLang's own bound (1)",
        ),
        Param(
            "dequant",
            ("shared", "registers", "lut", "bits", "fragment_bits", "prmt", "prmt_rs", "fma_rs", "prmt_rs2", "fp8_rs"),
            "FP4 -> bf16 by arithmetic into a shared tile (wgmma SS) or into the A fragment (wgmma RS), "
            "by a 256-entry byte -> bf16x2 table into a shared tile, (bits) one thread per packed word "
            "building the scaled bf16 bit patterns by integer arithmetic into a shared tile, or (fragment_bits) "
            "those bit patterns per value into the A fragment (no bf16 tile: deeper pipelines fit), or (prmt) the bits "
            "path's patterns by byte-permute table lookups, one thread per 32-value scale group (~2 integer "
            "instructions per value instead of ~12: the integer pipe is the bits kernel's limit), or (prmt_rs) the prmt "
            "lookups straight into the A fragment (wgmma RS: no bf16 tile, no per-tile barrier; K and q in a permuted dim "
            "order so each thread dequantises whole scale groups; setmaxnreg moves the producer's registers to the "
            "consumers under min_ctas), or (fma_rs) prmt_rs's A fragment with half the integer work on the FMA pipe: "
            "nibble bits placed at bf16 positions by an integer multiply (code x 2^-126) and the E8M0 scale applied by "
            "two packed bf16 multiplies (~1 integer instruction per value instead of ~1.9, no table), or (prmt_rs2, "
            "sm_90a only) prmt_rs's A registers bit for bit with the high-half selectors on the FMA pipe (IMAD.HI) and the "
            "scale byte by one byte permute (13 instead of 14 ALU-pipe instructions per packed word), or (fp8_rs, sm_90a "
            "only, fused epilogue, block_n <= 128) no bf16 at all: the E2M1 codes shifted into E4M3 bytes (7 integer "
            "instructions per packed word) for one FP8 wgmma per scale group, q in E4M3 with a power-of-two factor per "
            "head, the four group sums scaled by their E8M0 scales on the FMA pipe (right on the H200, and slower than "
            "prmt_rs there)",
        ),
        Param(
            "epilogue",
            EPILOGUES,
            "RS dequants only: (per_tile) every tile reloads the weights from shared memory, halves them and rebuilds "
            "the int64 output index of each store; (hoisted) w / 2 in registers and the CTA's output-row pointer built "
            "once per CTA (the same products and sums, bitwise: code motion only); (fused, one consumer warpgroup) hoisted plus "
            "the ReLU-weighted head sum as one FFMA chain per row, the quad sum as a reduce-scatter and each quad lane "
            "storing its own rows (hand-written on the wgmma accumulator registers)",
        ),
    )


_SELECT_ALGO = Param(
    "select_algo",
    ("multipass", "two_pass"),
    "top-k select: radix passes over the row in global memory (select_threads, radix_bits, select_split), or "
    "tiles.radix_select (one histogram and one compaction pass over the row, the rest in shared memory)",
)


def _build_two_pass(arch: Arch, rows: int, n: int, k: int, radix: Config | None = None) -> dict[str, Any]:
    """Compile tiles.radix_select's kernels for ``rows`` rows of ``n`` scores, top ``k`` (``radix``: a
    radix_select config, its default when None): the select, and the merge of its parts when there are several."""
    cfg = radix_select.check_config(radix or {}, k)
    parts = radix_select.resolve_parts(cfg["parts"], rows, n, k, arch)
    first, merge = radix_select.build_kernels(arch, k, parts, rows, cfg)
    return {"select": first} if merge is None else {"select": first, "merge": merge}


# The two-pass select's knobs in the indexer's space: the structural ones that matter when few rows are long (B=1
# decode: 8 CTAs on the whole GPU at radix_select's default; its row staged in shared memory at 512 threads ran one
# 128K row 25.4 -> 21.0 us on the H200, select_check_run3_staged.json). Defaults are radix_select.DEFAULT_CONFIG's.
_RADIX_PARAMS = (
    Param("radix_threads", radix_select.PARAMS["threads"], "two_pass select: threads per CTA (tiles.radix_select)"),
    Param(
        "radix_stage",
        radix_select.STAGES,
        "two_pass select: its passes read each row part from global memory (L2) or from a copy in shared memory",
    ),
    Param("radix_parts", ("auto", 8, 16, 32), "two_pass select: row parts selected apart before their merge"),
)
_RADIX_DEFAULT = {
    "radix_threads": radix_select.DEFAULT_CONFIG["threads"],
    "radix_stage": radix_select.DEFAULT_CONFIG["stage"],
    "radix_parts": radix_select.DEFAULT_CONFIG["parts"],
}


def radix_config(cfg: Config) -> Config:
    """The tiles.radix_select config of an indexer config (its ``radix_*`` keys; absent keys: radix_select's defaults)."""
    return {name.removeprefix("radix_"): cfg.get(name, default) for name, default in _RADIX_DEFAULT.items()}


def _radix_two_pass_only(config: Config, shape: Shape, arch: Arch) -> str | None:
    """The radix_* knobs configure select_algo="two_pass" only: other values under multipass would repeat a config."""
    if config.get("select_algo", "multipass") == "two_pass":
        return None
    moved = sorted(name for name, default in _RADIX_DEFAULT.items() if config.get(name, default) != default)
    return f"{', '.join(moved)} apply to select_algo=two_pass only" if moved else None


def _radix_smem(config: Config, shape: Shape, arch: Arch) -> str | None:
    """The two-pass select's shared memory must fit the arch (a staged part needs 104 KiB: not on sm86/89/120)."""
    if config.get("select_algo", "multipass") != "two_pass":
        return None
    need = radix_select.smem_bytes(radix_config(config))
    return (
        f"the select needs {need // 1024} KiB of shared memory > {arch.smem_per_block // 1024} KiB" if need > arch.smem_per_block else None
    )


def _select_params() -> tuple[Param, ...]:
    return (
        Param("select_threads", (512, 1024), "threads of the one-CTA-per-row radix select"),
        Param("radix_bits", (8, 11), "bits per radix pass: 4 passes of 8 or 3 of 11 (2048 bins)"),
    )


_SCORE_DEFAULT = {
    "block_n": 128,
    "threads": 256,
    "stages": 2,
    "tiles_per_cta": 4,
    "dequant": "shared",
    "min_ctas": 0,
    "epilogue": "per_tile",
}
_SELECT_DEFAULT = {"select_threads": 1024, "radix_bits": 8}
# Hopper: word-wise integer dequant (no per-value float chain, one barrier per tile), two
# consumer warpgroups so 8 warps share the dequant of a 128-entry tile, and 16 tiles (2048
# entries) per CTA so the 8 KiB query load and the pipeline prologue are paid once per 2048
# entries, not per 512. On the H200 its score kernel ran 0.84 ms at decode B=64 x 128K against 2.52 ms
# for the first default (`shared`), level with `lut` (notes/indexer.md, session 2).
_SCORE_DEFAULT_SM90 = {
    "block_n": 128,
    "threads": 256,
    "stages": 2,
    "tiles_per_cta": 16,
    "dequant": "bits",
    "min_ctas": 0,
    "epilogue": "per_tile",
}


class _ScoreAndSelectTile(Tile):
    """What the two score-then-select tiles share: one search space and one default."""

    def search_space(self, arch: Arch) -> SearchSpace:
        return SearchSpace(
            _score_params() + _select_params(),
            (
                Constraint("smem", _smem_score),
                Constraint("warpgroups", _warps_fit),
                Constraint("fragment_rows", _fragment_rows),
                Constraint("register_cap", _register_cap),
                Constraint("rs_registers", _rs_registers),
                Constraint("epilogue", _epilogue_fits),
                Constraint("dequant_arch", _dequant_arch),
            ),
        )

    def default_config(self, arch: Arch) -> Config:
        if arch.family == "hopper":
            return {**_SCORE_DEFAULT_SM90, **_SELECT_DEFAULT}
        return {**_SCORE_DEFAULT, **_SELECT_DEFAULT}

    def with_defaults(self, arch: Arch, config: Config) -> Config:
        """``config`` over the default. A config that picks a dequant other than the RS ones without naming
        ``epilogue`` gets ``per_tile`` (``hoisted`` and ``fused`` are built for the RS dequants only): {"dequant": "shared"}
        alone is valid on every arch; one that picks two consumer warpgroups gets ``hoisted``; {"dequant": "fp8_rs"}
        without a ``block_n`` gets at most FP8_MAX_BLOCK_N."""
        cfg = {**self.default_config(arch), **config}
        if cfg["dequant"] == "fp8_rs" and "block_n" not in config:
            cfg["block_n"] = min(cfg["block_n"], FP8_MAX_BLOCK_N)
        if "epilogue" not in config and cfg["dequant"] not in REGISTER_A_DEQUANTS:
            cfg["epilogue"] = "per_tile"
        elif "epilogue" not in config and cfg["epilogue"] == "fused" and _epilogue_fits(cfg, None, arch):
            cfg["epilogue"] = "hoisted"  # fused reads one warpgroup's accumulator layout: {"threads": 256} alone is valid
        return cfg


class IndexerTopkTile(_ScoreAndSelectTile):
    """Scores over the packed FP4 index K + top-k (two kernels: score rows, then radix select)."""

    name = "indexer_topk"
    description = "indexer scores over packed FP4 index K (bf16 wgmma after in-kernel dequant) + radix top-k sorted by position"

    def shapes(self) -> list[Shape]:
        return indexer_shapes()

    def search_space(self, arch: Arch) -> SearchSpace:
        space = super().search_space(arch)
        split = Param(
            "select_split", ("auto", *SELECT_SPLITS), "score rows cut into parts: a top-k per part (more CTAs), then of the candidates"
        )
        hidden = Param(
            "hidden_tiles",
            HIDDEN_TILES,
            "entry tiles past the token's visible count: scored and masked (score), or left out of the CTA's tile loop "
            "and written -inf (skip; a prefill token sees the cache up to itself)",
        )
        return SearchSpace(
            space.params + (hidden, split, _SELECT_ALGO) + _RADIX_PARAMS,
            space.constraints + (Constraint("radix_two_pass_only", _radix_two_pass_only), Constraint("radix_smem", _radix_smem)),
        )

    def default_config(self, arch: Arch) -> Config:
        # auto: as many parts as fill the SMs twice (8 for decode B=64, 1 for prefill), from the H200 profile
        cfg = {
            **super().default_config(arch),
            "hidden_tiles": "score",
            "select_split": "auto",
            "select_algo": "multipass",
            **_RADIX_DEFAULT,
        }
        if arch.family == "hopper":
            # H200, one run (results/sm90/profile_indexer_prmt_two_pass.json): byte-permute dequant, two CTAs per SM
            # and the two-pass select: decode B=64 x 128K 1.318 -> 0.530 ms per call, prefill 4K 2.253 -> 1.012 ms.
            # (prmt at 128 threads with min_ctas 3 ran decode at 0.468 ms but was not run at prefill: a tuning choice.)
            cfg.update(dequant="prmt", min_ctas=2, select_algo="two_pass")
            # Then the prmt decode straight into wgmma's A registers (results/sm90/
            # profile_compressor_multi_cta_indexer_prmt_rs.json, same run as prmt): decode B=64 x 128K 0.527 -> 0.376 ms
            # per call, prefill 4K 1.005 -> 0.712 ms.
            cfg.update(dequant="prmt_rs")
            # The per-CTA constants of the tile loop's epilogue (head weights, store pointer) held in registers
            # (results/sm90/profile_queued_session6.json, same run as per_tile): decode B=64 x 128K 0.378 -> 0.354 ms per
            # call, prefill 4K 0.715 -> 0.663 ms. (With stages 4 decode ran 0.348 ms; not run at prefill: a tuning choice.)
            cfg.update(epilogue="hoisted")
            # 256-entry tiles on one consumer warpgroup, one stage: the per-tile fixed work (barriers, wgmma issue and
            # wait, the epilogue) spread over twice the entries (results/sm90/profile_queued_session7.json, same run
            # as the previous default): decode B=64 x 128K 0.353 -> 0.309 ms per call; prefill 4K 0.663 -> 0.586 ms
            # in session 6's tuning run (results/sm90/indexer_topk.yaml).
            cfg.update(block_n=256, threads=128, stages=1)
            # The consumer's epilogue written by hand: FMA head sum, transposed 4-lane reduction, every lane stores its
            # rows (results/sm90/profile_queued_session8.json, same run as hoisted): decode B=64 x 128K 0.3092 -> 0.2950
            # ms per call, prefill 4K 0.5851 -> 0.5583 ms.
            cfg.update(epilogue="fused")
            # 16 tiles per CTA left one sequence's 128K entries 32 CTAs: the grid sized to the SMs instead
            # (results/sm90/profile_indexer_b1_tiles_session12.json, same run): decode B=1 x 128K 0.0291 -> 0.0149 ms per
            # call; B=64 and prefill resolve to 16 tiles, the kernels they ran before.
            cfg.update(tiles_per_cta="auto")
            # The tile loop ends at the last tile holding an entry the token sees (results/sm90/
            # score_hidden_tiles_session17.json and bench/bench_indexer_topk{,_hidden_skip}.json, same run): prefill 4K
            # score kernel 471.0 -> 260.5 us, 0.5541 -> 0.3442 ms per call; decode B=64 x 128K 0.2943 -> 0.2878 ms; B=1
            # 0.0255 -> 0.0254 ms.
            cfg.update(hidden_tiles="skip")
        return cfg

    def candidates(self, arch: Arch, shape: Shape) -> list[tuple[Config, str]]:
        """Hopper: the previous default's 128-entry tiles on two consumer warpgroups with four stages
        (results/sm90/profile_queued_session6.json: decode B=64 x 128K 0.348 ms, against 0.309 ms for today's default
        in session 7's run; not run at prefill)."""
        if arch.family != "hopper":
            return []
        return [
            ({"block_n": 128, "threads": 256, "stages": 4}, "decode B=64 x 128K 0.348 ms (H200, session 6)"),
            # the random sampler rarely meets the staged select with the default score kernel (one trial in 153 in session
            # 13's B=1 study); gpu/select_check.py timed it alone on one 128K row: 25.4 -> 21.0 us
            (
                {"radix_stage": "shared", "radix_threads": 512},
                "one 128K row's select 21.0 us vs 25.4 (H200, select_check_run3_staged.json)",
            ),
        ]

    def kernel_key(self, shape: Shape, config: Config, arch: Arch) -> str:
        """The config with ``tiles_per_cta`` resolved as the score launch resolves it; under the two-pass select without
        the multipass select's keys (its launch reads only the ``radix_*`` ones, whose "auto" knobs stay as named: a
        conservative key), under the multipass one with ``select_split`` resolved as its launch resolves it."""
        cfg = self.with_defaults(arch, config)
        rows, n = shape["B"] * shape["S"], shape["N"]
        cfg["tiles_per_cta"] = resolve_tiles_per_cta(cfg["tiles_per_cta"], rows, n, cfg["block_n"], arch)
        if cfg.get("select_algo", "multipass") == "two_pass":
            for multipass_only in ("select_threads", "radix_bits", "select_split"):
                cfg.pop(multipass_only, None)
        else:
            cfg["select_split"] = resolve_select_split(cfg.get("select_split", 1), rows, n, shape["K"], arch)
        return canonical_key(cfg)

    def _kernels(self, shape: Shape, cfg: Config, arch: Arch) -> dict[str, Any]:
        """The kernels one call launches, by name, compiled (or fetched from their caches) for the full ``cfg``."""
        kernels = {"score": _build_score(arch, cfg, False, 8, shape["B"] * shape["S"], shape["N"])}
        if cfg.get("select_algo", "multipass") == "two_pass":
            kernels.update(_build_two_pass(arch, shape["B"] * shape["S"], shape["N"], shape["K"], radix_config(cfg)))
        else:
            kernels["select"] = _select_kernel(arch.nvcc_arch, shape["K"], cfg["select_threads"], cfg["radix_bits"], 0)
        return kernels

    def build(self, shape: Shape, config: Config, arch: Arch):
        cfg = self.with_defaults(arch, config)
        self._kernels(shape, cfg, arch)
        return (cfg, arch, shape["K"])

    def kernel_sources(self, shape: Shape, config: Config, arch: Arch) -> dict[str, str]:
        return kernel_sources_of(self._kernels(shape, self.with_defaults(arch, config), arch))

    def make_inputs(self, shape: Shape, seed: int, device="cuda") -> Inputs:
        return _indexer_inputs(shape["B"], shape["S"], shape["N"], seed, device, causal=shape.phase == "prefill")

    def alloc_outputs(self, kernel, inputs: Inputs) -> dict[str, torch.Tensor]:
        _, _, k = kernel
        q = inputs["q"]
        B, S = q.shape[:2]
        N = inputs["k_packed"].shape[1]
        scores = poisoned((B, S, N), torch.float32, q.device)  # [B, S, N]
        out = poisoned((B, S, k), torch.int32, q.device)  # [B, S, K]
        return {"topk": out, "scores": scores}

    def launch(self, kernel, inputs: Inputs, outputs: dict[str, torch.Tensor]) -> None:
        cfg, arch, _ = kernel
        words, scales = _index_k_words(inputs["k_packed"], inputs["k_scales"])
        _launch_topk(cfg, arch, inputs["q"], inputs["weights"], words, scales, inputs["n_visible"], outputs["scores"], outputs["topk"])

    def reference(self, inputs: Inputs) -> dict[str, torch.Tensor]:
        scores = _reference_scores(inputs)
        return {"topk": topk_positions(scores, flash().index_topk), "scores": scores}

    def compare(self, outputs, expected) -> Comparison:
        sc = relative_l2({"scores": outputs["scores"]}, {"scores": expected["scores"]}, SCORE_RTOL)
        return _merge(sc, compare_topk_sets(outputs["topk"], expected["topk"], expected["scores"]))

    def flops(self, shape: Shape) -> float:
        B, S, N = shape["B"], shape["S"], shape["N"]
        return 2.0 * B * S * N * HEADS * HEAD_DIM

    def bytes_moved(self, shape: Shape) -> float:
        # The floor: the packed index K read once per batch row (68 B per entry), plus queries,
        # weights and the top-k written. Score rows the select kernel re-reads are not counted.
        B, S, N, K = shape["B"], shape["S"], shape["N"], shape["K"]
        return B * N * (HEAD_DIM // 2 + HEAD_DIM // GROUP) + B * S * (HEADS * HEAD_DIM * 2 + HEADS * 4 + K * 4)


class CandidatePoolTile(Tile):
    """Candidate pool of layer 20: block max over 8 positions + radix select of the best 2048 blocks."""

    name = "candidate_pool"
    description = "block max over 8 positions (newest block forced) + radix select of the best min(2048, n_blocks) blocks"

    def shapes(self) -> list[Shape]:
        return reindex_shapes()

    def search_space(self, arch: Arch) -> SearchSpace:
        return SearchSpace((Param("block_threads", (128, 256, 512), "threads of the block-max pass"),) + _select_params() + (_SELECT_ALGO,))

    def default_config(self, arch: Arch) -> Config:
        # Hopper: the two-pass select, H200, one run (results/sm90/profile_pool_reindex_compressor_run1.json):
        # decode B=64 x 128K 0.121 -> 0.034 ms per call, pools bit-exact. Elsewhere not measured: multipass.
        algo = "two_pass" if arch.family == "hopper" else "multipass"
        return {"block_threads": 256, **_SELECT_DEFAULT, "select_algo": algo}

    def _kernels(self, shape: Shape, cfg: Config, arch: Arch) -> dict[str, Any]:
        """The kernels one call launches, by name, compiled (or fetched from their caches) for the full ``cfg``."""
        nb = -(-shape["N"] // shape["block"])
        k = min(shape["P"], nb)
        kernels = {"block_max": _block_max_kernel(arch.nvcc_arch, shape["block"], cfg["block_threads"])}
        if cfg["select_algo"] == "two_pass":
            kernels.update(_build_two_pass(arch, shape["B"] * shape["S"], nb, k))
        else:
            kernels["select"] = _select_kernel(arch.nvcc_arch, k, cfg["select_threads"], cfg["radix_bits"], 0)
        return kernels

    def build(self, shape: Shape, config: Config, arch: Arch):
        cfg = self.with_defaults(arch, config)
        self._kernels(shape, cfg, arch)
        return (cfg, arch, shape["block"], shape["P"])

    def kernel_sources(self, shape: Shape, config: Config, arch: Arch) -> dict[str, str]:
        return kernel_sources_of(self._kernels(shape, self.with_defaults(arch, config), arch))

    def make_inputs(self, shape: Shape, seed: int, device="cuda") -> Inputs:
        B, S, N = shape["B"], shape["S"], shape["N"]
        gen = torch.Generator(device=device).manual_seed(seed)
        # Scores on a coarse grid so many blocks tie: the tie rule is exercised on every row.
        scores = torch.randint(-400, 400, (B, S, N), generator=gen, device=device).float() / 64  # [B, S, N]
        n_visible = N - torch.randint(0, max(1, N // 4), (B, S), generator=gen, device=device)
        if B * S > 2:  # a short row among many (a single row, as at decode B=1, sees the cache: see _indexer_inputs)
            n_visible.view(-1)[0] = min(N, 13)
        scores.masked_fill_(torch.arange(N, device=device) >= n_visible.unsqueeze(-1), NEG_INF)
        return {"scores": scores, "n_visible": n_visible.to(torch.int32)}

    def alloc_outputs(self, kernel, inputs: Inputs) -> dict[str, torch.Tensor]:
        _, _, block, max_blocks = kernel
        B, S, N = inputs["scores"].shape
        nb = -(-N // block)
        block_scores = poisoned((B * S, nb), torch.float32, inputs["scores"].device)  # [B*S, nb]: the block-max pass's output
        out = poisoned((B, S, min(max_blocks, nb)), torch.int32, inputs["scores"].device)  # [B, S, P]
        return {"pool": out, "block_scores": block_scores}

    def launch(self, kernel, inputs: Inputs, outputs: dict[str, torch.Tensor]) -> None:
        cfg, arch, block, _ = kernel
        scores = inputs["scores"]
        B, S, N = scores.shape
        nvis = inputs["n_visible"].view(B * S)
        _launch_pool(cfg, arch, scores.view(B * S, N), nvis, block, outputs["block_scores"], outputs["pool"])

    def reference(self, inputs: Inputs) -> dict[str, torch.Tensor]:
        return {"pool": candidate_blocks(inputs["scores"], inputs["n_visible"], flash().pool_block, flash().pool_max_blocks)}

    def compare(self, outputs, expected) -> Comparison:
        from tiles.compare import bit_exact

        return bit_exact(outputs, expected)

    def bytes_moved(self, shape: Shape) -> float:
        B, S, N = shape["B"], shape["S"], shape["N"]
        return B * S * (N * 4 + min(shape["P"], -(-N // shape["block"])) * 4)


def _random_pool(n_visible: torch.Tensor, N: int, P: int, block: int, gen: torch.Generator) -> torch.Tensor:
    """Random candidate pools: the newest visible block plus random others, ascending, -1 fill."""
    B, S = n_visible.shape
    nb = -(-N // block)
    keys = torch.rand(B, S, nb, generator=gen, device=n_visible.device)  # [B, S, nb]
    ids = torch.arange(nb, device=n_visible.device)
    vis_blocks = (n_visible.long() + block - 1) // block
    keys = torch.where(ids < vis_blocks.unsqueeze(-1), keys, torch.full_like(keys, -1.0))
    keys = torch.where(ids == (vis_blocks - 1).unsqueeze(-1), torch.full_like(keys, 2.0), keys)
    take = min(P, nb)
    top = keys.topk(take, dim=-1)
    chosen = torch.where(top.values >= 0, top.indices, torch.full_like(top.indices, nb))
    chosen = chosen.sort(-1).values
    chosen = torch.where(chosen == nb, torch.full_like(chosen, -1), chosen).to(torch.int32)
    if take < P:
        chosen = torch.cat([chosen, chosen.new_full((B, S, P - take), -1)], dim=-1)
    return chosen


class ReindexTopkTile(_ScoreAndSelectTile):
    """Reindex: gather the pool's 8-entry blocks, score them, top-k, map back to positions."""

    name = "reindex_topk"
    description = "scores of the candidate pool only (gathered FP4 index K, bf16 wgmma) + radix top-k mapped back to positions"

    def shapes(self) -> list[Shape]:
        return reindex_shapes()

    def search_space(self, arch: Arch) -> SearchSpace:
        space = super().search_space(arch)
        return SearchSpace(space.params + (_SELECT_ALGO,), space.constraints)

    def default_config(self, arch: Arch) -> Config:
        # Hopper: the two-pass select, H200, one run (results/sm90/profile_pool_reindex_compressor_run1.json):
        # decode B=64 x 16K candidates 0.239 -> 0.163 ms per call (slot -> position map included), top-k sets exact;
        # then the indexer's byte-permute dequant at two CTAs per SM (results/sm90/profile_attn_decode_reindex_prmt.json):
        # score kernel 134.6 -> 78.5 us, 0.163 -> 0.107 ms per call. Elsewhere not measured: multipass, bits.
        if arch.family != "hopper":
            return {**super().default_config(arch), "select_algo": "multipass"}
        # tiles_per_cta="auto" (resolve_tiles_per_cta): 16 at B=64 (the kernel it ran before), 1 at one sequence, whose
        # 16K candidates in 16-tile CTAs left 8 CTAs on the GPU. lab tune (reindex_topk.yaml, session 17, 20:04Z): the
        # B=1 winner, one tile per CTA, 16.1 us against the 16-tile default's 47.8.
        return {**super().default_config(arch), "select_algo": "two_pass", "dequant": "prmt", "min_ctas": 2, "tiles_per_cta": "auto"}

    def _kernels(self, shape: Shape, cfg: Config, arch: Arch) -> dict[str, Any]:
        """The kernels one call launches, by name, compiled (or fetched from their caches) for the full ``cfg``."""
        blk = shape["block"]
        kernels = {"score": _build_score(arch, cfg, True, blk, shape["B"] * shape["S"], shape["P"] * blk)}
        if cfg["select_algo"] == "two_pass":
            kernels["select"] = radix_select.remapped_kernel(arch, shape["K"], shape["B"] * shape["S"], block=blk)
        else:
            kernels["select"] = _select_kernel(arch.nvcc_arch, shape["K"], cfg["select_threads"], cfg["radix_bits"], blk)
        return kernels

    def build(self, shape: Shape, config: Config, arch: Arch):
        cfg = self.with_defaults(arch, config)
        self._kernels(shape, cfg, arch)
        return (cfg, arch, shape["K"], shape["block"])

    def kernel_sources(self, shape: Shape, config: Config, arch: Arch) -> dict[str, str]:
        return kernel_sources_of(self._kernels(shape, self.with_defaults(arch, config), arch))

    def make_inputs(self, shape: Shape, seed: int, device="cuda") -> Inputs:
        B, S, N, P, blk = shape["B"], shape["S"], shape["N"], shape["P"], shape["block"]
        inputs = _indexer_inputs(B, S, N, seed, device, causal=False)
        gen = torch.Generator(device=device).manual_seed(seed + 7919)
        inputs["pool_blocks"] = _random_pool(inputs["n_visible"], N, P, blk, gen)  # [B, S, P]
        return inputs

    def alloc_outputs(self, kernel, inputs: Inputs) -> dict[str, torch.Tensor]:
        _, _, k, blk = kernel
        q, pool = inputs["q"], inputs["pool_blocks"]
        B, S, P = pool.shape
        scores = poisoned((B, S, P * blk), torch.float32, q.device)  # [B, S, P*block]
        out = poisoned((B, S, k), torch.int32, q.device)  # [B, S, K]
        return {"topk": out, "pool_scores": scores}

    def launch(self, kernel, inputs: Inputs, outputs: dict[str, torch.Tensor]) -> None:
        cfg, arch, _, blk = kernel
        words, scales = _index_k_words(inputs["k_packed"], inputs["k_scales"])
        args = (inputs["q"], inputs["weights"], words, scales, inputs["n_visible"], inputs["pool_blocks"], blk)
        _launch_reindex(cfg, arch, *args, outputs["pool_scores"], outputs["topk"])

    def reference(self, inputs: Inputs) -> dict[str, torch.Tensor]:
        scores = _reference_scores(inputs)  # [B, S, N]: the reference scores everything
        pool = inputs["pool_blocks"]
        B, S, P = pool.shape
        N = scores.shape[-1]
        blk = flash().pool_block
        if B * S * P * N <= 1 << 31:
            inside = pool_mask(pool, N, blk)
        else:  # the same mask by scatter: pool_mask's [B, S, P, N] intermediate would not fit
            slots = (pool.long().unsqueeze(-1) * blk + torch.arange(blk, device=pool.device)).flatten(-2)  # [B, S, P*blk]
            slots = torch.where((pool.long() >= 0).repeat_interleave(blk, -1) & (slots < N), slots, torch.full_like(slots, N))
            inside = torch.zeros(B, S, N + 1, dtype=torch.bool, device=pool.device).scatter_(-1, slots, True)[..., :N]
        masked = scores.masked_fill(~inside, NEG_INF)
        slots = (pool.long().clamp(min=0).unsqueeze(-1) * blk + torch.arange(blk, device=pool.device)).flatten(-2)  # [B, S, P*blk]
        pool_scores = masked.gather(-1, slots.clamp(max=N - 1))
        pool_scores = torch.where(
            (pool.long() >= 0).repeat_interleave(blk, -1) & (slots < N), pool_scores, torch.full_like(pool_scores, NEG_INF)
        )
        return {"topk": topk_positions(masked, flash().index_topk), "scores": masked, "pool_scores": pool_scores}

    def compare(self, outputs, expected) -> Comparison:
        sc = relative_l2({"pool_scores": outputs["pool_scores"]}, {"pool_scores": expected["pool_scores"]}, SCORE_RTOL)
        return _merge(sc, compare_topk_sets(outputs["topk"], expected["topk"], expected["scores"]))

    def flops(self, shape: Shape) -> float:
        return 2.0 * shape["B"] * shape["S"] * shape["P"] * shape["block"] * HEADS * HEAD_DIM

    def bytes_moved(self, shape: Shape) -> float:
        B, S, C, K = shape["B"], shape["S"], shape["P"] * shape["block"], shape["K"]
        return B * S * (C * (HEAD_DIM // 2 + HEAD_DIM // GROUP) + shape["P"] * 4 + HEADS * HEAD_DIM * 2 + K * 4)


INDEXER_TOPK = IndexerTopkTile()
CANDIDATE_POOL = CandidatePoolTile()
REINDEX_TOPK = ReindexTopkTile()
TILES = [INDEXER_TOPK, CANDIDATE_POOL, REINDEX_TOPK]
