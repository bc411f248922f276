"""Sparse gather attention with an attention sink: FP4 main KV + FP8 window KV (and a bf16-KV variant).

Every query token attends, in one online softmax, to its SWA window entries (FP8 E4M3 codes
with one E8M0 scale per 32, indices into the window KV) and its top-k compressed entries
(packed FP4 E2M1 with one E4M3 scale per 16, indices into the group's global KV); the sink
adds ``exp(sink_h)`` to the denominator. K = V = the 512-dim latent (shared-KV MQA), so one
block serves ``heads_per_block`` heads of one token and gathers each KV row once for all of
them. Hopper has no FP4 MMA: the gathered rows are dequantised to bf16 in shared memory
(exactly: e2m1 x e4m3 and e4m3 x 2^k fit in bf16's 8-bit significand) and fed to wgmma.

Schedules (a tile parameter):

* ``ws`` (the Hopper default): warp specialisation after FlashMLA / TileLang's
  ``sparse_mla_fwd_pipelined``: one producer warpgroup gathers and dequantises into two KV buffers
  while consumer warpgroup 0 computes S, the online softmax and the left half of O, warpgroup 1 the
  right half (Hopper only: mbarriers, wgmma, setmaxnreg). ``produce`` picks how the producer fills a
  buffer: ``batched`` (the default: every load of a block in flight at once, packed-integer dequant,
  cp.async for bf16; 1.5-2x faster than ``serial`` on the H200, 5d356e3) or
  ``serial`` (16 rows per waited pass).
* ``pipelined``: all threads gather + dequantise, then both GEMMs; ``T.Pipelined`` prefetches the
  next block's indices (and, with ``dequant="staged"``, its raw bytes). The sm80/86/89 schedule
  (the GEMMs lower to mma.sync there).

``dequant`` (FP4 tiles, pipelined schedule) picks how the quantised bytes reach shared memory:
``direct`` (global -> registers -> bf16 smem, synchronous) or ``staged`` (the raw FP4 words and scales
are cp.async'ed into smem one block ahead, then dequantised smem -> smem). FP4 codes are read as int32
words, 8 codes per load, all inside one 16-wide scale group.

Split-KV (``n_split`` > 1, decode): each split takes a share of the window blocks and of the top-k
blocks, writes its partial output (normalised by its own sum; bf16 on Hopper, ``partials``) and its log2-sum-exp, and a small
combine kernel merges the splits together with the sink (``combine="fused"``, ws only: the last split CTA of
each token merges them itself, after an arrival counter). ``n_split="auto"`` picks the fewest
power-of-two splits that give at least two blocks per SM.

``kv_staging`` (the prefill tile): ``gather`` decodes each FP4/FP8 row in the producer every time a token reads it;
``expand`` first expands both caches to bf16 in one launch (:mod:`tiles.sparse_attn.kv_expand`, the producer's own decode
helpers, so the same bits) and runs the bf16 kernel on them: at prefill every row is read by hundreds of tokens, and
the decode work is what paced the producer (1.24x at 4K-64K on the H200). ``auto`` (the Hopper prefill default) expands
from EXPAND_MIN_TOKENS tokens reading each row EXPAND_MIN_READS times or more. The decode tile always gathers.

Index policy: -1 is skipped (masked: its KV row is written as zeros, so no garbage reaches the GEMM);
a repeated index counts each time; an index past the cache length is rejected by the wrapper only when
``check_indices=True`` (one host sync, off by default: in the model the indexer produces in-range
indices by construction). Unchecked, the ``ws``/``batched`` producer masks such an index exactly like
-1; the other schedules' guarded loads read zeros for its row (a zero key: score 0, not -inf).

The package, in the order a reader meets the kernel:

* :mod:`.kernels`: ``sparse_attn_kernel`` (validates the options, builds the pipelined schedule, hands ``ws`` to
  :mod:`.ws_kernel`) and ``combine_kernel`` (merges split partials with the sink).
* :mod:`.ws_kernel`: the warp-specialised CTA (shared buffers, barriers, the three warpgroups' roles).
* :mod:`.ws_consumers`, :mod:`.ws_producer`: the consumer schedules (wg0_scores, balanced, seesaw, paired) and the
  producer's fills (serial, batched, prefetch, halves), as TileLang macros.
* :mod:`.dequant` (E2M1/E8M0 decode and the packed-integer CUDA), :mod:`.online_softmax`.
* :mod:`.options` (the option vocabulary and the rules the kernel and the search space share), :mod:`.policy`
  (per-call resolution of the "auto" choices), :mod:`.space` (the search space and its constraints),
  :mod:`.kv_expand` (the prefill's caches expanded to bf16 once).
* :mod:`.launch`: the compiled kernels and their launch (``CompiledAttention``, ``ExpandedAttention``, ``compiled``).
* :mod:`.api`: the public functions ``sparse_attention`` and ``sparse_attention_bf16`` (checks, config choice).
* :mod:`.tile`: the three tiles (defaults, inputs, the reference) the tuner and ``lab`` use.
"""

from tiles.sparse_attn.api import sparse_attention, sparse_attention_bf16, tile_for_tokens
from tiles.sparse_attn.kernels import sparse_attn_kernel
from tiles.sparse_attn.launch import FP4_ONLY_KEYS, CompiledAttention, ExpandedAttention, compiled
from tiles.sparse_attn.options import UNUSED_ROWS
from tiles.sparse_attn.policy import resolve_io, resolve_kv_staging, resolve_split
from tiles.sparse_attn.space import attention_search_space, resolve_consumers
from tiles.sparse_attn.tile import BF16_TILE, DECODE_TILE, PREFILL_TILE, TILES, TOLERANCE
from tiles.sparse_attn.ws_consumers import PAIRED_NREG, PAIRED_OVL_NREG, SEESAW_NREG

__all__ = [
    "BF16_TILE",
    "DECODE_TILE",
    "FP4_ONLY_KEYS",
    "PAIRED_NREG",
    "PAIRED_OVL_NREG",
    "PREFILL_TILE",
    "SEESAW_NREG",
    "TILES",
    "TOLERANCE",
    "UNUSED_ROWS",
    "CompiledAttention",
    "ExpandedAttention",
    "attention_search_space",
    "compiled",
    "resolve_consumers",
    "resolve_io",
    "resolve_kv_staging",
    "resolve_split",
    "sparse_attention",
    "sparse_attention_bf16",
    "sparse_attn_kernel",
    "tile_for_tokens",
]
