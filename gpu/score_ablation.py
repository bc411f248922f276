"""How much of the indexer's score kernel the FP4 dequant costs: the default kernel against itself with the dequant
taken out (a timing ablation; its scores are wrong by design), and the dequant options timed beside them.

``no_dequant`` builds the score kernel of the indexer's default config (``dequant="prmt_rs"``, fused epilogue) with
``csa2_fp4_pair_bf16`` replaced by one integer add: each wgmma A register is the packed word plus the register index,
so the loads, the shared-memory words, the wgmma, the epilogue and the stores are the default's and only the
lookups, sign merges and interleaves are gone (the scale tables go too, unused). The time the kernel loses is what any
cheaper conversion (FP8 operands, integer MMA) could at most win back. ``no_store`` keeps the scores' computation and
drops their stores (see ``_NO_STORE_GUARD``): what a kernel that selects in place of writing the scores could at most
save; ``no_dequant_no_store`` drops both, the bound of such a kernel with a free conversion. Every variant is checked against the reference
(scores rel L2 <= 1e-5; the ablation fails it by design) and timed by CUDA-graph replay in the same process: the
``fp8_rs`` rows are that option at several layouts (``tiles.indexer``, dequant="fp8_rs").

    source .devbundle/prelude.sh && python3 gpu/score_ablation.py --out $OUT [--shapes decode_b64_n128k,prefill_s4k]
        [--variants default,no_dequant,...]

Writes ``score_ablation.json`` (rows, environment, command) under --out. Without a CUDA GPU it exits with status 2.
"""

