"""Partial rotary embedding (the last ``rope_dim`` dims of a head), with YaRN.

Pairs are interleaved (dims 2i, 2i+1 of the rope part rotate together), as in the
DeepSeek reference code. The inverse rotation (used on the attention output) is the same
rotation with ``-sin``.

A deliberate difference from the official V4.1 code: the angle ``position * freq`` is taken in
float64 (from the float32 frequency) and cos/sin rounded to float32 once; the official
``precompute_freqs_cis`` forms the product in float32, whose rounding grows with the position
(about 4e-3 rad at position 65,536 for the fastest pair).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from model.ops.precision import compute_dtype


@dataclass(frozen=True)
class RopeConfig:
    """Frequencies of one rotary embedding.

    ``yarn_factor`` > 1 turns on YaRN with DeepSeek's ramp between ``beta_fast`` and
    ``beta_slow`` rotations over ``original_seq_len``.
    """

    rope_dim: int = 64
    theta: float = 10000.0
    yarn_factor: float = 1.0
    original_seq_len: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    def inv_freq(self) -> torch.Tensor:
        """float32 [rope_dim // 2]: the angle per position of each pair."""
        dim = self.rope_dim
        freqs = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        if self.yarn_factor > 1.0:
            low, high = self._correction_range()
            ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
            smooth = 1.0 - ramp
            freqs = freqs / self.yarn_factor * (1.0 - smooth) + freqs * smooth
        return freqs.float()

    def _correction_range(self) -> tuple[float, float]:
        def dim_for(rotations: float) -> float:
            return self.rope_dim * math.log(self.original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(self.theta))

        low = max(math.floor(dim_for(self.beta_fast)), 0)
        high = min(math.ceil(dim_for(self.beta_slow)), self.rope_dim - 1)
        return float(low), float(high) + (0.001 if low == high else 0.0)


@functools.lru_cache(maxsize=64)
def _inv_freq_on(cfg: RopeConfig, device: torch.device) -> torch.Tensor:
    """float64 [rope_dim // 2] on ``device``, made once: a host-to-device copy per call would
    also make decode steps impossible to capture in a CUDA graph."""
    return cfg.inv_freq().to(device, torch.float64)


def rope_tables(cfg: RopeConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin float32 [*positions.shape, rope_dim // 2] for integer positions."""
    angles = positions.to(torch.float64).unsqueeze(-1) * _inv_freq_on(cfg, positions.device)
    return torch.cos(angles).float(), torch.sin(angles).float()


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Rotate the last ``2 * cos.shape[-1]`` dims of x.

    Args:
        x: [..., D] float; the rope part is x[..., D - rope_dim:].
        cos, sin: float32 broadcastable to [..., rope_dim // 2] (from :func:`rope_tables`;
            insert a head axis with ``unsqueeze(-2)`` for [B, S, H, D] inputs).
        inverse: rotate by minus the angle (undoes a forward rotation).
        out_dtype: the result's dtype; None is float32 (float64 for float64 x).
    Returns:
        [..., D] in ``out_dtype``: exactly the float32 (float64) rotation rounded to ``out_dtype``
        once; the first D - rope_dim dims are x's, converted.
    """
    rope_dim = 2 * cos.shape[-1]
    dt = compute_dtype(x)
    rot = x[..., -rope_dim:].to(dt)
    even, odd = rot[..., 0::2], rot[..., 1::2]
    s = -sin if inverse else sin
    out_even = even * cos - odd * s
    out_odd = even * s + odd * cos
    rotated = torch.stack([out_even, out_odd], dim=-1).flatten(-2)
    # Only the rope dims are computed wide: a [64K, 64, 512] query widened whole to fp32 and concatenated back
    # moved ~47 GB per call in the 64K prefill (H200, 3e4ac1f) for 64 rotated dims.
    out = x.to(out_dtype or dt, copy=True)
    out[..., -rope_dim:] = rotated
    return out
