"""A conversation's caches between turns: the paged cache, prefix reuse and the two storage tiers wired together.

After a turn, :meth:`SessionCache.end_turn` keeps what the next turn of the same conversation can reuse, each part
where its reuse time scale says (V4.1's tiers by reuse time scale):

* the prompt's **whole prefix blocks** (global KV pages, days of reuse): published in the HBM prefix index, where
  they stay until the pool needs the pages, and written to the disk tier under content keys;
* the **sequence's state past its last whole block** (minutes of reuse): every layer's SWA ring, the compressor
  tails, and the pages of the last partial block (entries no block names), parked in the host pool under the session
  id. The state belongs to the end of the turn, so an exact continuation needs every token of the turn, including
  the partial block: those pages travel with the state instead of being published (a partial block has no chain key)
  or pinned in HBM (a parked session would hold pages nobody else can use).

Then the sequence is freed. :meth:`SessionCache.start_turn` takes the next turn's full prompt (the old conversation
plus the new suffix) and picks the first path that applies:

* ``pure``: the session's state is in the host pool, the prompt extends the old turn, and all of the old turn's
  whole blocks are found (in HBM, or restored from disk): a new sequence shares those pages, gets the partial-block
  pages and the state back, and the suffix runs through every layer as decode steps would (``decode_paged`` of the
  suffix). Exact: bit-identical to a sequence that was never parked.
* ``replay``: the prompt's leading blocks are in HBM but the state is gone: encoder bounded replay
  (:meth:`Model.prefill_with_prefix`). Approximate past the window (``notes/kv_cache.md``).
* ``disk``: some leading blocks are only on the disk tier: they are read (checksummed) into fresh HBM pages and
  indexed, then bounded replay as above. A missing or corrupt page ends the hit at the start of its block.
* ``cold``: nothing cached: CED prefill of the whole prompt (:meth:`Model.prefill_paged`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from model.model import Model
from model.paged import OutOfPages, PagedCacheError, PagedKVCache, PagePool
from model.prefix import PrefixBlock
from model.tiers import DiskPageTier, HostStatePool, PagePayload, page_key, restore_sequence_state, sequence_state, state_bytes
from model.tiers.pagefile import NAMES

PATHS = ("pure", "replay", "disk", "cold")


class SessionError(PagedCacheError):
    """A session cache was built or used wrongly (one line, naming the fix)."""


@dataclass(frozen=True)
class TurnStart:
    """What :meth:`SessionCache.start_turn` did for one prompt.

    ``seq``: the new live sequence (it has consumed the whole prompt); ``logits``: float32 [vocab] of the prompt's last
    position (float64 for a float64 model); ``how``: one of :data:`PATHS`.
    """

    seq: int
    logits: torch.Tensor
    how: str
    hit_tokens: int  # leading prompt tokens whose global KV came from the cache (HBM or disk)
    replayed: int  # prefix tokens run again through the encoder (0 on the pure and cold paths)
    pages_shared: int  # HBM pages the new sequence shares with the index (found there, not restored)
    disk_pages: int  # pages read from the disk tier into HBM
    disk_bytes: int  # bytes of those page files
    host_bytes: int  # bytes of the parked state restored from the host pool (rings, tails, partial-block pages)


@dataclass
class SessionStats:
    """Counters of one :class:`SessionCache` (they only grow)."""

    turns_ended: int = 0
    paths: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PATHS, 0))
    blocks_published: int = 0
    pages_written: int = 0  # pages put on the disk tier (pages already there are not written again)
    disk_pages_read: int = 0
    disk_bytes_read: int = 0
    disk_misses: int = 0  # lookups that ended a disk hit: page absent, expired or corrupt
    states_parked: int = 0
    host_bytes_parked: int = 0
    host_bytes_restored: int = 0
    states_dropped: int = 0  # parked states found but unusable: another prompt, or the old blocks gone

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "paths": dict(self.paths)}


def _token_ids(tokens: torch.Tensor | Sequence[int], what: str) -> torch.Tensor:
    ids = torch.as_tensor(tokens)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise SessionError(f"{what}: tokens must be integer ids of shape [N] or [1, N], got {getattr(tokens, 'shape', type(tokens))}")
    return ids.to(torch.int64).cpu()


def _digest(ids: torch.Tensor) -> str:
    """Names a token history (int64 [N]): a parked state continues only the prompt it was parked after."""
    return hashlib.blake2b(ids.numpy().astype("<i8").tobytes(), digest_size=16).hexdigest()


def _page_rows(pool: PagePool, page: int) -> PagePayload:
    """Views of one page's rows in a pool (a disk read lands straight in them)."""
    rows = slice(page * pool.page_size, (page + 1) * pool.page_size)
    return PagePayload(*(getattr(pool, n)[rows] for n in NAMES))


