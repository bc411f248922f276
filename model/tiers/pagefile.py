"""The stored form of one global KV page: a checked header, then the page's four uint8 tensors back to back.

Layout (little-endian)::

    magic     8 bytes   b"CSA2PAGE"
    version   u16       FORMAT_VERSION
    arrays    u16       4 (main packed, main scales, index packed, index scales)
    key_len   u32       bytes of the key
    key       key_len   the page key's bytes (bytes.fromhex): a file copied under another key is caught
    shapes    arrays x (u32 rows, u32 cols)
    length    u64       payload bytes (the sum of rows * cols)
    digest    32 bytes  blake2b-256 over everything above and the payload
    payload   length    the tensors' bytes in the order above, row-major

A file is accepted only whole: right magic and version, sizes that add up to the file's length exactly, and the
digest. Anything else (a torn write, a flipped bit, garbage, another key's page) is :class:`CorruptPage`.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Protocol

import torch

MAGIC = b"CSA2PAGE"
FORMAT_VERSION = 1
NAMES = ("main_packed", "main_scales", "index_packed", "index_scales")
_HEAD = struct.Struct("<8sHHI")
_SHAPE = struct.Struct("<II")
_LENGTH = struct.Struct("<Q")
DIGEST_BYTES = 32


class CorruptPage(ValueError):
    """Stored bytes that are not one whole, intact page of the expected key."""


class PageRows(Protocol):
    """What a page pool offers (:class:`model.paged.PagePool`): four flat uint8 row tensors and the page size."""

    page_size: int
    main_packed: torch.Tensor
    main_scales: torch.Tensor
    index_packed: torch.Tensor
    index_scales: torch.Tensor


@dataclass(frozen=True)
class PagePayload:
    """One page of one KV group, four uint8 tensors of ``page_size`` rows each:

    main_packed [P, D/2] (E2M1 pairs), main_scales [P, D/16] (E4M3), index_packed [P, Di/2] (E2M1 pairs),
    index_scales [P, Di/32] (E8M0), P = page_size.
    """

    main_packed: torch.Tensor
    main_scales: torch.Tensor
    index_packed: torch.Tensor
    index_scales: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.main_packed, self.main_scales, self.index_packed, self.index_scales

    @property
    def shapes(self) -> tuple[tuple[int, int], ...]:
        return tuple(tuple(t.shape) for t in self.tensors())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.tensors())

    def equal(self, other: PagePayload) -> bool:
        """Bit-exact equality of all four tensors."""
        return all(a.shape == b.shape and torch.equal(a.cpu(), b.cpu()) for a, b in zip(self.tensors(), other.tensors(), strict=True))

    @classmethod
    def from_pool(cls, pool: PageRows, page_id: int) -> PagePayload:
        """CPU copies of page ``page_id``'s rows of a page pool (rows ``page_id * P .. page_id * P + P - 1``)."""
        rows = slice(page_id * pool.page_size, (page_id + 1) * pool.page_size)
        return cls(*(getattr(pool, n)[rows].to("cpu", copy=True) for n in NAMES))

    def copy_into_pool(self, pool: PageRows, page_id: int) -> None:
        """Write this page into page ``page_id``'s rows of a page pool (on the pool's device)."""
        rows = slice(page_id * pool.page_size, (page_id + 1) * pool.page_size)
        for n, t in zip(NAMES, self.tensors(), strict=True):
            getattr(pool, n)[rows].copy_(t)


def _check_payload(page: PagePayload) -> None:
    for n, t in zip(NAMES, page.tensors(), strict=True):
        if t.dtype != torch.uint8 or t.dim() != 2:
            raise ValueError(f"page tensor {n} must be uint8 [page_size, width], got {t.dtype} {list(t.shape)}")
    rows = {t.shape[0] for t in page.tensors()}
    if len(rows) != 1:
        raise ValueError(f"page tensors must have the same number of rows (page_size), got shapes {page.shapes}")


def encode_page(key: str, page: PagePayload) -> bytes:
    """The stored bytes of ``page`` under ``key`` (a hex page key); raises ValueError for tensors of the wrong kind."""
    _check_payload(page)
    key_bytes = bytes.fromhex(key)
    payload = b"".join(t.detach().to("cpu").contiguous().numpy().tobytes() for t in page.tensors())
    head = _HEAD.pack(MAGIC, FORMAT_VERSION, len(NAMES), len(key_bytes)) + key_bytes
    head += b"".join(_SHAPE.pack(*s) for s in page.shapes) + _LENGTH.pack(len(payload))
    digest = hashlib.blake2b(head, digest_size=DIGEST_BYTES)
    digest.update(payload)
    return head + digest.digest() + payload


def decode_page(key: str, data: bytes | bytearray) -> PagePayload:
    """The page stored in ``data`` under ``key``: four contiguous CPU uint8 tensors (views of one buffer).

    Raises :class:`CorruptPage` unless ``data`` is one whole, intact page of ``key``.
    """
    view = memoryview(data)
    if len(view) < _HEAD.size:
        raise CorruptPage(f"{len(view)} bytes: shorter than the header")
    magic, version, arrays, key_len = _HEAD.unpack_from(view)
    if magic != MAGIC:
        raise CorruptPage("bad magic")
    if version != FORMAT_VERSION or arrays != len(NAMES):
        raise CorruptPage(f"format version {version} with {arrays} arrays; this reader knows version {FORMAT_VERSION}")
    at = _HEAD.size
    head_len = at + key_len + len(NAMES) * _SHAPE.size + _LENGTH.size
    if len(view) < head_len + DIGEST_BYTES:
        raise CorruptPage(f"{len(view)} bytes: shorter than the header")
    if bytes(view[at : at + key_len]) != bytes.fromhex(key):
        raise CorruptPage("stored under another key")
    at += key_len
    shapes = [_SHAPE.unpack_from(view, at + i * _SHAPE.size) for i in range(len(NAMES))]
    at += len(NAMES) * _SHAPE.size
    (length,) = _LENGTH.unpack_from(view, at)
    if length != sum(r * c for r, c in shapes) or len(view) != head_len + DIGEST_BYTES + length:
        raise CorruptPage(f"{len(view)} bytes, header says {head_len + DIGEST_BYTES + length} (shapes {shapes}): torn or padded")
    digest = hashlib.blake2b(view[:head_len], digest_size=DIGEST_BYTES)
    payload = view[head_len + DIGEST_BYTES :]
    digest.update(payload)
    if digest.digest() != bytes(view[head_len : head_len + DIGEST_BYTES]):
        raise CorruptPage("checksum mismatch")
    buf = bytearray(payload)  # writable, so the tensors can be handed out without a warning or a second copy
    out, off = [], 0
    for r, c in shapes:
        out.append(
            torch.frombuffer(buf, dtype=torch.uint8, count=r * c, offset=off).view(r, c) if r * c else torch.empty(r, c, dtype=torch.uint8)
        )
        off += r * c
    return PagePayload(*out)
