"""The model on the paged cache manager (Model.prefill_paged / decode_paged): continuous batching.

The oracle is the contiguous KVCache: each sequence run alone (batch 1) through Model.prefill and
Model.decode. Everything runs in float64 (see tests/test_model.py: float32 GEMMs of different batch
shapes flip an FP8/FP4 code now and then), where a mixed batch must reproduce every sequence alone to
1e-10. Every pool tensor starts as random bytes (tails as random floats), so a read of a row the
manager never wrote, or of another sequence's row, shows up in the logits.
"""

from __future__ import annotations

import pytest
import torch

from model import InputError, Model, build_model, preset
from model.paged import OutOfPages, PagedKVCache, SequenceError

TOL = {"rtol": 0, "atol": 1e-10}


@pytest.fixture(scope="module")
def tiny() -> Model:
    return build_model(preset("tiny"), dtype=torch.float64, seed=0)


def _tokens(cfg, n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def _poison(cache: PagedKVCache, seed: int = 1) -> None:
    """Random bytes in every pool row, random floats in every tail row."""
    g = torch.Generator().manual_seed(seed)
    for t in cache.tensors().values():
        if t.dtype == torch.uint8:
            t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g))
        else:
            t.copy_(torch.randn(t.shape, generator=g, dtype=t.dtype) * 100)


def _snapshot(cache: PagedKVCache) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in cache.tensors().items()}


def _unchanged(cache: PagedKVCache, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(t, before[k]) for k, t in cache.tensors().items())


class Alone:
    """One sequence decoded by itself on a contiguous KVCache: the oracle of each paged row."""

    def __init__(self, model: Model, prompt: torch.Tensor, ced: bool) -> None:
        self.model = model
        self.prefill_logits, self.cache = model.prefill(prompt[None], ced=ced)

    def step(self, token: int) -> torch.Tensor:
        return self.model.decode(torch.tensor([token]), self.cache)[0]


