"""The score kernel's FP4 dequantisation: E2M1/E8M0 words into bf16 in shared memory (bits, prmt), into the wgmma
A fragment in registers (prmt_rs, prmt_rs2, fma_rs), or into E4M3 per scale group (fp8_rs); TileLang macros and the
CUDA helpers they call."""

import tilelang.language as T

from tiles.fp4.kernel import PRMT_ASM_CUDA
from tiles.indexer.common import GROUP


def e2m1_bf16_bits(code):
    """bf16 bit pattern (uint32) of an E2M1 code 0..15 at unit scale: +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}."""
    mag = code & 7
    # mag >= 2: exponent 126 + (mag >> 1), mantissa bit 6 = mag & 1, i.e. (mag << 6) + (126 << 7); mag 1 is 0.5.
    bits = T.if_then_else(mag >= 2, (mag << 6) + (126 << 7), T.if_then_else(mag == 1, 126 << 7, 0))
    return T.Cast("uint32", bits | ((code & 8) << 12))


@T.macro
def dequant_words_bits(kw_s, ks_s, k_deq, block_n: int, W: int):
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
PRMT_CUDA = r"""
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
def dequant_groups_prmt(kw_s, ks_s, k_deq, block_n: int, W: int):
    """FP4 words -> scaled bf16 by byte permutes (``PRMT_CUDA``): one thread per scale group (4 words, 32 values)."""
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


PRMT_PAIR_CUDA = (
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
# Not cheaper, and why (sm_90a SASS and the bit algebra, notes/indexer.md): the 4 lookups + 4 interleaves are a
# floor for byte tables (the hi byte needs all 8 magnitude slots of a PRMT, so lo and hi cannot share one table); a
# lookup cannot carry the sign (bit 7 of a PRMT output is bit 7 of the selected byte in both selector modes) and a LOP3
# cannot move bits, so the 8 sign bits need a byte spread (the 2 gathers) and 2 merges; the selectors need the mask.
PRMT_PAIR2_CUDA = (
    PRMT_PAIR_CUDA
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
# acc = sum_g 2^(s_g - 127) acc_g (1 FMUL + 3 FFMA per element, on the FMA pipe). Why: the default score kernel timed
# with its FP4 dequant taken out (the wgmma reading the packed words as they are) put the dequant at 70 of the
# default's 250 us at decode B=64 (28%) and 181 of 466 us at prefill 4K (39%) on the H200 (efc6840), and the
# conversion's share of it is on the ALU pipe, which issues at half the FMA pipe's rate on Hopper.
# q: the index queries are FP4 fake-quantised (spec: E2M1 codes x an E8M0 scale per 32), so q x 2^k is exact in E4M3
# when the head's power-of-two factor 2^k puts its largest |q| in [128, 256) and its four group scales span <= 2^12
# (smaller groups would round in E4M3's subnormal range). 2^6 / 2^k (the K placement and this factor) folds into the
# head's weight: ReLU(c x) = c ReLU(x) for c > 0.
# Exactness of the sums: within one k32 wgmma all 32 products share one scale (one K group, one q group), each an
# exact multiple of 1/4 of it below 36, so a group sum needs 13 significant bits. On the H200 the scores met the
# reference (rel L2 1e-5, top-k sets by the tie rule) at every layout and shape the GPU tests tried.
# Measured on the H200 (1533b47): right, and slower than prmt_rs at every layout tried (decode B=64 x 128K
# 291-472 us against 249; prefill 4K 514-697 against 471). Four accumulators cap the tile at 128 entries, and each tile
# pays four wgmma groups and a 64-FFMA combine per m-tile: more than the conversion saves. Kept as a search-space
# option (the tuner may find a layout; other FP8-capable GPUs may differ), not a default.
# A fragment (TileLang's layout for an m64k32 8-bit operand, PTX's): each 32-bit register holds 4 consecutive columns
# of one row, columns 4t..4t + 3 or 16 + 4t..16 + 4t + 3, t = lane % 4. Column c of group g holds dim ``_fp8_dim(g, c)``:
# quad lane t takes packed word 4g + t of its rows, the even nibbles in the low 16 columns and the odd ones in the
# high 16.
FP8_CUDA = r"""
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
    columns 0..15, its odd ones in 16..31 (quad lane t's 4 columns 4t.. of each half are word 4g + t's; see FP8_CUDA)."""
    return 32 * g + 2 * (c % 16) + c // 16


@T.macro
def load_q_fp8(q, q8_s, q_fac, b, s, H: int, D: int):
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
def score_fp8_groups(kw_s, k8, q8_s, accs, block_n: int):
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
REGISTERS_PER_SM = 65536  # sm_80 .. sm_120 alike (tiles.core.arch registers_per_sm); the kernel builder sees only the target


def rs_register_split(threads: int, min_ctas: int) -> tuple[int, int]:
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
def load_q_rs(q, q_s, b, s, H: int, D: int):
    """q [B, S, H, D] bf16 -> q_s [H, D] with column c holding dim ``_rs_dim(c)``: the order prmt_rs gives K."""
    for h, c in T.Parallel(H, D):
        q_s[h, c] = q[b, s, h, _rs_dim(c)]


@T.macro
def build_rs_tables(tab):
    """tab uint32 [256, 4]: the prmt byte tables (lo0, lo1, hi0, hi1) of every scale byte, once per CTA."""
    for v, e in T.Parallel(256, 4):
        tab[v, e] = T.call_extern("uint32", "csa2_fp4_table_word", v, e)


@T.macro
def dequant_fragment_prmt(kw_s, ks_s, tab, k_deq, block_n: int, D: int):
    """Packed words ``kw_s`` int32 [block_n, D / 8] + scales ``ks_s`` int32 [block_n] -> A fragment ``k_deq`` bf16
    [block_n, D] in the ``_rs_dim`` column order (``tab``: ``build_rs_tables``).

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
def dequant_fragment_prmt2(kw_s, ks_s, tab, k_deq, block_n: int, D: int):
    """``dequant_fragment_prmt`` for dequant="prmt_rs2": the same A fragment (same columns, tables and words), the scale
    byte by ``csa2_scale_byte`` and the pair by ``csa2_fp4_pair2_bf16`` (``PRMT_PAIR2_CUDA``)."""
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
FMA_PAIR_CUDA = r"""
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
def load_q_rs_fma(q, q_s, b, s, H: int, D: int):
    """q [B, S, H, D] bf16 -> q_s [H, D] with column c holding dim ``_rs_fma_dim(c)``: the order fma_rs gives K."""
    for h, c in T.Parallel(H, D):
        q_s[h, c] = q[b, s, h, _rs_fma_dim(c)]


@T.macro
def dequant_fragment_fma(kw_s, ks_s, k_deq, block_n: int, D: int):
    """Packed words ``kw_s`` int32 [block_n, D / 8] + scales ``ks_s`` int32 [block_n] -> A fragment ``k_deq`` bf16
    [block_n, D] in the ``_rs_fma_dim`` column order (``FMA_PAIR_CUDA``; no table).

    As in ``dequant_fragment_prmt``, element (i, c) with c even writes the 32-bit pair (i, c), (i, c + 1), one wgmma A
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
