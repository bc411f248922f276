"""KV cache manager: group-owned global caches, layer-owned SWA rings, compressor tail states.

* Global KV (one per KV source layer, read by every layer of its group): FP4 main latent
  (packed uint8 + E4M3 scale bytes) and FP4 index K (packed uint8 + E8M0 scale bytes), one
  entry per completed compression group. Grows with the context; buffers double when full.
* SWA ring (one per layer): the last ``window`` tokens' FP8 E4M3 codes + E8M0 scale bytes,
  slot ``position % window``. Fixed size per sequence.
* Compressor tail (one per KV source with ratio > 1): the ``Wkv(x)`` and ``Wgate(x)`` rows
  (float32) of an unfinished group waiting for its last token. Fixed size per sequence.

All sequences of a batch have the same length (equal-length prompts), so one token count
serves the whole batch. Sequences of their own lengths (continuous batching) live in the page
pools of :mod:`model.paged`, whose tests use this cache as the oracle. Sizes can be computed from the config alone with
:meth:`KVCache.layout`, :meth:`KVCache.global_bytes_per_token` and :meth:`KVCache.fixed_state_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.config import LayerMode, ModelConfig
from model.formats import FP8_GROUP

MLA_BYTES_PER_TOKEN = 61 * 576 * 2  # DeepSeek-V3 MLA: 61 layers x 576 bf16 = 70,272 B/token


def main_entry_bytes(cfg: ModelConfig) -> int:
    """Bytes of one FP4 main-KV entry: packed latent + one E4M3 scale byte per group (288 for v4.1-flash)."""
    return cfg.head_dim // 2 + cfg.head_dim // cfg.main_fp4_group


def index_entry_bytes(cfg: ModelConfig) -> int:
    """Bytes of one FP4 index-K entry: packed key + one E8M0 scale byte per group (68 for v4.1-flash)."""
    return cfg.index_head_dim // 2 + cfg.index_head_dim // cfg.index_fp4_group


def ring_bytes(cfg: ModelConfig) -> int:
    """Bytes of one layer's SWA ring per sequence: window x (D FP8 codes + D/32 scale bytes)."""
    return cfg.window * (cfg.head_dim + cfg.head_dim // FP8_GROUP)


def tail_bytes(cfg: ModelConfig, ratio: int) -> int:
    """Bytes of one compressor tail per sequence: (ratio - 1) pending tokens x (kv + gate) float32 rows."""
    return (ratio - 1) * 2 * cfg.head_dim * 4 if ratio > 1 else 0


@dataclass(frozen=True)
class GroupBytes:
    """One global KV group: its source layer, readers and bytes."""

    source: int
    region: str
    ratio: int
    readers: tuple[int, ...]  # layers attending to this group's KV (the source included)
    main_entry_bytes: int
    index_entry_bytes: int

    @property
    def entry_bytes(self) -> int:
        return self.main_entry_bytes + self.index_entry_bytes

    @property
    def bytes_per_token(self) -> float:
        return self.entry_bytes / self.ratio


class SwaRing:
    """One layer's SWA ring of FP8 window KV.

    Holds positions ``start .. end - 1`` (at most ``window`` of them) at slot ``pos % window``.
    """

    def __init__(self, batch: int, window: int, dim: int, device: torch.device | str) -> None:
        self.window = window
        self.codes = torch.zeros(batch, window, dim, dtype=torch.uint8, device=device)  # [B, W, D] E4M3
        self.scales = torch.zeros(batch, window, dim // FP8_GROUP, dtype=torch.uint8, device=device)  # [B, W, D/32] E8M0
        self.start = 0
        self.end = 0

    def reset(self, position: int) -> None:
        """Empty the ring; the next write starts at ``position`` (CED seeding of decoder rings)."""
        self.start = self.end = position

    def write(self, codes: torch.Tensor, scales: torch.Tensor, first: int) -> None:
        """Append tokens at positions ``first ..`` (codes [B, S, D], scales [B, S, D/32]); keeps the last ``window``."""
        if first != self.end:
            raise RuntimeError(f"SWA ring expects position {self.end}, got {first}")
        S = codes.shape[1]
        keep = min(S, self.window)
        pos = torch.arange(first + S - keep, first + S, device=codes.device)
        slots = pos % self.window
        self.codes[:, slots] = codes[:, S - keep :]
        self.scales[:, slots] = scales[:, S - keep :]
        self.end = first + S
        self.start = max(self.start, self.end - self.window)

    def window_indices(self, first: int, S: int, *, concatenated: bool) -> torch.Tensor:
        """Window rows for queries at positions ``first .. first + S - 1``.

        Each query sees positions ``i - window + 1 .. i`` (ascending). With ``concatenated``
        the rows index ``cat(ring, step tokens)``: ring slots for positions already held,
        ``window + (p - first)`` for the step's own tokens. Without it (S = 1, after
        :meth:`write`) they index the ring alone.

        Returns:
            int32 [S, window], -1 where the position is negative or not held.
        """
        dev = self.codes.device
        i = first + torch.arange(S, device=dev).unsqueeze(1)  # [S, 1]
        p = i - self.window + 1 + torch.arange(self.window, device=dev)  # [S, W]
        held = (p >= self.start) & (p < self.end)
        if concatenated:
            new = p >= first
            idx = torch.where(new, self.window + (p - first), p % self.window)
            valid = (p >= 0) & (new | held)
        else:
            idx, valid = p % self.window, (p >= 0) & held
        return torch.where(valid, idx, torch.full_like(idx, -1)).to(torch.int32)


class GlobalKV:
    """One group's global cache: FP4 main KV and FP4 index K, stored packed, one entry per group of ``ratio`` tokens."""

    def __init__(self, batch: int, cfg: ModelConfig, ratio: int, capacity: int, device: torch.device | str) -> None:
        self.ratio = ratio
        self.n = 0
        D, Di = cfg.head_dim, cfg.index_head_dim
        cap = max(capacity, 1)

        def buf(width: int) -> torch.Tensor:
            return torch.zeros(batch, cap, width, dtype=torch.uint8, device=device)

        self.main_packed = buf(D // 2)  # [B, cap, D/2] E2M1 pairs
        self.main_scales = buf(D // cfg.main_fp4_group)  # [B, cap, D/16] E4M3
        self.index_packed = buf(Di // 2)  # [B, cap, Di/2] E2M1 pairs
        self.index_scales = buf(Di // cfg.index_fp4_group)  # [B, cap, Di/32] E8M0

    @property
    def capacity(self) -> int:
        return self.main_packed.shape[1]

    def append(self, main_packed: torch.Tensor, main_scales: torch.Tensor, index_packed: torch.Tensor, index_scales: torch.Tensor) -> None:
        """Append G entries (each tensor [B, G, ...] uint8)."""
        G = main_packed.shape[1]
        if self.n + G > self.capacity:
            self._grow(max(self.n + G, 2 * self.capacity))
        sl = slice(self.n, self.n + G)
        self.main_packed[:, sl] = main_packed
        self.main_scales[:, sl] = main_scales
        self.index_packed[:, sl] = index_packed
        self.index_scales[:, sl] = index_scales
        self.n += G

    def _grow(self, capacity: int) -> None:
        for name in ("main_packed", "main_scales", "index_packed", "index_scales"):
            old = getattr(self, name)
            new = old.new_zeros(old.shape[0], capacity, old.shape[2])
            new[:, : self.n] = old[:, : self.n]
            setattr(self, name, new)

    def main(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the filled main KV: packed [B, n, D/2], scales [B, n, D/16]."""
        return self.main_packed[:, : self.n], self.main_scales[:, : self.n]

    def index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the filled index K: packed [B, n, Di/2], scales [B, n, Di/32]."""
        return self.index_packed[:, : self.n], self.index_scales[:, : self.n]


class CompressorTail:
    """The projections of an unfinished compression group (ratio - 1 tokens at most), float32."""

    def __init__(self, batch: int, ratio: int, dim: int, device: torch.device | str, dtype: torch.dtype = torch.float32) -> None:
        self.kv = torch.zeros(batch, ratio - 1, dim, dtype=dtype, device=device)  # [B, r-1, D]
        self.gate = torch.zeros(batch, ratio - 1, dim, dtype=dtype, device=device)  # [B, r-1, D]
        self.count = 0

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The pending rows: kv, gate [B, count, D]."""
        return self.kv[:, : self.count], self.gate[:, : self.count]

    def store(self, kv: torch.Tensor, gate: torch.Tensor) -> None:
        """Keep the rows of a new unfinished group ([B, c, D], c < ratio)."""
        c = kv.shape[1]
        self.kv[:, :c] = kv
        self.gate[:, :c] = gate
        self.count = c


class KVCache:
    """All decode state of one batch of equal-length sequences.

    Attributes:
        rings: one :class:`SwaRing` per layer.
        globals: KV source layer -> :class:`GlobalKV`.
        tails: KV source layer with ratio > 1 -> :class:`CompressorTail`.
        n_tokens: tokens consumed so far (the position of the next token).

    ``state_dtype`` is the tails' dtype: float32, float64 for a float64 model (the byte counts assume float32).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        batch: int,
        device: torch.device | str = "cpu",
        capacity_tokens: int = 256,
        state_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.cfg = cfg
        self.batch = batch
        self.n_tokens = 0
        self.rings = [SwaRing(batch, cfg.window, cfg.head_dim, device) for _ in range(cfg.n_layers)]
        self.globals: dict[int, GlobalKV] = {}
        self.tails: dict[int, CompressorTail] = {}
        for src in cfg.kv_source_layers:
            ratio = cfg.compress_ratios[src]
            self.globals[src] = GlobalKV(batch, cfg, ratio, -(-capacity_tokens // ratio), device)
            if ratio > 1:
                self.tails[src] = CompressorTail(batch, ratio, cfg.head_dim, device, state_dtype)

    # -- sizes from the config alone ------------------------------------------------------------

    @staticmethod
    def layout(cfg: ModelConfig) -> list[GroupBytes]:
        """One :class:`GroupBytes` per KV source layer, in layer order."""
        plans = cfg.layer_plan()
        rows = []
        for src in sorted(cfg.kv_source_layers):
            readers = tuple(p.index for p in plans if p.kv_source == src and p.mode != LayerMode.SWA_ONLY)
            rows.append(
                GroupBytes(src, plans[src].region, cfg.compress_ratios[src], readers, main_entry_bytes(cfg), index_entry_bytes(cfg))
            )
        return rows

    @staticmethod
    def global_bytes_per_token(cfg: ModelConfig) -> float:
        """Global (context-growing) KV bytes per token per sequence: sum over groups of entry bytes / ratio (890 for v4.1-flash)."""
        return sum(g.bytes_per_token for g in KVCache.layout(cfg))

    @staticmethod
    def fixed_state_bytes(cfg: ModelConfig) -> dict[str, int]:
        """Per-sequence state that does not grow with the context: SWA rings, compressor tails, total."""
        rings = cfg.n_layers * ring_bytes(cfg)
        tails = sum(tail_bytes(cfg, cfg.compress_ratios[s]) for s in cfg.kv_source_layers)
        return {"swa_rings": rings, "compressor_tails": tails, "total": rings + tails}

    # -- this cache ----------------------------------------------------------------------------

    def global_bytes_used(self) -> int:
        """Bytes of filled global entries per sequence (entries x entry bytes over all groups)."""
        per_entry = main_entry_bytes(self.cfg) + index_entry_bytes(self.cfg)
        return sum(g.n for g in self.globals.values()) * per_entry

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every stored tensor by a readable name (for inspection and tests)."""
        out = {}
        for i, ring in enumerate(self.rings):
            out[f"ring{i}.codes"], out[f"ring{i}.scales"] = ring.codes, ring.scales
        for src, g in self.globals.items():
            for name in ("main_packed", "main_scales", "index_packed", "index_scales"):
                out[f"global{src}.{name}"] = getattr(g, name)
        for src, t in self.tails.items():
            out[f"tail{src}.kv"], out[f"tail{src}.gate"] = t.kv, t.gate
        return out