import argparse
import functools
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name -> (the dequant taken out, the score stores taken out, config over the tile's default): the ablations, and the
# dequant options timed beside them
VARIANTS = {
    "default": (False, False, {}),
    "no_dequant": (True, False, {}),
    "no_store": (False, True, {}),
    "no_dequant_no_store": (True, True, {}),
    "hidden_skip": (False, False, {"hidden_tiles": "skip"}),  # the Hopper default since 78c058d: "default" is this kernel there
    "hidden_score": (False, False, {"hidden_tiles": "score"}),  # the indexer's Hopper default before 78c058d
    "fp8_rs_bn128_mc2_st1": (False, False, {"dequant": "fp8_rs", "block_n": 128, "min_ctas": 2, "stages": 1}),
    "fp8_rs_bn128_mc2_st2": (False, False, {"dequant": "fp8_rs", "block_n": 128, "min_ctas": 2, "stages": 2}),
    "fp8_rs_bn64_mc2_st2": (False, False, {"dequant": "fp8_rs", "block_n": 64, "min_ctas": 2, "stages": 2}),
    "fp8_rs_bn64_mc3_st3": (False, False, {"dequant": "fp8_rs", "block_n": 64, "min_ctas": 3, "stages": 3}),
}
# no_store: the fused epilogue's two score stores made conditional on a value no score takes, so the head sums are still
# computed (the compiler cannot drop them) but nothing is written: what a score kernel that hands its scores to an
# in-kernel select instead of HBM could at most save (33.5 MB of the 604 MB a decode B=64 x 128K call moves)
_STORE_GUARDS = ("if (off + row < n_left) out[off + row] =", "if (!c && off + row < n_left) out[off + row] =")
_NO_STORE_GUARD = "&& z == 0x1.5p-120f"  # a value the head sum of a ReLU'd, weighted wgmma never lands on here
_NO_DEQUANT_PAIR = (
    "__device__ __forceinline__ void csa2_fp4_pair_bf16(void* dst, int w_, unsigned lo0, unsigned lo1, unsigned hi0,\n"
    "                                                   unsigned hi1, int k) {\n"
    "  *(unsigned*)dst = (unsigned)w_ + (unsigned)k;  // timing ablation: no conversion, wrong values\n"
    "}\n"
)


def _use_kernel(ablate_dequant: bool, ablate_store: bool, original_pair: str, original_epi: str) -> None:
    """Point the score kernel builder at the default pair function and epilogue or the ablations' (a fresh build: the
    builder cache is cleared). The builder reads ``_PRMT_PAIR_CUDA`` and ``_FUSED_EPI_CUDA`` from its own module's
    globals (``tiles.indexer.score_kernel``), so those are the names replaced."""
    from tiles.indexer import dequant, score_kernel

    pair = dequant._fp4_pair_function("csa2_fp4_pair_bf16", dequant._SHR16_SELECTORS)
    assert pair in original_pair, "the default pair function moved: update the ablation"
    score_kernel._PRMT_PAIR_CUDA = original_pair.replace(pair, _NO_DEQUANT_PAIR) if ablate_dequant else original_pair
    epi = original_epi
    if ablate_store:
        for guard in _STORE_GUARDS:
            assert epi.count(guard) == 1, f"the fused epilogue's store {guard!r} moved: update the ablation"
            epi = epi.replace(guard, guard.replace(") out[", f" {_NO_STORE_GUARD}) out["))
    score_kernel._FUSED_EPI_CUDA = epi
    score_kernel._score_kernel.cache_clear()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--shapes", default="decode_b64_n128k,prefill_s4k", help="indexer_topk shapes, comma-separated")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}: known are {list(VARIANTS)}")

    import torch

    if not torch.cuda.is_available():
        print("score_ablation: no CUDA GPU here; run it on a GPU machine (see the module docstring)", file=sys.stderr)
        return 2

    from tiles import indexer as ix
    from tiles.arch import detect
    from tiles.compare import relative_l2
    from tiles.indexer import dequant as ix_dequant
    from tiles.indexer import launch as ix_launch
    from tiles.indexer import reference as ix_reference
    from tiles.timing import describe_environment, time_cuda_graph

    arch = detect()
    tile = ix.INDEXER_TOPK
    env = describe_environment()
    cmd = "python3 gpu/score_ablation.py " + " ".join(sys.argv[1:])
    from tiles.indexer import score_kernel as ix_score_kernel

    original_pair, original_epi = ix_dequant._PRMT_PAIR_CUDA, ix_score_kernel._FUSED_EPI_CUDA
    rows = []
    for name in args.shapes.split(","):
        shape = tile.shape(name)
        inputs = tile.make_inputs(shape, seed=17, device="cuda")
        words, scales = ix_launch._index_k_words(inputs["k_packed"], inputs["k_scales"])
        q, w, nvis = inputs["q"].to(torch.bfloat16).contiguous(), inputs["weights"].float().contiguous(), inputs["n_visible"]
        B, S = q.shape[:2]
        N = inputs["k_packed"].shape[1]
        pool = torch.empty(B, S, 1, dtype=torch.int32, device="cuda")  # [B, S, 1]: the contiguous kernel reads none
        scores = torch.full((B, S, N), float("nan"), device="cuda")  # [B, S, N] poisoned
        want = ix_reference._reference_scores(inputs)
        for variant in variants:
            ablate_dequant, ablate_store, overrides = VARIANTS[variant]
            _use_kernel(ablate_dequant, ablate_store, original_pair, original_epi)
            cfg = tile.with_defaults(arch, overrides)
            launch = functools.partial(ix_launch._build_score(arch, cfg, False, 8, B * S, N), q, w, words, scales, nvis, pool, scores)
            scores.fill_(float("nan"))
            launch()
            torch.cuda.synchronize()
            check = relative_l2({"scores": scores}, {"scores": want}, ix.SCORE_RTOL)
            timing = time_cuda_graph(lambda i, launch=launch: launch())
            row = {
                "shape": name,
                "variant": variant,
                "config": cfg,
                "score_us": timing.median_ms * 1e3 if timing else None,
                "check": "ok" if check.ok else str(check),  # no_dequant and no_store are wrong by design
            }
            rows.append(row)
            us = f"{row['score_us']:8.1f}" if row["score_us"] is not None else f"{'-':>8s}"  # None: the graph did not capture
            print(f"{name:18s} {variant:22s} {us} us  check: {row['check']}", flush=True)
        _use_kernel(False, False, original_pair, original_epi)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "score_ablation.json").write_text(json.dumps({"environment": env, "command": cmd, "rows": rows}, indent=1, default=str))
    print(f"{env}\ncommand: {cmd}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
