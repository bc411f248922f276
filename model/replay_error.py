"""The error of encoder bounded replay after a prefix hit, against the exact prefill of the whole prompt.

For a hit of ``h`` tokens and a suffix of ``s`` tokens, the prompt is the first ``h + s`` tokens of one seeded
random token stream. One sequence prefills the longest hit and publishes it; each request
``Model.prefill_with_prefix(prompt, max_hit_tokens=h)`` shares its first ``h`` tokens' pages and replays the last
``min(window, h)`` of them with the suffix. The oracle is ``Model.prefill_paged`` of the same prompt on a cache of
its own, with the same ``ced`` setting, so the decoder's own replay is in both and the difference is the encoder
replay alone. In float64 the formats' rounding is the same on both sides, so what is left is the approximation.

Exact by construction when ``h <= window`` (the replay starts at position 0); 0 when ``h = 0`` (no hit).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from model.model import Model
from model.paged import pages_for


class ReplayErrorInput(ValueError):
    """Hit positions or suffix lengths the measurement cannot run (one line naming the fix)."""


@dataclass(frozen=True)
class ReplayErrorRow:
    """One (hit, suffix) point. Errors are of the last position's logits, float64 model."""

    preset: str
    hit: int  # prompt tokens served from the cache (a multiple of the prefix block)
    suffix: int  # prompt tokens after the hit
    replayed: int  # prefix tokens run through the encoder again: min(window, hit)
    window: int
    max_abs: float  # max |logits - exact|
    rel_l2: float  # ||logits - exact|| / ||exact||
    argmax_same: bool  # the next-token choice agrees with the exact prefill's

    @property
    def exact_expected(self) -> bool:
        """The replay covers the whole prefix: the result must equal the exact prefill."""
        return self.hit <= self.window

    def as_dict(self) -> dict:
        return {**asdict(self), "exact_expected": self.exact_expected}


def check_points(model: Model, hits: Sequence[int], suffixes: Sequence[int], page_size: int) -> int:
    """Validate the grid; returns the prefix block in tokens (hits must be multiples of it)."""
    cfg = model.cfg
    if page_size < 1:
        raise ReplayErrorInput(f"page size must be at least 1, got {page_size}")
    if not hits or not suffixes:
        raise ReplayErrorInput("give at least one hit position and one suffix length")
    block = model.new_paged_cache(1, 1, page_size).block_tokens
    for h in hits:
        if h < 0 or h % block:
            raise ReplayErrorInput(
                f"hit {h} is not a whole number of prefix blocks of {block} tokens (lcm of ratio x page size {page_size});"
                f" give multiples of {block} or another page size"
            )
    if any(s < 0 for s in suffixes):
        raise ReplayErrorInput(f"suffix lengths must be at least 0, got {list(suffixes)}")
    longest = max(hits) + max(suffixes)
    if longest > cfg.max_seq_len:
        raise ReplayErrorInput(f"hit + suffix reaches {longest} tokens, past max_seq_len {cfg.max_seq_len} of preset {cfg.name!r}")
    if longest < 1:
        raise ReplayErrorInput("hit 0 with suffix 0 is an empty prompt; give a suffix of at least 1")
    return block


def replay_error_rows(
    model: Model, hits: Sequence[int], suffixes: Sequence[int], page_size: int = 16, seed: int = 0, ced: bool = True
) -> list[ReplayErrorRow]:
    """Logits error of prefix hit + bounded replay against the exact prefill, one row per (hit, suffix).

    Args:
        model: a model (float64 for the approximation alone; float32 adds rounding noise to both sides).
        hits: hit positions in tokens, multiples of the prefix block (``2 * page_size`` for ratios 1 and 2).
        suffixes: suffix lengths in tokens (0: the whole prompt is cached; the replay alone gives the logits).
        page_size: entries per page of the paged cache.
        seed: the token stream's seed.
        ced: the CED prefill (decoder replay of the last window encoder outputs) on both sides, or every layer.
    Returns:
        rows in (hit, suffix) order of the arguments, deduplicated; the empty prompt (hit 0, suffix 0) is skipped.
    """
    hits, suffixes = list(dict.fromkeys(hits)), list(dict.fromkeys(suffixes))
    check_points(model, hits, suffixes, page_size)
    cfg = model.cfg
    longest = max(hits) + max(suffixes)
    base = torch.randint(0, cfg.vocab_size, (longest,), generator=torch.Generator().manual_seed(seed)).to(model.device)
    need = {
        s: a + b
        for (s, a), b in zip(pages_for(cfg, max(hits), page_size).items(), pages_for(cfg, longest, page_size).values(), strict=True)
    }
    cache = model.new_paged_cache(need, n_slots=2, page_size=page_size)
    if max(hits):
        publisher = cache.add()
        model.prefill_paged(base[: max(hits)], cache, publisher, ced=ced)
        cache.publish_prefix(publisher, base[: max(hits)])
    exact: dict[int, torch.Tensor] = {}
    rows = []
    for h in hits:
        for s in suffixes:
            n = h + s
            if n < 1:
                continue
            if n not in exact:
                oracle = model.new_paged_cache(pages_for(cfg, n, page_size), n_slots=1, page_size=page_size)
                exact[n] = model.prefill_paged(base[:n], oracle, oracle.add(), ced=ced).double()
            got = model.prefill_with_prefix(base[:n], cache, ced=ced, publish=False, max_hit_tokens=h)
            cache.free(got.seq)
            if got.hit_tokens != h:
                raise RuntimeError(f"a hit of {h} tokens was published but {got.hit_tokens} were found")
            ref, diff = exact[n], got.logits.double() - exact[n]
            rows.append(
                ReplayErrorRow(
                    preset=cfg.name,
                    hit=h,
                    suffix=s,
                    replayed=got.replayed,
                    window=cfg.window,
                    max_abs=float(diff.abs().max()),
                    rel_l2=float(diff.norm() / ref.norm()),
                    argmax_same=bool(got.logits.argmax() == ref.argmax()),
                )
            )
    return rows
