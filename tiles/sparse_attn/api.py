"""The public attention functions: ``sparse_attention`` (FP4 main KV + FP8 window KV) and ``sparse_attention_bf16``,
with their shape, dtype and index checks and the choice of tile and config."""

import torch

from tiles.core.contract import Config, TileError
from tiles.core.dispatch import call_config, frozen, plan, signature, target
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


def _check_common(q, window_idx, topk_idx, sink, nw: int, nc: int) -> tuple[int, int, int, int, int, int]:
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
    return B, S, H, D, W, K


def tile_for_tokens(B: int, S: int, bf16: bool) -> "SparseAttnTile":
    """The attention tile a call runs on: the bf16-KV tile, else decode up to DECODE_MAX_TOKENS query tokens, else prefill."""
    if bf16:
        return BF16_TILE
    return DECODE_TILE if B * S <= DECODE_MAX_TOKENS else PREFILL_TILE


class _Launch:
    """One call signature's launch: the compiled kernel and the tensors a call adds to its own (the -inf sink when it
    has none; an SWA-only layer's one masked top-k slot over a one-row dummy cache)."""

    def __init__(self, kernel, no_sink: torch.Tensor, swa_only: tuple | None, fp4: bool):
        self.kernel, self.no_sink, self.swa_only, self.fp4 = kernel, no_sink, swa_only, fp4
        self.dummy = torch.empty(1, dtype=torch.uint8, device=no_sink.device)  # [1], the bf16 kernel has no scale tensors

    def __call__(self, q, win_a, win_b, window_idx, main_a, main_b, topk_idx, sink) -> torch.Tensor:
        if self.swa_only is not None:
            topk_idx, main_a, main_b = self.swa_only
        sink = self.no_sink if sink is None else sink
        if not self.fp4:
            return self.kernel(q, win_a, self.dummy, window_idx, main_a, self.dummy, topk_idx, sink)
        if win_a.dtype == torch.uint8:
            win_a = win_a.view(torch.float8_e4m3fn)
        if main_b.dtype == torch.uint8:
            main_b = main_b.view(torch.float8_e4m3fn)
        return self.kernel(q, win_a, win_b, window_idx, main_a.view(torch.int32), main_b, topk_idx, sink)


def _check_index_range(window_idx: torch.Tensor, topk_idx: torch.Tensor, nw: int, nc: int) -> None:
    for idx, n, name in ((window_idx, nw, "window_idx"), (topk_idx, nc, "topk_idx")):
        lo_hi = torch.stack([idx.min(), idx.max()]).tolist() if idx.numel() else [-1, -1]
        _require(lo_hi[0] >= -1 and lo_hi[1] < n, f"{name} holds values outside [-1, {n}): the cache has {n} entries")


def _kv_batch(t: torch.Tensor, name: str, B: int) -> int:
    """A cache's batch dim: B (one cache per batch row) or 1 (one pool every row reads through its indices)."""
    _require(
        t.shape[0] in (1, B), f"{name} must hold {B} batch rows (one per sequence) or 1 (a pool shared by every row), got {t.shape[0]}"
    )
    return t.shape[0]


