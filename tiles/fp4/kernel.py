"""The FP4 kernels: the work layout, the E2M1/E4M3/E8M0 code and scale arithmetic, the packed bf16x2 encode
(:data:`PACKED_CODES_CUDA`) and the two builders, :func:`build_quant` and :func:`build_dequant` (see the package docstring)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from model import formats
from tiles.core.arch import Arch, cuda_target
from tiles.core.contract import TileError

# The byte permute as a CUDA helper for the FP4 decodes by table lookup (the indexer's prmt dequants, the attention
# producer's fp4_decode=prmt): csa2_prmt(a, b, sel) picks bytes of (b:a) by sel's four low nibbles.
PRMT_ASM_CUDA = r"""
// prmt.b32 as opaque asm: with __byte_perm nvcc knows a selector's top 16 bits are unused and re-masked each word
// for each use (w & 0x7777 for the low nibbles, (w & 0x77770000) >> 16 for the high ones): 2 extra integer
// instructions per word. Not volatile, so equal lookups are still shared.
__device__ __forceinline__ unsigned csa2_prmt(unsigned a, unsigned b, unsigned sel) {
  unsigned d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}"""  # no final newline: a user's r"""\n... continues it

MAIN_DIM, INDEX_DIM = 512, 128
SCALE_GROUP = dict(formats.SCALE_FORMATS)  # "e4m3" -> 16, "e8m0" -> 32
TL_DTYPE = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
_PASS_CONFIGS = {"tl.enable_fast_math": False}
LANE_VALUES = 8  # values per chunk of the lanes mapping: 16 B of bf16, 4 packed bytes
FLT_MAX = 3.4028234663852886e38

# E2M1 midpoints in order; on an even index a tie stays on the lower (even) code, so the
# comparison is strict there and inclusive on odd indices (model.formats.e2m1_encode).
_MIDPOINTS = formats.E2M1_MIDPOINTS


# --------------------------------------------------------------------------------------
# Work layout
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Layout:
    """How a block's threads cover the rows (both kernels, both mappings).

    Per tile step a thread handles ``runs`` *runs*: ``run_len`` consecutive values of one row.
    Run ``r`` of thread ``tx`` in tile ``b`` is run number ``b * threads * runs + r * threads + tx``
    of the flattened [rows, dim] tensor. A *segment* is what one thread holds of one scale group
    (``seg_len`` values); ``lanes_per_group`` neighbouring lanes hold a whole group.
    """

    run_len: int
    runs: int
    seg_len: int
    lanes_per_group: int
    runs_per_row: int

    def position(self, tile, r: int, tx, threads: int):
        """(row, first column) of run ``r`` of thread ``tx`` in tile ``tile`` (see the class docstring)."""
        u = tile * (threads * self.runs) + r * threads + tx
        return u // self.runs_per_row, (u % self.runs_per_row) * self.run_len


