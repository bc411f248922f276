"""Prefix reuse on the paged cache (model.prefix, PagedKVCache.publish_prefix / match_prefix / add_with_prefix / fork):
holder counts, copy-on-write, the hash chain's alignment, freeing in every order, eviction and all-or-nothing adds.

Pools start as random bytes, so a page that a holder's write reaches shows up as changed bytes."""

from __future__ import annotations

import itertools

import pytest
import torch
from test_paged_cache import _poisoned, _snapshot

from model import Model, build_model, preset
from model.paged import OutOfPages, OutOfSlots, PagedCacheError, PagedKVCache, pages_for
from model.prefix import block_tokens, chain_keys, chain_root

TOL = {"rtol": 0, "atol": 1e-10}


@pytest.fixture
def cfg():
    return preset("tiny")  # KV groups 1 and 3 (ratio 2) and 4 (ratio 1); window 8


@pytest.fixture(scope="module")
def tiny() -> Model:
    return build_model(preset("tiny"), dtype=torch.float64, seed=0)


def _tokens(vocab: int, n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _fill(cache: PagedKVCache, seq: int, n: int, seed: int) -> None:
    """What a prefill of ``n`` tokens does to the pages: extend, write every completed entry (random bytes), advance."""
    cache.extend([seq], n)
    s = cache.sequence(seq)
    g = torch.Generator().manual_seed(seed)
    for src, pool in cache.groups.items():
        G = (s.n_tokens + n) // pool.ratio - s.entries[src]
        if G:
            cache.write_entries(
                seq, src, *[torch.randint(0, 256, (G, t.shape[1]), dtype=torch.uint8, generator=g) for t in pool.tensors().values()]
            )
    cache.advance([seq], n)


def _page_bytes(cache: PagedKVCache, src: int, page: int) -> list[torch.Tensor]:
    ps = cache.page_size
    return [t[page * ps : (page + 1) * ps].clone() for t in cache.groups[src].tensors().values()]


def _held(cache: PagedKVCache) -> dict[int, list[int]]:
    return {src: list(pool.refs) for src, pool in cache.groups.items()}


# -- the block and the hash chain ------------------------------------------------------------------


def test_block_is_the_lcm_of_every_groups_tokens_per_page(cfg):
    assert block_tokens([2, 2, 1], 4) == 8  # a page of a ratio-2 group spans 8 tokens, two pages of the ratio-1 group
    assert block_tokens([1], 4) == 4 and block_tokens([2], 3) == 6 and block_tokens([2, 1], 1) == 2
    assert PagedKVCache(cfg, 1, 1, page_size=4).block_tokens == 8
    assert PagedKVCache(preset("v4.1-flash"), 0, 1, page_size=64).block_tokens == 128


@pytest.mark.parametrize("changed", [0, 7, 8, 13, 23], ids=lambda p: f"token{p}")
def test_a_changed_token_changes_the_chain_from_its_block_on(cfg, changed):
    root, B = chain_root(cfg, 4), 8
    a = _tokens(cfg.vocab_size, 32, 0)
    b = a.clone()
    b[changed] = (b[changed] + 1) % cfg.vocab_size
    ka, kb = chain_keys(root, a, B), chain_keys(root, b, B)
    assert len(ka) == len(kb) == 4
    first = changed // B
    assert ka[:first] == kb[:first]
    assert all(x != y for x, y in zip(ka[first:], kb[first:], strict=True))
    assert chain_keys(chain_root(cfg, 2), a, B) != ka  # another page layout never answers


@pytest.mark.parametrize("page_size", [1, 2, 3, 4])
def test_a_hit_never_splits_a_page_or_a_compression_group(cfg, page_size):
    """Requests that share a random-length prefix with a published prompt hit whole blocks: whole pages in every group,
    whole groups of every ratio, as far as the shared prefix and the published whole blocks go."""
    cache = _poisoned(cfg, 200, 2, page_size)
    B = cache.block_tokens
    prompt = _tokens(cfg.vocab_size, 53, 1)
    a = cache.add()
    _fill(cache, a, 53, 0)
    assert cache.publish_prefix(a, prompt) == 53 // B
    g = torch.Generator().manual_seed(5)
    for common in [0, 1, B - 1, B, B + 1, 2 * B + 3, 53, *torch.randint(0, 53, (10,), generator=g).tolist()]:
        request = torch.cat([prompt[:common], (prompt[common:] + 1) % cfg.vocab_size])
        hit = cache.match_prefix(request)
        assert hit.n_tokens == common // B * B == hit.blocks * B
        for src, pool in cache.groups.items():
            assert hit.n_tokens % pool.ratio == 0
            assert len(hit.pages[src]) * page_size * pool.ratio == hit.n_tokens
            assert list(hit.pages[src]) == cache.sequence(a).pages[src][: len(hit.pages[src])]


def test_full_prompt_and_partial_hits(cfg):
    cache = _poisoned(cfg, 40, 4, page_size=2)  # blocks of 4 tokens
    prompt = _tokens(cfg.vocab_size, 15, 2)
    a = cache.add()
    _fill(cache, a, 15, 0)
    assert cache.publish_prefix(a, prompt) == 3  # tokens 12..14 are no whole block: not published
    assert cache.publish_prefix(a, prompt) == 0  # already indexed
    assert cache.match_prefix(prompt).n_tokens == 12
    assert cache.match_prefix(prompt[:12]).n_tokens == 12  # the whole prompt is cached
    assert cache.match_prefix(prompt, max_tokens=11).n_tokens == 8
    assert cache.match_prefix(prompt[:7]).n_tokens == 4
    assert cache.match_prefix(_tokens(cfg.vocab_size, 15, 3)).n_tokens == 0
    before, stats = _snapshot(cache), cache.prefix_stats.as_dict()
    cache.match_prefix(prompt)  # a lookup changes nothing
    assert all(torch.equal(v, before[k]) for k, v in cache.tensors().items()) and cache.prefix_stats.as_dict() == stats

    full, hit = cache.add_with_prefix(prompt[:12])
    s = cache.sequence(full)
    assert hit.n_tokens == 12 and s.n_tokens == 12 and s.entries == {1: 6, 3: 6, 4: 12} and s.tail == {1: 0, 3: 0}
    assert s.pages == {src: cache.sequence(a).pages[src][:n] for src, n in {1: 3, 3: 3, 4: 6}.items()}
    part, hit = cache.add_with_prefix(torch.cat([prompt[:9], torch.tensor([0, 1, 2])]))
    assert hit.n_tokens == 8 and cache.sequence(part).n_tokens == 8
    assert cache.sequence(part).pages[4][:4] == cache.sequence(a).pages[4][:4]
    assert len(cache.sequence(part).pages[4]) == 6  # the rest of the 12-token prompt: pages taken, not shared
    st = cache.prefix_stats
    assert (st.lookups, st.hits, st.hit_tokens, st.pages_shared, st.pages_copied) == (2, 2, 20, 12 + 8, 0)
    assert all(cache.groups[src].refs[p] == 3 for src in (1, 3, 4) for p in cache.sequence(a).pages[src][:2])


# -- holders, freeing, eviction ---------------------------------------------------------------------


@pytest.mark.parametrize("order", list(itertools.permutations(range(4))), ids=lambda o: "".join("ABCD"[i] for i in o))
def test_freeing_in_every_order(cfg, order):
    """A publishes; B hits it; C is a fork of B; D is unrelated. Whatever the order of the frees, a page is free exactly
    when its last holder has let go, and every page is free at the end."""
    cache = _poisoned(cfg, 24, 4, page_size=2)
    prompt = _tokens(cfg.vocab_size, 10, 4)
    a = cache.add()
    _fill(cache, a, 10, 0)
    cache.publish_prefix(a, prompt)
    b, _ = cache.add_with_prefix(torch.cat([prompt[:8], torch.tensor([1, 2, 3])]))
    _fill(cache, b, 3, 1)
    c = cache.fork(b)
    d = cache.add()
    _fill(cache, d, 5, 2)
    seqs = [a, b, c, d]
    holders = {src: {} for src in cache.groups}
    for s in seqs:
        for src, pages in cache.sequence(s).pages.items():
            for p in pages:
                holders[src].setdefault(p, set()).add(s)
    live = set(seqs)
    for i in order:
        free_before = cache.free_pages()
        cache.free(seqs[i])
        live.discard(seqs[i])
        for src, pool in cache.groups.items():
            for p, who in holders[src].items():
                assert pool.refs[p] == len(who & live), (src, p)
            freed = sum(1 for who in holders[src].values() if seqs[i] in who and not who & live)
            assert cache.free_pages()[src] == free_before[src] + freed
    assert cache.free_pages() == {1: 24, 3: 24, 4: 24} and cache.free_slots == 4
    assert all(r == 0 for pool in cache.groups.values() for r in pool.refs)
    # A's published blocks outlive every holder: the next prompt takes its pages back as they are
    _, hit = cache.add_with_prefix(prompt)
    assert hit.n_tokens == 8 and all(cache.groups[src].refs[p] == 1 for src in (1, 3, 4) for p in hit.pages[src])


def test_free_pages_that_answer_hits_are_taken_last_and_evict_their_chain_from_the_end(cfg):
    cache = _poisoned(cfg, {1: 6, 3: 6, 4: 12}, 2, page_size=2)  # blocks of 4 tokens: 1, 1 and 2 pages
    prompt = _tokens(cfg.vocab_size, 16, 6)
    a = cache.add()
    _fill(cache, a, 16, 0)
    assert cache.publish_prefix(a, prompt) == 4
    cache.free(a)
    assert cache.free_pages() == {1: 6, 3: 6, 4: 12} and cache.groups[4].n_cached_free == 8
    b = cache.add()
    _fill(cache, b, 8, 1)  # 4 free pages of group 4 that no prefix names: nothing evicted
    assert cache.match_prefix(prompt).n_tokens == 16 and cache.prefix_stats.blocks_evicted == 0
    _fill(cache, b, 2, 2)  # one more page of group 4: the least recently freed named page, the last block's
    assert cache.match_prefix(prompt).n_tokens == 12 and cache.prefix_stats.blocks_evicted == 1
    assert cache.groups[1].n_cached_free == 3  # the evicted block's page in group 1 is an ordinary free page again
    cache.free(b)
    c, hit = cache.add_with_prefix(prompt)
    assert hit.n_tokens == 12 and len(cache.sequence(c).pages[4]) == 8


def test_out_of_pages_during_a_prefix_add_leaves_everything_intact(cfg):
    cache = _poisoned(cfg, {1: 6, 3: 6, 4: 8}, 3, page_size=2)
    prompt = _tokens(cfg.vocab_size, 8, 7)
    a = cache.add()
    _fill(cache, a, 8, 0)
    cache.publish_prefix(a, prompt)
    cache.free(a)  # its 4 pages of group 4 are free and still answer the hit

    def state():
        return (
            _snapshot(cache),
            cache.free_pages(),
            _held(cache),
            {src: pool.n_cached_free for src, pool in cache.groups.items()},
            len(cache.prefix),
            cache.prefix_stats.as_dict(),
            cache.live,
            cache.free_slots,
        )

    before = state()
    # 8 free pages of group 4, but the hit takes back 4 of them: 4 left for the 6 the rest of a 20-token prompt needs
    with pytest.raises(OutOfPages, match=r"add_with_prefix: group 4 needs 6 more pages .* \(8 tokens hit\), but only 4 of 8 are free"):
        cache.add_with_prefix(torch.cat([prompt, _tokens(cfg.vocab_size, 12, 8)]))
    after = state()
    assert all(torch.equal(v, before[0][k]) for k, v in after[0].items()) and after[1:] == before[1:]
    x, y, z = cache.add(), cache.add(), cache.add()
    before = state()
    with pytest.raises(OutOfSlots, match="add_with_prefix: no free state slot"):
        cache.add_with_prefix(prompt)
    after = state()
    assert all(torch.equal(v, before[0][k]) for k, v in after[0].items()) and after[1:] == before[1:]
    for s in (x, y, z):
        cache.free(s)
    s, hit = cache.add_with_prefix(torch.cat([prompt, _tokens(cfg.vocab_size, 8, 8)]))  # 4 + 4 pages: fits
    assert hit.n_tokens == 8 and cache.free_pages()[4] == 0


# -- copy-on-write -----------------------------------------------------------------------------------


def test_a_write_into_a_shared_page_goes_to_a_copy(cfg):
    """A fork shares the partly filled last pages; the first write of either holder copies the page, and the other
    holder's page keeps every byte (its unwritten rows included)."""
    cache = _poisoned(cfg, 12, 2, page_size=4)
    a = cache.add()
    _fill(cache, a, 5, 0)  # group 4: page 0 full, page 1 holds 1 of 4; groups 1 and 3: 2 of 4 entries of page 0
    b = cache.fork(a)
    pa = {src: list(p) for src, p in cache.sequence(a).pages.items()}
    assert cache.sequence(b).pages == pa and all(cache.groups[src].refs[p] == 2 for src in pa for p in pa[src])
    shared = {src: _page_bytes(cache, src, pa[src][-1]) for src in pa}
    _fill(cache, b, 3, 1)  # 8 tokens: entries 5..7 of group 4 and 2..3 of groups 1, 3, all into shared pages
    assert cache.prefix_stats.pages_copied == 3
    for src in pa:
        assert all(torch.equal(x, y) for x, y in zip(_page_bytes(cache, src, pa[src][-1]), shared[src], strict=True)), src
        mine = cache.sequence(b).pages[src]
        assert mine[:-1] == pa[src][:-1] and mine[-1] != pa[src][-1]
        assert cache.groups[src].refs[pa[src][-1]] == 1 and cache.groups[src].refs[mine[-1]] == 1
        written = cache.sequence(a).entries[src] % 4  # the entries a had written before the fork were copied too
        for x, y in zip(_page_bytes(cache, src, mine[-1]), shared[src], strict=True):
            assert torch.equal(x[:written], y[:written])
    assert cache.groups[4].refs[pa[4][0]] == 2  # the full page stays shared: nobody writes it
    _fill(cache, a, 1, 2)  # a is the only holder of its pages now: written in place
    assert cache.prefix_stats.pages_copied == 3 and cache.sequence(a).pages == pa


def test_a_shared_page_is_never_written_in_place(cfg):
    cache = _poisoned(cfg, 8, 2, page_size=4)
    a = cache.add()
    _fill(cache, a, 5, 0)
    cache.fork(a)
    entry = [torch.zeros(1, t.shape[1], dtype=torch.uint8) for t in cache.groups[4].tensors().values()]
    before = _snapshot(cache)
    with pytest.raises(PagedCacheError, match=r"write_entries: page 1 of group 4 is shared \(2 holders\); extend\(\) the sequence first"):
        cache.write_entries(a, 4, *entry)  # a write without extend(): refused, not done
    assert all(torch.equal(v, before[k]) for k, v in cache.tensors().items())


def test_publish_refuses_tokens_the_sequence_did_not_consume(cfg):
    cache = _poisoned(cfg, 12, 2, page_size=2)
    prompt = _tokens(cfg.vocab_size, 8, 9)
    a = cache.add()
    _fill(cache, a, 8, 0)
    cache.publish_prefix(a, prompt)
    b, _ = cache.add_with_prefix(prompt)
    other = prompt.clone()
    other[0] += 1
    with pytest.raises(PagedCacheError, match="block 0 of sequence 1 holds pages another prefix names"):
        cache.publish_prefix(b, other)
    with pytest.raises(PagedCacheError, match="has consumed 8 tokens, got 9"):
        cache.publish_prefix(b, torch.cat([prompt, prompt[:1]]))


# -- the model on shared pages ------------------------------------------------------------------------


def test_forked_sequences_decode_as_if_alone_and_never_touch_each_others_pages(tiny):
    """Two continuations of one prompt (odd length: the ratio-2 tails are mid-group, the last pages partly filled):
    each decodes as the same prompt alone on a contiguous cache, and one's steps never change the other's pages."""
    cfg = tiny.cfg
    prompt = _tokens(cfg.vocab_size, 13, 11)
    cache = tiny.new_paged_cache(n_pages=20, n_slots=2, page_size=4)
    g = torch.Generator().manual_seed(3)
    for t in cache.tensors().values():
        t.copy_(
            torch.randint(0, 256, t.shape, generator=g).to(t.dtype)
            if t.dtype == torch.uint8
            else torch.randn(t.shape, generator=g, dtype=t.dtype)
        )
    a = cache.add()
    tiny.prefill_paged(prompt, cache, a)
    b = cache.fork(a)
    oracle = {s: tiny.prefill(prompt[None])[1] for s in (a, b)}
    toks = {a: [5, 9, 2, 7], b: [1, 1, 40, 3]}
    for step in range(4):
        pages_a = {src: [_page_bytes(cache, src, p) for p in cache.sequence(a).pages[src]] for src in cache.groups}
        got_b = tiny.decode_paged(torch.tensor([toks[b][step]]), cache, [b])[0]
        for src in cache.groups:
            for p, was in zip(cache.sequence(a).pages[src], pages_a[src], strict=True):
                assert all(torch.equal(x, y) for x, y in zip(_page_bytes(cache, src, p), was, strict=True)), (step, src, p)
        got_a = tiny.decode_paged(torch.tensor([toks[a][step]]), cache, [a])[0]
        for s, got in ((a, got_a), (b, got_b)):
            torch.testing.assert_close(got, tiny.decode(torch.tensor([toks[s][step]]), oracle[s])[0], **TOL)
    assert cache.prefix_stats.pages_copied >= 3  # every group's shared last page, copied on the first write


def test_both_holders_of_a_forked_page_in_one_step_copy_it_once(tiny):
    """A fork decoded together with its original in one step: the shared partly filled last page is copied once (the
    last holder keeps the original), so a pool with one free page per group is enough, and both continue as alone."""
    prompt = _tokens(tiny.cfg.vocab_size, 13, 11)
    cache = tiny.new_paged_cache(n_pages={src: n + 1 for src, n in pages_for(tiny.cfg, 13, 4).items()}, n_slots=2, page_size=4)
    a = cache.add()
    tiny.prefill_paged(prompt, cache, a)
    b = cache.fork(a)
    got = tiny.decode_paged(torch.tensor([5, 1]), cache, [a, b])
    shared_last = [src for src, pool in cache.groups.items() if cache.sequence(a).pages[src][-1] != cache.sequence(b).pages[src][-1]]
    assert cache.prefix_stats.pages_copied == len(shared_last) > 0
    oracle = tiny.prefill(prompt.expand(2, -1).contiguous())[1]
    torch.testing.assert_close(got, tiny.decode(torch.tensor([5, 1]), oracle), **TOL)


def test_prefill_with_prefix_counts_and_frees(tiny):
    cfg = tiny.cfg
    cache = tiny.new_paged_cache(n_pages=40, n_slots=3, page_size=2)
    prompt = _tokens(cfg.vocab_size, 14, 12)
    first = tiny.prefill_with_prefix(prompt, cache)  # nothing to hit: a plain prefill that publishes
    assert first.hit_tokens == 0 and first.replayed == 0 and first.published == 3
    second = tiny.prefill_with_prefix(torch.cat([prompt[:10], torch.tensor([3, 4])]), cache)
    assert (second.hit_tokens, second.replayed, second.published) == (8, 8, 1)
    st = cache.prefix_stats
    assert (st.hits, st.hit_tokens, st.blocks_published) == (1, 8, 4)
    need = pages_for(cfg, 14, 2)
    assert {src: 40 - n for src, n in cache.free_pages().items()} == {
        s: need[s] + pages_for(cfg, 12, 2)[s] - 8 // (2 * r) for s, r in ((1, 2), (3, 2), (4, 1))
    }
    cache.free(first.seq)
    cache.free(second.seq)
    assert cache.free_pages() == {1: 40, 3: 40, 4: 40}
