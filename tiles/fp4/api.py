"""The public functions ``fp4_quantize`` / ``fp4_dequantize``: checks with clear errors, the config for the call (explicit,
tuned winner, or default: :func:`tiles.core.dispatch.call_config`), one launch."""

from __future__ import annotations

import math

import torch

from tiles.core.contract import Config, Shape, Tile, TileError
from tiles.core.dispatch import call_config, target
from tiles.fp4.kernel import SCALE_GROUP, TL_DTYPE
from tiles.fp4.space import staging_fits
from tiles.fp4.tile import TILES, dequant_kernel, quant_kernel


# --------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------
def _check_format(group_size: int, scale_format: str) -> None:
    if scale_format not in SCALE_GROUP:
        raise TileError(f"unknown scale_format {scale_format!r}: use 'e4m3' (group 16) or 'e8m0' (group 32)")
    if group_size != SCALE_GROUP[scale_format]:
        raise TileError(f"scale_format {scale_format!r} goes with group_size={SCALE_GROUP[scale_format]}, got {group_size}")


def _check_cuda(t: torch.Tensor, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TileError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cuda":
        raise TileError(f"{what} is on {t.device}: the FP4 kernels run on a CUDA device (model.formats has the CPU reference)")
    if not t.is_contiguous():
        raise TileError(f"{what} must be contiguous (call .contiguous() first)")


def tile_for(quantise: bool, scale_format: str) -> Tile:
    """The FP4 tile a call runs on: quantise or dequantise, main-KV (e4m3) or index (e8m0) format."""
    return TILES[(0 if quantise else 2) + (0 if scale_format == "e4m3" else 1)]


def fp4_quantize(
    x: torch.Tensor, group_size: int = 16, scale_format: str = "e4m3", config: Config | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise to packed FP4 E2M1 with one scale per group, bit-exact with :func:`model.formats.fp4_quantize`.

    Args:
        x: bfloat16 or float32 [..., N] on a CUDA device, contiguous; N a multiple of ``group_size``.
        group_size: 16 with ``"e4m3"`` (main KV, N = 512) or 32 with ``"e8m0"`` (index K/Q, N = 128).
        config: tile parameters (see :func:`fp4_search_space`); None picks the tuned or default config.
            float32 input always runs ``code='divide'`` (the thresholds are exact for bf16 only).
    Returns:
        packed uint8 [..., N // 2] (even element in the low nibble) and scales uint8 [..., N // group_size]
        (raw E4M3 or E8M0 bytes).
    """
    _check_format(group_size, scale_format)
    _check_cuda(x, "x")
    if x.dtype not in TL_DTYPE:
        raise TileError(f"x must be bfloat16 or float32, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] % group_size:
        raise TileError(f"x has shape {tuple(x.shape)}: the last dim must be a multiple of group_size={group_size}")
    n = x.shape[-1]
    x2 = x.reshape(-1, n)  # [rows, N]
    rows = x2.shape[0]
    packed = torch.empty(*x.shape[:-1], n // 2, dtype=torch.uint8, device=x.device)  # [..., N // 2]
    scales = torch.empty(*x.shape[:-1], n // group_size, dtype=torch.uint8, device=x.device)  # [..., N // group]
    if rows == 0:
        return packed, scales
    arch, gpu = target(x, "fp4_quantize")
    tile = tile_for(True, scale_format)
    dims = {"rows": rows, "dim": n}
    c = call_config(tile, dims, arch, gpu, config)
    if x.dtype == torch.float32 and (why := staging_fits(c, Shape("call", "any", dims), arch, 4, scale_format)):
        raise TileError(f"config {c} does not fit float32 input: {why}")
    kernel = quant_kernel(n, scale_format, TL_DTYPE[x.dtype], c, arch)
    kernel(x2, packed.view(rows, n // 2), scales.view(rows, n // group_size))
    return packed, scales


def fp4_dequantize(
    packed: torch.Tensor,
    scales: torch.Tensor,
    group_size: int = 16,
    scale_format: str = "e4m3",
    out_dtype: torch.dtype = torch.bfloat16,
    config: Config | None = None,
) -> torch.Tensor:
    """Inverse of :func:`fp4_quantize`, value for value :func:`model.formats.fp4_dequantize` (cast to ``out_dtype``).

    Args:
        packed: uint8 [..., N // 2] on a CUDA device, contiguous.
        scales: uint8 [..., N // group_size], same leading dims and device, contiguous.
        out_dtype: torch.bfloat16 (exact: every FP4 value times an E4M3/E8M0 scale fits in 8 bits) or torch.float32.
    Returns:
        out_dtype [..., N].
    """
    _check_format(group_size, scale_format)
    _check_cuda(packed, "packed")
    _check_cuda(scales, "scales")
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TileError(f"packed and scales must be uint8, got {packed.dtype} and {scales.dtype}")
    if out_dtype not in TL_DTYPE:
        raise TileError(f"out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")
    if packed.dim() == 0 or packed.shape[:-1] != scales.shape[:-1] or scales.shape[-1] * group_size != packed.shape[-1] * 2:
        raise TileError(
            f"packed {tuple(packed.shape)} and scales {tuple(scales.shape)} do not match: want [..., N // 2] and [..., N // {group_size}]"
        )
    if packed.device != scales.device:
        raise TileError(f"packed is on {packed.device} but scales on {scales.device}")
    n = packed.shape[-1] * 2
    rows = math.prod(packed.shape[:-1])
    out = torch.empty(*packed.shape[:-1], n, dtype=out_dtype, device=packed.device)  # [..., N]
    if rows == 0:
        return out
    arch, gpu = target(packed, "fp4_dequantize")
    tile = tile_for(False, scale_format)
    dims = {"rows": rows, "dim": n}
    c = call_config(tile, dims, arch, gpu, config)
    if out_dtype == torch.float32 and (why := staging_fits(c, Shape("call", "any", dims), arch, 4, scale_format)):
        raise TileError(f"config {c} does not fit float32 output: {why}")
    kernel = dequant_kernel(n, scale_format, TL_DTYPE[out_dtype], c, arch)
    kernel(packed.view(rows, n // 2), scales.view(rows, n // group_size), out.view(rows, n))
    return out
