"""The three attention tiles the tuner and ``lab`` use (decode, prefill, bf16 KV): search spaces, constraints,
defaults per arch, inputs and the torch reference."""

from collections.abc import Mapping
from typing import ClassVar

import torch

from model.formats import fp4_dequantize, fp8_dequantize
from model.ops.sparse_attn import sparse_attention as _ref_sparse_attention
from tiles.core.arch import Arch
from tiles.core.compare import relative_l2
from tiles.core.contract import Comparison, Config, Inputs, SearchSpace, Shape, Tile, TileError, canonical_key, poisoned
from tiles.core.shapes import PAGE_SIZE, attention_shapes
from tiles.sparse_attn.launch import DEFAULT_SCALE, CompiledAttention, ExpandedAttention, compiled
from tiles.sparse_attn.options import (
    BF16_ROW_KEYS,
    NARROW_DEFAULTS,
    UNUSED_ROWS_DEFAULT,
    kernel_rows,
)
from tiles.sparse_attn.policy import resolve_io, resolve_kv_staging, resolve_split
from tiles.sparse_attn.space import attention_search_space, resolve_consumers

# Relative L2 vs the fp32 reference on the same dequantised inputs: P is rounded to bf16 before
# the PV GEMM and the output is bf16, each ~2^-9 relative; measured errors sit near 4e-3.
TOLERANCE = 1e-2


_BLACKWELL = "not built for Blackwell: it wants native block-scaled FP4 MMA (tcgen05), not dequant-to-bf16 for wgmma"


# consumers="auto" (the Hopper default of the prefill and bf16 tiles): paired_halves where io="auto" takes it to
# io=overlapped and the call rereads its KV rows (EXPAND_MIN_READS: a prefill), else wg0_scores. H200, one run per tile,
# every config checked first (ec81287; ms, prefill tile / bf16 tile, the default of then: wg0_scores with io="auto"):
# 512 tokens 0.0923 / 0.0904 against 0.1004 / 0.0991, 1024 0.1749 / 0.1723 against 0.1885 / 0.1898, 2048 0.3377 / 0.3377
# against 0.3645 / 0.3618, 4096 0.6656-0.6908 / 0.7190 against 0.7099 / 0.7178 (the bf16 tile level; another run 0.6806
# / 0.6997 against 0.7105 / 0.7176), 16384 2.8064 / 2.8909 against 2.9084 / 3.0002. At bf16 decode B=128/S=2 (rows read
# about once) paired_halves with io=overlapped lost: 0.0632 against wg0_scores' 0.0585 ms at 2 tokens per CTA in the
# same run.


