"""Compile every FP4 kernel the GPU batch uses, in parallel, so the tests and benches hit TileLang's cache."""

from __future__ import annotations

import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor

from gpu.fp4_bench import SWEEP

VARIANTS = [
    ("registers", 2, 256, "tiles"),
    ("registers", 1, 256, "tiles"),
    ("shared", 1, 128, "tiles"),
    ("registers", 4, 64, "persistent"),
    ("shared", 2, 512, "persistent"),
] + [(c["staging"], c["groups_per_thread"], c["threads"], c["grid"]) for c in SWEEP]


def _jobs() -> list[tuple]:
    jobs = set()
    for dim, fmt in ((512, "e4m3"), (128, "e8m0")):
        for staging, gpt, threads, grid in VARIANTS:
            if (dim // (16 if fmt == "e4m3" else 32)) % gpt:
                continue
            for kind in ("quant", "dequant"):
                jobs.add((kind, dim, fmt, "bfloat16", staging, gpt, threads, grid))
        for kind in ("quant", "dequant"):  # the public functions' float32 side, default config
            jobs.add((kind, dim, fmt, "float32", "registers", 2 if fmt == "e4m3" else 1, 256, "tiles"))
    return sorted(jobs)


def _build(job: tuple) -> str:
    from tiles import fp4

    kind, *args = job
    t0 = time.perf_counter()
    try:
        (fp4.build_quant if kind == "quant" else fp4.build_dequant)(*args, "sm_90a")
    except Exception as exc:  # noqa: BLE001 -- reported per kernel, the batch goes on
        return f"{job}: FAILED {type(exc).__name__}: {str(exc)[:300]}"
    return f"{job}: {time.perf_counter() - t0:.1f}s"


if __name__ == "__main__":
    jobs = _jobs()
    with ProcessPoolExecutor(max_workers=min(len(jobs), os.cpu_count() or 1), mp_context=multiprocessing.get_context("spawn")) as pool:
        for line in pool.map(_build, jobs):
            print(line, flush=True)
