"""The model's ``tiles`` backend: the accelerated ops of :mod:`model.backend` on TileLang kernels.

``build_model(..., backend="tiles")`` loads :class:`TilesBackend`. It subclasses the torch
backend, so an op without a kernel (the FP8 SWA quantiser, which is a few microseconds of
elementwise work) and any shape a kernel does not serve (the attention kernels are built for
the v4.1-flash head layout: H a multiple of 64, D = 512) run the reference. Every fallback is
counted in :attr:`TilesBackend.fallbacks` with its reason, so a benchmark can say what ran.

``configs="tuned"`` lets each kernel pick its stored winner for the GPU and shape (the
default config when none is stored); ``configs="default"`` forces every tile's default config,
the baseline that tuning is measured against.
"""

from __future__ import annotations

from collections import Counter

import torch

from model.backend import INDEX_GROUP, INDEX_SCALE, TorchBackend
from model.ops.compressor import group_positions
from model.ops.rope import RopeConfig, rope_tables
from tiles import compressor as compressor_tiles
from tiles import fp4 as fp4_tiles
from tiles import indexer as indexer_tiles
from tiles import sparse_attn as attn_tiles
from tiles.core.arch import Arch, detect
from tiles.core.contract import Tile, TileError

CONFIG_MODES = ("tuned", "default")


def widen_cache_view(view: torch.Tensor) -> torch.Tensor:
    """The whole cache buffer behind a view ``buf[:, :n]`` ([B, n, row] -> [B, capacity, row]), without a copy.

    The model hands the filled part of a growing cache; the kernels want a contiguous
    [B, N, row] tensor, and copying 64 sequences x 64K entries per call would cost more than the
    kernel. Rows past ``n`` are never addressed: index lists and visibility stop at ``n``.
    A view that is not such a slice is made contiguous instead.
    """
    if view.is_contiguous():
        return view
    B, n, row = view.shape
    sb, sn, sr = view.stride()
    if sr != 1 or sn != row or sb % row:
        return view.contiguous()
    capacity = sb // row
    needed = (view.storage_offset() + B * sb) * view.element_size()
    if capacity < n or needed > view.untyped_storage().nbytes():
        return view.contiguous()
    return view.as_strided((B, capacity, row), (sb, sn, sr))


