"""Where a block of the ws attention kernel goes: time the default with one role's work removed.

    python3 gpu/attn_ablation.py --json $OUT/attn_ablation.json

For each (tile, shape) the default config (the GPU's arch) is built as it is and with each of
``tiles.sparse_attn.ABLATIONS`` (``producer_idle``: the producer hands every buffer over unfilled, so the consumers'
chain runs alone; ``consumers_idle``: the consumers hand every filled buffer straight back, so the producer's cycle
runs alone; ``no_softmax``: warpgroup 0 skips the online softmax; ``no_dequant``: the producer skips the E2M1 decode;
``uncoupled``: both roles work but neither waits for the other; ``no_loads``: the producer decodes FP4 rows made
from the row index instead of loading them; ``no_fence``: no proxy fence before the producer arrives; ``no_stores``:
the producer loads and decodes but stores no decoded FP4 row; ``stores_only``: it stores FP4 rows with neither loads
nor decode; ``skeleton``: FP4 main blocks get no loads, decode or stores, window blocks are filled; ``no_window``:
the reverse; ``half_main``: the producer fills half of each FP4 main block's rows). The real kernel is checked against the torch
reference first (outputs NaN-poisoned); the ablations compute garbage by design and are only timed (CUDA-graph replay,
device time), in the same run. Read: the default against max(producer alone, consumers alone) is what running the
roles together costs; ``uncoupled`` splits that into contention on the SM (uncoupled vs the roles alone) and the
hand-offs (default vs uncoupled). Results and what they meant on the H200: notes/sparse_attn.md, session 14.

Runs from the repo root on a GPU machine; without a CUDA GPU it exits with status 2 and says so.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = (
    ("sparse_attn_prefill", "prefill_s4k"),
    ("sparse_attn_decode", "decode_b128_s2"),
    ("sparse_attn_decode", "decode_b64_s1"),
    ("sparse_attn_bf16", "prefill_s4k"),
    ("sparse_attn_bf16", "decode_b128_s2"),
)


def _kernel(tile, shape, arch, ablate: str, override: dict | None = None):
    """The tile's default kernel for ``shape`` (``override`` over it), built directly (never cached) with ``ablate``."""
    import tiles.sparse_attn as sa

    return sa.timing_ablation(tile, shape, arch, ablate, override)


def _compile_job(job):
    """Worker: build one (tile, shape, ablation) so that TileLang's disk cache holds it. Returns (job, error or None)."""
    tile_name, shape_name, ablate, arch_name, override = job
    try:
        from tiles.arch import get_arch
        from tiles.registry import get_tile

        tile = get_tile(tile_name)
        _kernel(tile, tile.shape(shape_name), get_arch(arch_name), ablate, override)
        return job, None
    except Exception as exc:  # noqa: BLE001 - reported, never fatal
        return job, "".join(traceback.format_exception_only(type(exc), exc)).strip()[-300:]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None, help="write the rows (with environment and command) here")
    parser.add_argument("--workers", type=int, default=14, help="compile processes")
    parser.add_argument("--config", default="{}", help='JSON over each tile\'s default config, e.g. \'{"consumers": "seesaw"}\'')
    parser.add_argument("--variants", default=None, help="comma-separated: 'default' and ablation names (default: all)")
    parser.add_argument("--cases", default=None, help="comma-separated tile:shape pairs of CASES (default: all)")
    args = parser.parse_args()
    override = json.loads(args.config)
    from tiles.sparse_attn import ABLATIONS

    # a typo in a variant or case must not cost a device call: checked before the GPU is asked for
    variants = tuple(v for v in (args.variants or ",".join(("default", *ABLATIONS))).split(",") if v)
    ablations = tuple("" if v == "default" else v for v in variants)
    cases = CASES if not args.cases else tuple(tuple(c.split(":")) for c in args.cases.split(","))
    unknown = [c for c in cases if c not in CASES] + [v for v in variants if v != "default" and v not in ABLATIONS]
    if unknown:
        known = ", ".join(f"{t}:{s}" for t, s in CASES)
        print(f"attn_ablation: unknown {unknown}; cases: {known}; variants: default, {', '.join(ABLATIONS)}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("attn_ablation: needs a CUDA GPU", file=sys.stderr)
        return 2
    from tiles.arch import detect
    from tiles.registry import get_tile
    from tiles.timing import describe_environment, time_cuda_graph

    arch = detect()
    rows = []
    jobs = [(t, sh, ab, arch.name, override) for t, sh in cases for ab in {"", *ablations}]
    with multiprocessing.get_context("spawn").Pool(min(args.workers, len(jobs))) as pool:  # fills TileLang's disk cache
        for job, err in pool.imap_unordered(_compile_job, jobs):
            print(f"compiled {job}: {err or 'ok'}", flush=True)
    print(f"{'tile':20s} {'shape':16s} {'variant':16s} {'ms':>9s}")
    for tile_name, shape_name in cases:
        tile = get_tile(tile_name)
        shape = tile.shape(shape_name)
        sets = [tile.make_inputs(shape, seed) for seed in (1, 2)]
        real = _kernel(tile, shape, arch, "", override)
        cmp = tile.compare(tile.run(real, sets[0]), tile.reference(sets[0]))  # outputs NaN-poisoned by run()
        # blocks per CTA slot: (token, head block) items x splits x blocks per split, over the SMs
        for ablate in ablations:
            kernel = real if not ablate else _kernel(tile, shape, arch, ablate, override)
            outs = [tile.alloc_outputs(kernel, s) for s in sets]
            t = time_cuda_graph(lambda j, tl=tile, k=kernel, o=outs, ins=sets: tl.launch(k, ins[j % 2], o[j % 2]), n_sets=2)
            ms = t.median_ms if t else float("nan")
            label = ablate or "default"
            rows.append(
                {
                    "tile": tile_name,
                    "shape": shape_name,
                    "config": override,
                    "variant": label,
                    "ms": ms,
                    "check": (cmp.ok, str(cmp)) if not ablate else None,
                }
            )
            print(
                f"{tile_name:20s} {shape_name:16s} {label:16s} {ms:9.4f}"
                + (f"   check {'ok' if cmp.ok else 'WRONG'}" if not ablate else "")
            )
    if args.json:
        cmd = "python3 gpu/attn_ablation.py --json $OUT/attn_ablation.json" + "".join(
            f" --{k} '{v}'" for k, v in (("config", args.config), ("variants", args.variants), ("cases", args.cases)) if v and v != "{}"
        )
        Path(args.json).write_text(json.dumps({"environment": describe_environment(), "command": cmd, "rows": rows}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
