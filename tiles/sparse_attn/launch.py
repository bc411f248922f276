"""The compiled attention kernels and their launch: ``CompiledAttention`` (the gathering kernel and its combine),
``ExpandedAttention`` (the prefill's caches expanded to bf16, then the bf16 kernel) and the per-config cache."""

from typing import Any

import tilelang
import torch

from tiles.core.arch import Arch
from tiles.core.contract import Config
from tiles.sparse_attn.dequant import FP4X8_FUNCTIONS, decode_helpers_cuda
from tiles.sparse_attn.kernels import combine_kernel, sparse_attn_kernel
from tiles.sparse_attn.kv_expand import expand_caches, expand_kernel
from tiles.sparse_attn.options import BF16_ROW_KEYS

_PASS_CONFIGS = {
    tilelang.PassConfigKey.TL_DISABLE_TMA_LOWER: True,
    tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
}


_KERNELS: dict[tuple, Any] = {}
DEFAULT_SCALE = 512**-0.5


class CompiledAttention:
    """The attention kernel (and the combine kernel when split) for one (H, D, W, K, scale, format, config, arch).

    ``combine="fused"``: no combine kernel; the attention kernel takes an arrival counter per (token, head block),
    int32, allocated zeroed once per device and grown when a call has more tokens (the kernel leaves it zero). A
    counter is shared by every call of this object on that device: calls must not run concurrently on two streams,
    and a CUDA graph must be captured after one eager call at its largest B * S (the growth allocates).

    ``shared`` (window, main): that cache is one pool read by every batch row, passed as ``[1, N, C]`` and launched
    with batch stride 0 (:mod:`tiles.sparse_attn.kv_layout`)."""

    def __init__(
        self,
        heads: int,
        dim: int,
        window: int,
        topk: int,
        scale: float,
        kv_format: str,
        config: Config,
        arch: Arch,
        shared: tuple[bool, bool] = (False, False),
    ):
        if config.get("kv_staging", "gather") != "gather":
            raise ValueError(f"kv_staging={config['kv_staging']!r}: this class is the gathering kernel; compiled() builds the expansion")
        self.heads, self.dim, self.window, self.topk, self.kv_format = heads, dim, window, topk, kv_format
        self.shared = shared
        self.n_split = int(config.get("n_split", 1))
        self.fused = config.get("combine", "separate") == "fused"
        self.partials_dtype = torch.bfloat16 if config.get("partials", "fp32") == "bf16" else torch.float32
        self.rep = heads // int(config.get("heads_per_block", 64))  # head blocks per token: counters per token
        self.counters: dict[torch.device, torch.Tensor] = {}
        target = tilelang.tvm.target.Target(arch.tilelang_target())
        params = {
            k: config[k]
            for k in (
                "block_I",
                "num_stages",
                "threads",
                "heads_per_block",
                "dequant",
                "schedule",
                "produce",
                "io",
                "consumers",
                "wg1_rows",
                "tokens_per_cta",
                "combine",
                "handoff",
                "lanes",
                "fp4_decode",
                "partials",
                "unused_rows",
            )
            if k in config
        }
        if kv_format != "bf16":
            # FP4/FP8 rows: the producer's own unused-row path and loads (these keys are for bf16 rows: BF16_ROW_KEYS)
            for key in BF16_ROW_KEYS:
                params.pop(key, None)
        # the batched producer reads FP8 window codes as int32 words and E4M3 scales as bytes
        self.word_views = kv_format == "fp4" and config.get("schedule") == "ws" and config.get("produce") in ("batched", "prefetch")
        prim = sparse_attn_kernel(
            heads,
            dim,
            window,
            topk,
            scale,
            kv_format=kv_format,
            n_split=self.n_split,
            window_shared=shared[0],
            main_shared=shared[1],
            **params,
        )
        # The batched producer masks out-of-range indices itself (ws_fetch_rows); TileLang's bounds guards
        # would turn its cp.async copies back into synchronous loads.
        batched = config.get("schedule") == "ws" and config.get("produce") in ("batched", "prefetch")
        passes = {**_PASS_CONFIGS, tilelang.PassConfigKey.TL_DISABLE_SAFE_MEMORY_ACCESS: True} if batched else dict(_PASS_CONFIGS)
        if config.get("ptxas_level"):  # 0: ptxas's own default (5)
            passes[tilelang.PassConfigKey.TL_PTXAS_REGISTER_USAGE_LEVEL] = int(config["ptxas_level"])
        self.main = tilelang.compile(prim, target=target, pass_configs=passes)
        self.combine = None
        if self.n_split > 1 and not self.fused:
            kernel = combine_kernel(heads, dim, self.n_split, partials=config.get("partials", "fp32"))
            self.combine = tilelang.compile(kernel, target=target, pass_configs=_PASS_CONFIGS)

    def __call__(self, q, win_a, win_b, window_idx, main_a, main_b, topk_idx, sink, out: torch.Tensor | None = None) -> torch.Tensor:
        B, S, H, D = q.shape
        if self.word_views:
            win_a, main_b = win_a.view(torch.int32), main_b.view(torch.uint8)  # [B, Nw, D/4], [B, Nc, D/16]
        if self.shared[0]:  # [1, Nw, ...] pool -> [B, Nw, ...], batch stride 0
            win_a, win_b = win_a.expand(B, -1, -1), win_b.expand(B, -1, -1)
        if self.shared[1]:
            main_a, main_b = main_a.expand(B, -1, -1), main_b.expand(B, -1, -1)
        if out is None:
            out = torch.empty(B, S, H, D, dtype=torch.bfloat16, device=q.device)  # [B, S, H, D]
        if self.n_split == 1:
            lse = torch.empty(B, S, 1, H, dtype=torch.float32, device=q.device)  # [B, S, 1, H], unused
            self.main(q, win_a, win_b, window_idx, main_a, main_b, topk_idx, sink, out, lse)
            return out
        opart = torch.empty(B, S, self.n_split, H, D, dtype=self.partials_dtype, device=q.device)  # [B, S, NS, H, D]
        lse = torch.empty(B, S, self.n_split, H, dtype=torch.float32, device=q.device)  # [B, S, NS, H]
        if self.fused:
            counter = self.counter(B, S, q.device)  # [B, S, REP], all zero
            self.main(q, win_a, win_b, window_idx, main_a, main_b, topk_idx, sink, out, lse, opart, counter)
            return out
        self.main(q, win_a, win_b, window_idx, main_a, main_b, topk_idx, sink, opart, lse)
        self.combine(opart, lse, sink, out)
        return out

    def counter(self, B: int, S: int, device: torch.device) -> torch.Tensor:
        """The fused combine's arrival counters for B x S tokens: a zero int32 [B, S, REP] view of this device's
        buffer, allocated (zeroed) on first use and replaced by a larger one when B * S outgrows it. Every launch
        leaves its counters at zero (the last CTA of each token resets its own), so the buffer is never cleared again."""
        need = B * S * self.rep
        buf = self.counters.get(device)
        if buf is None or buf.numel() < need:
            buf = torch.zeros(max(need, 2 * buf.numel() if buf is not None else need), dtype=torch.int32, device=device)
            self.counters[device] = buf
        return buf[:need].view(B, S, self.rep)  # [B, S, REP]


