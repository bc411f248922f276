"""Kernels on a paged cache: the attention reading one shared pool per cache (batch stride 0, rows named by the
indices) and the indexer's score kernels reading the index K through a block table.

CPU: the paged score kernel keeps the contiguous one's TMA producer (one copy per page of a tile), the shared-pool
attention kernel reads rows without a batch offset, the test pools hold each sequence's entries where its table says,
and bad paged inputs are one-line errors. GPU (marked): each paged shape against the torch reference (poisoned
outputs, two runs bitwise equal), and the paged kernels bitwise equal to the contiguous kernels on the same entries.
"""

import re

import pytest
import torch

from tiles import indexer as ix
from tiles import sparse_attn as attn
from tiles.core.arch import get_arch
from tiles.core.contract import Shape, TileError
from tiles.core.harness import OK, evaluate
from tiles.indexer import launch as ix_launch
from tiles.indexer import reference as ix_reference
from tiles.indexer import score_kernel as ix_score_kernel
from tiles.sparse_attn.tile import _into_pools, make_attention_inputs

SM90 = get_arch("sm90")
IDX = {"Hi": 32, "Di": 128, "K": 512}
ATT = {"H": 64, "D": 512, "W": 128, "K": 512}


def _paged(tile):
    return next(s for s in tile.shapes() if s.name.endswith("_paged"))


# ---------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize(("page", "copies"), [(64, 4), (128, 2), (256, 1), (512, 1)])
def test_paged_score_kernel_keeps_the_tma_producer(page, copies):
    """The Hopper default's 256-entry tiles on 64-entry pages: four TMA copies a tile, each from the page the CTA's
    copy of the block table names, in the warp-specialised producer; the contiguous kernel's one copy otherwise."""
    cfg = ix.INDEXER_TOPK.with_defaults(SM90, {})
    assert cfg["block_n"] == 256
    src = ix_launch.build_score(SM90, cfg, False, 8, 64, 131072, page).get_kernel_source()
    assert "warpgroup_reg_dealloc" in src and "block_table" in src
    assert len(re.findall(r"tl::tma_load\(k_words_desc", src)) == copies
    assert "pages_s" in src
    contiguous = ix_launch.build_score(SM90, cfg, False, 8, 64, 131072).get_kernel_source()
    assert len(re.findall(r"tl::tma_load\(k_words_desc", contiguous)) == 1 and "pages_s" not in contiguous


def test_paged_reindex_reads_rows_through_the_table():
    cfg = ix.REINDEX_TOPK.with_defaults(SM90, {})
    src = ix_launch.build_score(SM90, cfg, True, 8, 64, 16384, 64).get_kernel_source()
    assert "block_table[" in src
    plain = ix_launch.build_score(SM90, cfg, True, 8, 64, 16384).get_kernel_source()
    assert "block_table[" not in plain


@pytest.mark.parametrize("page", [48, 16, -64])
def test_score_kernel_refuses_pages_that_do_not_tile(page):
    with pytest.raises(ValueError, match="page"):
        ix_score_kernel.build_score_kernel(SM90.nvcc_arch, 256, 128, 1, 4, "prmt_rs", False, 8, 2, "fused", "skip", page)


def test_page_constraint_prunes_configs():
    shape = Shape("p", "decode", {"B": 4, "S": 1, "N": 4096, "page": 32, **IDX})
    space = ix.INDEXER_TOPK.search_space(SM90)
    assert not space.violations(ix.INDEXER_TOPK.with_defaults(SM90, {"block_n": 256}), shape, SM90)
    small_pages = Shape("p", "decode", {**shape.dims, "page": 16})
    reasons = space.violations(ix.INDEXER_TOPK.with_defaults(SM90, {"block_n": 256}), small_pages, SM90)
    assert any("pages" in r for r in reasons)


def _kv_reads(src: str, name: str) -> list[str]:
    return [line for line in src.splitlines() if f"({name} +" in line or f"= {name}[" in line]


