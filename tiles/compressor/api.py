"""The public function ``compress``: input checks with clear errors, the config for the call (explicit, tuned winner, or
default), then one launch writing both caches."""

import torch

from tiles.compressor.common import DI, INDEX_GROUP, MAIN_GROUP, ROPE, D
from tiles.compressor.launch import build_kernel, check_f32, prepared_forms, wk_args
from tiles.compressor.tile import COMPRESSOR
from tiles.core.calls import pick_config, tensor_arch
from tiles.core.contract import Config, Shape, TileError
from tiles.core.shapes import flash


def compress(
    kv: torch.Tensor,
    gate: torch.Tensor | None,
    ratio: int,
    norm_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    wk: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    config: Config | None = None,
    tail_kv: torch.Tensor | None = None,
    tail_gate: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Compress complete groups of tokens into the main and index FP4 caches (one kernel).

    Args:
        kv: fp32 [B, S, 512] the Wkv projections of the new tokens.
        gate: fp32 [B, S, 512] the Wgate projections (ratio 2), None for ratio 1.
        ratio: 1 or 2.
        norm_weight: fp32 [512] the compressor's RMSNorm weight.
        cos, sin: fp32 [G, 32] RoPE tables at each group's first position (interleaved pairs,
            as :func:`model.ops.rope.apply_rope`), G = complete groups (see below).
        wk: fp32 [128, 512] the index-K projection; k_norm_weight: fp32 [128].
        eps: RMSNorm epsilon (both norms).
        config: tile parameters (see :class:`CompressorTile`); None = tuned winner or default.
        tail_kv, tail_gate: fp32 [B, 512] the stored first token of an unfinished group
            (ratio 2 decode), placed before ``kv``/``gate``; both or neither.
    Returns:
        main_packed uint8 [B, G, 256], main_scales uint8 [B, G, 32] (E4M3),
        idx_packed uint8 [B, G, 64], idx_scales uint8 [B, G, 4] (E8M0), with
        G = (S + tail) // ratio. With an odd token count (ratio 2) the last token is left
        over: the caller keeps ``kv[:, -1]``, ``gate[:, -1]`` as the next tail.
    """
    if ratio not in (1, 2):
        raise TileError(f"ratio must be 1 or 2, got {ratio}")
    if kv.dim() != 3 or kv.shape[-1] != D:
        raise TileError(f"kv must be float32 [B, S, {D}], got {tuple(kv.shape)}")
    B, S, _ = kv.shape
    check_f32(kv, "kv", (B, S, D))
    if ratio == 2:
        if gate is None:
            raise TileError("ratio 2 needs a gate [B, S, 512]")
        check_f32(gate, "gate", (B, S, D))
    if (tail_kv is None) != (tail_gate is None):
        raise TileError("pass tail_kv and tail_gate together (or neither)")
    if tail_kv is not None:
        if ratio != 2:
            raise TileError("a tail state only exists for ratio 2")
        check_f32(tail_kv, "tail_kv", (B, D))
        check_f32(tail_gate, "tail_gate", (B, D))
        kv = torch.cat([tail_kv.unsqueeze(1), kv], dim=1)  # [B, S+1, D]: a decode step's few rows
        gate = torch.cat([tail_gate.unsqueeze(1), gate], dim=1)
    G = kv.shape[1] // ratio
    check_f32(norm_weight, "norm_weight", (D,))
    check_f32(cos, "cos", (G, ROPE // 2))
    check_f32(sin, "sin", (G, ROPE // 2))
    check_f32(wk, "wk", (DI, D))
    check_f32(k_norm_weight, "k_norm_weight", (DI,))
    for name, t in (("norm_weight", norm_weight), ("cos", cos), ("sin", sin), ("wk", wk), ("k_norm_weight", k_norm_weight)):
        if t.device != kv.device:
            raise TileError(f"{name} is on {t.device} but kv is on {kv.device}")
    dev = kv.device
    outs = (
        torch.empty(B, G, D // 2, dtype=torch.uint8, device=dev),  # [B, G, 256]
        torch.empty(B, G, D // MAIN_GROUP, dtype=torch.uint8, device=dev),  # [B, G, 32]
        torch.empty(B, G, DI // 2, dtype=torch.uint8, device=dev),  # [B, G, 64]
        torch.empty(B, G, DI // INDEX_GROUP, dtype=torch.uint8, device=dev),  # [B, G, 4]
    )
    if G == 0:
        return outs
    arch = tensor_arch(kv, "compress")
    shape = Shape("call", "any", {"B": B, "S": G * ratio, "ratio": ratio, "dim": flash().dim, "D": D, "Di": DI})
    cfg = pick_config(COMPRESSOR, shape, arch, config)
    kv = kv[:, : G * ratio].contiguous()
    gate = kv if ratio == 1 else gate[:, : G * ratio].contiguous()  # ratio 1 reads no gate
    eps_t = torch.full((1,), eps, dtype=torch.float32, device=dev)  # a fill, not a host copy: capturable
    kernel = build_kernel(arch, ratio, cfg)
    wk_hi, wk_lo = wk_args(kernel, wk, prepared_forms(wk))
    kernel(kv, gate, norm_weight.contiguous(), cos.contiguous(), sin.contiguous(), wk_hi, wk_lo, k_norm_weight.contiguous(), eps_t, *outs)
    return outs
