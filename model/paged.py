"""Paged KV cache manager: sequences of different lengths in shared page pools (continuous batching).

Two kinds of storage, as the V4 cache manager splits them:

* **Pages** (one pool per KV group, i.e. per KV source layer): completed compressed entries, which
  only ever grow. Each pool is four flat row tensors, ``pool row = page_id * page_size + offset``:
  main FP4 ``main_packed`` uint8 [R, D/2] + ``main_scales`` [R, D/16] (E4M3) and index FP4
  ``index_packed`` [R, Di/2] + ``index_scales`` [R, Di/32] (E8M0), R = n_pages * page_size.
  A sequence holds a list of page ids per group (its block table); logical entry ``j`` is at
  offset ``j % page_size`` of its ``j // page_size``-th page.
* **State slots** (one per live sequence): what depends on the current position, not on the
  history length: every layer's SWA ring (FP8 codes [n_slots * window, D] + E8M0 scales
  [n_slots * window, D/32], ``ring row = slot * window + pos % window``) and each ratio > 1
  source's unfinished-group tail (``kv`` and ``gate`` [n_slots, ratio - 1, D], float32; float64
  for a float64 model).

Sequences are added, extended and freed independently; a model step takes any subset of live
sequences. Every allocation is checked whole before anything is taken, so a step that runs out of
pages or slots raises :class:`OutOfPages` / :class:`OutOfSlots` and leaves every live sequence
as it was. The contiguous :class:`model.cache.KVCache` stays the oracle of this layout.

Sizes from the config alone: :func:`page_bytes`, :func:`pages_for`, :func:`slot_bytes`,
:func:`sequence_bytes` and :func:`plan_workload`.
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from model.cache import index_entry_bytes, main_entry_bytes, ring_bytes
from model.config import ModelConfig
from model.formats import FP8_GROUP
from model.prefix import PrefixBlock, PrefixHit, PrefixIndex, PrefixStats, block_tokens, chain_root

DEFAULT_PAGE_SIZE = 64


class PagedCacheError(RuntimeError):
    """Any error of the paged cache manager (one line, naming what was asked and what is there)."""


class OutOfPages(PagedCacheError):
    """A group's page pool cannot hold what a step asked for; nothing was allocated."""


class OutOfSlots(PagedCacheError):
    """Every state slot is taken by a live sequence; nothing was allocated."""


class SequenceError(PagedCacheError):
    """An unknown, freed or repeated sequence id, or a write past a sequence's pages."""


# -- sizes from the config alone ---------------------------------------------------------------------


def group_ratios(cfg: ModelConfig) -> dict[int, int]:
    """KV source layer -> its compress ratio, in layer order."""
    return {src: cfg.compress_ratios[src] for src in sorted(cfg.kv_source_layers)}


def entries_for(n_tokens: int, ratio: int) -> int:
    """Completed entries of a group after ``n_tokens`` tokens (an unfinished group waits in the tail)."""
    return n_tokens // ratio


