"""A decode cache at a given context length, filled with realistic data without running a prefill.

Timing a decode step at 128K context needs a cache holding 128K tokens; prefilling that with
the torch baseline for 64 sequences would take hours. The entries are real FP4/FP8 encodings
(through :mod:`model.formats`) of random latents with unit RMS, so kernels see valid codes
and scales of realistic magnitude.
"""

from __future__ import annotations

import torch

from model import formats
from model.cache import KVCache
from model.paged import PagedKVCache

_ROWS_PER_CHUNK = 1 << 20  # latents encoded per chunk (bounds the float32 scratch to ~2 GB)


def _encode_fp4(n_rows: int, dim: int, group: int, scale_format: str, gen: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    packed, scales = [], []
    for start in range(0, n_rows, _ROWS_PER_CHUNK):
        rows = min(_ROWS_PER_CHUNK, n_rows - start)
        x = torch.randn(rows, dim, generator=gen, device=device)  # [rows, dim]
        p, s = formats.fp4_quantize(x, group, scale_format)
        packed.append(p)
        scales.append(s)
    return torch.cat(packed), torch.cat(scales)


@torch.no_grad()
def fill_cache(cache: KVCache, context: int, seed: int = 0) -> KVCache:
    """Fill an empty ``cache`` as if ``context`` tokens had been consumed.

    Args:
        cache: from ``model.new_cache(batch, capacity_tokens)`` with capacity >= context + the steps to time.
        context: tokens already consumed per sequence.
    Returns:
        the same cache, ``n_tokens == context``.
    """
    cfg, B = cache.cfg, cache.batch
    device = cache.rings[0].codes.device
    gen = torch.Generator(device=device).manual_seed(seed)
    for src, glob in cache.globals.items():
        n = context // glob.ratio
        if n == 0:
            continue
        main_p, main_s = _encode_fp4(B * n, cfg.head_dim, cfg.main_fp4_group, "e4m3", gen, device)
        idx_p, idx_s = _encode_fp4(B * n, cfg.index_head_dim, cfg.index_fp4_group, "e8m0", gen, device)
        glob.append(*(t.view(B, n, -1) for t in (main_p, main_s, idx_p, idx_s)))
    for src, tail in cache.tails.items():
        pending = context % cache.globals[src].ratio
        if pending:
            tail.store(
                torch.randn(B, pending, cfg.head_dim, generator=gen, device=device, dtype=tail.kv.dtype),
                torch.randn(B, pending, cfg.head_dim, generator=gen, device=device, dtype=tail.gate.dtype),
            )
    held = min(context, cfg.window)
    for ring in cache.rings:
        ring.reset(context - held)
        if held:
            codes, scales = formats.fp8_quantize(torch.randn(B, held, cfg.head_dim, generator=gen, device=device))
            ring.write(codes, scales, context - held)
    cache.n_tokens = context
    return cache


@torch.no_grad()
def fill_paged_cache(cache: PagedKVCache, lengths: list[int], seed: int = 0, headroom: int = 0) -> list[int]:
    """Add one sequence per length to ``cache`` and fill it as if that many tokens had been consumed (real FP4/FP8
    encodings of random unit-RMS latents, as :func:`fill_cache`).

    Args:
        cache: an empty-enough :class:`PagedKVCache` (pages for every length plus ``headroom`` tokens each).
        lengths: tokens consumed per sequence.
        headroom: tokens each sequence gets pages for beyond its length (the decode steps to time).
    Returns:
        the new sequence ids, in the order of ``lengths``.
    """
    cfg, device = cache.cfg, cache.device
    gen = torch.Generator(device=device).manual_seed(seed)
    seqs = [cache.add() for _ in lengths]
    cache.extend(seqs, [n + headroom for n in lengths])
    for src, pool in cache.groups.items():
        counts = [n // pool.ratio for n in lengths]
        if not sum(counts):
            continue
        main_p, main_s = _encode_fp4(sum(counts), cfg.head_dim, cfg.main_fp4_group, "e4m3", gen, device)
        idx_p, idx_s = _encode_fp4(sum(counts), cfg.index_head_dim, cfg.index_fp4_group, "e8m0", gen, device)
        at = 0
        for seq, n in zip(seqs, counts, strict=True):
            if n:
                cache.write_entries(seq, src, *(t[at : at + n] for t in (main_p, main_s, idx_p, idx_s)))
            at += n
        if pool.ratio > 1:
            for seq, length in zip(seqs, lengths, strict=True):
                pending = length % pool.ratio
                if pending:
                    dt = cache.state.tail_kv[src].dtype
                    rows = torch.randn(2, 1, pending, cfg.head_dim, generator=gen, device=device, dtype=dt)  # kv, gate
                    cache.store_tail(seq, src, rows[0], rows[1])
    for layer in range(cfg.n_layers):
        for seq, length in zip(seqs, lengths, strict=True):
            held = min(length, cfg.window)
            cache.reset_ring(seq, layer, length - held)
            if held:
                codes, scales = formats.fp8_quantize(torch.randn(1, held, cfg.head_dim, generator=gen, device=device))
                cache.swa_step([seq], layer, [length - held], codes, scales)
    for seq, length in zip(seqs, lengths, strict=True):
        cache.advance([seq], length)
    return seqs
