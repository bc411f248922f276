"""Model configuration, presets and the layer map derived from them (spec section 1).

Layer modes are never listed per preset: they follow from ``compress_ratios``,
``kv_source_layers`` and ``index_source_layers``:

* ratio 0 (no compression) -> SWA only
* KV source and index source -> Full
* index source only -> Reindex
* neither -> Reuse (reads the KV of the nearest earlier KV source of its region)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum

from model.ops.rope import RopeConfig


class LayerMode(str, Enum):
    SWA_ONLY = "SWA only"
    FULL = "Full"
    REINDEX = "Reindex"
    REUSE = "Reuse"


class ConfigError(ValueError):
    """An inconsistent or unknown model configuration."""


@dataclass(frozen=True)
class LayerPlan:
    """What one layer does, derived from the config."""

    index: int
    region: str  # "encoder" | "decoder"
    ratio: int  # 0 = no compression (SWA only)
    mode: LayerMode
    kv_source: int | None  # layer whose compressor owns the global KV this layer reads
    index_source: int | None  # layer whose top-k this layer uses (itself for Full/Reindex)
    pool_source: int | None  # layer whose candidate pool a Reindex layer searches


@dataclass(frozen=True)
class ModelConfig:
    name: str
    dim: int
    n_layers: int
    n_encoder_layers: int
    n_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    compress_ratios: tuple[int, ...]
    kv_source_layers: tuple[int, ...]
    index_source_layers: tuple[int, ...]
    index_heads: int
    index_head_dim: int
    index_topk: int
    pool_source_layer: int | None
    pool_block: int
    pool_max_blocks: int
    vocab_size: int
    ffn_inter: int
    max_seq_len: int
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn_factor: float = 16.0
    yarn_original_seq_len: int = 65536
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    norm_eps: float = 1e-20  # every RMSNorm; the official V4.1 configuration's value
    main_fp4_group: int = 16
    index_fp4_group: int = 32
    n_routed_experts: int = 0  # 0 = dense SwiGLU FFN; > 0 = small MoE option
    n_active_experts: int = 0
    moe_inter: int = 0
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        validate(self)

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5

    def swa_rope(self) -> RopeConfig:
        return RopeConfig(rope_dim=self.rope_dim, theta=self.rope_theta)

    def compress_rope(self) -> RopeConfig:
        return RopeConfig(
            rope_dim=self.rope_dim,
            theta=self.compress_rope_theta,
            yarn_factor=self.yarn_factor,
            original_seq_len=self.yarn_original_seq_len,
            beta_fast=self.yarn_beta_fast,
            beta_slow=self.yarn_beta_slow,
        )

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def layer_plan(self) -> list[LayerPlan]:
        return layer_plan(self)


def _region(cfg: ModelConfig, layer: int) -> str:
    return "encoder" if layer < cfg.n_encoder_layers else "decoder"


def validate(cfg: ModelConfig) -> None:
    """Reject configurations whose layer map or sizes cannot work, naming the field to fix."""
    n = cfg.n_layers
    if len(cfg.compress_ratios) != n:
        raise ConfigError(f"{cfg.name}: compress_ratios has {len(cfg.compress_ratios)} entries for {n} layers")
    if not 0 < cfg.n_encoder_layers <= n:
        raise ConfigError(f"{cfg.name}: n_encoder_layers={cfg.n_encoder_layers} must be in 1..{n}")
    bad_ratio = [i for i, r in enumerate(cfg.compress_ratios) if r not in (0, 1, 2)]
    if bad_ratio:
        raise ConfigError(f"{cfg.name}: compress ratio must be 0 (SWA only), 1 or 2; layers {bad_ratio} are not")
    kv, idx = set(cfg.kv_source_layers), set(cfg.index_source_layers)
    for name, layers in (("kv_source_layers", kv), ("index_source_layers", idx)):
        outside = sorted(i for i in layers if not 0 <= i < n)
        if outside:
            raise ConfigError(f"{cfg.name}: {name} names layers {outside} outside 0..{n - 1}")
        swa = sorted(i for i in layers if cfg.compress_ratios[i] == 0)
        if swa:
            raise ConfigError(f"{cfg.name}: {name} names SWA-only layers {swa} (compress ratio 0)")
    if not kv <= idx:
        raise ConfigError(f"{cfg.name}: KV source layers {sorted(kv - idx)} must also be index sources (a Full layer runs its indexer)")
    for i, r in enumerate(cfg.compress_ratios):
        if r == 0:
            continue
        src = _kv_source(cfg, i)
        if src is None:
            raise ConfigError(f"{cfg.name}: layer {i} compresses but no KV source layer precedes it in the {_region(cfg, i)}")
        if cfg.compress_ratios[src] != r:
            raise ConfigError(f"{cfg.name}: layer {i} has ratio {r} but its KV source {src} has ratio {cfg.compress_ratios[src]}")
    reindex = sorted(idx - kv)
    if reindex and (cfg.pool_source_layer is None or cfg.pool_source_layer not in kv):
        raise ConfigError(f"{cfg.name}: Reindex layers {reindex} need pool_source_layer to be a KV source layer")
    if cfg.pool_source_layer is not None and any(i < cfg.pool_source_layer for i in reindex if _region(cfg, i) == "decoder"):
        raise ConfigError(f"{cfg.name}: a Reindex layer precedes the pool source layer {cfg.pool_source_layer}")
    if cfg.n_heads * cfg.head_dim % cfg.o_groups != 0:
        raise ConfigError(f"{cfg.name}: n_heads * head_dim must divide into o_groups={cfg.o_groups}")
    if cfg.head_dim % cfg.main_fp4_group or cfg.head_dim % 32 or cfg.index_head_dim % cfg.index_fp4_group:
        raise ConfigError(f"{cfg.name}: head dims must be multiples of the FP4/FP8 group sizes")
    if cfg.rope_dim % 2 or cfg.rope_dim > min(cfg.head_dim, cfg.index_head_dim):
        raise ConfigError(f"{cfg.name}: rope_dim={cfg.rope_dim} must be even and fit in the head dims")
    if (cfg.main_fp4_group, cfg.index_fp4_group) != (16, 32):
        raise ConfigError(f"{cfg.name}: the storage formats fix main_fp4_group=16 (E4M3 scales) and index_fp4_group=32 (E8M0 scales)")
    if cfg.pool_source_layer is not None and cfg.pool_source_layer not in kv:
        raise ConfigError(f"{cfg.name}: pool_source_layer={cfg.pool_source_layer} must be a KV source layer")
    plans = layer_plan(cfg)
    for p in plans:
        if p.mode == LayerMode.SWA_ONLY:
            continue
        if p.index_source is None or plans[p.index_source].kv_source != p.kv_source:
            raise ConfigError(
                f"{cfg.name}: layer {p.index} reads KV source {p.kv_source} but its index source {p.index_source} ranks another group;"
                " put an index source at or after its KV source"
            )
        if p.mode == LayerMode.REINDEX and p.kv_source != cfg.pool_source_layer:
            raise ConfigError(f"{cfg.name}: Reindex layer {p.index} must read the pool source's KV (layer {cfg.pool_source_layer})")
    for name, value in (
        ("window", cfg.window),
        ("index_topk", cfg.index_topk),
        ("pool_block", cfg.pool_block),
        ("pool_max_blocks", cfg.pool_max_blocks),
        ("max_seq_len", cfg.max_seq_len),
    ):
        if value < 1:
            raise ConfigError(f"{cfg.name}: {name}={value} must be at least 1")


def _kv_source(cfg: ModelConfig, layer: int) -> int | None:
    """The nearest KV source at or before ``layer`` in the same region."""
    region = _region(cfg, layer)
    candidates = [s for s in cfg.kv_source_layers if s <= layer and _region(cfg, s) == region]
    return max(candidates) if candidates else None


def layer_plan(cfg: ModelConfig) -> list[LayerPlan]:
    """One :class:`LayerPlan` per layer."""
    kv, idx = set(cfg.kv_source_layers), set(cfg.index_source_layers)
    plans = []
    for i, r in enumerate(cfg.compress_ratios):
        region = _region(cfg, i)
        if r == 0:
            plans.append(LayerPlan(i, region, 0, LayerMode.SWA_ONLY, None, None, None))
            continue
        mode = LayerMode.FULL if i in kv else LayerMode.REINDEX if i in idx else LayerMode.REUSE
        kv_src = _kv_source(cfg, i)
        earlier_idx = [s for s in idx if s <= i and _region(cfg, s) == region]
        index_src = max(earlier_idx) if earlier_idx else None
        pool_src = cfg.pool_source_layer if mode == LayerMode.REINDEX else None
        plans.append(LayerPlan(i, region, r, mode, kv_src, index_src, pool_src))
    return plans


def _flash() -> ModelConfig:
    return ModelConfig(
        name="v4.1-flash",
        dim=5120,
        n_layers=40,
        n_encoder_layers=20,
        n_heads=64,
        head_dim=512,
        rope_dim=64,
        q_lora_rank=1280,
        o_groups=8,
        o_lora_rank=1024,
        window=128,
        compress_ratios=(0, 0) + (2,) * 18 + (1,) * 20,
        kv_source_layers=(2, 8, 14, 20),
        index_source_layers=(2, 8, 14, 20, 24, 28, 32, 36),
        index_heads=32,
        index_head_dim=128,
        index_topk=512,
        pool_source_layer=20,
        pool_block=8,
        pool_max_blocks=2048,
        vocab_size=129280,
        ffn_inter=7 * 2304,
        max_seq_len=1 << 20,
    )


def _small() -> ModelConfig:
    # The v4.1-flash rhythm at 16 layers: 2 SWA-only, encoder sources every 3 layers, one
    # decoder source with Reindex layers every 2; about 100M parameters with the embeddings.
    return ModelConfig(
        name="small",
        dim=768,
        n_layers=16,
        n_encoder_layers=8,
        n_heads=8,
        head_dim=128,
        rope_dim=32,
        q_lora_rank=256,
        o_groups=2,
        o_lora_rank=256,
        window=64,
        compress_ratios=(0, 0) + (2,) * 6 + (1,) * 8,
        kv_source_layers=(2, 5, 8),
        index_source_layers=(2, 5, 8, 10, 12, 14),
        index_heads=8,
        index_head_dim=64,
        index_topk=128,
        pool_source_layer=8,
        pool_block=8,
        pool_max_blocks=64,
        vocab_size=32000,
        ffn_inter=2048,
        max_seq_len=1 << 16,
    )


def _tiny() -> ModelConfig:
    # Small enough for fast CPU tests, with window, top-k, pool and group sizes small enough
    # that sequences of a few dozen tokens cross every boundary.
    return ModelConfig(
        name="tiny",
        dim=64,
        n_layers=8,
        n_encoder_layers=4,
        n_heads=4,
        head_dim=32,
        rope_dim=8,
        q_lora_rank=32,
        o_groups=2,
        o_lora_rank=32,
        window=8,
        compress_ratios=(0, 2, 2, 2, 1, 1, 1, 1),
        kv_source_layers=(1, 3, 4),
        index_source_layers=(1, 3, 4, 6),
        index_heads=2,
        index_head_dim=32,
        index_topk=6,
        pool_source_layer=4,
        pool_block=2,
        pool_max_blocks=4,
        vocab_size=97,
        ffn_inter=96,
        max_seq_len=512,
    )


def _flash_mini() -> ModelConfig:
    # The v4.1-flash attention geometry (64 heads x 512, indexer 32 x 128, window 128, top-k 512,
    # pool 2048 x 8, FP4 groups) in a narrow 8-layer model: every kernel of the tiles backend runs
    # at its real shapes, while the model builds in a second. For GPU checks of tiles vs torch.
    return _flash().replace(
        name="flash-mini",
        dim=1024,
        n_layers=8,
        n_encoder_layers=4,
        q_lora_rank=256,
        o_lora_rank=256,
        compress_ratios=(0, 2, 2, 2, 1, 1, 1, 1),
        kv_source_layers=(1, 4),
        index_source_layers=(1, 4, 6),
        pool_source_layer=4,
        vocab_size=1024,
        ffn_inter=1024,
        max_seq_len=1 << 17,
    )


PRESETS = {"v4.1-flash": _flash, "small": _small, "tiny": _tiny, "flash-mini": _flash_mini}


def preset(name: str) -> ModelConfig:
    """The named preset: one of ``v4.1-flash``, ``small``, ``tiny``."""
    try:
        return PRESETS[name]()
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}: choose one of {', '.join(PRESETS)}") from None