# The keys of an FP4 config that the bf16 kernel behind kv_staging="expand" does not take (fp4_decode picks the
# expansion's FP4 word decode instead).
FP4_ONLY_KEYS = ("dequant", "wg1_rows", "fp4_decode", "kv_staging")


class ExpandedAttention:
    """``kv_staging="expand"``: both quantised caches expanded to bf16 (:mod:`tiles.sparse_attn.kv_expand`, one launch), then the
    bf16 kernel of the same config gathers them. Called like :class:`CompiledAttention` with FP4/FP8 arguments."""

    def __init__(
        self,
        heads: int,
        dim: int,
        window: int,
        topk: int,
        scale: float,
        config: Config,
        arch: Arch,
        shared: tuple[bool, bool] = (False, False),
    ):
        fp4_decode = config.get("fp4_decode", "fma")
        self.expand = expand_kernel(dim, decode_helpers_cuda(fp4_decode), FP4X8_FUNCTIONS[fp4_decode], arch)
        bf16_config = {k: v for k, v in config.items() if k not in FP4_ONLY_KEYS}
        self.attend = compiled(heads, dim, window, topk, scale, "bf16", bf16_config, arch, shared)  # a shared pool expands once

    # the attention behind the expansion, by CompiledAttention's names (source dumps, profilers, tests)
    main = property(lambda self: self.attend.main)
    combine = property(lambda self: self.attend.combine)
    n_split = property(lambda self: self.attend.n_split)

    def __call__(self, q, win_a, win_b, window_idx, main_a, main_b, topk_idx, sink, out: torch.Tensor | None = None) -> torch.Tensor:
        window_kv, main_kv = expand_caches(self.expand, win_a, win_b, main_a, main_b)  # [B | 1, Nw, D], [B | 1, Nc, D] bf16
        dummy = torch.empty(1, dtype=torch.uint8, device=q.device)  # [1], the bf16 kernel has no scale tensors
        return self.attend(q, window_kv, dummy, window_idx, main_kv, dummy, topk_idx, sink, out=out)


def compiled(
    heads: int,
    dim: int,
    window: int,
    topk: int,
    scale: float,
    kv_format: str,
    config: Config,
    arch: Arch,
    shared: tuple[bool, bool] = (False, False),
) -> "CompiledAttention | ExpandedAttention":
    """The cached kernel for (shape key, config, arch, shared pools); compiles on first use. ``kv_staging`` must be
    resolved (:func:`resolve_kv_staging`): "expand" gives the expansion and the bf16 kernel behind one call."""
    shared = (bool(shared[0]), bool(shared[1]))
    key = (heads, dim, window, topk, float(scale), kv_format, tuple(sorted(config.items())), arch.name, shared)
    if key not in _KERNELS:
        staging = config.get("kv_staging", "gather")
        if staging not in ("gather", "expand"):
            raise ValueError(f"kv_staging {staging!r} must be resolved to 'gather' or 'expand' first (resolve_kv_staging)")
        if staging == "expand":
            _KERNELS[key] = ExpandedAttention(heads, dim, window, topk, scale, config, arch, shared)
        else:
            _KERNELS[key] = CompiledAttention(heads, dim, window, topk, scale, kv_format, config, arch, shared)
    return _KERNELS[key]
