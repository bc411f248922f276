"""The compressor of Full layers on the GPU (spec section 2): one pass from the kv/gate
projections to both FP4 caches.

Per CTA, ``block_g`` groups: per-channel softmax pooling over the 2 tokens of a group
(ratio 1: the token itself), RMSNorm, RoPE on the last 64 dims at the group's first
position, FP4 (E4M3 per 16) into the main cache; then the index-K projection 512 -> 128 of
the same rotated latent, its RMSNorm and RoPE, FP4 (E8M0 per 32) into the index cache. The
latent never leaves the chip: memory traffic is the kv/gate read plus 356 B written per
entry. The Wkv/Wgate matmuls stay in cuBLAS (the inputs here are their fp32 outputs).

The index-K projection is fp32 in the reference. ``proj`` chooses how the kernel computes it:
``tf32x3`` splits both operands into a TF32 high part and an fp32 remainder and sums three
tensor-core products (hi*hi + hi*lo + lo*hi, error about 2^-20 relative), ``simt`` is plain
fp32 FMA from shared memory.

Comparison rule (honest about what is achieved): the fp32 latent and index key are computed
in a different summation order than torch (RMSNorm sum of squares, the 512-term projection),
so they equal the reference only to a few ulps; FP4 codes therefore match
:func:`model.formats.fp4_quantize` of the reference latent except where a value sits within
rounding of a code boundary. The check: dequantised caches within relative L2 1e-3 of the
reference caches (1e-2, which follows from the next bound), at most 1e-3 of the packed bytes
and of the scale bytes different, every differing scale byte one step off, and every differing
code one step off where its group's scale byte is equal (a scale one step off requantises its
group). Measured on the H200 (notes/indexer.md): at 64K tokens about 2e-7 of the main cache's
bytes differ with the reference's pooling expression (``pool_math="ieee"``: the RMSNorm's order),
about 5e-7 with Hopper's ``"fast"`` pooling and 4e-7 with it and ``norm_pass="in_pool"`` (Hopper's
default since session 10; ratio 1: no packed byte and 5e-7 of the scale bytes); the index cache
differs in about 1e-5 of its bytes with the ``tf32x3`` projection and was bit-exact with ``simt``
at 4K tokens.

Decode tail state (ratio 2): when a step brings the second token of a group, pass the stored
first token's projections as ``tail_kv`` / ``tail_gate`` [B, 512]; they are placed in front of
``kv``/``gate``. Complete groups are written; when the token count (tail included) is odd the
last token is not consumed and the caller stores ``kv[:, -1]``, ``gate[:, -1]`` as the next tail.
"""

import functools

import tilelang
import tilelang.language as T
import torch
import tvm
from tilelang.layout import make_linear_layout
from torch.utils.weak import WeakTensorKeyDictionary

from model import formats
from model.ops.compressor import compressor_entries, index_keys
from model.ops.rope import RopeConfig, rope_tables
from tiles.arch import Arch
from tiles.contract import Comparison, Config, Constraint, Inputs, Param, SearchSpace, Shape, Tile, TileError, poisoned
from tiles.indexer.api import _device_arch, _pick_config
from tiles.shapes import compressor_shapes, flash

D, DI, ROPE = 512, 128, 64  # latent dim, index-K dim, rope dims (the last 64 of each)
MAIN_GROUP, INDEX_GROUP = 16, 32
MAX_CODE_DIFF_FRACTION = 1e-3  # packed bytes / scale bytes that may differ (one code step each)
# Relative L2 of the dequantised caches: one-step differences in up to 1e-3 of the values give
# about sqrt(1e-3) * (step / rms value) ~ 1e-2, so the bound follows from the fraction above.
DEQ_RTOL = 1e-2


def _e2m1_code(v):
    """fp32 (already divided by the stored scale and clamped to [-6, 6]) -> E2M1 code 0..15, ties to even."""
    mag = T.abs(v)
    code = (
        T.Cast("int32", mag > 0.25)
        + T.Cast("int32", mag >= 0.75)
        + T.Cast("int32", mag > 1.25)
        + T.Cast("int32", mag >= 1.75)
        + T.Cast("int32", mag > 2.5)
        + T.Cast("int32", mag >= 3.5)
        + T.Cast("int32", mag > 5.0)
    )
    return code | T.if_then_else(v < 0, 8, 0)


# ``encode="thresholds"`` (division-free E2M1 codes, exactly the reference's): the midpoints m_k with the
# half-ulp h_k that decides fl(q) against m_k. fl(q) > m_k (even k, ties stay on the even code m_k) iff
# q > m_k + h_k (h_k half an ulp above m_k); fl(q) >= m_k (odd k) iff q >= m_k - h_k (half an ulp below;
# the odd-k midpoints are not powers of two). Both ends of each tie round to the even significand of m_k.
E2M1_BOUNDS = ((0.25, 2.0**-26), (0.75, 2.0**-25), (1.25, 2.0**-24), (1.75, 2.0**-24), (2.5, 2.0**-23), (3.5, 2.0**-23), (5.0, 2.0**-22))
ENCODES = ("divide", "thresholds")
WK_LOADS = ("hi_lo", "fp32")  # how the index-K weight reaches the SM (see _compress_kernel)
SCHEDULES = ("ws", "flat")  # producer warpgroup (one CTA per SM) or none (see _compress_kernel)
# kv (and gate): 16-channel slabs, ratio 1's block rows in one copy, or per-thread loads into the pooling (see _compress_kernel)
KV_LOADS = ("slabs", "whole", "direct")


def _bounds_cuda() -> str:
    """CUDA of ``encode="thresholds"`` for the main cache (E4M3 scale s, 2^-9 <= s <= 448): two codes per call.

    ``x / s`` passes midpoint k (reference: ``fl(x / s)`` > m_k for even k, >= m_k for odd k, see
    E2M1_BOUNDS) iff ``|x| > t_k = RD((m_k + h_k) s)`` (even k) or ``|x| >= t_k = RU((m_k - h_k) s)`` (odd k):
    ``m_k s`` (<= 7 significant bits) and ``h_k s`` (a power of two times s, >= 2^-35) are exact fp32, so one
    directed-rounding FMA gives the rounded bound, and a real strictly between two neighbouring floats
    compares with every float like the neighbour on the far side. ``x / s`` rounds to a nonzero negative value
    iff ``x < -t_neg``, ``t_neg = RD(s 2^-150)`` (``s 2^-126`` is exact, then one rounding). NaN passes
    nothing (code 0), +-Inf every bound (code 7): the reference's clamp changes no code. The passes are
    monotone in k, so a 3-level search (k = 3; 1 or 5; 0, 2, 4 or 6) finds the count.
    tests/test_compressor.py checks the bounds against the reference encode around every bound of every scale.
    """
    lines = []
    for k, (m, h) in enumerate(E2M1_BOUNDS):
        fn, sign = ("__fmaf_rd", "") if k % 2 == 0 else ("__fmaf_ru", "-")
        lines.append(f"  t[{k}] = {fn}(s, {m!r}f, s * {sign}{h.hex()}f);")
    body = "\n".join(lines)
    return (
        """
__device__ __forceinline__ unsigned csa2_e2m1_bounded(float x, const float* t, float t_neg) {
  const float a = fabsf(x);
  const bool ge4 = a >= t[3];
  const bool ge2 = a >= (ge4 ? t[5] : t[1]);
  const bool odd = a > (ge4 ? (ge2 ? t[6] : t[4]) : (ge2 ? t[2] : t[0]));
  return (ge4 ? 4u : 0u) | (ge2 ? 2u : 0u) | (odd ? 1u : 0u) | (x < -t_neg ? 8u : 0u);
}
// Values 2j and 2j + 1 of a group with E4M3 scale s -> their packed byte (2j in the low nibble).
__device__ __forceinline__ unsigned csa2_e2m1_pair_bounded(float x0, float x1, float s) {
  float t[7];
"""
        + body
        + """
  const float t_neg = __fmul_rd(s * 0x1p-126f, 0x1p-24f);
  return csa2_e2m1_bounded(x0, t, t_neg) | (csa2_e2m1_bounded(x1, t, t_neg) << 4);
}
"""
    )


def _e2m1_code_search(v):
    """fp32 ``v`` (already divided by its scale, unclamped) -> E2M1 code like :func:`_e2m1_code`, by the 3-level search.

    The clamp to [-6, 6] changes no code (|v| > 6 passes every midpoint either way, NaN none, the sign stays).
    """
    a = T.abs(v)
    ge4 = a >= 1.75
    ge2 = a >= T.if_then_else(ge4, T.float32(3.5), T.float32(0.75))
    odd = a > T.if_then_else(
        ge4, T.if_then_else(ge2, T.float32(5.0), T.float32(2.5)), T.if_then_else(ge2, T.float32(1.25), T.float32(0.25))
    )
    return T.if_then_else(ge4, 4, 0) | T.if_then_else(ge2, 2, 0) | T.if_then_else(odd, 1, 0) | T.if_then_else(v < 0, 8, 0)


POOL_MATHS = ("ieee", "fast")  # how the ratio-2 softmax over a group's two tokens is computed (see _pool_pair)
PROJ_K_SPLITS = (1, 2)  # register projection: each warp covers all 512 k, or half of them with twice the output columns
NORM_PASSES = ("separate", "in_pool")  # RMSNorm after the pooling from rot_s, or on the pooled rows in registers (kv_load=direct)
MAIN_PASSES = ("separate", "in_pool")  # RoPE + main cache as passes over rot_s, or from the rows in registers (norm_pass=in_pool)


def _pool_pair(x0, x1, kv0, kv1, pool_math: str):
    """Pooled latent of one channel of a ratio-2 group: softmax over the gates ``x0, x1`` weighting ``kv0, kv1``.

    "ieee": the reference's expression, ``e_t = exp(x_t - max)``, ``(e0 / tot) kv0 + (e1 / tot) kv1`` with two
    accurate expf (about ten SASS each: range reduction, MUFU.EX2, scaling) and two IEEE divisions.
    "fast": the larger gate's weight is ``1 / (1 + t)`` and the smaller's ``t / (1 + t)`` with ``t = exp(min - max)``
    (the larger gate's ``exp(0)`` is 1), by ``__expf`` (ex2.approx) and one approximate reciprocal: about 10 SASS a
    channel instead of about 45 (sm_90a: the pooling section of the Hopper default's loop 1115 -> 475 SASS lines). The
    latent is a few ulps from the reference's, which the comparison rule's one-code-step tolerance covers (a value must
    sit within a few ulps of a code boundary to change its code). A same-bits form with one accurate expf (exp(0) = 1
    skipped) saved only 6% of that section: the two IEEE divisions are most of it.
    """
    if pool_math == "ieee":
        m = T.max(x0, x1)
        e0, e1 = T.exp(x0 - m), T.exp(x1 - m)
        tot = e0 + e1
        return (e0 / tot) * kv0 + (e1 / tot) * kv1
    if pool_math == "fast":
        first_larger = x0 >= x1
        t = T.__exp(T.min(x0, x1) - T.max(x0, x1))
        inv = T.call_extern("float32", "__fdividef", T.float32(1.0), t + T.float32(1.0))
        w_small = t * inv
        return T.if_then_else(first_larger, inv, w_small) * kv0 + T.if_then_else(first_larger, w_small, inv) * kv1
    raise TileError(f"unknown pool_math {pool_math!r}: use one of {', '.join(POOL_MATHS)}")


