"""GPU check and timing of the indexer and compressor tiles, one call on the H200.

    python gpu/indexer_check.py --out $OUT --part compile     # every kernel, in a spawn pool
    python gpu/indexer_check.py --out $OUT --part topk|pool|reindex|compressor

Each part runs in its own process (a hang or a fault in one cannot take the others down).
Checks: fresh random inputs, outputs poisoned, the tile's comparison rule against the torch
reference, two runs bitwise equal; real shapes, odd shapes (N not a multiple of the block,
n_visible < top-k, empty rows), heavy ties, the public wrappers and the decode tail state.
Timings: kernel-only CUDA events on rotating input sets (tiles.timing), the torch path in the
same run, GB/s from the tile's byte count and the fraction of the measured copy bandwidth.
Rows go to ``<part>.jsonl`` under --out as they are produced; each part prints a table.
"""

import argparse
import json
import os
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

IDX = {"B": 0, "S": 0, "N": 0, "Hi": 32, "Di": 128, "K": 512}
ALT_TOPK = {
    "regs": {"dequant": "registers"},
    "lut": {"dequant": "lut"},
    "radix11": {"radix_bits": 11},
    "deep": {"tiles_per_cta": 16, "stages": 3},
}
ALT_COMP = {"simt": {"proj": "simt"}}


def _shape(tile, spec):
    from tiles.contract import Shape

    if isinstance(spec, str):
        return tile.shape(spec)
    name, phase, dims = spec
    return Shape(name, phase, dims)


def _odd_idx(B, S, N):
    return (f"odd_b{B}_s{S}_n{N}", "decode", {**IDX, "B": B, "S": S, "N": N})


def _odd_pool(B, S, N):
    return (f"odd_b{B}_s{S}_n{N}", "decode", {**IDX, "B": B, "S": S, "N": N, "P": 2048, "block": 8})


def _odd_comp(B, S, ratio):
    return (f"odd_r{ratio}_b{B}_s{S}", "prefill", {"B": B, "S": S, "ratio": ratio, "dim": 5120, "D": 512, "Di": 128})


PLAN = {
    "topk": (
        "indexer_topk",
        [("decode_b64_n32k", {}), ("decode_b1_n128k", {}), ("prefill_s4k", {}), (_odd_idx(3, 2, 1000), {}), (_odd_idx(2, 1, 77), {})]
        + [("decode_b64_n32k", c) for c in ALT_TOPK.values()],
        [("decode_b64_n128k", ["default", *ALT_TOPK]), ("decode_b1_n128k", ["default"]), ("prefill_s4k", ["default"])],
    ),
    "pool": (
        "candidate_pool",
        [("decode_b64_n32k", {}), ("decode_b1_n128k", {}), (_odd_pool(2, 3, 1001), {}), (_odd_pool(1, 1, 5), {})]
        + [("decode_b64_n32k", {"radix_bits": 11})],
        [("decode_b64_n128k", ["default"])],
    ),
    "reindex": (
        "reindex_topk",
        [("decode_b64_n32k", {}), ("decode_b1_n128k", {}), (_odd_pool(3, 2, 4001), {})]
        + [("decode_b64_n32k", ALT_TOPK[k]) for k in ("regs", "lut")],
        [("decode_b64_n128k", ["default", "regs", "lut"]), ("decode_b1_n128k", ["default"])],
    ),
    "compressor": (
        "compressor",
        [("prefill_r2_s4k", {}), ("prefill_r1_s4k", {}), ("decode_r2_b64", {}), ("decode_r1_b64", {}), (_odd_comp(2, 1002, 2), {})]
        + [(_odd_comp(3, 333, 1), {})]
        + [("prefill_r2_s4k", ALT_COMP["simt"]), ("prefill_r1_s4k", ALT_COMP["simt"])],
        [("prefill_r2_s64k", ["default", "simt"]), ("prefill_r1_s64k", ["default", "simt"]), ("decode_r2_b64", ["default"])],
    ),
}
ALTS = {**ALT_TOPK, **ALT_COMP}