class SparseAttnTile(Tile):
    """Shared machinery of the three sparse attention tiles (they differ in shapes, KV format and split)."""

    kv_format = "fp4"
    phase = "decode"
    splits = True
    unsupported: ClassVar[dict[str, str]] = {"sm100": _BLACKWELL, "sm120": _BLACKWELL}

    def shapes(self) -> list[Shape]:
        return [s for s in attention_shapes() if self.phase == "any" or s.phase == self.phase]

    def search_space(self, arch: Arch) -> SearchSpace:
        return attention_search_space(self.kv_format, self.splits)

    def default_config(self, arch: Arch) -> Config:
        if arch.family == "hopper":
            # FlashMLA's decode design, TileLang's sparse_mla_fwd_pipelined: a producer warpgroup gathers and
            # dequantises into two KV buffers while two consumer warpgroups run the GEMMs and the softmax.
            cfg: Config = {"schedule": "ws", "produce": "batched", "block_I": 64, "num_stages": 2, "threads": 256, "heads_per_block": 64}
        elif arch.smem_per_block >= 160 * 1024:  # A100: the Hopper tiles, single-buffered to fit 163 KiB
            cfg = {"schedule": "pipelined", "block_I": 64, "num_stages": 1, "threads": 256, "heads_per_block": 64}
        else:  # sm86/sm89: 99 KiB per block
            cfg = {"schedule": "pipelined", "block_I": 32, "num_stages": 1, "threads": 128, "heads_per_block": 32}
        cfg.setdefault("produce", "serial")
        cfg["consumers"] = "wg0_scores"
        cfg["tokens_per_cta"] = 1
        cfg["handoff"] = "after_pv"
        cfg["lanes"] = "row"
        # staged Q/O on Hopper: H200, prefill 2.58 -> 1.03 ms, decode B=128/S=2 0.203 -> 0.075 ms (ef4f7af);
        # the prefill and bf16 tiles: overlapped per call where it applies (io="auto", see IO_AUTO_TOKENS)
        cfg["io"] = "staged" if cfg["schedule"] == "ws" else "direct"
        if cfg["schedule"] == "ws" and (not self.splits or self.kv_format == "bf16"):
            cfg["io"] = "auto"
            # ... and there FlashMLA's paired consumers with the buffers handed over in halves where io=auto overlaps a
            # prefill's tokens (consumers="auto", see resolve_consumers): prefill 4K 0.6806 against 0.7105 ms, 1K
            # 0.1749 against 0.1885 (H200, ec81287)
            cfg["consumers"] = "auto"
        # register-usage level 10, as TileLang's sparse_mla_fwd_pipelined: on the H200 decode 4% faster, prefill level
        # (9e1c79a)
        cfg["ptxas_level"] = 10 if arch.family == "hopper" else 0
        if self.kv_format == "fp4":
            cfg["dequant"] = "direct"
            cfg["wg1_rows"] = 0
            # Hopper: the producer decodes packed FP4 words by byte-permute lookups of the E2M1 bf16 patterns (the same
            # bits), H200, one run against fma (5f78fe9): prefill 4K 1.0247 ->
            # 1.0081 ms, decode B=128/S=2 0.0775 -> 0.0765 ms, B=64/S=1 0.0326 -> 0.0315 ms.
            cfg["fp4_decode"] = "prmt" if cfg["schedule"] == "ws" else "fma"
            if not self.splits:
                cfg["unused_rows"] = UNUSED_ROWS_DEFAULT if cfg["schedule"] == "ws" else "row0"
                # Hopper prefill: both caches expanded to bf16 once for long prompts that reread their rows (auto; short
                # ones gather, see EXPAND_MIN_TOKENS), H200, one run against gather (6c9d184): 4K 1.0195 -> 0.8290 ms,
                # 16K 3.954 -> 3.093, 64K 15.83 -> 12.74 (the expansion 4 / 13 / 54 us of it). Elsewhere unmeasured.
                cfg["kv_staging"] = "auto" if arch.family == "hopper" else "gather"
        if self.kv_format == "bf16":
            cfg["unused_rows"] = UNUSED_ROWS_DEFAULT if cfg["schedule"] == "ws" else "row0"
        if self.splits:
            cfg["n_split"] = "auto" if self.phase != "prefill" else 1
            cfg["combine"] = "separate"  # "fused" measured slower on the H200 (decode B=64/S=1 0.0369 vs 0.0316 ms, 84d7a8c)
            # Hopper: bf16 split partials, H200, one run against fp32 (2592024): decode B=64/S=1 0.0313 -> 0.0273 ms
            # (bf16 KV 0.0291 -> 0.0254), rel L2 2.0e-3 -> 2.5e-3 (bound 1e-2).
            cfg["partials"] = "bf16" if cfg["schedule"] == "ws" else "fp32"
        return cfg

    def with_defaults(self, arch: Arch, config: Config) -> Config:
        """``config`` over the default. The ws-only choices (``produce``, ``io``, ``consumers``, ...) fall back to the plain ones when
        ``config`` picks another schedule without naming them: {"schedule": "pipelined"} alone is a valid config."""
        cfg = {**self.default_config(arch), **config}
        if cfg["schedule"] != "ws":
            plain_choices = (
                ("produce", "serial"),
                ("io", "direct"),
                ("consumers", "wg0_scores"),
                ("tokens_per_cta", 1),
                ("handoff", "after_pv"),
                ("lanes", "row"),
            )
            for key, plain in plain_choices:
                cfg[key] = config.get(key, plain)
        # Hopper-default choices built for one path only give way, when not named, to the choice every path has:
        # {"produce": "serial"} or {"consumers": "seesaw"} alone is valid.
        for key, narrow, broad, refusal in NARROW_DEFAULTS:
            if key not in config and cfg.get(key) == narrow and refusal(cfg, self.kv_format):
                cfg[key] = broad
        return cfg

    def build(self, shape: Shape, config: Config, arch: Arch) -> "CompiledAttention | ExpandedAttention":
        reason = self.support_reason(arch)
        if reason:
            raise TileError(f"{self.name} does not support {arch.name}: {reason}")
        cfg = self.resolve_call(self.with_defaults(arch, config), shape, arch)
        shared = bool(shape.dims.get("pool")) and shape["B"] > 1  # both caches are pools every row reads
        return compiled(shape["H"], shape["D"], shape["W"], shape["K"], DEFAULT_SCALE, self.kv_format, cfg, arch, (shared, shared))

    def kernel_key(self, shape: Shape, config: Config, arch: Arch) -> str:
        """The resolved config's key: a config naming "auto" (consumers, io, n_split, kv_staging) and one naming what it
        resolves to at ``shape`` build the same kernels (e.g. the prefill default and paired_halves, io=overlapped,
        8 tokens per CTA at 4K)."""
        cfg = self.resolve_call(self.with_defaults(arch, config), shape, arch)
        if kernel_rows(self.kv_format, cfg.get("kv_staging", "gather")) != "bf16":
            for key in BF16_ROW_KEYS:  # as CompiledAttention: FP4/FP8 rows decoded by the producer ignore them
                cfg.pop(key, None)
        return canonical_key(cfg)

    def resolve_call(self, config: Config, dims: Mapping[str, int], arch: Arch) -> Config:
        """``config`` (full) with its per-call choices resolved for one call of ``dims`` (a Shape or its dims), in the
        order they depend on each other: ``n_split``, then ``kv_staging``, then ``consumers``, then ``io`` and
        ``tokens_per_cta``."""
        cfg = dict(config)
        if self.splits:
            cfg["n_split"] = resolve_split(cfg["n_split"], dims["B"], dims["S"], dims["H"], cfg["heads_per_block"], arch, cfg["schedule"])
        if "kv_staging" in cfg:
            cfg["kv_staging"] = resolve_kv_staging(cfg["kv_staging"], dims)
        cfg = resolve_consumers(cfg, dims, arch, self.kv_format)
        cfg["io"], cfg["tokens_per_cta"] = resolve_io(cfg, dims, arch, self.kv_format)
        return cfg

    def make_inputs(self, shape: Shape, seed: int, device: str | torch.device = "cuda") -> Inputs:
        return make_attention_inputs(shape, seed, device, self.kv_format)

    def alloc_outputs(self, kernel: CompiledAttention, inputs: Inputs) -> dict[str, torch.Tensor]:
        return {"out": poisoned(inputs["q"].shape, torch.bfloat16, inputs["q"].device)}  # [B, S, H, D]

    def launch(self, kernel: CompiledAttention, inputs: Inputs, outputs: dict[str, torch.Tensor]) -> None:
        q, out = inputs["q"], outputs["out"]
        if self.kv_format == "fp4":
            f8 = torch.float8_e4m3fn
            kernel(
                q,
                inputs["window_codes"].view(f8),
                inputs["window_scales"],
                inputs["window_idx"],
                inputs["main_packed"].view(torch.int32),
                inputs["main_scales"].view(f8),
                inputs["topk_idx"],
                inputs["sink"],
                out=out,
            )
        else:
            dummy = torch.empty(1, dtype=torch.uint8, device=q.device)  # [1], the bf16 kernel has no scale tensors
            kernel(
                q, inputs["window_kv"], dummy, inputs["window_idx"], inputs["main_kv"], dummy, inputs["topk_idx"], inputs["sink"], out=out
            )

    def public_call(self, shape: Shape, inputs: Inputs, config: Config):
        from tiles.sparse_attn.api import sparse_attention, sparse_attention_bf16  # the api picks among these tiles

        i = inputs
        if self.kv_format == "fp4":
            args = (
                i["q"],
                i["window_codes"],
                i["window_scales"],
                i["window_idx"],
                i["main_packed"],
                i["main_scales"],
                i["topk_idx"],
                i["sink"],
            )
            return lambda: sparse_attention(*args, DEFAULT_SCALE, config=config)
        args = (i["q"], i["window_kv"], i["window_idx"], i["main_kv"], i["topk_idx"], i["sink"])
        return lambda: sparse_attention_bf16(*args, DEFAULT_SCALE, config=config)

    def reference(self, inputs: Inputs) -> dict[str, torch.Tensor]:
        if self.kv_format == "fp4":
            window_kv = fp8_dequantize(inputs["window_codes"], inputs["window_scales"])
            main_kv = fp4_dequantize(inputs["main_packed"], inputs["main_scales"], 16, "e4m3")
        else:
            window_kv, main_kv = inputs["window_kv"], inputs["main_kv"]
        window_idx, topk_idx = inputs["window_idx"], inputs["topk_idx"]
        if "main_rows" in inputs:  # pools: each sequence's own rows back in order, read with the logical indices
            window_kv, main_kv = window_kv[0][inputs["window_rows"]], main_kv[0][inputs["main_rows"]]  # [B, Nw, D], [B, Nc, D]
            window_idx, topk_idx = inputs["window_idx_logical"], inputs["topk_idx_logical"]
        out = _ref_sparse_attention(inputs["q"], window_kv, window_idx, main_kv, topk_idx, inputs["sink"], DEFAULT_SCALE)
        return {"out": out}

    def compare(self, outputs: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> Comparison:
        return relative_l2(outputs, expected, TOLERANCE)

    def flops(self, shape: Shape) -> float:
        return 4.0 * shape["B"] * shape["S"] * shape["H"] * (shape["W"] + shape["K"]) * shape["D"]

    def bytes_moved(self, shape: Shape) -> float:
        B, S, H, D, W, K = (shape[k] for k in ("B", "S", "H", "D", "W", "K"))
        if self.kv_format == "fp4":
            kv = W * (D + D // 32) + K * (D // 2 + D // 16)
        else:
            kv = (W + K) * D * 2
        return B * S * (2 * H * D * 2 + kv + (W + K) * 4)


class SparseAttnDecode(SparseAttnTile):
    name = "sparse_attn_decode"
    description = "sparse gather attention, FP4 main + FP8 window KV + sink, decode (B <= 128, S = 1 or 2), split-KV"
    phase = "decode"


class SparseAttnPrefill(SparseAttnTile):
    name = "sparse_attn_prefill"
    description = "sparse gather attention, FP4 main + FP8 window KV + sink, prefill (B = 1, S up to 64K)"
    phase = "prefill"
    splits = False

    def candidates(self, arch: Arch, shape: Shape) -> list[tuple[Config, str]]:
        """Hopper: the default's paired_halves at 4 tokens per CTA (io=auto takes 8 at 4K), its wg0_scores consumers
        (the default before 8e69e80), several tokens per CTA on the expanded caches (the producer runs into the next
        token), with the next token's Q load and this one's O store off the consumers' path (io=overlapped), the seesaw
        consumers on them (the fastest chain measured alone), the gathering path beside the expanding default (so a
        study times both), and the gathering path's best options (within ~1% of it at prefill 4K before the
        expansion)."""
        if arch.family != "hopper":
            return []
        gather = {"kv_staging": "gather"}
        return [
            (
                {"consumers": "paired_halves", "io": "overlapped", "tokens_per_cta": 4},
                "prefill 4K 0.6656 against 8 per CTA's 0.6908 ms in one run (H200, ec81287)",
            ),
            (
                {"consumers": "wg0_scores"},
                "the default before 8e69e80: prefill 4K 0.7099 against paired_halves' 0.6656-0.6908 ms in one run (ec81287)",
            ),
            (
                {"io": "overlapped", "tokens_per_cta": 4},
                (
                    "prefill 4K (expanded) 0.7201 against 0.7211 ms with 8 tokens per CTA (what io=auto picks there) in one "
                    "run (H200, 0ce975d)"
                ),
            ),
            (
                {"io": "staged", "tokens_per_cta": 4},
                (
                    "the expanded prefill 4K 0.7605 against the default's 0.7768 ms (H200, f3b55b2), "
                    "763.7 against 766.7 us in a tuning run (d041eab)"
                ),
            ),
            (
                {"kv_staging": "expand", "consumers": "seesaw"},
                (
                    "on bf16 KV at prefill 4K with zero-filled unused rows 0.8350 ms against the default's 0.7840 with the "
                    "producer, 0.6859 against 0.7405 with the consumers alone (H200, f3b55b2)"
                ),
            ),
            (gather, "prefill 4K 1.0195 ms against expand's 0.8290 (H200, 6c9d184)"),
            ({**gather, "produce": "prefetch"}, "gathering: prefill 4K 1.01x in a tuning run (H200, 84d7a8c)"),
            (
                {**gather, "lanes": "column", "handoff": "before_pv"},
                "gathering: prefill 4K 1.010 vs 1.021 ms (H200, 9765af3)",
            ),
        ]


class SparseAttnBf16(SparseAttnTile):
    name = "sparse_attn_bf16"
    description = "sparse gather attention with bf16 KV (window + main) and sink, decode and prefill"
    kv_format = "bf16"
    phase = "any"

    def candidates(self, arch: Arch, shape: Shape) -> list[tuple[Config, str]]:
        """Hopper: handing P over before warpgroup 0's own P V won at bf16 decode B=128/S=2 on the H200; one CTA per
        sequence (tokens_per_cta) won there in one run and came even or lost in others; with the Q load and O store
        off the consumers' path (io=overlapped) it won at decode and prefill in one run; the paired consumers with each
        buffer handed over in halves won at decode B=128/S=2 in two runs."""
        if arch.family != "hopper":
            return []
        overlapped = "{} {} against io=staged's {} ms in one run (H200, 0ce975d)"
        halves = (
            {"consumers": "paired_halves", "io": "staged"},  # io=auto would overlap 2 tokens per CTA: 0.0632 ms
            "bf16 decode B=128/S=2 0.0606 vs the default's 0.0633 and 0.0634 ms in two runs (H200, bb9e7c0)",
        )
        if shape.phase != "decode":  # io=auto picks 8 tokens per CTA at prefill 4K: 0.7406 ms in that run
            return [
                ({"io": "overlapped", "tokens_per_cta": 4, "n_split": 1}, overlapped.format("bf16 prefill 4K", "0.7517", "0.7739")),
                (
                    {"consumers": "paired_halves", "io": "overlapped", "tokens_per_cta": 4, "n_split": 1},
                    (
                        "bf16 prefill 4K 0.7239 against 8 per CTA's 0.7190 ms, 0.7013 against 0.6997 in another run; 4 per CTA "
                        "was 3.8% faster in the FP4 tile (H200, ec81287)"
                    ),
                ),
                (
                    {"consumers": "wg0_scores"},
                    (
                        "the default before 8e69e80: bf16 prefill 4K 0.7178 against paired_halves' 0.7190 ms in one run, "
                        "0.7176 against 0.6997 in another"
                    ),
                ),
            ]
        return [
            (
                {"io": "staged"},
                (
                    "the default before 8e69e80 (one token per CTA at decode B=128/S=2): 0.0636 against 2 per CTA's 0.0585 ms "
                    "in one run (H200, ec81287)"
                ),
            ),
            # one wave of 2-token CTAs: what io=auto takes at B=128/S=2 (resolve_io), named for the other decode shapes
            ({"io": "overlapped", "tokens_per_cta": 2, "n_split": 1}, overlapped.format("bf16 decode B=128/S=2", "0.0583", "0.0636")),
            (
                {"io": "staged", "tokens_per_cta": 4},
                (
                    "bf16 decode B=128/S=2 0.0603 vs 0.0637 ms (H200, f3b55b2); tuning runs: "
                    "tokens_per_cta=2 0.0645 against 0.0638 (95acaf6); the study's best 63.0 us against the default's "
                    "63.3, not this candidate (d041eab)"
                ),
            ),
            ({"handoff": "before_pv"}, "bf16 decode B=128/S=2 0.0599 vs 0.0636 ms (H200, 34010dc)"),
            halves,
            (
                {"handoff": "before_pv", "lanes": "column"},
                "bf16 decode B=128/S=2 0.0623 vs 0.0644 ms (H200, 9765af3)",
            ),
        ]


DECODE_TILE, PREFILL_TILE, BF16_TILE = SparseAttnDecode(), SparseAttnPrefill(), SparseAttnBf16()
TILES = [DECODE_TILE, PREFILL_TILE, BF16_TILE]


def make_attention_inputs(shape: Shape, seed: int, device: str | torch.device, kv_format: str = "fp4") -> Inputs:
    """Random inputs shaped like the model's: unit-scale latents, decode windows over the latest ring
    entries and distinct top-k over the context, prefill windows/top-k causal (-1 early on, top-k
    drawn with repeats among the visible entries)."""
    B, S, H, D, W, K, Nw, Nc = (shape[k] for k in ("B", "S", "H", "D", "W", "K", "Nw", "Nc"))
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, S, H, D, generator=g, device=device).to(torch.bfloat16)  # [B, S, H, D]
    window_kv = torch.randn(B, Nw, D, generator=g, device=device)  # [B, Nw, D]
    main_kv = torch.randn(B, Nc, D, generator=g, device=device)  # [B, Nc, D]
    sink = torch.randn(H, generator=g, device=device)  # [H]
    if shape.phase == "decode":
        # token s sees ring slots s+1 .. s+W in a random order; top-k distinct over the whole context
        order = torch.rand(B, S, W, generator=g, device=device).argsort(dim=-1)
        window_idx = (order + torch.arange(S, device=device).view(1, S, 1) + Nw - W - S + 1).int()  # [B, S, W]
        topk_idx = torch.rand(B * S, Nc, generator=g, device=device).topk(K, dim=-1).indices.sort(dim=-1).values
        topk_idx = topk_idx.view(B, S, K).int()  # [B, S, K]
    else:
        t = torch.arange(S, device=device).view(1, S, 1)
        j = torch.arange(W, device=device).view(1, 1, W)
        window_idx = torch.where(j <= t, t - j, -1).expand(B, S, W).contiguous().int()  # [B, S, W]
        draw = (torch.rand(B, S, K, generator=g, device=device) * (t + 1)).long().clamp(max=Nc - 1)
        draw = torch.where(torch.arange(K, device=device).view(1, 1, K) <= t, draw, -1)
        topk_idx = torch.where(draw >= 0, draw, Nc).sort(dim=-1).values  # -1 slots last, rows sorted
        topk_idx = torch.where(topk_idx >= Nc, -1, topk_idx).int().contiguous()  # [B, S, K]
    inputs: Inputs = {"q": q, "window_idx": window_idx.contiguous(), "topk_idx": topk_idx, "sink": sink}
    if kv_format == "fp4":
        from model.formats import fp4_quantize, fp8_quantize

        inputs["window_codes"], inputs["window_scales"] = fp8_quantize(window_kv)  # [B, Nw, D], [B, Nw, D/32]
        inputs["main_packed"], inputs["main_scales"] = fp4_quantize(main_kv, 16, "e4m3")  # [B, Nc, D/2], [B, Nc, D/16]
    else:
        inputs["window_kv"] = window_kv.to(torch.bfloat16)
        inputs["main_kv"] = main_kv.to(torch.bfloat16)
    if shape.dims.get("pool"):
        _into_pools(inputs, kv_format, g)
    return inputs


POOL_PAGE = PAGE_SIZE  # rows per page of the test pools (the paged cache's default page size)


def _into_pools(inputs: Inputs, kv_format: str, g: torch.Generator) -> None:
    """Move each cache into a pool every batch row reads: the main KV in pages of POOL_PAGE rows, the window KV one
    ring per slot, both in a random page order with random bytes in the rows no sequence owns; the indices become
    pool rows. The logical indices and each sequence's rows (``*_rows`` [B, N]) stay for the reference."""
    names = {"window": ("window_codes", "window_scales") if kv_format == "fp4" else ("window_kv",)}
    names["main"] = ("main_packed", "main_scales") if kv_format == "fp4" else ("main_kv",)
    for cache, idx_name, page in (("window", "window_idx", None), ("main", "topk_idx", POOL_PAGE)):
        first = inputs[names[cache][0]]
        B, N = first.shape[:2]
        page = page or N  # a window ring is one slot of N rows
        per_row = -(-N // page)
        spare = max(1, B // 4)  # pages no sequence owns: a wrong row lands in random bytes
        pages = torch.randperm(B * per_row + spare, generator=g, device=first.device)[: B * per_row].view(B, per_row)
        logical = torch.arange(N, device=first.device)
        rows = pages[:, logical // page] * page + logical % page  # [B, N] pool row of each sequence's entry
        for name in names[cache]:
            t = inputs[name]
            bits = t.view(torch.uint8) if t.dtype != torch.uint8 else t
            pool = torch.randint(0, 256, ((B * per_row + spare) * page, *bits.shape[2:]), generator=g, device=t.device, dtype=torch.uint8)
            if t.dtype == torch.bfloat16:  # random bf16 bytes may be NaN/inf: a finite noise instead
                pool = torch.randn(pool.shape[0], *t.shape[2:], generator=g, device=t.device).to(t.dtype).view(torch.uint8)
            pool[rows.reshape(-1)] = bits.reshape(B * N, *bits.shape[2:])
            inputs[name] = pool.view(t.dtype).unsqueeze(0)  # [1, R, ...]
        idx = inputs[idx_name]
        inputs[f"{idx_name}_logical"] = idx
        inputs[idx_name] = torch.where(idx >= 0, rows.gather(1, idx.clamp(min=0).flatten(1).long()).view_as(idx), -1).int()
        inputs[f"{cache}_rows"] = rows