# main_pass="in_pool" (with norm_pass="in_pool"): the main cache from the normalised rows while they are in registers.
# Lane l of warp w holds row w of the 8-row batch at columns 128 j + 4 l .. + 3 (j = 0..3: v[4 j ..], the annotated
# one-warp-per-row layout). It applies the RoPE to its pairs (lanes 16-31 at j = 3: columns 448 + 4 (l - 16) ..), stores
# the final latent into rot (the projection reads it), takes each 16-value group's |x| max over the group's four lanes
# (two xor shuffles), its E4M3 scale (the separate pass's expression, the same fp8 cast), and writes its two packed
# bytes per j; the group's first lane writes the scale byte. The separate RoPE, amax, scale and encode passes (each a
# sweep of rot_s, with barriers between) are gone; the arithmetic is theirs, expression for expression.
_MAIN_FROM_ROWS_CUDA = r"""
#include <tl_templates/cuda/cuda_fp8.h>  // fp8_e4_t, the type TileLang's own scale cast uses (imported sources come first)
__device__ __forceinline__ void csa2_main_from_rows(const float* v_in, const float* __restrict__ cs, const float* __restrict__ sn,
                                                    int grow, float* rot_row, unsigned char* bytes_row, unsigned char* sbyte_row) {
  const int lane = threadIdx.x & 31;
  float v[16];
#pragma unroll
  for (int k = 0; k < 16; ++k) v[k] = v_in[k];
  if (lane >= 16) {  // RoPE of pairs p and p + 1 at the group's first position (cos/sin [G, 32])
    const int p = 2 * (lane - 16);
    const float c0 = cs[grow * 32 + p], s0 = sn[grow * 32 + p], c1 = cs[grow * 32 + p + 1], s1 = sn[grow * 32 + p + 1];
    // Rounded as TileLang's separate RoPE pass compiles (its SASS, nvcc 13: ev * c fused onto the rounded od * s,
    // od * c onto the rounded ev * s), so the main cache is byte-identical to it; left to nvcc, the products fused
    // here differed (session 11 on the H200: rare code differences at 64K).
    float ev = v[12], od = v[13];
    v[12] = __fmaf_rn(ev, c0, -__fmul_rn(od, s0));
    v[13] = __fmaf_rn(od, c0, __fmul_rn(ev, s0));
    ev = v[14];
    od = v[15];
    v[14] = __fmaf_rn(ev, c1, -__fmul_rn(od, s1));
    v[15] = __fmaf_rn(od, c1, __fmul_rn(ev, s1));
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    *reinterpret_cast<float4*>(rot_row + 128 * j + 4 * lane) = make_float4(v[4 * j], v[4 * j + 1], v[4 * j + 2], v[4 * j + 3]);
    float a = 0.0f;
#pragma unroll
    for (int e = 0; e < 4; ++e) a = max(a, fabsf(v[4 * j + e]));
    a = max(a, __shfl_xor_sync(0xffffffffu, a, 1));
    a = max(a, __shfl_xor_sync(0xffffffffu, a, 2));
    const float raw = min((max(a, 0x1.8p-7f) / 0x1.8p+2f), 0x1.cp+8f);
    fp8_e4_t code8 = (fp8_e4_t)raw;
    const float s = (float)code8;
    if ((lane & 3) == 0) sbyte_row[8 * j + (lane >> 2)] = *(unsigned char*)(&code8);
    const unsigned lo = csa2_e2m1_pair_bounded(v[4 * j], v[4 * j + 1], s) & 0xFFu;
    const unsigned hi = csa2_e2m1_pair_bounded(v[4 * j + 2], v[4 * j + 3], s) & 0xFFu;
    *reinterpret_cast<unsigned short*>(bytes_row + 64 * j + 2 * lane) = static_cast<unsigned short>(lo | (hi << 8));
  }
}
"""


LOAD_CHUNK = 32  # channels per staged kv/gate slab: [2 * block_g, 32] fp32 = 8 KiB per tensor at block_g 32


