"""The three indexer tiles (indexer_topk, candidate_pool, reindex_topk) as the lab's harness and tuner see them."""

from typing import Any

import torch

from model.ops.indexer import candidate_blocks, pool_mask, topk_positions
from tiles.core.arch import Arch
from tiles.core.compare import relative_l2
from tiles.core.contract import (
    Comparison,
    Config,
    Constraint,
    Inputs,
    Param,
    SearchSpace,
    Shape,
    Tile,
    canonical_key,
    kernel_sources_of,
    poisoned,
)
from tiles.core.shapes import flash, indexer_shapes, reindex_shapes
from tiles.indexer.common import GROUP, HEAD_DIM, HEADS, NEG_INF, SCORE_RTOL
from tiles.indexer.dequant import FP8_MAX_BLOCK_N, REGISTER_A_DEQUANTS
from tiles.indexer.launch import build_score, build_two_pass, index_k_words, launch_pool, launch_reindex, launch_topk
from tiles.indexer.policy import RADIX_DEFAULT, SELECT_SPLITS, radix_config, resolve_select_split, resolve_tiles_per_cta
from tiles.indexer.radix_select import remapped_kernel
from tiles.indexer.reference import compare_topk_sets, indexer_inputs, into_page_pool, merge, random_pool, reference_scores
from tiles.indexer.score_kernel import HIDDEN_TILES
from tiles.indexer.select_kernel import block_max_kernel, build_select_kernel
from tiles.indexer.space import (
    RADIX_PARAMS,
    SCORE_DEFAULT,
    SCORE_DEFAULT_SM90,
    SELECT_ALGO,
    SELECT_DEFAULT,
    dequant_arch,
    epilogue_fits,
    fragment_rows,
    page_fits,
    radix_smem,
    radix_two_pass_only,
    register_cap,
    rs_registers,
    score_params,
    select_params,
    smem_score,
    warps_fit,
)


class _ScoreAndSelectTile(Tile):
    """What the two score-then-select tiles share: one search space and one default."""

    def search_space(self, arch: Arch) -> SearchSpace:
        return SearchSpace(
            score_params() + select_params(),
            (
                Constraint("smem", smem_score),
                Constraint("warpgroups", warps_fit),
                Constraint("fragment_rows", fragment_rows),
                Constraint("register_cap", register_cap),
                Constraint("rs_registers", rs_registers),
                Constraint("epilogue", epilogue_fits),
                Constraint("dequant_arch", dequant_arch),
                Constraint("page", page_fits),
            ),
        )

    def default_config(self, arch: Arch) -> Config:
        if arch.family == "hopper":
            return {**SCORE_DEFAULT_SM90, **SELECT_DEFAULT}
        return {**SCORE_DEFAULT, **SELECT_DEFAULT}

    def with_defaults(self, arch: Arch, config: Config) -> Config:
        """``config`` over the default. A config that picks a dequant other than the RS ones without naming
        ``epilogue`` gets ``per_tile`` (``hoisted`` and ``fused`` are built for the RS dequants only): {"dequant": "shared"}
        alone is valid on every arch; one that picks two consumer warpgroups gets ``hoisted``; {"dequant": "fp8_rs"}
        without a ``block_n`` gets at most FP8_MAX_BLOCK_N."""
        cfg = {**self.default_config(arch), **config}
        if cfg["dequant"] == "fp8_rs" and "block_n" not in config:
            cfg["block_n"] = min(cfg["block_n"], FP8_MAX_BLOCK_N)
        if "epilogue" not in config and cfg["dequant"] not in REGISTER_A_DEQUANTS:
            cfg["epilogue"] = "per_tile"
        elif "epilogue" not in config and cfg["epilogue"] == "fused" and epilogue_fits(cfg, None, arch):
            cfg["epilogue"] = "hoisted"  # fused reads one warpgroup's accumulator layout: {"threads": 256} alone is valid
        return cfg


