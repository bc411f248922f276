"""Where a CED prefill's time goes, op by op: torch.profiler over one prefill of the v4.1-flash model.

    python3 gpu/prefill_ops.py --prompt 65536 --backend tiles --json $OUT/prefill_ops.json

`lab e2e`'s breakdown puts half of a 64K tiles prefill in "rest" (everything outside the attention, indexer,
compressor and FFN calls: projections, norms, RoPE, the SWA quantisation, casts). This names it: one untimed
prefill (compiles, allocator pools), then one profiled prefill with CUDA activity recorded; per torch op its
self CUDA time (the kernels the op itself launched), calls and share of the prefill's CUDA time, the top
``--top`` printed, every op written to the JSON with the GPU, versions, date and command.

Runs from the repo root on a GPU machine; without a CUDA GPU it exits with status 2 and says so.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=65536, help="prompt tokens (batch 1; default 64K)")
    parser.add_argument("--backend", choices=("tiles", "torch"), default="tiles")
    parser.add_argument("--configs", choices=("default", "tuned"), default="default", help="the tiles backend's configs")
    parser.add_argument("--top", type=int, default=25, help="ops printed (default 25)")
    parser.add_argument("--json", metavar="PATH", default=None)
    args = parser.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        print("prefill_ops: needs a CUDA GPU", file=sys.stderr)
        return 2
    from gpu.profile_tiles import environment
    from lab.e2e.run import Variant, make_backend
    from model import build_model, preset

    model = build_model(preset("v4.1-flash"), backend="torch", device="cuda", dtype=torch.bfloat16, seed=0)
    model.backend = make_backend(Variant(args.backend, args.configs if args.backend == "tiles" else "-"), model.device)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        model.prefill(tokens)  # untimed: compiles, cuBLAS handles, allocator pools
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            model.prefill(tokens)
            torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3

    # Two views of the same kernels: by the torch op that launched them (CPU events' self CUDA time; TileLang's
    # launches are not torch ops and show up only in the second view), and by kernel name (CUDA events).
    ops, kernels = [], []
    for ev in prof.key_averages():
        row = {"name": ev.key, "calls": ev.count}
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels.append({**row, "cuda_ms": ev.device_time_total / 1e3})
        elif ev.self_device_time_total > 0 and "::" in ev.key:  # torch ops only (not the profiler's "Command Buffer Full")
            ops.append({**row, "cuda_ms": ev.self_device_time_total / 1e3})
    total = sum(k["cuda_ms"] for k in kernels)
    print(f"CED prefill of {args.prompt} tokens on {args.backend}: {wall_ms:.1f} ms under the profiler, {total:.1f} ms of kernel time")
    for title, rows in (("torch op (self CUDA time)", ops), ("kernel", kernels)):
        rows.sort(key=lambda r: -r["cuda_ms"])
        print(f"\n{title:<70} {'calls':>7} {'ms':>10} {'share':>7}")
        for r in rows[: args.top]:
            print(f"{r['name'][:70]:<70} {r['calls']:>7} {r['cuda_ms']:>10.2f} {r['cuda_ms'] / total:>7.1%}")
    if args.json:
        doc = {"environment": environment(), "prompt": args.prompt, "backend": args.backend, "configs": args.configs}
        doc.update(wall_ms_profiled=wall_ms, kernel_ms=total, ops=ops, kernels=kernels)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