def pages_for(cfg: ModelConfig, n_tokens: int, page_size: int = DEFAULT_PAGE_SIZE) -> dict[int, int]:
    """Pages each group needs for one sequence of ``n_tokens`` tokens: KV source layer -> pages."""
    return {src: -(-entries_for(n_tokens, r) // page_size) for src, r in group_ratios(cfg).items()}


def page_bytes(cfg: ModelConfig, page_size: int = DEFAULT_PAGE_SIZE) -> int:
    """Bytes of one page (main + index FP4 of ``page_size`` entries): 356 * 64 = 22,784 for v4.1-flash at 64."""
    return page_size * (main_entry_bytes(cfg) + index_entry_bytes(cfg))


def slot_bytes(cfg: ModelConfig, state_dtype: torch.dtype = torch.float32) -> int:
    """Bytes of one state slot: every layer's SWA ring plus each ratio > 1 source's kv + gate tail rows."""
    item = torch.empty(0, dtype=state_dtype).element_size()
    tails = sum((r - 1) * 2 * cfg.head_dim * item for r in group_ratios(cfg).values() if r > 1)
    return cfg.n_layers * ring_bytes(cfg) + tails


def sequence_bytes(cfg: ModelConfig, n_tokens: int, page_size: int = DEFAULT_PAGE_SIZE) -> int:
    """Bytes one sequence of ``n_tokens`` holds: its pages in every group plus one state slot (float32 tails)."""
    return sum(pages_for(cfg, n_tokens, page_size).values()) * page_bytes(cfg, page_size) + slot_bytes(cfg)


@dataclass(frozen=True)
class WorkloadPlan:
    """Pages, slots and bytes a set of sequences needs (:func:`plan_workload`)."""

    page_size: int
    lengths: tuple[int, ...]
    pages: dict[int, int]  # KV source layer -> pages over all sequences
    page_bytes: int
    slots: int
    slot_bytes: int

    @property
    def group_bytes(self) -> dict[int, int]:
        return {src: n * self.page_bytes for src, n in self.pages.items()}

    @property
    def page_total_bytes(self) -> int:
        return sum(self.group_bytes.values())

    @property
    def slot_total_bytes(self) -> int:
        return self.slots * self.slot_bytes

    @property
    def total_bytes(self) -> int:
        return self.page_total_bytes + self.slot_total_bytes


def spread_lengths(n: int, lo: int, hi: int) -> list[int]:
    """``n`` sequence lengths spread evenly from ``lo`` to ``hi`` tokens, both included (one sequence: ``lo``)."""
    return [lo + (hi - lo) * i // (n - 1) for i in range(n)] if n > 1 else [lo]


def plan_workload(cfg: ModelConfig, lengths: Sequence[int], page_size: int = DEFAULT_PAGE_SIZE) -> WorkloadPlan:
    """What a batch of live sequences of the given lengths holds: pages per group, one slot each, bytes."""
    if page_size < 1:
        raise PagedCacheError(f"page_size must be at least 1, got {page_size}")
    pages = dict.fromkeys(group_ratios(cfg), 0)
    for n in lengths:
        if n < 0:
            raise PagedCacheError(f"a sequence length must be at least 0, got {n}")
        for src, p in pages_for(cfg, n, page_size).items():
            pages[src] += p
    return WorkloadPlan(page_size, tuple(lengths), pages, page_bytes(cfg, page_size), len(lengths), slot_bytes(cfg))


# -- storage ---------------------------------------------------------------------------------------


class PagePool:
    """One KV group's pages: four flat row tensors, each page's holder count and the free pages.

    A page is held by every sequence whose block table lists it (a prefix hit or a fork shares pages; see
    :mod:`model.prefix`). It goes back to the free pages when its last holder lets it go. A free page that a prefix
    index still names keeps its contents and can be held again by a hit; it is taken for new entries only when no
    other page is free, least recently freed first, and taking it evicts its index entry (``on_evict``).
    """

    def __init__(self, cfg: ModelConfig, source: int, ratio: int, n_pages: int, page_size: int, device: torch.device | str) -> None:
        self.source, self.ratio, self.n_pages, self.page_size = source, ratio, n_pages, page_size
        R, D, Di = n_pages * page_size, cfg.head_dim, cfg.index_head_dim

        def rows(width: int) -> torch.Tensor:
            return torch.zeros(R, width, dtype=torch.uint8, device=device)

        self.main_packed = rows(D // 2)  # [R, D/2] E2M1 pairs
        self.main_scales = rows(D // cfg.main_fp4_group)  # [R, D/16] E4M3
        self.index_packed = rows(Di // 2)  # [R, Di/2] E2M1 pairs
        self.index_scales = rows(Di // cfg.index_fp4_group)  # [R, Di/32] E8M0
        self.refs = [0] * n_pages  # holders of each page (sequences whose block tables list it)
        self.indexed: set[int] = set()  # pages a prefix index names
        self._free = list(range(n_pages))  # a heap of free pages no index names: the smallest id is taken first (deterministic reuse)
        self._cached: OrderedDict[int, None] = OrderedDict()  # free pages an index names, least recently freed first
        self.on_evict: Callable[[int, int], None] | None = None  # (source, page) when a named free page is taken

    @property
    def n_free(self) -> int:
        """Free pages, those an index still names included (they are taken last)."""
        return len(self._free) + len(self._cached)

    @property
    def n_cached_free(self) -> int:
        """Free pages that still answer prefix hits."""
        return len(self._cached)

    def take(self, n: int) -> list[int]:
        """``n`` free page ids, each with one holder; the caller has checked :attr:`n_free`."""
        out = []
        for _ in range(n):
            if self._free:
                p = heapq.heappop(self._free)
            else:
                p, _ = self._cached.popitem(last=False)
                if self.on_evict is not None:
                    self.on_evict(self.source, p)  # the index forgets the page's block (and the blocks after it)
                self.indexed.discard(p)
            self.refs[p] = 1
            out.append(p)
        return out

    def hold(self, page: int) -> None:
        """One more holder of a page that is held or that an index names (a free named page is taken back as it is)."""
        if self.refs[page] == 0:
            if page not in self._cached:
                raise PagedCacheError(f"group {self.source}: page {page} is free and no prefix index names it; it cannot be shared")
            del self._cached[page]
        self.refs[page] += 1

    def release(self, pages: Sequence[int]) -> None:
        """One holder fewer of each page; a page whose last holder lets go is free again."""
        for p in pages:
            if self.refs[p] < 1:
                raise PagedCacheError(f"group {self.source}: page {p} is released more often than it was held")
            self.refs[p] -= 1
            if self.refs[p] == 0:
                if p in self.indexed:
                    self._cached[p] = None
                else:
                    heapq.heappush(self._free, p)

    give_back = release

    def mark_indexed(self, page: int) -> None:
        self.indexed.add(page)

    def unmark_indexed(self, page: int) -> None:
        """The index forgot the page: a free one becomes an ordinary free page."""
        self.indexed.discard(page)
        if page in self._cached:
            del self._cached[page]
            heapq.heappush(self._free, page)

    def shared(self, page: int) -> bool:
        """Whether a write into ``page`` would be seen by someone else: another holder or a prefix index."""
        return self.refs[page] > 1 or page in self.indexed

    def copy_page(self, src: int, dst: int) -> None:
        """Copy every row of page ``src`` into page ``dst`` (copy-on-write)."""
        ps = self.page_size
        for t in self.tensors().values():
            t[dst * ps : (dst + 1) * ps] = t[src * ps : (src + 1) * ps]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in ("main_packed", "main_scales", "index_packed", "index_scales")}


class StatePool:
    """Per-slot state: each layer's SWA ring rows and each ratio > 1 source's tail rows."""

    def __init__(self, cfg: ModelConfig, n_slots: int, device: torch.device | str, state_dtype: torch.dtype) -> None:
        self.n_slots, self.window = n_slots, cfg.window
        D, W = cfg.head_dim, cfg.window
        self.ring_codes = [torch.zeros(n_slots * W, D, dtype=torch.uint8, device=device) for _ in range(cfg.n_layers)]  # E4M3
        self.ring_scales = [torch.zeros(n_slots * W, D // FP8_GROUP, dtype=torch.uint8, device=device) for _ in range(cfg.n_layers)]
        self.tail_kv: dict[int, torch.Tensor] = {}
        self.tail_gate: dict[int, torch.Tensor] = {}
        for src, r in group_ratios(cfg).items():
            if r > 1:
                self.tail_kv[src] = torch.zeros(n_slots, r - 1, D, dtype=state_dtype, device=device)  # [n_slots, r-1, D]
                self.tail_gate[src] = torch.zeros(n_slots, r - 1, D, dtype=state_dtype, device=device)
        self._free = list(range(n_slots))

    @property
    def n_free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        return heapq.heappop(self._free)

    def give_back(self, slot: int) -> None:
        heapq.heappush(self._free, slot)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for i, (c, s) in enumerate(zip(self.ring_codes, self.ring_scales, strict=True)):
            out[f"ring{i}.codes"], out[f"ring{i}.scales"] = c, s
        for src in self.tail_kv:
            out[f"tail{src}.kv"], out[f"tail{src}.gate"] = self.tail_kv[src], self.tail_gate[src]
        return out


@dataclass
class SequenceState:
    """Host bookkeeping of one live sequence."""

    id: int
    slot: int
    n_tokens: int = 0  # tokens consumed (the position of the next token)
    pages: dict[int, list[int]] = field(default_factory=dict)  # KV source layer -> page ids, in order
    entries: dict[int, int] = field(default_factory=dict)  # KV source layer -> completed entries written
    tail: dict[int, int] = field(default_factory=dict)  # ratio > 1 source -> tokens waiting in the tail
    rings: list[list[int]] = field(default_factory=list)  # per layer [start, end): positions its ring holds


def _token_ids(tokens: torch.Tensor | Sequence[int], what: str) -> torch.Tensor:
    """int64 [N] on the host from a token tensor [N] / [1, N] or a list of ids."""
    ids = torch.as_tensor(tokens)
    if ids.dim() > 2 or (ids.dim() == 2 and ids.shape[0] != 1) or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise SequenceError(f"{what}: tokens must be integer ids of shape [N] or [1, N], got {getattr(tokens, 'shape', type(tokens))}")
    return ids.reshape(-1).to(torch.int64).cpu()


# -- the manager -----------------------------------------------------------------------------------


class PagedKVCache:
    """Page pools per KV group, a state-slot pool and the live sequences that own them.

    Args:
        cfg: the model config.
        n_pages: pages per group: one number for every group, or KV source layer -> pages.
        n_slots: state slots (the most sequences alive at once).
        page_size: compressed entries per page.
        state_dtype: the tails' dtype (float32; float64 for a float64 model).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        n_pages: int | Mapping[int, int],
        n_slots: int,
        page_size: int = DEFAULT_PAGE_SIZE,
        device: torch.device | str = "cpu",
        state_dtype: torch.dtype = torch.float32,
    ) -> None:
        ratios = group_ratios(cfg)
        pages = dict.fromkeys(ratios, n_pages) if isinstance(n_pages, int) else dict(n_pages)
        if set(pages) != set(ratios):
            raise PagedCacheError(f"n_pages must name every KV source layer {sorted(ratios)}, got {sorted(pages)}")
        if page_size < 1 or n_slots < 1 or any(n < 0 for n in pages.values()):
            raise PagedCacheError(
                f"page_size and n_slots must be at least 1 and page counts at least 0, got {page_size}, {n_slots}, {pages}"
            )
        self.cfg, self.page_size, self.device = cfg, page_size, torch.device(device)
        self.groups = {src: PagePool(cfg, src, r, pages[src], page_size, device) for src, r in ratios.items()}
        self.state = StatePool(cfg, n_slots, device, state_dtype)
        self._live: dict[int, SequenceState] = {}
        self._next_id = 0
        self.block_tokens = block_tokens(list(ratios.values()), page_size)
        self.prefix = PrefixIndex(chain_root(cfg, page_size), self.block_tokens)
        self.prefix_stats = PrefixStats()
        for pool in self.groups.values():
            pool.on_evict = self._evict_page

    @classmethod
    def for_lengths(
        cls,
        cfg: ModelConfig,
        lengths: Sequence[int],
        page_size: int = DEFAULT_PAGE_SIZE,
        device: torch.device | str = "cpu",
        state_dtype: torch.dtype = torch.float32,
        spare_pages: int = 0,
    ) -> PagedKVCache:
        """A cache just large enough for live sequences of these lengths at once (plus ``spare_pages`` per group)."""
        plan = plan_workload(cfg, lengths, page_size)
        return cls(cfg, {s: n + spare_pages for s, n in plan.pages.items()}, max(1, plan.slots), page_size, device, state_dtype)

    # -- sequences -------------------------------------------------------------------------------

    def add(self) -> int:
        """A new empty sequence with its own state slot; returns its id (ids are never reused)."""
        if not self.state.n_free:
            raise OutOfSlots(f"add: no free state slot ({self.state.n_slots} slots, all held by live sequences); free a sequence first")
        slot = self.state.take()
        seq = SequenceState(self._next_id, slot)
        for src, r in group_ratios(self.cfg).items():
            seq.pages[src], seq.entries[src] = [], 0
            if r > 1:
                seq.tail[src] = 0
        seq.rings = [[0, 0] for _ in range(self.cfg.n_layers)]
        self._live[seq.id] = seq
        self._next_id += 1
        return seq.id

    def free(self, seq_id: int) -> None:
        """Let go of a sequence's pages (each is free once its last holder lets go) and give its slot back; its id is
        never valid again."""
        seq = self.sequence(seq_id, "free")
        for src, pages in seq.pages.items():
            self.groups[src].release(pages[::-1])  # last page first: an indexed chain then loses its later blocks first
        self.state.give_back(seq.slot)
        del self._live[seq_id]

    def sequence(self, seq_id: int, what: str = "cache") -> SequenceState:
        """The live sequence ``seq_id`` (raises :class:`SequenceError` for an unknown or freed id)."""
        if not isinstance(seq_id, int) or isinstance(seq_id, bool):
            raise SequenceError(f"{what}: sequence ids are ints from add(), got {type(seq_id).__name__}")
        seq = self._live.get(seq_id)
        if seq is None:
            state = "was freed" if 0 <= seq_id < self._next_id else "was never added"
            raise SequenceError(f"{what}: sequence {seq_id} {state}; live sequences: {self._live_list()}")
        return seq

    def sequences(self, seq_ids: Sequence[int], what: str = "cache") -> list[SequenceState]:
        """Live sequences for a batch, each at most once."""
        seqs = [self.sequence(s, what) for s in seq_ids]
        if len({s.id for s in seqs}) != len(seqs):
            raise SequenceError(f"{what}: a batch names a sequence more than once: {list(seq_ids)}")
        if not seqs:
            raise SequenceError(f"{what}: a batch needs at least one sequence")
        return seqs

    def _live_list(self) -> str:
        ids = sorted(self._live)
        return ", ".join(map(str, ids[:16])) + (f", ... ({len(ids)})" if len(ids) > 16 else "") if ids else "none"

    @property
    def live(self) -> list[int]:
        """Ids of the live sequences, ascending."""
        return sorted(self._live)

    def length(self, seq_id: int) -> int:
        """Tokens a live sequence has consumed."""
        return self.sequence(seq_id).n_tokens

    def extend(self, seq_ids: Sequence[int], n_new: int | Sequence[int]) -> None:
        """Make room for ``n_new`` more tokens of each sequence: takes the pages every group then needs.

        All or nothing: when any group is short, raises :class:`OutOfPages` before taking a page.
        Token counts move on only when the tokens are written (:meth:`advance`).
        """
        seqs = self.sequences(seq_ids, "extend")
        news = [n_new] * len(seqs) if isinstance(n_new, int) else list(n_new)
        if len(news) != len(seqs) or any(n < 0 for n in news):
            raise SequenceError(f"extend: need one token count >= 0 per sequence, got {news} for {len(seqs)} sequences")
        want: dict[int, list[tuple[SequenceState, int, int | None]]] = {src: [] for src in self.groups}
        for seq, n in zip(seqs, news, strict=True):
            for src, p in pages_for(self.cfg, seq.n_tokens + n, self.page_size).items():
                grow, copy = max(0, p - len(seq.pages[src])), self._shared_write_page(seq, src, n)
                if grow or copy is not None:
                    want[src].append((seq, grow, copy))
        for src, asks in want.items():
            self._keep_last_holder(src, asks)
            need, pool = sum(n + (c is not None) for _, n, c in asks), self.groups[src]
            if need > pool.n_free:
                raise OutOfPages(
                    f"extend: group {src} needs {need} more pages of {self.page_size} entries for sequences"
                    f" {[s.id for s, _, _ in asks]}, but only {pool.n_free} of {pool.n_pages} are free; free a sequence or add pages"
                )
        for src, asks in want.items():
            pool = self.groups[src]
            for seq, n, copy in asks:
                if copy is not None:
                    self._copy_on_write(seq, src, copy)
                seq.pages[src].extend(pool.take(n))

    def _keep_last_holder(self, source: int, asks: list[tuple[SequenceState, int, int | None]]) -> None:
        """When every holder of a shared page that no index names writes into it in this step, the last of them keeps
        the original (the others' copies leave it theirs alone): a copy each would take a page more than needed."""
        pool = self.groups[source]
        writers = Counter(seq.pages[source][c] for seq, _, c in asks if c is not None)
        keep = {p for p, k in writers.items() if k == pool.refs[p] and p not in pool.indexed}
        for i in range(len(asks) - 1, -1, -1):
            seq, n, c = asks[i]
            if c is not None and seq.pages[source][c] in keep:
                keep.discard(seq.pages[source][c])
                asks[i] = (seq, n, None)

    def _shared_write_page(self, seq: SequenceState, source: int, n_new: int) -> int | None:
        """The index in ``seq``'s block table of a shared page that ``n_new`` more tokens would write entries into.

        Entries are appended, so only the page of the next entry can be both held and written: a fork shares a
        partly filled last page; prefix hits share full pages only.
        """
        pool = self.groups[source]
        first, end = seq.entries[source], (seq.n_tokens + n_new) // pool.ratio
        i = first // self.page_size
        if end > first and i < len(seq.pages[source]) and pool.shared(seq.pages[source][i]):
            return i
        return None

    def _copy_on_write(self, seq: SequenceState, source: int, i: int) -> None:
        """Give ``seq`` its own copy of the ``i``-th page of its block table; the other holders keep the original."""
        pool = self.groups[source]
        old = seq.pages[source][i]
        (new,) = pool.take(1)
        pool.copy_page(old, new)
        seq.pages[source][i] = new
        pool.release([old])
        self.prefix_stats.pages_copied += 1

    def advance(self, seq_ids: Sequence[int], n: int) -> None:
        """Count ``n`` more consumed tokens for each sequence (after a step has written them)."""
        for seq in self.sequences(seq_ids, "advance"):
            seq.n_tokens += n

    # -- prefix reuse and forks ------------------------------------------------------------------

    def match_prefix(self, tokens: torch.Tensor | Sequence[int], max_tokens: int | None = None) -> PrefixHit:
        """The longest published prefix of ``tokens`` (int [N]) in whole blocks of :attr:`block_tokens`; changes nothing.

        Args:
            max_tokens: take at most this many tokens from the cache (whole blocks below it).
        Returns:
            a :class:`PrefixHit`: ``n_tokens`` (a multiple of :attr:`block_tokens`, 0 on a miss) and its pages per group.
        """
        ids = _token_ids(tokens, "match_prefix")
        limit = ids.numel() if max_tokens is None else min(ids.numel(), max(0, max_tokens))
        found = self.prefix.lookup(self.prefix.keys(ids, limit // self.block_tokens))
        pages = {src: tuple(p for b in found for p in b.pages[src]) for src in self.groups}
        return PrefixHit(len(found) * self.block_tokens, len(found), pages, tuple(b.key for b in found))

    def add_with_prefix(self, tokens: torch.Tensor | Sequence[int], max_hit_tokens: int | None = None) -> tuple[int, PrefixHit]:
        """A new sequence for the prompt ``tokens`` (int [N]) that starts from its longest published prefix.

        The hit's pages are shared (one more holder each), never copied; the pages the rest of the prompt needs are
        taken now. The sequence then stands at position ``hit.n_tokens`` with every group's entries of the prefix,
        empty tails (a hit ends on a compression-group boundary) and empty SWA rings, which the model rebuilds by
        bounded replay (:meth:`model.model.Model.prefill_with_prefix`).

        All or nothing: raises :class:`OutOfSlots` / :class:`OutOfPages` before anything is held or taken.
        """
        ids = _token_ids(tokens, "add_with_prefix")
        hit = self.match_prefix(ids, max_hit_tokens)
        if not self.state.n_free:
            raise OutOfSlots(
                f"add_with_prefix: no free state slot ({self.state.n_slots} slots, all held by live sequences); free a sequence first"
            )
        need = pages_for(self.cfg, ids.numel(), self.page_size)
        for src, pool in self.groups.items():
            more = need[src] - len(hit.pages[src])
            revived = sum(pool.refs[p] == 0 for p in hit.pages[src])  # free pages the hit takes back
            if more > pool.n_free - revived:
                raise OutOfPages(
                    f"add_with_prefix: group {src} needs {more} more pages of {self.page_size} entries for a {ids.numel()}-token prompt"
                    f" ({hit.n_tokens} tokens hit), but only {pool.n_free - revived} of {pool.n_pages} are free;"
                    " free a sequence or add pages"
                )
        seq = self.sequence(self.add(), "add_with_prefix")
        for src, pool in self.groups.items():
            for p in hit.pages[src]:
                pool.hold(p)  # before take(): a page of the hit is never evicted for the rest of the prompt
            seq.pages[src] = list(hit.pages[src]) + pool.take(need[src] - len(hit.pages[src]))
            seq.entries[src] = hit.n_tokens // pool.ratio
        seq.n_tokens = hit.n_tokens
        seq.rings = [[hit.n_tokens, hit.n_tokens] for _ in range(self.cfg.n_layers)]
        st = self.prefix_stats
        st.lookups += 1
        if hit.n_tokens:
            st.hits, st.hit_tokens = st.hits + 1, st.hit_tokens + hit.n_tokens
            st.pages_shared += sum(len(p) for p in hit.pages.values())
        return seq.id, hit

    def publish_prefix(self, seq_id: int, tokens: torch.Tensor | Sequence[int]) -> int:
        """Index the whole prefix blocks of a sequence's prompt so later prompts that start with them share its pages.

        Args:
            tokens: int [N], the first N tokens the sequence consumed (its prompt). Only blocks whose entries are
                written in every group are published: full pages, which the sequence never writes again.
        Returns:
            the number of blocks newly indexed (blocks already indexed, by this or another sequence, are kept).
        """
        seq = self.sequence(seq_id, "publish_prefix")
        ids = _token_ids(tokens, "publish_prefix")
        if ids.numel() > seq.n_tokens:
            raise SequenceError(
                f"publish_prefix: sequence {seq_id} has consumed {seq.n_tokens} tokens, got {ids.numel()}; publish its prompt after prefill"
            )
        B = self.block_tokens
        written = min(seq.entries[src] * pool.ratio // B for src, pool in self.groups.items())
        keys, new, parent = self.prefix.keys(ids, written), 0, None
        for k, key in enumerate(keys):
            if key not in self.prefix:
                pages = {}
                for src, pool in self.groups.items():
                    per = B // (pool.ratio * self.page_size)
                    pages[src] = tuple(seq.pages[src][k * per : (k + 1) * per])
                    other = next((self.prefix.key_of(src, p) for p in pages[src] if self.prefix.key_of(src, p) is not None), None)
                    if other is not None:
                        raise PagedCacheError(
                            f"publish_prefix: block {k} of sequence {seq_id} holds pages another prefix names; pass the tokens"
                            " the sequence consumed"
                        )
                self.prefix.insert(PrefixBlock(key, parent, k, pages))
                for src, pool in self.groups.items():
                    for p in pages[src]:
                        pool.mark_indexed(p)
                new += 1
            parent = key
        self.prefix_stats.blocks_published += new
        return new

    def fork(self, seq_id: int) -> int:
        """A new sequence that continues from where ``seq_id`` stands: every page shared, SWA rings and tails copied.

        The first write of either sequence into a shared page (the partly filled last page of a group) goes to a copy
        of the page (:meth:`extend`), so neither ever sees the other's new entries.
        """
        parent = self.sequence(seq_id, "fork")
        child = self.sequence(self.add(), "fork")  # OutOfSlots before anything is shared
        W = self.cfg.window
        st = self.state
        rows, to = slice(parent.slot * W, (parent.slot + 1) * W), slice(child.slot * W, (child.slot + 1) * W)
        for codes, scales in zip(st.ring_codes, st.ring_scales, strict=True):
            codes[to], scales[to] = codes[rows], scales[rows]
        for src in st.tail_kv:
            st.tail_kv[src][child.slot], st.tail_gate[src][child.slot] = st.tail_kv[src][parent.slot], st.tail_gate[src][parent.slot]
        for src, pool in self.groups.items():
            for p in parent.pages[src]:
                pool.hold(p)
            child.pages[src] = list(parent.pages[src])
            self.prefix_stats.pages_shared += len(parent.pages[src])
        child.n_tokens, child.entries, child.tail = parent.n_tokens, dict(parent.entries), dict(parent.tail)
        child.rings = [list(r) for r in parent.rings]
        return child.id

    def _evict_page(self, source: int, page: int) -> None:
        """A pool takes a free page the index names: forget its block and the blocks after it."""
        key = self.prefix.key_of(source, page)
        if key is None:
            return
        for block in self.prefix.evict(key):
            for src, pages in block.pages.items():
                for p in pages:
                    self.groups[src].unmark_indexed(p)
            self.prefix_stats.blocks_evicted += 1

    # -- block tables and entries ----------------------------------------------------------------

    def block_table(self, seq_ids: Sequence[int], source: int) -> torch.Tensor:
        """int32 [B, max_pages]: each sequence's page ids in ``source``'s pool, -1 past its pages."""
        seqs = self.sequences(seq_ids, "block_table")
        width = max(len(s.pages[source]) for s in seqs)
        table = torch.full((len(seqs), width), -1, dtype=torch.int32)
        for b, s in enumerate(seqs):
            table[b, : len(s.pages[source])] = torch.tensor(s.pages[source], dtype=torch.int32)
        return table.to(self.device)

    def n_entries(self, seq_ids: Sequence[int], source: int) -> torch.Tensor:
        """int64 [B, 1]: completed entries of each sequence in ``source``'s group."""
        seqs = self.sequences(seq_ids, "n_entries")
        return torch.tensor([[s.entries[source]] for s in seqs], dtype=torch.int64, device=self.device)

    def entry_rows(self, seq_id: int, source: int, first: int, count: int) -> torch.Tensor:
        """int64 [count] pool rows of logical entries ``first .. first + count - 1`` of one sequence."""
        seq = self.sequence(seq_id, "entry_rows")
        pages, ps = seq.pages[source], self.page_size
        if first < 0 or first + count > len(pages) * ps:
            raise SequenceError(
                f"entries {first}..{first + count - 1} of sequence {seq_id} in group {source} lie past its {len(pages)} pages"
                f" of {ps} ({len(pages) * ps} entries); extend() the sequence first"
            )
        j = torch.arange(first, first + count)
        return (torch.tensor(pages, dtype=torch.int64)[j // ps] * ps + j % ps).to(self.device)

    def write_entries(
        self,
        seq_id: int,
        source: int,
        main_packed: torch.Tensor,
        main_scales: torch.Tensor,
        index_packed: torch.Tensor,
        index_scales: torch.Tensor,
    ) -> None:
        """Append G completed entries (each tensor uint8 [G, ...] or [1, G, ...]) to a sequence's pages in ``source``'s group."""
        seq = self.sequence(seq_id, "write_entries")
        tensors = [t.reshape(-1, t.shape[-1]) for t in (main_packed, main_scales, index_packed, index_scales)]
        G = tensors[0].shape[0]
        rows = self.entry_rows(seq_id, source, seq.entries[source], G)  # checked before any write
        pool = self.groups[source]
        for page in seq.pages[source][seq.entries[source] // self.page_size : (seq.entries[source] + G - 1) // self.page_size + 1]:
            if pool.shared(page):  # extend() copies a shared page before a step can write into it
                raise PagedCacheError(
                    f"write_entries: page {page} of group {source} is shared ({pool.refs[page]} holders"
                    f"{', prefix index' if page in pool.indexed else ''}); extend() the sequence first, which copies it"
                )
        for name, t in zip(("main_packed", "main_scales", "index_packed", "index_scales"), tensors, strict=True):
            getattr(pool, name)[rows] = t
        seq.entries[source] += G

    # -- compressor tails ------------------------------------------------------------------------

    def tail(self, seq_id: int, source: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The pending rows of a sequence's unfinished group: kv, gate [1, count, D]."""
        seq = self.sequence(seq_id, "tail")
        c = seq.tail[source]
        return self.state.tail_kv[source][seq.slot, :c].unsqueeze(0), self.state.tail_gate[source][seq.slot, :c].unsqueeze(0)

    def store_tail(self, seq_id: int, source: int, kv: torch.Tensor, gate: torch.Tensor) -> None:
        """Keep the rows of a new unfinished group (kv, gate [1, c, D], c < ratio)."""
        seq = self.sequence(seq_id, "store_tail")
        c = kv.shape[-2]
        self.state.tail_kv[source][seq.slot, :c] = kv.reshape(c, kv.shape[-1])
        self.state.tail_gate[source][seq.slot, :c] = gate.reshape(c, gate.shape[-1])
        seq.tail[source] = c

    # -- SWA rings -------------------------------------------------------------------------------

    def reset_ring(self, seq_id: int, layer: int, position: int) -> None:
        """Empty one layer's ring of a sequence; the next write starts at ``position`` (CED seeding of decoder rings)."""
        self.sequence(seq_id, "reset_ring").rings[layer] = [position, position]

    def swa_step(
        self, seq_ids: Sequence[int], layer: int, first: Sequence[int], codes: torch.Tensor, scales: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Write a step's SWA KV into the rings and return what its queries attend to.

        Row ``b`` holds tokens at positions ``first[b] .. first[b] + S - 1``; each query sees positions
        ``i - window + 1 .. i`` (ascending) that are held.

        Args:
            codes: uint8 [B, S, D] FP8 codes; scales: uint8 [B, S, D/32] E8M0.
        Returns:
            window codes, window scales, int32 [B, S, W] rows. S = 1: the ring pool shared by every row,
            [1, n_slots * W, D] / [1, n_slots * W, D/32], after the write (rows ``slot * W + pos % W``).
            S > 1: per row ``cat(ring, step tokens)`` [B, W + S, ...] from before the write (a later token of
            the step overwrites a slot an earlier query still needs): ring rows ``pos % W``, the step's tokens
            ``W + (pos - first)``.
        """
        seqs = self.sequences(seq_ids, "swa_step")
        B, S = codes.shape[:2]
        W, dev = self.cfg.window, self.device
        for seq, f in zip(seqs, first, strict=True):
            if seq.rings[layer][1] != f:
                raise SequenceError(f"swa_step: layer {layer} ring of sequence {seq.id} expects position {seq.rings[layer][1]}, got {f}")
        ring_c, ring_s = self.state.ring_codes[layer], self.state.ring_scales[layer]
        slot = torch.tensor([s.slot for s in seqs], dtype=torch.int64, device=dev)[:, None, None]  # [B, 1, 1]
        f0 = torch.tensor(list(first), dtype=torch.int64, device=dev)[:, None, None]
        if S > 1:
            base = (slot[:, :, 0] * W + torch.arange(W, device=dev)).view(B, W)  # [B, W] the rows of each ring
            win_codes, win_scales = torch.cat([ring_c[base], codes], 1), torch.cat([ring_s[base], scales], 1)  # [B, W+S, ...]
            old = [list(s.rings[layer]) for s in seqs]
        self._write_ring(seqs, layer, first, codes, scales)
        held = old if S > 1 else [s.rings[layer] for s in seqs]
        start = torch.tensor([h[0] for h in held], dtype=torch.int64, device=dev)[:, None, None]
        end = torch.tensor([h[1] for h in held], dtype=torch.int64, device=dev)[:, None, None]
        i = f0 + torch.arange(S, device=dev)[None, :, None]  # [B, S, 1] query positions
        p = i - W + 1 + torch.arange(W, device=dev)  # [B, S, W] the positions each query sees
        in_ring = (p >= start) & (p < end)
        if S > 1:
            new = p >= f0
            idx = torch.where(new, W + (p - f0), p % W)
            valid = (p >= 0) & (new | in_ring)
            out = win_codes, win_scales
        else:
            idx, valid = slot * W + p % W, (p >= 0) & in_ring
            out = ring_c.unsqueeze(0), ring_s.unsqueeze(0)
        return *out, torch.where(valid, idx, torch.full_like(idx, -1)).to(torch.int32)

    def _write_ring(self, seqs: list[SequenceState], layer: int, first: Sequence[int], codes: torch.Tensor, scales: torch.Tensor) -> None:
        """Ring write of [B, S, ...] tokens; keeps each row's last ``window``."""
        S, W = codes.shape[1], self.cfg.window
        keep = min(S, W)
        off = torch.arange(S - keep, S)
        rows = torch.stack([s.slot * W + (f + off) % W for s, f in zip(seqs, first, strict=True)]).to(self.device)  # [B, keep]
        self.state.ring_codes[layer][rows] = codes[:, S - keep :]
        self.state.ring_scales[layer][rows] = scales[:, S - keep :]
        for s, f in zip(seqs, first, strict=True):
            s.rings[layer][1] = f + S
            s.rings[layer][0] = max(s.rings[layer][0], f + S - W)

    # -- inspection ------------------------------------------------------------------------------

    def free_pages(self) -> dict[int, int]:
        """KV source layer -> free pages."""
        return {src: g.n_free for src, g in self.groups.items()}

    @property
    def free_slots(self) -> int:
        return self.state.n_free

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every stored tensor by a readable name (for inspection and tests)."""
        out = {f"group{src}.{name}": t for src, g in self.groups.items() for name, t in g.tensors().items()}
        out.update(self.state.tensors())
        return out
