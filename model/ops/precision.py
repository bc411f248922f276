"""The dtype reference ops compute in: float32, or float64 when any input is float64.

float64 lets a float64 model run the whole reference in double precision, so that decode
and forward (different batch shapes, hence different GEMM reduction orders) do not flip
FP8/FP4 codes or near-tied top-k choices through last-bit noise. Lower-precision inputs
(bf16, fp16, fp32) compute in float32, the kernels' contract.
"""

from __future__ import annotations

import torch


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float64 if any given tensor is float64, else float32."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32
