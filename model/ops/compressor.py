"""The compressor of Full layers (spec section 2), the torch reference.

Ratio 2: per-channel softmax pooling of ``kv`` over groups of 2 consecutive tokens with
weights from ``gate``; ratio 1: the token itself. Then RMSNorm: the **pre-RoPE latent**. Two
things are made from it, both rotated on their last 64 dims at the position of the group's
first token (``j * ratio``):

* the main KV entry ``rope(latent)``;
* the index key ``rope(k_norm(latent @ Wk^T))``, projected from the *unrotated* latent, as
  the official V4.1 inference code does ("the indexer needs the unrotated form").

Quantising into the caches is the caller's step (:func:`model.formats.fp4_quantize`).
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


def compressor_latents(kv: torch.Tensor, gate: torch.Tensor | None, ratio: int, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Latents of complete groups, **before RoPE**: ``RMSNorm(pool(kv, gate))``.

    The index keys are projected from this unrotated form (:func:`index_keys`); the main KV entry is
    its rotation (:func:`main_entries`). The official V4.1 compressor returns the same pre-RoPE latent
    and rotates it only after the indexer has read it.

    Args:
        kv, gate: [B, G * ratio, D] projections of the groups' tokens, in order (gate None for ratio 1).
        norm_weight: [D].
    Returns:
        float32 [B, G, D] (float64 for float64 kv).
    """
    return rms_norm(compress_groups(kv, gate, ratio), norm_weight, eps)


def group_positions(first_group: int | torch.Tensor, n_groups: int, ratio: int, device: torch.device) -> torch.Tensor:
    """int64 [G] first token position of each group: ``(first_group + g) * ratio`` for consecutive entries of one
    sequence, or ``first_group[g] * ratio`` for an int [G] tensor naming each group's own entry index (the groups of
    several sequences compressed in one call: entries are independent of each other)."""
    if isinstance(first_group, torch.Tensor):
        if first_group.shape != (n_groups,):
            raise ValueError(
                f"first_group as a tensor names one entry index per group: shape ({n_groups},), got {tuple(first_group.shape)}"
            )
        return first_group.to(device=device, dtype=torch.long) * ratio
    return (torch.arange(n_groups, device=device) + first_group) * ratio


def group_rope(x: torch.Tensor, first_group: int | torch.Tensor, ratio: int, rope: RopeConfig) -> torch.Tensor:
    """RoPE on the last ``rope_dim`` dims of entry ``g`` at its group's first position (:func:`group_positions`).

    Args:
        x: [B, G, N] one row per compressed entry.
    Returns:
        float32 [B, G, N] (float64 for float64 x).
    """
    cos, sin = rope_tables(rope, group_positions(first_group, x.shape[1], ratio, x.device))  # [G, rope_dim/2]
    return apply_rope(x, cos, sin)


def main_entries(latent: torch.Tensor, first_group: int | torch.Tensor, ratio: int, rope: RopeConfig) -> torch.Tensor:
    """Main KV entries (before FP4): the pre-RoPE latent rotated at each group's first position.

    Args:
        latent: [B, G, D] from :func:`compressor_latents`.
    Returns:
        float32 [B, G, D].
    """
    return group_rope(latent, first_group, ratio, rope)


def index_keys(
    latent: torch.Tensor,
    wk: torch.Tensor,
    k_norm_weight: torch.Tensor,
    first_group: int | torch.Tensor,
    ratio: int,
    rope: RopeConfig,
    eps: float,
) -> torch.Tensor:
    """Indexer keys of compressed entries: ``rope(k_norm(latent @ wk^T))``, projected from the latent **before RoPE**.

    Args:
        latent: float32 [B, G, D] from :func:`compressor_latents` (unrotated: the rotated main entry would
            give other keys, and other top-k rows).
        wk: [Di, D] (128 x 512 in v4.1-flash); k_norm_weight: [Di].
    Returns:
        float32 [B, G, Di], RoPE'd on the last ``rope_dim`` dims at the group's first position.
    """
    dt = compute_dtype(latent)
    k = rms_norm(latent.to(dt) @ wk.to(dt).t(), k_norm_weight, eps)
    return group_rope(k, first_group, ratio, rope)
