"""GPU check and timing of the sparse attention tiles, one call on the H200.

Compiles every kernel the run needs in a spawn process pool first (TileLang's disk cache then
serves the main process), checks each config against the fp32 torch reference on fresh random
inputs (outputs NaN-poisoned, run twice and required bitwise equal), runs the edge cases
(all -1 rows give exact zeros, repeated indices, W < 128, odd S, H = 128), then times the
target shapes: the torch reference, the default config and the alternative schedules in the
same run, kernel-only (CUDA events, rotating input sets, output buffers allocated once).

    python gpu/sparse_attn_check.py --out $OUT [--labels default,pipelined,...] [--no-compile]

Prints a compact table and rewrites ``sparse_attn_run_<labels>.json`` (rows + environment) under --out
after every row. About 70 s of compiling on 16 cores, then ~1 minute of checks and timings.
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

PIPE = {"schedule": "pipelined"}
LABELS = {
    "default": {},  # ws + batched producer on Hopper
    "serial": {"produce": "serial"},  # ws with the row-serial producer (the previous default)
    "pipelined": PIPE,
    "pipe_bi32_st1": {**PIPE, "block_I": 32, "num_stages": 1},  # the prefill 4K winner of the first tuning run
    "pipe_hb32_split2": {**PIPE, "heads_per_block": 32, "threads": 128, "n_split": 2},  # decode B=64 winner
    "split1": {"n_split": 1},
    "split2": {"n_split": 2},
    "split4": {"n_split": 4},
    "regs10": {"ptxas_level": 10},  # the register-usage level of TileLang's sparse_mla_fwd_pipelined example
    "io_staged": {"io": "staged"},  # Q per consumer warpgroup in 16-byte vectors, O staged through the freed Q tile
    "prefetch": {"produce": "prefetch"},  # the next FP4 block's loads issued before its buffer frees
    "balanced": {"consumers": "balanced"},  # both consumer warpgroups compute half of S and the softmax
    "overlap": {"consumers": "balanced_overlap"},  # ... and P V completes under the next block's QK^T
    "overlap_prefetch": {"consumers": "balanced_overlap", "produce": "prefetch"},
    "wg1": {"wg1_rows": 16},  # consumer warpgroup 1 dequantises the last 16 rows of each main block
    "tpc2": {"tokens_per_cta": 2},  # each CTA runs two (token, head block) items, the producer running ahead
    "tpc4": {"tokens_per_cta": 4},
    # the last split CTA of each token merges the partials (arrival counter): no combine launch
    "fused": {"combine": "fused"},
    "fused_split2": {"combine": "fused", "n_split": 2},  # where auto resolves to one split (B=128/S=2)
    "early": {"handoff": "before_pv"},  # warpgroup 0 hands P to warpgroup 1 before its own half of P V
    "lanes_col": {"lanes": "column"},  # producer lanes of a quarter-warp on 8 rows: no bank conflicts on the KV stores
    "lanes_col_early": {"lanes": "column", "handoff": "before_pv"},
    "bi32": {"block_I": 32},  # 32-row KV blocks: twice the blocks per token (the block-size effect alone)
    # the producer's FP4 words decoded by byte-permute table lookups (Hopper's default since session 8: the label names
    # it for runs of older code), alone and with the conflict-free lanes and early hand-off; fp4_fma: the decode before it
    "fp4_prmt": {"fp4_decode": "prmt"},
    "fp4_prmt_col_early": {"fp4_decode": "prmt", "lanes": "column", "handoff": "before_pv"},
    "fp4_fma": {"fp4_decode": "fma"},
    # the consumer warpgroups take whole blocks in turn, P, the rescale and the running max handed over (FlashMLA's
    # seesaw): one warpgroup's QK^T under the other's softmax, both doing the same work
    "seesaw": {"consumers": "seesaw"},
    "seesaw_col": {"consumers": "seesaw", "lanes": "column"},
    "seesaw_split4": {"consumers": "seesaw", "n_split": 4},
    # the two blocks of a pair at once, the running max handed 0 -> 1 -> 0, each warpgroup's own P V from registers
    # (FlashMLA's sparse prefill schedule); _auto: on the prefill's default staging (the expansion: bf16 rows)
    "paired": {"consumers": "paired"},
    "paired_split4": {"consumers": "paired", "n_split": 4},
    "paired_auto": {"consumers": "paired", "kv_staging": "auto"},
    "seesaw_auto": {"consumers": "seesaw", "kv_staging": "auto"},
    # paired with each KV buffer handed over in halves (FlashMLA's order; bf16 rows: the bf16 tile, or _auto)
    "halves": {"consumers": "paired_halves"},
    "halves_split4": {"consumers": "paired_halves", "n_split": 4},
    "halves_auto": {"consumers": "paired_halves", "kv_staging": "auto"},
    # ... with the next token's Q loaded under the last pair and O stored through the P tiles (io=overlapped)
    "halves_ovl2": {"consumers": "paired_halves", "io": "overlapped", "n_split": 1, "tokens_per_cta": 2},
    "halves_ovl4": {"consumers": "paired_halves", "io": "overlapped", "n_split": 1, "tokens_per_cta": 4},
    "halves_ovl8": {"consumers": "paired_halves", "io": "overlapped", "n_split": 1, "tokens_per_cta": 8},
    "halves_ovl8_auto": {"consumers": "paired_halves", "io": "overlapped", "tokens_per_cta": 8, "kv_staging": "auto"},
    # the split partials of O stored and combined as bf16 (half the bytes of the fp32 partials)
    "parts_bf16": {"partials": "bf16"},
    "parts_bf16_split4": {"partials": "bf16", "n_split": 4},
    # prefill: the caches decoded per read by the producer, or expanded to bf16 once (Hopper's prefill default since
    # session 18, "auto")
    "gather": {"kv_staging": "gather"},
    "expand": {"kv_staging": "expand"},
    "tpc4_auto": {"tokens_per_cta": 4, "kv_staging": "auto"},  # tpc4 on the prefill's default staging (prefill tile only)
    # the next token's Q by cp.async under the last QK^T, O staged through the last KV buffer and stored by the producer
    # (bf16 rows: the bf16 tile, or the prefill tile on its default staging, the expansion: the _auto labels)
    "ovl2": {"io": "overlapped", "n_split": 1, "tokens_per_cta": 2},
    "ovl4": {"io": "overlapped", "n_split": 1, "tokens_per_cta": 4},
    "ovl8": {"io": "overlapped", "n_split": 1, "tokens_per_cta": 8},
    "ovl2_auto": {"io": "overlapped", "tokens_per_cta": 2, "kv_staging": "auto"},
    "ovl4_auto": {"io": "overlapped", "tokens_per_cta": 4, "kv_staging": "auto"},
    "ovl8_auto": {"io": "overlapped", "tokens_per_cta": 8, "kv_staging": "auto"},
}


def _override(tile_name: str, label: str) -> dict:
    """LABELS[label] for ``tile_name``. The producer options are the gathering producer's: at prefill, whose default
    expands the caches instead, every label but "default" runs on kv_staging=gather unless it names kv_staging. They
    are also options of the one-token kernel with staged Q/O: every label but "default" runs on io=staged unless it
    names io (the prefill and bf16 tiles' default, io="auto", overlaps several tokens per CTA at 4K)."""
    override = dict(LABELS[label])
    if label != "default" and "io" not in override and tile_name != "sparse_attn_decode" and override.get("schedule") != "pipelined":
        override["io"] = "staged"
    if tile_name == "sparse_attn_prefill" and label != "default" and "kv_staging" not in override:
        override["kv_staging"] = "gather"
    return override


H128 = ("odd_h128_b3_s2", "decode", {"B": 3, "S": 2, "Nc": 5000, "Nw": 130, "H": 128, "W": 128, "K": 512})
W37 = ("odd_w37_b5_s1", "decode", {"B": 5, "S": 1, "Nc": 700, "Nw": 38, "H": 64, "W": 37, "K": 512})
S777 = ("odd_s777", "prefill", {"B": 1, "S": 777, "Nc": 777, "Nw": 777, "H": 64, "W": 128, "K": 512})
# 9 blocks per token (1 window + 8 main): the buffer of a token's last block alternates; 5 tokens per sequence
W37S5 = ("odd_w37_b2_s5", "decode", {"B": 2, "S": 5, "Nc": 700, "Nw": 40, "H": 64, "W": 37, "K": 512})


def _option_rows(label: str, bf16: tuple[str, ...] = ()) -> list[tuple]:
    """The rows an FP4 option is checked at: the three registry shapes and the odd ones (H=128, W=37, S=777), plus
    the bf16 tile at the registry shapes in ``bf16`` where the option applies to bf16 KV too."""
    return [
        ("sparse_attn_prefill", "prefill_s4k", label),
        ("sparse_attn_decode", "decode_b128_s2", label),
        ("sparse_attn_decode", "decode_b64_s1", label),
        ("sparse_attn_decode", H128, label),
        ("sparse_attn_decode", W37, label),
        ("sparse_attn_prefill", S777, label),
    ] + [("sparse_attn_bf16", shape, label) for shape in bf16]


# (tile, shape name or custom (name, phase, dims), label). Every passing row at a registry shape is also timed.
CHECKS = [
    ("sparse_attn_prefill", "prefill_s4k", "default"),
    ("sparse_attn_prefill", "prefill_s4k", "serial"),
    ("sparse_attn_prefill", "prefill_s4k", "pipe_bi32_st1"),
    ("sparse_attn_decode", "decode_b128_s2", "default"),
    ("sparse_attn_decode", "decode_b128_s2", "serial"),
    ("sparse_attn_decode", "decode_b128_s2", "split1"),
    ("sparse_attn_decode", "decode_b128_s2", "pipelined"),
    ("sparse_attn_decode", "decode_b64_s1", "default"),
    ("sparse_attn_decode", "decode_b64_s1", "serial"),
    ("sparse_attn_decode", "decode_b64_s1", "split2"),
    ("sparse_attn_decode", "decode_b64_s1", "split4"),
    ("sparse_attn_decode", "decode_b64_s1", "pipe_hb32_split2"),
    ("sparse_attn_bf16", "prefill_s4k", "default"),
    ("sparse_attn_bf16", "prefill_s4k", "serial"),
    ("sparse_attn_bf16", "decode_b128_s2", "default"),
    ("sparse_attn_bf16", "decode_b64_s1", "default"),
    ("sparse_attn_decode", H128, "default"),
    ("sparse_attn_decode", W37, "default"),
    ("sparse_attn_decode", W37, "serial"),
    ("sparse_attn_prefill", S777, "default"),
    ("sparse_attn_bf16", S777, "default"),
    ("sparse_attn_prefill", "prefill_s4k", "regs10"),
    ("sparse_attn_decode", "decode_b128_s2", "regs10"),
    ("sparse_attn_decode", "decode_b64_s1", "regs10"),
    ("sparse_attn_bf16", "prefill_s4k", "regs10"),
    *_option_rows("io_staged", bf16=("prefill_s4k",)),
    *_option_rows("prefetch"),  # FP4 only
    *_option_rows("wg1"),  # FP4 only
    *_option_rows("tpc2", bf16=("prefill_s4k",)),
    *_option_rows("tpc4", bf16=("prefill_s4k",)),
    *_option_rows("early", bf16=("prefill_s4k", "decode_b128_s2")),
    *_option_rows("lanes_col", bf16=("prefill_s4k", "decode_b128_s2")),
    *_option_rows("lanes_col_early", bf16=("prefill_s4k", "decode_b128_s2")),
    *_option_rows("fp4_prmt"),  # FP4 only
    *_option_rows("fp4_prmt_col_early"),  # FP4 only
    *_option_rows("fp4_fma"),  # FP4 only
    *_option_rows("bi32", bf16=("prefill_s4k",)),
    ("sparse_attn_decode", "decode_b64_s1", "fused"),  # auto: 2 splits, against default (separate) in the same run
    ("sparse_attn_decode", "decode_b128_s2", "fused_split2"),
    ("sparse_attn_decode", "decode_b128_s2", "split2"),  # the separate combine at the same split
    ("sparse_attn_decode", H128, "fused"),
    ("sparse_attn_decode", W37, "fused"),
    ("sparse_attn_bf16", "decode_b64_s1", "fused"),
    *_option_rows("balanced", bf16=("prefill_s4k", "decode_b128_s2")),
    *_option_rows("overlap", bf16=("prefill_s4k", "decode_b128_s2")),
    *_option_rows("overlap_prefetch"),  # prefetch is FP4-only
    *_option_rows("seesaw", bf16=("prefill_s4k", "decode_b128_s2", "decode_b64_s1")),
    *_option_rows("seesaw_col", bf16=("prefill_s4k",)),
    ("sparse_attn_decode", "decode_b64_s1", "seesaw_split4"),  # 2-3 blocks per split: the taken last block
    *_option_rows("paired", bf16=("prefill_s4k", "decode_b128_s2", "decode_b64_s1")),
    ("sparse_attn_decode", "decode_b64_s1", "paired_split4"),  # 2-3 blocks per split: warpgroup 1 without a block
    ("sparse_attn_bf16", W37S5, "paired"),  # 9 blocks per token
    ("sparse_attn_bf16", H128, "paired"),
    ("sparse_attn_prefill", "prefill_s4k", "paired_auto"),
    ("sparse_attn_prefill", S777, "paired_auto"),
    ("sparse_attn_prefill", "prefill_s4k", "seesaw_auto"),
    ("sparse_attn_bf16", "prefill_s4k", "halves"),
    ("sparse_attn_bf16", "decode_b128_s2", "halves"),
    ("sparse_attn_bf16", "decode_b64_s1", "halves"),
    ("sparse_attn_bf16", "decode_b64_s1", "halves_split4"),  # 2-3 blocks per split: warpgroup 1 without a block
    ("sparse_attn_bf16", W37S5, "halves"),  # 9 blocks per token
    ("sparse_attn_bf16", H128, "halves"),
    ("sparse_attn_bf16", S777, "halves"),
    ("sparse_attn_prefill", "prefill_s4k", "halves_auto"),
    ("sparse_attn_prefill", S777, "halves_auto"),
    ("sparse_attn_bf16", "decode_b128_s2", "halves_ovl2"),  # one wave of 2-token CTAs (the tuned winner's ovl2)
    ("sparse_attn_bf16", "decode_b64_s1", "halves_ovl2"),  # two sequences' tokens in a CTA
    ("sparse_attn_bf16", H128, "halves_ovl2"),
    ("sparse_attn_bf16", "prefill_s4k", "halves_ovl4"),
    ("sparse_attn_bf16", "prefill_s4k", "halves_ovl8"),
    ("sparse_attn_bf16", H128, "halves_ovl4"),  # two head blocks per token: items alternate head blocks
    ("sparse_attn_bf16", S777, "halves_ovl8"),  # the last CTA runs one token
    ("sparse_attn_prefill", "prefill_s4k", "halves_ovl8_auto"),
    ("sparse_attn_prefill", S777, "halves_ovl8_auto"),
    ("sparse_attn_decode", "decode_b64_s1", "split4"),
    ("sparse_attn_decode", "decode_b64_s1", "parts_bf16"),
    ("sparse_attn_decode", "decode_b64_s1", "parts_bf16_split4"),
    ("sparse_attn_decode", "decode_b128_s2", "parts_bf16_split4"),
    ("sparse_attn_decode", "decode_b128_s2", "split4"),
    ("sparse_attn_decode", H128, "parts_bf16"),
    ("sparse_attn_decode", W37, "parts_bf16"),
    ("sparse_attn_bf16", "decode_b64_s1", "parts_bf16"),
    ("sparse_attn_prefill", "prefill_s4k", "tpc4_auto"),
    ("sparse_attn_prefill", S777, "tpc4_auto"),
    ("sparse_attn_bf16", "decode_b128_s2", "tpc4"),  # the other tpc4 rows: _option_rows above
    ("sparse_attn_prefill", "prefill_s4k", "ovl2_auto"),
    ("sparse_attn_prefill", "prefill_s4k", "ovl4_auto"),
    ("sparse_attn_prefill", "prefill_s4k", "ovl8_auto"),
    ("sparse_attn_prefill", S777, "ovl4_auto"),  # the last CTA runs one token
    ("sparse_attn_bf16", "prefill_s4k", "ovl2"),
    ("sparse_attn_bf16", "prefill_s4k", "ovl4"),
    ("sparse_attn_bf16", "prefill_s4k", "ovl8"),
    ("sparse_attn_bf16", "decode_b128_s2", "ovl2"),
    ("sparse_attn_bf16", "decode_b64_s1", "ovl2"),  # one token per CTA all the same
    ("sparse_attn_bf16", H128, "ovl2"),  # two head blocks per token: items alternate head blocks
    ("sparse_attn_bf16", H128, "ovl4"),
    ("sparse_attn_bf16", W37S5, "ovl2"),  # odd blocks per token
    ("sparse_attn_bf16", W37S5, "ovl4"),
    ("sparse_attn_bf16", S777, "ovl8"),
]


def _shape(tile, spec):
    from tiles.contract import Shape

    if isinstance(spec, str):
        return tile.shape(spec)
    name, phase, dims = spec
    return Shape(name, phase, {"D": 512, **dims})


def _compile_job(job):
    """Worker: build one (tile, shape, config) so the disk cache holds it. Returns (job index, seconds, error)."""
    i, tile_name, spec, label = job
    override = _override(tile_name, label)
    from tiles.arch import get_arch
    from tiles.registry import get_tile

    t0 = time.time()
    try:
        tile = get_tile(tile_name)
        arch = get_arch("sm90")
        tile.build(_shape(tile, spec), tile.with_defaults(arch, override), arch)
        return i, time.time() - t0, None
    except Exception as exc:  # noqa: BLE001 - reported in the table, never fatal
        return i, time.time() - t0, "".join(traceback.format_exception_only(type(exc), exc)).strip()[-400:]


def _dump(out_dir: Path, labels: str, rows: list[dict], env: dict | None = None) -> dict | None:
    """Rewrite the results file after every row, so a run cut short still leaves what it measured."""
    name = "sparse_attn_run_" + labels.replace(",", "_") + ".json"
    cmd = f"python gpu/sparse_attn_check.py --out $OUT --labels {labels}"
    (out_dir / name).write_text(json.dumps({"environment": env, "command": cmd, "rows": rows}, indent=1, default=str))
    return env


def _reference_launcher(tile, sets):
    return lambda j: tile.reference(sets[j % 2])


def _launcher(tile, k, sets):
    """Kernel-only launch on input set j through the tile's own ``launch`` (outputs allocated once, not
    poisoned: timing only)."""
    import torch

    outs = [{"out": torch.empty_like(s["q"])} for s in sets]  # [B, S, H, D] each
    return lambda j: tile.launch(k, sets[j % 2], outs[j % 2])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--workers", type=int, default=14)
    parser.add_argument("--labels", default=",".join(LABELS), help="which configs to compile, check and time")
    parser.add_argument("--no-compile", action="store_true", help="skip the pool compile phase (an earlier invocation filled the cache)")
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    labels = set(args.labels.split(","))
    jobs = [(i, t, s, lab) for i, (t, s, lab) in enumerate(CHECKS) if lab in labels]
    t0 = time.time()
    compile_err: dict[int, str] = {}
    with ProcessPoolExecutor(max_workers=args.workers, mp_context=get_context("spawn")) as pool:
        for i, secs, err in pool.map(_compile_job, [] if args.no_compile else jobs):
            if err:
                compile_err[i] = err
            print(f"compiled {i:2d} {CHECKS[i][0]:20s} {CHECKS[i][2]:8s} {secs:6.1f}s {'ERR ' + err if err else ''}", flush=True)
    print(f"compile phase {time.time() - t0:.1f}s", flush=True)

    import torch

    from tiles.arch import detect
    from tiles.registry import get_tile
    from tiles.timing import describe_environment, time_cuda, time_cuda_graph

    arch = detect()
    rows: list[dict] = []
    kernels: dict[tuple, object] = {}

    def kernel_for(tile, shape, override):
        key = (tile.name, shape.name, tuple(sorted(override.items())))
        if key not in kernels:
            kernels[key] = tile.build(shape, tile.with_defaults(arch, override), arch)
        return kernels[key]

    # --- correctness ------------------------------------------------------------------------
    for i, (tile_name, spec, label) in enumerate(CHECKS):
        override = _override(tile_name, label)
        if label not in labels:
            continue
        tile = get_tile(tile_name)
        shape = _shape(tile, spec)
        row = {"kind": "check", "tile": tile_name, "shape": shape.name, "label": label, "config": tile.with_defaults(arch, override)}
        if i in compile_err:
            rows.append({**row, "outcome": "compile_error", "message": compile_err[i]})
            continue
        try:
            k = kernel_for(tile, shape, override)
            row["n_split"] = k.n_split
            inputs = tile.make_inputs(shape, seed=100 + i, device="cuda")
            o1 = tile.run(k, inputs)["out"]
            o2 = tile.run(k, inputs)["out"]
            torch.cuda.synchronize()
            ref = tile.reference(inputs)
            cmp = tile.compare({"out": o1}, ref)
            row.update(
                outcome="ok" if cmp.ok else "wrong_result",
                rel_l2=cmp.error,
                finite=bool(torch.isfinite(o1).all()),
                bitwise_repeat=bool(torch.equal(o1.view(torch.int16), o2.view(torch.int16))),
                message=str(cmp),
            )
            if not (row["finite"] and row["bitwise_repeat"]):
                row["outcome"] = "wrong_result"
            # Edge cases on the same kernel: all -1 rows are exact zeros, one index repeated K times matches the reference.
            e = dict(inputs)
            wi, ti = e["window_idx"].clone(), e["topk_idx"].clone()
            wi[0, 0] = -1
            ti[0, 0] = -1
            ti[-1, -1] = ti[-1, -1, :1].clamp(min=0).expand_as(ti[-1, -1]).clone()  # one index repeated K times
            e["window_idx"], e["topk_idx"] = wi, ti
            oe = tile.run(k, e)["out"]
            re = tile.reference(e)
            ce = tile.compare({"out": oe}, re)
            row["edge_all_minus1_zero"] = bool((oe[0, 0] == 0).all())
            row["edge_rel_l2"] = ce.error
            if not (row["edge_all_minus1_zero"] and ce.ok):
                row["outcome"] = "wrong_result"
                row["message"] += f"; edge: zero={row['edge_all_minus1_zero']} {ce}"
            cfg = row["config"]
            if cfg.get("schedule") == "ws" and cfg.get("produce") == "batched":
                # the batched producer masks an index past the cache like -1
                nc = shape["Nc"]
                eo = dict(inputs)
                ti = eo["topk_idx"].clone()
                ti[0, 0, :3] = torch.tensor([nc, nc + 7, 2**30], dtype=torch.int32, device="cuda")
                eo["topk_idx"] = ti
                ro = dict(eo)
                ro["topk_idx"] = torch.where(ti >= nc, -1, ti)
                co = tile.compare({"out": tile.run(k, eo)["out"]}, tile.reference(ro))
                row["edge_out_of_range_rel_l2"] = co.error
                if not co.ok:
                    row["outcome"] = "wrong_result"
                    row["message"] += f"; out-of-range indices not masked: {co}"
        except Exception as exc:  # noqa: BLE001 - a faulting config is a row, not the end of the run
            row.update(outcome="runtime_fault", message="".join(traceback.format_exception_only(type(exc), exc)).strip()[-400:])
        rows.append(row)
        _dump(out_dir, args.labels, rows)
        print(
            f"check {tile_name:20s} {shape.name:16s} {label:8s} {row['outcome']:14s} rel_l2={row.get('rel_l2', float('nan')):.2e}",
            flush=True,
        )

    ok_checks = {(r["tile"], r["shape"], r["label"]) for r in rows if r.get("outcome") == "ok"}

    # --- timing -----------------------------------------------------------------------------
    timed = [(t, sh) for t, sh, _ in CHECKS if isinstance(sh, str)]  # registry shapes only: custom ones hold dicts
    for tile_name, shape_name in dict.fromkeys(timed):
        passed = [lab for t, sh, lab in CHECKS if (t, sh) == (tile_name, shape_name) and (t, sh, lab) in ok_checks]
        if not passed:
            continue
        tile = get_tile(tile_name)
        shape = tile.shape(shape_name)
        flops, nbytes = tile.flops(shape), tile.bytes_moved(shape)
        sets = [tile.make_inputs(shape, seed=200 + j, device="cuda") for j in range(2)]
        tr = time_cuda(_reference_launcher(tile, sets), n_sets=2, warmup=1, runs=3, min_time_ms=0).median_ms
        rows.append({"kind": "time", "tile": tile_name, "shape": shape_name, "label": "torch_reference", "ms": tr})
        for label in passed:
            row = {"kind": "time", "tile": tile_name, "shape": shape_name, "label": label}
            k = kernel_for(tile, shape, _override(tile_name, label))
            launch = _launcher(tile, k, sets)
            eager = time_cuda(launch, n_sets=2, warmup=5, runs=30, min_time_ms=20)
            t = time_cuda_graph(launch, n_sets=2) or eager  # device time; per-call (host overhead included) beside it
            row.update(
                timing="cuda-graph" if t is not eager else "eager",
                eager_ms=eager.median_ms,
                ms=t.median_ms,
                p10_ms=t.p10_ms,
                p90_ms=t.p90_ms,
                n_split=k.n_split,
                tflops=flops / (t.median_ms * 1e-3) / 1e12,
                gbps=nbytes / (t.median_ms * 1e-3) / 1e9,
                speedup_vs_torch=tr / t.median_ms,
            )
            rows.append(row)
            _dump(out_dir, args.labels, rows)
        del sets
        torch.cuda.empty_cache()

    env = _dump(out_dir, args.labels, rows, describe_environment())

    print("\n== checks")
    for r in rows:
        if r["kind"] == "check":
            extra = (
                f" edge_zero={r.get('edge_all_minus1_zero')} edge_l2={r.get('edge_rel_l2', float('nan')):.2e}" if "edge_rel_l2" in r else ""
            )
            print(
                f"{r['tile']:20s} {r['shape']:16s} {r['label']:8s} {r['outcome']:14s} split={r.get('n_split', '-')} "
                f"rel_l2={r.get('rel_l2', float('nan')):.2e} rep={r.get('bitwise_repeat')}{extra} {'' if r['outcome'] == 'ok' else r.get('message', '')[:300]}"
            )
    print(
        "\n== timings (kernel device time from CUDA-graph replay; TFLOPS = 4*B*S*H*(W+K)*D / t; GB/s from q + gathered KV + indices + out)"
    )
    for r in rows:
        if r["kind"] == "time":
            if r.get("ms") is None:
                print(f"{r['tile']:20s} {r['shape']:16s} {r['label']:16s} {'-':>9s} {r.get('message', '')}")
            elif r["label"] == "torch_reference":
                print(f"{r['tile']:20s} {r['shape']:16s} {r['label']:16s} {r['ms']:9.4f} ms")
            else:
                print(
                    f"{r['tile']:20s} {r['shape']:16s} {r['label']:16s} {r['ms']:9.4f} ms {r['tflops']:7.1f} TFLOPS {r['gbps']:8.1f} GB/s "
                    f"split={r['n_split']} x{r['speedup_vs_torch'] or 0:.1f} vs torch ({r['timing']}; per call {r['eager_ms']:.4f} ms)"
                )
    print(f"\n{env}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
