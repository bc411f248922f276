"""The lightning indexer (spec section 2), the torch reference.

``score[t] = sum_h relu(q[h] . k[t]) * w[h]`` over visible compressed entries; top-k by
score; the candidate pool of layer 20 (blocks of 8 positions); the Reindex mask.

Tie rule (everywhere): among equal scores the lower position (or block id) wins.
"""

from __future__ import annotations

import torch

from model.ops.precision import compute_dtype

NEG_INF = float("-inf")


def visible_entries(query_pos: torch.Tensor, ratio: int, n_entries: int | torch.Tensor) -> torch.Tensor:
    """How many compressed entries each query may see: ``min((pos + 1) // ratio, n_entries)``.

    Args:
        query_pos: int [B, S] absolute positions; n_entries: entries in the cache (int or [B, 1]).
    Returns:
        int64 [B, S].
    """
    vis = torch.div(query_pos.long() + 1, ratio, rounding_mode="floor")
    if isinstance(n_entries, int):
        return vis.clamp(max=n_entries)  # no host-to-device copy (CUDA graph capture)
    return torch.minimum(vis, n_entries.to(vis.device).long())


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor, n_visible: torch.Tensor) -> torch.Tensor:
    """ReLU-weighted multi-head scores.

    Args:
        q: [B, S, Hi, Di] indexer queries (FP4 fake-quantised in the model).
        weights: [B, S, Hi] per-head weights (already scaled by Di^-0.5 * Hi^-0.5).
        index_k: [B, N, Di] dequantised index keys.
        n_visible: int [B, S]; entries j >= n_visible are not visible.
    Returns:
        float32 [B, S, N] (float64 if any input is), -inf where not visible.
    """
    dt = compute_dtype(q, weights, index_k)
    logits = torch.einsum("bshd,bnd->bshn", q.to(dt), index_k.to(dt))  # [B, S, Hi, N]
    scores = torch.einsum("bshn,bsh->bsn", torch.relu(logits), weights.to(dt))
    j = torch.arange(index_k.shape[1], device=q.device)
    return scores.masked_fill(j >= n_visible.unsqueeze(-1), NEG_INF)


def _select_sorted(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Best ``k`` columns above -inf of each row by (score desc, column asc), returned sorted ascending, -1 fill."""
    n = scores.shape[-1]
    take = min(k, n)
    order = torch.sort(scores, dim=-1, descending=True, stable=True)
    chosen = order.indices[..., :take]
    ok = order.values[..., :take] > NEG_INF  # +inf (a forced block) counts, -inf and NaN do not
    chosen = torch.where(ok, chosen, torch.full_like(chosen, n))  # unused slots sort last
    chosen = torch.sort(chosen, dim=-1).values
    chosen = torch.where(chosen == n, torch.full_like(chosen, -1), chosen).to(torch.int32)
    if take < k:
        chosen = torch.cat([chosen, chosen.new_full((*chosen.shape[:-1], k - take), -1)], dim=-1)
    return chosen


def topk_positions(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k visible entries by score, re-sorted by position.

    Args:
        scores: float32 [B, S, N] from :func:`indexer_scores` (-inf = not visible).
    Returns:
        int32 [B, S, k]: ascending positions, then -1 for unused slots.
    """
    return _select_sorted(scores, k)


def candidate_blocks(scores: torch.Tensor, n_visible: torch.Tensor, block: int = 8, max_blocks: int = 2048) -> torch.Tensor:
    """Candidate pool: the best blocks of ``block`` positions by their max score.

    The newest (possibly partial) visible block is always kept.

    Args:
        scores: float32 [B, S, N]; n_visible: int [B, S].
    Returns:
        int32 [B, S, min(max_blocks, ceil(N / block))]: ascending block ids, -1 fill.
    """
    B, S, N = scores.shape
    n_blocks = -(-N // block)
    padded = torch.nn.functional.pad(scores, (0, n_blocks * block - N), value=NEG_INF)
    block_score = padded.view(B, S, n_blocks, block).amax(dim=-1)  # [B, S, n_blocks]
    newest = (n_visible.long() - 1).clamp(min=-1) // block  # -1 when nothing is visible
    ids = torch.arange(n_blocks, device=scores.device)
    is_newest = (ids == newest.unsqueeze(-1)) & (n_visible.unsqueeze(-1) > 0)
    block_score = torch.where(is_newest, torch.full_like(block_score, float("inf")), block_score)
    return _select_sorted(block_score, min(max_blocks, n_blocks))


def pool_mask(blocks: torch.Tensor, n_entries: int, block: int = 8) -> torch.Tensor:
    """Entries inside the candidate pool: blocks int [B, S, P] (-1 fill) -> bool [B, S, n_entries]."""
    n_blocks = -(-n_entries // block)
    ids = blocks.long()
    ids = torch.where(ids >= 0, ids, torch.full_like(ids, n_blocks))  # -1 slots land in a spare column
    hit = torch.zeros(*blocks.shape[:-1], n_blocks + 1, dtype=torch.bool, device=blocks.device)
    hit.scatter_(-1, ids, True)
    return hit[..., :n_blocks].repeat_interleave(block, dim=-1)[..., :n_entries]
