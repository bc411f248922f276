"""One CSA2 attention layer (spec section 2) and the per-step state shared between layers.

RoPE: SWA-only layers use ``rope_theta`` for q, the SWA KV and the output's inverse
rotation. CSA2 layers (ratio 1 or 2) use the compress RoPE (``compress_rope_theta`` with
YaRN) for q, the compressed latent, the index K/Q, the inverse rotation **and their own SWA
KV**: the window and top-k keys meet the same query in one softmax, so they must rotate
with the same frequencies for ``q . k`` to depend on relative position consistently.

Every accelerated op goes through ``step.backend`` (see :mod:`model.backend`).

A step runs either on a contiguous :class:`KVCache` (every sequence at the same position) or on a
:class:`PagedKVCache` (any live sequences, each at its own position): the paged step attends to the
shared ring and page pools through rows and block tables, and the indexer keeps ranking logical
positions, turned into pool rows (:func:`pool_rows`) only for the attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from model.backend import INDEX_GROUP, INDEX_SCALE, Backend
from model.cache import KVCache
from model.config import LayerMode, LayerPlan, ModelConfig
from model.layers import Compressor, Indexer, Linear, RMSNorm
from model.ops.indexer import visible_entries
from model.ops.paged import pool_rows
from model.ops.rope import RopeConfig, apply_rope, rope_tables
from model.paged import PagedKVCache


@dataclass
class Step:
    """One forward step over tokens at positions ``first .. first + S - 1`` of every sequence.

    On a paged cache, batch row ``b`` is sequence ``seqs[b]`` at positions ``row_first[b] ..
    row_first[b] + S - 1`` (``first`` is unused). An encoder bounded replay (after a prefix hit) runs
    ``replay`` already cached tokens in front of the new ones: they rebuild the SWA rings and attend as usual,
    but the compressors see only the new tokens (the cached prefix ends on a group boundary).

    Carries what layers publish for later layers of the same step: the latest top-k of
    each index source (logical positions) and the candidate pool of the pool source.
    """

    cache: KVCache | PagedKVCache
    backend: Backend
    first: int
    S: int
    prebuilt: frozenset[int] = frozenset()  # KV sources whose entries for this step already exist (CED)
    seqs: tuple[int, ...] = ()  # paged: the sequence id of each batch row
    row_first: tuple[int, ...] = ()  # paged: the position of each row's first token
    replay: int = 0  # paged: the first ``replay`` tokens of each row are replayed; their global entries exist already
    topk: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> int32 [B, S, K]
    pool: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> int32 [B, S, P]
    _tables: dict[RopeConfig, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    _block_tables: dict[int, torch.Tensor] = field(default_factory=dict)
    _row_positions: torch.Tensor | None = None

    @property
    def paged(self) -> bool:
        return isinstance(self.cache, PagedKVCache)

    @property
    def positions(self) -> torch.Tensor:
        """int64 [S] (contiguous) or [B, S] (paged: each row at its own position, built once per step: a host list to
        the device is a copy the GPU waits on)."""
        if self.paged:
            if self._row_positions is None:
                first = torch.tensor(self.row_first, dtype=torch.int64, device=self.cache.device)
                self._row_positions = first[:, None] + torch.arange(self.S, device=self.cache.device)
            return self._row_positions
        return torch.arange(self.first, self.first + self.S, device=self.cache.rings[0].codes.device)

    def rope(self, cfg: RopeConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin float32 [S, rope_dim/2] (paged: [B, S, rope_dim/2]) at this step's positions (once per RoPE config)."""
        if cfg not in self._tables:
            self._tables[cfg] = rope_tables(cfg, self.positions)
        return self._tables[cfg]

    def block_table(self, source: int) -> torch.Tensor:
        """Paged: int32 [B, pages] of ``source``'s group, -1 past each sequence's pages. The step's pages are taken
        before it starts, so one table per group serves every layer of the step. Its width is the longest sequence's
        page count rounded up to a power of two: a kernel's launch plan is kept per table shape, and an exact width
        would make a new one every few steps as sequences grow, join and leave."""
        if source not in self._block_tables:
            table = self.cache.block_table(self.seqs, source)  # [B, longest's pages]
            pages = table.shape[1]
            width = 1 << (pages - 1).bit_length() if pages else 0
            self._block_tables[source] = torch.nn.functional.pad(table, (0, width - pages), value=-1) if width > pages else table
        return self._block_tables[source]


