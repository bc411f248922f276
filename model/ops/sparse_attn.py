"""Sparse gather attention with an attention sink (spec section 2), the torch reference.

Every query token attends, in one softmax, to two index lists: its SWA window (indices
into a window KV tensor) and its top-k compressed entries (indices into the group's
global KV). K and V are the same latent (shared-KV MQA). Index -1 is skipped; a repeated
index counts as often as it appears. The sink adds ``exp(sink_h)`` to the denominator and
has no value. A row with no valid index returns zeros.
"""

from __future__ import annotations

import torch

from model.formats import fp4_dequantize, fp8_dequantize
from model.ops.precision import compute_dtype

# Queries per chunk so that the gathered KV [chunk, W + K, D] stays a few hundred MB.
_TOKENS_PER_CHUNK_BUDGET = 64 * 1024 * 1024


def _check_indices(idx: torch.Tensor, n: int, name: str) -> None:
    if idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {idx.dtype}")
    if idx.is_cuda and torch.cuda.is_current_stream_capturing():
        return  # no host reads inside a CUDA graph capture: checked on the eager steps before it
    if idx.numel() and (int(idx.max()) >= n or int(idx.min()) < -1):
        raise IndexError(f"{name} holds values outside [-1, {n}): the cache has {n} entries")


def _batch_index(B: int, values: torch.Tensor, scales: torch.Tensor, name: str, device: torch.device) -> torch.Tensor:
    """int64 [B, 1, 1] batch index into one KV source: each row its own ([B, N, ...]) or all row 0 (a shared pool [1, N, ...])."""
    if values.shape[0] != scales.shape[0] or values.shape[0] not in (1, B):
        raise ValueError(
            f"{name} KV batch must be {B} (per row) or 1 (one shared pool), got {values.shape[0]} and {scales.shape[0]} for values and scales"
        )
    rows = torch.arange(B, device=device) if values.shape[0] == B else torch.zeros(B, dtype=torch.long, device=device)
    return rows[:, None, None]