def test_shared_pool_attention_reads_rows_without_a_batch_offset():
    """The same kernel body; a pool's reads drop the batch term (blockIdx.y) from the address, a per-row cache's keep it."""
    shape = _paged(attn.DECODE_TILE)
    cfg = attn.DECODE_TILE.default_config(SM90)
    pooled = attn.DECODE_TILE.build(shape, cfg, SM90)
    plain = attn.DECODE_TILE.build(attn.DECODE_TILE.shape("decode_b64_s1"), cfg, SM90)
    assert pooled.shared == (True, True) and plain.shared == (False, False)
    for name in ("MainA", "WinA"):
        pooled_reads, plain_reads = _kv_reads(pooled.main.get_kernel_source(), name), _kv_reads(plain.main.get_kernel_source(), name)
        assert pooled_reads and plain_reads
        assert not any("blockIdx.y" in r for r in pooled_reads), name
        assert all("blockIdx.y" in r for r in plain_reads), name


def test_test_pools_hold_each_sequence_where_its_table_says():
    """The pools the GPU checks run on: every logical entry read back through the table (or the pool rows) is the
    contiguous cache's; a page past a row's visible entries is -1."""
    g = torch.Generator().manual_seed(0)
    inputs = ix_reference.indexer_inputs(3, 2, 1024, 0, "cpu", causal=False)
    ix_reference.into_page_pool(inputs, 64, g)
    table, pool = inputs["block_table"], inputs["k_packed"][0]
    assert table.shape == (3, 16) and inputs["k_packed"].shape[0] == 1
    for b in range(3):
        visible = int(inputs["n_visible"][b].max())
        for j in range(visible):
            page = int(table[b, j // 64])
            assert torch.equal(pool[page * 64 + j % 64], inputs["k_packed_logical"][b, j])
        assert all(int(table[b, p]) == -1 for p in range(16) if p * 64 >= visible)
    shape = Shape("odd", "decode", {"B": 3, "S": 1, "Nc": 1000, "Nw": 128, "pool": 1, **ATT})
    att = make_attention_inputs(Shape("odd", "decode", {k: v for k, v in shape.dims.items() if k != "pool"}), 0, "cpu")
    pooled = dict(att)
    _into_pools(pooled, "fp4", torch.Generator().manual_seed(1))
    for key, idx in (("main_packed", "topk_idx"), ("window_codes", "window_idx")):
        rows = pooled[idx].long()
        got = pooled[key][0][rows.clamp(min=0)]  # [B, S, K, ...]
        want = torch.stack([att[key][b][att[idx][b].long().clamp(min=0)] for b in range(3)])
        assert torch.equal(got[rows >= 0], want[rows >= 0]) and torch.equal(rows < 0, att[idx] < 0)


def _indexer_args(B=2, S=1, N=256):
    inputs = ix_reference.indexer_inputs(B, S, N, 0, "cpu", causal=False)
    ix_reference.into_page_pool(inputs, 64, torch.Generator().manual_seed(0))
    return inputs


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"page_size": 48}, "page_size must be one of"),
        ({"block_table": "wrong_shape"}, r"block_table must be int32 \[B=2, pages\]"),
        ({"block_table": "int64"}, "block_table must be torch.int32"),
        ({"k_packed": "batched"}, r"k_packed must have shape \(1, "),
        ({"block_table": None}, "page_size=64 needs a block_table"),
        ({"k_packed": "ragged"}, "not a whole number of 64-entry pages"),
    ],
    ids=["page_size", "table_shape", "table_dtype", "pool_not_shared", "page_without_table", "ragged_pool"],
)
def test_bad_paged_indexer_input_is_one_line(change, message):
    i = _indexer_args()
    kw = {"block_table": i["block_table"], "page_size": 64}
    k_packed, k_scales = i["k_packed"], i["k_scales"]
    if change.get("block_table") == "wrong_shape":
        kw["block_table"] = i["block_table"][:1]
    elif change.get("block_table") == "int64":
        kw["block_table"] = i["block_table"].long()
    elif "block_table" in change:
        kw["block_table"] = None
    if change.get("k_packed") == "batched":
        k_packed, k_scales = k_packed.expand(2, -1, -1).contiguous(), k_scales.expand(2, -1, -1).contiguous()
    elif change.get("k_packed") == "ragged":
        k_packed, k_scales = k_packed[:, :-1].contiguous(), k_scales[:, :-1].contiguous()
    if "page_size" in change:
        kw["page_size"] = change["page_size"]
    with pytest.raises(TileError, match=message) as err:
        ix.indexer_topk(i["q"], i["weights"], k_packed, k_scales, i["n_visible"], 512, **kw)
    assert "\n" not in str(err.value)


