"""The tile x arch x shape x config matrix behind ``lab check``: one function per cell, run in a process pool.

A *cell* is one (tile, arch, shape, config label). :func:`compile_cell` compiles it on any
machine (nvcc needs no GPU); :func:`check_cell` also runs it against the torch reference
on the GPU that is present. Cells carry a ``label`` ("default" today) so another source of
configs (stored tuned winners, say) adds rows to the same matrix without changing it.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field

from tiles.core.arch import Arch, get_arch
from tiles.core.contract import Config, Tile
from tiles.core.harness import COMPILE_ERROR, OK, compile_tile, evaluate
from tiles.core.registry import get_tile

UNSUPPORTED = "unsupported"
SKIPPED = "skipped"  # over the --max-gib memory budget: not run, not a failure, listed


@dataclass
class Cell:
    """What one cell asks for and what came out; ``outcome`` is a tiles.core.harness outcome kind or ``unsupported``."""

    tile: str
    arch: str
    shape: str
    label: str = "default"
    config: Config | None = None  # None: the tile's default config for the arch
    mode: str = "compile"  # "compile" or "check"
    outcome: str = ""
    compile_s: float | None = None
    error: float | None = None
    message: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.outcome in (OK, UNSUPPORTED, SKIPPED)

    def to_dict(self) -> dict:
        return asdict(self)


def _resolve(cell: Cell) -> tuple[Tile, Arch, Config, object]:
    tile, arch = get_tile(cell.tile), get_arch(cell.arch)
    shape = tile.shape(cell.shape)
    return tile, arch, tile.with_defaults(arch, cell.config or {}), shape


def compile_cell(cell: Cell) -> Cell:
    """Compile one cell for its arch (no GPU needed); never raises for a tile's failure."""
    try:
        tile, arch, config, shape = _resolve(cell)
        cell.config = config
        why = tile.support_reason(arch)
        if why:
            cell.outcome, cell.message = UNSUPPORTED, why
            return cell
        _, ev = compile_tile(tile, shape, config, arch)
    except Exception as exc:  # noqa: BLE001 -- a tile that cannot even describe itself is that cell's error, not the matrix's
        cell.outcome, cell.message = COMPILE_ERROR, f"{type(exc).__name__}: {exc}"
        return cell
    cell.outcome, cell.compile_s, cell.message = ev.outcome, ev.compile_s, ev.message
    return cell


def check_cell(cell: Cell, seed: int = 0, time_it: bool = False, repeats: int = 2) -> Cell:
    """Compile one cell and run it against the reference on the present GPU (fresh inputs, ``repeats`` runs that must
    give the same bits).

    With ``time_it`` the cell is also timed (``extra["ms"]``), for the regression check of
    stored winners.
    """
    try:
        tile, arch, config, shape = _resolve(cell)
        cell.config, cell.mode = config, "check"
        why = tile.support_reason(arch)
        if why:
            cell.outcome, cell.message = UNSUPPORTED, why
            return cell
        ev = evaluate(tile, shape, config, arch, seed=seed, time_it=time_it, repeats=repeats)
    except Exception as exc:  # noqa: BLE001 -- e.g. out of memory while making inputs: that cell fails, the rest still run
        cell.outcome, cell.message = "runtime_fault", f"{type(exc).__name__}: {exc}"
        return cell
    cell.outcome, cell.compile_s, cell.error, cell.message = ev.outcome, ev.compile_s, ev.error, ev.message
    if ev.ms is not None:
        cell.extra["ms"] = ev.ms
    return cell


