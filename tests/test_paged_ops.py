"""The backend seam on paged caches (TorchBackend + model.ops.paged): block tables in the indexer ops, shared pools in
sparse_attention, pool_rows. Every paged call must return bitwise what the contiguous call returns on the same logical
data; the pool rows no table points at hold random bytes, so a wrong row read shows."""

from __future__ import annotations

import pytest
import torch

from model.backend import TorchBackend
from model.formats import fp4_quantize, fp8_quantize
from model.ops.paged import BlockTableError, check_block_table, gather_pages, pool_rows

BACKEND = TorchBackend()


def _paged(logical: list[torch.Tensor], lengths: list[int], page_size: int, n_pages: int, seed: int):
    """Scatter the first ``lengths[b]`` entries of each [B, N, w] tensor into a pool of shuffled pages, other rows random.

    Returns (pools [1, R, w] each, block_table int32 [B, max_pages])."""
    g = torch.Generator().manual_seed(seed)
    B = logical[0].shape[0]
    need = [-(-n // page_size) for n in lengths]
    order = torch.randperm(n_pages, generator=g).tolist()
    table = torch.full((B, max(need)), -1, dtype=torch.int32)
    taken = 0
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor(order[taken : taken + n], dtype=torch.int32)
        taken += n
    pools = []
    for t in logical:
        pool = torch.randint(0, 256, (1, n_pages * page_size, t.shape[-1]), dtype=torch.uint8, generator=g)
        for b, n in enumerate(lengths):
            j = torch.arange(n)
            pool[0, table[b, j // page_size].long() * page_size + j % page_size] = t[b, :n]
        pools.append(pool)
    return pools, table


def _index_inputs(B=3, S=2, Hi=4, Di=64, N=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    q_packed, q_scales = fp4_quantize(torch.randn(B, S, Hi, Di, generator=g), 32, "e8m0")
    weights = torch.rand(B, S, Hi, generator=g)
    k_packed, k_scales = fp4_quantize(torch.randn(B, N, Di, generator=g), 32, "e8m0")
    return q_packed, q_scales, weights, k_packed, k_scales


@pytest.mark.parametrize("page_size", [1, 4, 16, 64], ids=lambda p: f"page{p}")
def test_indexer_ops_through_block_tables_equal_the_contiguous_call(page_size):
    lengths = [37, 5, 0]  # a long row, a short one, an empty one
    q_packed, q_scales, weights, k_packed, k_scales = _index_inputs()
    (pool_p, pool_s), table = _paged([k_packed, k_scales], lengths, page_size, n_pages=-(-42 // page_size) + 3, seed=page_size)
    width = table.shape[1] * page_size
    # the contiguous oracle on the same logical entries, padded to the table's logical width with zeros
    pad = max(0, width - k_packed.shape[1])
    logical_p = torch.nn.functional.pad(k_packed, (0, 0, 0, pad))[:, :width]
    logical_s = torch.nn.functional.pad(k_scales, (0, 0, 0, pad))[:, :width]
    n_visible = torch.tensor([[36, 37], [4, 5], [0, 0]])
    paging = {"block_table": table, "page_size": page_size}
    contiguous = (q_packed, q_scales, weights, logical_p, logical_s, n_visible)
    paged = (q_packed, q_scales, weights, pool_p, pool_s, n_visible)
    want = BACKEND.indexer_topk(*contiguous, 6)
    assert torch.equal(BACKEND.indexer_topk(*paged, 6, **paging), want)
    assert (want[0] >= 0).all() and (want[2] == -1).all()
    blocks = BACKEND.candidate_pool(*contiguous, 4, 3)
    assert torch.equal(BACKEND.candidate_pool(*paged, 4, 3, **paging), blocks)
    assert torch.equal(BACKEND.reindex_topk(*paged, blocks, 4, 6, **paging), BACKEND.reindex_topk(*contiguous, blocks, 4, 6))


def test_pool_rows():
    table = torch.tensor([[5, 2, -1], [0, -1, -1]], dtype=torch.int32)
    pos = torch.tensor([[[0, 3, 4, 7, -1]], [[1, 2, 3, -1, -1]]], dtype=torch.int32)  # [B=2, S=1, K=5], page size 4
    assert pool_rows(pos, table, 4).tolist() == [[[20, 23, 8, 11, -1]], [[1, 2, 3, -1, -1]]]
    assert pool_rows(pos, table, 4).dtype == torch.int32
    empty = torch.full((2, 1, 3), -1, dtype=torch.int32)
    assert pool_rows(empty, torch.empty(2, 0, dtype=torch.int32), 4).tolist() == empty.tolist()


def _attn_inputs(B=3, S=2, H=4, D=64, W=6, K=5, Nw=9, Nc=13, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, H, D, generator=g)
    wc, ws = fp8_quantize(torch.randn(B, Nw, D, generator=g))
    mp, ms = fp4_quantize(torch.randn(B, Nc, D, generator=g), 16, "e4m3")
    wi = torch.randint(-1, Nw, (B, S, W), generator=g, dtype=torch.int32)
    ti = torch.randint(-1, Nc, (B, S, K), generator=g, dtype=torch.int32)
    sink = torch.randn(H, generator=g) * 0.1
    return q, wc, ws, wi, mp, ms, ti, sink


@pytest.mark.parametrize("shared", ["window", "main", "both"])
def test_sparse_attention_reads_shared_pools_like_per_row_tensors(shared):
    q, wc, ws, wi, mp, ms, ti, sink = _attn_inputs()
    B, scale = q.shape[0], q.shape[-1] ** -0.5
    want = BACKEND.sparse_attention(q, wc, ws, wi, mp, ms, ti, sink, scale)
    if shared in ("window", "both"):
        (wc, ws), table = _paged([wc, ws], [wc.shape[1]] * B, 3, n_pages=12, seed=1)
        wi = pool_rows(wi, table, 3)
    if shared in ("main", "both"):
        (mp, ms), table = _paged([mp, ms], [mp.shape[1]] * B, 4, n_pages=14, seed=2)
        ti = pool_rows(ti, table, 4)
    got = BACKEND.sparse_attention(q, wc, ws, wi, mp, ms, ti, sink, scale)
    assert torch.equal(got, want)


def test_masked_slots_never_read_a_poisoned_row():
    """-1 slots must not bring a NaN-coded row (an E4M3 0x7F scale, an FP8 NaN code) into the sum."""
    q, wc, ws, wi, mp, ms, ti, sink = _attn_inputs()
    wc, ws, mp, ms = wc.clone(), ws.clone(), mp.clone(), ms.clone()
    wi, ti = wi.clone(), ti.clone()
    wi[wi == 0], ti[ti == 0] = -1, -1  # nobody reads row 0 ...
    want = BACKEND.sparse_attention(q, wc, ws, wi, mp, ms, ti, sink, 0.125)
    wc[:, 0], ms[:, 0] = 0x7F, 0x7F  # ... so NaN bytes there change nothing
    got = BACKEND.sparse_attention(q, wc, ws, wi, mp, ms, ti, sink, 0.125)
    assert torch.isfinite(got).all() and torch.equal(got, want)


def test_shared_pool_batch_must_be_one_or_b():
    q, wc, ws, wi, mp, ms, ti, sink = _attn_inputs()
    with pytest.raises(ValueError, match="main KV batch must be 3 .per row. or 1"):
        BACKEND.sparse_attention(q, wc, ws, wi, mp[:2], ms[:2], ti, sink, 0.125)


# -- bad block tables: one-line errors ----------------------------------------------------------------


def test_bad_block_tables_are_rejected():
    q_packed, q_scales, weights, k_packed, k_scales = _index_inputs(N=8)
    pool_p, pool_s = k_packed[:1], k_scales[:1]  # [1, 8, ...]: two pages of 4
    n_visible = torch.tensor([[4, 4], [8, 8], [1, 1]])
    args = (q_packed, q_scales, weights, pool_p, pool_s, n_visible, 4)
    with pytest.raises(BlockTableError, match=r"block_table holds page 2, outside the pool's pages 0..1"):
        BACKEND.indexer_topk(*args, block_table=torch.tensor([[0, -1], [1, 2], [0, -1]], dtype=torch.int32), page_size=4)
    with pytest.raises(BlockTableError, match=r"batch row 1 sees 8 entries but its block table holds 1 pages of 4 \(4 entries\)"):
        BACKEND.indexer_topk(*args, block_table=torch.tensor([[0, -1], [1, -1], [0, -1]], dtype=torch.int32), page_size=4)
    with pytest.raises(BlockTableError, match="not a whole number of pages of 3"):
        check_block_table(torch.zeros(1, 1, dtype=torch.int32), 8, 3)
    with pytest.raises(BlockTableError, match=r"must be \[1, R, W\]"):
        gather_pages(k_packed, torch.zeros(3, 1, dtype=torch.int32), 4)


def test_one_compressor_call_for_groups_of_several_sequences_equals_a_call_each():
    """The paged decode's compressor call: the completed groups of several sequences end to end in one row, each at its
    own entry index (an int64 [G] first_group), give each sequence's entries as one call per sequence does."""
    from model.ops.rope import RopeConfig

    g = torch.Generator().manual_seed(4)
    D, Di, ratio = 64, 32, 2
    rope = RopeConfig(rope_dim=16, theta=10000.0)
    weights = (torch.rand(D, generator=g, dtype=torch.float64) + 0.5, torch.randn(Di, D, generator=g, dtype=torch.float64) / 8)
    k_norm = torch.rand(Di, generator=g, dtype=torch.float64) + 0.5
    groups, starts = [1, 3, 2], [7, 0, 40]  # completed groups per sequence, and each one's first entry index
    kv = [torch.randn(1, n * ratio, D, generator=g, dtype=torch.float64) for n in groups]
    gate = [torch.randn(1, n * ratio, D, generator=g, dtype=torch.float64) for n in groups]
    args = (weights[0], weights[1], k_norm, rope, 1e-20)
    each = [BACKEND.compressor(kv[i], gate[i], ratio, starts[i], *args) for i in range(3)]
    first = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, groups, strict=True)])
    joint = BACKEND.compressor(torch.cat(kv, 1), torch.cat(gate, 1), ratio, first, *args)
    at = 0
    for i, n in enumerate(groups):
        for got, want in zip(joint, each[i], strict=True):
            assert torch.equal(got[:, at : at + n], want)
        at += n
    with pytest.raises(ValueError, match="one entry index per group"):
        BACKEND.compressor(torch.cat(kv, 1), torch.cat(gate, 1), ratio, first[:-1], *args)
