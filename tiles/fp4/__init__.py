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

The package, in reading order: ``kernel`` (layout, code arithmetic, the builders), ``space`` (search space and
defaults), ``tile`` (the four tiles) and ``api`` (the public functions).
"""

from tiles.fp4.api import fp4_dequantize, fp4_quantize, tile_for
from tiles.fp4.kernel import CODES, FLT_MAX, INDEX_DIM, LANE_VALUES, MAIN_DIM, PRMT_ASM_CUDA, SCALE_GROUP, SIXTH, build_dequant, build_quant
from tiles.fp4.space import fp4_default_config, fp4_search_space
from tiles.fp4.tile import TILES, FP4DequantTile, FP4QuantTile, bit_exact_nan_canonical, dequant_inputs, quant_inputs

__all__ = [
    "CODES",
    "FLT_MAX",
    "INDEX_DIM",
    "LANE_VALUES",
    "MAIN_DIM",
    "PRMT_ASM_CUDA",
    "SCALE_GROUP",
    "SIXTH",
    "TILES",
    "FP4DequantTile",
    "FP4QuantTile",
    "bit_exact_nan_canonical",
    "build_dequant",
    "build_quant",
    "dequant_inputs",
    "fp4_default_config",
    "fp4_dequantize",
    "fp4_quantize",
    "fp4_search_space",
    "quant_inputs",
    "tile_for",
]
