"""The compressor tile as the lab's harness and tuner see it: shapes, search space and constraints, inputs, the torch
reference and the FP4 cache comparison."""

import torch

from model import formats
from model.ops.compressor import compressor_latents, index_keys, main_entries
from model.ops.rope import RopeConfig, rope_tables
from tiles.compressor.common import (
    DEQ_RTOL,
    DI,
    INDEX_GROUP,
    MAIN_GROUP,
    MAX_CODE_DIFF_FRACTION,
    MULTI_CTA_CHUNK,
    D,
)
from tiles.compressor.launch import build_kernel, kernel_schedule, prepared_forms, wk_args
from tiles.compressor.space import (
    MMA_PROJS,
    compressor_search_space,
    occupancy_compress,
    proj_registers_refusal,
    smem_compress,
)
from tiles.core.arch import Arch
from tiles.core.contract import Comparison, Config, Inputs, SearchSpace, Shape, Tile, poisoned
from tiles.core.shapes import compressor_shapes, flash


def compare_fp4_caches(outputs, expected) -> Comparison:
    """The compressor's comparison rule (module docstring): near bit-exact, differences one code step."""
    worst, notes, ok = 0.0, [], True
    for name, group, fmt in (("main", MAIN_GROUP, "e4m3"), ("idx", INDEX_GROUP, "e8m0")):
        p, s = outputs[f"{name}_packed"], outputs[f"{name}_scales"]
        rp, rs = expected[f"{name}_packed"].to(p.device), expected[f"{name}_scales"].to(p.device)
        if p.shape != rp.shape or s.shape != rs.shape:
            return Comparison(
                False, "fp4-near-exact", 1.0, f"{name}: shapes {tuple(p.shape)}/{tuple(s.shape)} != {tuple(rp.shape)}/{tuple(rs.shape)}"
            )
        codes, rcodes = formats.unpack_nibbles(p), formats.unpack_nibbles(rp)
        # One code step: neighbouring magnitudes of the same sign, or +0/-0/+-0.5 around zero.
        mag, rmag = (codes & 7).int(), (rcodes & 7).int()
        same_sign = (codes & 8) == (rcodes & 8)
        step_ok = (codes == rcodes) | (same_sign & ((mag - rmag).abs() <= 1)) | ((mag <= 1) & (rmag <= 1))
        # A scale one step off (amax on a rounding boundary of the scale) requantises its whole
        # group, so the one-step rule applies to codes under equal scales only; such groups are
        # bounded by the scale-byte fraction and the dequantised error instead.
        same_scale = (s == rs).repeat_interleave(group, dim=-1)  # [..., N] per value
        step_ok = step_ok | ~same_scale
        s_ok = (s.int() - rs.int()).abs() <= 1
        frac_p = float((p != rp).float().mean())
        frac_s = float((s != rs).float().mean())
        deq = formats.fp4_dequantize(p, s, group, fmt)
        rdeq = formats.fp4_dequantize(rp, rs, group, fmt)
        rel = float((deq - rdeq).norm() / rdeq.norm().clamp(min=1e-30))
        good = (
            bool(step_ok.all())
            and bool(s_ok.all())
            and frac_p <= MAX_CODE_DIFF_FRACTION
            and frac_s <= MAX_CODE_DIFF_FRACTION
            and rel <= DEQ_RTOL
        )
        ok &= good
        worst = max(worst, frac_p, frac_s)
        notes.append(f"{name}: {frac_p:.2e} bytes, {frac_s:.2e} scales differ, rel_l2 {rel:.2e}{'' if good else ' (FAIL)'}")
    return Comparison(ok, "fp4-near-exact", worst, "; ".join(notes))


