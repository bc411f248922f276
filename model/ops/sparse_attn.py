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
    B, S, H, D = q.shape
    dt = compute_dtype(q)
    _check_indices(window_idx, window_kv.shape[1], "window_idx")
    _check_indices(topk_idx, main_kv.shape[1], "topk_idx")
    idx = torch.cat([window_idx.long(), topk_idx.long() + window_kv.shape[1]], dim=-1)  # [B, S, W+K]
    kv = torch.cat([window_kv.to(dt), main_kv.to(dt)], dim=1)  # [B, Nw+Nc, D]
    valid = torch.cat([window_idx, topk_idx], dim=-1) >= 0  # [B, S, W+K]
    idx = torch.where(valid, idx, torch.zeros_like(idx))
    out = torch.empty(B, S, H, D, dtype=dt, device=q.device)
    n_sel = idx.shape[-1]
    chunk = max(1, _TOKENS_PER_CHUNK_BUDGET // max(1, n_sel * D * 4))
    batch = torch.arange(B, device=q.device)[:, None, None]
    for s0 in range(0, S, chunk):
        s1 = min(S, s0 + chunk)
        kv_sel = kv[batch, idx[:, s0:s1]]  # [B, s, W+K, D]
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

    Args:
        window_codes: uint8 [B, Nw, D] FP8 E4M3 codes; window_scales: uint8 [B, Nw, D//32] E8M0.
        main_packed: uint8 [B, Nc, D//2] FP4 E2M1; main_scales: uint8 [B, Nc, D//16] E4M3.
        Others as in :func:`sparse_attention`.
    Returns:
        float32 [B, S, H, D].
    """
    window_kv = fp8_dequantize(window_codes, window_scales)
    main_kv = fp4_dequantize(main_packed, main_scales, 16, "e4m3")
    return sparse_attention(q, window_kv, window_idx, main_kv, topk_idx, sink, scale)
