"""One tuning study across every local GPU against the same study on one GPU (issue 8).

    python3 gpu/multi_gpu_tune.py OUT [--tile fp4_dequant_index] [--shape decode_b64] [--trials 24]

Runs ``lab tune --workers N`` (N = the GPUs present) into a fresh SQLite study, then ``--workers 1`` with the same
tile, shape, trials and seed into another, and writes ``OUT/multi_gpu_tune.json``: wall time of each run, trials per
GPU (the ``gpu`` attribute the GPU worker records), configs measured more than once (there must be none: a repeat is
answered from the earlier trial, a concurrent one is marked duplicate), and each run's winner.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def tune(out: Path, workers: int, args) -> dict:
    results = out / f"workers{workers}"
    results.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "lab", "tune", "--arch", "auto", "--tile", args.tile, "--shapes", args.shape, "--trials", str(args.trials),
           "--workers", str(workers), "--seed", "7", "--results", str(results), "--storage", f"sqlite:///{results}/study.db"]  # fmt: skip
    t0 = time.time()
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=ROOT)
    wall = time.time() - t0
    (results / "tune.log").write_text(proc.stdout + proc.stderr)
    return {
        "workers": workers,
        "command": " ".join(["lab", *cmd[3:]]),
        "rc": proc.returncode,
        "wall_s": round(wall, 1),
        **summarise(results),
    }


def summarise(results: Path) -> dict:
    """The study in ``results/study.db`` through the tuner's own :func:`tuning.study.summarize`, plus the spread of
    its measured trials over GPUs and any config measured twice."""
    import optuna

    from tiles.arch import get_arch
    from tiles.registry import get_tile
    from tuning.study import summarize

    storage = f"sqlite:///{results}/study.db"
    studies = optuna.get_all_study_summaries(storage)
    if not studies:
        return {"error": "no study was recorded"}
    study = optuna.load_study(study_name=studies[0].study_name, storage=storage)
    tile = get_tile(study.user_attrs["tile"])
    arch = get_arch(study.user_attrs["arch"])
    summary = summarize(study, tile, tile.shape(study.user_attrs["shape"]), tile.default_config(arch), compile_only=False)
    measured = [t for t in study.get_trials(deepcopy=False) if "gpu" in t.user_attrs]  # trials a GPU worker ran
    keys = Counter(t.user_attrs.get("config_key") for t in measured)
    return {
        "study": summary.study,
        "trials": summary.trials,
        "outcomes": summary.outcomes,
        "trials_per_gpu": dict(Counter(t.user_attrs["gpu"] for t in measured)),
        "configs_measured_twice": [k for k, n in keys.items() if n > 1],
        "best_ms": summary.best_ms,
        "default_ms": summary.default_ms,
        "best_config": summary.best.params if summary.best else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--tile", default="fp4_dequant_index")
    parser.add_argument("--shape", default="decode_b64")
    parser.add_argument("--trials", type=int, default=24)
    args = parser.parse_args()
    import torch

    from tiles.timing import describe_environment

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    n_gpus = torch.cuda.device_count()
    runs = [tune(out, n_gpus, args), tune(out, 1, args)]
    doc = {"environment": describe_environment(), "gpus": n_gpus, "command": f"python3 gpu/multi_gpu_tune.py OUT --tile {args.tile} "
           f"--shape {args.shape} --trials {args.trials}", "runs": runs}  # fmt: skip
    (out / "multi_gpu_tune.json").write_text(json.dumps(doc, indent=1, default=str))
    print(json.dumps(runs, indent=1, default=str))
    return 0 if all(r["rc"] == 0 for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