class CompressorTile(Tile):
    """Pooling + RMSNorm + RoPE + FP4 main cache + index-K projection/norm/RoPE + FP4 index cache, one pass."""

    name = "compressor"
    description = "gated pooling, RMSNorm, RoPE, FP4 E4M3/16 main cache and fused 512->128 index-K (tf32x3 or f16x3 MMA) into FP4 E8M0/32"

    def shapes(self) -> list[Shape]:
        return compressor_shapes()

    def search_space(self, arch: Arch) -> SearchSpace:
        return compressor_search_space(arch)

    def default_config(self, arch: Arch) -> Config:
        # Hopper: the staged loads (bulk copies, double-buffered) with 32 groups per CTA and
        # 32-wide projection chunks so the two weight stages fit next to the kv/gate slabs; the
        # direct path measured 9% of copy bandwidth at prefill_r2_s64k (H200, 8cf2bdf).
        # Elsewhere: the direct path with the largest tile that fits the per-block shared memory.
        # encode=thresholds on Hopper: the same bytes without divisions, H200, one run (84d7a8c): prefill 64K ratio 2
        # 0.426 -> 0.295 ms per call, ratio 1 0.639 -> 0.490 ms. Not measured elsewhere: the direct path keeps "divide".
        # Then two CTAs per SM with Wk read once in fp32, H200, one run against the previous default (28b25cc): ratio 2
        # 0.294 -> 0.250 ms, ratio 1 0.491 -> 0.375 ms (hi_lo Wk ran ratio 2 at 0.241 ms but was not run at ratio 1: a
        # tuning choice).
        if arch.family == "hopper":
            cfg = {
                "block_g": 32,
                "threads": 256,
                # The projection's three products in fp16 on m16n8k16 (half the MMAs of tf32x3, Wk split on the host; index
                # codes closer to the reference's), H200, one run against tf32x3 (ba7f262): prefill 64K ratio 2 0.1447 ->
                # 0.1296 ms, ratio 1 0.2293 -> 0.1982 ms, decode B=64 ratio 2 0.0122 -> 0.0103 ms, ratio 1 0.0108 -> 0.0095 ms.
                "proj": "f16x3",
                "k_chunk": 16,
                "load": "staged",
                "encode": "thresholds",
                "ctas_per_sm": 2,
                "wk": "fp32",
                "schedule": "flat",  # what two CTAs per SM run (no producer warpgroup)
                "wk_stages": 2,
                # The pooling's kv/gate straight from global memory into registers, no slabs and no barriers, H200, one
                # run against the slabs (ac10b3b): ratio 2 0.2506 -> 0.2228 ms, ratio 1 0.3762 -> 0.3499 ms at 64K.
                "kv_load": "direct",
                # The TF32x3 projection's operands from registers (the same MMAs on the same bits, ~6x fewer shared-memory
                # wavefronts), H200, one run against the shared-memory operands (5f78fe9): prefill 64K ratio 2 0.2221 ->
                # 0.1677 ms, ratio 1 0.3504 -> 0.2365 ms, decode B=64 ratio 2 0.0328 -> 0.0247 ms.
                "proj_operands": "registers",
                # Ratio 2's softmax by __expf and one approximate reciprocal (a few ulps, within the comparison rule), H200,
                # one run against the reference's expression (e7d4e86): prefill 64K ratio 2 0.1679 -> 0.1581 ms, decode
                # B=64 ratio 2 0.0249 -> 0.0213 ms; main-cache bytes that differ from the torch reference 2.4e-7 -> 4.8e-7
                # of them (at 64K).
                "pool_math": "fast",
                "proj_accumulators": "shared",
                # The RMSNorm on the pooled rows in registers (rot_s written once, no norm passes or barrier), H200, one
                # run against the separate passes (6a0ff60): prefill 64K ratio 2 0.1478 -> 0.1450 ms, ratio 1 0.2493 ->
                # 0.2312 ms, decode B=64 ratio 2 0.0124 -> 0.0122 ms, ratio 1 0.0119 -> 0.0109 ms (three CTAs of 16, below).
                "norm_pass": "in_pool",
                "proj_k_split": 1,
                "main_pass": "separate",  # "in_pool": slower at decode (H200, 4310866); the 64K winners take it
                "proj_latent": "fp32",
                "proj_out": "k_s",
                "main_store": "bulk",
                "proj_pipeline": "near",
            }
            # Then three CTAs per SM of 16 groups (what the fast pooling's registers allow with the direct loads), H200,
            # one run against two of 32 (d709727): prefill 64K ratio 2 0.1584 -> 0.1487 ms, decode B=64 ratio 2 0.0213 ->
            # 0.0124 ms; ratio 1 at 64K is 5% slower (0.2371 -> 0.2489 ms: nothing to pool, so nothing to overlap), two
            # CTAs of 32 stay its tuning candidate. Ratio 2 is three of the four Full layers.
            cfg.update(block_g=16, ctas_per_sm=3)
            if smem_compress(cfg, Shape("default", "any", {"ratio": 2}), arch) is None:
                return cfg
        for block_g, k_chunk in ((32, 64), (16, 64), (16, 32)):
            cfg = {"block_g": block_g, "threads": 256, "proj": "tf32x3", "k_chunk": k_chunk, "load": "direct", "encode": "divide"}
            cfg.update(ctas_per_sm=1, wk="hi_lo", schedule="ws", wk_stages=2, kv_load="slabs", proj_operands="smem", pool_math="ieee")
            cfg.update(proj_accumulators="shared", norm_pass="separate", proj_k_split=1, main_pass="separate", proj_latent="fp32")
            cfg.update(proj_out="k_s", main_store="bulk", proj_pipeline="near")
            if smem_compress(cfg, Shape("default", "any", {}), arch) is None:
                return cfg
        return cfg

    def candidates(self, arch: Arch, shape: Shape) -> list[tuple[Config, str]]:
        """Ratio 1 on Hopper: the flat kernel with 64 groups per CTA and the block's kv rows in one copy beat the
        default there (H200, same run: 0.327 / 0.349 vs 0.377 ms at prefill_r1_s64k, 9765af3); at ratio 2 block_g 64 was
        2% slower and kv_load=whole does not exist. Not a default, which serves both ratios.
        Prefill at ratio 2 on Hopper: two CTAs of 32 with the k-split projection, 1.7% faster than the default in one run
        (H200, 0.1418 vs 0.1443 ms at 64K, 45064e7); not a default (two CTAs of 32 were 70% slower at decode: 0.0213 vs
        0.0124 ms, d709727). With ``main_pass="in_pool"`` on top: 0.1354 vs 0.1457 ms the default (6eddb42); main_pass
        alone was even at ratio 2 and slower at decode there. The default projects in fp16 (proj="f16x3", ba7f262); the
        layouts measured before it pin tf32x3, and each ratio has its f16x3 layout (ba7f262, 5132bcb). Three CTAs of 32
        (proj_out="rot_s", main_store="registers"): 96c85c1; with the RoPE coefficients prefetched and
        proj_pipeline="deep": 9961aff."""
        if arch.family != "hopper":
            return []
        tf32 = {"proj": "tf32x3"}  # the layouts measured before f16x3 became the default (ba7f262)
        split_once = {"proj_latent": "f16_split"}  # f16x3's latent split by the main pass, not by every projection warp
        compact = {"proj_out": "rot_s", "main_store": "registers"}  # what lets three CTAs of 32 share an SM
        deep = {"proj_pipeline": "deep"}  # Wk four chunks ahead, the latent one
        if shape.dims.get("ratio") == 2 and shape.phase == "prefill":
            return [
                ({"block_g": 32, "ctas_per_sm": 2, "proj_k_split": 2, **tf32}, "r2 64K 0.1418 vs 0.1443 ms (H200, 45064e7)"),
                (
                    {"block_g": 32, "ctas_per_sm": 2, "proj_k_split": 2, "main_pass": "in_pool", **tf32},
                    "r2 64K 0.1354 vs 0.1457 ms the default (H200, 6eddb42)",
                ),
                (
                    {"block_g": 32, "ctas_per_sm": 2, "main_pass": "in_pool"},
                    "r2 64K 0.1264 vs 0.1296 ms the f16x3 default (H200, ba7f262)",
                ),
                (
                    {"block_g": 32, "ctas_per_sm": 2, "main_pass": "in_pool", **split_once},
                    "r2 64K 0.1223 vs 0.1273 ms split per warp (H200, 5132bcb)",
                ),
                ({"main_pass": "in_pool", **split_once}, "r2 64K 0.1403 vs 0.1308 ms the default (H200, 5132bcb): slower"),
                (
                    {"block_g": 32, "ctas_per_sm": 3, "main_pass": "in_pool", **split_once, **compact},
                    "r2 64K 0.1144 vs 0.1158 ms two CTAs of 32 (H200, 9961aff, RoPE coefficients prefetched)",
                ),
                (
                    {"block_g": 32, "ctas_per_sm": 2, "main_pass": "in_pool", **split_once, **deep},
                    "r2 64K 0.1151 / 0.1154 vs 0.1158 ms proj_pipeline=near (H200, 9961aff)",
                ),
            ]
        if shape.dims.get("ratio") == 2:  # decode
            return [
                (
                    {"main_pass": "in_pool", **split_once, **compact, **deep},
                    "r2 decode B=64 0.00901 vs 0.00928 ms proj_pipeline=near, 0.01025 the default (H200, 9961aff)",
                )
            ]
        if shape.dims.get("ratio") != 1:
            return []
        return [
            ({"schedule": "flat", "block_g": 64, "kv_load": "whole", "wk_stages": 4}, "r1 64K 0.327 vs 0.377 ms (H200)"),
            ({"block_g": 32, "ctas_per_sm": 2, "kv_load": "whole", "wk_stages": 3}, "r1 64K 0.349 vs 0.377 ms (H200)"),
            (
                {"block_g": 32, "ctas_per_sm": 2, **tf32},
                "r1 64K 0.2251 vs 0.2312 ms at three CTAs of 16, both norm_pass=in_pool (H200, 6a0ff60)",
            ),
            (
                {"block_g": 32, "ctas_per_sm": 2, "proj_accumulators": "split", **tf32},
                "r1 64K 0.2115 vs 0.2251 ms with one accumulator, 0.2312 the default (H200, 6a0ff60, norm_pass=in_pool)",
            ),
            ({"block_g": 32, "ctas_per_sm": 2, "proj_k_split": 2, **tf32}, "r1 64K 0.2147 vs 0.2292 ms the default (H200, 45064e7)"),
            ({"main_pass": "in_pool", **tf32}, "r1 64K 0.2260 vs 0.2317 ms the default (H200, 6eddb42)"),
            (
                {"block_g": 32, "ctas_per_sm": 2, "proj_accumulators": "split", "main_pass": "in_pool"},
                "r1 64K 0.1885 vs 0.1982 ms the f16x3 default (H200, ba7f262)",
            ),
            (
                {"block_g": 32, "ctas_per_sm": 2, "proj_accumulators": "split", "main_pass": "in_pool", **split_once},
                "r1 64K 0.1729 vs 0.1907 ms split per warp (H200, 5132bcb)",
            ),
            (
                {"block_g": 32, "ctas_per_sm": 3, "main_pass": "in_pool", **split_once, **compact},
                "r1 64K 0.1501 vs 0.1605 ms two CTAs of 32 with split accumulators (H200, 96c85c1)",
            ),
            (
                {"main_pass": "in_pool", **split_once, **compact, **deep},
                "r1 decode B=64 0.00841 vs 0.00884 ms proj_pipeline=near, 0.00938 the default (H200, 9961aff)",
            ),
        ]

    def with_defaults(self, arch: Arch, config: Config) -> Config:
        """``config`` over the default. A config that picks a one-CTA choice (direct loads, simt, other threads,
        block_g or k_chunk, schedule="ws") without naming ``ctas_per_sm`` gets the one-CTA kernel (ctas_per_sm 1,
        Wk hi/lo, k_chunk 32 unless named), as it did before two CTAs per SM became Hopper's default: {"load":
        "direct"} alone is valid.
        With ``schedule="flat"`` named (e.g. {"schedule": "flat", "block_g": 64}) it gets the flat kernel at one CTA per
        SM and keeps the default's k_chunk 16 and wk."""
        cfg = {**self.default_config(arch), **config}
        multi_cta_ok = cfg["load"] == "staged" and cfg["proj"] in MMA_PROJS and cfg["threads"] == 256
        multi_cta_ok = multi_cta_ok and cfg["block_g"] in (16, 32) and cfg["k_chunk"] == MULTI_CTA_CHUNK
        multi_cta_ok = multi_cta_ok and cfg.get("schedule", "flat") == "flat"
        if "ctas_per_sm" not in config and cfg.get("ctas_per_sm", 1) > 1 and not multi_cta_ok:
            if config.get("schedule") == "flat":
                # The flat kernel at one CTA per SM (e.g. block_g 64): the default's flat-kernel choices stay.
                cfg.update(ctas_per_sm=1)
            else:
                cfg.update(ctas_per_sm=1, wk=config.get("wk", "hi_lo"), k_chunk=config.get("k_chunk", 32), schedule="ws")
                cfg.update(kv_load=config.get("kv_load", "slabs"))  # the ws kernel streams kv through slabs
        if "ctas_per_sm" not in config and cfg["block_g"] == 32 and cfg.get("ctas_per_sm", 1) == 3:
            cfg["ctas_per_sm"] = 2  # 32 groups fit two CTAs per SM, not the default's three
        if "ctas_per_sm" not in config and "block_g" not in config and cfg.get("ctas_per_sm", 1) == 3:
            # What the three CTAs cannot run with (e.g. pool_math="ieee" with the direct loads: spills) gets two CTAs of
            # 32, Hopper's default before three CTAs of 16 (d709727).
            r2, two = Shape("default", "any", {"ratio": 2}), {**cfg, "block_g": 32, "ctas_per_sm": 2}
            if occupancy_compress(cfg, r2, arch) is not None and occupancy_compress(two, r2, arch) is None:
                cfg.update(block_g=32, ctas_per_sm=2)
        if "proj_operands" not in config and cfg.get("proj_operands") == "registers" and proj_registers_refusal(cfg, kernel_schedule(cfg)):
            cfg["proj_operands"] = "smem"  # what the picked choices leave the register operands unable to run with
        if "proj" not in config and cfg["proj"] == "f16x3" and cfg.get("proj_operands") != "registers":
            cfg["proj"] = "tf32x3"  # f16x3 is built in the register projection only
        if "norm_pass" not in config and cfg.get("norm_pass") == "in_pool" and cfg.get("kv_load") != "direct":
            cfg["norm_pass"] = "separate"  # the pooled rows are in registers only with the direct loads
        if "main_pass" not in config and cfg.get("main_pass") == "in_pool" and cfg["norm_pass"] != "in_pool":
            cfg["main_pass"] = "separate"  # and only then can the main cache be encoded from them
        return cfg

    def build(self, shape: Shape, config: Config, arch: Arch):
        return build_kernel(arch, shape["ratio"], self.with_defaults(arch, config))

    def make_inputs(self, shape: Shape, seed: int, device="cuda") -> Inputs:
        B, S, ratio = shape["B"], shape["S"], shape["ratio"]
        gen = torch.Generator(device=device).manual_seed(seed)
        G = S // ratio
        kv = torch.randn(B, S, D, generator=gen, device=device)  # [B, S, D]
        gate = torch.randn(B, S, D, generator=gen, device=device) * 2  # [B, S, D]
        first = int(torch.randint(0, 4096, (1,), generator=gen, device=device))  # groups already in the cache
        rope = _rope()
        cos, sin = rope_tables(rope, (torch.arange(G, device=device) + first) * ratio)  # [G, 32]
        return {
            "kv": kv,
            "gate": gate,
            "norm_weight": 1 + 0.1 * torch.randn(D, generator=gen, device=device),
            "wk": torch.randn(DI, D, generator=gen, device=device) * D**-0.5,
            "k_norm_weight": 1 + 0.1 * torch.randn(DI, generator=gen, device=device),
            "cos": cos,
            "sin": sin,
            "first_group": torch.tensor([first]),
            "ratio": torch.tensor([ratio]),
        }

    def alloc_outputs(self, kernel, inputs: Inputs) -> dict[str, torch.Tensor]:
        kv, ratio = inputs["kv"], int(inputs["ratio"])
        B, S, _ = kv.shape
        G = S // ratio
        return {
            "main_packed": poisoned((B, G, D // 2), torch.uint8, kv.device),  # [B, G, 256]
            "main_scales": poisoned((B, G, D // MAIN_GROUP), torch.uint8, kv.device),  # [B, G, 32]
            "idx_packed": poisoned((B, G, DI // 2), torch.uint8, kv.device),  # [B, G, 64]
            "idx_scales": poisoned((B, G, DI // INDEX_GROUP), torch.uint8, kv.device),  # [B, G, 4]
        }

    def launch(self, kernel, inputs: Inputs, outputs: dict[str, torch.Tensor]) -> None:
        kv, ratio = inputs["kv"], int(inputs["ratio"])
        if "eps" not in inputs:  # a per-layer constant, made once per input set (the prepared Wk forms: prepared_forms)
            inputs["eps"] = torch.tensor([flash().norm_eps], dtype=torch.float32, device=kv.device)
        gate = kv if ratio == 1 else inputs["gate"]
        wk_hi, wk_lo = wk_args(kernel, inputs["wk"], prepared_forms(inputs["wk"]))  # fp32 wk: no copy
        args = (
            inputs["norm_weight"],
            inputs["cos"],
            inputs["sin"],
            wk_hi,
            wk_lo,
            inputs["k_norm_weight"],
            inputs["eps"],
        )
        kernel(kv, gate, *args, outputs["main_packed"], outputs["main_scales"], outputs["idx_packed"], outputs["idx_scales"])

    def public_call(self, shape: Shape, inputs: Inputs, config: Config):
        from tiles.compressor.api import compress

        i, ratio = inputs, int(inputs["ratio"])
        gate = i["gate"] if ratio == 2 else None
        args = (i["kv"], gate, ratio, i["norm_weight"], i["cos"], i["sin"], i["wk"], i["k_norm_weight"], flash().norm_eps)
        return lambda: compress(*args, config=config)

    def reference(self, inputs: Inputs) -> dict[str, torch.Tensor]:
        ratio, first = int(inputs["ratio"]), int(inputs["first_group"])
        gate = inputs["gate"] if ratio == 2 else None
        eps = flash().norm_eps
        latent = compressor_latents(inputs["kv"], gate, ratio, inputs["norm_weight"], eps)  # [B, G, D] before RoPE
        k = index_keys(latent, inputs["wk"], inputs["k_norm_weight"], first, ratio, _rope(), eps)  # [B, G, Di]
        mp, ms = formats.fp4_quantize(main_entries(latent, first, ratio, _rope()), MAIN_GROUP, "e4m3")
        ip, is_ = formats.fp4_quantize(k, INDEX_GROUP, "e8m0")
        return {"main_packed": mp, "main_scales": ms, "idx_packed": ip, "idx_scales": is_}

    def compare(self, outputs, expected) -> Comparison:
        return compare_fp4_caches(outputs, expected)

    def flops(self, shape: Shape) -> float:
        G = shape["B"] * shape["S"] // shape["ratio"]
        return 2.0 * G * D * DI

    def bytes_moved(self, shape: Shape) -> float:
        # kv (and gate for ratio 2) read once, both caches written once; weights are noise.
        B, S, ratio = shape["B"], shape["S"], shape["ratio"]
        G = S // ratio
        return B * S * D * 4 * (2 if ratio == 2 else 1) + B * G * (D // 2 + D // MAIN_GROUP + DI // 2 + DI // INDEX_GROUP)


def _rope() -> RopeConfig:
    cfg = flash()
    return RopeConfig(
        cfg.rope_dim, cfg.compress_rope_theta, cfg.yarn_factor, cfg.yarn_original_seq_len, cfg.yarn_beta_fast, cfg.yarn_beta_slow
    )


COMPRESSOR = CompressorTile()
TILES = [COMPRESSOR]
