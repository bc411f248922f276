"""KV cache manager (model.cache): bytes per token from the config, real packed storage."""

from __future__ import annotations

import pytest
import torch

from model import KVCache, build_model, preset
from model.cache import MLA_BYTES_PER_TOKEN, SwaRing
from model.config import PRESETS


def _formula(cfg) -> float:
    """Global bytes per token written out independently: FP4 main (g16, E4M3) + FP4 index K (g32, E8M0), / ratio."""
    entry = cfg.head_dim // 2 + cfg.head_dim // 16 + cfg.index_head_dim // 2 + cfg.index_head_dim // 32
    return sum(entry / cfg.compress_ratios[s] for s in cfg.kv_source_layers)


def test_flash_global_bytes_per_token_is_890():
    cfg = preset("v4.1-flash")
    assert KVCache.global_bytes_per_token(cfg) == 890
    assert [g.bytes_per_token for g in KVCache.layout(cfg)] == [178, 178, 178, 356]
    assert {(g.main_entry_bytes, g.index_entry_bytes) for g in KVCache.layout(cfg)} == {(288, 68)}
    assert MLA_BYTES_PER_TOKEN == 70272


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_follows_the_formula(name):
    cfg = preset(name)
    assert KVCache.global_bytes_per_token(cfg) == _formula(cfg)


def test_flash_fixed_state_per_sequence():
    fixed = KVCache.fixed_state_bytes(preset("v4.1-flash"))
    assert fixed["swa_rings"] == 40 * 128 * (512 + 16)
    assert fixed["compressor_tails"] == 3 * 1 * 2 * 512 * 4  # one pending token's fp32 kv + gate per ratio-2 source
    assert fixed["total"] == fixed["swa_rings"] + fixed["compressor_tails"]


def test_flash_groups_and_readers():
    groups = KVCache.layout(preset("v4.1-flash"))
    assert [(g.source, g.region, g.ratio) for g in groups] == [(2, "encoder", 2), (8, "encoder", 2), (14, "encoder", 2), (20, "decoder", 1)]
    assert groups[0].readers == tuple(range(2, 8)) and groups[3].readers == tuple(range(20, 40))


@pytest.fixture(scope="module")
def tiny():
    """float64: byte-exact comparisons between decode and forward need batch-invariant arithmetic (see tests/test_model.py)."""
    return build_model(preset("tiny"), seed=0, dtype=torch.float64)


def test_cache_is_stored_packed_and_sized_by_the_formula(tiny):
    cfg = tiny.cfg
    B, N = 2, 14
    tokens = torch.randint(0, cfg.vocab_size, (B, N), generator=torch.Generator().manual_seed(5))
    _, cache = tiny.prefill(tokens)
    D, Di = cfg.head_dim, cfg.index_head_dim
    for name, t in cache.tensors().items():
        if ".kv" in name or ".gate" in name:
            assert t.dtype == torch.float64, name  # tails keep the model's compute dtype
        else:
            assert t.dtype == torch.uint8, name
    for src, g in cache.globals.items():
        assert g.n == N // cfg.compress_ratios[src]
        packed, scales = g.main()
        assert packed.shape == (B, g.n, D // 2) and scales.shape == (B, g.n, D // 16)
        packed, scales = g.index()
        assert packed.shape == (B, g.n, Di // 2) and scales.shape == (B, g.n, Di // 32)
    assert cache.rings[0].codes.shape == (B, cfg.window, D) and cache.rings[0].scales.shape == (B, cfg.window, D // 32)
    assert cache.global_bytes_used() == N * KVCache.global_bytes_per_token(cfg)


def test_odd_length_leaves_one_token_in_each_ratio2_tail(tiny):
    tokens = torch.randint(0, tiny.cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(6))
    _, cache = tiny.forward(tokens, return_cache=True)
    assert {src: t.count for src, t in cache.tails.items()} == {1: 1, 3: 1}
    assert cache.globals[1].n == 4 and cache.globals[4].n == 9


def test_decode_writes_the_same_bytes_as_forward(tiny):
    """Incremental compression (tail states, ring slots, buffer growth) stores exactly what one pass stores."""
    tokens = torch.randint(0, tiny.cfg.vocab_size, (2, 19), generator=torch.Generator().manual_seed(8))
    _, ref = tiny.forward(tokens, return_cache=True)
    cache = tiny.new_cache(2, capacity_tokens=2)  # forces the global buffers to grow several times
    for i in range(tokens.shape[1]):
        tiny.decode(tokens[:, i], cache)
    for src in ref.globals:
        for a, b in zip(
            ref.globals[src].main() + ref.globals[src].index(), cache.globals[src].main() + cache.globals[src].index(), strict=True
        ):
            assert torch.equal(a, b), src
    for i, (a, b) in enumerate(zip(ref.rings, cache.rings, strict=True)):
        assert (a.start, a.end) == (b.start, b.end)
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales), i


def test_ring_window_indices():
    ring = SwaRing(batch=1, window=4, dim=32, device="cpu")
    codes, scales = torch.ones(1, 6, 32, dtype=torch.uint8), torch.ones(1, 6, 1, dtype=torch.uint8)
    ring.write(codes, scales, 0)
    assert (ring.start, ring.end) == (2, 6)
    # decode of position 6 after writing it: positions 3..6 at slots 3, 0, 1, 2
    ring.write(codes[:, :1], scales[:, :1], 6)
    assert ring.window_indices(6, 1, concatenated=False).tolist() == [[3, 0, 1, 2]]
    # a 2-token step at positions 7, 8 reads cat(ring, step): ring slots for 4..6, then rows 4 and 5
    assert ring.window_indices(7, 2, concatenated=True).tolist() == [[0, 1, 2, 4], [1, 2, 4, 5]]
    fresh = SwaRing(batch=1, window=4, dim=32, device="cpu")
    assert fresh.window_indices(0, 2, concatenated=True).tolist() == [[-1, -1, -1, 4], [-1, -1, 4, 5]]
