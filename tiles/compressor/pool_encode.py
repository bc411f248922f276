"""The pooling and the FP4 encode: E2M1 codes (divide or threshold search, bit-exact with the reference), the ratio-2
softmax pooling of a group's two tokens, and the main cache written from the pooled rows in registers."""

import tilelang.language as T

from tiles.compressor.common import LOAD_CHUNK, D
from tiles.compressor.space import POOL_MATHS
from tiles.core.contract import TileError


def e2m1_code(v):
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


def bounds_cuda() -> str:
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


def e2m1_code_search(v):
    """fp32 ``v`` (already divided by its scale, unclamped) -> E2M1 code like :func:`e2m1_code`, by the 3-level search.

    The clamp to [-6, 6] changes no code (|v| > 6 passes every midpoint either way, NaN none, the sign stays).
    """
    a = T.abs(v)
    ge4 = a >= 1.75
    ge2 = a >= T.if_then_else(ge4, T.float32(3.5), T.float32(0.75))
    odd = a > T.if_then_else(
        ge4, T.if_then_else(ge2, T.float32(5.0), T.float32(2.5)), T.if_then_else(ge2, T.float32(1.25), T.float32(0.25))
    )
    return T.if_then_else(ge4, 4, 0) | T.if_then_else(ge2, 2, 0) | T.if_then_else(odd, 1, 0) | T.if_then_else(v < 0, 8, 0)


def pool_pair(x0, x1, kv0, kv1, pool_math: str):
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


# kv_load="direct" with norm_pass="in_pool" at two CTAs an SM or fewer: one token's row of kv or gate into the registers
# of the warp that pools it (lane l: columns 128 j + 4 l .. + 3 into v[4 j ..], the one-warp-per-row layout), by
# ld.global.nc.L1::no_allocate (the non-coherent path is valid: the kernel never writes kv or gate). Each byte is read
# once, by one lane, so caching the stream in L1 only evicts what is reused there (Wk's fragments, the norm weights).
# H200, the same call (3a9eff8): ratio 2 at 64K, two CTAs of 32 0.1164 -> 0.1094 ms. Not at three CTAs an SM: within
# their 80 registers ptxas spilled 152-196 B at ratio 2 (0.1146 -> 0.1387 ms, decode 0.0091 -> 0.0114), and decode
# ratio 1 ran 3% slower.
ROW_LOAD_CUDA = r"""
__device__ __forceinline__ void csa2_load_row_stream(const float* __restrict__ row, float* v) {
  const float4* p = reinterpret_cast<const float4*>(row) + (threadIdx.x & 31);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    asm("ld.global.nc.L1::no_allocate.v4.f32 {%0, %1, %2, %3}, [%4];"
        : "=f"(v[4 * j]), "=f"(v[4 * j + 1]), "=f"(v[4 * j + 2]), "=f"(v[4 * j + 3])
        : "l"(p + 32 * j));
  }
}
"""


