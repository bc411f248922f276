"""Parameter-holding building blocks of the CSA2 model: linear, norm, FFN, compressor, indexer.

The attention layer that ties them together lives in :mod:`model.attention`. Weights are
created empty here and filled by :func:`model.init.init_weights` from one seeded generator.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.ops.norm import rms_norm
from model.ops.precision import compute_dtype


class Linear(nn.Module):
    """``y = x @ W^T`` without bias; W [out, in]."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight)

    def forward_wide(self, x: torch.Tensor) -> torch.Tensor:
        """The projection in float32 (float64 for a float64 model) whatever the weight dtype (compressor projections)."""
        dt = compute_dtype(self.weight)
        return F.linear(x.to(dt), self.weight.to(dt))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., dim] -> float32 [..., dim]."""
        return rms_norm(x, self.weight, self.eps)


class SwiGLU(nn.Module):
    """Dense FFN: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, inter: int) -> None:
        super().__init__()
        self.w1, self.w3, self.w2 = Linear(dim, inter), Linear(dim, inter), Linear(inter, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """Small mixture of SwiGLU experts: softmax router, top ``n_active`` renormalised, plus one shared expert.

    A plain loop over experts: the FFN is not what this project accelerates.
    """

    def __init__(self, dim: int, n_experts: int, n_active: int, inter: int) -> None:
        super().__init__()
        self.n_active = n_active
        self.router = Linear(dim, n_experts)
        self.experts = nn.ModuleList(SwiGLU(dim, inter) for _ in range(n_experts))
        self.shared = SwiGLU(dim, inter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [T, dim]
        dt = compute_dtype(self.router.weight)
        probs = torch.softmax(self.router(flat).to(dt), dim=-1)  # [T, E]
        weight, expert = probs.topk(self.n_active, dim=-1)  # [T, A]
        weight = weight / weight.sum(-1, keepdim=True)
        out = self.shared(flat).to(dt)
        for e, ffn in enumerate(self.experts):
            rows, slot = (expert == e).nonzero(as_tuple=True)
            if rows.numel():
                out[rows] += weight[rows, slot, None] * ffn(flat[rows]).to(dt)
        return out.to(x.dtype).reshape(shape)


class Compressor(nn.Module):
    """Full layers only: projections feeding the group's global KV and index K.

    ``kv = Wkv(x)``, ``gate = Wgate(x)`` (ratio 2 only), float32; the latent's RMSNorm weight;
    the index-K projection ``Wk`` (D -> Di) and its norm.
    """

    def __init__(self, dim: int, head_dim: int, index_head_dim: int, ratio: int, eps: float) -> None:
        super().__init__()
        self.ratio = ratio
        self.wkv = Linear(dim, head_dim)
        self.wgate = Linear(dim, head_dim) if ratio > 1 else None
        self.norm = RMSNorm(head_dim, eps)
        self.wk = Linear(head_dim, index_head_dim)
        self.k_norm = RMSNorm(index_head_dim, eps)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [B, S, dim] -> kv, gate float32 (float64 in a float64 model) [B, S, D] (gate None for ratio 1)."""
        return self.wkv.forward_wide(x), self.wgate.forward_wide(x) if self.wgate is not None else None


class Indexer(nn.Module):
    """Full and Reindex layers: the indexer query ``Wq_idx(qr)`` -> [Hi, Di] and head weights ``weights_proj(x)`` -> [Hi]."""

    def __init__(self, dim: int, q_lora_rank: int, n_heads: int, head_dim: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, head_dim
        self.wq = Linear(q_lora_rank, n_heads * head_dim)
        self.weights_proj = Linear(dim, n_heads)

    def forward(self, qr: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """qr [B, S, q_lora], x [B, S, dim] -> q [B, S, Hi, Di] (before RoPE), weights [B, S, Hi]; float32 (float64 in a float64 model)."""
        B, S = x.shape[:2]
        dt = compute_dtype(self.wq.weight)
        q = self.wq(qr).to(dt).view(B, S, self.n_heads, self.head_dim)
        w = self.weights_proj(x).to(dt) * (self.head_dim**-0.5 * self.n_heads**-0.5)
        return q, w