def _checked(fp4: bool, tensors: tuple) -> tuple[int, int, int, int, int, int, int, int, int, int]:
    """Every check of the public functions but the device's: (B, S, H, D, W, K, Nw, Nc, Bw, Bm), Bw and Bm the
    caches' batch dims (B, or 1 for a shared pool)."""
    if fp4:
        q, window_codes, window_scales, window_idx, main_packed, main_scales, topk_idx, sink = tensors
    else:
        q, window_codes, window_idx, main_packed, topk_idx, sink = tensors
    _require(isinstance(q, torch.Tensor) and q.dim() == 4, "q must be a 4-d tensor [B, S, H, D]")
    if fp4:
        _require(window_codes.dim() == 3 and main_packed.dim() == 3, "window_codes and main_packed must be [B, Nw, D] and [B, Nc, D/2]")
    else:
        _require(window_codes.dim() == 3 and main_packed.dim() == 3, "window_kv and main_kv must be [B, Nw, D] and [B, Nc, D]")
    nw, nc = window_codes.shape[1], main_packed.shape[1]
    B, S, H, D, W, K = _check_common(q, window_idx, topk_idx, sink, nw, nc)
    bw = _kv_batch(window_codes, "window_codes" if fp4 else "window_kv", B)
    bm = _kv_batch(main_packed, "main_packed" if fp4 else "main_kv", B)
    if fp4:
        codes = window_codes.view(torch.uint8) if window_codes.dtype == torch.float8_e4m3fn else window_codes
        mscales = main_scales.view(torch.uint8) if main_scales.dtype == torch.float8_e4m3fn else main_scales
        _check_tensor(codes, "window_codes", torch.uint8, (bw, nw, D), q.device)
        _check_tensor(window_scales, "window_scales", torch.uint8, (bw, nw, D // 32), q.device)
        _check_tensor(main_packed, "main_packed", torch.uint8, (bm, nc, D // 2), q.device)
        _check_tensor(mscales, "main_scales", torch.uint8, (bm, nc, D // 16), q.device)
    else:
        _check_tensor(window_codes, "window_kv", torch.bfloat16, (bw, nw, D), q.device)
        _check_tensor(main_packed, "main_kv", torch.bfloat16, (bm, nc, D), q.device)
    return B, S, H, D, W, K, nw, nc, bw, bm


def _launch(fp4: bool, scale: float, config: Config | None, tensors: tuple) -> _Launch:
    """Check one call's tensors (every check of the public functions) and build its launch."""
    B, S, H, D, W, K, nw, nc, bw, bm = _checked(fp4, tensors)
    q = tensors[0]
    shared = (bw == 1 and B > 1, bm == 1 and B > 1)
    _require_cuda(q)
    arch, gpu = target(q, "sparse_attention" if fp4 else "sparse_attention_bf16")
    swa_only = None
    if K == 0 or nc == 0:  # SWA-only layer: one masked top-k slot over a one-row dummy cache
        swa_only = (
            torch.full((B, S, 1), -1, dtype=torch.int32, device=q.device),  # [B, S, 1]
            torch.zeros(B, 1, D // 2 if fp4 else D, dtype=torch.uint8 if fp4 else torch.bfloat16, device=q.device),  # [B, 1, D/2 | D]
            torch.zeros(B, 1, D // 16, dtype=torch.uint8, device=q.device).view(torch.float8_e4m3fn) if fp4 else None,  # [B, 1, D/16]
        )
        nc, K, shared = 1, 1, (shared[0], False)
    tile = tile_for_tokens(B, S, bf16=not fp4)
    # a shared pool's rows per batch row: what the config buckets and the staging choice count per sequence
    per_row_nw, per_row_nc = (-(-nw // B) if shared[0] else nw), (-(-nc // B) if shared[1] else nc)
    dims = {"B": B, "S": S, "Nc": per_row_nc, "Nw": per_row_nw, "H": H, "D": D, "W": W, "K": K}
    if any(shared):  # pools read through indices: the paged shapes' winners (a bucket of their own)
        dims["pool"] = 1
    cfg = call_config(tile, dims, arch, gpu, config, tile.phase)
    kernel = compiled(H, D, W, K, scale, "fp4" if fp4 else "bf16", cfg, arch, shared)
    no_sink = torch.full((H,), float("-inf"), dtype=torch.float32, device=q.device)  # [H]: exp(-inf) adds nothing
    return _Launch(kernel, no_sink, swa_only, fp4)


def _launch_for(name: str, fp4: bool, scale: float, config: Config | None, tensors: tuple, check_indices: bool) -> _Launch:
    """The cached launch of this call's signature (:func:`tiles.core.dispatch.plan`): built, with every check, on the
    first call of a signature; later calls with an equal signature pass the same checks. ``check_indices``: the
    tensors are checked and the index ranges read (a host sync) on every call."""
    if check_indices:
        *_, nw, nc, _, _ = _checked(fp4, tensors)
        _check_index_range(tensors[3 if fp4 else 2], tensors[6 if fp4 else 4], nw, nc)
    try:
        key = (name, signature(*tensors), float(scale), frozen(config))
    except (AttributeError, TypeError):  # not tensors, or an unhashable config: the checks say what is wrong
        return _launch(fp4, scale, config, tensors)
    return plan(key, lambda: _launch(fp4, scale, config, tensors))


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
        window_codes: uint8 (or float8_e4m3fn) [B, Nw, D] FP8 E4M3 window KV codes, or [1, Nw, D]: one pool (a
            state-slot pool of SWA rings) that every batch row reads, window_idx naming its rows.
        window_scales: uint8 [B | 1, Nw, D/32] E8M0 scale bytes (the batch dim of window_codes).
        window_idx: int32 [B, S, W] indices into the window KV (W <= 128), -1 = unused.
        main_packed: uint8 [B, Nc, D/2] packed FP4 E2M1 main KV (even element in the low nibble), or [1, Nc, D/2]:
            one pool (a paged cache's page pool) that every batch row reads, topk_idx naming its rows.
        main_scales: uint8 (or float8_e4m3fn) [B | 1, Nc, D/16] E4M3 scale bytes (the batch dim of main_packed).
        topk_idx: int32 [B, S, K] indices into the main KV, -1 = unused. K = 0 (or Nc = 0): an SWA-only layer.
        sink: float32 [H] per-head sink logits, or None for no sink.
        scale: softmax scale (512^-0.5 in the model).
        config: tile config overriding the tuned winner / default (keys of the tile's search space).
        check_indices: reject indices outside [-1, N) with a TileError (costs one host sync).
    Returns:
        bf16 [B, S, H, D]. A row whose indices are all -1 is zero.

    The first call of a signature (shapes, dtypes, devices, layouts, scale, config) checks every tensor and picks the
    kernel; later calls of that signature launch it directly (:mod:`tiles.core.dispatch`).

    A -1 slot reads row 0 of its cache and weights it zero: every row 0 must hold a finite entry (a written entry, or
    zeros as a fresh pool holds), since a NaN code times a zero weight is still NaN.
    """
    tensors = (q, window_codes, window_scales, window_idx, main_packed, main_scales, topk_idx, sink)
    return _launch_for("sparse_attention", True, scale, config, tensors, check_indices)(*tensors)


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
    tensors = (q, window_kv, window_idx, main_kv, topk_idx, sink)
    launch = _launch_for("sparse_attention_bf16", False, scale, config, tensors, check_indices)
    return launch(q, window_kv, None, window_idx, main_kv, None, topk_idx, sink)
