"""Plain torch versions of every op the kernels accelerate.

These functions are the model's ``torch`` backend, the correctness oracle of every tile
test and the baseline of every speed comparison. Each takes explicit tensors (no module
state) and documents its shapes.
"""

from model.ops.compressor import compress_groups, compressor_latents, group_rope, index_keys, main_entries
from model.ops.indexer import candidate_blocks, indexer_scores, pool_mask, topk_positions, visible_entries
from model.ops.norm import rms_norm
from model.ops.rope import RopeConfig, apply_rope, rope_tables
from model.ops.sparse_attn import sparse_attention, sparse_attention_quantized

__all__ = [
    "RopeConfig",
    "apply_rope",
    "candidate_blocks",
    "compress_groups",
    "compressor_latents",
    "group_rope",
    "index_keys",
    "indexer_scores",
    "main_entries",
    "pool_mask",
    "rms_norm",
    "rope_tables",
    "sparse_attention",
    "sparse_attention_quantized",
    "topk_positions",
    "visible_entries",
]