@T.macro
def _staged_pool(
    kv, gate, kv_s, gate_s, rot_s, b, g0, ratio: int, block_g: int, chunk: int = LOAD_CHUNK, stages: int = 2, pool_math: str = "ieee"
):
    """Pooled latent of ``block_g`` groups into ``rot_s`` fp32 [block_g, 512], slab by slab.

    ``kv``/``gate`` fp32 [B, S, 512] in global memory; ``kv_s``/``gate_s`` fp32
    [ratio * block_g, chunk] shared staging, ``stages`` deep. Rows past the last group are zero-filled by
    the bulk copy (TMA, or cp.async with source size 0; their results are never stored). The arithmetic is the "direct" path's,
    expression for expression, so both give bit-identical latents.
    """
    for dc in T.Pipelined(D // chunk, num_stages=stages):
        T.copy(kv[b, g0 * ratio : (g0 + block_g) * ratio, dc * chunk : (dc + 1) * chunk], kv_s)
        if ratio == 2:
            T.copy(gate[b, g0 * 2 : (g0 + block_g) * 2, dc * chunk : (dc + 1) * chunk], gate_s)
        for i, d in T.Parallel(block_g, chunk):
            if ratio == 1:
                rot_s[i, dc * chunk + d] = kv_s[i, d]
            else:
                x0, x1 = gate_s[2 * i, d], gate_s[2 * i + 1, d]
                rot_s[i, dc * chunk + d] = _pool_pair(x0, x1, kv_s[2 * i, d], kv_s[2 * i + 1, d], pool_math)


@T.macro
def _split_tf32_tile(rot_s, a_hi, a_lo, kc, block_g: int, k_chunk: int):
    """Columns ``kc * k_chunk ..`` of ``rot_s`` [block_g, *] -> TF32 high part + fp32 remainder (exact split).

    Used for the latent and (``wk="fp32"``) for the staged Wk chunk [128, k_chunk]: the same bits as :func:`split_tf32`.
    """
    for i, kk in T.Parallel(block_g, k_chunk):
        x = rot_s[i, kc * k_chunk + kk]
        xh = T.reinterpret(T.reinterpret(x, "uint32") & T.uint32(0xFFFFE000), "float32")
        a_hi[i, kk] = xh
        a_lo[i, kk] = x - xh


MULTI_CTA_CHUNK, MULTI_CTA_STAGES = 16, 3  # ctas_per_sm > 1: kv/gate slab width and pipeline depth
DIRECT_ROWS = 8  # kv_load=direct: groups whose kv/gate rows are loaded into registers before any is pooled
NORM_LANES = 8  # ctas_per_sm > 1: threads per latent row in the RMSNorm sum of squares (one shuffle reduction)
PROJ_OPERANDS = ("smem", "registers", "wgmma")  # where the tf32x3 projection's operands live (see _compress_kernel)
PROJ_ACCUMULATORS = ("shared", "split")  # register projection: one accumulator per output tile, or the small products apart
ROT_PAD = 4  # proj_operands=registers: rot_s row stride 516 words, so a warp's fragment reads hit 32 distinct banks
PROJ_WARPS = 8  # proj_operands=registers: each warp owns 16 of the 128 output columns, all block_g rows

# proj_operands="registers": the index-K projection with every operand in registers. Warp w computes columns
# [16w, 16w + 16) for all block_g rows (MT = block_g / 16 m-tiles): per 16-wide k chunk it reads its latent words from
# rot_s (row stride RS = 516: the 8 rows x 4 columns of a fragment read sit in 32 distinct banks) and its Wk words from
# global memory (L2) as two float4s per thread, in the order of wk_fragment_order (host), two chunks ahead; each word is
# split into its TF32 high part and fp32 remainder once per warp (the split of _split_tf32_tile, bit for bit), and the
# three products run in T.gemm's order per output tile (lo*hi, hi*lo, hi*hi, each k step 0 then 1), with the PTX
# fragment layout T.gemm's ldmatrix loads give: the same accumulator bits. No shared staging, no barrier, no cp.async.
_PROJ_REGS_CUDA = r"""
__device__ __forceinline__ void csa2_split_tf32(float x, unsigned& hi, unsigned& lo) {
  const unsigned h = __float_as_uint(x) & 0xFFFFE000u;
  hi = h;
  lo = __float_as_uint(x - __uint_as_float(h));
}
__device__ __forceinline__ void csa2_mma_tf32(float* d, const unsigned* a, unsigned b0, unsigned b1) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// rot: fp32 [MT * 16, RS] shared; wkf: Wk [128, 512] fp32 in fragment order (global); out: fp32 [MT * 16, 128] shared.
template <int MT, int RS>
__device__ __forceinline__ void csa2_proj_tf32x3_regs(const float* rot, const float* __restrict__ wkf, float* out) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  float acc[MT][2][4];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[m][n][e] = 0.0f;
  // Chunk c of this warp: 32 lanes x 8 words at float4 (warp * 32 + c) * 64 + lane * 2; word j = n * 4 + ks * 2 + h
  // is Wk[16 warp + 8 n + g, 16 c + 8 ks + 4 h + t].
  const float4* wp = reinterpret_cast<const float4*>(wkf) + warp * 32 * 64 + lane * 2;
  float4 raw[2][2];
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    raw[s][0] = __ldg(wp + s * 64);
    raw[s][1] = __ldg(wp + s * 64 + 1);
  }
  const float* arow = rot + g * RS + t;
#pragma unroll 1
  for (int kc = 0; kc < 32; kc += 2) {
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const int c = kc + s;
      unsigned bh[2][2][2], bl[2][2][2];  // [n][ks][h]
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        const float w[4] = {raw[s][n].x, raw[s][n].y, raw[s][n].z, raw[s][n].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) csa2_split_tf32(w[j], bh[n][j >> 1][j & 1], bl[n][j >> 1][j & 1]);
      }
      // Two chunks ahead (the last two wrap to chunks 0 and 1: valid addresses, values unused).
      const int nc = (c + 2) & 31;
      raw[s][0] = __ldg(wp + nc * 64);
      raw[s][1] = __ldg(wp + nc * 64 + 1);
      unsigned ah[MT][2][4], al[MT][2][4];  // [m][ks][a0..a3]: (g, k), (g + 8, k), (g, k + 4), (g + 8, k + 4)
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int ks = 0; ks < 2; ++ks)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            csa2_split_tf32(arow[(m * 16 + (e & 1) * 8) * RS + c * 16 + ks * 8 + (e >> 1) * 4], ah[m][ks][e], al[m][ks][e]);
#pragma unroll
      for (int ks = 0; ks < 2; ++ks)
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
          for (int n = 0; n < 2; ++n) csa2_mma_tf32(acc[m][n], al[m][ks], bh[n][ks][0], bh[n][ks][1]);
#pragma unroll
      for (int ks = 0; ks < 2; ++ks)
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
          for (int n = 0; n < 2; ++n) csa2_mma_tf32(acc[m][n], ah[m][ks], bl[n][ks][0], bl[n][ks][1]);
#pragma unroll
      for (int ks = 0; ks < 2; ++ks)
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
          for (int n = 0; n < 2; ++n) csa2_mma_tf32(acc[m][n], ah[m][ks], bh[n][ks][0], bh[n][ks][1]);
    }
  }
  // Accumulator (g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1) of each 16 x 8 tile.
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      float* o = out + (m * 16 + g) * 128 + warp * 16 + n * 8 + t * 2;
      *reinterpret_cast<float2*>(o) = make_float2(acc[m][n][0], acc[m][n][1]);
      *reinterpret_cast<float2*>(o + 8 * 128) = make_float2(acc[m][n][2], acc[m][n][3]);
    }
}
"""


def _split_accumulator_cuda() -> str:
    """``proj_accumulators="split"``: :data:`_PROJ_REGS_CUDA` as ``csa2_proj_tf32x3_regs_split``, with the two small
    products (lo*hi, hi*lo) accumulated apart from hi*hi and added at the end. Each output tile then has two independent
    MMA chains instead of one (at block_g 16 a warp has only two tiles: six dependent MMAs per tile and chunk); the sum
    is in another order than T.gemm's, so the index keys may differ from the shared accumulator's in the last bits."""
    # the helpers (csa2_split_tf32, csa2_mma_tf32) come once, from _PROJ_REGS_CUDA: only the function is derived
    src = _PROJ_REGS_CUDA[_PROJ_REGS_CUDA.index("// rot: fp32") :]
    src = src.replace("void csa2_proj_tf32x3_regs(", "void csa2_proj_tf32x3_regs_split(")
    replacements = (
        ("  float acc[MT][2][4];\n", "  float acc[MT][2][4], acc_s[MT][2][4];\n"),
        (
            "      for (int e = 0; e < 4; ++e) acc[m][n][e] = 0.0f;",
            "      for (int e = 0; e < 4; ++e) acc[m][n][e] = acc_s[m][n][e] = 0.0f;",
        ),
        ("csa2_mma_tf32(acc[m][n], al[m][ks]", "csa2_mma_tf32(acc_s[m][n], al[m][ks]"),
        ("csa2_mma_tf32(acc[m][n], ah[m][ks], bl[n]", "csa2_mma_tf32(acc_s[m][n], ah[m][ks], bl[n]"),
        ("make_float2(acc[m][n][0], acc[m][n][1])", "make_float2(acc[m][n][0] + acc_s[m][n][0], acc[m][n][1] + acc_s[m][n][1])"),
        ("make_float2(acc[m][n][2], acc[m][n][3])", "make_float2(acc[m][n][2] + acc_s[m][n][2], acc[m][n][3] + acc_s[m][n][3])"),
    )
    for old, new in replacements:
        if src.count(old) != 1:  # the shared template changed under this derivation
            raise RuntimeError(f"_PROJ_REGS_CUDA no longer has exactly one {old.strip()!r}: update _split_accumulator_cuda")
        src = src.replace(old, new)
    return src


# proj_k_split=2: the register projection with the 512-long K split between two halves of the CTA. Warp w covers the K
# half kh = w / 4 (chunks [16 kh, 16 kh + 16)) and the output columns [32 cg, 32 cg + 32), cg = w % 4 (four n tiles), so
# it reads and splits only its half of the latent: 128 instead of 256 latent LDS and splits per warp (Nsight, session 10:
# the projection is 58% of the default's stall samples and 52% of its shared-memory wavefronts, every warp reading the
# whole latent). Its Wk words are wk_fragment_order(Wk, 32): per chunk a lane reads four float4s (n tiles 0-3), issued one
# chunk ahead, each n tile's float4 reloaded as soon as it is split. The halves meet in `out`: half 1 stores its sums, a
# barrier, half 0 adds its own to them (a fixed order: two runs give the same bits). The same three products per tile in
# the shared template's order; the K halves are summed apart, so the index keys may differ in the last bits.
# Measured (H200, session 10, results/sm90/profile_compressor_k_split_session10.json): slower at three CTAs of 16
# (ratio 2 at 64K 0.1443 -> 0.1664 ms; Nsight: its warps wait on the Wk loads, one chunk ahead is not enough, and L1
# throughput rose 68 -> 83%), faster at two CTAs of 32 (ratio 2 0.1418 ms, ratio 1 0.2147 ms, against the default's
# 0.1443 / 0.2292): a tuning candidate there, not a default.
_PROJ_REGS_K2_CUDA = r"""
template <int MT, int RS>
__device__ __forceinline__ void csa2_proj_tf32x3_regs_k2(const float* rot, const float* __restrict__ wkf, float* out) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, kh = warp >> 2, cg = warp & 3;
  float acc[MT][4][4];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[m][n][e] = 0.0f;
  // Chunk c of column group cg: 32 lanes x 16 words at float4 (cg * 32 + c) * 128 + lane * 4 + n; word ks * 2 + h of
  // float4 n is Wk[32 cg + 8 n + g, 16 c + 8 ks + 4 h + t].
  const float4* wp = reinterpret_cast<const float4*>(wkf) + cg * 32 * 128 + lane * 4;
  const int c0 = kh * 16;
  float4 raw[4];
#pragma unroll
  for (int n = 0; n < 4; ++n) raw[n] = __ldg(wp + c0 * 128 + n);
  const float* arow = rot + g * RS + t;
#pragma unroll 1
  for (int c = c0; c < c0 + 16; ++c) {
    unsigned ah[MT][2][4], al[MT][2][4];  // [m][ks][a0..a3]: (g, k), (g + 8, k), (g, k + 4), (g + 8, k + 4)
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int ks = 0; ks < 2; ++ks)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          csa2_split_tf32(arow[(m * 16 + (e & 1) * 8) * RS + c * 16 + ks * 8 + (e >> 1) * 4], ah[m][ks][e], al[m][ks][e]);
    const int nc = c + 1 < c0 + 16 ? c + 1 : c0;  // the next chunk (the last wraps: a valid address, its value unused)
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      unsigned bh[2][2], bl[2][2];  // [ks][h]
      const float w[4] = {raw[n].x, raw[n].y, raw[n].z, raw[n].w};
#pragma unroll
      for (int j = 0; j < 4; ++j) csa2_split_tf32(w[j], bh[j >> 1][j & 1], bl[j >> 1][j & 1]);
      raw[n] = __ldg(wp + nc * 128 + n);
#pragma unroll
      for (int ks = 0; ks < 2; ++ks)
#pragma unroll
        for (int m = 0; m < MT; ++m) csa2_mma_tf32(acc[m][n], al[m][ks], bh[ks][0], bh[ks][1]);
#pragma unroll
      for (int ks = 0; ks < 2; ++ks)
#pragma unroll
        for (int m = 0; m < MT; ++m) csa2_mma_tf32(acc[m][n], ah[m][ks], bl[ks][0], bl[ks][1]);
#pragma unroll
      for (int ks = 0; ks < 2; ++ks)
#pragma unroll
        for (int m = 0; m < MT; ++m) csa2_mma_tf32(acc[m][n], ah[m][ks], bh[ks][0], bh[ks][1]);
    }
  }
  // Accumulator (g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1) of each 16 x 8 tile; K half 1 first, then half 0 adds.
#pragma unroll
  for (int half = 1; half >= 0; --half) {
    if (kh == half) {
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int n = 0; n < 4; ++n) {
          float2* o = reinterpret_cast<float2*>(out + (m * 16 + g) * 128 + cg * 32 + n * 8 + t * 2);
          float2* o8 = reinterpret_cast<float2*>(out + (m * 16 + g + 8) * 128 + cg * 32 + n * 8 + t * 2);
          float2 v = make_float2(acc[m][n][0], acc[m][n][1]), v8 = make_float2(acc[m][n][2], acc[m][n][3]);
          if (half == 0) {
            const float2 p = *o, p8 = *o8;
            v = make_float2(p.x + v.x, p.y + v.y);
            v8 = make_float2(p8.x + v8.x, p8.y + v8.y);
          }
          *o = v;
          *o8 = v8;
        }
    }
    if (half == 1) __syncthreads();
  }
}
"""


# proj_operands="wgmma" (sm_90a, block_g 16): the projection transposed, k^T [128, N] = Wk [128, 512] x latent^T, on
# wgmma m64nNk8 TF32 (N = block_g groups). Warpgroup q computes output columns [64q, 64q + 64); warp w's A fragment is
# Wk rows [16w, 16w + 16), the very words the register projection's warp w reads (wk_fragment_order: a0..a3 of k step
# ks are its words (n 0, h 0), (n 1, h 0), (n 0, h 1), (n 1, h 1), i.e. rows g, g + 8 at columns t, t + 4), split per
# warp as there. The latent is split ONCE per CTA instead of once per warp (8x fewer splits and LDS): its TF32 high part
# overwrites rot_s (read into registers first, a barrier between) and its remainder goes to `lo`, both in wgmma's
# no-swizzle K-major layout (8 x 16-byte core matrices: rows n % 8 16 B apart, the N / 8 row blocks 128 B apart, k
# quads 16 N bytes apart), which the tensor cores read through descriptors. Three wgmmas per k step (Wk lo x hi,
# Wk hi x lo, Wk hi x hi), one commit group per 16-wide chunk, A registers double-buffered so that a chunk's splits and
# loads run under the previous chunk's wgmmas. The result is written to `out` [N, OS] after every warpgroup's wgmmas
# have completed (out may alias lo: a barrier first).
# Measured (H200, session 10, results/sm90/profile_compressor_wgmma_session10.json): right (index keys equal to the
# register projection's at 4K), but slower at every shape: ratio 2 at 64K 0.1488 -> 0.1650 ms, ratio 1 0.2490 -> 0.2512,
# decode 0.0124 -> 0.0132. Its loop is 45 instructions a chunk instead of ~70, but the kernel is not bound by them: the
# wgmmas read the latent once per warpgroup and k step (1.5K shared wavefronts a CTA, plus the split's 0.5K, against the
# register projection's 2.3K), and in Nsight the other phases' samples grew by more than the projection's shrank.
_PROJ_WGMMA_CUDA = r"""
__device__ __forceinline__ unsigned long long csa2_wgmma_desc(const float* smem, int lbo_bytes) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  // start address >> 4 | leading (K-direction) byte offset >> 4 << 16 | stride (8-row block) byte offset 128 >> 4 << 32
  return (unsigned long long)((a & 0x3FFFF) >> 4) | ((unsigned long long)(lbo_bytes >> 4) << 16) | ((unsigned long long)(128 >> 4) << 32);
}
template <int N>
__device__ __forceinline__ void csa2_wgmma_tf32(float* d, const unsigned* a, unsigned long long desc);
template <>
__device__ __forceinline__ void csa2_wgmma_tf32<16>(float* d, const unsigned* a, unsigned long long desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k8.f32.tf32.tf32 {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, "
      "p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));  // p true: D += A B
}
// rot: fp32 [N, RS] shared (in: the rotated latent; out: its TF32 high part, wgmma layout); lo: fp32 [N * 512] shared;
// wkf: Wk [128, 512] fp32 in fragment order (global); out: fp32 [N, OS] shared.
template <int N, int RS, int OS>
__device__ __forceinline__ void csa2_proj_tf32x3_wgmma(float* rot, float* lo, const float* __restrict__ wkf, float* out) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  // 1. The latent's split, once per CTA. Thread tid's p-th float4 is row n = i % N, k quad i / N (i = p * 256 + tid):
  // eight neighbouring threads read rows n..n+7 of one quad (banks 4n apart at RS = 516) and write one 128-byte core
  // matrix row block: no bank conflicts either way.
  constexpr int PER = N * (512 / 4) / 256;
  float4 v[PER];
#pragma unroll
  for (int p = 0; p < PER; ++p) {
    const int i = p * 256 + tid;
    v[p] = *reinterpret_cast<const float4*>(rot + (i % N) * RS + 4 * (i / N));
  }
  __syncthreads();  // every latent word is in registers before its high part overwrites rot
#pragma unroll
  for (int p = 0; p < PER; ++p) {
    const int i = p * 256 + tid, n = i % N, off = (((i / N) * (N / 8) + n / 8) * 8 + n % 8) * 4;
    const float x[4] = {v[p].x, v[p].y, v[p].z, v[p].w};
    unsigned h[4], l[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) csa2_split_tf32(x[e], h[e], l[e]);
    *reinterpret_cast<uint4*>(rot + off) = make_uint4(h[0], h[1], h[2], h[3]);
    *reinterpret_cast<uint4*>(lo + off) = make_uint4(l[0], l[1], l[2], l[3]);
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // generic-proxy stores -> the wgmma (async proxy) reads
  __syncthreads();
  // 2. The wgmmas. Descriptors advance 32 N bytes (two k quads) per k step of 8.
  const unsigned long long d_hi = csa2_wgmma_desc(rot, 16 * N), d_lo = csa2_wgmma_desc(lo, 16 * N);
  float acc[N / 2];
#pragma unroll
  for (int e = 0; e < N / 2; ++e) acc[e] = 0.0f;
  const float4* wp = reinterpret_cast<const float4*>(wkf) + warp * 32 * 64 + lane * 2;
  float4 raw[2][2];
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    raw[s][0] = __ldg(wp + s * 64);
    raw[s][1] = __ldg(wp + s * 64 + 1);
  }
  unsigned ah[2][2][4], al[2][2][4];  // [buffer][ks][a0..a3]
#pragma unroll 1
  for (int kc = 0; kc < 32; kc += 2) {
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const int c = kc + s;
      // Buffer s was last read by chunk c - 2's wgmmas: wait until at most chunk c - 1's group is pending.
      asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
      const float w0[4] = {raw[s][0].x, raw[s][0].y, raw[s][0].z, raw[s][0].w};
      const float w1[4] = {raw[s][1].x, raw[s][1].y, raw[s][1].z, raw[s][1].w};
#pragma unroll
      for (int ks = 0; ks < 2; ++ks) {
        csa2_split_tf32(w0[2 * ks], ah[s][ks][0], al[s][ks][0]);      // (g, t)
        csa2_split_tf32(w1[2 * ks], ah[s][ks][1], al[s][ks][1]);      // (g + 8, t)
        csa2_split_tf32(w0[2 * ks + 1], ah[s][ks][2], al[s][ks][2]);  // (g, t + 4)
        csa2_split_tf32(w1[2 * ks + 1], ah[s][ks][3], al[s][ks][3]);  // (g + 8, t + 4)
      }
      const int nc = (c + 2) & 31;  // two chunks ahead (the last two wrap: valid addresses, values unused)
      raw[s][0] = __ldg(wp + nc * 64);
      raw[s][1] = __ldg(wp + nc * 64 + 1);
      asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
      for (int ks = 0; ks < 2; ++ks) {
        const unsigned long long step = (unsigned long long)((2 * c + ks) * 2 * N);  // (2c + ks) * 32 N bytes, >> 4
        csa2_wgmma_tf32<N>(acc, al[s][ks], d_hi + step);
        csa2_wgmma_tf32<N>(acc, ah[s][ks], d_lo + step);
        csa2_wgmma_tf32<N>(acc, ah[s][ks], d_hi + step);
      }
      asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    }
  }
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#pragma unroll
  for (int e = 0; e < N / 2; ++e) asm volatile("" : "+f"(acc[e])::"memory");
  __syncthreads();  // both warpgroups' wgmmas have read lo before out (which may alias it) is written
  // Accumulator e = 4j + 2r + b: row (output column) 16 warp + g + 8r, column (group) 8j + 2t + b.
#pragma unroll
  for (int j = 0; j < N / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) out[(8 * j + 2 * t + (e & 1)) * OS + 16 * warp + g + 8 * (e >> 1)] = acc[4 * j + e];
}
"""


def wk_fragment_order(wk: torch.Tensor, columns: int = 16) -> torch.Tensor:
    """fp32 Wk [128, 512] -> the same words [128, 512] in the order ``proj_operands="registers"`` reads them: per column
    group w (``columns`` output columns: 16, or 32 with ``proj_k_split=2``) and k chunk c (16 wide), 32 lanes x
    ``columns / 2`` words, word n * 4 + ks * 2 + h of lane 4g + t being ``Wk[columns w + 8n + g, 16c + 8ks + 4h + t]``
    (``columns / 8`` float4 loads per lane per chunk, a warp reads 1-2 KiB contiguous)."""
    w = wk.float().contiguous().view(DI // columns, columns // 8, 8, D // 16, 2, 2, 4)  # (w, n, g, c, ks, h, t)
    return w.permute(0, 3, 2, 6, 1, 4, 5).contiguous().view(DI, D)  # (w, c, g, t, n, ks, h)


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
def _rope_last_dims(buf, width: int, block_g: int, g0, G, cos, sin):
    """RoPE on the last 64 of the ``width`` columns of ``buf`` [block_g, *] at each row's group position (``cos``/``sin``
    [G, 32]), interleaved pairs; each pair is read and written by one thread."""
    for i, p in T.Parallel(block_g, ROPE // 2):
        g = T.min(g0 + i, G - 1)
        ev, od = buf[i, width - ROPE + 2 * p], buf[i, width - ROPE + 2 * p + 1]
        c, s = cos[g, p], sin[g, p]
        buf[i, width - ROPE + 2 * p] = ev * c - od * s
        buf[i, width - ROPE + 2 * p + 1] = ev * s + od * c


@functools.cache
def _compress_kernel(
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
):
    """Build the one-pass compressor for ``ratio`` (1 or 2); dims B and G are dynamic.

    ``load``: "direct" reads kv/gate with per-thread loads straight into the pooling registers;
    "staged" streams them through shared memory by double-buffered bulk copies (and the Wk
    chunks likewise, for tf32x3), see :func:`_staged_pool`.
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
    stages, and uses narrower kv/gate slabs; ``_smem_compress``/``_occupancy_compress`` say what fits.
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
    writes the pooled latent to rot_s (the arithmetic of :func:`_staged_pool`, expression for expression); the loads of
    one thread's 16 float4 outputs are independent, so many more bytes are in flight than the slabs' two stages.
    ``proj_operands`` (flat kernel, wk=fp32): "smem" splits each 16-wide chunk of the latent and of Wk into TF32 high
    and low tiles in shared memory (cp.async Wk stages, three barriers per chunk) and T.gemm reads them by ldmatrix;
    "registers" runs the projection out of registers (_PROJ_REGS_CUDA): each warp owns 16 output columns, reads its
    latent words from rot_s (padded rows) and its Wk words from L2 (host order :func:`wk_fragment_order`), splits each
    once and issues the same MMAs in the same order; the result goes to k_s. No Wk stages, a_hi/a_lo/b_hi/b_lo or
    barriers in the loop. "wgmma" (sm_90a, block_g 16) computes the transposed product on wgmma (_PROJ_WGMMA_CUDA): Wk
    from registers as the register projection reads and splits it, the latent split once per CTA into wgmma's shared
    layout (its high part over rot_s) instead of once per warp; the same three products, summed in the tensor cores'
    order (the index keys may differ from "registers" in the last bits).
    ``proj_accumulators`` (register projection): "shared" accumulates the three products of each output tile in one
    accumulator, in T.gemm's order (the shared-memory projection's bits); "split" keeps the small products (lo*hi, hi*lo)
    in a second one, added at the end (:func:`_split_accumulator_cuda`): two independent MMA chains per tile.
    ``pool_math`` (ratio 2; ratio 1 pools nothing): how each channel's softmax over the group's two tokens is computed,
    see :func:`_pool_pair`: "ieee" (two expf, two IEEE divisions: the reference's expression) or "fast" (ex2.approx and
    one approximate reciprocal: a few ulps off).
    ``norm_pass`` (kv_load=direct): "separate" normalises rot_s after the pooling (:func:`_rmsnorm_in_smem`: a pass that
    sums the squares from rot_s, a barrier, a pass that reads, scales and writes it back); "in_pool" sums each pooled
    row's squares in registers (one warp-wide shuffle reduction) and writes rot_s once, normalised: no rot_s round trip
    and no barriers for the norm (the latent moves by a few ulps: another summation order).
    ``main_pass`` (norm_pass="in_pool", encode="thresholds"): "separate" applies the RoPE and encodes the main cache in
    passes over rot_s (RoPE; amax; scale; codes, with barriers between); "in_pool" does all of it from the normalised
    rows in registers (:data:`_MAIN_FROM_ROWS_CUDA`: the same arithmetic, the group max by two shuffles) and writes
    rot_s the final latent; bytes_m and sbyte_m get plain layouts (the TMA stores read them unswizzled).
    ``proj_k_split`` (register projection, one accumulator): 1, every warp covers all 512 k for 16 output columns; 2, a
    warp covers half of them for 32 columns (:data:`_PROJ_REGS_K2_CUDA`: half the latent reads and splits per warp, Wk in
    ``wk_fragment_order(Wk, 32)``, the two halves added in k_s).
    """
    if encode not in ENCODES:
        raise TileError(f"unknown encode {encode!r}: use one of {', '.join(ENCODES)}")
    if schedule not in SCHEDULES:
        raise TileError(f"unknown schedule {schedule!r}: use one of {', '.join(SCHEDULES)}")
    # The flat kernel: no producer warpgroup. Several CTAs per SM need it; one CTA may pick it (schedule="flat").
    flat = ctas_per_sm > 1 or schedule == "flat"
    if flat and (load != "staged" or proj != "tf32x3"):
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
            rot_s = T.alloc_shared((block_g, D + ROT_PAD if regs else D), "float32")
            w_s = T.alloc_shared((D,), "float32")
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
            if encode == "thresholds" or regs:  # one import_source per kernel
                extra = _split_accumulator_cuda() if proj_accumulators == "split" else (_PROJ_WGMMA_CUDA if wgmma else "")
                extra += _PROJ_REGS_K2_CUDA if proj_k_split == 2 else ""
                bounds = (_bounds_cuda() + (_MAIN_FROM_ROWS_CUDA if main_pass == "in_pool" else "")) if encode == "thresholds" else ""
                T.import_source(bounds + (_PROJ_REGS_CUDA + extra if regs else ""))
            T.copy(norm_w, w_s)
            T.copy(k_norm_w, kw_s)

            # 1. pooling (softmax over the group's tokens, per channel).
            if load == "staged":
                # Bulk async copies of channel slabs, double-buffered: the kv/gate stream (the
                # kernel's HBM traffic) is in flight while the previous slab is pooled, instead
                # of each thread waiting on its own scalar loads (see _staged_pool).
                if kv_load == "whole":
                    # Ratio 1 pools nothing: the block's rows straight into rot_s, every load in flight at once (one HBM
                    # round trip instead of 32 slab round trips two deep); rows past G are zero-filled by the copy.
                    T.copy(kv[b, g0 : g0 + block_g, :], rot_s)
                elif kv_load == "direct":
                    # No slabs, no barrier per slab: each thread's kv/gate float4s straight from global memory into the
                    # softmax (the same expressions as _staged_pool, so the same latent bits). Rows past G read row G - 1
                    # (their results are never stored).
                    for r in T.serial(block_g // DIRECT_ROWS):
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
                                    pooled_f[i, d] = _pool_pair(x0, x1, kv_f[0][i, d], kv_f[1][i, d], pool_math)
                            for i, d in T.Parallel(DIRECT_ROWS, D):
                                sq_f[i, d] = pooled_f[i, d] * pooled_f[i, d]
                            T.reduce_sum(sq_f, ss_f, dim=1)
                            if main_pass == "in_pool":
                                # Normalised in place; then RoPE, rot_s and the main cache from the registers.
                                for i, d in T.Parallel(DIRECT_ROWS, D):
                                    inv = T.rsqrt(ss_f[i] / D + eps[0])
                                    pooled_f[i, d] = pooled_f[i, d] * inv * w_s[d]
                                row = r * DIRECT_ROWS + T.get_thread_binding() // 32
                                T.call_extern(
                                    "handle",
                                    "csa2_main_from_rows",
                                    T.address_of(pooled_f[0, 0]),
                                    T.address_of(cos[0, 0]),
                                    T.address_of(sin[0, 0]),
                                    T.max(T.min(g0 + row, G - 1), 0),
                                    T.address_of(rot_s[row, 0]),
                                    T.address_of(bytes_m[row, 0]),
                                    T.address_of(sbyte_m[row, 0]),
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
                                    rot_s[r * DIRECT_ROWS + i, d] = _pool_pair(x0, x1, kv_f[0][i, d], kv_f[1][i, d], pool_math)
                else:
                    _staged_pool(kv, gate, kv_s, gate_s, rot_s, b, g0, ratio, block_g, chunk, stages, pool_math)
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
                        lat[i, d] = _pool_pair(x0, x1, kv[b, 2 * g, d], kv[b, 2 * g + 1, d], pool_math)
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
                # 3. RoPE on the last 64 dims (main_pass="in_pool": done with 4. from the rows in registers).
                _rope_last_dims(rot_s, D, block_g, g0, G, cos, sin)
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
                        lo = _e2m1_code(T.clamp(rot_s[i, 2 * j] / sc, -6.0, 6.0))
                        hi = _e2m1_code(T.clamp(rot_s[i, 2 * j + 1] / sc, -6.0, 6.0))
                        bytes_m[i, j] = T.Cast("uint8", lo | (hi << 4))
            if flat:
                # Stored now, not at the end: bytes_m's shared memory is then free for the Wk stages.
                T.copy(bytes_m, main_packed[b, g0 : g0 + block_g, :])
                T.copy(sbyte_m, main_scales[b, g0 : g0 + block_g, :])
                # The allocator reuses bytes_m/sbyte_m for b_lo/a_hi right after these bulk stores, but only
                # the electing thread waits for the stores to have read shared memory: everyone waits for it.
                T.sync_threads()
            # 5. Index-K projection of the rotated latent (fp32 accuracy, see module docstring).
            if not regs:
                T.clear(kacc)
            if regs:
                # Out of registers (see _PROJ_REGS_CUDA) or on wgmma (_PROJ_WGMMA_CUDA: the latent's high part overwrites
                # rot_s, its remainder goes to lo_s) into k_s; rot_s is final (barrier after the main stores).
                if wgmma:
                    fn, operands = f"csa2_proj_tf32x3_wgmma<{block_g}, {D + ROT_PAD}, {D}>", (rot_s, lo_s, wk_hi, k_s)
                else:
                    variant = "_split" if proj_accumulators == "split" else ("_k2" if proj_k_split == 2 else "")
                    fn, operands = f"csa2_proj_tf32x3_regs{variant}<{block_g // 16}, {D + ROT_PAD}>", (rot_s, wk_hi, k_s)
                T.call_extern("handle", fn, *[T.address_of(buf[0, 0]) for buf in operands])
                T.sync_threads()
            elif wk == "fp32":
                # Half the L2 -> SM bytes of "hi_lo": the chunk of Wk itself, split here like the latent.
                for kc in T.Pipelined(D // k_chunk, num_stages=wk_stages):
                    T.copy(wk_hi[:, kc * k_chunk : (kc + 1) * k_chunk], w_st)
                    _split_tf32_tile(rot_s, a_hi, a_lo, kc, block_g, k_chunk)
                    _split_tf32_tile(w_st, b_hi, b_lo, 0, DI, k_chunk)
                    T.gemm(a_lo, b_hi, kacc, transpose_B=True)
                    T.gemm(a_hi, b_lo, kacc, transpose_B=True)
                    T.gemm(a_hi, b_hi, kacc, transpose_B=True)
            elif proj == "tf32x3" and load == "staged":
                # The weight chunks by async copies, double-buffered, so the L2 -> SM stream of Wk (512 KiB
                # hi + lo per CTA) overlaps the split and the MMAs instead of stalling each chunk.
                for kc in T.Pipelined(D // k_chunk, num_stages=wk_stages):
                    T.copy(wk_hi[:, kc * k_chunk : (kc + 1) * k_chunk], b_hi)
                    T.copy(wk_lo[:, kc * k_chunk : (kc + 1) * k_chunk], b_lo)
                    _split_tf32_tile(rot_s, a_hi, a_lo, kc, block_g, k_chunk)
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
                    lo = _e2m1_code_search(k_s[i, 2 * j] * sc)
                    hi = _e2m1_code_search(k_s[i, 2 * j + 1] * sc)
                else:
                    lo = _e2m1_code(T.clamp(k_s[i, 2 * j] / sc, -6.0, 6.0))
                    hi = _e2m1_code(T.clamp(k_s[i, 2 * j + 1] / sc, -6.0, 6.0))
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
    kernel = tilelang.compile(compress, target=tvm.target.Target({"kind": "cuda", "arch": target}), pass_configs=pass_configs)
    # what the launchers pass as (wk_hi, wk_lo): see _wk_args
    kernel.csa2_wk = ("fragments_k2" if proj_k_split == 2 else "fragments") if regs else wk
    return kernel


# --------------------------------------------------------------------------------------
# public function
# --------------------------------------------------------------------------------------


def _build(arch: Arch, ratio: int, cfg: Config):
    """The compiled compressor for a full config (see :meth:`CompressorTile.search_space`)."""
    return _compress_kernel(
        arch.nvcc_arch,
        ratio,
        cfg["block_g"],
        cfg["threads"],
        cfg["proj"],
        cfg["k_chunk"],
        cfg.get("load", "direct"),
        cfg.get("encode", "divide"),
        cfg.get("ctas_per_sm", 1),
        cfg.get("wk", "hi_lo"),
        _schedule(cfg),
        cfg.get("wk_stages", 2),
        cfg.get("kv_load", "slabs"),
        cfg.get("proj_operands", "smem"),
        cfg.get("pool_math", "ieee"),
        cfg.get("proj_accumulators", "shared"),
        cfg.get("norm_pass", "separate"),
        cfg.get("proj_k_split", 1),
        cfg.get("main_pass", "separate"),
    )


def _schedule(cfg: Config) -> str:
    """The kernel's schedule: "flat" (no producer warpgroup) whenever several CTAs share an SM, else the config's
    ``schedule`` ("ws", the warp-specialised one-CTA kernel, unless named)."""
    return "flat" if cfg.get("ctas_per_sm", 1) > 1 else cfg.get("schedule", "ws")


def _wk_args(kernel, wk: torch.Tensor, prepared: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's (wk_hi, wk_lo) arguments for fp32 ``wk`` [128, 512]: the TF32 split, (``wk="fp32"``) Wk itself in
    the first slot (the kernel splits it; the second slot is not read), or (``proj_operands="registers"``/``"wgmma"``) Wk
    in :func:`wk_fragment_order` (32 columns per group with ``proj_k_split=2``), also in the first slot. ``prepared``: a dict that keeps the split or the reordered copy
    of this ``wk`` across calls (a per-layer constant: made once)."""
    form = getattr(kernel, "csa2_wk", "hi_lo")
    if form == "fp32":
        w = wk.float().contiguous()
        return w, w
    prepared = {} if prepared is None else prepared
    if form not in prepared:
        if form in ("fragments", "fragments_k2"):
            w = wk_fragment_order(wk, 32 if form == "fragments_k2" else 16)
            prepared[form] = (w, w)
        else:
            prepared[form] = split_tf32(wk)
    return prepared[form]


# compress()'s prepared Wk forms per weight tensor (the TF32 split, the fragment order): a layer's Wk is a constant, so
# they are made on its first call, not on every call (a reorder of 256 KiB and its launches per layer and decode step).
# Keyed weakly by the tensor; an in-place write to it (its version counter moves) makes them again.
_PREPARED_WK = WeakTensorKeyDictionary()


def _prepared_forms(wk: torch.Tensor) -> dict:
    """The ``prepared`` dict of :func:`_wk_args` that belongs to this ``wk`` tensor as it is now."""
    version, forms = _PREPARED_WK.get(wk, (None, None))
    if version != wk._version:
        forms = {}
        _PREPARED_WK[wk] = (wk._version, forms)
    return forms


def split_tf32(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [..] -> (high part with the low 13 mantissa bits cleared = exact TF32, fp32 remainder)."""
    wf = w.float().contiguous()
    hi = (wf.view(torch.int32) & -8192).view(torch.float32)  # 0xFFFFE000
    return hi, wf - hi


def _check_f32(t: torch.Tensor, name: str, shape: tuple[int, ...]) -> None:
    if t.dtype != torch.float32:
        raise TileError(f"{name} must be float32, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise TileError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def compress(
    kv: torch.Tensor,
    gate: torch.Tensor | None,
    ratio: int,
    norm_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    wk: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    config: Config | None = None,
    tail_kv: torch.Tensor | None = None,
    tail_gate: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Compress complete groups of tokens into the main and index FP4 caches (one kernel).

    Args:
        kv: fp32 [B, S, 512] the Wkv projections of the new tokens.
        gate: fp32 [B, S, 512] the Wgate projections (ratio 2), None for ratio 1.
        ratio: 1 or 2.
        norm_weight: fp32 [512] the compressor's RMSNorm weight.
        cos, sin: fp32 [G, 32] RoPE tables at each group's first position (interleaved pairs,
            as :func:`model.ops.rope.apply_rope`), G = complete groups (see below).
        wk: fp32 [128, 512] the index-K projection; k_norm_weight: fp32 [128].
        eps: RMSNorm epsilon (both norms).
        config: tile parameters (see :class:`CompressorTile`); None = tuned winner or default.
        tail_kv, tail_gate: fp32 [B, 512] the stored first token of an unfinished group
            (ratio 2 decode), placed before ``kv``/``gate``; both or neither.
    Returns:
        main_packed uint8 [B, G, 256], main_scales uint8 [B, G, 32] (E4M3),
        idx_packed uint8 [B, G, 64], idx_scales uint8 [B, G, 4] (E8M0), with
        G = (S + tail) // ratio. With an odd token count (ratio 2) the last token is left
        over: the caller keeps ``kv[:, -1]``, ``gate[:, -1]`` as the next tail.
    """
    if ratio not in (1, 2):
        raise TileError(f"ratio must be 1 or 2, got {ratio}")
    if kv.dim() != 3 or kv.shape[-1] != D:
        raise TileError(f"kv must be float32 [B, S, {D}], got {tuple(kv.shape)}")
    B, S, _ = kv.shape
    _check_f32(kv, "kv", (B, S, D))
    if ratio == 2:
        if gate is None:
            raise TileError("ratio 2 needs a gate [B, S, 512]")
        _check_f32(gate, "gate", (B, S, D))
    if (tail_kv is None) != (tail_gate is None):
        raise TileError("pass tail_kv and tail_gate together (or neither)")
    if tail_kv is not None:
        if ratio != 2:
            raise TileError("a tail state only exists for ratio 2")
        _check_f32(tail_kv, "tail_kv", (B, D))
        _check_f32(tail_gate, "tail_gate", (B, D))
        kv = torch.cat([tail_kv.unsqueeze(1), kv], dim=1)  # [B, S+1, D]: a decode step's few rows
        gate = torch.cat([tail_gate.unsqueeze(1), gate], dim=1)
    G = kv.shape[1] // ratio
    _check_f32(norm_weight, "norm_weight", (D,))
    _check_f32(cos, "cos", (G, ROPE // 2))
    _check_f32(sin, "sin", (G, ROPE // 2))
    _check_f32(wk, "wk", (DI, D))
    _check_f32(k_norm_weight, "k_norm_weight", (DI,))
    for name, t in (("norm_weight", norm_weight), ("cos", cos), ("sin", sin), ("wk", wk), ("k_norm_weight", k_norm_weight)):
        if t.device != kv.device:
            raise TileError(f"{name} is on {t.device} but kv is on {kv.device}")
    dev = kv.device
    outs = (
        torch.empty(B, G, D // 2, dtype=torch.uint8, device=dev),  # [B, G, 256]
        torch.empty(B, G, D // MAIN_GROUP, dtype=torch.uint8, device=dev),  # [B, G, 32]
        torch.empty(B, G, DI // 2, dtype=torch.uint8, device=dev),  # [B, G, 64]
        torch.empty(B, G, DI // INDEX_GROUP, dtype=torch.uint8, device=dev),  # [B, G, 4]
    )
    if G == 0:
        return outs
    arch = _device_arch(kv)
    shape = Shape("call", "any", {"B": B, "S": G * ratio, "ratio": ratio, "dim": flash().dim, "D": D, "Di": DI})
    cfg = _pick_config(COMPRESSOR, shape, arch, config)
    kv = kv[:, : G * ratio].contiguous()
    gate = kv if ratio == 1 else gate[:, : G * ratio].contiguous()  # ratio 1 reads no gate
    eps_t = torch.full((1,), eps, dtype=torch.float32, device=dev)  # a fill, not a host copy: capturable
    kernel = _build(arch, ratio, cfg)
    wk_hi, wk_lo = _wk_args(kernel, wk, _prepared_forms(wk))
    kernel(kv, gate, norm_weight.contiguous(), cos.contiguous(), sin.contiguous(), wk_hi, wk_lo, k_norm_weight.contiguous(), eps_t, *outs)
    return outs


# --------------------------------------------------------------------------------------
# tile
# --------------------------------------------------------------------------------------


def compare_fp4_caches(outputs, expected) -> Comparison:
    """The compressor's comparison rule (module docstring): near bit-exact, differences one code step."""
    worst, notes, ok = 0.0, [], True
    for name, group, fmt in (("main", MAIN_GROUP, "e4m3"), ("idx", INDEX_GROUP, "e8m0")):
        p, s = outputs[f"{name}_packed"], outputs[f"{name}_scales"]
        rp, rs = expected[f"{name}_packed"].to(p.device), expected[f"{name}_scales"].to(p.device)
        if p.shape != rp.shape or s.shape != rs.shape:
            return Comparison(
                False, "fp4-near-exact", 1.0, f"{name}: shapes {tuple(p.shape)}/{tuple(s.shape)} != {tuple(rp.shape)}/{tuple(rs.shape)}"
            )
        codes, rcodes = formats.unpack_nibbles(p), formats.unpack_nibbles(rp)
        # One code step: neighbouring magnitudes of the same sign, or +0/-0/+-0.5 around zero.
        mag, rmag = (codes & 7).int(), (rcodes & 7).int()
        same_sign = (codes & 8) == (rcodes & 8)
        step_ok = (codes == rcodes) | (same_sign & ((mag - rmag).abs() <= 1)) | ((mag <= 1) & (rmag <= 1))
        # A scale one step off (amax on a rounding boundary of the scale) requantises its whole
        # group, so the one-step rule applies to codes under equal scales only; such groups are
        # bounded by the scale-byte fraction and the dequantised error instead.
        same_scale = (s == rs).repeat_interleave(group, dim=-1)  # [..., N] per value
        step_ok = step_ok | ~same_scale
        s_ok = (s.int() - rs.int()).abs() <= 1
        frac_p = float((p != rp).float().mean())
        frac_s = float((s != rs).float().mean())
        deq = formats.fp4_dequantize(p, s, group, fmt)
        rdeq = formats.fp4_dequantize(rp, rs, group, fmt)
        rel = float((deq - rdeq).norm() / rdeq.norm().clamp(min=1e-30))
        good = (
            bool(step_ok.all())
            and bool(s_ok.all())
            and frac_p <= MAX_CODE_DIFF_FRACTION
            and frac_s <= MAX_CODE_DIFF_FRACTION
            and rel <= DEQ_RTOL
        )
        ok &= good
        worst = max(worst, frac_p, frac_s)
        notes.append(f"{name}: {frac_p:.2e} bytes, {frac_s:.2e} scales differ, rel_l2 {rel:.2e}{'' if good else ' (FAIL)'}")
    return Comparison(ok, "fp4-near-exact", worst, "; ".join(notes))


class CompressorTile(Tile):
    """Pooling + RMSNorm + RoPE + FP4 main cache + index-K projection/norm/RoPE + FP4 index cache, one pass."""

    name = "compressor"
    description = "gated pooling, RMSNorm, RoPE, FP4 E4M3/16 main cache and fused 512->128 index-K (tf32x3 MMA) into FP4 E8M0/32"

    def shapes(self) -> list[Shape]:
        return compressor_shapes()

    def search_space(self, arch: Arch) -> SearchSpace:
        params = (
            Param("block_g", (16, 32, 64), "groups (cache entries) per CTA"),
            Param("threads", (128, 256, 512), "threads per CTA"),
            Param("proj", ("tf32x3", "simt"), "index-K projection: three TF32 tensor-core products, or fp32 FMA"),
            Param("k_chunk", (16, 32, 64), "K chunk of the projection staged through shared memory"),
            Param(
                "load",
                ("direct", "staged"),
                "kv/gate (and Wk chunks) by per-thread loads into registers, or by double-buffered bulk copies through shared memory",
            ),
            Param(
                "encode",
                ENCODES,
                "E2M1 codes: IEEE x / s and 7 midpoint comparisons, or the same codes division-free "
                "(|x| against exact per-scale fp32 bounds; index cache: x times the exact inverse power of two)",
            ),
            Param(
                "ctas_per_sm",
                (1, 2, 3),
                "CTAs resident per SM: 1 = the warp-specialised kernel (one CTA fills the SM); 2-3 = no producer "
                "warpgroup, registers and shared memory cut so that several CTAs share the SM and one CTA's kv/gate "
                "stream overlaps another's norm/encode/projection (staged tf32x3, 256 threads, k_chunk 16)",
            ),
            Param(
                "wk",
                WK_LOADS,
                "index-K weight from L2: the host-split TF32 high part + remainder (512 KiB per CTA), or (ctas_per_sm > 1) "
                "fp32 Wk split in shared memory (256 KiB per CTA, the same operands)",
            ),
            Param(
                "schedule",
                SCHEDULES,
                "one CTA per SM: the warp-specialised kernel, or the flat kernel of ctas_per_sm > 1 (for block_g 64: "
                "one pass over Wk per 64 groups, half the Wk bytes and splits per group); ctas_per_sm > 1 is flat",
            ),
            Param("wk_stages", (2, 3, 4), "flat kernel: Wk chunks (L2 round trips) in flight + 1 in the projection loop"),
            Param(
                "kv_load",
                KV_LOADS,
                "flat kernel, ratio 1: kv through 16-channel slabs (32 HBM round trips per CTA), or the block's rows "
                "straight into the latent buffer in one copy; 'direct' (both ratios): no slabs and no barriers, each "
                f"thread loads {DIRECT_ROWS} groups' kv/gate float4s into registers at once, then pools them",
            ),
            Param(
                "proj_operands",
                PROJ_OPERANDS,
                "flat kernel, tf32x3 projection: latent and Wk chunks split into TF32 high/low tiles in shared memory and "
                "read by T.gemm (ldmatrix, three barriers per chunk), or every operand in registers: each warp owns 16 "
                "output columns, reads its latent words from rot_s and its Wk words from L2 (host fragment order), splits "
                "each once and issues the same MMAs (no Wk stages, no barriers; wk=fp32, wk_stages 2); or (block_g 16) the "
                "transposed product on wgmma: Wk from registers as before, the latent split once per CTA into wgmma's "
                "shared layout instead of once per warp",
            ),
            Param(
                "proj_accumulators",
                PROJ_ACCUMULATORS,
                "register projection: the three TF32 products of an output tile in one accumulator (T.gemm's order), or "
                "the two small products in a second one added at the end (two independent MMA chains per tile)",
            ),
            Param(
                "pool_math",
                POOL_MATHS,
                "ratio 2's softmax over a group's two tokens: two accurate expf and two IEEE divisions (the reference's "
                "expression), or ex2.approx and one approximate reciprocal (a few ulps: within the one-code-step rule); "
                "no effect at ratio 1",
            ),
            Param(
                "proj_k_split",
                PROJ_K_SPLITS,
                "register projection: each warp covers all 512 k for 16 output columns (every warp reads and splits the "
                "whole latent), or half of them for 32 columns (half the latent reads and splits; the halves added in k_s)",
            ),
            Param(
                "norm_pass",
                NORM_PASSES,
                "kv_load=direct: RMSNorm as its own passes over rot_s (sum of squares, barrier, scale), or on the pooled "
                "rows in registers (one warp per row, a shuffle reduction) so that rot_s is written once, normalised",
            ),
            Param(
                "main_pass",
                MAIN_PASSES,
                "norm_pass=in_pool, encode=thresholds: RoPE and the main cache's amax, scale and codes as passes over rot_s "
                "(barriers between), or from the normalised rows in registers (the group max by two shuffles; the same bits)",
            ),
        )
        return SearchSpace(params, (Constraint("smem", _smem_compress), Constraint("occupancy", _occupancy_compress)))

    def default_config(self, arch: Arch) -> Config:
        # Hopper: the staged loads (bulk copies, double-buffered) with 32 groups per CTA and
        # 32-wide projection chunks so the two weight stages fit next to the kv/gate slabs; the
        # direct path measured 9% of copy bandwidth at prefill_r2_s64k (notes/indexer.md).
        # Elsewhere: the direct path with the largest tile that fits the per-block shared memory.
        # encode=thresholds on Hopper: the same bytes without divisions, H200, one run
        # (results/sm90/profile_pool_reindex_compressor_run1.json): prefill 64K ratio 2 0.426 -> 0.295 ms per call,
        # ratio 1 0.639 -> 0.490 ms. Not measured elsewhere: the direct path keeps "divide".
        # Then two CTAs per SM with Wk read once in fp32, H200, one run against the previous default
        # (results/sm90/profile_compressor_multi_cta_indexer_prmt_rs.json): ratio 2 0.294 -> 0.250 ms, ratio 1
        # 0.491 -> 0.375 ms (hi_lo Wk ran ratio 2 at 0.241 ms but was not run at ratio 1: a tuning choice).
        if arch.family == "hopper":
            cfg = {
                "block_g": 32,
                "threads": 256,
                "proj": "tf32x3",
                "k_chunk": 16,
                "load": "staged",
                "encode": "thresholds",
                "ctas_per_sm": 2,
                "wk": "fp32",
                "schedule": "flat",  # what two CTAs per SM run (no producer warpgroup)
                "wk_stages": 2,
                # The pooling's kv/gate straight from global memory into registers, no slabs and no barriers, H200, one
                # run against the slabs (results/sm90/profile_queued_session7b.json): ratio 2 0.2506 -> 0.2228 ms,
                # ratio 1 0.3762 -> 0.3499 ms at 64K.
                "kv_load": "direct",
                # The TF32x3 projection's operands from registers (the same MMAs on the same bits, ~6x fewer shared-memory
                # wavefronts), H200, one run against the shared-memory operands (results/sm90/profile_queued_session8.json):
                # prefill 64K ratio 2 0.2221 -> 0.1677 ms, ratio 1 0.3504 -> 0.2365 ms, decode B=64 ratio 2 0.0328 -> 0.0247 ms.
                "proj_operands": "registers",
                # Ratio 2's softmax by __expf and one approximate reciprocal (a few ulps, within the comparison rule), H200,
                # one run against the reference's expression (results/sm90/profile_compressor_pool_fast_session9.json):
                # prefill 64K ratio 2 0.1679 -> 0.1581 ms, decode B=64 ratio 2 0.0249 -> 0.0213 ms; main-cache bytes that
                # differ from the torch reference 2.4e-7 -> 4.8e-7 of them (at 64K).
                "pool_math": "fast",
                "proj_accumulators": "shared",
                # The RMSNorm on the pooled rows in registers (rot_s written once, no norm passes or barrier), H200, one
                # run against the separate passes (results/sm90/profile_compressor_norm_in_pool_session10.json): prefill
                # 64K ratio 2 0.1478 -> 0.1450 ms, ratio 1 0.2493 -> 0.2312 ms, decode B=64 ratio 2 0.0124 -> 0.0122 ms,
                # ratio 1 0.0119 -> 0.0109 ms (three CTAs of 16, below).
                "norm_pass": "in_pool",
                "proj_k_split": 1,
                "main_pass": "separate",  # "in_pool": NOT yet run on a GPU (gpu/session.sh queued)
            }
            # Then three CTAs per SM of 16 groups (what the fast pooling's registers allow with the direct loads), H200,
            # one run against two of 32 (results/sm90/profile_compressor_three_ctas_session9.json): prefill 64K ratio 2
            # 0.1584 -> 0.1487 ms, decode B=64 ratio 2 0.0213 -> 0.0124 ms; ratio 1 at 64K is 5% slower (0.2371 ->
            # 0.2489 ms: nothing to pool, so nothing to overlap), two CTAs of 32 stay its tuning candidate. Ratio 2 is
            # three of the four Full layers.
            cfg.update(block_g=16, ctas_per_sm=3)
            if _smem_compress(cfg, Shape("default", "any", {"ratio": 2}), arch) is None:
                return cfg
        for block_g, k_chunk in ((32, 64), (16, 64), (16, 32)):
            cfg = {"block_g": block_g, "threads": 256, "proj": "tf32x3", "k_chunk": k_chunk, "load": "direct", "encode": "divide"}
            cfg.update(ctas_per_sm=1, wk="hi_lo", schedule="ws", wk_stages=2, kv_load="slabs", proj_operands="smem", pool_math="ieee")
            cfg.update(proj_accumulators="shared", norm_pass="separate", proj_k_split=1, main_pass="separate")
            if _smem_compress(cfg, Shape("default", "any", {}), arch) is None:
                return cfg
        return cfg

    def candidates(self, arch: Arch, shape: Shape) -> list[tuple[Config, str]]:
        """Ratio 1 on Hopper: the flat kernel with 64 groups per CTA and the block's kv rows in one copy beat the
        default there (results/sm90/profile_queued_session6.json, same run: 0.327 / 0.349 vs 0.377 ms at
        prefill_r1_s64k); at ratio 2 block_g 64 was 2% slower and kv_load=whole does not exist. Not a default, which
        serves both ratios.
        Prefill at ratio 2 on Hopper: two CTAs of 32 with the k-split projection, 1.7% faster than the default in one run
        (results/sm90/profile_compressor_k_split_session10.json: 0.1418 vs 0.1443 ms at 64K); not a default (two CTAs of
        32 were 70% slower at decode, session 9). With ``main_pass="in_pool"`` on top: 0.1354 vs 0.1457 ms the default (session
        11, results/sm90/profile_compressor_main_pass_session11.json); main_pass alone was even at ratio 2 and slower
        at decode there."""
        if arch.family != "hopper":
            return []
        if shape.dims.get("ratio") == 2 and shape.phase == "prefill":
            return [
                ({"block_g": 32, "ctas_per_sm": 2, "proj_k_split": 2}, "r2 64K 0.1418 vs 0.1443 ms (H200, session 10)"),
                (
                    {"block_g": 32, "ctas_per_sm": 2, "proj_k_split": 2, "main_pass": "in_pool"},
                    "r2 64K 0.1354 vs 0.1457 ms the default (H200, session 11)",
                ),
            ]
        if shape.dims.get("ratio") != 1:
            return []
        return [
            ({"schedule": "flat", "block_g": 64, "kv_load": "whole", "wk_stages": 4}, "r1 64K 0.327 vs 0.377 ms (H200)"),
            ({"block_g": 32, "ctas_per_sm": 2, "kv_load": "whole", "wk_stages": 3}, "r1 64K 0.349 vs 0.377 ms (H200)"),
            (
                {"block_g": 32, "ctas_per_sm": 2},
                "r1 64K 0.2251 vs 0.2312 ms at three CTAs of 16, both norm_pass=in_pool (H200, session 10)",
            ),
            (
                {"block_g": 32, "ctas_per_sm": 2, "proj_accumulators": "split"},
                "r1 64K 0.2115 vs 0.2251 ms with one accumulator, 0.2312 the default (H200, session 10, norm_pass=in_pool)",
            ),
            ({"block_g": 32, "ctas_per_sm": 2, "proj_k_split": 2}, "r1 64K 0.2147 vs 0.2292 ms the default (H200, session 10)"),
            ({"main_pass": "in_pool"}, "r1 64K 0.2260 vs 0.2317 ms the default (H200, session 11)"),
        ]

    def with_defaults(self, arch: Arch, config: Config) -> Config:
        """``config`` over the default. A config that picks a one-CTA choice (direct loads, simt, other threads,
        block_g or k_chunk, schedule="ws") without naming ``ctas_per_sm`` gets the one-CTA kernel (ctas_per_sm 1,
        Wk hi/lo, k_chunk 32 unless named), as it did before two CTAs per SM became Hopper's default: {"load":
        "direct"} alone is valid.
        With ``schedule="flat"`` named (e.g. {"schedule": "flat", "block_g": 64}) it gets the flat kernel at one CTA per
        SM and keeps the default's k_chunk 16 and wk."""
        cfg = {**self.default_config(arch), **config}
        multi_cta_ok = cfg["load"] == "staged" and cfg["proj"] == "tf32x3" and cfg["threads"] == 256
        multi_cta_ok = multi_cta_ok and cfg["block_g"] in (16, 32) and cfg["k_chunk"] == MULTI_CTA_CHUNK
        multi_cta_ok = multi_cta_ok and cfg.get("schedule", "flat") == "flat"
        if "ctas_per_sm" not in config and cfg.get("ctas_per_sm", 1) > 1 and not multi_cta_ok:
            if config.get("schedule") == "flat":
                # The flat kernel at one CTA per SM (e.g. block_g 64): the default's flat-kernel choices stay.
                cfg.update(ctas_per_sm=1)
            else:
                cfg.update(ctas_per_sm=1, wk=config.get("wk", "hi_lo"), k_chunk=config.get("k_chunk", 32), schedule="ws")
                cfg.update(kv_load=config.get("kv_load", "slabs"))  # the ws kernel streams kv through slabs
        if "ctas_per_sm" not in config and cfg["block_g"] == 32 and cfg.get("ctas_per_sm", 1) == 3:
            cfg["ctas_per_sm"] = 2  # 32 groups fit two CTAs per SM, not the default's three
        if "ctas_per_sm" not in config and "block_g" not in config and cfg.get("ctas_per_sm", 1) == 3:
            # What the three CTAs cannot run with (e.g. pool_math="ieee" with the direct loads: spills) gets the two CTAs
            # of 32 of the default before session 9.
            r2, two = Shape("default", "any", {"ratio": 2}), {**cfg, "block_g": 32, "ctas_per_sm": 2}
            if _occupancy_compress(cfg, r2, arch) is not None and _occupancy_compress(two, r2, arch) is None:
                cfg.update(block_g=32, ctas_per_sm=2)
        if "proj_operands" not in config and cfg.get("proj_operands") == "registers" and _proj_registers_refusal(cfg, _schedule(cfg)):
            cfg["proj_operands"] = "smem"  # what the picked choices leave the register operands unable to run with
        if "norm_pass" not in config and cfg.get("norm_pass") == "in_pool" and cfg.get("kv_load") != "direct":
            cfg["norm_pass"] = "separate"  # the pooled rows are in registers only with the direct loads
        if "main_pass" not in config and cfg.get("main_pass") == "in_pool" and cfg["norm_pass"] != "in_pool":
            cfg["main_pass"] = "separate"  # and only then can the main cache be encoded from them
        return cfg

    def build(self, shape: Shape, config: Config, arch: Arch):
        return _build(arch, shape["ratio"], self.with_defaults(arch, config))

    def make_inputs(self, shape: Shape, seed: int, device="cuda") -> Inputs:
        B, S, ratio = shape["B"], shape["S"], shape["ratio"]
        gen = torch.Generator(device=device).manual_seed(seed)
        G = S // ratio
        kv = torch.randn(B, S, D, generator=gen, device=device)  # [B, S, D]
        gate = torch.randn(B, S, D, generator=gen, device=device) * 2  # [B, S, D]
        first = int(torch.randint(0, 4096, (1,), generator=gen, device=device))  # groups already in the cache
        rope = _rope()
        cos, sin = rope_tables(rope, (torch.arange(G, device=device) + first) * ratio)  # [G, 32]
        return {
            "kv": kv,
            "gate": gate,
            "norm_weight": 1 + 0.1 * torch.randn(D, generator=gen, device=device),
            "wk": torch.randn(DI, D, generator=gen, device=device) * D**-0.5,
            "k_norm_weight": 1 + 0.1 * torch.randn(DI, generator=gen, device=device),
            "cos": cos,
            "sin": sin,
            "first_group": torch.tensor([first]),
            "ratio": torch.tensor([ratio]),
        }

    def alloc_outputs(self, kernel, inputs: Inputs) -> dict[str, torch.Tensor]:
        kv, ratio = inputs["kv"], int(inputs["ratio"])
        B, S, _ = kv.shape
        G = S // ratio
        return {
            "main_packed": poisoned((B, G, D // 2), torch.uint8, kv.device),  # [B, G, 256]
            "main_scales": poisoned((B, G, D // MAIN_GROUP), torch.uint8, kv.device),  # [B, G, 32]
            "idx_packed": poisoned((B, G, DI // 2), torch.uint8, kv.device),  # [B, G, 64]
            "idx_scales": poisoned((B, G, DI // INDEX_GROUP), torch.uint8, kv.device),  # [B, G, 4]
        }

    def launch(self, kernel, inputs: Inputs, outputs: dict[str, torch.Tensor]) -> None:
        kv, ratio = inputs["kv"], int(inputs["ratio"])
        if "eps" not in inputs:  # a per-layer constant, made once per input set (the prepared Wk forms: _prepared_forms)
            inputs["eps"] = torch.tensor([flash().norm_eps], dtype=torch.float32, device=kv.device)
        gate = kv if ratio == 1 else inputs["gate"]
        wk_hi, wk_lo = _wk_args(kernel, inputs["wk"], _prepared_forms(inputs["wk"]))  # fp32 wk: no copy
        args = (
            inputs["norm_weight"],
            inputs["cos"],
            inputs["sin"],
            wk_hi,
            wk_lo,
            inputs["k_norm_weight"],
            inputs["eps"],
        )
        kernel(kv, gate, *args, outputs["main_packed"], outputs["main_scales"], outputs["idx_packed"], outputs["idx_scales"])

    def reference(self, inputs: Inputs) -> dict[str, torch.Tensor]:
        ratio, first = int(inputs["ratio"]), int(inputs["first_group"])
        gate = inputs["gate"] if ratio == 2 else None
        eps = flash().norm_eps
        latent = compressor_entries(inputs["kv"], gate, ratio, inputs["norm_weight"], first, _rope(), eps)  # [B, G, D]
        k = index_keys(latent, inputs["wk"], inputs["k_norm_weight"], first, ratio, _rope(), eps)  # [B, G, Di]
        mp, ms = formats.fp4_quantize(latent, MAIN_GROUP, "e4m3")
        ip, is_ = formats.fp4_quantize(k, INDEX_GROUP, "e8m0")
        return {"main_packed": mp, "main_scales": ms, "idx_packed": ip, "idx_scales": is_}

    def compare(self, outputs, expected) -> Comparison:
        return compare_fp4_caches(outputs, expected)

    def flops(self, shape: Shape) -> float:
        G = shape["B"] * shape["S"] // shape["ratio"]
        return 2.0 * G * D * DI

    def bytes_moved(self, shape: Shape) -> float:
        # kv (and gate for ratio 2) read once, both caches written once; weights are noise.
        B, S, ratio = shape["B"], shape["S"], shape["ratio"]
        G = S // ratio
        return B * S * D * 4 * (2 if ratio == 2 else 1) + B * G * (D // 2 + D // MAIN_GROUP + DI // 2 + DI // INDEX_GROUP)


def _rope() -> RopeConfig:
    cfg = flash()
    return RopeConfig(
        cfg.rope_dim, cfg.compress_rope_theta, cfg.yarn_factor, cfg.yarn_original_seq_len, cfg.yarn_beta_fast, cfg.yarn_beta_slow
    )


def _proj_registers_refusal(config: Config, schedule: str) -> str | None:
    """Why proj_operands="registers" (or "wgmma", which reads Wk the same way) cannot run with ``config`` (whose kernel
    is ``schedule``), or None."""
    name = f"proj_operands={config.get('proj_operands', 'registers')}"
    if schedule != "flat":
        return f"{name} exists only in the flat kernel (ctas_per_sm > 1 or schedule=flat)"
    if config.get("wk", "hi_lo") != "fp32":
        return f"{name} reads fp32 Wk (in fragment order) from L2: it needs wk=fp32"
    if config.get("kv_load", "slabs") == "whole":
        return f"{name} pads rot_s's rows (conflict-free fragment reads): kv_load=whole's one copy is not built"
    if config.get("wk_stages", 2) != 2:
        return f"{name} has no Wk pipeline in shared memory: wk_stages must stay 2"
    if config.get("proj_operands") == "wgmma" and config.get("block_g") != 16:
        return "proj_operands=wgmma is built for block_g 16 (the latent's high and low parts in wgmma's layout: three CTAs per SM)"
    return None


def _occupancy_compress(config: Config, shape: Shape, arch: Arch) -> str | None:
    """The flat kernel (``ctas_per_sm`` > 1, or ``schedule="flat"`` at one CTA per SM) and its values (``k_chunk`` 16,
    ``wk`` fp32, ``wk_stages`` 3-4, ``kv_load`` whole or direct) exist for the builds checked with ptxas (sm_90a).

    256 threads x 2 CTAs leave 128 registers a thread (ptxas: 88-102 at block_g 32, no spills), x 3 CTAs 85 (56-77 at
    block_g 16); one flat CTA of block_g 64 took 102-150, no spills. The staged kv/gate path and the pipelined tf32x3
    projection are the code it was cut from, and k_chunk 16 is what makes the Wk stages small enough (k_chunk 32 asked
    for 154,112 B at block_g 32, ratio 2). The shared memory itself is judged by :func:`_smem_compress`.
    ``proj_operands="registers"`` (ptxas, no spills): 117 / 109 registers at block_g 32, 2 CTAs (ratio 2 / 1, direct),
    79-80 at block_g 16, 3 CTAs (slabs; direct at ratio 1), 118-146 at block_g 64, one CTA.
    """
    config = {"block_g": 32, "threads": 256, "proj": "tf32x3", "k_chunk": 64, "load": "direct", **config}  # partial: judged with defaults
    n = config.get("ctas_per_sm", 1)
    schedule = config.get("schedule", "flat" if n > 1 else "ws")
    if schedule not in SCHEDULES:
        return f"unknown schedule {schedule!r}"
    if n > 1 and schedule != "flat":
        return f"ctas_per_sm {n} is the flat kernel (no producer warpgroup): schedule=ws exists only at one CTA per SM"
    kv_load = config.get("kv_load", "slabs")
    if kv_load == "whole" and shape.dims.get("ratio") != 1:
        return "kv_load=whole exists for ratio 1 only (ratio 2 pools pairs of tokens through the slabs)"
    if kv_load not in KV_LOADS:
        return f"unknown kv_load {kv_load!r}: use one of {', '.join(KV_LOADS)}"
    proj_operands = config.get("proj_operands", "smem")
    if proj_operands not in PROJ_OPERANDS:
        return f"unknown proj_operands {proj_operands!r}: use one of {', '.join(PROJ_OPERANDS)}"
    if proj_operands in ("registers", "wgmma") and (why := _proj_registers_refusal(config, schedule)):
        return why
    if config.get("proj_accumulators", "shared") not in PROJ_ACCUMULATORS:
        return f"unknown proj_accumulators {config['proj_accumulators']!r}: use one of {', '.join(PROJ_ACCUMULATORS)}"
    if config.get("proj_accumulators", "shared") == "split" and proj_operands != "registers":
        return "proj_accumulators=split exists in the register projection only (proj_operands=registers)"
    k_split = config.get("proj_k_split", 1)
    if k_split not in PROJ_K_SPLITS:
        return f"unknown proj_k_split {k_split!r}: use one of {', '.join(map(str, PROJ_K_SPLITS))}"
    if k_split == 2 and (proj_operands != "registers" or config.get("proj_accumulators", "shared") != "shared"):
        return "proj_k_split=2 exists in the register projection with one accumulator (proj_operands=registers, proj_accumulators=shared)"
    norm_pass = config.get("norm_pass", "separate")
    if norm_pass not in NORM_PASSES:
        return f"unknown norm_pass {norm_pass!r}: use one of {', '.join(NORM_PASSES)}"
    if norm_pass == "in_pool" and kv_load != "direct":
        return "norm_pass=in_pool normalises the direct loads' pooled rows in registers: it needs kv_load=direct"
    main_pass = config.get("main_pass", "separate")
    if main_pass not in MAIN_PASSES:
        return f"unknown main_pass {main_pass!r}: use one of {', '.join(MAIN_PASSES)}"
    if main_pass == "in_pool" and (norm_pass != "in_pool" or config.get("encode", "divide") != "thresholds"):
        return "main_pass=in_pool encodes the normalised rows in registers: it needs norm_pass=in_pool and encode=thresholds"
    if kv_load == "direct" and n > 2 and shape.dims.get("ratio", 2) == 2 and config.get("pool_math", "ieee") == "ieee":
        # ptxas: 80 registers (the cap of 3 x 256 threads) and 36-40 bytes of spills at block_g 16, ratio 2, with the
        # reference's pooling expression; pool_math="fast" compiles to 80 registers without spills (session 9).
        return "kv_load=direct at ratio 2 holds 16 float4s per thread: with pool_math=ieee it spills at 3 CTAs per SM (use ctas_per_sm 1-2 or pool_math=fast)"
    if schedule == "ws":
        # The new values came with the flat kernel and were compiled and checked only there.
        if config.get("wk", "hi_lo") == "fp32":
            return "wk=fp32 exists only in the flat kernel (ctas_per_sm > 1 or schedule=flat)"
        if config.get("wk_stages", 2) != 2 or kv_load != "slabs":
            return "wk_stages 3-4 and kv_load=whole/direct exist only in the flat kernel (ctas_per_sm > 1 or schedule=flat)"
        return "k_chunk 16 exists only in the flat kernel (ctas_per_sm > 1 or schedule=flat)" if config["k_chunk"] == 16 else None
    if arch.family != "hopper":
        return f"ctas_per_sm {n} (the flat kernel) is built and checked for Hopper (sm_90a) only"
    # block_g 64 only at one CTA per SM (its rot_s alone is 128 KiB); 16 only at 3 (what was compiled and checked).
    groups = (16, 32) if n > 1 else (32, 64)
    want = {"load": ("staged",), "proj": ("tf32x3",), "threads": (256,), "k_chunk": (16,), "block_g": groups}
    wrong = [f"{k}={config[k]!r}" for k, ok in want.items() if config[k] not in ok]
    if wrong:
        g = " or ".join(map(str, groups))
        return f"ctas_per_sm {n} (flat) needs load=staged, proj=tf32x3, threads=256, k_chunk=16, block_g {g} (got {', '.join(wrong)})"
    return None


def _smem_flat(config: Config, ratio: int) -> int:
    """Dynamic shared memory of the flat kernel (B), fitted to the compiled kernels (sm_90a, TileLang 0.1.15, k_chunk 16,
    no static shared memory; tests/test_compressor.py checks it against the launch of every build in FLAT_BUILDS).

    rot_s, the gate slabs (the kv slabs share bytes with the Wk stages), four Wk-sized stages, a_lo and the small
    per-group arrays: exact at block_g 32 ratio 2/1 = 115,200/102,912 B and block_g 16 = 74,240/68,096 B. Each Wk
    stage past two adds one [128, k_chunk] fp32 tile (wk=fp32: the raw chunk) or two (hi_lo: both halves); block_g 64
    adds 2 KiB of the allocator's packing (174,592 B at ratio 1, 199,168 B at ratio 2). kv_load=whole changes nothing:
    the kv slabs it drops shared their bytes with the Wk stages; kv_load=direct also drops the gate slabs (its
    kv/gate rows are registers), so ratio 2 needs what ratio 1 does (102,912 B at block_g 32).
    """
    bg, kc = config["block_g"], config["k_chunk"]
    if config.get("proj_operands", "smem") in ("registers", "wgmma"):
        # rot_s with padded rows, k_s (the projection's result, written while rot_s is read; "wgmma": the latent's
        # remainder [block_g, 512], which k_s then reuses) and 2,560 B of small arrays; no Wk stages or split tiles, so
        # kv_load=slabs adds all its slabs (kv and gate, three stages each). Exact at block_g 16/32/64, ratio 1/2,
        # kv_load slabs/direct (tests/test_compressor.py).
        n_slabs = 0 if config.get("kv_load", "slabs") != "slabs" else (2 if ratio == 2 else 1)
        slab = MULTI_CTA_STAGES * ratio * bg * MULTI_CTA_CHUNK * 4
        k_s = bg * (D if config["proj_operands"] == "wgmma" else DI) * 4
        return 2560 + bg * (D + ROT_PAD) * 4 + k_s + n_slabs * slab
    slabs = ratio == 2 and config.get("kv_load", "slabs") != "direct"
    gate_slabs = MULTI_CTA_STAGES * 2 * bg * MULTI_CTA_CHUNK * 4 if slabs else 0
    need = bg * D * 4 + gate_slabs + 4 * DI * kc * 4 + 8 * bg * kc + 512
    per_stage = DI * kc * 4 * (1 if config.get("wk", "hi_lo") == "fp32" else 2)
    return need + (config.get("wk_stages", 2) - 2) * per_stage + (2048 if bg == 64 else 0)


def _smem_compress(config: Config, shape: Shape, arch: Arch) -> str | None:
    config = {"block_g": 32, "threads": 256, "proj": "tf32x3", "k_chunk": 64, "load": "direct", **config}  # partial: judged with defaults
    bg, kc = config["block_g"], config["k_chunk"]
    staged = config["load"] == "staged"
    ratio = shape.dims.get("ratio", 2)  # unknown ratio: count the larger ratio-2 staging
    n = config.get("ctas_per_sm", 1)
    if n > 1 or config.get("schedule") == "flat":
        # Every CTA also costs the 1 KiB the hardware reserves per block. Other k_chunk values are refused by
        # _occupancy_compress.
        need = _smem_flat(config, ratio)
        budget = min(arch.smem_per_sm // n - 1024, arch.smem_per_block)
        return None if need <= budget else f"shared memory {need} B > {budget} B per CTA at {n} CTAs per SM"
    need = (
        bg * D * 4
        + D * 4
        + bg * (D // MAIN_GROUP) * 5
        + bg * D // 2
        + bg * DI * 4
        + DI * 4
        + bg * DI // 2
        + 2 * bg * kc * 4
        + 2 * DI * kc * 4
    )
    if config["proj"] == "tf32x3":
        # Fitted to the dynamic shared memory of the compiled kernels (sm_90a, TileLang 0.1.15; exact at block_g
        # 16/32 x k_chunk 32/64): the sum above misses the split-precision copies of the Wk chunks, and the
        # staged pipeline keeps six Wk stages. On the H200 a (16, 64) staged config asked for 311 KiB and failed.
        need = -1024 + 2304 * bg + 1024 * kc + 12 * bg * kc
        if staged:
            need += 6 * DI * kc * 4 + 384 * bg + 2048
    elif staged:  # two pipeline stages of the kv (and gate) slabs
        slabs = 2 if ratio == 2 else 1
        need += 2 * slabs * bg * ratio * LOAD_CHUNK * 4
    # The fit is exact at 256 threads; at 128 it missed 1.5 KiB (block_g 32, k_chunk 32, staged: 230,400 B fitted,
    # 231,936 B asked) and on the H200 that request failed at launch, twice (results/sm90/tune_session8*/). Below 256
    # threads 3 KiB stay clear of the limit (the 256-thread builds of the same size launch: GPU tests, session 8).
    budget = arch.smem_per_block - (3072 if config["threads"] < 256 else 0)
    return None if need <= budget else f"shared memory {need // 1024} KiB > {budget // 1024} KiB"


COMPRESSOR = CompressorTile()
TILES = [COMPRESSOR]
