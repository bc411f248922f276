"""`lab tune`: autotune tiles for a GPU architecture with Optuna (see :mod:`tuning`).

lab tune --arch auto --tile all --trials 40              # tune on the GPU present, write results/<arch>/<tile>.yaml
lab tune --arch sm100 --tile NAME --compile-only         # compile a search space for another arch, no GPU needed
lab tune --arch sm90 --tile all --compile-only --trials 20   # at most 20 configs of each space
lab tune --arch sm90 --storage postgresql://... --workers 8   # share one study across GPUs and hosts
lab tune --replay TILE:sm90:SHAPE                        # how fast would each sampler have found the winner
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from lab.cli import LabError, non_negative_int, positive_int, positive_seconds
from tiles.core.arch import ARCHS  # torch-free: the parser stays light (lab.cli.CommandParser)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", default="auto", help=f"auto (detect the GPU) or one of {', '.join(ARCHS)}")
    parser.add_argument("--tile", default="all", help="tile name, comma-separated names, or all")
    parser.add_argument("--shapes", default="all", help="decode, prefill, all, or comma-separated shape names")
    parser.add_argument(
        "--trials",
        type=positive_int,
        default=None,
        metavar="N",
        help="configs measured per (tile, shape) study, counting earlier runs (default 40; proposals a constraint refuses "
        "and repeats answered from the record are free; a study with fewer valid configs measures them all). With "
        "--compile-only: configs compiled per study (default: every config of the space, or 40 sampled from one too "
        "large to compile whole)",
    )
    parser.add_argument("--timeout", type=positive_seconds, default=None, metavar="S", help="wall-clock budget per study in seconds")
    parser.add_argument(
        "--trial-timeout", type=positive_seconds, default=120.0, metavar="S", help="one GPU evaluation; a hang past it is killed"
    )
    parser.add_argument("--compile-timeout", type=positive_seconds, default=300.0, metavar="S", help="one compile in the pool")
    parser.add_argument(
        "--storage",
        default=None,
        metavar="URL",
        help="Optuna storage (default: results/tuning.db): sqlite:///PATH, postgresql://USER:PASSWORD@HOST/DB, "
        "mysql://USER:PASSWORD@HOST/DB or journal:PATH (passwords are masked wherever the URL is shown or recorded)",
    )
    parser.add_argument("--workers", type=positive_int, default=1, metavar="N", help="GPU workers, one per local GPU")
    parser.add_argument(
        "--compile-jobs", type=positive_int, default=os.cpu_count() or 1, metavar="N", help="compile pool size (default: all cores)"
    )
    parser.add_argument(
        "--compile-only",
        action="store_true",
        help="compile the search space (every config, or --trials of them) for --arch; no GPU, no timing",
    )
    parser.add_argument("--replay", default=None, metavar="STUDY", help="replay samplers offline against a recorded study")
    parser.add_argument("--seed", type=int, default=0, help="sampler seed")
    parser.add_argument(
        "--rematch",
        type=non_negative_int,
        default=3,
        metavar="N",
        help="a study's winner that is not the default is timed against the default N more times each, alternating, and "
        "kept only if it is faster in every round and its median at least 1%% faster (0: store the study's best as it is)",
    )
    parser.add_argument("--results", type=Path, default=None, metavar="DIR", help="results directory (default: results/)")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from tiles.core.arch import ArchError, resolve
    from tiles.core.contract import TileError
    from tiles.core.registry import select
    from tuning.progress import TuneProgress
    from tuning.study import TuneError, TuneOptions, tune

    console = Console()
    try:
        if args.replay:
            return _replay(args, console)
        arch = resolve(args.arch)
        tiles = select(args.tile)
        if not tiles:
            raise LabError("no tiles are registered yet: nothing to tune")
        opts = TuneOptions(
            arch=arch,
            trials=args.trials,
            timeout_s=args.timeout,
            trial_timeout_s=args.trial_timeout,
            compile_timeout_s=args.compile_timeout,
            storage=args.storage,
            workers=args.workers,
            compile_jobs=args.compile_jobs,
            compile_only=args.compile_only,
            seed=args.seed,
            rematch_rounds=args.rematch,
            results_root=args.results,
            command=args.invocation,
        )
        with TuneProgress() as progress:
            summaries = tune(tiles, opts, args.shapes, progress)
        console.print(progress.final_table(summaries))
    except (ArchError, TileError, TuneError) as exc:
        raise LabError(str(exc)) from None
    return 0


def _replay(args: argparse.Namespace, console) -> int:
    from rich.table import Table

    from tuning.replay import replay

    report = replay(args.storage, args.replay)
    table = Table(title=f"replay {report.study}: {report.recorded} recorded configs, best {report.best_ms:.4g} ms, budget {report.budget}")
    for col in ("sampler", f"trials to within {report.within:.0%} (mean)", "seeds reached", "note"):
        table.add_column(col)
    for r in report.results:
        mean = f"{r.mean:.1f}" if r.mean is not None else "-"
        table.add_row(r.sampler, mean, f"{r.reached}/{len(r.needed)}" if r.needed else "-", r.note)
    console.print(table)
    return 0
