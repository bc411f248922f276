"""The prefill attention with its caches gathered and decoded per read (``kv_staging="gather"``) against expanded to
bf16 once (``"expand"``), in one run.

    python3 gpu/kv_staging.py --json $OUT/kv_staging.json [--shapes prefill_s4k,prefill_s16k,prefill_s64k]
        [--sweep 256:32768,1024:131072]

``--sweep S:Nc,...``: prompt chunks of S tokens (window over the chunk's own S rows) over Nc cache entries, where each
cache row is read fewer times: both configs checked and timed, for where "auto" should stop expanding.

Per shape: both configs through the harness (checked against the torch reference on fresh inputs with NaN-poisoned
outputs, repeat runs bitwise equal, then timed by CUDA-graph replay), the expansion and the bf16 attention behind
"expand" timed alone on the same inputs, and the torch reference. Runs from the repo root on a GPU machine; without a
CUDA GPU it exits with status 2 and says so.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = "prefill_s4k,prefill_s16k,prefill_s64k"
# label -> config over the prefill tile's default
VARIANTS = {
    "gather": {"kv_staging": "gather"},
    "expand": {"kv_staging": "expand", "unused_rows": "row0"},
    "expand_zeros": {"kv_staging": "expand", "unused_rows": "zeros"},  # unused slots zero-filled, not copied from row 0
}


def _parts(tile, shape, arch) -> dict[str, float | None]:
    """Device ms of the expansion alone and of the bf16 attention alone on its output (CUDA-graph replay)."""
    import torch

    from tiles.kv_expand import expand_caches
    from tiles.timing import time_cuda_graph

    kernel = tile.build(shape, {"kv_staging": "expand"}, arch)
    inputs = tile.make_inputs(shape, 0, "cuda")
    f8 = torch.float8_e4m3fn
    args = (inputs["window_codes"], inputs["window_scales"], inputs["main_packed"], inputs["main_scales"].view(f8))
    window_kv, main_kv = expand_caches(kernel.expand, *args)
    dummy = torch.empty(1, dtype=torch.uint8, device="cuda")
    out = torch.empty_like(inputs["q"])

    def attend(_):
        kernel.attend(inputs["q"], window_kv, dummy, inputs["window_idx"], main_kv, dummy, inputs["topk_idx"], inputs["sink"], out=out)

    expand = time_cuda_graph(lambda _: expand_caches(kernel.expand, *args))
    attention = time_cuda_graph(attend)
    return {"expand_ms": expand.median_ms if expand else None, "bf16_attention_ms": attention.median_ms if attention else None}


def _full_lists(make_inputs):
    """``make_inputs`` with every window and top-k slot holding a random row of the whole cache (no -1): the causal
    prompt's early tokens leave most slots unused, which a short prompt is mostly made of."""
    import torch

    def make(shape, seed, device="cuda"):
        inputs = make_inputs(shape, seed, device)
        g = torch.Generator(device=device).manual_seed(seed + 7)
        B, S, W, K, Nw, Nc = (shape[k] for k in ("B", "S", "W", "K", "Nw", "Nc"))
        inputs["window_idx"] = torch.randint(0, Nw, (B, S, W), generator=g, device=device, dtype=torch.int32)
        inputs["topk_idx"] = torch.randint(0, Nc, (B, S, K), generator=g, device=device, dtype=torch.int32)
        return inputs

    return make


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--sweep", default="", help="S:Nc pairs, e.g. 256:32768,1024:131072")
    parser.add_argument("--variants", default="gather,expand", help=f"labels among {', '.join(VARIANTS)}")
    parser.add_argument(
        "--full-lists",
        action="store_true",
        help="sweep rows with every window and top-k slot used (random rows of the whole cache) instead of the causal prompt's lists",
    )
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("kv_staging.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from tiles.arch import detect
    from tiles.contract import Shape
    from tiles.harness import evaluate, time_reference
    from tiles.sparse_attn import PREFILL_TILE, resolve_kv_staging
    from tiles.timing import describe_environment

    arch = detect()
    tile = PREFILL_TILE
    if args.full_lists:
        tile.make_inputs = _full_lists(tile.make_inputs)  # this process's instance only
    doc = {
        "command": "python3 gpu/kv_staging.py " + " ".join(sys.argv[1:]),
        "environment": describe_environment(),
        "full_lists": args.full_lists,
        "rows": [],
    }
    print(f"{'shape':14} {'staging':12} {'outcome':8} {'ms':>8} {'TFLOPS':>7} {'rel_l2':>8}")
    base = tile.shape("prefill_s4k").dims
    sweep = [tuple(int(x) for x in pair.split(":")) for pair in args.sweep.split(",") if pair]
    shapes = [tile.shape(name) for name in args.shapes.split(",") if name]
    shapes += [Shape(f"s{S}_nc{nc}", "prefill", {**base, "S": S, "Nw": S, "Nc": nc}) for S, nc in sweep]
    for shape in shapes:
        name, swept = shape.name, shape.name not in {s.name for s in tile.shapes()}
        reads = shape["S"] * (shape["W"] + shape["K"]) / (shape["Nw"] + shape["Nc"])
        row = {"shape": name, "dims": dict(shape.dims), "flops": tile.flops(shape), "reads_per_row": reads}
        for staging in args.variants.split(","):
            ev = evaluate(tile, shape, tile.with_defaults(arch, VARIANTS[staging]), arch)
            row[staging] = ev.to_dict()
            tflops = f"{ev.tflops:7.1f}" if ev.tflops else "      -"
            ms = f"{ev.ms:8.4f}" if ev.ms else "       -"
            print(f"{name:14} {staging:12} {ev.outcome:8} {ms} {tflops} {ev.error if ev.error is not None else '-':>8}", flush=True)
            if not ev.ok:
                print(f"  {ev.message}", flush=True)
        if swept:
            auto = resolve_kv_staging("auto", shape)
            print(f"  {reads:.1f} reads per cache row; auto picks {auto}", flush=True)
        else:
            row.update(_parts(tile, shape, arch))
            row["torch_ms"] = time_reference(tile, shape)
            print(
                f"  expansion alone {row['expand_ms']} ms, bf16 attention alone {row['bf16_attention_ms']} ms, torch {row['torch_ms']} ms",
                flush=True,
            )
        doc["rows"].append(row)
        torch.cuda.empty_cache()
    args.json.write_text(json.dumps(doc, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
