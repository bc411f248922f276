"""The compressor's fixed sizes, comparison bounds and the layout constants its kernel and constraints share."""

D, DI, ROPE = 512, 128, 64  # latent dim, index-K dim, rope dims (the last 64 of each)
MAIN_GROUP, INDEX_GROUP = 16, 32
MAX_CODE_DIFF_FRACTION = 1e-3  # packed bytes / scale bytes that may differ (one code step each)
# Relative L2 of the dequantised caches: one-step differences in up to 1e-3 of the values give
# about sqrt(1e-3) * (step / rms value) ~ 1e-2, so the bound follows from the fraction above.
DEQ_RTOL = 1e-2


MULTI_CTA_CHUNK, MULTI_CTA_STAGES = 16, 3  # ctas_per_sm > 1: kv/gate slab width and pipeline depth
DIRECT_ROWS = 8  # kv_load=direct: groups whose kv/gate rows are loaded into registers before any is pooled
NORM_LANES = 8  # ctas_per_sm > 1: threads per latent row in the RMSNorm sum of squares (one shuffle reduction)
LOAD_CHUNK = 32  # channels per staged kv/gate slab: [2 * block_g, 32] fp32 = 8 KiB per tensor at block_g 32
