"""Content keys of global KV pages: sha256 over the model, the KV group and the token history the page ends."""

from __future__ import annotations

import hashlib
import re

_KEY = re.compile(r"[0-9a-f]{16,128}")
_DOMAIN = b"csa2-lab/kv-page/1\0"  # a different purpose never yields the same digest from the same inputs


def page_key(model: str, source: int, chain: bytes) -> str:
    """The key of one page of one KV group: lowercase sha256 hex (64 characters).

    Args:
        model: the model's identity: whatever makes two caches byte-compatible (preset, weights digest, page size,
            cache formats). Pages of models with different identities never share a key.
        source: the KV source layer whose group the page belongs to.
        chain: a chain hash of the token blocks up to and including this page (the caller's choice of hash, as bytes);
            the page's content is a function of exactly that history.
    """
    if not isinstance(chain, bytes | bytearray | memoryview):
        raise TypeError(f"page_key: chain must be bytes (a digest of the token blocks), got {type(chain).__name__}")
    if source < 0:
        raise ValueError(f"page_key: source must be a KV source layer >= 0, got {source}")
    name = model.encode()
    h = hashlib.sha256(_DOMAIN)
    # Length prefixes keep the fields apart: ("ab", 1, b"c") and ("a", 1, b"bc") hash differently.
    h.update(len(name).to_bytes(8, "little") + name)
    h.update(source.to_bytes(8, "little"))
    h.update(len(chain).to_bytes(8, "little") + bytes(chain))
    return h.hexdigest()


def check_key(key: str) -> str:
    """``key`` when it is 16 to 128 lowercase hex digits (it names a file); raises ValueError otherwise."""
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise ValueError(f"a page key is 16 to 128 lowercase hex digits (see page_key), got {key!r}")
    return key
