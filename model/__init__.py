"""PyTorch reference CSA2/CED model: configs, formats, reference ops, the model and its KV cache.

from model import build_model, preset
m = build_model(preset("tiny"), backend="torch", device="cpu", dtype=torch.float32, seed=0)
full = m.forward(tokens)               # [B, N] -> [B, N, vocab]
logits, cache = m.prefill(tokens)      # CED prefill -> [B, vocab]
logits = m.decode(next_tokens, cache)  # [B] -> [B, vocab]

Continuous batching on the paged cache manager (sequences of their own lengths, joining and leaving):
cache = m.new_paged_cache(n_pages=256, n_slots=8, page_size=64)
seq = cache.add()
logits = m.prefill_paged(prompt, cache, seq)             # [N] -> [vocab]
logits = m.decode_paged(next_tokens, cache, [seq, ...])  # [B] -> [B, vocab], any live sequences
cache.free(seq)

Prefix reuse (pages shared by reference count, copy-on-write, bounded replay of the lost SWA state):
cache.publish_prefix(seq, prompt)                        # index the prompt's whole prefix blocks
r = m.prefill_with_prefix(prompt2, cache)                # r.seq, r.logits [vocab], r.hit.n_tokens, r.replayed

Conformance with the official DeepSeek-V4.1 inference code (``inference/model.py`` and its
``kernel.py``), the semantic reference where ``csa2-spec.md`` is silent. The attention path
computes what it computes: index keys ``rope(k_norm(Wk latent))`` from the compressor's latent
*before* RoPE, the FP4 rules of both caches and the FP8 window rule (amax floored at 1e-4)
bit for bit, ``norm_eps`` 1e-20 in every RMSNorm. Three deliberate differences, each tested
in ``tests/test_conformance.py``:

* **A ratio-2 decode step whose group is still filling** scores against the layer group's own
  index cache. The official indexer reads a module-global ``index_k`` that the last source
  layer to *publish* keys set, which at such a step is another group's cache (it looks like a
  defect: the keys then belong to another layer's positions).
* **Reindex with fewer than top-k visible entries in the candidate pool** fills the rest of
  the row with -1. The official code takes ``min(topk, visible)`` entries from the masked row,
  so the slots beyond the pool's entries hold arbitrary visible entries outside the pool (the
  tie order of -inf scores).
* **RoPE angles** are ``position * freq`` in float64, rounded once (:mod:`model.ops.rope`); the
  official tables are float32 products (about 2^-24 relative error in the angle, 4e-3 rad at
  position 64K for the fastest pair).

Other scope choices (dense FFN by default, no hyper-connections, Engram, vision or MTP) are
listed in the spec, section 1.
"""

from model.backend import Backend, BackendError, TorchBackend, load_backend
from model.cache import KVCache
from model.config import ConfigError, LayerMode, ModelConfig, preset
from model.inputs import InputError, InputTypeError
from model.model import Model, PrefixPrefill, build_model, count_parameters
from model.paged import OutOfPages, OutOfSlots, PagedCacheError, PagedKVCache, SequenceError
from model.prefix import PrefixHit, PrefixStats

__all__ = [
    "Backend",
    "BackendError",
    "ConfigError",
    "InputError",
    "InputTypeError",
    "KVCache",
    "LayerMode",
    "Model",
    "ModelConfig",
    "OutOfPages",
    "OutOfSlots",
    "PagedCacheError",
    "PagedKVCache",
    "PrefixHit",
    "PrefixPrefill",
    "PrefixStats",
    "SequenceError",
    "TorchBackend",
    "build_model",
    "count_parameters",
    "load_backend",
    "preset",
]
