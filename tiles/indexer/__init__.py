"""The lightning indexer on the GPU (spec section 2): scores over the packed FP4 index K,
top-k, the candidate pool of layer 20 and the Reindex search inside the pool.

Three tiles share two kernels:

* a **score kernel**: per (batch, token, run of ``block_n`` entries) it loads the packed FP4
  index K (``uint8 [B, N, 64]`` read as 16 int32 words per entry, plus the 4 E8M0 scale
  bytes read as one int32), dequantises it to bf16 in shared memory (or straight into the
  MMA's register fragment), multiplies it with the 32 x 128 query on the tensor cores
  (``acc[entries, heads] = K @ q^T``, so the entry tile is the M side of wgmma), applies ReLU
  and the per-head weight and sums over heads. FP4 values times a power-of-two scale are
  exact in bf16 and their products exact in fp32, so the only difference from the fp32
  reference is the order of the sums. With ``gather`` it reads the entries of a candidate
  pool instead of a contiguous run (Reindex: the pool is gathered first, nothing else is
  scored).
* a **select kernel**: one CTA per score row finds the exact k-th largest score by radix
  select on the order-preserving 32-bit key of each fp32 score (``radix_bits`` per pass, the
  row re-read from L2 each pass, warp-aggregated histogram atomics), then writes the chosen positions in position order (a
  block-wide prefix count over contiguous per-thread segments), -1 fill. Ties at the k-th
  key go to the lower positions, the reference's rule, so the selection is deterministic.

Comparison rules (also in each tile's ``compare``): scores by relative L2 <= 1e-5 with -inf
exactly where the reference has it; top-k as index SETS: positions missing from either side
must have reference scores equal to the k-th largest reference score within 1e-5 relative
(their order cannot differ: both are sorted by position). Candidate pools must equal the
reference exactly when both are computed from the same scores. NaN scores are not part of the
contract (the reference lets a NaN take a slot; the kernel skips it).

The package, in reading order: ``common`` (sizes, tolerances), ``dequant`` (FP4 into bf16 or E4M3, in shared memory
or registers), ``score_kernel``, ``select_kernel``, ``policy`` (the "auto" choices), ``launch`` (build and launch for
one call), ``reference`` (inputs and comparison), ``space`` (parameters, constraints, defaults), ``api`` (the public
functions) and ``tile`` (the three tiles).
"""

from tiles.indexer.api import PAGE_SIZES, candidate_pool, indexer_topk, reindex_topk
from tiles.indexer.common import GROUP, HEAD_DIM, HEADS, NEG_INF, SCORE_RTOL, TIE_RTOL
from tiles.indexer.dequant import FP8_MAX_BLOCK_N, HOPPER_ONLY_DEQUANTS, PRMT_RS_DEQUANTS, REGISTER_A_DEQUANTS, RS_DEQUANTS
from tiles.indexer.policy import AUTO_CTAS_PER_SM, SELECT_SPLITS, TILES_PER_CTA, radix_config, resolve_select_split, resolve_tiles_per_cta
from tiles.indexer.reference import compare_topk_sets
from tiles.indexer.score_kernel import EPILOGUES, HIDDEN_TILES
from tiles.indexer.tile import CANDIDATE_POOL, INDEXER_TOPK, REINDEX_TOPK, TILES, CandidatePoolTile, IndexerTopkTile, ReindexTopkTile

__all__ = [
    "AUTO_CTAS_PER_SM",
    "CANDIDATE_POOL",
    "EPILOGUES",
    "FP8_MAX_BLOCK_N",
    "GROUP",
    "HEADS",
    "HEAD_DIM",
    "HIDDEN_TILES",
    "HOPPER_ONLY_DEQUANTS",
    "INDEXER_TOPK",
    "NEG_INF",
    "PAGE_SIZES",
    "PRMT_RS_DEQUANTS",
    "REGISTER_A_DEQUANTS",
    "REINDEX_TOPK",
    "RS_DEQUANTS",
    "SCORE_RTOL",
    "SELECT_SPLITS",
    "TIE_RTOL",
    "TILES",
    "TILES_PER_CTA",
    "CandidatePoolTile",
    "IndexerTopkTile",
    "ReindexTopkTile",
    "candidate_pool",
    "compare_topk_sets",
    "indexer_topk",
    "radix_config",
    "reindex_topk",
    "resolve_select_split",
    "resolve_tiles_per_cta",
]