def sparse_attention(
    q: torch.Tensor,
    window_kv: torch.Tensor,
    window_idx: torch.Tensor,
    main_kv: torch.Tensor,
    topk_idx: torch.Tensor,
    sink: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Attention over gathered window + top-k entries with a per-head sink.

    Args:
        q: [B, S, H, D] queries (any float dtype; math in float32, float64 for float64 q).
        window_kv: [B, Nw, D] dequantised window KV (the SWA ring, or every token's SWA KV in prefill).
        window_idx: int [B, S, W] indices into window_kv, -1 = unused.
        main_kv: [B, Nc, D] dequantised compressed (global) KV.
        topk_idx: int [B, S, K] indices into main_kv, -1 = unused.
        sink: float32 [H] or None (no sink).
        scale: softmax scale (512^-0.5 in the model).
    Returns:
        float32 [B, S, H, D] (float64 for float64 q).
    """
    dt = compute_dtype(q)
    _check_indices(window_idx, window_kv.shape[1], "window_idx")
    _check_indices(topk_idx, main_kv.shape[1], "topk_idx")
    B = q.shape[0]
    kv = torch.cat([window_kv.to(dt), main_kv.to(dt)], dim=1)  # [B, Nw+Nc, D]
    batch = torch.arange(B, device=q.device)[:, None, None]
    nw = window_kv.shape[1]

    def gather(s0: int, s1: int) -> torch.Tensor:
        idx = torch.cat([window_idx[:, s0:s1].long(), topk_idx[:, s0:s1].long() + nw], dim=-1)  # [B, s, W+K]
        return kv[batch, idx.clamp(min=0)]  # [B, s, W+K, D]; -1 slots read row 0, masked below

    return _attend_in_chunks(q, gather, window_idx, topk_idx, sink, scale, dt)


def _attend_in_chunks(q, gather, window_idx, topk_idx, sink, scale, dt) -> torch.Tensor:
    """The softmax over the gathered rows, in chunks of query tokens that keep the gathered KV a few
    hundred MB. ``gather(s0, s1)`` returns the rows of tokens s0..s1: [B, s, W+K, D] in ``dt``."""
    B, S, H, D = q.shape
    valid = torch.cat([window_idx, topk_idx], dim=-1) >= 0  # [B, S, W+K]
    n_sel = valid.shape[-1]
    out = torch.empty(B, S, H, D, dtype=dt, device=q.device)
    chunk = max(1, _TOKENS_PER_CHUNK_BUDGET // max(1, n_sel * D * 4))
    for s0 in range(0, S, chunk):
        s1 = min(S, s0 + chunk)
        # -1 slots read some row: zero it, since 0 * NaN is NaN and a pool's unwritten rows may hold any bytes
        kv_sel = gather(s0, s1).masked_fill(~valid[:, s0:s1, :, None], 0)  # [B, s, W+K, D]
        logits = torch.einsum("bshd,bskd->bshk", q[:, s0:s1].to(dt), kv_sel) * scale  # [B, s, H, W+K]
        logits = logits.masked_fill(~valid[:, s0:s1, None, :], float("-inf"))
        if sink is not None:
            sink_col = sink.to(dt).view(1, 1, H, 1).expand(B, s1 - s0, H, 1)
            logits = torch.cat([logits, sink_col], dim=-1)
        row_max = logits.amax(dim=-1, keepdim=True)
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        p = torch.exp(logits - row_max)
        denom = p.sum(dim=-1, keepdim=True)
        p = p[..., :n_sel] / torch.where(denom > 0, denom, torch.ones_like(denom))
        out[:, s0:s1] = torch.einsum("bshk,bskd->bshd", p, kv_sel)
    return out


def sparse_attention_quantized(
    q: torch.Tensor,
    window_codes: torch.Tensor,
    window_scales: torch.Tensor,
    window_idx: torch.Tensor,
    main_packed: torch.Tensor,
    main_scales: torch.Tensor,
    topk_idx: torch.Tensor,
    sink: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """:func:`sparse_attention` reading the stored formats.

    Gathers the selected rows of the packed caches first and dequantises only those, a chunk of
    tokens at a time: what a careful torch user writes (a decode step at 64K context reads 640 rows
    per token, not the 16K-entry cache). Dequantisation is exact and elementwise, so the result is
    identical to dequantising the whole cache first.

    Each KV source is either per batch row ([B, N, ...]) or one pool shared by every row ([1, N, ...], a
    paged cache: the indices are rows of that pool); the two choose independently.

    Args:
        window_codes: uint8 [B or 1, Nw, D] FP8 E4M3 codes; window_scales: uint8 [B or 1, Nw, D//32] E8M0.
        main_packed: uint8 [B or 1, Nc, D//2] FP4 E2M1; main_scales: uint8 [B or 1, Nc, D//16] E4M3.
        Others as in :func:`sparse_attention`.
    Returns:
        float32 [B, S, H, D].
    """
    dt = compute_dtype(q)
    _check_indices(window_idx, window_codes.shape[1], "window_idx")
    _check_indices(topk_idx, main_packed.shape[1], "topk_idx")
    B, D = q.shape[0], q.shape[-1]
    w_batch = _batch_index(B, window_codes, window_scales, "window", q.device)
    m_batch = _batch_index(B, main_packed, main_scales, "main", q.device)
    nc = main_packed.shape[1]

    def gather(s0: int, s1: int) -> torch.Tensor:
        w_rows = window_idx[:, s0:s1].long().clamp(min=0)  # [B, s, W]; -1 slots read row 0, masked later
        kv_w = fp8_dequantize(window_codes[w_batch, w_rows], window_scales[w_batch, w_rows])  # [B, s, W, D]
        t_rows = topk_idx[:, s0:s1].long().clamp(min=0)  # [B, s, K]
        if nc:
            kv_t = fp4_dequantize(main_packed[m_batch, t_rows], main_scales[m_batch, t_rows], 16, "e4m3")  # [B, s, K, D]
        else:  # SWA-only layer: every top-k slot is -1
            kv_t = torch.zeros(*t_rows.shape, D, device=q.device)
        return torch.cat([kv_w, kv_t], dim=2).to(dt)

    return _attend_in_chunks(q, gather, window_idx, topk_idx, sink, scale, dt)