def stored_winner_cells(tiles: Iterable[Tile], arch: Arch, gpu: str | None, root=None) -> list[Cell]:
    """For every shape with a stored winner that would run on GPU model ``gpu`` (``results/<arch>/tuned/<gpu>/<tile>.yaml``,
    else the nearest model's: :func:`tiles.core.config_store.candidate_files`): a ``tuned`` cell with the winner and a
    ``default`` cell, both to be checked and timed. Cells of ``gpu``'s own winners carry the latencies recorded on that
    model; a winner borrowed from another model carries ``extra["borrowed"]`` (its slug) and no record to compare with."""
    from tiles.core.config_store import candidate_files, read_results, stale_params
    from tiles.core.gpu import gpu_slug

    cells = []
    for tile in tiles:
        known = {s.name for s in tile.shapes()}
        seen: set[str] = set()
        for slug, path in candidate_files(tile.name, arch, gpu, root):
            stored = read_results(path, tile.name, arch)
            for shape_name, entry in sorted(stored["shapes"].items()):
                if shape_name not in known or shape_name in seen:
                    continue
                seen.add(shape_name)
                if gpu is not None and slug == gpu_slug(gpu):
                    recorded = {"recorded_ms": entry.get("ms"), "recorded_default_ms": entry.get("default_ms")}
                else:  # latencies recorded on another model say nothing about this one
                    recorded = {"borrowed": slug}
                missing = stale_params(tile, arch, entry["config"], entry.get("default_config"))
                if missing:  # tuned before these options existed: run time uses the default (tiles.core.config_store.load_winner)
                    recorded["stale"] = ", ".join(missing)
                tie = _unconfirmed_tie(entry)
                if tie:
                    recorded["unconfirmed"] = tie
                cells.append(Cell(tile.name, arch.name, shape_name, "tuned", dict(entry["config"]), extra=dict(recorded)))
                cells.append(Cell(tile.name, arch.name, shape_name, "default", None, extra=dict(recorded)))
    return cells


def stored_compile_cells(tiles: Iterable[Tile], archs: Iterable[Arch], root=None) -> list[Cell]:
    """A compile cell (label ``tuned:<gpu>``) for every stored winner of every GPU model of each arch that would run
    (not stale): ``lab check --compile-only`` builds what the tuned configs ask for, not only the defaults. A corrupt
    results file raises :class:`tiles.core.config_store.ResultsError` naming it."""
    from tiles.core.config_store import candidate_files, read_results, stale_params

    cells = []
    for tile in tiles:
        known = {s.name for s in tile.shapes()}
        for arch in archs:
            for slug, path in candidate_files(tile.name, arch, None, root):
                for shape_name, entry in sorted(read_results(path, tile.name, arch)["shapes"].items()):
                    if shape_name in known and not stale_params(tile, arch, entry["config"], entry.get("default_config")):
                        cells.append(Cell(tile.name, arch.name, shape_name, f"tuned:{slug}", dict(entry["config"])))
    return cells


def _unconfirmed_tie(entry: dict) -> str | None:
    """For a stored winner (not the default) that no rematch confirmed and whose own record puts it less than
    tuning.rematch.REMATCH_MARGIN ahead of the default: its recorded speedup ("1.003x"), else None. Such entries were
    stored before the rematch rule (a00e7a1); a tune now would keep the default."""
    from tuning.rematch import clears_margin  # imported here: lab.matrix loads without the tuner's modules

    ms, default_ms = entry.get("ms"), entry.get("default_ms")
    if "rematch" in entry or not ms or not default_ms or entry.get("config") == entry.get("default_config"):
        return None
    speedup = default_ms / ms
    return None if clears_margin(speedup) else f"{speedup:.3f}x"


# A latency difference this small is within the run-to-run spread of the smallest kernels, whatever the fraction: the
# ~2 us fp4_quant_main winners were 15% slower at B=64 and 12% faster at B=128 than their records in a lab check on
# the H200 (18b181d), their default 5% slower and 4% faster.
REGRESSION_FLOOR_MS = 0.0005


def _slower(ms: float, than: float, tolerance: float) -> bool:
    """``ms`` is slower than ``than`` by more than ``tolerance`` and by more than :data:`REGRESSION_FLOOR_MS`."""
    return ms > than * (1 + tolerance) and ms - than > REGRESSION_FLOOR_MS


