"""The shape registry: every benchmark and tuning shape, derived from the ``v4.1-flash`` preset.

Spec section 5: decode B in {1, 16, 64, 128}, S (tokens per step) in {1, 2}, context
8K-128K (up to 1M for the indexer); prefill S = 4096-65536. Shape names are the keys under
which tuned winners are stored (``results/<arch>/<tile>.yaml``).
"""

from __future__ import annotations

from functools import cache

from model.config import ModelConfig, preset
from tiles.core.contract import Shape

DECODE_BATCHES = (1, 16, 64, 128)
DECODE_TOKENS = (1, 2)
PREFILL_TOKENS = (4096, 16384, 65536)
CONTEXTS = (8192, 32768, 131072)
PAGE_SIZE = 64  # compressed entries per page of the paged cache's shapes (the cache manager's default)


@cache
def flash() -> ModelConfig:
    return preset("v4.1-flash")


def _k(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def fp4_rows(dim: int) -> list[Shape]:
    """Row counts quantised at once: one decode step of new entries, a 64K prefill, and 1M rows (the bandwidth benchmark)."""
    rows = {"decode_b64": 64, "decode_b128": 128, "prefill_s4k": 4096, "prefill_s64k": 65536, "bulk_1m": 1 << 20}
    return [Shape(name, "decode" if name.startswith("decode") else "prefill", {"rows": n, "dim": dim}) for name, n in rows.items()]


def attention_shapes() -> list[Shape]:
    """Sparse attention: decode (B, S) over a 64K-token context, and prefill B=1."""
    cfg = flash()
    common = {"H": cfg.n_heads, "D": cfg.head_dim, "W": cfg.window, "K": cfg.index_topk}
    shapes = [
        Shape(f"decode_b{b}_s{s}", "decode", {"B": b, "S": s, "Nc": 32768, "Nw": cfg.window + s, **common})
        for b in DECODE_BATCHES
        for s in DECODE_TOKENS
    ]
    shapes += [Shape(f"prefill_s{_k(s)}", "prefill", {"B": 1, "S": s, "Nc": s, "Nw": s, **common}) for s in PREFILL_TOKENS]
    # the paged cache's decode: both caches are pools every sequence reads through its indices (page pool, state-slot
    # pool); Nc and Nw count rows per sequence, the pools hold B times as many in shuffled pages
    shapes += [
        Shape(f"decode_b{b}_s1_paged", "decode", {"B": b, "S": 1, "Nc": 32768, "Nw": cfg.window, "pool": 1, **common}) for b in (64,)
    ]
    return shapes


def indexer_shapes() -> list[Shape]:
    """Indexer scores + top-k: decode over 8K-1M-entry index caches, prefill over its own tokens."""
    cfg = flash()
    common = {"Hi": cfg.index_heads, "Di": cfg.index_head_dim, "K": cfg.index_topk}
    shapes = [Shape(f"decode_b{b}_n{_k(n)}", "decode", {"B": b, "S": 1, "N": n, **common}) for b in (1, 64) for n in CONTEXTS + (1 << 20,)]
    shapes += [Shape(f"prefill_s{_k(s)}", "prefill", {"B": 1, "S": s, "N": s, **common}) for s in (4096, 16384)]
    # the paged cache (64-entry pages, the cache manager's default) at the decode shape the contiguous one is tuned on
    shapes += [Shape("decode_b64_n128k_paged", "decode", {"B": 64, "S": 1, "N": 131072, "page": PAGE_SIZE, **common})]
    return shapes


def reindex_shapes() -> list[Shape]:
    """Reindex: top-k inside the candidate pool (at most 2048 blocks of 8 = 16,384 candidates)."""
    cfg = flash()
    pool = cfg.pool_max_blocks * cfg.pool_block
    common = {"Hi": cfg.index_heads, "Di": cfg.index_head_dim, "K": cfg.index_topk, "P": cfg.pool_max_blocks, "block": cfg.pool_block}
    shapes = [Shape(f"decode_b{b}_n{_k(n)}", "decode", {"B": b, "S": 1, "N": n, **common}) for b in (1, 64) for n in (pool * 2, 131072)]
    return shapes + [Shape("decode_b64_n128k_paged", "decode", {"B": 64, "S": 1, "N": 131072, "page": PAGE_SIZE, **common})]


def compressor_shapes() -> list[Shape]:
    """Compressor: the ratio-2 encoder sources and the ratio-1 decoder source, prefill and one decode step."""
    cfg = flash()
    common = {"dim": cfg.dim, "D": cfg.head_dim, "Di": cfg.index_head_dim}
    shapes = []
    for ratio in (2, 1):
        shapes += [Shape(f"prefill_r{ratio}_s{_k(s)}", "prefill", {"B": 1, "S": s, "ratio": ratio, **common}) for s in (4096, 65536)]
        shapes += [Shape(f"decode_r{ratio}_b{b}", "decode", {"B": b, "S": 1 * ratio, "ratio": ratio, **common}) for b in (64,)]
    return shapes