class TilesBackend(TorchBackend):
    """TileLang kernels behind the model's backend seam (same methods and shapes as :class:`TorchBackend`)."""

    name = "tiles"

    def __init__(self, device: torch.device | str | None = None, configs: str = "tuned") -> None:
        super().__init__(device)
        if configs not in CONFIG_MODES:
            raise ValueError(f"configs must be one of {CONFIG_MODES}, got {configs!r}")
        if not torch.cuda.is_available() or (device is not None and torch.device(device).type != "cuda"):
            raise TileError(
                "the tiles backend runs TileLang kernels on a CUDA GPU: build the model with device='cuda', or use backend='torch'"
            )
        self.configs = configs
        self.arch: Arch = detect()
        self.fallbacks: Counter[str] = Counter()

    def _config(self, tile: Tile) -> dict | None:
        """None lets the kernel wrapper pick the tuned winner; the default config otherwise."""
        return tile.default_config(self.arch) if self.configs == "default" else None

    # -- formats ---------------------------------------------------------------------------------

    def fp4_quantize(self, x: torch.Tensor, group_size: int, scale_format: str) -> tuple[torch.Tensor, torch.Tensor]:
        tile = fp4_tiles.tile_for(True, scale_format)
        return fp4_tiles.fp4_quantize(x.contiguous(), group_size, scale_format, config=self._config(tile))

    def _index_queries(self, q_packed: torch.Tensor, q_scales: torch.Tensor) -> torch.Tensor:
        """FP4 indexer queries -> bf16 [B, S, Hi, Di] (exact: E2M1 x E8M0 values fit bf16)."""
        tile = fp4_tiles.tile_for(False, INDEX_SCALE)
        return fp4_tiles.fp4_dequantize(
            q_packed.contiguous(), q_scales.contiguous(), INDEX_GROUP, INDEX_SCALE, torch.bfloat16, config=self._config(tile)
        )

    # -- compressor ------------------------------------------------------------------------------

    def compressor(
        self,
        kv: torch.Tensor,
        gate: torch.Tensor | None,
        ratio: int,
        first_group: int | torch.Tensor,
        norm_weight: torch.Tensor,
        wk: torch.Tensor,
        k_norm_weight: torch.Tensor,
        rope: RopeConfig,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        G = kv.shape[1] // ratio
        if G == 0 or kv.shape[-1] != 512 or wk.shape[0] != 128:
            self.fallbacks["compressor: not the v4.1-flash latent (512) / index (128) dims"] += 1
            return super().compressor(kv, gate, ratio, first_group, norm_weight, wk, k_norm_weight, rope, eps)
        cos, sin = rope_tables(rope, group_positions(first_group, G, ratio, kv.device))  # [G, rope_dim/2]
        f32 = torch.float32
        return compressor_tiles.compress(
            kv.to(f32).contiguous(),
            None if gate is None else gate.to(f32).contiguous(),
            ratio,
            norm_weight.to(f32),
            cos,
            sin,
            wk.to(f32).contiguous(),
            k_norm_weight.to(f32),
            eps,
            config=self._config(compressor_tiles.COMPRESSOR),
        )

    # -- indexer ---------------------------------------------------------------------------------

    def _indexer_ok(self, q_packed: torch.Tensor, index_packed: torch.Tensor, block_table: torch.Tensor | None, page_size: int) -> bool:
        if q_packed.shape[-2:] != (32, 64):
            self.fallbacks["indexer: not the v4.1-flash indexer (32 heads x 128)"] += 1
            return False
        if index_packed.shape[1] == 0 or (block_table is not None and block_table.shape[1] == 0):
            self.fallbacks["indexer: no compressed entry yet (nothing to score)"] += 1
            return False
        if block_table is not None and page_size not in indexer_tiles.PAGE_SIZES:
            self.fallbacks[f"indexer: pages of {page_size} entries (the kernels read {indexer_tiles.PAGE_SIZES})"] += 1
            return False
        return True

    def _index_cache(self, index_packed, index_scales, block_table) -> tuple[torch.Tensor, torch.Tensor]:
        """The index K as the kernels take it: a paged cache's pool as it is, a contiguous cache's view widened."""
        if block_table is not None:
            return index_packed.contiguous(), index_scales.contiguous()
        return widen_cache_view(index_packed), widen_cache_view(index_scales)

    def indexer_topk(self, q_packed, q_scales, weights, index_packed, index_scales, n_visible, k, block_table=None, page_size=0):
        paged = {"block_table": block_table, "page_size": page_size} if block_table is not None else {}
        if not self._indexer_ok(q_packed, index_packed, block_table, page_size):
            return super().indexer_topk(q_packed, q_scales, weights, index_packed, index_scales, n_visible, k, **paged)
        q = self._index_queries(q_packed, q_scales)
        k_packed, k_scales = self._index_cache(index_packed, index_scales, block_table)
        return indexer_tiles.indexer_topk(
            q, weights.float(), k_packed, k_scales, n_visible, k, config=self._config(indexer_tiles.INDEXER_TOPK), **paged
        )

    def candidate_pool(
        self, q_packed, q_scales, weights, index_packed, index_scales, n_visible, block, max_blocks, block_table=None, page_size=0
    ):
        paged = {"block_table": block_table, "page_size": page_size} if block_table is not None else {}
        if not self._indexer_ok(q_packed, index_packed, block_table, page_size):
            return super().candidate_pool(q_packed, q_scales, weights, index_packed, index_scales, n_visible, block, max_blocks, **paged)
        # The pool needs every score; the scan is the indexer kernel's, asked to return its scores.
        q = self._index_queries(q_packed, q_scales)
        k_packed, k_scales = self._index_cache(index_packed, index_scales, block_table)
        _, scores = indexer_tiles.indexer_topk(
            q,
            weights.float(),
            k_packed,
            k_scales,
            n_visible,
            1,
            return_scores=True,
            config=self._config(indexer_tiles.INDEXER_TOPK),
            **paged,
        )
        if block_table is None:
            scores = scores[..., : index_packed.shape[1]].contiguous()  # the pool's width follows the filled entries
        return indexer_tiles.candidate_pool(scores, n_visible, block, max_blocks, config=self._config(indexer_tiles.CANDIDATE_POOL))

    def reindex_topk(
        self, q_packed, q_scales, weights, index_packed, index_scales, n_visible, pool_blocks, block, k, block_table=None, page_size=0
    ):
        paged = {"block_table": block_table, "page_size": page_size} if block_table is not None else {}
        if not self._indexer_ok(q_packed, index_packed, block_table, page_size):
            return super().reindex_topk(q_packed, q_scales, weights, index_packed, index_scales, n_visible, pool_blocks, block, k, **paged)
        q = self._index_queries(q_packed, q_scales)
        k_packed, k_scales = self._index_cache(index_packed, index_scales, block_table)
        return indexer_tiles.reindex_topk(
            q,
            weights.float(),
            k_packed,
            k_scales,
            n_visible,
            pool_blocks,
            block,
            k,
            config=self._config(indexer_tiles.REINDEX_TOPK),
            **paged,
        )

    # -- attention -------------------------------------------------------------------------------

    @staticmethod
    def _attention_serves(n_heads: int, head_dim: int) -> bool:
        return n_heads % 64 == 0 and head_dim == 512

    def query_dtype(self, n_heads: int, head_dim: int) -> torch.dtype | None:
        """bf16 where the attention kernels serve the shape (they read bf16 queries); the reference's float32 where the
        torch fallback runs."""
        return torch.bfloat16 if self._attention_serves(n_heads, head_dim) else None

    def sparse_attention(self, q, window_codes, window_scales, window_idx, main_packed, main_scales, topk_idx, sink, scale):
        B, S, H, D = q.shape
        if not self._attention_serves(H, D) or sink is None:
            self.fallbacks["sparse_attention: kernels serve H % 64 == 0, D = 512, with a sink"] += 1
            return super().sparse_attention(q, window_codes, window_scales, window_idx, main_packed, main_scales, topk_idx, sink, scale)
        if topk_idx.shape[-1] == 0:
            # SWA-only layers have no compressed entries: one all -1 block of top-k slots over a one-row cache.
            topk_idx = torch.full((B, S, 64), -1, dtype=torch.int32, device=q.device)
            main_packed = torch.zeros(B, 1, D // 2, dtype=torch.uint8, device=q.device)
            main_scales = torch.zeros(B, 1, D // 16, dtype=torch.uint8, device=q.device)
        tile = attn_tiles.tile_for_tokens(B, S, bf16=False)
        return attn_tiles.sparse_attention(
            q.to(torch.bfloat16).contiguous(),
            window_codes.contiguous(),
            window_scales.contiguous(),
            window_idx.to(torch.int32).contiguous(),
            widen_cache_view(main_packed) if main_packed.shape[0] == B else main_packed.contiguous(),  # a pool: as it is
            widen_cache_view(main_scales) if main_scales.shape[0] == B else main_scales.contiguous(),
            topk_idx.to(torch.int32).contiguous(),
            sink.float(),
            scale,
            config=self._config(tile),
        )
