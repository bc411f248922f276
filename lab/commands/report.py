"""`lab report`: regenerate the reports of every ``results/<arch>/`` from the data stored there (lab.results_store)."""

from __future__ import annotations

import argparse
from pathlib import Path

from lab.cli import LabError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--results", default=None, help="the results directory (default: the lab's results/)")


def _render(arch_dir: Path) -> tuple[dict[str, str], list]:
    """The bench and tuning reports of one ``results/<arch>/`` rendered, and its e2e documents read (nothing written)."""
    from lab.e2e.report import load
    from lab.summaries import bench_markdown, tuning_markdown

    reports = {}
    bench = sorted(arch_dir.glob("bench/*.json"))
    if bench:
        reports["bench.md"] = bench_markdown(bench)
    tuned = sorted(arch_dir.glob("tuned/*/*.yaml"))
    if tuned:
        reports["tuning.md"] = tuning_markdown(tuned)
    try:
        documents = [(path, load(path)) for path in sorted(arch_dir.glob("e2e/*.json"))]
    except ValueError as exc:
        raise LabError(str(exc)) from None
    return reports, documents


def run(args: argparse.Namespace) -> int:
    from lab.e2e.report import render_plots, results_markdown
    from lab.results_store import e2e_plot_prefix, unaccounted
    from tiles.core.config_store import results_dir
    from tuning.export import write_atomic

    root = Path(args.results) if args.results else results_dir()
    if not root.is_dir():
        raise LabError(f"{root} is not a directory: pass --results DIR")
    # every input of every arch read and rendered before any report is written: a bad file leaves all reports in place
    rendered = [(arch_dir, _render(arch_dir)) for arch_dir in sorted(p for p in root.iterdir() if p.is_dir())]
    for arch_dir, (reports, documents) in rendered:
        # the plots before e2e.md, which links the ones that exist
        for path, doc in documents:
            render_plots(doc, path.parent, prefix=e2e_plot_prefix(path))
        if documents:
            reports["e2e.md"] = results_markdown([path for path, _ in documents])
        for name, text in reports.items():
            write_atomic(arch_dir / name, text)
        print(f"{arch_dir}: {', '.join(reports) or 'nothing to render'}")
    extra = unaccounted(root)
    if extra:
        listing = "".join(f"\n  {p}" for p in extra[:20]) + (f"\n  ... {len(extra) - 20} more" if len(extra) > 20 else "")
        print(
            f"{len(extra)} file(s) under {root} that no report renders and no run reads (results/ holds reports and their data only):{listing}"
        )
    return 0
