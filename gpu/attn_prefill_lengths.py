"""Do ``io="auto"`` and ``consumers="auto"`` pick the fastest Q/O handling and consumers at every prompt length?

    python3 gpu/attn_prefill_lengths.py --out $OUT [--tile sparse_attn_prefill] [--lengths 256,512,1024,4096]

The sparse-attention tiles' default ``io="auto"`` resolves per call (``tiles.sparse_attn.resolve_io``): where the
kernel's rows are bf16 it runs ``overlapped`` with 8, 4 or 2 tokens per CTA or ``staged`` with one, whichever leaves
the busiest SM the least work (waves of CTAs x work per CTA); ``consumers="auto"`` (``resolve_consumers``) then runs
paired_halves where that overlaps a prefill's tokens. This times, at each prefill length S (B=1, H=64, window 128,
top-k 512), the default and the fixed alternatives it chooses between:

    wg0         consumers=wg0_scores with io="auto" (the default before session 22, with session 22's io rule)
    staged1     io=staged, one token per CTA
    staged4     io=staged, 4 tokens per CTA
    ovl2/4/8    io=overlapped with 2, 4 or 8 tokens per CTA
    halves1     consumers=paired_halves, io=staged, one token per CTA
    halves2/4/8 consumers=paired_halves, io=overlapped with 2, 4 or 8 tokens per CTA

Every (length, label) is checked against the reference on fresh inputs (NaN-poisoned outputs) before it is timed
(CUDA-graph replay: device time); a label the constraints refuse at a length is listed as refused. The table marks
what the default resolved to and the fastest label per length. Writes attn_prefill_lengths.json (rows, environment,
command) under --out. All kernels compile first, in parallel. Without a CUDA GPU it exits with status 2.
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

LABELS = {
    "default": {},
    "wg0": {"consumers": "wg0_scores"},
    "staged1": {"io": "staged", "tokens_per_cta": 1},
    "staged4": {"io": "staged", "tokens_per_cta": 4},
    "ovl2": {"io": "overlapped", "tokens_per_cta": 2},
    "ovl4": {"io": "overlapped", "tokens_per_cta": 4},
    "ovl8": {"io": "overlapped", "tokens_per_cta": 8},
    # the paired consumers with each KV buffer handed over in halves, staged or overlapped (O through the P tiles)
    "halves1": {"consumers": "paired_halves", "io": "staged", "tokens_per_cta": 1},
    "halves2": {"consumers": "paired_halves", "io": "overlapped", "tokens_per_cta": 2},
    "halves4": {"consumers": "paired_halves", "io": "overlapped", "tokens_per_cta": 4},
    "halves8": {"consumers": "paired_halves", "io": "overlapped", "tokens_per_cta": 8},
}
LENGTHS = (256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)


def shape_at(s: int):
    """Prefill of one ``s``-token prompt: H=64, window 128, top-k 512 (the tile's prefill_s4k at another length)."""
    from tiles.contract import Shape

    return Shape(f"prefill_s{s}", "prefill", {"B": 1, "S": s, "Nc": s, "Nw": s, "H": 64, "D": 512, "W": 128, "K": 512})


def _refusal(tile_name: str, s: int, label: str, arch_name: str) -> str | None:
    from tiles.arch import get_arch
    from tiles.registry import get_tile

    tile, arch, shape = get_tile(tile_name), get_arch(arch_name), shape_at(s)
    bad = tile.search_space(arch).violations(tile.with_defaults(arch, LABELS[label]), shape, arch)
    return "; ".join(bad) or None


def _compile_job(job):
    """Worker: build one (length, label) so that TileLang's disk cache holds it. Returns (job, error or None)."""
    tile_name, s, label, arch_name = job
    try:
        from tiles.arch import get_arch
        from tiles.registry import get_tile

        tile, arch = get_tile(tile_name), get_arch(arch_name)
        tile.build(shape_at(s), tile.with_defaults(arch, LABELS[label]), arch)
        return job, None
    except Exception as exc:  # noqa: BLE001 - reported, never fatal
        return job, "".join(traceback.format_exception_only(type(exc), exc)).strip()[-300:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--tile", default="sparse_attn_prefill")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="comma-separated prompt lengths")
    parser.add_argument("--labels", default=",".join(LABELS), help=f"comma-separated, of {', '.join(LABELS)}")
    parser.add_argument("--workers", type=int, default=14, help="compile processes")
    args = parser.parse_args()
    labels = [x for x in args.labels.split(",") if x]
    unknown = [x for x in labels if x not in LABELS]
    lengths = [int(x) for x in args.lengths.split(",") if x]
    if unknown or not labels or not lengths:  # a typo must not cost a device call
        print(f"attn_prefill_lengths: unknown labels {unknown}; use {', '.join(LABELS)}", file=sys.stderr)
        return 2

    import torch

    if not torch.cuda.is_available():
        print("attn_prefill_lengths: needs a CUDA GPU", file=sys.stderr)
        return 2

    from tiles.arch import detect
    from tiles.registry import get_tile
    from tiles.timing import describe_environment, time_cuda, time_cuda_graph

    arch, tile = detect(), get_tile(args.tile)
    jobs = [(args.tile, s, x, arch.name) for s in lengths for x in labels if not _refusal(args.tile, s, x, arch.name)]
    with multiprocessing.get_context("spawn").Pool(max(1, min(args.workers, len(jobs)))) as pool:  # fills the disk cache
        for job, err in pool.imap_unordered(_compile_job, jobs):
            print(f"compiled S={job[1]} {job[2]}: {err or 'ok'}", flush=True)
    rows = []
    for s in lengths:
        shape = shape_at(s)
        resolved = tile.resolve_call(tile.with_defaults(arch, {}), shape.dims, arch)
        chosen = f"{resolved['io']}, {resolved['tokens_per_cta']} per CTA"
        inputs = tile.make_inputs(shape, seed=11)
        for label in labels:
            row = {"S": s, "label": label, "config": LABELS[label], "default_resolves_to": chosen}
            why = _refusal(args.tile, s, label, arch.name)
            if why:
                row.update(check="refused", detail=why)
            else:
                try:
                    kernel = tile.build(shape, tile.with_defaults(arch, LABELS[label]), arch)
                    cmp = tile.compare(tile.run(kernel, inputs), tile.reference(inputs))  # outputs NaN-poisoned by run()
                    row.update(check="ok" if cmp.ok else "WRONG", detail=str(cmp))
                except Exception as exc:  # noqa: BLE001 - one label that fails leaves the others' rows
                    row.update(check="error", detail=str(exc)[-300:])
                if row["check"] == "ok":
                    out = tile.alloc_outputs(kernel, inputs)
                    launch = lambda _j, o=out, kk=kernel, x=inputs: tile.launch(kk, x, o)
                    timing = time_cuda_graph(launch, n_sets=1) or time_cuda(launch, n_sets=1)  # graph replay: device time
                    row["ms"] = timing.median_ms
            rows.append(row)
        timed = {r["label"]: r["ms"] for r in rows if r["S"] == s and "ms" in r}
        best = min(timed, key=timed.get) if timed else None
        cells = [f"{x} {timed[x]:.4f}" + ("*" if x == best else "") if x in timed else f"{x} -" for x in labels]
        print(f"S={s:6d} default -> {chosen:22s} " + "  ".join(cells), flush=True)
    cmd = f"python3 gpu/attn_prefill_lengths.py --out $OUT --tile {args.tile} --lengths {args.lengths} --labels {args.labels}"
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {"environment": describe_environment(), "command": cmd, "tile": args.tile, "rows": rows}
    (args.out / "attn_prefill_lengths.json").write_text(json.dumps(doc, indent=1))
    return 0 if all(r["check"] in ("ok", "refused") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