class Attention(nn.Module):
    """CSA2 attention of one layer; what it owns depends on its mode.

    * every layer: query path ``Wq_a -> RMSNorm -> qr -> Wq_b``, SWA KV ``kv_norm(Wkv_swa(x))``,
      per-head sink, grouped output projection;
    * Full: a :class:`Compressor` (its group's global KV and index K) and an :class:`Indexer`;
    * Reindex: an :class:`Indexer` only (searches the pool source's candidate pool);
    * Reuse and SWA only: neither (Reuse reads its group's KV and the latest top-k).
    """

    def __init__(self, cfg: ModelConfig, plan: LayerPlan) -> None:
        super().__init__()
        self.cfg, self.plan = cfg, plan
        H, D = cfg.n_heads, cfg.head_dim
        self.wq_a = Linear(cfg.dim, cfg.q_lora_rank)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, H * D)
        self.wkv_swa = Linear(cfg.dim, D)
        self.kv_norm = RMSNorm(D, cfg.norm_eps)
        self.sink = nn.Parameter(torch.empty(H))  # float32 whatever the model dtype
        self.wo_a = nn.Parameter(torch.empty(cfg.o_groups, cfg.o_lora_rank, H * D // cfg.o_groups))  # per-group [o_lora, H*D/G]
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, cfg.dim)
        self.rope = cfg.swa_rope() if plan.mode == LayerMode.SWA_ONLY else cfg.compress_rope()
        full = plan.mode == LayerMode.FULL
        self.compressor = Compressor(cfg.dim, D, cfg.index_head_dim, plan.ratio, cfg.norm_eps) if full else None
        has_indexer = plan.mode in (LayerMode.FULL, LayerMode.REINDEX)
        self.indexer = Indexer(cfg.dim, cfg.q_lora_rank, cfg.index_heads, cfg.index_head_dim) if has_indexer else None

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        """x [B, S, dim] (the pre-normed hidden state) -> [B, S, dim] in the model dtype."""
        cfg, plan = self.cfg, self.plan
        B, S, _ = x.shape
        H, D = cfg.n_heads, cfg.head_dim
        cos, sin = step.rope(self.rope)  # [S, r/2]
        qr = self.q_norm(self.wq_a(x))  # [B, S, q_lora] fp32
        # the dtype the backend reads queries in (bf16 for the attention kernels): rounded once here, never widened whole
        q_dtype = step.backend.query_dtype(H, D) if hasattr(step.backend, "query_dtype") else None
        q = apply_rope(self.wq_b(qr).view(B, S, H, D), cos.unsqueeze(-2), sin.unsqueeze(-2), out_dtype=q_dtype)  # [B, S, H, D]
        win_codes, win_scales, win_idx = self._swa(x, step, cos, sin)
        if plan.mode == LayerMode.SWA_ONLY:
            main_packed = x.new_zeros(B, 0, D // 2, dtype=torch.uint8)
            main_scales = x.new_zeros(B, 0, D // cfg.main_fp4_group, dtype=torch.uint8)
            topk = torch.empty(B, S, 0, dtype=torch.int32, device=x.device)
        else:
            if self.compressor is not None and plan.index not in step.prebuilt:
                if step.paged:
                    if step.replay < S:  # replayed tokens never rewrite the cached prefix's entries
                        self.append_paged(x[:, step.replay :], step.cache, step.seqs, step.backend)
                else:
                    self.append_global(x, step.cache, step.backend)
            topk = self._topk(qr, x, step, cos, sin) if self.indexer is not None else step.topk[plan.index_source]
            if step.paged:
                group = step.cache.groups[plan.kv_source]
                main_packed, main_scales = group.main_packed.unsqueeze(0), group.main_scales.unsqueeze(0)  # [1, R, ...] pool
                topk = pool_rows(topk, step.block_table(plan.kv_source), group.page_size)
            else:
                main_packed, main_scales = step.cache.globals[plan.kv_source].main()
        out = step.backend.sparse_attention(q, win_codes, win_scales, win_idx, main_packed, main_scales, topk, self.sink, cfg.softmax_scale)
        # rotated wide, rounded once to wo_a's dtype (what a float32 rotation and a cast gave, without the float32 copy)
        out = apply_rope(out, cos.unsqueeze(-2), sin.unsqueeze(-2), inverse=True, out_dtype=self.wo_a.dtype)  # [B, S, H, D]
        o = out.view(B, S, cfg.o_groups, H * D // cfg.o_groups)  # [B, S, G, H*D/G]
        o = torch.einsum("bsgi,goi->bsgo", o, self.wo_a).reshape(B, S, cfg.o_groups * cfg.o_lora_rank)
        return self.wo_b(o)

    def _swa(self, x: torch.Tensor, step: Step, cos: torch.Tensor, sin: torch.Tensor):
        """Quantise this step's SWA KV into the ring; return the window KV and its int32 [B, S, W] rows."""
        B, S = x.shape[:2]
        kv = apply_rope(self.kv_norm(self.wkv_swa(x)), cos, sin)  # [B, S, D]
        codes, scales = step.backend.fp8_quantize(kv)  # [B, S, D], [B, S, D/32]
        if step.paged:
            return step.cache.swa_step(step.seqs, self.plan.index, step.row_first, codes, scales)
        ring = step.cache.rings[self.plan.index]
        if S == 1:
            # One token overwrites only a slot no query of this step needs: attend in place.
            ring.write(codes, scales, step.first)
            idx = ring.window_indices(step.first, 1, concatenated=False)
            win_codes, win_scales = ring.codes, ring.scales  # [B, W, D], [B, W, D/32]
        else:
            # A later token of the step would overwrite a slot an earlier query still needs.
            idx = ring.window_indices(step.first, S, concatenated=True)
            win_codes, win_scales = torch.cat([ring.codes, codes], 1), torch.cat([ring.scales, scales], 1)  # [B, W+S, ...]
            ring.write(codes, scales, step.first)
        return win_codes, win_scales, idx.unsqueeze(0).expand(B, -1, -1).contiguous()

    def append_global(self, x: torch.Tensor, cache: KVCache, backend: Backend) -> None:
        """Compressor of a Full layer: feed x [B, S, dim] (pre-normed) into the group's tail; append completed groups."""
        comp = self.compressor
        assert comp is not None, "only Full layers own a compressor"
        kv, gate = comp.project(x)  # [B, S, D] fp32 each (gate None for ratio 1)
        tail = cache.tails.get(self.plan.index)
        if tail is not None and tail.count:
            old_kv, old_gate = tail.take()
            kv, gate = torch.cat([old_kv, kv], 1), torch.cat([old_gate, gate], 1)
        r = comp.ratio
        done = kv.shape[1] // r * r
        if tail is not None:
            tail.store(kv[:, done:], gate[:, done:])
        if done:
            glob = cache.globals[self.plan.index]
            entries = backend.compressor(
                kv[:, :done],
                gate[:, :done] if gate is not None else None,
                r,
                glob.n,
                comp.norm.weight,
                comp.wk.weight,
                comp.k_norm.weight,
                self.rope,
                self.cfg.norm_eps,
            )
            glob.append(*entries)

    def append_paged(self, x: torch.Tensor, cache: PagedKVCache, seqs: tuple[int, ...], backend: Backend) -> None:
        """:meth:`append_global` on a paged cache: row ``b`` of x [B, S, dim] extends sequence ``seqs[b]``.

        One compressor call for the whole batch: every row's completed groups, each at its own entry index (RoPE
        position), laid end to end in one row (groups are independent of each other), then each sequence's entries
        go into its pages, taken before the step.
        """
        comp = self.compressor
        assert comp is not None, "only Full layers own a compressor"
        src, r = self.plan.index, comp.ratio
        kv_all, gate_all = comp.project(x)  # [B, S, D] fp32 each (gate None for ratio 1)
        kv_done, gate_done, first, counts = [], [], [], []
        for b, seq in enumerate(seqs):
            kv, gate = kv_all[b : b + 1], gate_all[b : b + 1] if gate_all is not None else None  # [1, S, D]
            if r > 1:
                old_kv, old_gate = cache.tail(seq, src)  # [1, c, D]
                kv, gate = torch.cat([old_kv, kv], 1), torch.cat([old_gate, gate], 1)
            done = kv.shape[1] // r * r
            if r > 1:
                cache.store_tail(seq, src, kv[:, done:], gate[:, done:])
            counts.append(done // r)
            if done:
                kv_done.append(kv[:, :done])
                gate_done.append(gate[:, :done] if gate is not None else None)
                entries = cache.sequence(seq).entries[src]
                first.append(torch.arange(entries, entries + done // r, device=x.device))
        if not kv_done:
            return
        entries = backend.compressor(
            torch.cat(kv_done, 1),  # [1, sum(G_b) * r, D]
            torch.cat(gate_done, 1) if r > 1 else None,
            r,
            torch.cat(first),  # [sum(G_b)] each group's entry index
            comp.norm.weight,
            comp.wk.weight,
            comp.k_norm.weight,
            self.rope,
            self.cfg.norm_eps,
        )
        at = 0
        for seq, n in zip(seqs, counts, strict=True):
            if n:
                cache.write_entries(seq, src, *(t[:, at : at + n] for t in entries))
                at += n

    def _topk(self, qr: torch.Tensor, x: torch.Tensor, step: Step, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Run this layer's indexer (Full: full scan, plus the pool at the pool source; Reindex: inside the pool); publish top-k.

        The keys are always those of the layer's own KV group (``plan.kv_source``), also at a ratio-2 decode step whose
        group is still filling. Deliberate: the official code then scores against the index cache that the last source
        layer to publish keys left in a module-global, which belongs to another group.
        """
        cfg, plan, backend = self.cfg, self.plan, step.backend
        B, S = x.shape[:2]
        q_idx, weights = self.indexer(qr, x)  # [B, S, Hi, Di], [B, S, Hi]
        q_idx = apply_rope(q_idx, cos.unsqueeze(-2), sin.unsqueeze(-2))
        q_packed, q_scales = backend.fp4_quantize(q_idx, INDEX_GROUP, INDEX_SCALE)  # [B, S, Hi, Di/2], [B, S, Hi, Di/32]
        if step.paged:
            group = step.cache.groups[plan.kv_source]
            index_packed, index_scales = group.index_packed.unsqueeze(0), group.index_scales.unsqueeze(0)  # [1, R, ...] pool
            n_entries = step.cache.n_entries(step.seqs, plan.kv_source)  # [B, 1]
            paging = {"block_table": step.block_table(plan.kv_source), "page_size": group.page_size}
        else:
            glob = step.cache.globals[plan.kv_source]
            index_packed, index_scales = glob.index()
            n_entries, paging = glob.n, {}  # the contiguous call keeps its original signature
        n_visible = visible_entries(step.positions.expand(B, S), plan.ratio, n_entries)  # [B, S]
        args = (q_packed, q_scales, weights, index_packed, index_scales, n_visible)
        if plan.mode == LayerMode.FULL:
            topk = backend.indexer_topk(*args, cfg.index_topk, **paging)
            if plan.index == cfg.pool_source_layer:
                step.pool[plan.index] = backend.candidate_pool(*args, cfg.pool_block, cfg.pool_max_blocks, **paging)
        else:
            topk = backend.reindex_topk(*args, step.pool[plan.pool_source], cfg.pool_block, cfg.index_topk, **paging)
        step.topk[plan.index] = topk
        return topk
