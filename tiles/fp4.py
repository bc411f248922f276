"""FP4 E2M1 quantise / dequantise tiles for the main KV latent and the indexer K/Q.

Bit-exact with :func:`model.formats.fp4_quantize` / :func:`model.formats.fp4_dequantize`
on every input, NaN and +-Inf included (spec section 3):

==================  =========  ======================================  ==============
tile                row        output per row                           bytes per row
==================  =========  ======================================  ==============
fp4_quant_main      512 vals   256 packed + 32 E4M3 scales (group 16)   288
fp4_quant_index     128 vals   64 packed + 4 E8M0 scales (group 32)     68
fp4_dequant_main    288 B      512 values (bf16 for the tile; fp32 too)
fp4_dequant_index   68 B       128 values (bf16 for the tile; fp32 too)
==================  =========  ======================================  ==============

Exactness: the kernels are compiled with fast math off (``tl.enable_fast_math`` False), so
``amax / 6`` and ``x / s`` are IEEE ``div.rn.f32`` and denormals are kept, as in torch. The
E4M3 scale is rounded with integer bit arithmetic (RNE, saturation is impossible after the
clamp to 448), E8M0 is ``exponent + (mantissa != 0)``. NaN never wins the ``amax`` (a
comparison-based max keeps the running value). The E2M1 code of a value is the number of
midpoints ``m_k`` (0.25 0.75 1.25 1.75 2.5 3.5 5) it passes, strictly on even ``k`` and
inclusively on odd ``k`` (ties to the even code); NaN passes none and encodes as code 0.
Two ways to get it (param ``code`` of the quantisers):

* ``divide``: ``v = x / s`` (E8M0: ``x * 2^-e``, the same single rounding), then seven
  comparisons of ``|v|`` with the ``m_k``; sign bit ``v < 0``. Exact for any input dtype.
* ``thresholds`` (16-bit inputs only): compare ``|x|`` with ``t_k = m_k * s``, computed once
  per group, by a 3-level binary search (``k = 3``, then 1 or 5, then 0/2/4/6). Exact because
  ``m_k`` has <= 3 significant bits and the scale <= 4 (E8M0: 1), so ``m_k * s`` is exact in
  fp32 (E4M3: ``s >= 2^-9``, no underflow; E8M0 products above FLT_MAX are clamped to it,
  which no finite bf16 reaches, so +-Inf still passes every threshold). A bf16 ``x`` has 8
  significant bits, so ``x != t_k`` puts ``x / s`` at a relative distance ``> 2^-10`` from
  ``m_k``, far beyond fp32's rounding of the quotient: ``fl(|x| / s) > m_k <=> |x| > t_k``, and
  equality likewise. The sign bit is ``x < 0`` for E4M3 (a nonzero bf16 over ``s <= 448`` never
  rounds to -0); for E8M0 the quotient ``x * 2^-e`` rounds to -0 iff ``|x| <= 2^(e-150)``, so
  the bit is ``x < -2^(e-150)``. float32 inputs (24-bit mantissas) break the gap argument and
  always take ``divide``. tests/test_fp4_tiles.py checks both claims exhaustively on the CPU
  (every bf16 pattern against every scale byte).
* ``packed`` (bf16 in, E4M3 scales, ``mapping='lanes'``): the same three-level threshold search
  on two values at once, in bf16x2 (:data:`_PACKED_CODES_CUDA`): ``t_k`` is an exact bf16 value
  too (``m_k`` <= 3 significant bits times ``s`` <= 4 is <= 7, and ``2^-11 <= t_k <= 2240``),
  so ``__hge2_mask`` / ``__hgt2_mask`` on ``|x|`` decide what the fp32 compares decide; NaN fails
  every bf16 comparison (code 0) and the sign bit is ``|x| > 0`` and the bf16 sign. The
  threshold selects of the search are bitwise selects on the lane masks, and the group ``amax``
  is ``__hmax2`` (NaN loses to the other operand; the result is clamped at 0 like the fp32 max).
  15.8 static SASS instructions per value for the whole sm_90a kernel against 22.8 for ``thresholds``
  (nvdisasm; the quantiser was ALU-bound): 3.53 TB/s against 2.43 on the H200 (notes/fp4.md). Not for
  E8M0: ``m_k * 2^127`` overflows bf16, and ``+Inf > t_6`` then fails.

Dequantise: ``value * s`` with the E2M1 value built from the code's bits (below), exact in fp32
(<= 2 x 4 significant bits), then cast: bf16 holds it exactly too.

Kernel structure, param ``mapping``:

* ``lanes``: a thread owns *chunks* of 8 consecutive values of a row (quantise: 16 B of bf16
  in, 4 packed bytes out; dequantise: 4 packed bytes in, 16 B of bf16 out), so consecutive
  lanes touch consecutive memory. A scale group spans 2 lanes (E4M3, group 16) or 4 (E8M0,
  group 32): each lane reduces its 8 values and ``shfl_xor`` completes the group ``amax``;
  every lane of the group then computes the same scale and the group's first lane stores the
  scale byte. ``chunks_per_thread`` chunks per thread and tile step, ``threads`` apart, so each
  one is a coalesced sweep of the block and more bytes are in flight per thread.
* ``thread``: a thread owns ``groups_per_thread`` whole consecutive groups of one row; a warp's
  16-byte accesses are strided by the unit size. ``staging`` picks how bytes reach the thread:
  straight from global memory in 16-byte vectors (``registers``) or through a shared-memory
  row tile moved with ``T.copy`` in both directions (``shared``).

``grid`` picks one block per tile of work or a persistent grid that strides over the tiles.
Rows are a dynamic dimension: one compiled kernel serves every row count; a row past the end
is neither read nor written (lanes past it still join the shuffles, on zeros).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from model import formats
from tiles.arch import Arch, cuda_target, detect
from tiles.contract import Comparison, Config, Constraint, Inputs, Param, SearchSpace, Shape, Tile, TileError, poisoned
from tiles.shapes import fp4_rows

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
_TL_DTYPE = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
_PASS_CONFIGS = {"tl.enable_fast_math": False}
LANE_VALUES = 8  # values per chunk of the lanes mapping: 16 B of bf16, 4 packed bytes
FLT_MAX = 3.4028234663852886e38

# E2M1 midpoints in order; on an even index a tie stays on the lower (even) code, so the
# comparison is strict there and inclusive on odd indices (model.formats.e2m1_encode).
_MIDPOINTS = formats._E2M1_MIDPOINTS


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
        raise TileError(f"code='packed' needs mapping='lanes' and E4M3 scales (got {mapping!r}, {scale_format}): {_PACKED_WHY}")


CODES = ("thresholds", "packed", "divide")
_PACKED_WHY = "it codes one 8-value lanes chunk at a time, and m_k * 2^127 (E8M0) overflows bf16"


def _n_blocks(n_tiles, grid: str, arch: Arch, threads: int):
    """Blocks launched: one per tile, or as many as fit on the GPU at once (persistent, 2048 threads per SM)."""
    if grid == "persistent":
        return arch.sm_count * max(1, 2048 // threads)
    return n_tiles


# --------------------------------------------------------------------------------------
# Element helpers (TileLang expressions)
# --------------------------------------------------------------------------------------
def _e2m1_code(v):
    """fp32 value already divided by its scale -> uint8 E2M1 code (0..15), NaN -> 0 (``code='divide'``)."""
    import tilelang.language as T

    mag = T.abs(v)
    code = T.cast(mag > T.float32(_MIDPOINTS[0]), "uint8")
    for k, mid in enumerate(_MIDPOINTS[1:], start=1):
        hit = mag > T.float32(mid) if k % 2 == 0 else mag >= T.float32(mid)
        code = code + T.cast(hit, "uint8")
    return code | (T.cast(v < T.float32(0.0), "uint8") << T.uint8(3))


def _e2m1_code_search(x, thr, neg, shift: int):
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
                                pk[g * seg // 2 + j] = _e2m1_code(v_lo) | (_e2m1_code(v_hi) << T.uint8(4))
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
                                pk[g * seg // 2 + j] = _e2m1_code(v_lo) | (_e2m1_code(v_hi) << T.uint8(4))
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
                                _e2m1_code_search(v_lo, thr, neg, 0) | _e2m1_code_search(v_hi, thr, neg, 4), "uint8"
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
    from tiles.arch import ARCHS

    return next(a for a in ARCHS.values() if a.nvcc_arch == nvcc_arch)


# --------------------------------------------------------------------------------------
# Search space, defaults, inputs
# --------------------------------------------------------------------------------------
def _param(config: Config, key: str, scale_format: str):
    """``config[key]``, or the default's value when the config leaves it out (a stored winner from before the key existed)."""
    return config.get(key, fp4_default_config(scale_format, quantise=True)[key])


