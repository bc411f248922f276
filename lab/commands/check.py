"""`lab check`: every tile against the reference on the GPU present, or compile-only for any arch.

``lab check --compile-only --arch sm80,sm89,sm90,sm100`` compiles each registered tile's
default config (first shape, or ``--all-shapes``) for every arch in a process pool and
prints a tile x arch table of compile seconds. Without ``--compile-only`` the GPU's own arch
is checked for real (each shape, fresh inputs, bit-exact or tolerance compare, ``--repeats`` runs bitwise equal)
and the other listed archs are compiled. Exit status 1 when any cell fails. The cells are
:mod:`lab.matrix` functions, so other config sources add rows without touching this command.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from lab.cli import LabError
from lab.matrix import (
    SKIPPED,
    UNSUPPORTED,
    Cell,
    check_cell,
    lost_here,
    plan,
    regressions,
    run_compile,
    stored_compile_cells,
    stored_winner_cells,
)
from tiles.core.arch import ArchError, detect, get_arch
from tiles.core.contract import TileError
from tiles.core.gpu import present_gpu
from tiles.core.registry import select
from tiles.core.timing import describe_environment


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tile", default="all", help="'all' or comma-separated tile names")
    parser.add_argument("--arch", default="auto", help="comma-separated archs (sm80,sm89,sm90,sm100); 'auto' is the GPU present")
    parser.add_argument("--compile-only", action="store_true", help="only compile (works without a GPU)")
    parser.add_argument("--all-shapes", action="store_true", help="every shape of each tile, not just its first")
    parser.add_argument("--jobs", type=int, default=None, help="parallel compile processes (default: CPU count)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the check inputs")
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="launches of each GPU cell on its check inputs that must all give the same bits (default 2; a race that "
        "strikes one launch in ten needs 20 or more to show)",
    )
    parser.add_argument("--json", action="store_true", help="print the cells as JSON instead of a table")
    parser.add_argument(
        "--max-gib",
        type=float,
        default=None,
        help="skip GPU cells whose working set (inputs, rotating timing sets, the fp32 reference: ~8x the bytes a launch "
        "moves) would exceed this many GiB; for sharing one GPU between several checkers (pytest -n)",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=0.10,
        help="a stored winner more than this fraction slower than recorded (or than the default) regresses",
    )


def _archs(text: str, compile_only: bool):
    names = [p.strip() for p in text.split(",") if p.strip()]
    if not names:
        raise LabError("--arch is empty: name archs such as sm80,sm90 or use 'auto'")
    archs = []
    try:
        for name in names:
            archs.append(detect() if name == "auto" else get_arch(name))
    except ArchError as exc:
        raise LabError(str(exc)) from None
    return list(dict.fromkeys(archs))


def run(args: argparse.Namespace) -> int:
    try:
        tiles = select(args.tile)
    except TileError as exc:
        raise LabError(str(exc)) from None
    if not tiles:
        raise LabError(f"--tile {args.tile!r} names no tile")
    archs = _archs(args.arch, args.compile_only)
    if args.jobs is not None and args.jobs < 1:
        raise LabError(f"--jobs must be at least 1, got {args.jobs}")
    if args.repeats < 2:
        raise LabError(f"--repeats must be at least 2 (the first run and one to compare it with), got {args.repeats}")

    present = None
    if not args.compile_only:
        try:
            present = detect()
        except ArchError as exc:
            raise LabError(f"{exc} (add --compile-only to compile without a GPU)") from None

    gpu_cells: list[Cell] = []
    compile_cells: list[Cell] = []
    for cell in plan(tiles, archs, args.all_shapes):
        (gpu_cells if present is not None and cell.arch == present.name else compile_cells).append(cell)
    if present is not None:
        # every shape on the GPU present: that is the point of checking for real
        gpu_cells = plan(tiles, [present], all_shapes=True)

    try:  # what the stored winners of every GPU model ask for, compiled for the archs not checked on this GPU
        compile_cells += stored_compile_cells(tiles, [a for a in archs if present is None or a.name != present.name])
    except TileError as exc:  # a corrupt or foreign results file
        raise LabError(str(exc)) from None
    winner_cells: list[Cell] = []
    gpu = present_gpu()
    if present is not None:
        try:
            winner_cells = stored_winner_cells(tiles, present, gpu)
        except TileError as exc:  # a corrupt or foreign results file
            raise LabError(str(exc)) from None
        # every kernel the GPU part runs, compiled first in parallel into TileLang's disk cache (copies: the outcomes
        # that count are the checks'), so that the checks below load them instead of compiling one at a time
        run_compile([replace(c) for c in gpu_cells + winner_cells], args.jobs)

    progress = None if args.json else _progress
    done = run_compile(compile_cells, args.jobs, on_done=progress)
    for cell in gpu_cells:
        over = _over_budget(cell, args.max_gib)
        if over:
            cell.outcome, cell.message = SKIPPED, over
            done.append(cell)
            continue
        done.append(check_cell(cell, seed=args.seed, repeats=args.repeats))
        if progress:
            progress(done[-1])
    timed: list[Cell] = []
    for cell in winner_cells:
        timed.append(check_cell(cell, seed=args.seed, time_it=True, repeats=args.repeats))
        if progress:
            progress(timed[-1])
    regressed = regressions(timed, args.tolerance)

    if args.json:
        # the machine and versions with the cells, so that a saved JSON is a results file on its own (results/<arch>/)
        doc = {"command": args.invocation, "environment": describe_environment()}
        doc["cells"] = [c.to_dict() for c in done + timed]
        doc["regressions"] = [{"tile": c.tile, "shape": c.shape, "why": why} for c, why in regressed]
        doc["lost_here"] = [{"tile": t, "shape": s, "why": why} for (t, s), why in lost_here(timed, args.tolerance).items()]
        print(json.dumps(doc, indent=1))
    else:
        _print_table(done, [t.name for t in tiles], [a.name for a in archs])
        if timed:
            _print_winners(timed, regressed, gpu, lost_here(timed, args.tolerance))
    return 0 if all(c.ok for c in done) and not regressed else 1


def _print_winners(cells: list[Cell], regressed: list[tuple[Cell, str]], gpu: str | None, lost: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"stored winners vs defaults, timed now on {gpu}")
    for col in ("tile", "shape", "tuned ms", "recorded", "default ms", "recorded default", "speedup now", "verdict"):
        table.add_column(col)
    defaults = {(c.tile, c.shape): c for c in cells if c.label == "default"}
    bad = {(c.tile, c.shape): why for c, why in regressed}

    def ms(x):
        return "-" if x is None else f"{x:.4f}"

    for c in cells:
        if c.label != "tuned":
            continue
        d = defaults.get((c.tile, c.shape))
        now, dnow = c.extra.get("ms"), d.extra.get("ms") if d else None
        speed = f"{dnow / now:.2f}x" if now and dnow else "-"
        verdict = f"[red]regressed: {bad[(c.tile, c.shape)]}[/red]" if (c.tile, c.shape) in bad else "[green]ok[/green]"
        if c.extra.get("borrowed") and (c.tile, c.shape) not in bad:
            verdict = f"[yellow]no record for this GPU (tuned on {c.extra['borrowed']})[/yellow]"
            if (c.tile, c.shape) in lost:
                verdict = f"[yellow]tuned on {c.extra['borrowed']}, slower than the default here: tune this GPU[/yellow]"
        elif c.extra.get("stale") and (c.tile, c.shape) not in bad:
            verdict = f"[yellow]stale (predates {c.extra['stale']}): the default runs; re-tune[/yellow]"
        elif c.extra.get("unconfirmed") and (c.tile, c.shape) not in bad:
            verdict = f"[yellow]unconfirmed: a {c.extra['unconfirmed']} tie stored before the rematch rule; re-tune[/yellow]"
        table.add_row(
            c.tile, c.shape, ms(now), ms(c.extra.get("recorded_ms")), ms(dnow), ms(c.extra.get("recorded_default_ms")), speed, verdict
        )
    Console().print(table)


def _progress(cell: Cell) -> None:
    print(f"  {cell.tile} {cell.arch} {cell.shape}: {cell.outcome}", file=sys.stderr)


def _cell_text(cells: list[Cell]) -> str:
    from rich.markup import escape

    if not cells:
        return "-"
    if all(c.outcome == UNSUPPORTED for c in cells):
        return f"[dim]n/a: {escape(cells[0].message)}[/dim]"
    bad = [c for c in cells if not c.ok]
    mode = "checked" if cells[0].mode == "check" else "compiled"
    secs = sum(c.compile_s or 0.0 for c in cells)
    if bad:
        return f"[red]{len(bad)}/{len(cells)} {bad[0].outcome}[/red]"
    return f"[green]{mode}[/green] {secs:.1f}s" + (f" ({len(cells)} shapes)" if len(cells) > 1 else "")


WORKING_SET_FACTOR = 8  # GPU memory of a check relative to the bytes one launch moves (inputs, timing sets, reference)


def _over_budget(cell: Cell, max_gib: float | None) -> str | None:
    """Why ``cell`` is skipped under a ``--max-gib`` budget, or None."""
    if max_gib is None:
        return None
    from tiles.core.registry import get_tile

    tile = get_tile(cell.tile)
    shape = tile.shape(cell.shape)
    need = WORKING_SET_FACTOR * tile.bytes_moved(shape) / 2**30
    return f"~{need:.1f} GiB working set > --max-gib {max_gib:g}" if need > max_gib else None


def _print_table(cells: list[Cell], tile_names: list[str], arch_names: list[str]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="lab check: tile x arch (compile seconds)")
    table.add_column("tile", no_wrap=True)
    for a in arch_names:
        table.add_column(a)
    for t in tile_names:
        table.add_row(t, *[_cell_text([c for c in cells if c.tile == t and c.arch == a]) for a in arch_names])
    console = Console()
    console.print(table)
    for c in cells:
        if not c.ok:
            console.print(f"[red]{c.tile} {c.arch} {c.shape} ({c.label}): {c.outcome}[/red] {escape(c.message)}", highlight=False)
        elif c.outcome == SKIPPED:
            console.print(f"[yellow]{c.tile} {c.arch} {c.shape}: skipped[/yellow] {escape(c.message)}", highlight=False)
    n_bad = sum(not c.ok for c in cells)
    console.print(f"{len(cells) - n_bad} of {len(cells)} cells ok" + (f", {n_bad} failed" if n_bad else ""))
