"""The paged cache manager (model.paged): sequences, pages, slots, rings, tails, errors and sizes from the config."""

from __future__ import annotations

import pytest
import torch

from model import KVCache, preset
from model.cache import SwaRing
from model.config import PRESETS
from model.paged import (
    OutOfPages,
    OutOfSlots,
    PagedCacheError,
    PagedKVCache,
    SequenceError,
    page_bytes,
    pages_for,
    plan_workload,
    sequence_bytes,
    slot_bytes,
)


@pytest.fixture
def cfg():
    return preset("tiny")  # KV groups 1 and 3 (ratio 2) and 4 (ratio 1); window 8


def _poisoned(cfg, n_pages, n_slots, page_size=4) -> PagedKVCache:
    cache = PagedKVCache(cfg, n_pages, n_slots, page_size)
    g = torch.Generator().manual_seed(2)
    for t in cache.tensors().values():
        t.copy_(torch.randint(0, 256, t.shape, generator=g).to(t.dtype))
    return cache


def _snapshot(cache):
    return {k: v.clone() for k, v in cache.tensors().items()}


def _unchanged(cache, before) -> bool:
    return all(torch.equal(t, before[k]) for k, t in cache.tensors().items())


# -- sizes from the config alone -------------------------------------------------------------------


def test_flash_page_and_slot_bytes():
    cfg = preset("v4.1-flash")
    assert page_bytes(cfg) == 64 * (288 + 68) == 22784
    assert page_bytes(cfg, 16) == 16 * 356
    assert slot_bytes(cfg) == KVCache.fixed_state_bytes(cfg)["total"]
    assert slot_bytes(cfg, torch.float64) == 40 * 128 * 528 + 3 * 2 * 512 * 8
    # 65,537 tokens: 32,768 entries (512 pages) in each ratio-2 group, 65,537 entries (1,025 pages) in the decoder group
    assert pages_for(cfg, 65537) == {2: 512, 8: 512, 14: 512, 20: 1025}
    assert sequence_bytes(cfg, 65537) == (3 * 512 + 1025) * 22784 + slot_bytes(cfg)


@pytest.mark.parametrize("name", list(PRESETS))
def test_pages_approach_the_bytes_per_token(name):
    """Whole pages hold at most one partly filled page per group more than the entries need."""
    cfg = preset(name)
    n = 10_000
    got = sum(pages_for(cfg, n, 64).values()) * page_bytes(cfg, 64)
    exact = n * KVCache.global_bytes_per_token(cfg)
    assert exact <= got < exact + len(cfg.kv_source_layers) * page_bytes(cfg, 64)


def test_plan_workload_sums_the_sequences(cfg):
    plan = plan_workload(cfg, [5, 13, 0, 64], page_size=4)
    # entries per group: ratio 2 -> 2, 6, 0, 32 -> pages 1, 2, 0, 8; ratio 1 -> 5, 13, 0, 64 -> pages 2, 4, 0, 16
    assert plan.pages == {1: 11, 3: 11, 4: 22}
    assert plan.slots == 4 and plan.page_bytes == page_bytes(cfg, 4)
    assert plan.total_bytes == 44 * page_bytes(cfg, 4) + 4 * slot_bytes(cfg)
    cache = PagedKVCache.for_lengths(cfg, [5, 13, 0, 64], page_size=4)
    ids = [cache.add() for _ in range(4)]
    cache.extend(ids, [5, 13, 0, 64])
    assert cache.free_pages() == {1: 0, 3: 0, 4: 0} and cache.free_slots == 0
    with pytest.raises(PagedCacheError, match="at least 0"):
        plan_workload(cfg, [-1])


# -- sequences, pages, slots -----------------------------------------------------------------------


