"""Host-memory pool of idle sequences' SWA state: minutes of reuse, then bounded replay rebuilds it.

A sequence's state slot (every layer's SWA ring, each compressor's unfinished-group tail, the ring positions and tail
counts) is worth keeping only while its session is active: a user's next turn usually comes within minutes. Parking it
in host DRAM frees the HBM slot; after the TTL it is cheaper to replay the last ``window`` tokens than to keep it, so
it is never written to disk.

Entries are CPU copies, kept under a key (the session id) with their last use. Expired entries are misses; puts that
would exceed the byte budget drop expired entries first, then the least recently used.
"""

from __future__ import annotations

import copy
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from model.tiers.stats import TierStats

DEFAULT_TTL_S = 600.0


@dataclass
class HostEntry:
    """One parked sequence state: CPU tensors by name, small metadata (positions, counts) and bookkeeping."""

    tensors: dict[str, torch.Tensor]  # contiguous CPU copies, e.g. "ring3.codes" uint8 [W, D]
    meta: dict[str, Any]  # e.g. {"n_tokens": 900, "rings": [[772, 900], ...], "tail": {2: 1}}
    nbytes: int
    last_use: float


def state_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """Bytes of a state's tensors (what the pool's budget counts; metadata is not counted)."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


class HostStatePool:
    """Sequence states in host memory under a TTL and a byte budget (thread-safe).

    Args:
        max_bytes: the budget of all entries' tensor bytes (e.g. a tenth of the host's DRAM).
        ttl_s: an entry whose last use is longer ago than this is gone (10 minutes by default).
        clock: monotonic seconds (``time.monotonic``); tests pass a fake one.
    """

    def __init__(self, max_bytes: int, *, ttl_s: float = DEFAULT_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        if max_bytes < 0 or ttl_s <= 0:
            raise ValueError(f"max_bytes must be >= 0 and ttl_s > 0, got {max_bytes}, {ttl_s}")
        self.max_bytes, self.ttl_s, self.clock = max_bytes, ttl_s, clock
        self.stats = TierStats()
        self._entries: OrderedDict[Hashable, HostEntry] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Tensor bytes held now (expired entries included until the next put, get or sweep)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        """Whether a live (unexpired) entry is held; does not count as a use."""
        with self._lock:
            e = self._entries.get(key)
            return e is not None and not self._expired(e, self.clock())

    def keys(self) -> list[Hashable]:
        """Keys held, least recently used first (expired ones included until a sweep)."""
        with self._lock:
            return list(self._entries)

    def put(self, key: Hashable, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any] | None = None) -> bool:
        """Park a state under ``key`` (replacing what was there); True when it was stored.

        The tensors are copied to contiguous CPU tensors (any device and layout in), ``meta`` is deep-copied. A state
        larger than the whole budget is not stored (and the key's old state is dropped: it is stale).
        """
        stored = {name: t.detach().to("cpu", memory_format=torch.contiguous_format, copy=True) for name, t in tensors.items()}
        size = state_bytes(stored)
        entry_meta = copy.deepcopy(dict(meta or {}))
        with self._lock:
            now = self.clock()
            self._drop(key)
            if size > self.max_bytes:
                self.stats.skipped += 1
                return False
            self._sweep(now)
            while self._bytes + size > self.max_bytes:
                self._drop(next(iter(self._entries)))
                self.stats.evictions += 1
            self._entries[key] = HostEntry(stored, entry_meta, size, now)
            self._bytes += size
            self.stats.writes += 1
            self.stats.bytes_written += size
            return True

    def get(self, key: Hashable) -> HostEntry | None:
        """The live state under ``key`` (marked used), or None. Its tensors are the pool's: copy them, don't write them."""
        with self._lock:
            e = self._take(key, self.clock())
            if e is None:
                return None
            self._entries.move_to_end(key)
            return e

    def pop(self, key: Hashable) -> HostEntry | None:
        """Remove and return the live state under ``key`` (a sequence resuming takes its state back), or None."""
        with self._lock:
            e = self._take(key, self.clock())
            if e is not None:
                self._drop(key)
            return e

    def discard(self, key: Hashable) -> bool:
        """Forget ``key``'s state (a finished session); True when one was held."""
        with self._lock:
            return self._drop(key) is not None

    def sweep(self) -> int:
        """Drop every expired entry; returns how many."""
        with self._lock:
            return self._sweep(self.clock())

    # -- under the lock --------------------------------------------------------------------------

    def _expired(self, e: HostEntry, now: float) -> bool:
        return now - e.last_use > self.ttl_s

    def _take(self, key: Hashable, now: float) -> HostEntry | None:
        """A live entry, marked used now and counted as a hit; a miss (expired ones dropped) otherwise."""
        e = self._entries.get(key)
        if e is not None and self._expired(e, now):
            self._drop(key)
            self.stats.expired += 1
            e = None
        if e is None:
            self.stats.misses += 1
            return None
        e.last_use = now
        self.stats.hits += 1
        self.stats.bytes_read += e.nbytes
        return e

    def _drop(self, key: Hashable) -> HostEntry | None:
        e = self._entries.pop(key, None)
        if e is not None:
            self._bytes -= e.nbytes
        return e

    def _sweep(self, now: float) -> int:
        # Last uses only grow along the LRU order, so the expired entries are a prefix of it.
        n = 0
        while self._entries:
            key, e = next(iter(self._entries.items()))
            if not self._expired(e, now):
                break
            self._drop(key)
            n += 1
        self.stats.expired += n
        return n