class SessionCache:
    """A serving engine's cache of conversations between turns.

    Args:
        model: the model whose pages the cache holds.
        cache: its :class:`PagedKVCache` (``model.new_paged_cache``).
        disk: the disk tier of global KV pages, or None (no pages outlive HBM).
        host: the host pool of parked sequence states, or None (every later turn replays).
        model_id: names the weights (e.g. ``"v4.1-flash@<weights digest>"``); required with a disk tier, whose keys
            must never let pages of other weights answer.
    """

    def __init__(
        self,
        model: Model,
        cache: PagedKVCache,
        disk: DiskPageTier | None = None,
        host: HostStatePool | None = None,
        *,
        model_id: str | None = None,
    ) -> None:
        if cache.cfg != model.cfg:
            raise SessionError(
                f"SessionCache: the cache is of preset {cache.cfg.name!r}, the model {model.cfg.name!r}; use model.new_paged_cache()"
            )
        if disk is not None and not model_id:
            raise SessionError("SessionCache: a disk tier needs model_id naming the weights (e.g. 'v4.1-flash@<weights digest>')")
        self.model, self.cache, self.disk, self.host = model, cache, disk, host
        # The chain root names preset, KV groups, ratios and page size; model_id adds the weights.
        self.identity = f"{model_id}/{cache.prefix.root.hex()}" if model_id else ""
        self.stats = SessionStats()

    # -- keys ------------------------------------------------------------------------------------

    def _pages_per_block(self, pool: PagePool) -> int:
        return self.cache.block_tokens // (pool.ratio * self.cache.page_size)

    def disk_keys(self, chain: bytes, source: int) -> list[str]:
        """Disk keys of the pages of one block (chain key ``chain``) in ``source``'s group, in order. A block holds
        several pages of a low-ratio group; the page's number within the block tells them apart."""
        per = self._pages_per_block(self.cache.groups[source])
        return [page_key(self.identity, source, chain + j.to_bytes(2, "little")) for j in range(per)]

    # -- after a turn ----------------------------------------------------------------------------

    def end_turn(self, session_id: Hashable, seq: int, tokens: torch.Tensor | Sequence[int]) -> None:
        """Keep what the session's next turn can reuse, then free ``seq``.

        Args:
            session_id: the conversation (the host pool's key).
            seq: a live sequence of the cache.
            tokens: int [N], every token ``seq`` consumed (N == its length), the prompt and the tokens fed back.
        """
        cache = self.cache
        ids = _token_ids(tokens, "end_turn")
        state = cache.sequence(seq, "end_turn")
        if ids.numel() != state.n_tokens:
            raise SessionError(
                f"end_turn: sequence {seq} consumed {state.n_tokens} tokens, got {ids.numel()}; pass every token it consumed"
            )
        self.stats.blocks_published += cache.publish_prefix(seq, ids)
        n_blocks = ids.numel() // cache.block_tokens
        if self.disk is not None:
            self._write_blocks(seq, ids, n_blocks)
        if self.host is not None:
            tensors, meta = sequence_state(cache, seq)
            partial: dict[int, int] = {}
            for src, pool in cache.groups.items():
                pages = state.pages[src][n_blocks * self._pages_per_block(pool) :]
                used = -(-state.entries[src] // cache.page_size) - n_blocks * self._pages_per_block(pool)
                partial[src] = used
                for j, p in enumerate(pages[:used]):
                    for name, t in zip(NAMES, PagePayload.from_pool(pool, p).tensors(), strict=True):
                        tensors[f"page{src}.{j}.{name}"] = t
            meta |= {"n_blocks": n_blocks, "partial_pages": partial, "digest": _digest(ids)}
            if self.host.put(session_id, tensors, meta):
                self.stats.states_parked += 1
                self.stats.host_bytes_parked += state_bytes(tensors)
        cache.free(seq)
        self.stats.turns_ended += 1

    def _write_blocks(self, seq: int, ids: torch.Tensor, n_blocks: int) -> None:
        """Put the pages of the sequence's first ``n_blocks`` blocks on the disk tier (pages stored already are kept and
        marked used)."""
        state = self.cache.sequence(seq)
        chain = self.cache.prefix.keys(ids, n_blocks)
        for src, pool in self.cache.groups.items():
            per = self._pages_per_block(pool)
            for k, key in enumerate(chain):
                for j, disk_key in enumerate(self.disk_keys(key, src)):
                    # a page stored already is only marked used: its retention runs from the conversation's last turn
                    if not self.disk.touch(disk_key) and self.disk.put(
                        disk_key, PagePayload.from_pool(pool, state.pages[src][k * per + j])
                    ):
                        self.stats.pages_written += 1

    # -- before a turn ---------------------------------------------------------------------------

    @torch.no_grad()
    def start_turn(self, session_id: Hashable, tokens: torch.Tensor | Sequence[int], ced: bool = True) -> TurnStart:
        """A new sequence that has consumed the whole prompt ``tokens`` (int [N]): pure continuation, bounded replay
        after an HBM or disk hit, or a cold prefill (see the module doc), in that order of preference.

        Args:
            ced: the replay and cold paths run CED (False: every layer over the prompt; the pure path is unaffected).
        Raises:
            OutOfSlots / OutOfPages with the cache's sequences unchanged (pages restored from disk stay indexed) and the
            session's parked state still in the host pool.
        """
        cache, model = self.cache, self.model
        ids = _token_ids(tokens, "start_turn")
        if ids.numel() < 1:
            raise SessionError("start_turn: the prompt is empty; pass at least one token")
        # read, not taken: a turn that fails (no slot, no pages) leaves the parked state for a retry
        entry = self.host.get(session_id) if self.host is not None else None
        if entry is not None:
            n_old = entry.meta["n_tokens"]
            if not (n_old < ids.numel() and _digest(ids[:n_old]) == entry.meta["digest"]):
                entry = None  # another history (edited, or no new token): the state continues nothing here
                self.host.discard(session_id)
                self.stats.states_dropped += 1
        want = entry.meta["n_blocks"] * cache.block_tokens if entry is not None else ids.numel()
        held: dict[int, list[int]] = {src: [] for src in cache.groups}  # our references: nothing is evicted under us
        try:
            hit_tokens, shared, disk_pages, disk_bytes = self._find_prefix(ids, want, held)
            if entry is not None and hit_tokens == want:
                seq, logits = self._continue(ids, entry, held)
                self.stats.host_bytes_restored += entry.nbytes
                how, replayed, host_bytes = "pure", 0, entry.nbytes
            else:
                if entry is not None:
                    self.stats.states_dropped += 1
                if hit_tokens:
                    r = model.prefill_with_prefix(ids.to(model.device), cache, ced=ced, publish=False, max_hit_tokens=hit_tokens)
                    seq, logits, replayed = r.seq, r.logits, r.replayed
                    hit_tokens = r.hit_tokens
                else:
                    seq = cache.add()
                    try:
                        logits = model.prefill_paged(ids.to(model.device), cache, seq, ced=ced)
                    except BaseException:
                        cache.free(seq)
                        raise
                    replayed = 0
                how, host_bytes = ("disk" if disk_pages else "replay") if hit_tokens else "cold", 0
        finally:
            for src, pages in held.items():
                cache.groups[src].release(pages[::-1])
        if self.host is not None:
            self.host.discard(session_id)  # continued, or superseded by the sequence this turn started
        self.stats.paths[how] += 1
        return TurnStart(seq, logits, how, hit_tokens, replayed, shared, disk_pages, disk_bytes, host_bytes)

    def _find_prefix(self, ids: torch.Tensor, limit: int, held: dict[int, list[int]]) -> tuple[int, int, int, int]:
        """The longest run of leading whole blocks of ``ids`` (at most ``limit`` tokens) found in HBM, then continued
        from the disk tier into fresh pages that are indexed; every page of it gets one reference in ``held``.

        Returns: (hit tokens, pages shared from HBM, pages read from disk, their bytes).
        """
        cache = self.cache
        hit = cache.match_prefix(ids, limit)
        for src, pages in hit.pages.items():
            for p in pages:
                cache.groups[src].hold(p)
                held[src].append(p)
        shared = sum(len(p) for p in hit.pages.values())
        n_blocks, disk_pages, disk_bytes = hit.blocks, 0, 0
        if self.disk is None:
            return hit.n_tokens, shared, 0, 0
        chain = cache.prefix.keys(ids, min(limit, ids.numel()) // cache.block_tokens)
        for k in range(n_blocks, len(chain)):
            block = self._read_block(chain[k], held)
            if block is None:
                break
            pages, nbytes = block
            cache.prefix.insert(PrefixBlock(chain[k], chain[k - 1] if k else None, k, pages))
            for src, ps in pages.items():
                for p in ps:
                    cache.groups[src].mark_indexed(p)
            n_blocks, disk_pages, disk_bytes = n_blocks + 1, disk_pages + sum(len(p) for p in pages.values()), disk_bytes + nbytes
        self.stats.disk_pages_read += disk_pages
        self.stats.disk_bytes_read += disk_bytes
        return n_blocks * cache.block_tokens, shared, disk_pages, disk_bytes

    def _read_block(self, chain: bytes, held: dict[int, list[int]]) -> tuple[dict[int, tuple[int, ...]], int] | None:
        """Read one block's pages from disk into fresh pages (held in ``held``); None, with nothing taken, when a page is
        missing or corrupt or the pools have no room."""
        cache = self.cache
        if any(pool.n_free < self._pages_per_block(pool) for pool in cache.groups.values()):
            return None
        taken: dict[int, list[int]] = {}
        nbytes = 0
        for src, pool in cache.groups.items():
            taken[src] = pool.take(self._pages_per_block(pool))
            for key, p in zip(self.disk_keys(chain, src), taken[src], strict=True):
                before = self.disk.stats.bytes_read
                if self.disk.get(key, out=_page_rows(pool, p)) is None:
                    self.stats.disk_misses += 1
                    for s, ps in taken.items():
                        cache.groups[s].release(ps)
                    return None
                nbytes += self.disk.stats.bytes_read - before
        for src, ps in taken.items():
            held[src].extend(ps)
        return {src: tuple(ps) for src, ps in taken.items()}, nbytes

    def _continue(self, ids: torch.Tensor, entry, held: dict[int, list[int]]) -> tuple[int, torch.Tensor]:
        """The pure path: a sequence holding the old turn's blocks (``held``) and partial-block pages, its state put
        back, then the suffix through every layer."""
        cache, meta = self.cache, entry.meta
        n_old = meta["n_tokens"]
        partial = {int(s): n for s, n in meta["partial_pages"].items()}
        for src, pool in cache.groups.items():
            if partial[src] > pool.n_free:
                raise OutOfPages(
                    f"start_turn: group {src} needs {partial[src]} pages for the parked partial block but {pool.n_free} are free;"
                    " free a sequence or add pages"
                )
        seq = cache.add()
        try:
            state = cache.sequence(seq)
            for src, pool in cache.groups.items():
                for p in held[src]:
                    pool.hold(p)
                state.pages[src] = list(held[src]) + pool.take(partial[src])
                for j in range(partial[src]):
                    page = PagePayload(*(entry.tensors[f"page{src}.{j}.{name}"] for name in NAMES))
                    page.copy_into_pool(pool, state.pages[src][len(held[src]) + j])
                state.entries[src] = n_old // pool.ratio
            state.n_tokens = n_old
            ring_state = {k: v for k, v in entry.tensors.items() if not k.startswith("page")}
            restore_sequence_state(cache, seq, ring_state, meta)
            logits = self.model.decode_paged(ids[n_old:].view(1, -1).to(self.model.device), cache, [seq])[0, -1]
        except BaseException:
            cache.free(seq)
            raise
        return seq, logits

    def forget(self, session_id: Hashable) -> None:
        """A finished conversation: drop its parked state (its published pages stay, shared by prefix)."""
        if self.host is not None:
            self.host.discard(session_id)


__all__ = ["PATHS", "SessionCache", "SessionError", "SessionStats", "TurnStart"]
