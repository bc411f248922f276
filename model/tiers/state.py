"""A paged cache sequence's state slot as named CPU tensors and metadata: what :class:`HostStatePool` parks.

The state slot is what depends on the current position: every layer's SWA ring (with the positions it holds) and each
ratio > 1 source's unfinished-group tail (with its count). Pages and the token count are not part of it: the global KV
pages come back through prefix reuse or the disk tier.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from model.paged import PagedKVCache


def sequence_state(cache: PagedKVCache, seq_id: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A live sequence's state slot (views of the cache's rows; :meth:`HostStatePool.put` copies them).

    Returns:
        tensors: ``ring{l}.codes`` uint8 [W, D] (E4M3) and ``ring{l}.scales`` uint8 [W, D/32] (E8M0) for every layer
            ``l``, row ``pos % W``; ``tail{src}.kv`` and ``tail{src}.gate`` [c, D] (the tails' dtype) for every
            ratio > 1 source, its ``c`` pending rows.
        meta: ``n_tokens`` (int), ``window`` (W), ``rings`` (per layer ``[start, end)`` positions held) and ``tail``
            (source -> pending count).
    """
    seq = cache.sequence(seq_id, "sequence_state")
    W = cache.state.window
    rows = slice(seq.slot * W, (seq.slot + 1) * W)
    tensors: dict[str, torch.Tensor] = {}
    for layer, (codes, scales) in enumerate(zip(cache.state.ring_codes, cache.state.ring_scales, strict=True)):
        tensors[f"ring{layer}.codes"], tensors[f"ring{layer}.scales"] = codes[rows], scales[rows]
    for src in cache.state.tail_kv:
        kv, gate = cache.tail(seq_id, src)  # [1, c, D]
        tensors[f"tail{src}.kv"], tensors[f"tail{src}.gate"] = kv[0], gate[0]
    meta = {"n_tokens": seq.n_tokens, "window": W, "rings": [list(r) for r in seq.rings], "tail": dict(seq.tail)}
    return tensors, meta


def restore_sequence_state(cache: PagedKVCache, seq_id: int, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
    """Write a state from :func:`sequence_state` into a live sequence's slot (rings, ring positions, tails, counts).

    The sequence's pages and token count are the caller's to restore. Raises ValueError, before writing anything, when
    the state belongs to a cache of another shape (window, layers, tail sources or widths).
    """
    seq = cache.sequence(seq_id, "restore_sequence_state")
    W, n_layers = cache.state.window, len(cache.state.ring_codes)
    expect = {f"ring{i}.{part}" for i in range(n_layers) for part in ("codes", "scales")}
    expect |= {f"tail{src}.{part}" for src in cache.state.tail_kv for part in ("kv", "gate")}
    if meta.get("window") != W or len(meta.get("rings", ())) != n_layers or set(tensors) != expect:
        raise ValueError(
            f"restore_sequence_state: the state is of another cache (window {meta.get('window')}, {len(meta.get('rings', ()))} rings,"
            f" tensors {sorted(tensors)}); this cache has window {W}, {n_layers} layers and tails of sources {sorted(cache.state.tail_kv)}"
        )
    for layer in range(n_layers):
        for name, pool in (("codes", cache.state.ring_codes[layer]), ("scales", cache.state.ring_scales[layer])):
            if tensors[f"ring{layer}.{name}"].shape != (W, pool.shape[1]):
                raise ValueError(
                    f"restore_sequence_state: ring{layer}.{name} is {list(tensors[f'ring{layer}.{name}'].shape)}, want [{W}, {pool.shape[1]}]"
                )
    for src, pool in cache.state.tail_kv.items():  # a tail holds the pending tokens of one unfinished group
        for part in ("kv", "gate"):
            t = tensors[f"tail{src}.{part}"]
            if t.dim() != 2 or t.shape[0] > pool.shape[1] or t.shape[1] != pool.shape[2]:
                raise ValueError(f"restore_sequence_state: tail{src}.{part} is {list(t.shape)}, want [<= {pool.shape[1]}, {pool.shape[2]}]")
    rows = slice(seq.slot * W, (seq.slot + 1) * W)
    for layer in range(n_layers):
        cache.state.ring_codes[layer][rows].copy_(tensors[f"ring{layer}.codes"])
        cache.state.ring_scales[layer][rows].copy_(tensors[f"ring{layer}.scales"])
        seq.rings[layer] = list(meta["rings"][layer])
    for src in cache.state.tail_kv:
        kv, gate = tensors[f"tail{src}.kv"], tensors[f"tail{src}.gate"]
        cache.store_tail(
            seq_id, src, kv.unsqueeze(0).to(cache.state.tail_kv[src].dtype), gate.unsqueeze(0).to(cache.state.tail_gate[src].dtype)
        )