# main_pass="in_pool" (with norm_pass="in_pool"): the main cache from the normalised rows while they are in registers.
# Lane l of warp w holds row w of the 8-row batch at columns 128 j + 4 l .. + 3 (j = 0..3: v[4 j ..], the annotated
# one-warp-per-row layout). It stores the latent into rot *before* RoPE (the index-K projection reads the unrotated
# latent), applies the RoPE to its pairs (lanes 16-31 at j = 3: columns 448 + 4 (l - 16) ..), takes each 16-value group's
# |x| max over the group's four lanes
# (two xor shuffles), its E4M3 scale (the separate pass's expression, the same fp8 cast), and writes its two packed
# bytes per j; the group's first lane writes the scale byte. The separate RoPE, amax, scale and encode passes (each a
# sweep of rot_s, with barriers between) are gone; the arithmetic is theirs, expression for expression. bytes_row and
# sbyte_row: the row in shared memory (bulk stores copy it out) or in the cache itself (main_store="registers");
# ``store`` false (a row past the last group, which the bulk stores mask) writes neither. The RoPE coefficients come from
# csa2_rope_coeffs, called before the batch's kv/gate loads: when this function loaded them itself, right before their
# use, the wait held 9% of the pooling phase's stall samples (Nsight on the H200, 887c37c).
MAIN_FROM_ROWS_CUDA = r"""
#include <tl_templates/cuda/cuda_fp8.h>  // fp8_e4_t, the type TileLang's own scale cast uses (imported sources come first)
// Lanes 16-31 of the warp of row grow: (cos, sin) of pairs p = 2 (lane - 16) and p + 1 (cos/sin [G, 32]) into rc[0..3].
__device__ __forceinline__ void csa2_rope_coeffs(const float* __restrict__ cs, const float* __restrict__ sn, int grow, float* rc) {
  const int lane = threadIdx.x & 31;
  if (lane >= 16) {
    const int p = 2 * (lane - 16);
    const float2 c = *reinterpret_cast<const float2*>(cs + grow * 32 + p), s = *reinterpret_cast<const float2*>(sn + grow * 32 + p);
    rc[0] = c.x;
    rc[1] = s.x;
    rc[2] = c.y;
    rc[3] = s.y;
  }
}
__device__ __forceinline__ void csa2_main_from_rows(const float* v_in, const float* rc, float* rot_row, unsigned char* bytes_row,
                                                    unsigned char* sbyte_row, bool store) {
  const int lane = threadIdx.x & 31;
  float v[16];
#pragma unroll
  for (int k = 0; k < 16; ++k) v[k] = v_in[k];
#pragma unroll
  for (int j = 0; j < 4; ++j)  // the pre-RoPE latent, for the index-K projection
    *reinterpret_cast<float4*>(rot_row + 128 * j + 4 * lane) = make_float4(v[4 * j], v[4 * j + 1], v[4 * j + 2], v[4 * j + 3]);
  if (lane >= 16) {  // RoPE of pairs p and p + 1 at the group's first position (rc: csa2_rope_coeffs)
    const float c0 = rc[0], s0 = rc[1], c1 = rc[2], s1 = rc[3];
    // Rounded as TileLang's separate RoPE pass compiles (its SASS, nvcc 13: ev * c fused onto the rounded od * s,
    // od * c onto the rounded ev * s), so the main cache is byte-identical to it; left to nvcc, the products fused
    // here differed (H200, 6eddb42: rare code differences at 64K).
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
    float a = 0.0f;
#pragma unroll
    for (int e = 0; e < 4; ++e) a = max(a, fabsf(v[4 * j + e]));
    a = max(a, __shfl_xor_sync(0xffffffffu, a, 1));
    a = max(a, __shfl_xor_sync(0xffffffffu, a, 2));
    const float raw = min((max(a, 0x1.8p-7f) / 0x1.8p+2f), 0x1.cp+8f);
    fp8_e4_t code8 = (fp8_e4_t)raw;
    const float s = (float)code8;
    if (store && (lane & 3) == 0) sbyte_row[8 * j + (lane >> 2)] = *(unsigned char*)(&code8);
    const unsigned lo = csa2_e2m1_pair_bounded(v[4 * j], v[4 * j + 1], s) & 0xFFu;
    const unsigned hi = csa2_e2m1_pair_bounded(v[4 * j + 2], v[4 * j + 3], s) & 0xFFu;
    if (store) *reinterpret_cast<unsigned short*>(bytes_row + 64 * j + 2 * lane) = static_cast<unsigned short>(lo | (hi << 8));
  }
}
"""


def main_from_rows_f16_split_cuda() -> str:
    """``proj_latent="f16_split"``: :data:`MAIN_FROM_ROWS_CUDA` as ``csa2_main_from_rows_f16``, which stores the pre-RoPE
    latent into its row of rot_s as fp16 high parts and remainders (``csa2_store_f16_split``, once per value) instead of
    fp32: the split that every projection warp otherwise makes of what it reads. The main cache is the same code."""
    # the include and csa2_rope_coeffs come once, from the fp32 variant
    src = MAIN_FROM_ROWS_CUDA[MAIN_FROM_ROWS_CUDA.index("__device__ __forceinline__ void csa2_main_from_rows(") :]
    old = "*reinterpret_cast<float4*>(rot_row + 128 * j + 4 * lane) = make_float4(v[4 * j], v[4 * j + 1], v[4 * j + 2], v[4 * j + 3]);"
    new = "csa2_store_f16_split(rot_row, 128 * j + 4 * lane, v[4 * j], v[4 * j + 1], v[4 * j + 2], v[4 * j + 3]);"
    for before, after in ((old, new), ("void csa2_main_from_rows(", "void csa2_main_from_rows_f16(")):
        if src.count(before) != 1:  # the shared source changed under this derivation
            raise RuntimeError(f"MAIN_FROM_ROWS_CUDA no longer has exactly one {before!r}: update main_from_rows_f16_split_cuda")
        src = src.replace(before, after)
    return src


@T.macro
def staged_pool(
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
                rot_s[i, dc * chunk + d] = pool_pair(x0, x1, kv_s[2 * i, d], kv_s[2 * i + 1, d], pool_math)
