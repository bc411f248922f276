"""RMSNorm."""

from __future__ import annotations

import torch

from model.ops.precision import compute_dtype


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 (float64 for float64 x): x [..., D], weight [D] -> [..., D]."""
    dt = compute_dtype(x)
    xf = x.to(dt)
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(dt)
