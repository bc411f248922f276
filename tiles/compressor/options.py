"""The values of the compressor's structural parameters (encode, loads, schedule, pooling, norm and main passes,
projection operands and accumulators): what ``_compress_kernel`` builds and the search space offers."""

ENCODES = ("divide", "thresholds")
WK_LOADS = ("hi_lo", "fp32")  # how the index-K weight reaches the SM (see _compress_kernel)
SCHEDULES = ("ws", "flat")  # producer warpgroup (one CTA per SM) or none (see _compress_kernel)
# kv (and gate): 16-channel slabs, ratio 1's block rows in one copy, or per-thread loads into the pooling (see _compress_kernel)
KV_LOADS = ("slabs", "whole", "direct")


POOL_MATHS = ("ieee", "fast")  # how the ratio-2 softmax over a group's two tokens is computed (see _pool_pair)
PROJ_K_SPLITS = (1, 2)  # register projection: each warp covers all 512 k, or half of them with twice the output columns
NORM_PASSES = ("separate", "in_pool")  # RMSNorm after the pooling from rot_s, or on the pooled rows in registers (kv_load=direct)
MAIN_PASSES = ("separate", "in_pool")  # RoPE + main cache as passes over rot_s, or from the rows in registers (norm_pass=in_pool)


PROJ_OPERANDS = ("smem", "registers", "wgmma")  # where the tf32x3 projection's operands live (see _compress_kernel)
PROJ_ACCUMULATORS = ("shared", "split")  # register projection: one accumulator per output tile, or the small products apart
MMA_PROJS = ("tf32x3", "f16x3")  # the tensor-core projections (the others: "simt")
PROJ_LATENTS = ("fp32", "f16_split")  # proj=f16x3: the latent in rot_s as fp32 (split per warp) or split once by the main pass
PROJ_OUTS = ("k_s", "rot_s")  # proj=f16x3: the keys into their own shared buffer, or over rot_s's first 128 columns
MAIN_STORES = ("bulk", "registers")  # main_pass=in_pool: main cache via shared memory and bulk stores, or from registers
PROJ_PIPELINES = ("near", "deep")  # proj=f16x3 with f16_split: Wk two chunks ahead, latent at use; or four / one ahead
