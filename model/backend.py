"""The backend seam: every op the kernels accelerate, called by the model through one object.

The model never calls an accelerated op directly; it calls the methods of its backend.
:class:`TorchBackend` is the plain torch reference (the ops in :mod:`model.ops` and the formats
in :mod:`model.formats`). ``tiles.backend.TilesBackend`` (TileLang kernels) exposes the same
methods with the same signatures and is loaded by name, only when asked for, by :func:`load_backend`; it may subclass
:class:`TorchBackend` to inherit the ops it does not accelerate.

Every method speaks the stored formats, so a kernel can implement it directly:

* main KV: FP4 E2M1 packed two per byte (even element in the low nibble), uint8 [..., D/2],
  one E4M3 scale byte per 16 values, uint8 [..., D/16];
* index K and indexer Q: FP4 packed uint8 [..., Di/2], one E8M0 scale byte per 32, uint8 [..., Di/32];
* SWA window KV: FP8 E4M3 codes uint8 [..., D], one E8M0 scale byte per 32, uint8 [..., D/32];
* index lists: int32, ascending positions, -1 = unused slot.

Cache tensors handed to a backend may be views of larger buffers (``buf[:, :n]``): the last
dim is contiguous, the batch stride may be larger than the row count times the row size.
Outputs are freshly allocated. Computation is float32 whatever the input float dtype.

Paged caches (:mod:`model.paged`, continuous batching) use the same methods:

* ``sparse_attention`` takes each of its two KV sources either per batch row ([B, N, ...]) or as one
  pool shared by every row ([1, N, ...]), whose indices are then rows of that pool;
* the indexer methods take ``block_table`` (int32 [B, max_pages], -1 past a row's pages) and
  ``page_size``: ``index_packed`` / ``index_scales`` are then the group's pool [1, R, ...] and logical
  entry ``j`` of row ``b`` is pool row ``block_table[b, j // page_size] * page_size + j % page_size``
  (logical width ``max_pages * page_size``). Their outputs stay logical positions / block ids, exactly
  the contiguous call's; :func:`model.ops.paged.pool_rows` turns a top-k into pool rows.
"""

from __future__ import annotations

import importlib
from typing import Protocol, runtime_checkable

import torch

import model.formats
from model.ops.compressor import compressor_latents, index_keys, main_entries
from model.ops.indexer import candidate_blocks, indexer_scores, pool_mask, topk_positions
from model.ops.paged import check_block_table, gather_pages
from model.ops.rope import RopeConfig
from model.ops.sparse_attn import sparse_attention_quantized

MAIN_GROUP, MAIN_SCALE = 16, "e4m3"
_LOGITS_BUDGET_BYTES = 2 << 30  # indexer logits materialised at once by the torch reference
INDEX_GROUP, INDEX_SCALE = 32, "e8m0"


class BackendError(RuntimeError):
    """A backend that cannot be loaded or does not implement the seam."""


