"""The public attention functions: ``sparse_attention`` (FP4 main KV + FP8 window KV) and ``sparse_attention_bf16``,
with their shape, dtype and index checks and the choice of tile and config."""

import torch

from tiles.core.arch import Arch, device_arch
from tiles.core.contract import Config, Shape, TileError
from tiles.sparse_attn.launch import DEFAULT_SCALE, compiled
from tiles.sparse_attn.tile import BF16_TILE, DECODE_TILE, PREFILL_TILE, SparseAttnTile

DECODE_MAX_TOKENS = 256  # B * S at or below this runs the decode tile (split-KV), above it the prefill tile


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise TileError(msg)


def _check_tensor(t: torch.Tensor, name: str, dtype: torch.dtype, shape: tuple, device: torch.device) -> None:
    _require(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _require(t.dtype == dtype, f"{name} must be {dtype}, got {t.dtype}")
    _require(tuple(t.shape) == tuple(shape), f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    _require(t.device == device, f"{name} is on {t.device} but q is on {device}: put every input on one GPU")
    _require(t.is_contiguous(), f"{name} must be contiguous (call .contiguous())")


def _require_cuda(q: torch.Tensor) -> None:
    # Checked after shapes and dtypes so that those errors read the same on any device.
    _require(q.is_cuda, "q must be on a CUDA device: the kernels run on the GPU (use model.ops.sparse_attention on the CPU)")


_NO_SINK: dict[tuple, torch.Tensor] = {}


def _sink_or_none(sink: torch.Tensor | None, heads: int, device: torch.device) -> torch.Tensor:
    """No sink is a sink of -inf: exp(-inf) adds nothing to the denominator."""
    if sink is not None:
        return sink
    key = (heads, str(device))
    if key not in _NO_SINK:
        _NO_SINK[key] = torch.full((heads,), float("-inf"), dtype=torch.float32, device=device)  # [H]
    return _NO_SINK[key]


def _check_common(q, window_idx, topk_idx, sink, nw: int, nc: int, check_indices: bool) -> tuple[int, int, int, int, int, int]:
    _require(isinstance(q, torch.Tensor) and q.dim() == 4, "q must be a 4-d tensor [B, S, H, D]")
    B, S, H, D = q.shape
    _require(q.dtype == torch.bfloat16, f"q must be torch.bfloat16, got {q.dtype}")
    _require(q.is_contiguous(), "q must be contiguous (call .contiguous())")
    _require(D == 512, f"head dim must be 512 (the CSA2 latent), got {D}")
    _require(H % 64 == 0, f"heads must be a multiple of 64 (64 or 128 in the model), got {H}")
    _require(window_idx.dim() == 3 and topk_idx.dim() == 3, "window_idx and topk_idx must be [B, S, W] and [B, S, K]")
    W, K = window_idx.shape[-1], topk_idx.shape[-1]
    _require(nw >= 1, "the window KV is empty: it holds at least the current token")
    _require(1 <= W <= 128, f"window_idx holds {W} slots per token; the SWA window is 1..128")
    _require(0 <= K <= 2048, f"topk_idx holds {K} slots per token; 0..2048 are supported")
    _check_tensor(window_idx, "window_idx", torch.int32, (B, S, W), q.device)
    _check_tensor(topk_idx, "topk_idx", torch.int32, (B, S, K), q.device)
    if sink is not None:
        _check_tensor(sink, "sink", torch.float32, (H,), q.device)
    if check_indices:
        for idx, n, name in ((window_idx, nw, "window_idx"), (topk_idx, nc, "topk_idx")):
            lo_hi = torch.stack([idx.min(), idx.max()]).tolist() if idx.numel() else [-1, -1]
            _require(lo_hi[0] >= -1 and lo_hi[1] < n, f"{name} holds values outside [-1, {n}): the cache has {n} entries")
    return B, S, H, D, W, K


_PICKED: dict[tuple, Config] = {}


def _pick_config(tile: "SparseAttnTile", arch: Arch, dims: dict[str, int], config: Config | None) -> Config:
    """An explicit config over the default, else the tuned winner nearest this shape (tiles.core.config_store), else the default.

    The winner lookup reads files, so its answer is kept per (tile, arch, dims)."""
    shape = Shape("call", tile.phase, dims)
    if config is not None:
        cfg = tile.with_defaults(arch, config)
    else:
        key = (tile.name, arch.name, tuple(sorted(dims.items())))
        if key not in _PICKED:
            try:
                from tiles.core.config_store import load_winner
            except ImportError:  # the results module is optional: without it the default runs
                _PICKED[key] = tile.default_config(arch)
            else:
                _PICKED[key] = dict(load_winner(tile.name, arch, shape, default=tile.default_config(arch))[0])
        cfg = dict(_PICKED[key])
    reasons = tile.search_space(arch).violations(cfg, shape, arch)
    _require(not reasons, f"config {cfg} is not valid for {tile.name} at {dims}: {'; '.join(reasons)}")
    return tile.resolve_call(cfg, dims, arch)


def tile_for_tokens(B: int, S: int, bf16: bool) -> "SparseAttnTile":
    """The attention tile a call runs on: the bf16-KV tile, else decode up to DECODE_MAX_TOKENS query tokens, else prefill."""
    if bf16:
        return BF16_TILE
    return DECODE_TILE if B * S <= DECODE_MAX_TOKENS else PREFILL_TILE


def sparse_attention(
    q: torch.Tensor,
    window_codes: torch.Tensor,
    window_scales: torch.Tensor,
    window_idx: torch.Tensor,
    main_packed: torch.Tensor,
    main_scales: torch.Tensor,
    topk_idx: torch.Tensor,
    sink: torch.Tensor | None,
    scale: float = DEFAULT_SCALE,
    config: Config | None = None,
    check_indices: bool = False,
) -> torch.Tensor:
    """Sparse gather attention over the FP8 window KV and the FP4 main KV, with a per-head sink.

    Args:
        q: bf16 [B, S, H, D] queries (H a multiple of 64, D = 512).
        window_codes: uint8 (or float8_e4m3fn) [B, Nw, D] FP8 E4M3 window KV codes.
        window_scales: uint8 [B, Nw, D/32] E8M0 scale bytes.
        window_idx: int32 [B, S, W] indices into the window KV (W <= 128), -1 = unused.
        main_packed: uint8 [B, Nc, D/2] packed FP4 E2M1 main KV (even element in the low nibble).
        main_scales: uint8 (or float8_e4m3fn) [B, Nc, D/16] E4M3 scale bytes.
        topk_idx: int32 [B, S, K] indices into the main KV, -1 = unused. K = 0 (or Nc = 0): an SWA-only layer.
        sink: float32 [H] per-head sink logits, or None for no sink.
        scale: softmax scale (512^-0.5 in the model).
        config: tile config overriding the tuned winner / default (keys of the tile's search space).
        check_indices: reject indices outside [-1, N) with a TileError (costs one host sync).
    Returns:
        bf16 [B, S, H, D]. A row whose indices are all -1 is zero.
    """
    _require(isinstance(q, torch.Tensor) and q.dim() == 4, "q must be a 4-d tensor [B, S, H, D]")
    B, S, _, D = q.shape
    _require(window_codes.dim() == 3 and main_packed.dim() == 3, "window_codes and main_packed must be [B, Nw, D] and [B, Nc, D/2]")
    nw, nc = window_codes.shape[1], main_packed.shape[1]
    B, S, H, D, W, K = _check_common(q, window_idx, topk_idx, sink, nw, nc, check_indices)
    codes = window_codes.view(torch.uint8) if window_codes.dtype == torch.float8_e4m3fn else window_codes
    mscales = main_scales.view(torch.uint8) if main_scales.dtype == torch.float8_e4m3fn else main_scales
    _check_tensor(codes, "window_codes", torch.uint8, (B, nw, D), q.device)
    _check_tensor(window_scales, "window_scales", torch.uint8, (B, nw, D // 32), q.device)
    _check_tensor(main_packed, "main_packed", torch.uint8, (B, nc, D // 2), q.device)
    _check_tensor(mscales, "main_scales", torch.uint8, (B, nc, D // 16), q.device)
    _require_cuda(q)
    if K == 0 or nc == 0:  # SWA-only layer: one masked top-k slot over a one-row dummy cache
        topk_idx = torch.full((B, S, 1), -1, dtype=torch.int32, device=q.device)  # [B, S, 1]
        main_packed = torch.zeros(B, 1, D // 2, dtype=torch.uint8, device=q.device)  # [B, 1, D/2]
        mscales = torch.zeros(B, 1, D // 16, dtype=torch.uint8, device=q.device)  # [B, 1, D/16]
        nc, K = 1, 1
    tile = tile_for_tokens(B, S, bf16=False)
    arch = device_arch(q.device)
    dims = {"B": B, "S": S, "Nc": nc, "Nw": nw, "H": H, "D": D, "W": W, "K": K}
    cfg = _pick_config(tile, arch, dims, config)
    kernel = compiled(H, D, W, K, scale, "fp4", cfg, arch)
    return kernel(
        q,
        codes.view(torch.float8_e4m3fn),
        window_scales,
        window_idx,
        main_packed.view(torch.int32),
        mscales.view(torch.float8_e4m3fn),
        topk_idx,
        _sink_or_none(sink, H, q.device),
    )


def sparse_attention_bf16(
    q: torch.Tensor,
    window_kv: torch.Tensor,
    window_idx: torch.Tensor,
    main_kv: torch.Tensor,
    topk_idx: torch.Tensor,
    sink: torch.Tensor | None,
    scale: float = DEFAULT_SCALE,
    config: Config | None = None,
    check_indices: bool = False,
) -> torch.Tensor:
    """:func:`sparse_attention` with bf16 KV.

    Args:
        window_kv: bf16 [B, Nw, D]; main_kv: bf16 [B, Nc, D]. Others as in :func:`sparse_attention`.
    Returns:
        bf16 [B, S, H, D].
    """
    _require(isinstance(q, torch.Tensor) and q.dim() == 4, "q must be a 4-d tensor [B, S, H, D]")
    _require(window_kv.dim() == 3 and main_kv.dim() == 3, "window_kv and main_kv must be [B, Nw, D] and [B, Nc, D]")
    nw, nc = window_kv.shape[1], main_kv.shape[1]
    B, S, H, D, W, K = _check_common(q, window_idx, topk_idx, sink, nw, nc, check_indices)
    _check_tensor(window_kv, "window_kv", torch.bfloat16, (B, nw, D), q.device)
    _check_tensor(main_kv, "main_kv", torch.bfloat16, (B, nc, D), q.device)
    _require_cuda(q)
    if K == 0 or nc == 0:  # SWA-only layer: one masked top-k slot over a one-row dummy cache
        topk_idx = torch.full((B, S, 1), -1, dtype=torch.int32, device=q.device)  # [B, S, 1]
        main_kv = torch.zeros(B, 1, D, dtype=torch.bfloat16, device=q.device)  # [B, 1, D]
        nc, K = 1, 1
    tile = tile_for_tokens(B, S, bf16=True)
    arch = device_arch(q.device)
    dims = {"B": B, "S": S, "Nc": nc, "Nw": nw, "H": H, "D": D, "W": W, "K": K}
    cfg = _pick_config(tile, arch, dims, config)
    dummy = torch.empty(1, dtype=torch.uint8, device=q.device)  # [1], the bf16 kernel has no scale tensors
    kernel = compiled(H, D, W, K, scale, "bf16", cfg, arch)
    return kernel(q, window_kv, dummy, window_idx, main_kv, dummy, topk_idx, _sink_or_none(sink, H, q.device))
