"""The compressor of Full layers (spec section 2), the torch reference.

Ratio 2: per-channel softmax pooling of ``kv`` over groups of 2 consecutive tokens with
weights from ``gate``; ratio 1: the token itself. Then RMSNorm and RoPE on the last 64
dims at the position of the group's first token (``j * ratio``). The index key is
``rope(k_norm(latent @ Wk^T))``. Quantising into the caches is the caller's step
(:func:`model.formats.fp4_quantize`), so the same latent feeds both paths.
"""

from __future__ import annotations

import torch

from model.ops.norm import rms_norm
from model.ops.precision import compute_dtype
from model.ops.rope import RopeConfig, apply_rope, rope_tables


def compress_groups(kv: torch.Tensor, gate: torch.Tensor | None, ratio: int) -> torch.Tensor:
    """Pool complete groups of ``ratio`` tokens.

    Args:
        kv: [B, G * ratio, D] (float32 in the model).
        gate: [B, G * ratio, D] gate logits, or None when ratio == 1.
        ratio: 1 or 2.
    Returns:
        float32 [B, G, D] (float64 for float64 kv): ``sum_r softmax_r(gate) * kv`` per channel (``kv`` for ratio 1).
    """
    B, N, D = kv.shape
    dt = compute_dtype(kv)
    if N % ratio != 0:
        raise ValueError(f"{N} tokens do not make whole groups of {ratio}")
    if ratio == 1:
        return kv.to(dt)
    if gate is None or gate.shape != kv.shape:
        raise ValueError(f"ratio {ratio} needs a gate of shape {tuple(kv.shape)}")
    g = gate.to(dt).view(B, N // ratio, ratio, D)
    w = torch.softmax(g, dim=2)  # per channel, over the tokens of a group
    return (w * kv.to(dt).view(B, N // ratio, ratio, D)).sum(dim=2)


def compressor_entries(
    kv: torch.Tensor,
    gate: torch.Tensor | None,
    ratio: int,
    norm_weight: torch.Tensor,
    first_group: int,
    rope: RopeConfig,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Latents of complete groups: pool, RMSNorm, RoPE at ``(first_group + g) * ratio``.

    Args:
        kv, gate: [B, G * ratio, D] projections of the tokens of groups first_group..first_group+G-1.
        norm_weight: [D].
    Returns:
        float32 [B, G, D].
    """
    pooled = compress_groups(kv, gate, ratio)
    latent = rms_norm(pooled, norm_weight, eps)
    G = latent.shape[1]
    positions = (torch.arange(G, device=kv.device) + first_group) * ratio
    cos, sin = rope_tables(rope, positions)  # [G, rope_dim/2]
    return apply_rope(latent, cos, sin)


def index_keys(
    latent: torch.Tensor,
    wk: torch.Tensor,
    k_norm_weight: torch.Tensor,
    first_group: int,
    ratio: int,
    rope: RopeConfig,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Indexer keys of compressed entries: ``rope(k_norm(latent @ wk^T))``.

    Args:
        latent: float32 [B, G, D] from :func:`compressor_entries`.
        wk: [Di, D] (128 x 512 in v4.1-flash); k_norm_weight: [Di].
    Returns:
        float32 [B, G, Di].
    """
    dt = compute_dtype(latent)
    k = rms_norm(latent.to(dt) @ wk.to(dt).t(), k_norm_weight, eps)
    positions = (torch.arange(latent.shape[1], device=latent.device) + first_group) * ratio
    cos, sin = rope_tables(rope, positions)
    return apply_rope(k, cos, sin)
