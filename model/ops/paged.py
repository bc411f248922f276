"""Block tables of a paged KV cache, the torch reference: logical entries -> rows of a group's page pool.

A group's pool stores its entries as flat rows (``pool row = page_id * page_size + offset``). A sequence's
block table lists its page ids in order, so logical entry ``j`` of batch row ``b`` lives at pool row
``block_table[b, j // page_size] * page_size + j % page_size``. Tables are int32 [B, max_pages] with -1
past a row's pages; the logical width of a table is ``max_pages * page_size`` entries.

The indexer ops keep speaking logical positions (their outputs are the contiguous call's); the model turns
the final top-k into pool rows with :func:`pool_rows` before the sparse attention reads the pool.
"""

from __future__ import annotations

import torch


class BlockTableError(ValueError):
    """A block table that points outside its pool, or visible entries past a row's pages."""


def pool_rows(positions: torch.Tensor, block_table: torch.Tensor, page_size: int) -> torch.Tensor:
    """Logical entry positions -> rows of the group's pool.

    No host check here (this runs once per layer and step): the manager builds both tensors, and
    :func:`gather_pages` checks the same table on the indexer's path.

    Args:
        positions: int32 [B, S, K] logical entries (ascending, -1 fill), e.g. the indexer's top-k.
        block_table: int32 [B, max_pages] page ids, -1 past a row's pages.
        page_size: entries per page.
    Returns:
        int32 [B, S, K]: pool rows, -1 where ``positions`` is -1.
    """
    B, S, K = positions.shape
    pos = positions.long()
    valid = pos >= 0
    page_col = torch.where(valid, pos // page_size, torch.zeros_like(pos)).view(B, S * K)
    if block_table.shape[1] == 0:  # no pages yet: every position is -1
        return torch.full_like(positions, -1, dtype=torch.int32)
    pages = block_table.long().gather(1, page_col).view(B, S, K)  # [B, S, K]
    rows = pages * page_size + pos % page_size
    return torch.where(valid, rows, torch.full_like(rows, -1)).to(torch.int32)


def check_block_table(block_table: torch.Tensor, n_rows: int, page_size: int, n_visible: torch.Tensor | None = None) -> None:
    """Host-side checks of a block table against its pool (the reference path only; never inside a CUDA graph).

    Args:
        block_table: int32 [B, max_pages]; n_rows: rows of the pool (a multiple of ``page_size``).
        n_visible: int [B, S] (optional): no visible entry may lie past the row's leading pages.
    Raises:
        BlockTableError: one line naming the bad page id or row.
    """
    if page_size < 1:
        raise BlockTableError(f"page_size must be at least 1 with a block table, got {page_size}")
    if n_rows % page_size:
        raise BlockTableError(f"the pool has {n_rows} rows, not a whole number of pages of {page_size}")
    if block_table.dim() != 2 or block_table.dtype not in (torch.int32, torch.int64):
        raise BlockTableError(f"block_table must be int32 [B, max_pages], got {block_table.dtype} {tuple(block_table.shape)}")
    n_pages = n_rows // page_size
    if block_table.numel() and (int(block_table.max()) >= n_pages or int(block_table.min()) < -1):
        bad = int(block_table.max()) if int(block_table.max()) >= n_pages else int(block_table.min())
        raise BlockTableError(f"block_table holds page {bad}, outside the pool's pages 0..{n_pages - 1} (-1 = no page)")
    if n_visible is not None and n_visible.numel():
        held = block_table >= 0
        leading = held.long().cumprod(dim=1).sum(dim=1) * page_size  # [B] entries of the row's leading pages
        need = n_visible.long().amax(dim=1).to(leading.device)  # [B]
        over = (need > leading).nonzero()
        if over.numel():
            b = int(over[0, 0])
            raise BlockTableError(
                f"batch row {b} sees {int(need[b])} entries but its block table holds {int(leading[b]) // page_size} pages"
                f" of {page_size} ({int(leading[b])} entries)"
            )


def gather_pages(pool: torch.Tensor, block_table: torch.Tensor, page_size: int) -> torch.Tensor:
    """A group's pool read through block tables into the logical (contiguous) layout.

    Args:
        pool: [1, R, W] the group's rows (any dtype), R = n_pages * page_size.
        block_table: int32 [B, max_pages] (-1 past a row's pages).
    Returns:
        [B, max_pages * page_size, W]: entry j of row b is pool row ``block_table[b, j // page_size] * page_size
        + j % page_size``; entries on -1 pages are zeros (never visible).
    """
    if pool.dim() != 3 or pool.shape[0] != 1:
        raise BlockTableError(f"with a block table the pool must be [1, R, W], got {tuple(pool.shape)}")
    B, P = block_table.shape
    pages = block_table.long()  # [B, P]
    rows = (pages.clamp(min=0) * page_size).unsqueeze(-1) + torch.arange(page_size, device=pool.device)  # [B, P, page_size]
    out = pool[0][rows.view(B, P * page_size)]  # [B, P*page_size, W]
    held = (pages >= 0).repeat_interleave(page_size, dim=1)  # [B, P*page_size]
    return out.masked_fill(~held.unsqueeze(-1), 0)