def test_pools_are_flat_rows_of_the_stored_formats(cfg):
    cache = PagedKVCache(cfg, n_pages={1: 3, 3: 2, 4: 5}, n_slots=2, page_size=4)
    D, Di, W = cfg.head_dim, cfg.index_head_dim, cfg.window
    g = cache.groups[4]
    assert g.main_packed.shape == (20, D // 2) and g.main_scales.shape == (20, D // 16)
    assert g.index_packed.shape == (20, Di // 2) and g.index_scales.shape == (20, Di // 32)
    assert cache.groups[3].main_packed.shape[0] == 8
    assert cache.state.ring_codes[0].shape == (2 * W, D) and cache.state.ring_scales[0].shape == (2 * W, D // 32)
    assert set(cache.state.tail_kv) == {1, 3} and cache.state.tail_kv[1].shape == (2, 1, D)
    assert all(t.dtype == torch.uint8 for n, t in cache.tensors().items() if "tail" not in n)


def test_extend_takes_the_pages_each_group_needs(cfg):
    cache = PagedKVCache(cfg, 10, 3, page_size=4)
    a, b = cache.add(), cache.add()
    assert (a, b) == (0, 1)
    cache.extend([a], 9)  # ratio 2: 4 entries -> 1 page; ratio 1: 9 entries -> 3 pages
    assert {s: len(p) for s, p in cache.sequence(a).pages.items()} == {1: 1, 3: 1, 4: 3}
    cache.extend([a, b], [0, 1])  # extending by what is held takes nothing more
    assert cache.free_pages() == {1: 9, 3: 9, 4: 6}
    assert cache.block_table([b, a], 4).tolist() == [[3, -1, -1], [0, 1, 2]]
    assert cache.block_table([b], 1).tolist() == [[]]  # b's one token completes no ratio-2 group
    cache.free(a)
    assert cache.free_pages() == {1: 10, 3: 10, 4: 9}
    c = cache.add()
    cache.extend([c], 4)
    assert c == 2 and cache.sequence(c).slot == 0  # a's slot and its smallest pages go first
    assert cache.sequence(c).pages == {1: [0], 3: [0], 4: [0]}


def test_out_of_pages_is_all_or_nothing(cfg):
    cache = _poisoned(cfg, {1: 4, 3: 4, 4: 3}, 3)
    a, b = cache.add(), cache.add()
    cache.extend([a], 8)  # group 4: 2 pages
    cache.advance([a], 8)
    before, free = _snapshot(cache), cache.free_pages()
    pages = {s: list(p) for s, p in cache.sequence(a).pages.items()}
    with pytest.raises(OutOfPages, match=r"extend: group 4 needs 3 more pages of 4 entries for sequences \[0, 1\], but only 1 of 3"):
        cache.extend([a, b], [4, 8])  # groups 1 and 3 would fit; group 4 does not, so nothing is taken anywhere
    assert cache.free_pages() == free and {s: list(p) for s, p in cache.sequence(a).pages.items()} == pages
    assert cache.sequence(b).pages == {1: [], 3: [], 4: []}
    assert _unchanged(cache, before)
    assert issubclass(OutOfPages, PagedCacheError) and issubclass(OutOfSlots, PagedCacheError)


def test_out_of_slots_and_bad_ids(cfg):
    cache = PagedKVCache(cfg, 2, 2, page_size=4)
    a, b = cache.add(), cache.add()
    with pytest.raises(OutOfSlots, match="no free state slot .2 slots"):
        cache.add()
    cache.free(a)
    with pytest.raises(SequenceError, match="sequence 0 was freed; live sequences: 1"):
        cache.free(a)
    with pytest.raises(SequenceError, match="sequence 7 was never added"):
        cache.extend([7], 1)
    with pytest.raises(SequenceError, match="more than once"):
        cache.extend([b, b], 1)
    with pytest.raises(SequenceError, match="sequence ids are ints"):
        cache.block_table(["1"], 4)
    assert cache.add() == 2 and cache.live == [1, 2]  # a new id, never the freed one


def test_writes_past_a_sequences_pages_are_rejected_before_writing(cfg):
    cache = _poisoned(cfg, 4, 2)
    a = cache.add()
    cache.extend([a], 5)  # group 4: 5 entries -> 2 pages (8 rows)
    entry = [torch.full((1, 6, w), 7, dtype=torch.uint8) for w in (16, 2, 16, 1)]  # 6 entries of tiny's widths
    cache.write_entries(a, 4, *[t[:, :6] for t in entry])
    before = _snapshot(cache)
    with pytest.raises(SequenceError, match=r"entries 6\.\.8 of sequence 0 in group 4 lie past its 2 pages of 4 \(8 entries\)"):
        cache.write_entries(a, 4, *[t[:, :3] for t in entry])
    assert _unchanged(cache, before) and cache.sequence(a).entries[4] == 6
    rows = cache.entry_rows(a, 4, 0, 6)
    pages = cache.sequence(a).pages[4]
    assert rows.tolist() == [pages[j // 4] * 4 + j % 4 for j in range(6)]
    assert (cache.groups[4].main_packed[rows] == 7).all()


def test_tails_are_per_slot(cfg):
    cache = PagedKVCache(cfg, 4, 2, page_size=4, state_dtype=torch.float64)
    a, b = cache.add(), cache.add()
    kv, gate = torch.randn(1, 1, cfg.head_dim, dtype=torch.float64), torch.randn(1, 1, cfg.head_dim, dtype=torch.float64)
    cache.store_tail(b, 1, kv, gate)
    assert cache.tail(a, 1)[0].shape == (1, 0, cfg.head_dim)
    got_kv, got_gate = cache.tail(b, 1)
    assert torch.equal(got_kv, kv) and torch.equal(got_gate, gate)


# -- SWA rings ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("steps", [[1] * 12, [5, 1, 1, 9, 2, 1], [20, 1, 3]], ids=["one-by-one", "mixed", "past-window"])
def test_ring_rows_see_what_the_contiguous_ring_sees(cfg, steps):
    """Window KV gathered through the manager's rows equals the contiguous SwaRing's, for steps of any size, with a
    second sequence in the other slot writing different bytes at the same time."""
    cache = _poisoned(cfg, 4, 2)
    other, a = cache.add(), cache.add()
    W, D = cfg.window, cfg.head_dim
    ring = SwaRing(1, W, D, "cpu")
    g = torch.Generator().manual_seed(3)
    pos = 0
    for S in steps:
        codes = torch.randint(0, 256, (2, S, D), dtype=torch.uint8, generator=g)
        scales = torch.randint(0, 256, (2, S, D // 32), dtype=torch.uint8, generator=g)
        win_c, win_s, idx = cache.swa_step([a, other], 0, [pos, pos], codes, scales)
        if S == 1:
            ring.write(codes[:1], scales[:1], pos)  # a one-token step attends after its write
            want_idx = ring.window_indices(pos, 1, concatenated=False)
            want_c, want_s = ring.codes, ring.scales
            assert win_c.shape == (1, 2 * W, D)  # the ring pool, shared by both rows
            rows_c, rows_s = win_c[0], win_s[0]
        else:
            want_idx = ring.window_indices(pos, S, concatenated=True)
            want_c, want_s = torch.cat([ring.codes, codes[:1]], 1), torch.cat([ring.scales, scales[:1]], 1)
            ring.write(codes[:1], scales[:1], pos)
            assert win_c.shape == (2, W + S, D)
            rows_c, rows_s = win_c[0], win_s[0]
        ok = want_idx >= 0
        assert torch.equal(idx[0] >= 0, ok)
        assert torch.equal(rows_c[idx[0][ok].long()], want_c[0][want_idx[ok].long()])
        assert torch.equal(rows_s[idx[0][ok].long()], want_s[0][want_idx[ok].long()])
        pos += S
    assert cache.sequence(a).rings[0] == [ring.start, ring.end]


def test_ring_expects_the_next_position(cfg):
    cache = PagedKVCache(cfg, 4, 1, page_size=4)
    a = cache.add()
    codes = torch.zeros(1, 1, cfg.head_dim, dtype=torch.uint8)
    scales = torch.zeros(1, 1, cfg.head_dim // 32, dtype=torch.uint8)
    with pytest.raises(SequenceError, match="expects position 0, got 3"):
        cache.swa_step([a], 2, [3], codes, scales)
    cache.reset_ring(a, 2, 3)
    cache.swa_step([a], 2, [3], codes, scales)
    assert cache.sequence(a).rings[2] == [3, 4]
