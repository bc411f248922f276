"""Prefix index of a paged KV cache: which published pages hold the global KV of which token prefix.

A prompt is cut into **prefix blocks** of :func:`block_tokens` tokens, the least common multiple of every KV
group's tokens per page (``ratio * page_size``). With ratios 1 and 2 and pages of P entries that is 2P tokens:
one page of each ratio-2 group and two pages of the ratio-1 group. So a prefix of whole blocks

* ends on a page boundary in every group: a hit shares whole pages, never part of one;
* ends on a compression-group boundary (the block is a multiple of every ratio): no unfinished group of the
  prefix waits in a tail, so a sequence that continues after a hit starts its next group from an empty tail.

Block ``k`` is named by a hash chain, ``key_k = blake2b(key_{k-1} || tokens of block k)`` (token ids as int64
little-endian), from a root that names the model config and page size. A key therefore stands for the whole
prefix up to the end of its block: a different token anywhere before changes every key from its block on.

The index holds no pages itself. It maps keys to the page ids a sequence published (:class:`PrefixBlock`);
the page pools keep each page's holder count and keep an indexed page's contents after its last holder frees
it (a free page that still answers hits) until the pool needs the page for something else. Taking such a
page evicts its block and every block after it in the chain (:meth:`PrefixIndex.evict`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from model.config import ModelConfig

KEY_BYTES = 16


def block_tokens(ratios: Sequence[int], page_size: int) -> int:
    """Tokens of one prefix block: lcm over the KV groups of ``ratio * page_size`` (2 * page_size for ratios 1 and 2)."""
    return math.lcm(*(r * page_size for r in ratios))


def chain_root(cfg: ModelConfig, page_size: int) -> bytes:
    """The key before block 0: the preset name, its KV groups and ratios, and the page size (pages of another layout
    never answer a lookup)."""
    groups = ",".join(f"{s}:{cfg.compress_ratios[s]}" for s in sorted(cfg.kv_source_layers))
    text = f"csa2-prefix/{cfg.name}/dim{cfg.dim}/groups{groups}/page{page_size}"
    return hashlib.blake2b(text.encode(), digest_size=KEY_BYTES).digest()


def chain_keys(root: bytes, tokens: torch.Tensor | Sequence[int], n_block_tokens: int, n_blocks: int | None = None) -> list[bytes]:
    """Keys of the whole blocks of ``tokens`` (int [N]), in order; at most ``n_blocks`` of them."""
    ids = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1).cpu()
    n = ids.numel() // n_block_tokens
    if n_blocks is not None:
        n = min(n, n_blocks)
    keys, key = [], root
    for k in range(n):
        block = ids[k * n_block_tokens : (k + 1) * n_block_tokens].numpy().astype("<i8").tobytes()
        key = hashlib.blake2b(key + block, digest_size=KEY_BYTES).digest()
        keys.append(key)
    return keys


@dataclass
class PrefixBlock:
    """One published block: its key, its parent's key (None for block 0), its number, its pages in each group."""

    key: bytes
    parent: bytes | None
    number: int  # the block's tokens are number * block_tokens .. (number + 1) * block_tokens - 1
    pages: dict[int, tuple[int, ...]]  # KV source layer -> the block's page ids, in order
    children: set[bytes] = field(default_factory=set)


@dataclass(frozen=True)
class PrefixHit:
    """What a lookup found: ``n_tokens`` leading tokens are cached in ``blocks`` whole blocks.

    ``pages``: KV source layer -> page ids of the hit, in order (what a new sequence's block table starts with).
    """

    n_tokens: int
    blocks: int
    pages: dict[int, tuple[int, ...]]
    keys: tuple[bytes, ...] = ()


@dataclass
class PrefixStats:
    """Counters of prefix reuse on one cache (they only grow)."""

    lookups: int = 0  # match_prefix / add_with_prefix calls
    hits: int = 0  # lookups that found at least one block
    hit_tokens: int = 0  # tokens served from cached pages, over all hits
    pages_shared: int = 0  # page references taken on pages another holder (or the index) already had
    pages_copied: int = 0  # copy-on-write copies of shared pages before a write
    blocks_published: int = 0
    blocks_evicted: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class PrefixIndex:
    """Key -> :class:`PrefixBlock`, and each indexed page -> its block's key."""

    def __init__(self, root: bytes, n_block_tokens: int) -> None:
        self.root, self.block_tokens = root, n_block_tokens
        self._blocks: dict[bytes, PrefixBlock] = {}
        self._page_key: dict[tuple[int, int], bytes] = {}  # (KV source layer, page id) -> key

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def blocks(self) -> Iterator[PrefixBlock]:
        return iter(self._blocks.values())

    def keys(self, tokens: torch.Tensor | Sequence[int], n_blocks: int | None = None) -> list[bytes]:
        return chain_keys(self.root, tokens, self.block_tokens, n_blocks)

    def lookup(self, keys: Sequence[bytes]) -> list[PrefixBlock]:
        """The indexed blocks of the longest indexed leading run of ``keys``."""
        found = []
        for key in keys:
            block = self._blocks.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def key_of(self, source: int, page: int) -> bytes | None:
        """The key of the block that holds ``page`` of group ``source`` (None when the page is not indexed)."""
        return self._page_key.get((source, page))

    def insert(self, block: PrefixBlock) -> None:
        """Index a block whose parent is indexed (or which is block 0); its pages must not be indexed already."""
        if block.key in self._blocks:
            raise ValueError(f"prefix block {block.key.hex()} is indexed already")
        if block.parent is not None:
            self._blocks[block.parent].children.add(block.key)
        self._blocks[block.key] = block
        for src, pages in block.pages.items():
            for p in pages:
                self._page_key[src, p] = block.key

    def evict(self, key: bytes) -> list[PrefixBlock]:
        """Remove a block and every block after it in its chain (unreachable without it); returns the removed blocks."""
        gone, todo = [], [key]
        while todo:
            block = self._blocks.pop(todo.pop(), None)
            if block is None:
                continue
            gone.append(block)
            todo.extend(block.children)
            for src, pages in block.pages.items():
                for p in pages:
                    del self._page_key[src, p]
        parent = self._blocks.get(gone[0].parent) if gone and gone[0].parent is not None else None
        if parent is not None:
            parent.children.discard(key)
        return gone