def test_attention_pool_batch_must_be_one_or_b():
    inputs = make_attention_inputs(Shape("t", "decode", {"B": 4, "S": 1, "Nc": 1024, "Nw": 128, **ATT}), 0, "cpu")
    args = [inputs[k] for k in ("q", "window_codes", "window_scales", "window_idx", "main_packed", "main_scales", "topk_idx", "sink")]
    args[4], args[5] = args[4][:2].contiguous(), args[5][:2].contiguous()
    with pytest.raises(TileError, match=r"main_packed must hold 4 batch rows \(one per sequence\) or 1"):
        attn.sparse_attention(*args)


# ---------------------------------------------------------------------------------- GPU


def _odd_paged_shapes():
    return [
        (attn.DECODE_TILE, Shape("odd_b3_paged", "decode", {"B": 3, "S": 1, "Nc": 1000, "Nw": 128, "pool": 1, **ATT})),
        (ix.INDEXER_TOPK, Shape("odd_b3_s2_paged", "decode", {"B": 3, "S": 2, "N": 1024, "page": 64, **IDX})),
        (ix.INDEXER_TOPK, Shape("odd_b2_p256_paged", "decode", {"B": 2, "S": 1, "N": 4096, "page": 256, **IDX})),
        (ix.REINDEX_TOPK, Shape("odd_b3_paged", "decode", {"B": 3, "S": 2, "N": 4096, "P": 2048, "block": 8, "page": 64, **IDX})),
    ]


PAGED_CASES = [(t, _paged(t)) for t in (attn.DECODE_TILE, ix.INDEXER_TOPK, ix.REINDEX_TOPK)] + _odd_paged_shapes()


@pytest.mark.gpu
@pytest.mark.parametrize(("tile", "shape"), PAGED_CASES, ids=[f"{t.name}-{s.name}" for t, s in PAGED_CASES])
def test_paged_tile_matches_reference(tile, shape):
    ev = evaluate(tile, shape, tile.default_config(SM90), SM90, seed=5, time_it=False)
    assert ev.outcome == OK, f"{shape.name}: {ev.message}"


@pytest.mark.gpu
def test_paged_indexer_equals_contiguous_bitwise():
    """The same entries read through a block table score bit for bit as from the contiguous cache (same config)."""
    tile = ix.INDEXER_TOPK
    shape = Shape("b4_paged", "decode", {"B": 4, "S": 1, "N": 8192, "page": 64, **IDX})
    inputs = tile.make_inputs(shape, 11, "cuda")
    common = (inputs["q"], inputs["weights"])
    paged_topk, paged = ix.indexer_topk(
        *common, inputs["k_packed"], inputs["k_scales"], inputs["n_visible"], 512, True, block_table=inputs["block_table"], page_size=64
    )
    flat_topk, flat = ix.indexer_topk(*common, inputs["k_packed_logical"], inputs["k_scales_logical"], inputs["n_visible"], 512, True)
    assert torch.equal(paged, flat) and torch.equal(paged_topk, flat_topk)


@pytest.mark.gpu
def test_paged_attention_equals_per_row_caches_bitwise():
    tile = attn.DECODE_TILE
    shape = Shape("b8_paged", "decode", {"B": 8, "S": 1, "Nc": 4096, "Nw": 128, "pool": 1, **ATT})
    inputs = tile.make_inputs(shape, 13, "cuda")
    flat = make_attention_inputs(Shape("b8", "decode", {k: v for k, v in shape.dims.items() if k != "pool"}), 13, "cuda")
    cfg = tile.default_config(SM90)
    keys = ("q", "window_codes", "window_scales", "window_idx", "main_packed", "main_scales", "topk_idx", "sink")
    out_paged = attn.sparse_attention(*(inputs[k] for k in keys), config=cfg, check_indices=True)
    out_flat = attn.sparse_attention(*(flat[k] for k in keys), config=cfg)
    assert torch.equal(out_paged, out_flat)
