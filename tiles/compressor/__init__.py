"""The compressor of Full layers on the GPU (spec section 2): one pass from the kv/gate
projections to both FP4 caches.

Per CTA, ``block_g`` groups: per-channel softmax pooling over the 2 tokens of a group
(ratio 1: the token itself), RMSNorm (the pre-RoPE latent), RoPE on the last 64 dims at the
group's first position, FP4 (E4M3 per 16) into the main cache; then the index-K projection
512 -> 128 of the latent *before* RoPE (as the official V4.1 code: the indexer needs the
unrotated form), its RMSNorm and RoPE, FP4 (E8M0 per 32) into the index cache. The
latent never leaves the chip: memory traffic is the kv/gate read plus 356 B written per
entry. The Wkv/Wgate matmuls stay in cuBLAS (the inputs here are their fp32 outputs).

The index-K projection is fp32 in the reference. ``proj`` chooses how the kernel computes it:
``tf32x3`` splits both operands into a TF32 high part and an fp32 remainder and sums three
tensor-core products (hi*hi + hi*lo + lo*hi, error about 2^-20 relative), ``f16x3`` (register
projection; Hopper's default) does the same in fp16 on m16n8k16 with Wk scaled by
a power of two and split on the host (half the MMAs, 22-bit operands), ``simt`` is plain fp32 FMA
from shared memory. ``proj_latent="f16_split"`` has the main pass store the latent already split.

Comparison rule (honest about what is achieved): the fp32 latent and index key are computed
in a different summation order than torch (RMSNorm sum of squares, the 512-term projection),
so they equal the reference only to a few ulps; FP4 codes therefore match
:func:`model.formats.fp4_quantize` of the reference latent except where a value sits within
rounding of a code boundary. The check: dequantised caches within relative L2 1e-3 of the
reference caches (1e-2, which follows from the next bound), at most 1e-3 of the packed bytes
and of the scale bytes different, every differing scale byte one step off, and every differing
code one step off where its group's scale byte is equal (a scale one step off requantises its
group). Measured on the H200 (e7d4e86, 79fe566, f2a870e; notes/compressor.md): at 64K tokens
about 2e-7 of the main cache's bytes differ with the reference's pooling expression
(``pool_math="ieee"``: the RMSNorm's order), about 5e-7 with Hopper's ``"fast"`` pooling and 4e-7
with it and ``norm_pass="in_pool"`` (Hopper's default; ratio 1: no packed byte and 5e-7 of the
scale bytes); the index cache differs in about 1e-5 of its bytes with the ``tf32x3`` projection,
2-6e-6 with ``f16x3``, and was bit-exact with ``simt`` at 4K tokens.

Decode tail state (ratio 2): when a step brings the second token of a group, pass the stored
first token's projections as ``tail_kv`` / ``tail_gate`` [B, 512]; they are placed in front of
``kv``/``gate``. Complete groups are written; when the token count (tail included) is odd the
last token is not consumed and the caller stores ``kv[:, -1]``, ``gate[:, -1]`` as the next tail.

The package, in reading order: ``common`` (sizes, bounds, layout constants), ``pool_encode`` (pooling and the FP4
encode), ``projection`` (the tf32x3 and f16x3 index-K projections), ``kernel``, ``space`` (the structural choices, the
search space and its constraints), ``launch`` (build, Wk forms, launch arguments), ``api`` (``compress``) and ``tile``.
"""

from tiles.compressor.api import compress
from tiles.compressor.common import (
    DEQ_RTOL,
    DI,
    DIRECT_ROWS,
    INDEX_GROUP,
    MAIN_GROUP,
    MAX_CODE_DIFF_FRACTION,
    MULTI_CTA_CHUNK,
    MULTI_CTA_STAGES,
    NORM_LANES,
    ROPE,
    D,
)
from tiles.compressor.launch import split_tf32
from tiles.compressor.pool_encode import E2M1_BOUNDS
from tiles.compressor.projection import ROT_PAD, wk_fragment_order
from tiles.compressor.space import (
    ENCODES,
    KV_LOADS,
    MAIN_PASSES,
    NORM_PASSES,
    POOL_MATHS,
    PROJ_ACCUMULATORS,
    PROJ_K_SPLITS,
    PROJ_OPERANDS,
    SCHEDULES,
    WK_LOADS,
)
from tiles.compressor.tile import COMPRESSOR, TILES, CompressorTile, compare_fp4_caches

__all__ = [
    "COMPRESSOR",
    "DEQ_RTOL",
    "DI",
    "DIRECT_ROWS",
    "E2M1_BOUNDS",
    "ENCODES",
    "INDEX_GROUP",
    "KV_LOADS",
    "MAIN_GROUP",
    "MAIN_PASSES",
    "MAX_CODE_DIFF_FRACTION",
    "MULTI_CTA_CHUNK",
    "MULTI_CTA_STAGES",
    "NORM_LANES",
    "NORM_PASSES",
    "POOL_MATHS",
    "PROJ_ACCUMULATORS",
    "PROJ_K_SPLITS",
    "PROJ_OPERANDS",
    "ROPE",
    "ROT_PAD",
    "SCHEDULES",
    "TILES",
    "WK_LOADS",
    "CompressorTile",
    "D",
    "compare_fp4_caches",
    "compress",
    "split_tf32",
    "wk_fragment_order",
]
