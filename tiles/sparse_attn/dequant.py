"""Dequantisation of the gathered rows: E2M1/E8M0 decode as TileLang expressions (the pipelined schedule), and the
packed-integer CUDA helpers the ws producer includes into the kernel source (FP8 window words, FP4 main words by
shifts and multiplies or by byte-permute lookups)."""

import tilelang.language as T

from tiles.fp4.kernel import PRMT_ASM_CUDA


def e2m1_value(nib):
    """E2M1 code (int32, 0..15) -> float32 value (0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 the sign), branch-free.

    Codes 2..7 are normal numbers whose exponent and mantissa bits are the code's ``e m`` bits moved into
    place with the exponent rebased (126 = 127 - 1); codes 0 and 1 (0 and 0.5) are picked directly.
    """
    m = nib & 7
    normal = T.shift_left(m, 22) + (126 << 23)
    small = T.if_then_else(m == 1, 0x3F000000, 0)
    mag = T.reinterpret(T.if_then_else(m >= 2, normal, small), "float32")
    return T.if_then_else(nib >= 8, -mag, mag)


def e8m0_value(byte):
    """E8M0 byte -> float32 2^(byte - 127), built from the exponent bits (exact, no exp2 rounding)."""
    return T.reinterpret(T.shift_left(T.cast(byte, "int32"), 23), "float32")


# Packed-integer dequantisation for the batched producer (CUDA, included into the kernel source). Each helper
# turns a 32-bit word of codes into bf16x2 words with shifts and masks plus two exact bf16x2 multiplies,
# ~3.5 instructions per value against ~15 for the per-value float path.
#
# The trick: a code's magnitude bits are placed straight into the bf16 exponent/mantissa field, which
# encodes value * 2^-126 (E2M1) or value * 2^-120 (E4M3): the smallest nonzero codes (E2M1 0.5, E4M3
# subnormals) land on bf16 subnormals, which fma.rn.bf16x2 keeps (there is no flush-to-zero for bf16).
# One multiply by 2^126 (2^120) restores the value exactly, a second by the scale gives value * scale,
# exact because e2m1 x e4m3 needs 6 significant bits and e4m3 x 2^k needs 4 (bf16 has 8). E4M3 NaN
# codes (0x7F/0xFF) decode as +-480 here: the quantiser writes them only for NaN inputs.
_DEQUANT_CUDA = r"""
__device__ __forceinline__ unsigned csa2_bf16x2_mul(unsigned a, unsigned b) {
  unsigned d;  // a * b + (-0): the exact product, signed zeros kept
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
}
// E2M1 codes in bits 0-3 and 16-19 -> bf16x2 of value * 2^-126.
__device__ __forceinline__ unsigned csa2_e2m1x2(unsigned y) {
  return ((y << 6) & 0x01C001C0u) | ((y << 12) & 0x80008000u);
}
// E4M3 codes in bytes 0 and 2 -> bf16x2 of value * 2^-120.
__device__ __forceinline__ unsigned csa2_e4m3x2(unsigned y) {
  return ((y << 4) & 0x07F007F0u) | ((y << 8) & 0x80008000u);
}
// E4M3 scale byte -> its value as a bf16x2 pair (exact).
__device__ __forceinline__ unsigned csa2_e4m3_scale2(unsigned b) {
  unsigned x = csa2_bf16x2_mul(csa2_e4m3x2(b & 0xFFu), 0x7B807B80u) & 0xFFFFu;  // * 2^120
  return x | (x << 16);
}
// E8M0 scale byte -> 2^(b - 127) as a bf16x2 pair (0: the subnormal 2^-127, 255: NaN).
__device__ __forceinline__ unsigned csa2_e8m0_scale2(unsigned b) {
  unsigned x = b == 0u ? 0x0040u : (b == 255u ? 0x7FC0u : (b << 7));
  return x | (x << 16);
}
// 8 FP4 codes (code k in bits 4k..4k+3 of w) times a bf16x2 scale pair -> 8 bf16 in order at dst.
__device__ __forceinline__ void csa2_fp4x8_bf16(void* dst, int w, unsigned scale2) {
  const unsigned u = (unsigned)w;
  unsigned t[4];  // t[k] holds codes k and k + 4
#pragma unroll
  for (int k = 0; k < 4; ++k) t[k] = csa2_bf16x2_mul(csa2_bf16x2_mul(csa2_e2m1x2(u >> (4 * k)), 0x7E807E80u), scale2);
  uint4 o;
  o.x = __byte_perm(t[0], t[1], 0x5410);
  o.y = __byte_perm(t[2], t[3], 0x5410);
  o.z = __byte_perm(t[0], t[1], 0x7632);
  o.w = __byte_perm(t[2], t[3], 0x7632);
  *reinterpret_cast<uint4*>(dst) = o;
}
// 4 E4M3 codes (byte k of w) times a bf16x2 scale pair -> 4 bf16 in order at dst.
__device__ __forceinline__ void csa2_e4m3x4_bf16(void* dst, int w, unsigned scale2) {
  const unsigned u = (unsigned)w;
  const unsigned t02 = csa2_bf16x2_mul(csa2_bf16x2_mul(csa2_e4m3x2(u), 0x7B807B80u), scale2);
  const unsigned t13 = csa2_bf16x2_mul(csa2_bf16x2_mul(csa2_e4m3x2(u >> 8), 0x7B807B80u), scale2);
  uint2 o;
  o.x = __byte_perm(t02, t13, 0x5410);
  o.y = __byte_perm(t02, t13, 0x7632);
  *reinterpret_cast<uint2*>(dst) = o;
}
"""