def _staging_fits(config: Config, shape: Shape, arch: Arch, value_bytes: int, scale_format: str) -> str | None:
    """The shared staging needs whole rows per block tile and the tile inside the shared-memory budget."""
    if _param(config, "staging", scale_format) != "shared" or _param(config, "mapping", scale_format) != "thread":
        return None  # lanes + shared is refused by its own constraint
    group = SCALE_GROUP[scale_format]
    threads = _param(config, "threads", scale_format)
    elems = threads * _param(config, "groups_per_thread", scale_format) * group
    if elems % shape["dim"]:
        return f"{threads} threads x {elems // threads} values do not cover whole rows of {shape['dim']}"
    rows = elems // shape["dim"]
    smem = rows * (shape["dim"] * value_bytes + shape["dim"] // 2 + shape["dim"] // group)
    if smem > arch.smem_per_block:
        return f"shared memory {smem / 1024:.0f} KiB > {arch.smem_per_block / 1024:.0f} KiB"
    return None


def _units_divide(config: Config, shape: Shape, arch: Arch, scale_format: str) -> str | None:
    if _param(config, "mapping", scale_format) != "thread":
        return None  # lanes: groups_per_thread is not used
    n_groups = shape["dim"] // SCALE_GROUP[scale_format]
    gpt = _param(config, "groups_per_thread", scale_format)
    if n_groups % gpt:
        return f"groups_per_thread={gpt} does not divide the {n_groups} groups of a row"
    return None


def _lanes_registers(config: Config, shape: Shape, arch: Arch, scale_format: str) -> str | None:
    if _param(config, "mapping", scale_format) == "lanes" and _param(config, "staging", scale_format) != "registers":
        return "mapping=lanes moves coalesced 16-byte chunks straight to registers; shared staging goes with mapping=thread"
    return None


def _thresholds_input(config: Config, value_bytes: int, scale_format: str) -> str | None:
    code = _param(config, "code", scale_format)
    if value_bytes != 2 and code in ("thresholds", "packed"):
        return f"code={code} is exact for bf16 inputs only (8-bit mantissas), not {8 * value_bytes}-bit floats: use code=divide"
    return None


def _packed_structure(config: Config, scale_format: str) -> str | None:
    if _param(config, "code", scale_format) != "packed":
        return None
    if scale_format != "e4m3" or _param(config, "mapping", scale_format) != "lanes":
        return f"code=packed needs mapping=lanes and E4M3 scales: {_PACKED_WHY}"
    return None


def _unused_size_at_default(config: Config, scale_format: str, quantise: bool) -> str | None:
    """The size a mapping ignores stays at its default, so each kernel has one spelling in the space: without
    this the tuner compiled and timed the same kernel up to 12 times (576 valid configs, 176 distinct)."""
    default = fp4_default_config(scale_format, quantise)
    if (
        config.get("mapping", "lanes") == "lanes"
        and config.get("groups_per_thread", default["groups_per_thread"]) != default["groups_per_thread"]
    ):
        return f"groups_per_thread is unused with mapping=lanes: leave it at {default['groups_per_thread']}"
    if (
        config.get("mapping", "lanes") == "thread"
        and config.get("chunks_per_thread", default["chunks_per_thread"]) != default["chunks_per_thread"]
    ):
        return f"chunks_per_thread is unused with mapping=thread: leave it at {default['chunks_per_thread']}"
    return None


def fp4_search_space(scale_format: str, value_bytes: int = 2, quantise: bool = True) -> SearchSpace:
    """Structural choices of the FP4 kernels; ``value_bytes`` is the width of the unquantised side (2 for bf16).

    ``groups_per_thread`` only matters with ``mapping='thread'`` and ``chunks_per_thread`` only with
    ``'lanes'``: the unused size must stay at its default (one spelling per kernel), which configs stored
    before ``mapping`` existed satisfy when merged with the default. ``staging='shared'`` needs ``mapping='thread'``
    and ``code='thresholds'`` needs bf16 input: both are refused otherwise, with the reason.
    """
    code = Param(
        "code",
        CODES if scale_format == "e4m3" else tuple(c for c in CODES if c != "packed"),
        "E2M1 code: |x| against m_k * s by binary search in fp32 (bf16 only), the same on bf16x2 pairs (lanes, E4M3), "
        "or IEEE x / s against the midpoints",
    )
    return SearchSpace(
        params=(
            Param(
                "mapping", ("lanes", "thread"), "lanes: 16-byte chunks per lane, group amax by shuffles; thread: whole groups per thread"
            ),
            *((code,) if quantise else ()),
            Param("chunks_per_thread", (1, 2, 4), "lanes only: 8-value chunks per thread and tile step, a block apart"),
            Param(
                "staging",
                ("registers", "shared"),
                "thread only: 16-byte vectors straight to registers, or a row tile through shared memory",
            ),
            Param("groups_per_thread", (1, 2, 4, 8), "thread only: scale groups per thread, the vector width of the packed loads/stores"),
            Param("threads", (64, 128, 256, 512), "threads per block"),
            Param("grid", ("tiles", "persistent"), "one block per tile of units, or a persistent grid striding over tiles"),
        ),
        constraints=(
            Constraint("whole groups", lambda c, s, a: _units_divide(c, s, a, scale_format)),
            Constraint("shared tile", lambda c, s, a: _staging_fits(c, s, a, value_bytes, scale_format)),
            Constraint("lanes staging", lambda c, s, a: _lanes_registers(c, s, a, scale_format)),
            Constraint("one spelling", lambda c, s, a: _unused_size_at_default(c, scale_format, quantise)),
            *(
                (
                    Constraint("thresholds input", lambda c, s, a: _thresholds_input(c, value_bytes, scale_format)),
                    Constraint("packed codes", lambda c, s, a: _packed_structure(c, scale_format)),
                )
                if quantise
                else ()
            ),
        ),
    )


def fp4_default_config(scale_format: str, quantise: bool = True) -> Config:
    """Lanes mapping, 256 threads, one block per tile. Quantise: four 16-byte chunks per thread in flight;
    E4M3 codes by the bf16x2 threshold search (``packed``: 3.53 TB/s against 2.43 for fp32 ``thresholds``),
    E8M0 codes by the exact multiply by 2^-e (``divide``, which is no division there). Dequantise: two
    chunks. All from the H200 sweeps at bulk_1m (notes/fp4.md).

    ``groups_per_thread`` keeps the first kernel's 16-byte packed vectors (2 groups of 16 or 1 of
    32) for ``mapping='thread'``.
    """
    config = {
        "mapping": "lanes",
        "code": "packed" if scale_format == "e4m3" else "divide",
        "chunks_per_thread": 4 if quantise else 2,
        "staging": "registers",
        "groups_per_thread": 2 if scale_format == "e4m3" else 1,
        "threads": 256,
        "grid": "tiles",
    }
    if not quantise:
        del config["code"]
    return config


def _quant_kernel(dim: int, scale_format: str, in_dtype: str, c: Config, arch: Arch):
    """:func:`build_quant` for a full config; float32 inputs always divide (the threshold argument needs bf16)."""
    code = c["code"] if in_dtype == "bfloat16" else "divide"
    return build_quant(
        dim, scale_format, in_dtype, c["staging"], c["groups_per_thread"], c["threads"], c["grid"], arch.nvcc_arch,
        mapping=c["mapping"], code=code, chunks_per_thread=c["chunks_per_thread"],
    )  # fmt: skip


def _dequant_kernel(dim: int, scale_format: str, out_dtype: str, c: Config, arch: Arch):
    """:func:`build_dequant` for a full config."""
    return build_dequant(
        dim, scale_format, out_dtype, c["staging"], c["groups_per_thread"], c["threads"], c["grid"], arch.nvcc_arch,
        mapping=c["mapping"], chunks_per_thread=c["chunks_per_thread"],
    )  # fmt: skip


def _edge_rows(dim: int, scale_format: str, generator: torch.Generator) -> torch.Tensor:
    """Rows that hit every special case of the format, float32 [8, dim].

    Row 0: exact E2M1 midpoints (ties) and grid points, at a scale the group's amax pins
    exactly. Row 1: zeros and -0. Row 2: tiny values incl. denormals. Row 3: huge values.
    Row 4: NaN, +-Inf mixed with normal values. Row 5: an all-NaN group next to a one-Inf group.
    Rows 6-7: random signs at magnitudes spread over 2^-140..2^120.
    """
    group = SCALE_GROUP[scale_format]
    n_groups = dim // group
    rows = torch.empty(8, dim)  # [8, dim]
    mids = torch.tensor(formats._E2M1_MIDPOINTS + formats.E2M1_VALUES)
    for g in range(n_groups):
        scale = 2.0 ** (g % 24 - 12) * (1.0 + (g % 8) / 8 if scale_format == "e4m3" else 1.0)  # an exact E4M3/E8M0 value
        vals = mids[torch.arange(group) % len(mids)] * scale
        vals[0] = 6.0 * scale  # amax = 6 s pins the stored scale to s exactly
        sign = torch.where(torch.rand(group, generator=generator) < 0.5, -1.0, 1.0)
        rows[0, g * group : (g + 1) * group] = vals * sign
    rows[1] = 0.0
    rows[1, 1::2] = -0.0
    rows[1, : dim // 2] = torch.where(torch.arange(dim // 2) % 3 == 0, torch.tensor(1e-3), torch.tensor(0.0))
    rows[2] = torch.randn(dim, generator=generator) * 1e-39  # denormal in fp32 and bf16
    rows[2, ::4] = -1e-45
    rows[3] = torch.randn(dim, generator=generator) * 1e37
    rows[3, ::5] = 3.0e38
    rows[4] = torch.randn(dim, generator=generator)
    rows[4, ::7] = float("nan")
    rows[4, 3::11] = float("inf")
    rows[4, 5::13] = float("-inf")
    rows[5] = torch.randn(dim, generator=generator)
    rows[5, :group] = float("nan")
    rows[5, group + 1] = float("-inf")
    exps = torch.randint(-140, 120, (2, dim), generator=generator).float()
    rows[6:8] = torch.randn(2, dim, generator=generator).sign() * torch.exp2(exps)
    return rows


def _generator(seed: int, device) -> torch.Generator:
    # random data is made where it is used: a 1M-row CPU randn would dominate a benchmark run
    return torch.Generator(device=torch.device(device)).manual_seed(seed)


def quant_inputs(rows: int, dim: int, scale_format: str, seed: int, device, dtype: torch.dtype = torch.bfloat16) -> Inputs:
    """x [rows, dim] ``dtype``: N(0, 1) per element times a log-uniform per-row magnitude, special rows first."""
    gen = _generator(seed, device)
    x = torch.randn(rows, dim, generator=gen, device=device)  # [rows, dim]
    x *= torch.exp2(torch.empty(rows, 1, device=device).uniform_(-8, 8, generator=gen))  # [rows, 1]
    n_edge = min(rows, 8)
    x[:n_edge] = _edge_rows(dim, scale_format, torch.Generator().manual_seed(seed))[:n_edge].to(device)
    return {"x": x.to(dtype)}


def dequant_inputs(rows: int, dim: int, scale_format: str, seed: int, device) -> Inputs:
    """packed uint8 [rows, dim // 2] (every byte value), scales uint8 [rows, dim // group] (every byte value, NaN codes too)."""
    gen = _generator(seed, device)
    packed = torch.randint(0, 256, (rows, dim // 2), generator=gen, dtype=torch.uint8, device=device)  # [rows, dim // 2]
    scales = torch.randint(
        0, 256, (rows, dim // SCALE_GROUP[scale_format]), generator=gen, dtype=torch.uint8, device=device
    )  # [rows, dim // group]
    return {"packed": packed, "scales": scales}


def bit_exact_nan_canonical(outputs: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> Comparison:
    """Byte-for-byte equality where every NaN counts as one NaN (GPU converts emit a canonical payload, torch keeps another)."""
    from tiles.compare import bit_exact

    def canon(t: torch.Tensor) -> torch.Tensor:
        return torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t) if t.is_floating_point() else t

    return bit_exact({k: canon(v) for k, v in outputs.items()}, {k: canon(v.to(outputs[k].device)) for k, v in expected.items()})


# --------------------------------------------------------------------------------------
# Tiles
# --------------------------------------------------------------------------------------
class FP4QuantTile(Tile):
    """bf16 [rows, dim] -> packed FP4 uint8 [rows, dim // 2] + scale bytes uint8 [rows, dim // group]."""

    def __init__(self, name: str, dim: int, scale_format: str):
        self.name, self.dim, self.scale_format = name, dim, scale_format
        self.group = SCALE_GROUP[scale_format]
        self.description = f"FP4 quantise [rows, {dim}] bf16, group {self.group}, {scale_format.upper()} scales"

    def shapes(self) -> list[Shape]:
        return fp4_rows(self.dim)

    def search_space(self, arch: Arch) -> SearchSpace:
        return fp4_search_space(self.scale_format, value_bytes=2)

    def default_config(self, arch: Arch) -> Config:
        return fp4_default_config(self.scale_format)

    def build(self, shape: Shape, config: Config, arch: Arch):
        c = self.with_defaults(arch, config)
        return _quant_kernel(shape["dim"], self.scale_format, "bfloat16", c, arch)

    def make_inputs(self, shape: Shape, seed: int, device="cuda") -> Inputs:
        return quant_inputs(shape["rows"], shape["dim"], self.scale_format, seed, device)

    def alloc_outputs(self, kernel, inputs: Inputs) -> dict[str, torch.Tensor]:
        x = inputs["x"]
        packed = poisoned((x.shape[0], x.shape[1] // 2), torch.uint8, x.device)  # [rows, dim // 2]
        scales = poisoned((x.shape[0], x.shape[1] // self.group), torch.uint8, x.device)  # [rows, dim // group]
        return {"packed": packed, "scales": scales}

    def launch(self, kernel, inputs: Inputs, outputs: dict[str, torch.Tensor]) -> None:
        kernel(inputs["x"], outputs["packed"], outputs["scales"])

    def reference(self, inputs: Inputs) -> dict[str, torch.Tensor]:
        packed, scales = formats.fp4_quantize(inputs["x"], self.group, self.scale_format)
        return {"packed": packed, "scales": scales}

    def compare(self, outputs, expected) -> Comparison:
        return bit_exact_nan_canonical(outputs, expected)

    def bytes_moved(self, shape: Shape) -> float:
        rows, dim = shape["rows"], shape["dim"]
        return rows * (dim * 2 + dim // 2 + dim // self.group)


class FP4DequantTile(FP4QuantTile):
    """packed FP4 uint8 [rows, dim // 2] + scale bytes uint8 [rows, dim // group] -> bf16 [rows, dim] (fp32 through the public function)."""

    def __init__(self, name: str, dim: int, scale_format: str):
        super().__init__(name, dim, scale_format)
        self.description = f"FP4 dequantise to [rows, {dim}] bf16, group {self.group}, {scale_format.upper()} scales"

    def search_space(self, arch: Arch) -> SearchSpace:
        return fp4_search_space(self.scale_format, value_bytes=2, quantise=False)

    def default_config(self, arch: Arch) -> Config:
        return fp4_default_config(self.scale_format, quantise=False)

    def build(self, shape: Shape, config: Config, arch: Arch):
        c = self.with_defaults(arch, config)
        return _dequant_kernel(shape["dim"], self.scale_format, "bfloat16", c, arch)

    def make_inputs(self, shape: Shape, seed: int, device="cuda") -> Inputs:
        return dequant_inputs(shape["rows"], shape["dim"], self.scale_format, seed, device)

    def alloc_outputs(self, kernel, inputs: Inputs) -> dict[str, torch.Tensor]:
        packed = inputs["packed"]
        return {"out": poisoned((packed.shape[0], packed.shape[1] * 2), torch.bfloat16, packed.device)}  # [rows, dim]

    def launch(self, kernel, inputs: Inputs, outputs: dict[str, torch.Tensor]) -> None:
        kernel(inputs["packed"], inputs["scales"], outputs["out"])

    def reference(self, inputs: Inputs) -> dict[str, torch.Tensor]:
        out = formats.fp4_dequantize(inputs["packed"], inputs["scales"], self.group, self.scale_format)
        return {"out": out.to(torch.bfloat16)}


TILES = [
    FP4QuantTile("fp4_quant_main", MAIN_DIM, "e4m3"),
    FP4QuantTile("fp4_quant_index", INDEX_DIM, "e8m0"),
    FP4DequantTile("fp4_dequant_main", MAIN_DIM, "e4m3"),
    FP4DequantTile("fp4_dequant_index", INDEX_DIM, "e8m0"),
]


# --------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------
def _check_format(group_size: int, scale_format: str) -> None:
    if scale_format not in SCALE_GROUP:
        raise TileError(f"unknown scale_format {scale_format!r}: use 'e4m3' (group 16) or 'e8m0' (group 32)")
    if group_size != SCALE_GROUP[scale_format]:
        raise TileError(f"scale_format {scale_format!r} goes with group_size={SCALE_GROUP[scale_format]}, got {group_size}")


def _check_cuda(t: torch.Tensor, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TileError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cuda":
        raise TileError(f"{what} is on {t.device}: the FP4 kernels run on a CUDA device (model.formats has the CPU reference)")
    if not t.is_contiguous():
        raise TileError(f"{what} must be contiguous (call .contiguous() first)")


def pick_config(tile: Tile, shape: Shape, arch: Arch, config: Config | None) -> Config:
    """The config to run: the caller's (validated), else a stored tuned winner when the results store has one, else the default."""
    if config is None:
        config = _tuned_config(tile, shape, arch)
    full = tile.with_defaults(arch, config or {})
    if config is None and tile.search_space(arch).violations(full, shape, arch):
        full["groups_per_thread"] = 1  # a row width the default vector does not divide
    reasons = tile.search_space(arch).violations(full, shape, arch)
    if reasons:
        raise TileError(f"config {full} is invalid for {tile.name} at {dict(shape.dims)} on {arch.name}: {'; '.join(reasons)}")
    return full


def _tuned_config(tile: Tile, shape: Shape, arch: Arch) -> Config | None:
    """The stored winner for (arch, shape) from :func:`tiles.results.config_for`, None when only the default exists."""
    found = _stored_winner(tile.name, tuple(sorted(shape.dims.items())), arch.name)
    return dict(found) if found is not None else None


@functools.lru_cache(maxsize=256)
def _stored_winner(tile_name: str, dims: tuple, arch_name: str) -> tuple | None:
    # cached: the public functions sit on the decode path and must not read a YAML file per call
    try:
        from tiles.results import config_for
    except ImportError:  # the results store is optional: without it every call runs the default
        return None
    from tiles.arch import get_arch
    from tiles.registry import get_tile

    config, source = config_for(get_tile(tile_name), Shape("call", "any", dict(dims)), get_arch(arch_name))
    return tuple(config.items()) if source.startswith("tuned:") else None


def tile_for(quantise: bool, scale_format: str) -> Tile:
    """The FP4 tile a call runs on: quantise or dequantise, main-KV (e4m3) or index (e8m0) format."""
    return TILES[(0 if quantise else 2) + (0 if scale_format == "e4m3" else 1)]


def fp4_quantize(
    x: torch.Tensor, group_size: int = 16, scale_format: str = "e4m3", config: Config | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise to packed FP4 E2M1 with one scale per group, bit-exact with :func:`model.formats.fp4_quantize`.

    Args:
        x: bfloat16 or float32 [..., N] on a CUDA device, contiguous; N a multiple of ``group_size``.
        group_size: 16 with ``"e4m3"`` (main KV, N = 512) or 32 with ``"e8m0"`` (index K/Q, N = 128).
        config: tile parameters (see :func:`fp4_search_space`); None picks the tuned or default config.
            float32 input always runs ``code='divide'`` (the thresholds are exact for bf16 only).
    Returns:
        packed uint8 [..., N // 2] (even element in the low nibble) and scales uint8 [..., N // group_size]
        (raw E4M3 or E8M0 bytes).
    """
    _check_format(group_size, scale_format)
    _check_cuda(x, "x")
    if x.dtype not in _TL_DTYPE:
        raise TileError(f"x must be bfloat16 or float32, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] % group_size:
        raise TileError(f"x has shape {tuple(x.shape)}: the last dim must be a multiple of group_size={group_size}")
    n = x.shape[-1]
    x2 = x.reshape(-1, n)  # [rows, N]
    rows = x2.shape[0]
    packed = torch.empty(*x.shape[:-1], n // 2, dtype=torch.uint8, device=x.device)  # [..., N // 2]
    scales = torch.empty(*x.shape[:-1], n // group_size, dtype=torch.uint8, device=x.device)  # [..., N // group]
    if rows == 0:
        return packed, scales
    arch = detect()
    tile = tile_for(True, scale_format)
    shape = Shape("call", "any", {"rows": rows, "dim": n})
    c = pick_config(tile, shape, arch, config)
    if x.dtype == torch.float32 and (why := _staging_fits(c, shape, arch, 4, scale_format)):
        raise TileError(f"config {c} does not fit float32 input: {why}")
    kernel = _quant_kernel(n, scale_format, _TL_DTYPE[x.dtype], c, arch)
    kernel(x2, packed.view(rows, n // 2), scales.view(rows, n // group_size))
    return packed, scales


def fp4_dequantize(
    packed: torch.Tensor,
    scales: torch.Tensor,
    group_size: int = 16,
    scale_format: str = "e4m3",
    out_dtype: torch.dtype = torch.bfloat16,
    config: Config | None = None,
) -> torch.Tensor:
    """Inverse of :func:`fp4_quantize`, value for value :func:`model.formats.fp4_dequantize` (cast to ``out_dtype``).

    Args:
        packed: uint8 [..., N // 2] on a CUDA device, contiguous.
        scales: uint8 [..., N // group_size], same leading dims and device, contiguous.
        out_dtype: torch.bfloat16 (exact: every FP4 value times an E4M3/E8M0 scale fits in 8 bits) or torch.float32.
    Returns:
        out_dtype [..., N].
    """
    _check_format(group_size, scale_format)
    _check_cuda(packed, "packed")
    _check_cuda(scales, "scales")
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TileError(f"packed and scales must be uint8, got {packed.dtype} and {scales.dtype}")
    if out_dtype not in _TL_DTYPE:
        raise TileError(f"out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")
    if packed.dim() == 0 or packed.shape[:-1] != scales.shape[:-1] or scales.shape[-1] * group_size != packed.shape[-1] * 2:
        raise TileError(
            f"packed {tuple(packed.shape)} and scales {tuple(scales.shape)} do not match: want [..., N // 2] and [..., N // {group_size}]"
        )
    if packed.device != scales.device:
        raise TileError(f"packed is on {packed.device} but scales on {scales.device}")
    n = packed.shape[-1] * 2
    rows = math.prod(packed.shape[:-1])
    out = torch.empty(*packed.shape[:-1], n, dtype=out_dtype, device=packed.device)  # [..., N]
    if rows == 0:
        return out
    arch = detect()
    tile = tile_for(False, scale_format)
    shape = Shape("call", "any", {"rows": rows, "dim": n})
    c = pick_config(tile, shape, arch, config)
    if out_dtype == torch.float32 and (why := _staging_fits(c, shape, arch, 4, scale_format)):
        raise TileError(f"config {c} does not fit float32 output: {why}")
    kernel = _dequant_kernel(n, scale_format, _TL_DTYPE[out_dtype], c, arch)
    kernel(packed.view(rows, n // 2), scales.view(rows, n // group_size), out.view(rows, n))
    return out
