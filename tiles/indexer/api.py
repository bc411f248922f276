"""The public functions (``indexer_topk``, ``candidate_pool``, ``reindex_topk``): input checks with clear errors, the
config for the call (explicit, tuned winner, or default), then the launch."""

import torch

from tiles.core.calls import pick_config, tensor_arch
from tiles.core.contract import Config, Shape, TileError
from tiles.indexer.common import GROUP, HEAD_DIM, HEADS
from tiles.indexer.launch import index_k_words, launch_pool, launch_reindex, launch_topk
from tiles.indexer.tile import CANDIDATE_POOL, INDEXER_TOPK, REINDEX_TOPK


def _check(t: torch.Tensor, name: str, shape: tuple, dtypes: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in dtypes:
        raise TileError(f"{name} must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if t.dim() != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape)):
        want = tuple("*" if w is None else w for w in shape)
        raise TileError(f"{name} must have shape {want}, got {tuple(t.shape)}")


def _check_indexer_inputs(q, weights, k_packed, k_scales, n_visible) -> tuple[int, int, int]:
    if q.dim() != 4:
        raise TileError(f"q must be [B, S, {HEADS}, {HEAD_DIM}], got {tuple(q.shape)}")
    B, S = q.shape[:2]
    _check(q, "q", (B, S, HEADS, HEAD_DIM), (torch.bfloat16, torch.float32))
    _check(weights, "weights", (B, S, HEADS), (torch.float32,))
    if k_packed.dim() != 3:
        raise TileError(f"k_packed must be uint8 [B, N, {HEAD_DIM // 2}], got {tuple(k_packed.shape)}")
    N = k_packed.shape[1]
    _check(k_packed, "k_packed", (B, N, HEAD_DIM // 2), (torch.uint8,))
    _check(k_scales, "k_scales", (B, N, HEAD_DIM // GROUP), (torch.uint8,))
    _check(n_visible, "n_visible", (B, S), (torch.int32, torch.int64))
    for name, t in (("weights", weights), ("k_packed", k_packed), ("k_scales", k_scales), ("n_visible", n_visible)):
        if t.device != q.device:
            raise TileError(f"{name} is on {t.device} but q is on {q.device}")
    if N == 0:
        raise TileError("the index cache is empty (N = 0): nothing to score")
    return B, S, N


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_packed: torch.Tensor,
    k_scales: torch.Tensor,
    n_visible: torch.Tensor,
    topk: int,
    return_scores: bool = False,
    config: Config | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Indexer scores over the packed FP4 index K, then the top-k positions.

    Args:
        q: bf16 or fp32 [B, S, 32, 128] indexer queries, FP4 fake-quantised (E8M0 group 32):
            such values are exact in bf16, so fp32 queries are converted to bf16 losslessly.
        weights: fp32 [B, S, 32] per-head weights (already scaled by 128^-0.5 * 32^-0.5).
        k_packed: uint8 [B, N, 64] packed FP4 index K (even element in the low nibble).
        k_scales: uint8 [B, N, 4] E8M0 scale bytes, one per 32 dims. Both are read as int32
            words; a strided view of a larger cache (``buf[:, :n]``) is made contiguous first
            (a copy), so pass contiguous caches on the hot path.
        n_visible: int32/int64 [B, S]; entries j >= n_visible[b, s] are not visible.
        topk: how many positions to keep (512 in v4.1-flash).
        return_scores: also return the scores.
        config: tile parameters (see :class:`IndexerTopkTile`); None = tuned winner or default.
    Returns:
        int32 [B, S, topk]: ascending positions, -1 fill (ties: lower position wins);
        with ``return_scores`` also fp32 [B, S, N] scores, -inf where not visible.
    """
    B, S, N = _check_indexer_inputs(q, weights, k_packed, k_scales, n_visible)
    if topk <= 0:
        raise TileError(f"topk must be positive, got {topk}")
    arch = tensor_arch(q, "indexer_topk")
    shape = Shape("call", "any", {"B": B, "S": S, "N": N, "Hi": HEADS, "Di": HEAD_DIM, "K": topk})
    cfg = pick_config(INDEXER_TOPK, shape, arch, config)
    words, scales = index_k_words(k_packed, k_scales)
    nvis = n_visible.to(torch.int32).contiguous()
    scores = torch.empty(B, S, N, dtype=torch.float32, device=q.device)  # [B, S, N]
    out = torch.empty(B, S, topk, dtype=torch.int32, device=q.device)  # [B, S, K]
    launch_topk(cfg, arch, q, weights, words, scales, nvis, scores, out)
    return (out, scores) if return_scores else out


def candidate_pool(
    scores: torch.Tensor, n_visible: torch.Tensor, block: int = 8, max_blocks: int = 2048, config: Config | None = None
) -> torch.Tensor:
    """The candidate pool of layer 20: the best blocks of ``block`` positions by their max score.

    The newest (possibly partial) visible block is always kept; ties: lower block id wins.
    Equal to :func:`model.ops.indexer.candidate_blocks` on the same scores, exactly.

    Args:
        scores: fp32 [B, S, N] indexer scores, -inf where not visible.
        n_visible: int32/int64 [B, S].
        block: positions per block (8); max_blocks: pool size cap (2048).
    Returns:
        int32 [B, S, min(max_blocks, ceil(N / block))]: ascending block ids, -1 fill.
    """
    if scores.dim() != 3 or scores.dtype != torch.float32:
        raise TileError(f"scores must be float32 [B, S, N], got {scores.dtype} {tuple(scores.shape)}")
    B, S, N = scores.shape
    _check(n_visible, "n_visible", (B, S), (torch.int32, torch.int64))
    if block <= 0 or max_blocks <= 0:
        raise TileError(f"block and max_blocks must be positive, got {block} and {max_blocks}")
    if N == 0:
        raise TileError("scores have no entries (N = 0)")
    arch = tensor_arch(scores, "candidate_pool")
    nb = -(-N // block)
    P = min(max_blocks, nb)
    shape = Shape("call", "decode", {"B": B, "S": S, "N": N, "Hi": HEADS, "Di": HEAD_DIM, "K": 512, "P": max_blocks, "block": block})
    cfg = pick_config(CANDIDATE_POOL, shape, arch, config)
    nvis = n_visible.to(torch.int32).contiguous().view(B * S)
    block_scores = torch.empty(B * S, nb, dtype=torch.float32, device=scores.device)  # [B*S, nb]
    out = torch.empty(B, S, P, dtype=torch.int32, device=scores.device)  # [B, S, P]
    launch_pool(cfg, arch, scores.contiguous().view(B * S, N), nvis, block, block_scores, out)
    return out


def reindex_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_packed: torch.Tensor,
    k_scales: torch.Tensor,
    n_visible: torch.Tensor,
    pool_blocks: torch.Tensor,
    block: int,
    topk: int,
    config: Config | None = None,
    return_scores: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Reindex: indexer scores and top-k only inside the candidate pool.

    The pool's ``block``-entry runs are gathered first (P * block candidates are scored,
    never the whole cache), then the top-k of those candidates is mapped back to cache
    positions. Equal in selection to scoring everything, masking with
    :func:`model.ops.indexer.pool_mask` and :func:`model.ops.indexer.topk_positions`.

    Args:
        q, weights, k_packed, k_scales, n_visible: as :func:`indexer_topk`.
        pool_blocks: int32 [B, S, P] ascending block ids, -1 fill (from :func:`candidate_pool`).
        block: positions per block (8).
        topk: positions to keep (512).
        return_scores: also return the candidates' scores.
    Returns:
        int32 [B, S, topk]: ascending cache positions, -1 fill; with ``return_scores`` also
        fp32 [B, S, P * block] scores of the pool's slots (-inf for unused or invisible slots).
    """
    B, S, N = _check_indexer_inputs(q, weights, k_packed, k_scales, n_visible)
    if pool_blocks.dim() != 3:
        raise TileError(f"pool_blocks must be int32 [B, S, P], got {tuple(pool_blocks.shape)}")
    _check(pool_blocks, "pool_blocks", (B, S, None), (torch.int32,))
    if block <= 0 or topk <= 0:
        raise TileError(f"block and topk must be positive, got {block} and {topk}")
    arch = tensor_arch(q, "reindex_topk")
    P = pool_blocks.shape[-1]
    shape = Shape("call", "decode", {"B": B, "S": S, "N": N, "Hi": HEADS, "Di": HEAD_DIM, "K": topk, "P": P, "block": block})
    cfg = pick_config(REINDEX_TOPK, shape, arch, config)
    words, scales = index_k_words(k_packed, k_scales)
    nvis = n_visible.to(torch.int32).contiguous()
    pool = pool_blocks.contiguous()
    scores = torch.empty(B, S, P * block, dtype=torch.float32, device=q.device)  # [B, S, P*block]
    out = torch.empty(B, S, topk, dtype=torch.int32, device=q.device)  # [B, S, K]
    launch_reindex(cfg, arch, q, weights, words, scales, nvis, pool, block, scores, out)
    return (out, scores) if return_scores else out
