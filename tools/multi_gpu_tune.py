"""One tuning run across every local GPU against the same run on one GPU (issue 8).

    python3 tools/multi_gpu_tune.py OUT [--tile all] [--shapes decode_b64_n128k,...] [--trials 8] [--run-timeout 280]

Runs ``lab tune --workers N`` (N = the GPUs present) into a fresh SQLite storage, then ``--workers 1`` with the same
tiles, shapes, trials and seed into another; each run gets its own empty TileLang cache, so both compile every config
from scratch on the same cores and differ only in the GPU workers. Writes ``OUT/multi_gpu_tune.json``: per run its
wall time, trials per GPU (the ``gpu`` attribute the GPU worker records) and each GPU's busy seconds (``gpu_s``), and
per study its trials, outcomes, configs measured more than once (there must be none: a repeat is answered from the
earlier trial, a concurrent one is marked duplicate) and its winner; the winners each run exported sit in
``OUT/workers<N>/results/``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# one shape per tile, so ``--tile all`` covers every tile once: decode target shapes, and prefill 4K for the tiles
# that have no decode shape (sparse_attn_prefill) or whose prefill schedule differs (indexer, bf16 attention)
DEFAULT_SHAPES = "decode_b64_n128k,decode_r2_b64,decode_b64,decode_b64_s1,prefill_s4k"


def tune(out: Path, workers: int, args) -> dict:
    run_dir = out / f"workers{workers}"
    run_dir.mkdir(parents=True, exist_ok=True)
    storage = f"sqlite:///{run_dir}/study.db"
    cmd = [sys.executable, "-m", "lab", "tune", "--arch", "auto", "--tile", args.tile, "--shapes", args.shapes,
           "--trials", str(args.trials), "--workers", str(workers), "--seed", "7", "--results", str(run_dir / "results"),
           "--storage", storage]  # fmt: skip
    env = os.environ | {"TILELANG_CACHE_DIR": str(Path(args.cache_root) / f"workers{workers}")}  # empty: compiles from scratch
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=ROOT, env=env, timeout=args.run_timeout)
        rc, log = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, log = "timeout", f"{exc.stdout or ''}{exc.stderr or ''}\n-- killed after {args.run_timeout} s"
    wall = time.time() - t0
    (run_dir / "tune.log").write_text(log if isinstance(log, str) else log.decode(errors="replace"))
    return {"workers": workers, "command": " ".join(["lab", *cmd[3:]]), "rc": rc, "wall_s": round(wall, 1), **summarise(storage)}


def summarise(storage: str) -> dict:
    """Every study in ``storage`` through the tuner's own :func:`tuning.study.summarize`, plus the spread of its
    measured trials over GPUs and any config measured twice."""
    import optuna

    from tiles.core.arch import get_arch
    from tiles.core.registry import get_tile
    from tuning.study import summarize

    per_gpu_trials: Counter = Counter()
    per_gpu_busy: defaultdict = defaultdict(float)
    studies = []
    for info in optuna.get_all_study_summaries(storage):
        study = optuna.load_study(study_name=info.study_name, storage=storage)
        tile = get_tile(study.user_attrs["tile"])
        arch = get_arch(study.user_attrs["arch"])
        summary = summarize(study, tile, tile.shape(study.user_attrs["shape"]), tile.default_config(arch), compile_only=False)
        measured = [t for t in study.get_trials(deepcopy=False) if "gpu" in t.user_attrs and "repeat_of" not in t.user_attrs]
        for t in measured:
            per_gpu_trials[t.user_attrs["gpu"]] += 1
            per_gpu_busy[t.user_attrs["gpu"]] += t.user_attrs.get("gpu_s") or 0.0
        keys = Counter(t.user_attrs.get("config_key") for t in measured)
        finished = [t for t in study.get_trials(deepcopy=False) if t.datetime_start and t.datetime_complete]
        span = max(t.datetime_complete for t in finished) - min(t.datetime_start for t in finished) if finished else None
        studies.append({
            "study": summary.study,
            "wall_s": round(span.total_seconds(), 1) if span else None,  # first trial asked to last one told
            "measured": len(measured),
            "trials": summary.trials,
            "outcomes": summary.outcomes,
            "trials_per_gpu": dict(Counter(t.user_attrs["gpu"] for t in measured)),
            "configs_measured_twice": [k for k, n in keys.items() if n > 1],
            "best_ms": summary.best_ms,
            "default_ms": summary.default_ms,
            "best_config": summary.best.params if summary.best else None,
        })  # fmt: skip
    return {
        "studies": studies,
        "trials": sum(s["trials"] for s in studies),
        "trials_per_gpu": dict(per_gpu_trials),
        "gpu_busy_s": {gpu: round(s, 1) for gpu, s in per_gpu_busy.items()},
        "configs_measured_twice": sum(len(s["configs_measured_twice"]) for s in studies),
    }


def resummarise(out: Path) -> int:
    """Rewrite ``OUT/multi_gpu_tune.json``'s per-run study summaries from the recorded studies (the run's environment,
    command, exit codes and wall times stay as recorded)."""
    path = out / "multi_gpu_tune.json"
    doc = json.loads(path.read_text())
    for run in doc["runs"]:
        db = out / f"workers{run['workers']}" / "study.db"
        run |= summarise(f"sqlite:///{db}")
    path.write_text(json.dumps(doc, indent=1, default=str))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--tile", default="all")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES)
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--run-timeout", type=int, default=280, help="seconds per run; a run cut short says so (rc timeout)")
    parser.add_argument("--cache-root", default="/tmp/multi-gpu-tune-cache")
    parser.add_argument("--summarise-only", action="store_true", help="re-read OUT's recorded studies, rewrite the summary")
    args = parser.parse_args()
    if args.summarise_only:
        return resummarise(Path(args.out))
    import torch

    from tiles.core.timing import describe_environment

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    n_gpus = torch.cuda.device_count()
    runs = [tune(out, n_gpus, args), tune(out, 1, args)]
    doc = {"environment": describe_environment(), "gpus": n_gpus, "runs": runs,
           "command": f"python3 tools/multi_gpu_tune.py OUT --tile {args.tile} --shapes {args.shapes} --trials {args.trials} "
                      f"--run-timeout {args.run_timeout}"}  # fmt: skip
    (out / "multi_gpu_tune.json").write_text(json.dumps(doc, indent=1, default=str))
    for r in runs:
        print(f"workers={r['workers']} rc={r['rc']} wall={r['wall_s']} s trials={r['trials']} per GPU={r['trials_per_gpu']} "
              f"busy={r['gpu_busy_s']} measured twice={r['configs_measured_twice']}")  # fmt: skip
    return 0 if all(r["rc"] == 0 for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
