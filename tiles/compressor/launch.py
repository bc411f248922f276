"""Building the kernel for a config and shape, the prepared forms of Wk (per tensor, cached), and the launch
arguments, for :mod:`tiles.compressor.api` and the tile."""

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from tiles.compressor.kernel import compress_kernel
from tiles.compressor.projection import wk_fragment_order, wk_fragment_order_f16
from tiles.core.arch import Arch
from tiles.core.contract import Config, TileError


def build_kernel(arch: Arch, ratio: int, cfg: Config):
    """The compiled compressor for a full config (see :meth:`CompressorTile.search_space`)."""
    return compress_kernel(
        arch.nvcc_arch,
        ratio,
        cfg["block_g"],
        cfg["threads"],
        cfg["proj"],
        cfg["k_chunk"],
        cfg.get("load", "direct"),
        cfg.get("encode", "divide"),
        cfg.get("ctas_per_sm", 1),
        cfg.get("wk", "hi_lo"),
        kernel_schedule(cfg),
        cfg.get("wk_stages", 2),
        cfg.get("kv_load", "slabs"),
        cfg.get("proj_operands", "smem"),
        cfg.get("pool_math", "ieee"),
        cfg.get("proj_accumulators", "shared"),
        cfg.get("norm_pass", "separate"),
        cfg.get("proj_k_split", 1),
        cfg.get("main_pass", "separate"),
        cfg.get("proj_latent", "fp32"),
        cfg.get("proj_out", "k_s"),
        cfg.get("main_store", "bulk"),
        cfg.get("proj_pipeline", "near"),
    )


def kernel_schedule(cfg: Config) -> str:
    """The kernel's schedule: "flat" (no producer warpgroup) whenever several CTAs share an SM, else the config's
    ``schedule`` ("ws", the warp-specialised one-CTA kernel, unless named)."""
    return "flat" if cfg.get("ctas_per_sm", 1) > 1 else cfg.get("schedule", "ws")


def wk_args(kernel, wk: torch.Tensor, prepared: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's (wk_hi, wk_lo) arguments for fp32 ``wk`` [128, 512]: the TF32 split, (``wk="fp32"``) Wk itself in
    the first slot (the kernel splits it; the second slot is not read), or (``proj_operands="registers"``/``"wgmma"``) Wk
    in :func:`wk_fragment_order` (32 columns per group with ``proj_k_split=2``), also in the first slot; or (``proj="f16x3"``)
    :func:`wk_fragment_order_f16`'s scaled fp16 fragments and the unscale. ``prepared``: a dict that keeps the split or the
    reordered copy of this ``wk`` across calls (a per-layer constant: made once)."""
    form = getattr(kernel, "csa2_wk", "hi_lo")
    if form == "fp32":
        w = wk.float().contiguous()
        return w, w
    prepared = {} if prepared is None else prepared
    if form not in prepared:
        if form in ("fragments_f16", "fragments_f16_k2"):
            prepared[form] = wk_fragment_order_f16(wk, 32 if form == "fragments_f16_k2" else 16)
        elif form in ("fragments", "fragments_k2"):
            w = wk_fragment_order(wk, 32 if form == "fragments_k2" else 16)
            prepared[form] = (w, w)
        else:
            prepared[form] = split_tf32(wk)
    return prepared[form]


# compress()'s prepared Wk forms per weight tensor (the TF32 split, the fragment order): a layer's Wk is a constant, so
# they are made on its first call, not on every call (a reorder of 256 KiB and its launches per layer and decode step).
# Keyed weakly by the tensor; an in-place write to it (its version counter moves) makes them again.
_PREPARED_WK = WeakTensorKeyDictionary()


def prepared_forms(wk: torch.Tensor) -> dict:
    """The ``prepared`` dict of :func:`wk_args` that belongs to this ``wk`` tensor as it is now."""
    version, forms = _PREPARED_WK.get(wk, (None, None))
    if version != wk._version:
        forms = {}
        _PREPARED_WK[wk] = (wk._version, forms)
    return forms


def split_tf32(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [..] -> (high part with the low 13 mantissa bits cleared = exact TF32, fp32 remainder)."""
    wf = w.float().contiguous()
    hi = (wf.view(torch.int32) & -8192).view(torch.float32)  # 0xFFFFE000
    return hi, wf - hi


def check_f32(t: torch.Tensor, name: str, shape: tuple[int, ...]) -> None:
    if t.dtype != torch.float32:
        raise TileError(f"{name} must be float32, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise TileError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