class IndexerTopkTile(_ScoreAndSelectTile):
    """Scores over the packed FP4 index K + top-k (two kernels: score rows, then radix select)."""

    name = "indexer_topk"
    description = "indexer scores over packed FP4 index K (bf16 wgmma after in-kernel dequant) + radix top-k sorted by position"

    def shapes(self) -> list[Shape]:
        return indexer_shapes()

    def search_space(self, arch: Arch) -> SearchSpace:
        space = super().search_space(arch)
        split = Param(
            "select_split", ("auto", *SELECT_SPLITS), "score rows cut into parts: a top-k per part (more CTAs), then of the candidates"
        )
        hidden = Param(
            "hidden_tiles",
            HIDDEN_TILES,
            "entry tiles past the token's visible count: scored and masked (score), or left out of the CTA's tile loop "
            "and written -inf (skip; a prefill token sees the cache up to itself)",
        )
        return SearchSpace(
            space.params + (hidden, split, SELECT_ALGO) + RADIX_PARAMS,
            space.constraints + (Constraint("radix_two_pass_only", radix_two_pass_only), Constraint("radix_smem", radix_smem)),
        )

    def default_config(self, arch: Arch) -> Config:
        # auto: as many parts as fill the SMs twice (8 for decode B=64, 1 for prefill), from the H200 profile
        cfg = {
            **super().default_config(arch),
            "hidden_tiles": "score",
            "select_split": "auto",
            "select_algo": "multipass",
            **RADIX_DEFAULT,
        }
        if arch.family == "hopper":
            # H200, one run (281866f): byte-permute dequant, two CTAs per SM
            # and the two-pass select: decode B=64 x 128K 1.318 -> 0.530 ms per call, prefill 4K 2.253 -> 1.012 ms.
            # (prmt at 128 threads with min_ctas 3 ran decode at 0.468 ms but was not run at prefill: a tuning choice.)
            cfg.update(dequant="prmt", min_ctas=2, select_algo="two_pass")
            # Then the prmt decode straight into wgmma's A registers (H200, 28b25cc, prmt timed in the same run): decode
            # B=64 x 128K 0.527 -> 0.376 ms per call, prefill 4K 1.005 -> 0.712 ms.
            cfg.update(dequant="prmt_rs")
            # The per-CTA constants of the tile loop's epilogue (head weights, store pointer) held in registers
            # (H200, 9765af3, per_tile timed in the same run): decode B=64 x 128K 0.378 -> 0.354 ms per call, prefill 4K
            # 0.715 -> 0.663 ms. (With stages 4 decode ran 0.348 ms; not run at prefill: a tuning choice.)
            cfg.update(epilogue="hoisted")
            # 256-entry tiles on one consumer warpgroup, one stage: the per-tile fixed work (barriers, wgmma issue and
            # wait, the epilogue) spread over twice the entries (H200, 1dac5e2, the previous default timed in the same
            # run): decode B=64 x 128K 0.353 -> 0.309 ms per call; prefill 4K 0.663 -> 0.586 ms as the prefill tuning
            # study's winner (74ad928).
            cfg.update(block_n=256, threads=128, stages=1)
            # The consumer's epilogue written by hand: FMA head sum, transposed 4-lane reduction, every lane stores its
            # rows (H200, 5f78fe9, hoisted timed in the same run): decode B=64 x 128K 0.3092 -> 0.2950 ms per call,
            # prefill 4K 0.5851 -> 0.5583 ms.
            cfg.update(epilogue="fused")
            # 16 tiles per CTA left one sequence's 128K entries 32 CTAs: the grid sized to the SMs instead
            # (H200, one run, f2c2480): decode B=1 x 128K 0.0291 -> 0.0149 ms per call; B=64 and prefill resolve to 16
            # tiles, the kernels they ran before.
            cfg.update(tiles_per_cta="auto")
            # The tile loop ends at the last tile holding an entry the token sees (H200, one run, score kernel alone and
            # lab bench, 78c058d): prefill 4K score kernel 471.0 -> 260.5 us, 0.5541 -> 0.3442 ms per call; decode B=64
            # x 128K 0.2943 -> 0.2878 ms; B=1 0.0255 -> 0.0254 ms.
            cfg.update(hidden_tiles="skip")
        return cfg

    def candidates(self, arch: Arch, shape: Shape) -> list[tuple[Config, str]]:
        """Hopper: the previous default's 128-entry tiles on two consumer warpgroups with four stages
        (H200, 9765af3: decode B=64 x 128K 0.348 ms, against 0.309 ms for the 256-entry tiles that replaced it, timed
        in a later run, 1dac5e2; not run at prefill)."""
        if arch.family != "hopper":
            return []
        return [
            ({"block_n": 128, "threads": 256, "stages": 4}, "decode B=64 x 128K 0.348 ms (H200, 9765af3)"),
            # the random sampler rarely meets the staged select with the default score kernel (one trial in 153 of the
            # B=1 x 128K tuning study, c110996); the select timed alone on one 128K row: 25.4 -> 21.0 us (H200, 0f2e979)
            (
                {"radix_stage": "shared", "radix_threads": 512},
                "one 128K row's select 21.0 us vs 25.4 (H200, 0f2e979)",
            ),
        ]

    def kernel_key(self, shape: Shape, config: Config, arch: Arch) -> str:
        """The config with ``tiles_per_cta`` resolved as the score launch resolves it; under the two-pass select without
        the multipass select's keys (its launch reads only the ``radix_*`` ones, whose "auto" knobs stay as named: a
        conservative key), under the multipass one with ``select_split`` resolved as its launch resolves it."""
        cfg = self.with_defaults(arch, config)
        rows, n = shape["B"] * shape["S"], shape["N"]
        cfg["tiles_per_cta"] = resolve_tiles_per_cta(cfg["tiles_per_cta"], rows, n, cfg["block_n"], arch)
        if cfg.get("select_algo", "multipass") == "two_pass":
            for multipass_only in ("select_threads", "radix_bits", "select_split"):
                cfg.pop(multipass_only, None)
        else:
            cfg["select_split"] = resolve_select_split(cfg.get("select_split", 1), rows, n, shape["K"], arch)
        return canonical_key(cfg)

    def _kernels(self, shape: Shape, cfg: Config, arch: Arch) -> dict[str, Any]:
        """The kernels one call launches, by name, compiled (or fetched from their caches) for the full ``cfg``."""
        kernels = {"score": build_score(arch, cfg, False, 8, shape["B"] * shape["S"], shape["N"], shape.dims.get("page", 0))}
        if cfg.get("select_algo", "multipass") == "two_pass":
            kernels.update(build_two_pass(arch, shape["B"] * shape["S"], shape["N"], shape["K"], radix_config(cfg)))
        else:
            kernels["select"] = build_select_kernel(arch.nvcc_arch, shape["K"], cfg["select_threads"], cfg["radix_bits"], 0)
        return kernels

    def build(self, shape: Shape, config: Config, arch: Arch):
        cfg = self.with_defaults(arch, config)
        self._kernels(shape, cfg, arch)
        return (cfg, arch, shape["K"], shape.dims.get("page", 0))

    def kernel_sources(self, shape: Shape, config: Config, arch: Arch) -> dict[str, str]:
        return kernel_sources_of(self._kernels(shape, self.with_defaults(arch, config), arch))

    def make_inputs(self, shape: Shape, seed: int, device="cuda") -> Inputs:
        inputs = indexer_inputs(shape["B"], shape["S"], shape["N"], seed, device, causal=shape.phase == "prefill")
        if shape.dims.get("page"):
            into_page_pool(inputs, shape["page"], torch.Generator(device=device).manual_seed(seed + 104729))
        return inputs

    def alloc_outputs(self, kernel, inputs: Inputs) -> dict[str, torch.Tensor]:
        _, _, k, page = kernel
        q = inputs["q"]
        B, S = q.shape[:2]
        N = inputs["block_table"].shape[1] * page if page else inputs["k_packed"].shape[1]
        scores = poisoned((B, S, N), torch.float32, q.device)  # [B, S, N]
        out = poisoned((B, S, k), torch.int32, q.device)  # [B, S, K]
        return {"topk": out, "scores": scores}

    def launch(self, kernel, inputs: Inputs, outputs: dict[str, torch.Tensor]) -> None:
        cfg, arch, _, page = kernel
        words, scales = index_k_words(inputs["k_packed"], inputs["k_scales"])
        args = (inputs["q"], inputs["weights"], words, scales, inputs["n_visible"], outputs["scores"], outputs["topk"])
        launch_topk(cfg, arch, *args, inputs.get("block_table"), page)

    def public_call(self, shape: Shape, inputs: Inputs, config: Config):
        from tiles.indexer.api import indexer_topk

        i, paged = inputs, {"block_table": inputs.get("block_table"), "page_size": shape.dims.get("page", 0)}
        return lambda: indexer_topk(i["q"], i["weights"], i["k_packed"], i["k_scales"], i["n_visible"], shape["K"], config=config, **paged)

    def reference(self, inputs: Inputs) -> dict[str, torch.Tensor]:
        scores = reference_scores(inputs)
        return {"topk": topk_positions(scores, flash().index_topk), "scores": scores}

    def compare(self, outputs, expected) -> Comparison:
        sc = relative_l2({"scores": outputs["scores"]}, {"scores": expected["scores"]}, SCORE_RTOL)
        return merge(sc, compare_topk_sets(outputs["topk"], expected["topk"], expected["scores"]))

    def flops(self, shape: Shape) -> float:
        B, S, N = shape["B"], shape["S"], shape["N"]
        return 2.0 * B * S * N * HEADS * HEAD_DIM

    def bytes_moved(self, shape: Shape) -> float:
        # The floor: the packed index K read once per batch row (68 B per entry), plus queries,
        # weights and the top-k written. Score rows the select kernel re-reads are not counted.
        B, S, N, K = shape["B"], shape["S"], shape["N"], shape["K"]
        return B * N * (HEAD_DIM // 2 + HEAD_DIM // GROUP) + B * S * (HEADS * HEAD_DIM * 2 + HEADS * 4 + K * 4)


class CandidatePoolTile(Tile):
    """Candidate pool of layer 20: block max over 8 positions + radix select of the best 2048 blocks."""

    name = "candidate_pool"
    description = "block max over 8 positions (newest block forced) + radix select of the best min(2048, n_blocks) blocks"

    def shapes(self) -> list[Shape]:
        return reindex_shapes()

    def search_space(self, arch: Arch) -> SearchSpace:
        return SearchSpace((Param("block_threads", (128, 256, 512), "threads of the block-max pass"),) + select_params() + (SELECT_ALGO,))

    def default_config(self, arch: Arch) -> Config:
        # Hopper: the two-pass select, H200, one run (84d7a8c):
        # decode B=64 x 128K 0.121 -> 0.034 ms per call, pools bit-exact. Elsewhere not measured: multipass.
        algo = "two_pass" if arch.family == "hopper" else "multipass"
        return {"block_threads": 256, **SELECT_DEFAULT, "select_algo": algo}

    def _kernels(self, shape: Shape, cfg: Config, arch: Arch) -> dict[str, Any]:
        """The kernels one call launches, by name, compiled (or fetched from their caches) for the full ``cfg``."""
        nb = -(-shape["N"] // shape["block"])
        k = min(shape["P"], nb)
        kernels = {"block_max": block_max_kernel(arch.nvcc_arch, shape["block"], cfg["block_threads"])}
        if cfg["select_algo"] == "two_pass":
            kernels.update(build_two_pass(arch, shape["B"] * shape["S"], nb, k))
        else:
            kernels["select"] = build_select_kernel(arch.nvcc_arch, k, cfg["select_threads"], cfg["radix_bits"], 0)
        return kernels

    def build(self, shape: Shape, config: Config, arch: Arch):
        cfg = self.with_defaults(arch, config)
        self._kernels(shape, cfg, arch)
        return (cfg, arch, shape["block"], shape["P"])

    def kernel_sources(self, shape: Shape, config: Config, arch: Arch) -> dict[str, str]:
        return kernel_sources_of(self._kernels(shape, self.with_defaults(arch, config), arch))

    def make_inputs(self, shape: Shape, seed: int, device="cuda") -> Inputs:
        B, S, N = shape["B"], shape["S"], shape["N"]
        gen = torch.Generator(device=device).manual_seed(seed)
        # Scores on a coarse grid so many blocks tie: the tie rule is exercised on every row.
        scores = torch.randint(-400, 400, (B, S, N), generator=gen, device=device).float() / 64  # [B, S, N]
        n_visible = N - torch.randint(0, max(1, N // 4), (B, S), generator=gen, device=device)
        if B * S > 2:  # a short row among many (a single row, as at decode B=1, sees the cache: see indexer_inputs)
            n_visible.view(-1)[0] = min(N, 13)
        scores.masked_fill_(torch.arange(N, device=device) >= n_visible.unsqueeze(-1), NEG_INF)
        return {"scores": scores, "n_visible": n_visible.to(torch.int32)}

    def alloc_outputs(self, kernel, inputs: Inputs) -> dict[str, torch.Tensor]:
        _, _, block, max_blocks = kernel
        B, S, N = inputs["scores"].shape
        nb = -(-N // block)
        block_scores = poisoned((B * S, nb), torch.float32, inputs["scores"].device)  # [B*S, nb]: the block-max pass's output
        out = poisoned((B, S, min(max_blocks, nb)), torch.int32, inputs["scores"].device)  # [B, S, P]
        return {"pool": out, "block_scores": block_scores}

    def launch(self, kernel, inputs: Inputs, outputs: dict[str, torch.Tensor]) -> None:
        cfg, arch, block, _ = kernel
        scores = inputs["scores"]
        B, S, N = scores.shape
        nvis = inputs["n_visible"].view(B * S)
        launch_pool(cfg, arch, scores.view(B * S, N), nvis, block, outputs["block_scores"], outputs["pool"])

    def public_call(self, shape: Shape, inputs: Inputs, config: Config):
        from tiles.indexer.api import candidate_pool

        return lambda: candidate_pool(inputs["scores"], inputs["n_visible"], shape["block"], shape["P"], config=config)

    def reference(self, inputs: Inputs) -> dict[str, torch.Tensor]:
        return {"pool": candidate_blocks(inputs["scores"], inputs["n_visible"], flash().pool_block, flash().pool_max_blocks)}

    def compare(self, outputs, expected) -> Comparison:
        from tiles.core.compare import bit_exact

        return bit_exact(outputs, expected)

    def bytes_moved(self, shape: Shape) -> float:
        B, S, N = shape["B"], shape["S"], shape["N"]
        return B * S * (N * 4 + min(shape["P"], -(-N // shape["block"])) * 4)


class ReindexTopkTile(_ScoreAndSelectTile):
    """Reindex: gather the pool's 8-entry blocks, score them, top-k, map back to positions."""

    name = "reindex_topk"
    description = "scores of the candidate pool only (gathered FP4 index K, bf16 wgmma) + radix top-k mapped back to positions"

    def shapes(self) -> list[Shape]:
        return reindex_shapes()

    def search_space(self, arch: Arch) -> SearchSpace:
        space = super().search_space(arch)
        return SearchSpace(space.params + (SELECT_ALGO,), space.constraints)

    def default_config(self, arch: Arch) -> Config:
        # Hopper: the two-pass select, H200, one run (84d7a8c):
        # decode B=64 x 16K candidates 0.239 -> 0.163 ms per call (slot -> position map included), top-k sets exact;
        # then the indexer's byte-permute dequant at two CTAs per SM (H200, one run, cb334b4):
        # score kernel 134.6 -> 78.5 us, 0.163 -> 0.107 ms per call. Elsewhere not measured: multipass, bits.
        if arch.family != "hopper":
            return {**super().default_config(arch), "select_algo": "multipass"}
        # tiles_per_cta="auto" (resolve_tiles_per_cta): 16 at B=64 (the kernel it ran before), 1 at one sequence, whose
        # 16K candidates in 16-tile CTAs left 8 CTAs on the GPU. lab tune on the H200 (2a3aa53): the B=1 winner, one
        # tile per CTA, 16.1 us against the 16-tile default's 47.8.
        return {**super().default_config(arch), "select_algo": "two_pass", "dequant": "prmt", "min_ctas": 2, "tiles_per_cta": "auto"}

    def _kernels(self, shape: Shape, cfg: Config, arch: Arch) -> dict[str, Any]:
        """The kernels one call launches, by name, compiled (or fetched from their caches) for the full ``cfg``."""
        blk = shape["block"]
        kernels = {"score": build_score(arch, cfg, True, blk, shape["B"] * shape["S"], shape["P"] * blk, shape.dims.get("page", 0))}
        if cfg["select_algo"] == "two_pass":
            kernels["select"] = remapped_kernel(arch, shape["K"], shape["B"] * shape["S"], block=blk)
        else:
            kernels["select"] = build_select_kernel(arch.nvcc_arch, shape["K"], cfg["select_threads"], cfg["radix_bits"], blk)
        return kernels

    def build(self, shape: Shape, config: Config, arch: Arch):
        cfg = self.with_defaults(arch, config)
        self._kernels(shape, cfg, arch)
        return (cfg, arch, shape["K"], shape["block"], shape.dims.get("page", 0))

    def kernel_sources(self, shape: Shape, config: Config, arch: Arch) -> dict[str, str]:
        return kernel_sources_of(self._kernels(shape, self.with_defaults(arch, config), arch))

    def make_inputs(self, shape: Shape, seed: int, device="cuda") -> Inputs:
        B, S, N, P, blk = shape["B"], shape["S"], shape["N"], shape["P"], shape["block"]
        inputs = indexer_inputs(B, S, N, seed, device, causal=False)
        gen = torch.Generator(device=device).manual_seed(seed + 7919)
        inputs["pool_blocks"] = random_pool(inputs["n_visible"], N, P, blk, gen)  # [B, S, P]
        if shape.dims.get("page"):
            into_page_pool(inputs, shape["page"], gen)
        return inputs

    def alloc_outputs(self, kernel, inputs: Inputs) -> dict[str, torch.Tensor]:
        _, _, k, blk, _ = kernel
        q, pool = inputs["q"], inputs["pool_blocks"]
        B, S, P = pool.shape
        scores = poisoned((B, S, P * blk), torch.float32, q.device)  # [B, S, P*block]
        out = poisoned((B, S, k), torch.int32, q.device)  # [B, S, K]
        return {"topk": out, "pool_scores": scores}

    def launch(self, kernel, inputs: Inputs, outputs: dict[str, torch.Tensor]) -> None:
        cfg, arch, _, blk, page = kernel
        words, scales = index_k_words(inputs["k_packed"], inputs["k_scales"])
        args = (inputs["q"], inputs["weights"], words, scales, inputs["n_visible"], inputs["pool_blocks"], blk)
        launch_reindex(cfg, arch, *args, outputs["pool_scores"], outputs["topk"], inputs.get("block_table"), page)

    def public_call(self, shape: Shape, inputs: Inputs, config: Config):
        from tiles.indexer.api import reindex_topk

        i = inputs
        args = (i["q"], i["weights"], i["k_packed"], i["k_scales"], i["n_visible"], i["pool_blocks"], shape["block"], shape["K"])
        paged = {"block_table": i.get("block_table"), "page_size": shape.dims.get("page", 0)}
        return lambda: reindex_topk(*args, config=config, **paged)

    def reference(self, inputs: Inputs) -> dict[str, torch.Tensor]:
        scores = reference_scores(inputs)  # [B, S, N]: the reference scores everything
        pool = inputs["pool_blocks"]
        B, S, P = pool.shape
        N = scores.shape[-1]
        blk = flash().pool_block
        if B * S * P * N <= 1 << 31:
            inside = pool_mask(pool, N, blk)
        else:  # the same mask by scatter: pool_mask's [B, S, P, N] intermediate would not fit
            slots = (pool.long().unsqueeze(-1) * blk + torch.arange(blk, device=pool.device)).flatten(-2)  # [B, S, P*blk]
            slots = torch.where((pool.long() >= 0).repeat_interleave(blk, -1) & (slots < N), slots, torch.full_like(slots, N))
            inside = torch.zeros(B, S, N + 1, dtype=torch.bool, device=pool.device).scatter_(-1, slots, True)[..., :N]
        masked = scores.masked_fill(~inside, NEG_INF)
        slots = (pool.long().clamp(min=0).unsqueeze(-1) * blk + torch.arange(blk, device=pool.device)).flatten(-2)  # [B, S, P*blk]
        pool_scores = masked.gather(-1, slots.clamp(max=N - 1))
        pool_scores = torch.where(
            (pool.long() >= 0).repeat_interleave(blk, -1) & (slots < N), pool_scores, torch.full_like(pool_scores, NEG_INF)
        )
        return {"topk": topk_positions(masked, flash().index_topk), "scores": masked, "pool_scores": pool_scores}

    def compare(self, outputs, expected) -> Comparison:
        sc = relative_l2({"pool_scores": outputs["pool_scores"]}, {"pool_scores": expected["pool_scores"]}, SCORE_RTOL)
        return merge(sc, compare_topk_sets(outputs["topk"], expected["topk"], expected["scores"]))

    def flops(self, shape: Shape) -> float:
        return 2.0 * shape["B"] * shape["S"] * shape["P"] * shape["block"] * HEADS * HEAD_DIM

    def bytes_moved(self, shape: Shape) -> float:
        B, S, C, K = shape["B"], shape["S"], shape["P"] * shape["block"], shape["K"]
        return B * S * (C * (HEAD_DIM // 2 + HEAD_DIM // GROUP) + shape["P"] * 4 + HEADS * HEAD_DIM * 2 + K * 4)


INDEXER_TOPK = IndexerTopkTile()
CANDIDATE_POOL = CandidatePoolTile()
REINDEX_TOPK = ReindexTopkTile()
TILES = [INDEXER_TOPK, CANDIDATE_POOL, REINDEX_TOPK]