def _compile_one(job):
    tile_name, spec, config = job
    from tiles.arch import get_arch
    from tiles.registry import get_tile

    tile = get_tile(tile_name)
    t0 = time.perf_counter()
    try:
        tile.build(_shape(tile, spec), tile.with_defaults(get_arch("sm90"), config), get_arch("sm90"))
        return f"{tile_name} {config} compiled in {time.perf_counter() - t0:.1f}s"
    except Exception as exc:  # noqa: BLE001 - every failure is a reported outcome
        return f"{tile_name} {config} COMPILE ERROR {type(exc).__name__}: {str(exc)[-400:]}"


def _kernel_key(tile_name: str, spec) -> tuple:
    """The shape dims a tile's kernels are specialised on (everything else is dynamic)."""
    from tiles.registry import get_tile

    shape = _shape(get_tile(tile_name), spec)
    if tile_name == "candidate_pool":
        return (min(shape["P"], -(-shape["N"] // shape["block"])),)
    if tile_name == "compressor":
        return (shape["ratio"],)
    return (shape["K"],)


def part_compile(out: Path) -> None:
    jobs, seen = [], set()
    for tile_name, checks, timings in PLAN.values():
        specs = [(s, c) for s, c in checks] + [(s, ALTS.get(label, {})) for s, labels in timings for label in labels]
        for spec, config in specs:
            key = (tile_name, json.dumps(config, sort_keys=True), _kernel_key(tile_name, spec))
            if key not in seen:
                seen.add(key)
                jobs.append((tile_name, spec, config))
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=min(14, len(jobs)), mp_context=get_context("spawn")) as pool:
        for line in pool.map(_compile_one, jobs):
            print(line, flush=True)
    print(f"compiled {len(jobs)} jobs in {time.perf_counter() - t0:.1f}s", flush=True)


def _emit(out: Path, part: str, row: dict) -> None:
    with open(out / f"{part}.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    short = {k: (v[:160] if isinstance(v, str) else v) for k, v in row.items() if k not in ("env", "p10_ms", "p90_ms")}
    print(json.dumps(short), flush=True)


def _check(tile, shape, config, arch, seed=0):
    import torch

    from tiles.harness import NONDETERMINISTIC, OK, RUNTIME_FAULT, WRONG_RESULT

    kernel = tile.build(shape, config, arch)
    inputs = tile.make_inputs(shape, seed, "cuda")
    try:
        o1 = tile.run(kernel, inputs)
        o2 = tile.run(kernel, inputs)
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - every failure is a reported outcome
        return RUNTIME_FAULT, f"{type(exc).__name__}: {str(exc)[-300:]}", kernel, inputs
    cmp = tile.compare(o1, tile.reference(inputs))
    if not cmp.ok:
        return WRONG_RESULT, str(cmp), kernel, inputs
    for key in o1:
        if not torch.equal(o1[key].contiguous().view(torch.uint8), o2[key].contiguous().view(torch.uint8)):
            return NONDETERMINISTIC, f"two runs differ in {key}", kernel, inputs
    return OK, str(cmp), kernel, inputs


def _extra_checks(part: str, out: Path, arch) -> None:
    """Ties, the public wrappers and the decode tail state."""
    import torch

    from model import formats
    from model.ops.indexer import candidate_blocks, topk_positions
    from tiles import compressor as cp
    from tiles import indexer as ix
    from tiles.indexer import reference as ix_reference

    def emit(name, ok, detail):
        _emit(out, part, {"check": name, "outcome": "ok" if ok else "wrong_result", "detail": detail})

    if part == "topk":
        # Heavy ties: 64 distinct keys repeated over the cache, so every score value repeats ~500 times.
        inputs = ix_reference._indexer_inputs(4, 2, 32768, 5, "cuda", causal=False)
        inputs["k_packed"] = inputs["k_packed"][:, :64].repeat(1, 512, 1).contiguous()
        inputs["k_scales"] = inputs["k_scales"][:, :64].repeat(1, 512, 1).contiguous()
        out_k, sc = ix.indexer_topk(inputs["q"], inputs["weights"], inputs["k_packed"], inputs["k_scales"], inputs["n_visible"], 512, True)
        ref_sc = ix_reference._reference_scores(inputs)
        ref = topk_positions(ref_sc, 512)
        exact = torch.equal(out_k, ref)
        cmp = ix.compare_topk_sets(out_k, ref, ref_sc)
        emit("topk_ties_wrapper", cmp.ok, f"exactly equal to the reference: {exact}; {cmp}")
        # Same scores into both selections: the kernel's select alone must equal topk_positions exactly.
        own = topk_positions(sc, 512)
        emit("topk_select_on_kernel_scores", torch.equal(out_k, own), "select kernel vs topk_positions on the kernel's own scores")
        # fp32 queries go through the same path.
        out32 = ix.indexer_topk(inputs["q"].float(), inputs["weights"], inputs["k_packed"], inputs["k_scales"], inputs["n_visible"], 512)
        emit("topk_fp32_queries", torch.equal(out32, out_k), "fp32 q equals bf16 q")
    if part == "pool":
        inputs = ix_reference._indexer_inputs(4, 1, 20000, 9, "cuda", causal=False)
        _, sc = ix.indexer_topk(inputs["q"], inputs["weights"], inputs["k_packed"], inputs["k_scales"], inputs["n_visible"], 512, True)
        pool = ix.candidate_pool(sc, inputs["n_visible"])
        ref = candidate_blocks(sc, inputs["n_visible"], 8, 2048)
        emit("pool_wrapper_on_kernel_scores", torch.equal(pool, ref), f"shape {tuple(pool.shape)}")
    if part == "reindex":
        inputs = ix_reference._indexer_inputs(2, 2, 50000, 11, "cuda", causal=False)
        _, sc = ix.indexer_topk(inputs["q"], inputs["weights"], inputs["k_packed"], inputs["k_scales"], inputs["n_visible"], 512, True)
        pool = ix.candidate_pool(sc, inputs["n_visible"])
        inputs["pool_blocks"] = pool
        got = ix.reindex_topk(inputs["q"], inputs["weights"], inputs["k_packed"], inputs["k_scales"], inputs["n_visible"], pool, 8, 512)
        ref = ix.REINDEX_TOPK.reference(inputs)
        cmp = ix.compare_topk_sets(got, ref["topk"], ref["scores"])
        emit("reindex_wrapper_real_pool", cmp.ok, str(cmp))
    if part == "compressor":
        tile = cp.COMPRESSOR
        shape = tile.shape("decode_r2_b64")
        inputs = tile.make_inputs(shape, 3, "cuda")  # S = 2: one group
        ref = tile.reference(inputs)
        eps = 1e-6
        args = (inputs["norm_weight"], inputs["cos"], inputs["sin"], inputs["wk"], inputs["k_norm_weight"], eps)
        full = cp.compress(inputs["kv"], inputs["gate"], 2, *args)
        tail = cp.compress(inputs["kv"][:, 1:], inputs["gate"][:, 1:], 2, *args, tail_kv=inputs["kv"][:, 0], tail_gate=inputs["gate"][:, 0])
        same = all(torch.equal(a, b) for a, b in zip(full, tail))
        names = ("main_packed", "main_scales", "idx_packed", "idx_scales")
        cmp = cp.compare_fp4_caches(dict(zip(names, full)), ref)
        emit("compress_wrapper_and_tail", same and cmp.ok, f"tail path equals full path: {same}; {cmp}")
        # Exhaustive check of the in-kernel encoders: every E4M3 byte / E8M0 byte is decoded by formats.
        p, s = full[0], full[1]
        deq = formats.fp4_dequantize(p, s, 16, "e4m3")
        emit("compress_decodes", bool(torch.isfinite(deq).all()), "all main-cache values decode finite")


def part_run(part: str, out: Path) -> None:
    import torch

    from tiles.arch import get_arch
    from tiles.registry import get_tile
    from tiles.timing import device_copy_bandwidth, input_sets_for_l2, time_cuda

    arch = get_arch("sm90")
    tile_name, checks, timings = PLAN[part]
    tile = get_tile(tile_name)
    base = tile.default_config(arch)
    passed: set[tuple[str, str]] = set()
    for spec, config in checks:
        shape = _shape(tile, spec)
        label = next((k for k, v in ALTS.items() if v == config), "default")
        t0 = time.perf_counter()
        try:
            outcome, detail, _, _ = _check(tile, shape, {**base, **config}, arch)
        except Exception as exc:  # noqa: BLE001 - every failure is a reported outcome
            outcome, detail = "error", f"{type(exc).__name__}: {str(exc)[-300:]}"
            traceback.print_exc()
        if outcome == "ok":
            passed.add((shape.name, label))
        _emit(
            out,
            part,
            {"check": f"{tile_name}/{shape.name}/{label}", "outcome": outcome, "detail": detail, "s": round(time.perf_counter() - t0, 1)},
        )
        torch.cuda.empty_cache()
    try:
        _extra_checks(part, out, arch)
    except Exception as exc:  # noqa: BLE001 - every failure is a reported outcome
        traceback.print_exc()
        _emit(out, part, {"check": f"{part}/extra", "outcome": "error", "detail": f"{type(exc).__name__}: {str(exc)[-300:]}"})
    copy_bw = device_copy_bandwidth(1 << 30)
    _emit(out, part, {"copy_GBps": round(copy_bw / 1e9, 1)})
    rows = []
    for shape_name, labels in timings:
        shape = tile.shape(shape_name)
        n_bytes, flops = tile.bytes_moved(shape), tile.flops(shape)
        n_sets = input_sets_for_l2(n_bytes, arch.l2_bytes, max_sets=3)
        sets = [tile.make_inputs(shape, 100 + i, "cuda") for i in range(n_sets)]
        # Correctness first on this shape (no speed for a kernel that fails its check).
        ref_ms = None
        try:
            ref_ms = time_cuda(lambda i, sets=sets: tile.reference(sets[i]), n_sets=n_sets, warmup=1, runs=5, min_time_ms=0).median_ms
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
        fast_ms = _torch_fast_path(part, sets, n_sets)
        for label in labels:
            config = {**base, **ALTS.get(label, {})}
            outcome, detail, kernel, _ = _check(tile, shape, config, arch, seed=100)
            row = {"tile": tile_name, "shape": shape.name, "config": label, "outcome": outcome}
            if outcome == "ok":
                calls = [_kernel_only(part, kernel, s) for s in sets]
                t = time_cuda(lambda i, calls=calls: calls[i](), n_sets=n_sets, runs=30)
                gbps = n_bytes / (t.median_ms * 1e-3) / 1e9
                row.update(
                    ms=round(t.median_ms, 4),
                    p10_ms=round(t.p10_ms, 4),
                    p90_ms=round(t.p90_ms, 4),
                    GBps=round(gbps, 1),
                    frac_copy_bw=round(gbps * 1e9 / copy_bw, 3),
                    TFLOPs=round(flops / (t.median_ms * 1e-3) / 1e12, 2) if flops else None,
                    ref_ms=round(ref_ms, 3) if ref_ms else None,
                    speedup_vs_ref=round(ref_ms / t.median_ms, 1) if ref_ms else None,
                    torch_fast_ms=round(fast_ms, 3) if fast_ms else None,
                    speedup_vs_torch_fast=round(fast_ms / t.median_ms, 1) if fast_ms else None,
                )
            else:
                row["detail"] = detail
            rows.append(row)
            _emit(out, part, row)
        sets = []  # free the inputs before the next shape
        torch.cuda.empty_cache()
    print(
        f"\n{'tile':<15} {'shape':<18} {'config':<8} {'ms':>8} {'GB/s':>8} {'of copy':>8} {'TFLOP/s':>8} {'ref ms':>9} {'x ref':>7} {'x fast':>7}"
    )
    for r in rows:
        if r["outcome"] != "ok":
            print(f"{r['tile']:<15} {r['shape']:<18} {r['config']:<8} {r['outcome']}")
            continue
        print(
            f"{r['tile']:<15} {r['shape']:<18} {r['config']:<8} {r['ms']:>8.4f} {r['GBps']:>8.1f} {r['frac_copy_bw']:>8.3f} "
            f"{r['TFLOPs'] or 0:>8.1f} {r['ref_ms'] or float('nan'):>9.3f} {r['speedup_vs_ref'] or float('nan'):>7.1f} "
            f"{r['speedup_vs_torch_fast'] or float('nan'):>7.1f}"
        )


def _kernel_only(part: str, kernel, inputs):
    """A call of the kernels alone: outputs allocated once, outside the timed region (no poison fill)."""
    import torch

    from tiles import compressor as cp
    from tiles.indexer import launch as ix_launch

    if part == "compressor":
        kv, ratio = inputs["kv"], int(inputs["ratio"])
        B, S, _ = kv.shape
        G = S // ratio
        outs = [torch.empty(B, G, n, dtype=torch.uint8, device=kv.device) for n in (256, 32, 64, 4)]
        wk_hi, wk_lo = cp.split_tf32(inputs["wk"])
        eps = torch.tensor([1e-6], device=kv.device)
        gate = kv if ratio == 1 else inputs["gate"]
        args = (kv, gate, inputs["norm_weight"], inputs["cos"], inputs["sin"], wk_hi, wk_lo, inputs["k_norm_weight"], eps, *outs)
        return lambda: kernel(*args)
    if part == "pool":
        cfg, arch, block, max_blocks = kernel
        scores = inputs["scores"]
        B, S, N = scores.shape
        nb = -(-N // block)
        bs = torch.empty(B * S, nb, device=scores.device)
        out = torch.empty(B, S, min(max_blocks, nb), dtype=torch.int32, device=scores.device)
        return lambda: ix_launch._launch_pool(cfg, arch, scores.view(B * S, N), inputs["n_visible"].view(B * S), block, bs, out)
    words, scales = ix_launch._index_k_words(inputs["k_packed"], inputs["k_scales"])
    q, w, nv = inputs["q"], inputs["weights"], inputs["n_visible"]
    B, S = q.shape[:2]
    if part == "topk":
        cfg, arch, k = kernel
        sc = torch.empty(B, S, words.shape[1], device=q.device)
        out = torch.empty(B, S, k, dtype=torch.int32, device=q.device)
        return lambda: ix_launch._launch_topk(cfg, arch, q, w, words, scales, nv, sc, out)
    cfg, arch, k, blk = kernel
    pool = inputs["pool_blocks"]
    sc = torch.empty(B, S, pool.shape[-1] * blk, device=q.device)
    out = torch.empty(B, S, k, dtype=torch.int32, device=q.device)
    return lambda: ix_launch._launch_reindex(cfg, arch, q, w, words, scales, nv, pool, blk, sc, out)


def _torch_fast_path(part: str, sets, n_sets: int):
    """The lean torch path: einsum over pre-dequantised K (dequant not timed) + torch.topk."""
    import torch

    from model import formats
    from tiles.timing import time_cuda

    if part not in ("topk", "reindex"):
        return None
    try:
        ks = [formats.fp4_dequantize(s["k_packed"], s["k_scales"], 32, "e8m0") for s in sets]  # [B, N, Di] each

        def fast(i):
            s = sets[i]
            logits = torch.einsum("bshd,bnd->bshn", s["q"].float(), ks[i])
            scores = torch.einsum("bshn,bsh->bsn", torch.relu(logits), s["weights"])
            return torch.topk(scores, 512, dim=-1)

        return time_cuda(fast, n_sets=n_sets, warmup=2, runs=10, min_time_ms=0).median_ms
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")))
    ap.add_argument("--part", required=True, help="compile, or a comma-separated list of " + ", ".join(PLAN))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.part == "compile":
        part_compile(args.out)
        return
    from tiles.timing import describe_environment

    for part in args.part.split(","):
        if part not in PLAN:
            raise SystemExit(f"unknown part {part!r}: use compile or one of {', '.join(PLAN)}")
        _emit(args.out, part, {"env": describe_environment(), "command": " ".join(sys.argv)})
        part_run(part, args.out)


if __name__ == "__main__":
    main()