def regressions(cells: list[Cell], tolerance: float = 0.10) -> list[tuple[Cell, str]]:
    """What regressed among timed stored-winner cells.

    A tuned cell regresses when it fails its check, when it runs more than ``tolerance``
    slower than its latency recorded on this GPU model, or more than ``tolerance`` slower than the default
    measured in the same run (the winner is then no longer a winner); in both cases by more
    than :data:`REGRESSION_FLOOR_MS` as well. A winner borrowed from another model (``extra["borrowed"]``) regresses
    only by failing its check: that it loses to the default here is a reason to tune this model (:func:`lost_here`),
    not a regression of a record.
    """
    out = []
    defaults = {(c.tile, c.shape): c for c in cells if c.label == "default" and "ms" in c.extra}
    for c in cells:
        if c.label != "tuned":
            continue
        if not c.ok:
            if c.extra.get("stale") and c.outcome == "invalid":
                continue  # tuned before the space changed shape; it no longer runs (tiles.core.config_store.load_winner)
            out.append((c, f"{c.outcome}: {c.message}"))
            continue
        ms, recorded = c.extra.get("ms"), c.extra.get("recorded_ms")
        if ms is not None and recorded and _slower(ms, recorded, tolerance):
            out.append((c, f"{ms:.4f} ms vs {recorded:.4f} ms recorded ({ms / recorded:.2f}x slower)"))
        dflt = defaults.get((c.tile, c.shape))
        if c.extra.get("stale") or c.extra.get("borrowed"):
            continue  # a stale winner no longer runs; a borrowed one was never timed against this GPU's default
        if ms is not None and dflt is not None and _slower(ms, dflt.extra["ms"], tolerance):
            out.append((c, f"{ms:.4f} ms vs the default's {dflt.extra['ms']:.4f} ms now: the stored winner lost"))
    return out


def lost_here(cells: list[Cell], tolerance: float = 0.10) -> dict[tuple[str, str], str]:
    """Borrowed winners (tuned on another GPU model) that run more than ``tolerance`` slower than the default timed in
    the same run: ``{(tile, shape): why}``."""
    defaults = {(c.tile, c.shape): c for c in cells if c.label == "default" and "ms" in c.extra}
    out = {}
    for c in cells:
        d = defaults.get((c.tile, c.shape))
        if c.label == "tuned" and c.extra.get("borrowed") and "ms" in c.extra and d and _slower(c.extra["ms"], d.extra["ms"], tolerance):
            out[(c.tile, c.shape)] = f"{c.extra['ms']:.4f} ms vs the default's {d.extra['ms']:.4f} ms here"
    return out


def plan(tiles: Iterable[Tile], archs: Iterable[Arch], all_shapes: bool = False, label: str = "default") -> list[Cell]:
    """Every (tile, arch, shape) cell: each tile's first shape, or all of them."""
    archs = list(archs)
    cells = []
    for tile in tiles:
        shapes = tile.shapes() if all_shapes else tile.shapes()[:1]
        cells += [Cell(tile.name, arch.name, s.name, label) for arch in archs for s in shapes]
    return cells


def _compile_worker_init() -> None:
    """A spawned compile worker starts with TileLang's own logging, which writes to stdout; send it to stderr as the
    parent does (lab.cli.tilelang_logs_to_stderr), so that a ``--json`` document on stdout stays one document."""
    from lab.cli import tilelang_logs_to_stderr

    tilelang_logs_to_stderr()


def run_compile(cells: list[Cell], jobs: int | None = None, on_done: Callable[[Cell], None] | None = None) -> list[Cell]:
    """Compile cells in parallel (spawned processes: TileLang and CUDA state never cross a fork); keeps the input order."""
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(cells) or 1))
    if jobs == 1:
        done = []
        for c in cells:
            done.append(compile_cell(c))
            if on_done:
                on_done(done[-1])
        return done
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=spawn, initializer=_compile_worker_init) as pool:
        futures = [pool.submit(compile_cell, c) for c in cells]
        results = []
        for f in futures:
            results.append(f.result())
            if on_done:
                on_done(results[-1])
        return results
