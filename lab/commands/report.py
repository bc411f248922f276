"""`lab report`: regenerate markdown and plots from what is stored under results/."""

from __future__ import annotations

import argparse
from pathlib import Path

from lab.cli import LabError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--results", default=None, help="the results directory (default: the lab's results/)")


def run(args: argparse.Namespace) -> int:
    from lab.e2e.report import load, render_markdown, render_plots
    from lab.summaries import bench_markdown, tuning_markdown
    from tiles.results import results_dir
    from tuning.export import write_atomic

    root = Path(args.results) if args.results else results_dir()
    if not root.is_dir():
        raise LabError(f"{root} is not a directory: pass --results DIR")
    for arch_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        bench = sorted(arch_dir.glob("bench/*.json"))
        if bench:
            write_atomic(arch_dir / "bench.md", bench_markdown(bench))
            print(f"{arch_dir}: bench.md from {len(bench)} bench documents")
        tuned = sorted(arch_dir.glob("*.yaml"))
        if tuned:
            write_atomic(arch_dir / "tuning.md", tuning_markdown(tuned))
            print(f"{arch_dir}: tuning.md from {len(tuned)} tuned-config files")
    found = sorted(root.glob("**/e2e.json"))
    if not found:
        print(f"no e2e results under {root}/ (run `lab e2e` on a GPU first)")
        return 0
    for path in found:
        try:
            doc = load(path)
        except ValueError as exc:
            raise LabError(str(exc)) from None
        write_atomic(path.with_suffix(".md"), render_markdown(doc))
        plots = render_plots(doc, path.parent)
        print(f"{path.parent}: e2e.md" + "".join(f", {p.name}" for p in plots))
    return 0