@runtime_checkable
class Backend(Protocol):
    """What the model calls. See :class:`TorchBackend` for shapes, dtypes and semantics.

    Optional: ``query_dtype(n_heads, head_dim)``, the dtype ``sparse_attention`` reads its queries in (None: float32);
    the model asks for it only if the backend has it (:meth:`TorchBackend.query_dtype`)."""

    name: str

    def fp4_quantize(self, x: torch.Tensor, group_size: int, scale_format: str) -> tuple[torch.Tensor, torch.Tensor]: ...

    def fp8_quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

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
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def indexer_topk(
        self,
        q_packed: torch.Tensor,
        q_scales: torch.Tensor,
        weights: torch.Tensor,
        index_packed: torch.Tensor,
        index_scales: torch.Tensor,
        n_visible: torch.Tensor,
        k: int,
        block_table: torch.Tensor | None = None,
        page_size: int = 0,
    ) -> torch.Tensor: ...

    def candidate_pool(
        self,
        q_packed: torch.Tensor,
        q_scales: torch.Tensor,
        weights: torch.Tensor,
        index_packed: torch.Tensor,
        index_scales: torch.Tensor,
        n_visible: torch.Tensor,
        block: int,
        max_blocks: int,
        block_table: torch.Tensor | None = None,
        page_size: int = 0,
    ) -> torch.Tensor: ...

    def reindex_topk(
        self,
        q_packed: torch.Tensor,
        q_scales: torch.Tensor,
        weights: torch.Tensor,
        index_packed: torch.Tensor,
        index_scales: torch.Tensor,
        n_visible: torch.Tensor,
        pool_blocks: torch.Tensor,
        block: int,
        k: int,
        block_table: torch.Tensor | None = None,
        page_size: int = 0,
    ) -> torch.Tensor: ...

    def sparse_attention(
        self,
        q: torch.Tensor,
        window_codes: torch.Tensor,
        window_scales: torch.Tensor,
        window_idx: torch.Tensor,
        main_packed: torch.Tensor,
        main_scales: torch.Tensor,
        topk_idx: torch.Tensor,
        sink: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor: ...


class TorchBackend:
    """Plain torch reference of every accelerated op (the baseline and the correctness oracle)."""

    name = "torch"

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else torch.device("cpu")

    # -- formats ---------------------------------------------------------------------------

    def fp4_quantize(self, x: torch.Tensor, group_size: int, scale_format: str) -> tuple[torch.Tensor, torch.Tensor]:
        """FP4 E2M1 with one scale per group (:func:`model.formats.fp4_quantize`).

        Args:
            x: float [..., N]; group_size 16 with ``"e4m3"`` (main KV) or 32 with ``"e8m0"`` (index K/Q).
        Returns:
            packed uint8 [..., N/2], scales uint8 [..., N/group_size].
        """
        return model.formats.fp4_quantize(x, group_size, scale_format)

    def fp8_quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """FP8 E4M3 with one E8M0 scale per 32 (SWA window KV).

        Args:
            x: float [..., N], N a multiple of 32.
        Returns:
            codes uint8 [..., N], scales uint8 [..., N/32].
        """
        return model.formats.fp8_quantize(x)

    # -- compressor --------------------------------------------------------------------------

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
        """Complete groups -> cache entries: pool, RMSNorm (the pre-RoPE latent); RoPE, FP4 main KV; index K, FP4.

        Entry ``g`` (0-based in this call) is compressed entry ``first_group + g`` of the group's
        cache; its RoPE position is ``(first_group + g) * ratio``. The index key is projected from
        the latent *before* RoPE (``rope(k_norm(Wk latent))``), as in the official V4.1 code.

        Args:
            kv: float32 [B, G * ratio, D] ``Wkv(x)`` of the groups' tokens, in order.
            gate: float32 [B, G * ratio, D] ``Wgate(x)`` (ratio 2), None for ratio 1.
            ratio: 1 or 2.
            first_group: index of the first entry produced; or int64 [G] the entry index of each group, for groups
                of several sequences compressed in one call (B = 1, each group's tokens consecutive in kv).
            norm_weight: [D] the compressor's RMSNorm weight.
            wk: [Di, D] index-K projection; k_norm_weight: [Di].
            rope: the compress RoPE (YaRN) of the layer.
        Returns:
            main_packed uint8 [B, G, D/2], main_scales uint8 [B, G, D/16] (E4M3),
            index_packed uint8 [B, G, Di/2], index_scales uint8 [B, G, Di/32] (E8M0).
        """
        latent = compressor_latents(kv, gate, ratio, norm_weight, eps)  # [B, G, D] before RoPE
        k = index_keys(latent, wk, k_norm_weight, first_group, ratio, rope, eps)  # [B, G, Di]
        main_packed, main_scales = self.fp4_quantize(main_entries(latent, first_group, ratio, rope), MAIN_GROUP, MAIN_SCALE)
        index_packed, index_scales = self.fp4_quantize(k, INDEX_GROUP, INDEX_SCALE)
        return main_packed, main_scales, index_packed, index_scales

    # -- indexer -----------------------------------------------------------------------------

    def _select_by_query_chunks(self, select, q_packed, q_scales, weights, index_packed, index_scales, n_visible) -> torch.Tensor:
        """``select(scores [B, s, Nc], query slice)`` over chunks of queries.

        A 64K-token prefill would need [B, S, Hi, Nc] logits of 512 GB at once; chunking the
        queries keeps them near :data:`_LOGITS_BUDGET_BYTES`, the way a careful torch user
        would write it. Every selection here is row-wise, so chunking changes no result.
        """
        B, S, Hi = weights.shape
        k = model.formats.fp4_dequantize(index_packed, index_scales, INDEX_GROUP, INDEX_SCALE)  # [B, Nc, Di]
        chunk = max(1, _LOGITS_BUDGET_BYTES // max(1, B * Hi * k.shape[1] * 8))
        parts = []
        for s0 in range(0, S, chunk):
            sl = slice(s0, min(S, s0 + chunk))
            q = model.formats.fp4_dequantize(q_packed[:, sl], q_scales[:, sl], INDEX_GROUP, INDEX_SCALE)  # [B, s, Hi, Di]
            parts.append(select(indexer_scores(q, weights[:, sl], k, n_visible[:, sl]), sl))  # scores [B, s, Nc]
        return torch.cat(parts, dim=1)

    @staticmethod
    def _logical_index(index_packed, index_scales, n_visible, block_table, page_size) -> tuple[torch.Tensor, torch.Tensor]:
        """The index K in the contiguous layout [B, N, ...]: as given, or gathered from the pool through the block table
        (the reference materialises it; a kernel reads pool rows through the table instead)."""
        if block_table is None:
            return index_packed, index_scales
        check_block_table(block_table, index_packed.shape[1], page_size, n_visible)
        return gather_pages(index_packed, block_table, page_size), gather_pages(index_scales, block_table, page_size)

    def indexer_topk(
        self,
        q_packed: torch.Tensor,
        q_scales: torch.Tensor,
        weights: torch.Tensor,
        index_packed: torch.Tensor,
        index_scales: torch.Tensor,
        n_visible: torch.Tensor,
        k: int,
        block_table: torch.Tensor | None = None,
        page_size: int = 0,
    ) -> torch.Tensor:
        """Full indexer scan: ``score[t] = sum_h relu(q[h] . k[t]) * w[h]`` over visible entries, top-k.

        Args:
            q_packed: uint8 [B, S, Hi, Di/2] FP4 indexer queries; q_scales: uint8 [B, S, Hi, Di/32] E8M0.
            weights: float32 [B, S, Hi], already scaled by Di^-0.5 * Hi^-0.5.
            index_packed: uint8 [B, Nc, Di/2]; index_scales: uint8 [B, Nc, Di/32] E8M0.
            n_visible: int64 [B, S]; entry j is visible to query s iff j < n_visible[b, s].
            k: top-k width.
            block_table: None (contiguous), or int32 [B, max_pages] page ids (-1 past a row's pages): the index
                tensors are then the group's pool, uint8 [1, R, Di/2] / [1, R, Di/32], read through the table.
            page_size: entries per page (with ``block_table``).
        Returns:
            int32 [B, S, k]: the best ``min(k, n_visible)`` entries (ties: lower position wins),
            sorted ascending by position, then -1. Logical positions also with a block table.
        """
        index_packed, index_scales = self._logical_index(index_packed, index_scales, n_visible, block_table, page_size)
        args = (q_packed, q_scales, weights, index_packed, index_scales, n_visible)
        return self._select_by_query_chunks(lambda scores, sl: topk_positions(scores, k), *args)

    def candidate_pool(
        self,
        q_packed: torch.Tensor,
        q_scales: torch.Tensor,
        weights: torch.Tensor,
        index_packed: torch.Tensor,
        index_scales: torch.Tensor,
        n_visible: torch.Tensor,
        block: int,
        max_blocks: int,
        block_table: torch.Tensor | None = None,
        page_size: int = 0,
    ) -> torch.Tensor:
        """Candidate pool of the pool source layer: blocks of ``block`` entries ranked by their max score.

        Inputs as in :meth:`indexer_topk` (``block_table`` too).

        Returns:
            int32 [B, S, P], P = min(max_blocks, ceil(Nc / block)): ascending block ids, -1 fill.
            The newest (possibly partial) visible block is always kept. With a block table Nc is the
            logical width ``max_pages * page_size`` and the ids are logical blocks.
        """
        index_packed, index_scales = self._logical_index(index_packed, index_scales, n_visible, block_table, page_size)
        args = (q_packed, q_scales, weights, index_packed, index_scales, n_visible)
        return self._select_by_query_chunks(lambda scores, sl: candidate_blocks(scores, n_visible[:, sl], block, max_blocks), *args)

    def reindex_topk(
        self,
        q_packed: torch.Tensor,
        q_scales: torch.Tensor,
        weights: torch.Tensor,
        index_packed: torch.Tensor,
        index_scales: torch.Tensor,
        n_visible: torch.Tensor,
        pool_blocks: torch.Tensor,
        block: int,
        k: int,
        block_table: torch.Tensor | None = None,
        page_size: int = 0,
    ) -> torch.Tensor:
        """Reindex: top-k among the visible entries inside the candidate pool only.

        The reference scores every entry and masks (as the public reference does); a kernel
        should gather the pool's blocks first and score only those. When the pool holds fewer
        than ``k`` visible entries the rest of the row is -1 (deliberate: the official code fills
        it with arbitrary visible entries outside the pool, the tie order of -inf scores).

        Args:
            pool_blocks: int32 [B, S, P] from :meth:`candidate_pool` (-1 fill; logical block ids).
            Others as in :meth:`indexer_topk` (``block_table`` too).
        Returns:
            int32 [B, S, k], as :meth:`indexer_topk`.
        """
        index_packed, index_scales = self._logical_index(index_packed, index_scales, n_visible, block_table, page_size)

        def select(scores: torch.Tensor, sl: slice) -> torch.Tensor:
            inside = pool_mask(pool_blocks[:, sl], scores.shape[-1], block)  # [B, s, Nc]
            return topk_positions(scores.masked_fill(~inside, float("-inf")), k)

        return self._select_by_query_chunks(select, q_packed, q_scales, weights, index_packed, index_scales, n_visible)

    # -- attention ---------------------------------------------------------------------------

    def query_dtype(self, n_heads: int, head_dim: int) -> torch.dtype | None:
        """The dtype :meth:`sparse_attention` wants its queries in (None: float32, the reference's math), so the
        model rounds the RoPE'd queries once instead of widening them and having the backend narrow them again."""
        return None

    def sparse_attention(
        self,
        q: torch.Tensor,
        window_codes: torch.Tensor,
        window_scales: torch.Tensor,
        window_idx: torch.Tensor,
        main_packed: torch.Tensor,
        main_scales: torch.Tensor,
        topk_idx: torch.Tensor,
        sink: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        """One softmax over the SWA window and the top-k compressed entries, plus a per-head sink.

        Args:
            q: [B, S, H, D] queries (RoPE applied), any float dtype.
            window_codes: uint8 [B, Nw, D] FP8 E4M3; window_scales: uint8 [B, Nw, D/32] E8M0.
                In decode (S = 1) this is the layer's ring (Nw = window); for S > 1 steps it is
                the ring followed by the step's own tokens (Nw = window + S). Or [1, Nw, ...]: one
                pool shared by every batch row (a paged cache's ring pool, Nw = n_slots * window).
            window_idx: int32 [B, S, W] rows of window_codes (of the shared pool when its batch is 1), -1 = unused.
            main_packed: uint8 [B, Nc, D/2] FP4; main_scales: uint8 [B, Nc, D/16] E4M3
                (Nc = 0 for SWA-only layers). Or [1, Nc, ...]: a group's page pool shared by every row.
            topk_idx: int32 [B, S, K] rows of main_packed, -1 = unused (K = 0 for SWA-only layers); with a
                page pool these are pool rows (:func:`model.ops.paged.pool_rows`), not logical positions.
            sink: float32 [H] or None.
            scale: softmax scale (head_dim^-0.5).
        Returns:
            float32 [B, S, H, D]; a row with no valid index is zeros.
        """
        return sparse_attention_quantized(q, window_codes, window_scales, window_idx, main_packed, main_scales, topk_idx, sink, scale)


_METHODS = ("fp4_quantize", "fp8_quantize", "compressor", "indexer_topk", "candidate_pool", "reindex_topk", "sparse_attention")


# Backends other than the reference, by name -> "module:class". The model package never imports them itself (they
# build on it: an import of theirs here would close a circle); a name is resolved only when it is asked for.
PLUGIN_BACKENDS = {"tiles": "tiles.backend:TilesBackend"}


def load_backend(backend: str | object, device: torch.device | str | None = None) -> Backend:
    """The backend named ``"torch"`` or one of :data:`PLUGIN_BACKENDS` (``"tiles"``), or a ready backend object passed
    through. A plugin is imported only when asked for and constructed as ``cls(device=device)``."""
    if isinstance(backend, str):
        if backend == "torch":
            return TorchBackend(device)
        if backend not in PLUGIN_BACKENDS:
            raise BackendError(f"unknown backend {backend!r}: use 'torch' or {' or '.join(repr(n) for n in PLUGIN_BACKENDS)}")
        module_name, class_name = PLUGIN_BACKENDS[backend].split(":")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except ImportError as exc:
            raise BackendError(f"backend {backend!r} is unavailable ({exc}); install tilelang and tiles/, or use backend='torch'") from None
        obj = cls(device=device)
    else:
        obj = backend
    missing = [m for m in _METHODS if not callable(getattr(obj, m, None))]
    if missing:
        raise BackendError(f"backend {type(obj).__name__} lacks {', '.join(missing)}; subclass model.backend.TorchBackend to inherit them")
    return obj
