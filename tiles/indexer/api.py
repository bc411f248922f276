"""The public functions (``indexer_topk``, ``candidate_pool``, ``reindex_topk``): input checks with clear errors, the
config for the call (explicit, tuned winner, or default: :func:`tiles.core.dispatch.call_config`), then the launch.

Each function builds its launch (checks, config, kernels, constant buffers) on the first call of a signature (its
tensors' shapes, dtypes, devices and layouts, and its scalar arguments) and keeps it (:func:`tiles.core.dispatch.plan`);
later calls of that signature allocate their outputs and launch."""

import torch

from tiles.core.contract import Config, TileError
from tiles.core.dispatch import call_config, frozen, plan, signature, target
from tiles.indexer.common import GROUP, HEAD_DIM, HEADS
from tiles.indexer.launch import PoolLaunch, ReindexLaunch, TopkLaunch, index_k_words
from tiles.indexer.tile import CANDIDATE_POOL, INDEXER_TOPK, REINDEX_TOPK


def _check(t: torch.Tensor, name: str, shape: tuple, dtypes: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in dtypes:
        raise TileError(f"{name} must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if t.dim() != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape)):
        want = tuple("*" if w is None else w for w in shape)
        raise TileError(f"{name} must have shape {want}, got {tuple(t.shape)}")


PAGE_SIZES = (32, 64, 128, 256, 512, 1024)  # the score kernel copies a tile in whole pages, or a page in whole tiles


def _check_indexer_inputs(q, weights, k_packed, k_scales, n_visible, block_table=None, page_size: int = 0) -> tuple[int, int, int]:
    """(B, S, N), N the logical entries of a row: the cache's N, or the block table's width times ``page_size``."""
    if q.dim() != 4:
        raise TileError(f"q must be [B, S, {HEADS}, {HEAD_DIM}], got {tuple(q.shape)}")
    B, S = q.shape[:2]
    _check(q, "q", (B, S, HEADS, HEAD_DIM), (torch.bfloat16, torch.float32))
    _check(weights, "weights", (B, S, HEADS), (torch.float32,))
    paged = block_table is not None
    if page_size and not paged:
        raise TileError(f"page_size={page_size} needs a block_table")
    if k_packed.dim() != 3:
        raise TileError(f"k_packed must be uint8 [{'1' if paged else 'B'}, N, {HEAD_DIM // 2}], got {tuple(k_packed.shape)}")
    N = k_packed.shape[1]
    rows = 1 if paged else B
    _check(k_packed, "k_packed", (rows, N, HEAD_DIM // 2), (torch.uint8,))
    _check(k_scales, "k_scales", (rows, N, HEAD_DIM // GROUP), (torch.uint8,))
    _check(n_visible, "n_visible", (B, S), (torch.int32, torch.int64))
    for name, t in (("weights", weights), ("k_packed", k_packed), ("k_scales", k_scales), ("n_visible", n_visible)):
        if t.device != q.device:
            raise TileError(f"{name} is on {t.device} but q is on {q.device}")
    if paged:
        if page_size not in PAGE_SIZES:
            raise TileError(f"page_size must be one of {PAGE_SIZES} with a block table, got {page_size}")
        if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2 or block_table.shape[0] != B or block_table.shape[1] == 0:
            raise TileError(f"block_table must be int32 [B={B}, pages], got {tuple(getattr(block_table, 'shape', ()))}")
        _check(block_table, "block_table", (B, None), (torch.int32,))
        if block_table.device != q.device or not block_table.is_contiguous():
            raise TileError(f"block_table must be a contiguous tensor on {q.device}")
        if N % page_size:
            raise TileError(f"the index pool holds {N} rows, not a whole number of {page_size}-entry pages")
        N = block_table.shape[1] * page_size
    if N == 0:
        raise TileError("the index cache is empty (N = 0): nothing to score")
    return B, S, N


def _check_block_table(block_table: torch.Tensor, pool_rows: int, page_size: int) -> None:
    """Every page id of the table in [-1, pages of the pool) (one host sync)."""
    pages = pool_rows // page_size
    lo, hi = torch.stack([block_table.min(), block_table.max()]).tolist()
    if lo < -1 or hi >= pages:
        raise TileError(f"block_table holds page ids outside [-1, {pages}): the index pool has {pages} pages of {page_size}")


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_packed: torch.Tensor,
    k_scales: torch.Tensor,
    n_visible: torch.Tensor,
    topk: int,
    return_scores: bool = False,
    config: Config | None = None,
    *,
    block_table: torch.Tensor | None = None,
    page_size: int = 0,
    check_indices: bool = False,
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
        block_table: int32 [B, MP], a paged cache: k_packed / k_scales are then the pool, uint8 [1, R, 64] /
            [1, R, 4] (R a whole number of pages), and logical entry j of row b is pool row
            ``block_table[b, j // page_size] * page_size + j % page_size``; N = MP * page_size. Entries past a
            sequence's pages (-1 in its table) must lie past its n_visible.
        page_size: entries per page (one of PAGE_SIZES), with ``block_table``.
        check_indices: with ``block_table``, reject page ids outside the pool (one host sync).
    Returns:
        int32 [B, S, topk]: ascending positions, -1 fill (ties: lower position wins); logical positions with a block table;
        with ``return_scores`` also fp32 [B, S, N] scores, -inf where not visible.
    """
    tensors = (q, weights, k_packed, k_scales, n_visible, block_table)
    launch = _cached(
        ("indexer_topk", topk, frozen(config), page_size),
        tensors,
        lambda: _topk_launch(q, weights, k_packed, k_scales, n_visible, topk, config, block_table, page_size),
    )
    if check_indices and block_table is not None:
        _check_block_table(block_table, k_packed.shape[1], page_size)
    B, S = q.shape[0], q.shape[1]
    N = k_packed.shape[1] if block_table is None else block_table.shape[1] * page_size
    words, scales = index_k_words(k_packed, k_scales)
    nvis = n_visible.to(torch.int32).contiguous()
    scores = torch.empty(B, S, N, dtype=torch.float32, device=q.device)  # [B, S, N]
    out = torch.empty(B, S, topk, dtype=torch.int32, device=q.device)  # [B, S, K]
    launch(q, weights, words, scales, nvis, scores, out, block_table)
    return (out, scores) if return_scores else out


def _cached(key: tuple, tensors: tuple, build):
    """The launch kept for ``key`` and the tensors' signature, built (every check included) on its first call."""
    try:
        key = (*key, signature(*tensors))
    except (AttributeError, TypeError):  # not tensors, or an unhashable config: the checks say what is wrong
        return build()
    return plan(key, build)


def _paged_dims(page_size: int) -> dict[str, int]:
    """The config dims a paged call adds: its page size (paged shapes keep winners of their own)."""
    return {"page": page_size} if page_size else {}


def _topk_launch(q, weights, k_packed, k_scales, n_visible, topk: int, config: Config | None, block_table, page_size: int) -> TopkLaunch:
    B, S, N = _check_indexer_inputs(q, weights, k_packed, k_scales, n_visible, block_table, page_size)
    if topk <= 0:
        raise TileError(f"topk must be positive, got {topk}")
    arch, gpu = target(q, "indexer_topk")
    dims = {"B": B, "S": S, "N": N, "Hi": HEADS, "Di": HEAD_DIM, "K": topk, **_paged_dims(page_size)}
    cfg = call_config(INDEXER_TOPK, dims, arch, gpu, config)
    return TopkLaunch(cfg, arch, B, S, N, topk, q.device, page_size)


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
    launch = _cached(
        ("candidate_pool", block, max_blocks, frozen(config)),
        (scores, n_visible),
        lambda: _pool_launch(scores, n_visible, block, max_blocks, config),
    )
    B, S, N = scores.shape
    nb = -(-N // block)
    nvis = n_visible.to(torch.int32).contiguous().view(B * S)
    block_scores = torch.empty(B * S, nb, dtype=torch.float32, device=scores.device)  # [B*S, nb]
    out = torch.empty(B, S, min(max_blocks, nb), dtype=torch.int32, device=scores.device)  # [B, S, P]
    launch(scores.contiguous().view(B * S, N), nvis, block_scores, out)
    return out


def _pool_launch(scores, n_visible, block: int, max_blocks: int, config: Config | None) -> PoolLaunch:
    if not isinstance(scores, torch.Tensor) or scores.dim() != 3 or scores.dtype != torch.float32:
        raise TileError(
            f"scores must be float32 [B, S, N], got {getattr(scores, 'dtype', type(scores).__name__)} {tuple(getattr(scores, 'shape', ()))}"
        )
    B, S, N = scores.shape
    _check(n_visible, "n_visible", (B, S), (torch.int32, torch.int64))
    if block <= 0 or max_blocks <= 0:
        raise TileError(f"block and max_blocks must be positive, got {block} and {max_blocks}")
    if N == 0:
        raise TileError("scores have no entries (N = 0)")
    if n_visible.device != scores.device:
        raise TileError(f"n_visible is on {n_visible.device} but scores are on {scores.device}")
    arch, gpu = target(scores, "candidate_pool")
    nb = -(-N // block)
    dims = {"B": B, "S": S, "N": N, "Hi": HEADS, "Di": HEAD_DIM, "K": 512, "P": max_blocks, "block": block}
    cfg = call_config(CANDIDATE_POOL, dims, arch, gpu, config, "decode")
    return PoolLaunch(cfg, arch, B * S, nb, min(max_blocks, nb), block, scores.device)


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
    *,
    block_table: torch.Tensor | None = None,
    page_size: int = 0,
    check_indices: bool = False,
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
        block_table, page_size, check_indices: a paged cache, as :func:`indexer_topk` (pool blocks and the
            positions returned are logical).
    Returns:
        int32 [B, S, topk]: ascending cache positions, -1 fill; with ``return_scores`` also
        fp32 [B, S, P * block] scores of the pool's slots (-inf for unused or invisible slots).
    """
    tensors = (q, weights, k_packed, k_scales, n_visible, pool_blocks, block_table)
    launch = _cached(
        ("reindex_topk", block, topk, frozen(config), page_size),
        tensors,
        lambda: _reindex_launch(q, weights, k_packed, k_scales, n_visible, pool_blocks, block, topk, config, block_table, page_size),
    )
    if check_indices and block_table is not None:
        _check_block_table(block_table, k_packed.shape[1], page_size)
    B, S, P = pool_blocks.shape
    words, scales = index_k_words(k_packed, k_scales)
    nvis = n_visible.to(torch.int32).contiguous()
    scores = torch.empty(B, S, P * block, dtype=torch.float32, device=q.device)  # [B, S, P*block]
    out = torch.empty(B, S, topk, dtype=torch.int32, device=q.device)  # [B, S, K]
    launch(q, weights, words, scales, nvis, pool_blocks.contiguous(), scores, out, block_table)
    return (out, scores) if return_scores else out


def _reindex_launch(
    q, weights, k_packed, k_scales, n_visible, pool_blocks, block: int, topk: int, config: Config | None, block_table, page_size: int
) -> ReindexLaunch:
    B, S, N = _check_indexer_inputs(q, weights, k_packed, k_scales, n_visible, block_table, page_size)
    if not isinstance(pool_blocks, torch.Tensor) or pool_blocks.dim() != 3:
        raise TileError(f"pool_blocks must be int32 [B, S, P], got {tuple(getattr(pool_blocks, 'shape', ()))}")
    _check(pool_blocks, "pool_blocks", (B, S, None), (torch.int32,))
    if pool_blocks.device != q.device:
        raise TileError(f"pool_blocks is on {pool_blocks.device} but q is on {q.device}")
    if block <= 0 or topk <= 0:
        raise TileError(f"block and topk must be positive, got {block} and {topk}")
    arch, gpu = target(q, "reindex_topk")
    P = pool_blocks.shape[-1]
    dims = {"B": B, "S": S, "N": N, "Hi": HEADS, "Di": HEAD_DIM, "K": topk, "P": P, "block": block, **_paged_dims(page_size)}
    cfg = call_config(REINDEX_TOPK, dims, arch, gpu, config, "decode")
    return ReindexLaunch(cfg, arch, B, S, P * block, topk, block, q.device, page_size)