def _continuous_batching(model: Model, page_size: int, lengths: dict[str, int], ced: dict[str, bool], seed: int) -> None:
    """A run with sequences of different lengths: one joins late, one leaves and a newcomer takes its pages and slot,
    one skips a step. Every logit row must be that of its sequence decoded alone."""
    cfg = model.cfg
    cache = model.new_paged_cache(n_pages=max(24, 96 // page_size), n_slots=4, page_size=page_size)
    _poison(cache)
    prompts = {name: _tokens(cfg, n, seed + i) for i, (name, n) in enumerate(lengths.items())}
    ids: dict[str, int] = {}
    alone: dict[str, Alone] = {}

    def join(name: str) -> None:
        ids[name] = cache.add()
        logits = model.prefill_paged(prompts[name], cache, ids[name], ced=ced[name])
        alone[name] = Alone(model, prompts[name], ced[name])
        torch.testing.assert_close(logits, alone[name].prefill_logits[0], **TOL)

    for name in ("a", "b", "c"):
        join(name)
    g = torch.Generator().manual_seed(seed + 100)
    schedule = {2: ("join", "d"), 4: ("free", "b"), 5: ("join", "e")}
    for step in range(9):
        event = schedule.get(step)
        if event and event[0] == "join":
            join(event[1])
        elif event:
            freed = ids.pop(event[1])
            cache.free(freed)
            with pytest.raises(SequenceError, match=f"sequence {freed} was freed"):
                model.decode_paged(torch.tensor([1]), cache, [freed])
        names = [n for n in ids if not (n == "a" and step == 3)]  # "a" skips one step: any subset of the live sequences
        toks = torch.randint(0, cfg.vocab_size, (len(names),), generator=g)
        logits = model.decode_paged(toks, cache, [ids[n] for n in names])
        for row, n in enumerate(names):
            torch.testing.assert_close(logits[row], alone[n].step(int(toks[row])), **TOL, msg=lambda m, n=n, s=step: f"{n} step {s}: {m}")
    assert cache.free_slots == 0  # a, c, d, e: b's slot went to e


def test_decode_paged_mixed_batch_equals_each_sequence_alone(tiny):
    """tiny (window 8, ratio-2 encoder groups, pool blocks of 2): prompts below and past the window, odd ones leaving
    the ratio-2 tails unfinished, CED and non-CED prefill; pages of 4 entries so every sequence spans several."""
    lengths = {"a": 5, "b": 13, "c": 20, "d": 3, "e": 11}
    ced = {"a": True, "b": True, "c": False, "d": True, "e": True}
    _continuous_batching(tiny, 4, lengths, ced, seed=10)


@pytest.mark.parametrize("page_size", [1, 16], ids=["page1", "page16"])
def test_decode_paged_page_size_one_and_larger_than_a_sequence(tiny, page_size):
    """Page boundaries at every entry (page size 1) and none at all (16: every group fits one page)."""
    lengths = {"a": 9, "b": 2, "c": 14, "d": 7, "e": 1}
    _continuous_batching(tiny, page_size, lengths, dict.fromkeys(lengths, True), seed=30 + page_size)


def test_decode_paged_on_the_small_preset():
    """small (window 64, top-k 128, pool blocks of 8): prompts across the window, odd and even."""
    m = build_model(preset("small").replace(n_layers=10, compress_ratios=(0, 0) + (2,) * 6 + (1,) * 2, n_encoder_layers=8,
                                            kv_source_layers=(2, 5, 8), index_source_layers=(2, 5, 8), vocab_size=512),
                    dtype=torch.float64, seed=0)  # fmt: skip
    cache = m.new_paged_cache(n_pages=12, n_slots=3, page_size=16)
    _poison(cache)
    prompts = [_tokens(m.cfg, n, 50 + n) for n in (70, 9, 37)]
    seqs = [cache.add() for _ in prompts]
    alone = [Alone(m, p, ced=True) for p in prompts]
    for s, p, a in zip(seqs, prompts, alone, strict=True):
        torch.testing.assert_close(m.prefill_paged(p, cache, s), a.prefill_logits[0], **TOL)
    g = torch.Generator().manual_seed(7)
    for _ in range(3):
        toks = torch.randint(0, m.cfg.vocab_size, (3,), generator=g)
        logits = m.decode_paged(toks, cache, seqs)
        for row, a in enumerate(alone):
            torch.testing.assert_close(logits[row], a.step(int(toks[row])), **TOL)


def test_paged_equals_contiguous_on_an_equal_length_batch(tiny):
    """An equal-length batch on the paged cache gives the contiguous cache's logits and stores its bytes."""
    cfg, B, N = tiny.cfg, 3, 15
    prompts = torch.stack([_tokens(cfg, N, 60 + b) for b in range(B)])
    ref_logits, ref = tiny.prefill(prompts)
    cache = tiny.new_paged_cache(n_pages=20, n_slots=B, page_size=4)
    _poison(cache)
    seqs = [cache.add() for _ in range(B)]
    got = torch.stack([tiny.prefill_paged(prompts[b], cache, s) for b, s in enumerate(seqs)])
    torch.testing.assert_close(got, ref_logits, rtol=0, atol=1e-12)
    g = torch.Generator().manual_seed(3)
    for _ in range(6):
        toks = torch.randint(0, cfg.vocab_size, (B, 1), generator=g)
        torch.testing.assert_close(tiny.decode_paged(toks, cache, seqs), tiny.decode(toks, ref), rtol=0, atol=1e-12)
    for src, glob in ref.globals.items():
        table = cache.block_table(seqs, src).long()
        for b, s in enumerate(seqs):
            rows = cache.entry_rows(s, src, 0, glob.n)
            for name, want in zip(("main_packed", "main_scales", "index_packed", "index_scales"), glob.main() + glob.index(), strict=True):
                assert torch.equal(getattr(cache.groups[src], name)[rows], want[b]), (src, name)
        assert table.shape[1] == -(-glob.n // 4)


def test_multi_token_decode_steps_on_the_paged_cache(tiny):
    """[B, S] steps (S = 3) of two sequences at different positions equal their single-token decode alone."""
    cfg = tiny.cfg
    cache = tiny.new_paged_cache(n_pages=16, n_slots=2, page_size=4)
    _poison(cache)
    prompts = [_tokens(cfg, 6, 70), _tokens(cfg, 11, 71)]
    seqs = [cache.add() for _ in prompts]
    alone = [Alone(tiny, p, ced=False) for p in prompts]
    for s, p in zip(seqs, prompts, strict=True):
        tiny.prefill_paged(p, cache, s, ced=False)
    toks = torch.randint(0, cfg.vocab_size, (2, 3), generator=torch.Generator().manual_seed(4))
    logits = tiny.decode_paged(toks, cache, seqs)
    assert logits.shape == (2, 3, cfg.vocab_size)
    for row, a in enumerate(alone):
        want = torch.stack([a.step(int(t)) for t in toks[row]])
        torch.testing.assert_close(logits[row], want, **TOL)


# -- bad input: one-line errors, nothing written ----------------------------------------------------


def test_errors_leave_the_cache_unchanged(tiny):
    cfg = tiny.cfg.replace(max_seq_len=40)
    m = build_model(cfg, dtype=torch.float64, seed=0)
    cache = m.new_paged_cache(n_pages={1: 3, 3: 3, 4: 5}, n_slots=3, page_size=4)
    _poison(cache)
    a, b = cache.add(), cache.add()
    m.prefill_paged(_tokens(cfg, 16, 80), cache, a)
    m.prefill_paged(_tokens(cfg, 3, 81), cache, b)
    freed = cache.add()
    cache.free(freed)
    before, lengths = _snapshot(cache), (cache.length(a), cache.length(b))
    one = torch.tensor([5])
    cases = [
        (lambda: m.decode_paged(one, cache, [freed]), SequenceError, f"sequence {freed} was freed"),
        (lambda: m.decode_paged(one, cache, [99]), SequenceError, "sequence 99 was never added"),
        (lambda: m.decode_paged(torch.tensor([5, 5]), cache, [a, a]), SequenceError, "more than once"),
        (lambda: m.decode_paged(torch.tensor([5, 5]), cache, [a]), InputError, "2 rows for 1 sequences"),
        (lambda: m.decode_paged(torch.ones(1, 25, dtype=torch.long), cache, [a]), InputError, "max_seq_len=40"),
        # a needs page 5 of group 4 (17 entries > 16) while b holds 1: 4 + 1 of 5 are taken
        (lambda: m.decode_paged(torch.tensor([5, 5]), cache, [b, a]), OutOfPages, r"group 4 needs 1 more pages .* only 0 of 5 are free"),
        (lambda: m.prefill_paged(_tokens(cfg, 4, 1), cache, b), SequenceError, "already holds 3 tokens"),
        (lambda: m.decode_paged(one, PagedKVCache(preset("tiny"), 1, 1), [0]), InputError, "PagedKVCache of preset"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()
        assert _unchanged(cache, before), message
        assert (cache.length(a), cache.length(b)) == lengths, message
    # b alone still fits (its group-4 page has room), and freeing b lets a go on: both unharmed by the failed steps
    ref_b = Alone(m, _tokens(cfg, 3, 81), ced=True)
    torch.testing.assert_close(m.decode_paged(one, cache, [b])[0], ref_b.step(5), **TOL)
    cache.free(b)
    ref_a = Alone(m, _tokens(cfg, 16, 80), ced=True)
    torch.testing.assert_close(m.decode_paged(one, cache, [a])[0], ref_a.step(5), **TOL)


def test_prefill_that_does_not_fit_takes_nothing(tiny):
    cache = tiny.new_paged_cache(n_pages=2, n_slots=2, page_size=4)
    s = cache.add()
    before, free = _snapshot(cache), cache.free_pages()
    with pytest.raises(OutOfPages, match=r"group 4 needs 3 more pages .* only 2 of 2"):
        tiny.prefill_paged(_tokens(tiny.cfg, 12, 0), cache, s)
    assert _unchanged(cache, before) and cache.free_pages() == free and cache.length(s) == 0
    tiny.prefill_paged(_tokens(tiny.cfg, 8, 0), cache, s)  # 8 tokens fit: group 4 needs 2 pages
    assert cache.free_pages() == {1: 1, 3: 1, 4: 0}