def _layout(dim: int, scale_format: str, mapping: str, groups_per_thread: int, chunks_per_thread: int) -> _Layout:
    group = SCALE_GROUP[scale_format]
    if mapping == "lanes":
        return _Layout(LANE_VALUES, chunks_per_thread, LANE_VALUES, group // LANE_VALUES, dim // LANE_VALUES)
    run = groups_per_thread * group
    return _Layout(run, 1, group, 1, dim // run)


def _n_tiles(rows, lay: _Layout, runs_per_tile: int):
    """Tiles of ``runs_per_tile`` runs over ``rows`` rows; in whole rows when a tile holds whole rows, so that
    ``rows * runs_per_row`` (64 per main row for lanes) cannot overflow int32 on huge inputs."""
    import tilelang.language as T

    if runs_per_tile % lay.runs_per_row == 0:
        return T.ceildiv(rows, runs_per_tile // lay.runs_per_row)
    return T.ceildiv(rows * lay.runs_per_row, runs_per_tile)


def _check_structure(value_dtype: str, staging: str, mapping: str, code: str = "divide", scale_format: str = "e4m3") -> None:
    """Refuse builder arguments no constraint should have let through (the builders are public too)."""
    if mapping not in ("lanes", "thread"):
        raise TileError(f"unknown mapping {mapping!r}: use 'lanes' or 'thread'")
    if code not in CODES:
        raise TileError(f"unknown code {code!r}: use one of {', '.join(CODES)}")
    if mapping == "lanes" and staging != "registers":
        raise TileError("mapping='lanes' reads and writes global memory directly: use staging='registers'")
    if code in ("thresholds", "packed") and value_dtype != "bfloat16":
        raise TileError(f"code={code!r} is exact for bf16 inputs only, got {value_dtype}: use code='divide'")
    if code == "packed" and (mapping != "lanes" or scale_format != "e4m3"):
        raise TileError(f"code='packed' needs mapping='lanes' and E4M3 scales (got {mapping!r}, {scale_format}): {PACKED_WHY}")


CODES = ("thresholds", "packed", "divide")
PACKED_WHY = "it codes one 8-value lanes chunk at a time, and m_k * 2^127 (E8M0) overflows bf16"


def _n_blocks(n_tiles, grid: str, arch: Arch, threads: int):
    """Blocks launched: one per tile, or as many as fit on the GPU at once (persistent, 2048 threads per SM)."""
    if grid == "persistent":
        return arch.sm_count * max(1, 2048 // threads)
    return n_tiles


# --------------------------------------------------------------------------------------
# Element helpers (TileLang expressions)
# --------------------------------------------------------------------------------------
def e2m1_code(v):
    """fp32 value already divided by its scale -> uint8 E2M1 code (0..15), NaN -> 0 (``code='divide'``)."""
    import tilelang.language as T

    mag = T.abs(v)
    code = T.cast(mag > T.float32(_MIDPOINTS[0]), "uint8")
    for k, mid in enumerate(_MIDPOINTS[1:], start=1):
        hit = mag > T.float32(mid) if k % 2 == 0 else mag >= T.float32(mid)
        code = code + T.cast(hit, "uint8")
    return code | (T.cast(v < T.float32(0.0), "uint8") << T.uint8(3))


def e2m1_code_search(x, thr, neg, shift: int):
    """Unscaled fp32 ``x`` -> its E2M1 code (``code='thresholds'``, NaN -> 0) as uint32, shifted left by ``shift``.

    ``thr`` [7] holds ``m_k * s``; ``neg`` is the bound below which ``x / s`` stays negative
    after rounding. Three comparisons instead of seven: ``k = 3`` decides code >= 4, then
    ``k = 1`` or ``5`` (odd: inclusive), then ``k = 0, 2, 4`` or ``6`` (even: strict). Each bit
    is a select of a shifted constant, so the nibble lands in place without shifts or widening.
    """
    import tilelang.language as T

    def bit(cond, value: int):
        return T.if_then_else(cond, T.uint32(value << shift), T.uint32(0))

    a = T.abs(x)
    ge4 = a >= thr[3]
    ge2 = a >= T.if_then_else(ge4, thr[5], thr[1])
    odd = a > T.if_then_else(ge4, T.if_then_else(ge2, thr[6], thr[4]), T.if_then_else(ge2, thr[2], thr[0]))
    return bit(ge4, 4) | bit(ge2, 2) | bit(odd, 1) | bit(x < neg, 8)


SIXTH = 0.1666666716337204  # fp32 RN(1/6), 0x3E2AAAAB


def _div6_bf16(a):
    """IEEE ``a / 6`` (round to nearest even) for ``a`` a finite bf16 value >= 6 * 2^-126, or +Inf, without a division.

    ``q = RN(a * RN(1/6))``, one FMA residual ``r = a - 6 q`` (exact) and ``RN(q + r * RN(1/6))`` is the correctly
    rounded quotient for every such ``a`` (checked exhaustively on the CPU: tests/test_fp4_tiles.py); it spares the
    ``div.rn.f32`` sequence, its range check and slow-path branch, per scale group. ``+Inf`` makes the residual NaN:
    ``fminf`` turns that into FLT_MAX, which the E4M3 clamp and the E8M0 exponent clamp treat as ``+Inf / 6``.
    """
    import tilelang.language as T

    q = a * T.float32(SIXTH)
    r = T.call_extern("float32", "__fmaf_rn", -q, T.float32(formats.FP4_MAX), a)
    return T.min(T.call_extern("float32", "__fmaf_rn", r, T.float32(SIXTH), q), T.float32(FLT_MAX))


def _e2m1_value_select(c):
    """uint32 code 0..15 -> fp32 value built from its bits with a select for codes 0/1 (code 8 -> -0.0)."""
    import tilelang.language as T

    m = c & T.uint32(7)
    mag = T.if_then_else(
        m < T.uint32(2),
        m * T.uint32(0x3F000000),  # 0 -> 0.0, 1 -> 0.5
        ((((m >> T.uint32(1)) + T.uint32(126)) << T.uint32(23)) | ((m & T.uint32(1)) << T.uint32(22))),
    )
    return T.reinterpret(mag | ((c & T.uint32(8)) << T.uint32(28)), "float32")


def _e2m1_times(c, s):
    """uint32 code 0..15 times fp32 ``s``, exactly, branch-free.

    The code's bits ``s e1 e0 m`` placed at fp32 bits 31 and 24..22 read as the E2M1 value
    times 2^-126: exponent field ``e`` gives ``2^(e-127) (1 + m/2)``, and ``e = 0`` is the
    denormal ``m * 2^-127`` (fast math off keeps it). ``* 2^126`` is then exact, and so is
    ``* s`` (<= 2 x 4 significant bits; inf and NaN as torch's product).
    """
    import tilelang.language as T

    tiny = T.reinterpret(((c & T.uint32(7)) << T.uint32(22)) | ((c & T.uint32(8)) << T.uint32(28)), "float32")
    return tiny * T.float32(2.0**126) * s


def _e4m3_scale_value(b):
    """E4M3 byte (uint32) -> fp32: 0x7F/0xFF are NaN, exponent 0 is subnormal (m * 2^-9)."""
    import tilelang.language as T

    s = T.if_then_else(
        (b & T.uint32(0x78)) == T.uint32(0),
        T.cast(b & T.uint32(7), "float32") * T.float32(2.0**-9),
        T.reinterpret(
            (((b >> T.uint32(3)) & T.uint32(15)) + T.uint32(120)) << T.uint32(23) | ((b & T.uint32(7)) << T.uint32(20)), "float32"
        ),
    )
    s = T.if_then_else((b & T.uint32(0x7F)) == T.uint32(0x7F), T.reinterpret(T.uint32(0x7FC00000), "float32"), s)
    return T.if_then_else((b & T.uint32(0x80)) != T.uint32(0), -s, s)


def _e4m3_scale_value_bits(b):
    """E4M3 byte (uint32) -> fp32 like :func:`_e4m3_scale_value`, branch-free (the lanes dequantiser).

    ``eeee mmm`` placed at fp32 bits 26..20 reads as the E4M3 value times 2^-120: exponent field
    ``e`` gives ``2^(e-127) (1 + m/8)``, and ``e = 0`` is the denormal ``m * 2^-129``; ``* 2^120`` is exact.
    """
    import tilelang.language as T

    mag = T.reinterpret(((b & T.uint32(0x7F)) << T.uint32(20)) | ((b & T.uint32(0x80)) << T.uint32(24)), "float32") * T.float32(2.0**120)
    return T.if_then_else((b & T.uint32(0x7F)) == T.uint32(0x7F), T.reinterpret(T.uint32(0x7FC00000), "float32"), mag)


def _e8m0_scale_value(b):
    """E8M0 byte (uint32) -> fp32 2^(b - 127): 0 is the denormal 2^-127, 255 is NaN."""
    import tilelang.language as T

    s = T.if_then_else(b == T.uint32(0), T.float32(2.0**-127), T.reinterpret(b << T.uint32(23), "float32"))
    return T.if_then_else(b == T.uint32(255), T.reinterpret(T.uint32(0x7FC00000), "float32"), s)


# ``code='packed'``: E2M1 codes of 8 bf16 values (one lanes chunk) by bf16x2 threshold search. A pair
# word ``w`` holds values 2j (low half) and 2j + 1 (high half); each comparison yields 0xFFFF per true
# half, so the next threshold is a bitwise select on that mask and the code bits are masks of it.
# tests/test_fp4_tiles.py mirrors these functions on the CPU word for word (_packed_codes).
_PACKED_CODES_CUDA = r"""
#include <cuda_bf16.h>
__device__ __forceinline__ __nv_bfloat162 csa2_as_bf162(unsigned u) { return *reinterpret_cast<__nv_bfloat162*>(&u); }
__device__ __forceinline__ unsigned csa2_bits(__nv_bfloat162 v) { return *reinterpret_cast<unsigned*>(&v); }
__device__ __forceinline__ unsigned csa2_select(unsigned m, unsigned a, unsigned b) { return (m & a) | (~m & b); }
// Two codes from a pair word: value 2j's nibble in bits 0-3, value 2j + 1's in bits 4-7.
__device__ __forceinline__ unsigned csa2_e2m1_pair(unsigned w, const unsigned* t) {
  const __nv_bfloat162 a = csa2_as_bf162(w & 0x7FFF7FFFu);  // |x|; NaN stays NaN and fails every comparison
  const unsigned ge4 = __hge2_mask(a, csa2_as_bf162(t[3]));  // odd k: inclusive (ties go to the even code)
  const unsigned ge2 = __hge2_mask(a, csa2_as_bf162(csa2_select(ge4, t[5], t[1])));
  const unsigned odd = __hgt2_mask(a, csa2_as_bf162(csa2_select(ge4, csa2_select(ge2, t[6], t[4]), csa2_select(ge2, t[2], t[0]))));
  const unsigned neg = __hgt2_mask(a, csa2_as_bf162(0u)) & w & 0x80008000u;  // x < 0, not -0, not NaN
  const unsigned nib = (ge4 & 0x00040004u) | (ge2 & 0x00020002u) | (odd & 0x00010001u) | (neg >> 12);
  return (nib | (nib >> 12)) & 0xFFu;
}
// 8 bf16 at src, E4M3 scale s (an exact bf16 value) -> the chunk's 4 packed bytes, stored as one word at dst.
__device__ __forceinline__ void csa2_fp4_codes8_bf16(void* dst, const void* src, float s) {
  const uint4 x = *reinterpret_cast<const uint4*>(src);
  const __nv_bfloat162 s2 = __float2bfloat162_rn(s);
  const float mids[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  unsigned t[7];  // m_k * s in both halves: exact products (<= 7 significant bits)
#pragma unroll
  for (int k = 0; k < 7; ++k) t[k] = csa2_bits(__hmul2(s2, __float2bfloat162_rn(mids[k])));
  *reinterpret_cast<unsigned*>(dst) =
      csa2_e2m1_pair(x.x, t) | (csa2_e2m1_pair(x.y, t) << 8) | (csa2_e2m1_pair(x.z, t) << 16) | (csa2_e2m1_pair(x.w, t) << 24);
}
// max |x| of 8 bf16 at src as fp32; NaN loses to the other operand of __hmax2, and an all-NaN result counts as 0.
__device__ __forceinline__ float csa2_absmax8_bf16(const void* src) {
  const uint4 x = *reinterpret_cast<const uint4*>(src);
  const __nv_bfloat162 m = __hmax2(__hmax2(csa2_as_bf162(x.x & 0x7FFF7FFFu), csa2_as_bf162(x.y & 0x7FFF7FFFu)),
                                   __hmax2(csa2_as_bf162(x.z & 0x7FFF7FFFu), csa2_as_bf162(x.w & 0x7FFF7FFFu)));
  return fmaxf(fmaxf(__low2float(m), __high2float(m)), 0.0f);
}
"""


# --------------------------------------------------------------------------------------
# Kernel builders
# --------------------------------------------------------------------------------------
@functools.cache
def build_quant(
    dim: int,
    scale_format: str,
    in_dtype: str,
    staging: str,
    groups_per_thread: int,
    threads: int,
    grid: str,
    nvcc_arch: str,
    mapping: str = "thread",
    code: str = "divide",
    chunks_per_thread: int = 1,
):
    """Compile the quantiser for rows of ``dim`` values; rows are dynamic.

    Kernel arguments: X [rows, dim] ``in_dtype``, P [rows, dim // 2] uint8, S [rows, dim // group] uint8.
    ``groups_per_thread`` and ``staging`` shape the ``thread`` mapping, ``chunks_per_thread`` the
    ``lanes`` one (see the module docstring); the defaults of the last three are the first kernel's.
    """
    import tilelang
    import tilelang.language as T
    import tvm

    _check_structure(in_dtype, staging, mapping, code, scale_format)
    group = SCALE_GROUP[scale_format]
    n_groups = dim // group
    lay = _layout(dim, scale_format, mapping, groups_per_thread, chunks_per_thread)
    R, seg, lanes = lay.run_len, lay.seg_len, lay.lanes_per_group
    vals = R * lay.runs  # values per thread and tile step
    n_segs = vals // seg
    runs_per_tile = threads * lay.runs
    rows = T.dynamic("rows")
    rows_per_tile = max(1, threads * R // dim)  # only used by the shared staging (threads * R % dim == 0 there)
    n_tiles = _n_tiles(rows, lay, runs_per_tile)
    arch = _arch_by_nvcc(nvcc_arch)
    n_blocks = _n_blocks(n_tiles, grid, arch, threads)
    steps = T.ceildiv(n_tiles, n_blocks) if grid == "persistent" else 1
    min_scale = T.float32(formats.FP4_MAX * (2.0**-9 if scale_format == "e4m3" else 2.0**-126))

    @T.prim_func
    def quant(X: T.Tensor((rows, dim), in_dtype), P: T.Tensor((rows, dim // 2), "uint8"), S: T.Tensor((rows, n_groups), "uint8")):
        with T.Kernel(n_blocks, threads=threads) as bx:
            tx = T.get_thread_binding()
            xin = T.alloc_local((vals,), in_dtype)
            pk = T.alloc_local((vals // 2,), "uint8")
            sc = T.alloc_local((n_segs,), "uint8")
            thr = T.alloc_local((7,), "float32")  # thresholds: m_k * s of the current group
            amax = T.alloc_var("float32")
            raw = T.alloc_var("float32")
            inv = T.alloc_var("float32")  # E8M0: the exact reciprocal 2^-e of the scale
            s = T.alloc_var("float32")
            neg = T.alloc_var("float32")  # thresholds: x < neg <=> x / s rounds to a negative value
            bits = T.alloc_var("uint32")
            v_lo = T.alloc_var("float32")  # the values (divide: quotients), bound once: each feeds several comparisons
            v_hi = T.alloc_var("float32")
            if staging == "shared":
                Xs = T.alloc_shared((rows_per_tile, dim), in_dtype)
                Ps = T.alloc_shared((rows_per_tile, dim // 2), "uint8")
                Ss = T.alloc_shared((rows_per_tile, n_groups), "uint8")
            if code == "packed":
                T.import_source(_PACKED_CODES_CUDA)
            for step in T.serial(steps):
                tile = bx + step * n_blocks if grid == "persistent" else bx
                # ---- load: run r of this thread -> xin[r * R : (r + 1) * R]
                for r in T.unroll(lay.runs):
                    row, col = lay.position(tile, r, tx, threads)
                    if staging == "shared":
                        r0 = tile * rows_per_tile
                        T.copy(X[r0, 0], Xs)
                        for i in T.vectorized(R):
                            xin[i] = Xs[row - r0, col + i]
                    else:
                        if mapping == "lanes":
                            # lanes past the last row still join the amax shuffles: give them zeros
                            for i in T.vectorized(R):
                                xin[r * R + i] = T.cast(0, in_dtype)
                        if row < rows:
                            for i in T.vectorized(R):
                                xin[r * R + i] = X[row, col + i]
                # ---- per segment: group amax, scale byte, codes
                for g in T.unroll(n_segs):
                    if code == "packed":
                        amax = T.call_extern("float32", "csa2_absmax8_bf16", T.address_of(xin[g * seg]))
                    else:
                        amax = T.float32(0.0)
                        for i in T.unroll(seg):
                            a = T.abs(T.cast(xin[g * seg + i], "float32"))
                            # NaN never replaces amax: a comparison max (the first kernel), or fmaxf (one instruction),
                            # which returns the other operand when one is NaN; amax starts at 0 and so is never NaN
                            amax = T.max(amax, a) if mapping == "lanes" else T.if_then_else(a > amax, a, amax)
                    # the group's other lanes hold the rest of it: amax is NaN-free, so fmaxf is the same max
                    if lanes >= 2:
                        amax = T.max(amax, T.shfl_xor(amax, 1))
                    if lanes >= 4:
                        amax = T.max(amax, T.shfl_xor(amax, 2))
                    raw = T.if_then_else(amax > min_scale, amax, min_scale)
                    raw = _div6_bf16(raw) if in_dtype == "bfloat16" else raw / T.float32(formats.FP4_MAX)
                    if scale_format == "e4m3":
                        raw = T.if_then_else(raw < T.float32(formats.E4M3_MAX), raw, T.float32(formats.E4M3_MAX))
                        if raw < T.float32(2.0**-6):
                            # E4M3 subnormals are multiples of 2^-9: round raw * 512 to even
                            s = T.nearbyint(raw * T.float32(512.0))
                            sc[g] = T.cast(s, "uint8")
                            s = s * T.float32(2.0**-9)
                        else:
                            # RNE to 3 mantissa bits on the fp32 pattern; E4M3 exponent = fp32 exponent - 120
                            bits = T.reinterpret(raw, "uint32")
                            bits = (bits + T.uint32(0x7FFFF) + ((bits >> T.uint32(20)) & T.uint32(1))) & T.uint32(0xFFF00000)
                            sc[g] = T.cast(
                                (((bits >> T.uint32(23)) - T.uint32(120)) << T.uint32(3)) | ((bits >> T.uint32(20)) & T.uint32(7)), "uint8"
                            )
                            s = T.reinterpret(bits, "float32")
                        if code == "packed":
                            T.call_extern("handle", "csa2_fp4_codes8_bf16", T.address_of(pk[g * seg // 2]), T.address_of(xin[g * seg]), s)
                        if code == "divide":
                            for j in T.unroll(seg // 2):
                                v_lo = T.cast(xin[g * seg + 2 * j], "float32") / s
                                v_hi = T.cast(xin[g * seg + 2 * j + 1], "float32") / s
                                pk[g * seg // 2 + j] = e2m1_code(v_lo) | (e2m1_code(v_hi) << T.uint8(4))
                        # a nonzero bf16 over s <= 448 never rounds to -0: the sign is x's
                        neg = T.float32(0.0)
                    else:
                        bits = T.reinterpret(raw, "uint32")
                        bits = ((bits >> T.uint32(23)) & T.uint32(0xFF)) + T.cast((bits & T.uint32(0x7FFFFF)) != T.uint32(0), "uint32")
                        bits = T.if_then_else(bits > T.uint32(254), T.uint32(254), bits)
                        sc[g] = T.cast(bits, "uint8")
                        if code == "divide":
                            # 2^(127 - byte) for byte in [1, 254]; byte 254 gives the subnormal 2^-127 (fast math off keeps it)
                            inv = T.if_then_else(
                                bits == T.uint32(254),
                                T.float32(2.0**-127),
                                T.reinterpret((T.uint32(254) - bits) << T.uint32(23), "float32"),
                            )
                            for j in T.unroll(seg // 2):
                                v_lo = T.cast(xin[g * seg + 2 * j], "float32") * inv
                                v_hi = T.cast(xin[g * seg + 2 * j + 1], "float32") * inv
                                pk[g * seg // 2 + j] = e2m1_code(v_lo) | (e2m1_code(v_hi) << T.uint8(4))
                        s = T.reinterpret(bits << T.uint32(23), "float32")  # 2^(byte - 127), a normal number
                        # x * 2^-e rounds to -0 iff |x| <= 2^(e-150) (exact here for e >= 1; below, every nonzero bf16 is larger)
                        neg = -(s * T.float32(2.0**-75)) * T.float32(2.0**-75)
                    if code == "thresholds":
                        # t_k = m_k * s, exact (module docstring); E8M0 clamps the products that overflow
                        thr[0] = s * T.float32(_MIDPOINTS[0])
                        thr[1] = s * T.float32(_MIDPOINTS[1])
                        thr[2] = s * T.float32(_MIDPOINTS[2])
                        thr[3] = s * T.float32(_MIDPOINTS[3])
                        thr[4] = s * T.float32(_MIDPOINTS[4])
                        thr[5] = s * T.float32(_MIDPOINTS[5])
                        thr[6] = s * T.float32(_MIDPOINTS[6])
                        if scale_format == "e8m0":
                            for k in T.unroll(7):
                                thr[k] = T.min(thr[k], T.float32(FLT_MAX))
                        for j in T.unroll(seg // 2):
                            v_lo = T.cast(xin[g * seg + 2 * j], "float32")
                            v_hi = T.cast(xin[g * seg + 2 * j + 1], "float32")
                            pk[g * seg // 2 + j] = T.cast(
                                e2m1_code_search(v_lo, thr, neg, 0) | e2m1_code_search(v_hi, thr, neg, 4), "uint8"
                            )
                # ---- store
                for r in T.unroll(lay.runs):
                    row, col = lay.position(tile, r, tx, threads)
                    if staging == "shared":
                        r0 = tile * rows_per_tile
                        for i in T.vectorized(R // 2):
                            Ps[row - r0, col // 2 + i] = pk[i]
                        for g in T.vectorized(groups_per_thread):
                            Ss[row - r0, col // group + g] = sc[g]
                        T.copy(Ps, P[r0, 0])
                        T.copy(Ss, S[r0, 0])
                    elif row < rows:
                        for i in T.vectorized(R // 2):
                            P[row, col // 2 + i] = pk[r * R // 2 + i]
                        if mapping == "lanes":
                            if tx % lanes == 0:
                                S[row, col // group] = sc[r]
                        else:
                            for g in T.vectorized(groups_per_thread):
                                S[row, col // group + g] = sc[g]

    target = tvm.target.Target(cuda_target(nvcc_arch))
    return tilelang.compile(quant, target=target, pass_configs=_PASS_CONFIGS)


@functools.cache
def build_dequant(
    dim: int,
    scale_format: str,
    out_dtype: str,
    staging: str,
    groups_per_thread: int,
    threads: int,
    grid: str,
    nvcc_arch: str,
    mapping: str = "thread",
    chunks_per_thread: int = 1,
):
    """Compile the dequantiser for rows of ``dim`` values; rows are dynamic.

    Kernel arguments: P [rows, dim // 2] uint8, S [rows, dim // group] uint8, Y [rows, dim] ``out_dtype``.
    The ``thread`` mapping decodes with selects (the first kernel), ``lanes`` branch-free from the
    bits (:func:`_e2m1_times`, :func:`_e4m3_scale_value_bits`).
    """
    import tilelang
    import tilelang.language as T
    import tvm

    _check_structure(out_dtype, staging, mapping)
    group = SCALE_GROUP[scale_format]
    n_groups = dim // group
    lay = _layout(dim, scale_format, mapping, groups_per_thread, chunks_per_thread)
    R, seg = lay.run_len, lay.seg_len
    vals = R * lay.runs
    n_segs = vals // seg
    runs_per_tile = threads * lay.runs
    rows = T.dynamic("rows")
    rows_per_tile = max(1, threads * R // dim)
    n_tiles = _n_tiles(rows, lay, runs_per_tile)
    arch = _arch_by_nvcc(nvcc_arch)
    n_blocks = _n_blocks(n_tiles, grid, arch, threads)
    steps = T.ceildiv(n_tiles, n_blocks) if grid == "persistent" else 1
    scale_value = _e8m0_scale_value
    if scale_format == "e4m3":
        scale_value = _e4m3_scale_value_bits if mapping == "lanes" else _e4m3_scale_value

    @T.prim_func
    def dequant(P: T.Tensor((rows, dim // 2), "uint8"), S: T.Tensor((rows, n_groups), "uint8"), Y: T.Tensor((rows, dim), out_dtype)):
        with T.Kernel(n_blocks, threads=threads) as bx:
            tx = T.get_thread_binding()
            pk = T.alloc_local((vals // 2,), "uint8")
            sc = T.alloc_local((n_segs,), "uint8")
            yo = T.alloc_local((vals,), out_dtype)
            s = T.alloc_var("float32")
            if staging == "shared":
                Ps = T.alloc_shared((rows_per_tile, dim // 2), "uint8")
                Ss = T.alloc_shared((rows_per_tile, n_groups), "uint8")
                Ys = T.alloc_shared((rows_per_tile, dim), out_dtype)
            for step in T.serial(steps):
                tile = bx + step * n_blocks if grid == "persistent" else bx
                for r in T.unroll(lay.runs):
                    row, col = lay.position(tile, r, tx, threads)
                    if staging == "shared":
                        r0 = tile * rows_per_tile
                        T.copy(P[r0, 0], Ps)
                        T.copy(S[r0, 0], Ss)
                        for i in T.vectorized(R // 2):
                            pk[i] = Ps[row - r0, col // 2 + i]
                        for g in T.vectorized(groups_per_thread):
                            sc[g] = Ss[row - r0, col // group + g]
                    elif row < rows:
                        for i in T.vectorized(R // 2):
                            pk[r * R // 2 + i] = P[row, col // 2 + i]
                        if mapping == "lanes":
                            sc[r] = S[row, col // group]  # the group's lanes read the same byte: one transaction
                        else:
                            for g in T.vectorized(groups_per_thread):
                                sc[g] = S[row, col // group + g]
                for g in T.unroll(n_segs):
                    s = scale_value(T.cast(sc[g], "uint32"))
                    for j in T.unroll(seg // 2):
                        c = T.cast(pk[g * seg // 2 + j], "uint32")
                        if mapping == "lanes":
                            yo[g * seg + 2 * j] = T.cast(_e2m1_times(c & T.uint32(15), s), out_dtype)
                            yo[g * seg + 2 * j + 1] = T.cast(_e2m1_times(c >> T.uint32(4), s), out_dtype)
                        else:
                            yo[g * seg + 2 * j] = T.cast(_e2m1_value_select(c & T.uint32(15)) * s, out_dtype)
                            yo[g * seg + 2 * j + 1] = T.cast(_e2m1_value_select(c >> T.uint32(4)) * s, out_dtype)
                for r in T.unroll(lay.runs):
                    row, col = lay.position(tile, r, tx, threads)
                    if staging == "shared":
                        r0 = tile * rows_per_tile
                        for i in T.vectorized(R):
                            Ys[row - r0, col + i] = yo[i]
                        T.copy(Ys, Y[r0, 0])
                    elif row < rows:
                        for i in T.vectorized(R):
                            Y[row, col + i] = yo[r * R + i]

    target = tvm.target.Target(cuda_target(nvcc_arch))
    return tilelang.compile(dequant, target=target, pass_configs=_PASS_CONFIGS)


def _arch_by_nvcc(nvcc_arch: str) -> Arch:
    from tiles.core.arch import ARCHS

    return next(a for a in ARCHS.values() if a.nvcc_arch == nvcc_arch)
