"""The public function ``compress``: input checks with clear errors, the config for the call (explicit, tuned winner, or
default: :func:`tiles.core.dispatch.call_config`), then one launch writing both caches. The checks, the config and the
kernel are settled on the first call of a signature and kept (:func:`tiles.core.dispatch.plan`)."""

import torch

from tiles.compressor.common import DI, INDEX_GROUP, MAIN_GROUP, ROPE, D
from tiles.compressor.launch import build_kernel, check_f32, prepared_forms, wk_args
from tiles.compressor.tile import COMPRESSOR
from tiles.core.contract import Config, TileError
from tiles.core.dispatch import call_config, frozen, plan, signature, target
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
    tensors = (kv, gate, norm_weight, cos, sin, wk, k_norm_weight, tail_kv, tail_gate)
    try:
        key = ("compress", ratio, float(eps), frozen(config), signature(*tensors))
    except (AttributeError, TypeError):  # not tensors, or an unhashable config: the checks say what is wrong
        key = None
    launch = _launch(ratio, eps, config, *tensors) if key is None else plan(key, lambda: _launch(ratio, eps, config, *tensors))
    if tail_kv is not None:
        kv = torch.cat([tail_kv.unsqueeze(1), kv], dim=1)  # [B, S+1, D]: a decode step's few rows
        gate = torch.cat([tail_gate.unsqueeze(1), gate], dim=1)
    B, G = kv.shape[0], launch.groups
    dev = kv.device
    outs = (
        torch.empty(B, G, D // 2, dtype=torch.uint8, device=dev),  # [B, G, 256]
        torch.empty(B, G, D // MAIN_GROUP, dtype=torch.uint8, device=dev),  # [B, G, 32]
        torch.empty(B, G, DI // 2, dtype=torch.uint8, device=dev),  # [B, G, 64]
        torch.empty(B, G, DI // INDEX_GROUP, dtype=torch.uint8, device=dev),  # [B, G, 4]
    )
    if G == 0:
        return outs
    rows = G * ratio
    kv = kv[:, :rows].contiguous()
    gate = kv if ratio == 1 else gate[:, :rows].contiguous()  # ratio 1 reads no gate
    kernel = launch.kernel
    wk_hi, wk_lo = wk_args(kernel, wk, prepared_forms(wk))
    kernel(
        kv, gate, norm_weight.contiguous(), cos.contiguous(), sin.contiguous(), wk_hi, wk_lo, k_norm_weight.contiguous(), launch.eps, *outs
    )
    return outs


class _Launch:
    """One call signature's compressor: the complete groups it writes, the kernel (None when there are none) and the
    epsilon as a device tensor (made once: a fill, not a host copy, so capturable)."""

    def __init__(self, groups: int, kernel, eps: torch.Tensor | None):
        self.groups, self.kernel, self.eps = groups, kernel, eps


def _launch(
    ratio: int, eps: float, config: Config | None, kv, gate, norm_weight, cos, sin, wk, k_norm_weight, tail_kv, tail_gate
) -> _Launch:
    """Check one call's tensors (every check of :func:`compress`) and build its launch."""
    if ratio not in (1, 2):
        raise TileError(f"ratio must be 1 or 2, got {ratio}")
    if not isinstance(kv, torch.Tensor) or kv.dim() != 3 or kv.shape[-1] != D:
        raise TileError(f"kv must be float32 [B, S, {D}], got {tuple(getattr(kv, 'shape', ()))}")
    B, S, _ = kv.shape
    check_f32(kv, "kv", (B, S, D))
    if ratio == 2:
        if gate is None:
            raise TileError("ratio 2 needs a gate [B, S, 512]")
        check_f32(gate, "gate", (B, S, D))
    if (tail_kv is None) != (tail_gate is None):
        raise TileError("pass tail_kv and tail_gate together (or neither)")
    tail = 0
    if tail_kv is not None:
        if ratio != 2:
            raise TileError("a tail state only exists for ratio 2")
        check_f32(tail_kv, "tail_kv", (B, D))
        check_f32(tail_gate, "tail_gate", (B, D))
        tail = 1
    G = (S + tail) // ratio
    check_f32(norm_weight, "norm_weight", (D,))
    check_f32(cos, "cos", (G, ROPE // 2))
    check_f32(sin, "sin", (G, ROPE // 2))
    check_f32(wk, "wk", (DI, D))
    check_f32(k_norm_weight, "k_norm_weight", (DI,))
    others = (("gate", gate), ("tail_kv", tail_kv), ("tail_gate", tail_gate), ("norm_weight", norm_weight), ("cos", cos), ("sin", sin))
    for name, t in (*others, ("wk", wk), ("k_norm_weight", k_norm_weight)):
        if t is not None and t.device != kv.device:
            raise TileError(f"{name} is on {t.device} but kv is on {kv.device}")
    if G == 0:
        return _Launch(0, None, None)
    arch, gpu = target(kv, "compress")
    dims = {"B": B, "S": G * ratio, "ratio": ratio, "dim": flash().dim, "D": D, "Di": DI}
    cfg = call_config(COMPRESSOR, dims, arch, gpu, config)
    eps_t = torch.full((1,), eps, dtype=torch.float32, device=kv.device)  # [1]
    return _Launch(G, build_kernel(arch, ratio, cfg), eps_t)