# fp4_decode="prmt": csa2_fp4x8_bf16's 8 bf16 by byte-permute table lookups (the indexer's prmt dequant, tiles/indexer/dequant.py,
# with constant tables: the scale here is E4M3, not a power of two, so it is applied afterwards by the same exact
# multiply). The 8 E2M1 magnitudes' bf16 patterns (0, 0.5, 1, 1.5, 2, 3, 4, 6: 0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000,
# 0x4040, 0x4080, 0x40C0) split into a low-byte table (00 00 80 C0 00 40 80 C0) and a high-byte table (00 3F 3F 3F
# 40 40 40 40), two registers each; a word's masked codes (bit 3, prmt's sign-replicate flag, cleared) select from them,
# 4 nibbles per prmt. Per word: mask, shift, shift, 4 lookups, 2 sign merges (prmt of w and w << 4, masked, or'ed into
# the high bytes), 4 interleaves, 4 multiplies by the scale pair: ~19 instructions against ~28. The looked-up bf16 is
# bit for bit csa2_fp4x8_bf16's intermediate (the pattern times 2^126, exact, signed zeros kept), and the scale
# multiply is the same fma, so the output is identical for every code and every scale pair
# (tests/test_sparse_attn.py emulates both exhaustively).
_FP4_PRMT_CUDA = (
    PRMT_ASM_CUDA
    + r"""
// 8 FP4 codes (code k in bits 4k..4k+3 of w) times a bf16x2 scale pair -> 8 bf16 in order at dst (= csa2_fp4x8_bf16).
__device__ __forceinline__ void csa2_fp4x8_bf16_prmt(void* dst, int w, unsigned scale2) {
  const unsigned u = (unsigned)w;
  const unsigned m = u & 0x77777777u;                    // magnitude codes: the lookup selectors
  unsigned mh;
  asm("shr.b32 %0, %1, 16;" : "=r"(mh) : "r"(m));       // codes 4..7 (opaque: else nvcc re-masks u for it)
  const unsigned u4 = u << 4;
  const unsigned l0 = csa2_prmt(0xC0800000u, 0xC0804000u, m);   // low bytes of codes 0..3
  const unsigned l1 = csa2_prmt(0xC0800000u, 0xC0804000u, mh);  // ... of codes 4..7
  // high bytes, with the sign of nibble j (bit 4j + 3) moved to bit 7 of byte j: from u << 4 (even j) or u (odd j)
  const unsigned h0 = csa2_prmt(0x3F3F3F00u, 0x40404040u, m) | (__byte_perm(u, u4, 0x1504) & 0x80808080u);
  const unsigned h1 = csa2_prmt(0x3F3F3F00u, 0x40404040u, mh) | (__byte_perm(u, u4, 0x3726) & 0x80808080u);
  uint4 o;
  o.x = csa2_bf16x2_mul(__byte_perm(l0, h0, 0x5140), scale2);  // codes 0 (low half) and 1
  o.y = csa2_bf16x2_mul(__byte_perm(l0, h0, 0x7362), scale2);  // 2, 3
  o.z = csa2_bf16x2_mul(__byte_perm(l1, h1, 0x5140), scale2);  // 4, 5
  o.w = csa2_bf16x2_mul(__byte_perm(l1, h1, 0x7362), scale2);  // 6, 7
  *reinterpret_cast<uint4*>(dst) = o;
}
"""
)
# The FP4 main-word dequant the ws batched/prefetch producer calls, per ``fp4_decode``.
FP4X8_FUNCTIONS = {"fma": "csa2_fp4x8_bf16", "prmt": "csa2_fp4x8_bf16_prmt"}


def decode_helpers_cuda(fp4_decode: str) -> str:
    """The producer's decode helpers for ``fp4_decode`` (the FP8 window's and the FP4 main word's)."""
    return _DEQUANT_CUDA + (_FP4_PRMT_CUDA if fp4_decode == "prmt" else "")
