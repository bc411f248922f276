"""Writes a tuning run's winners to ``results/<arch>/tuned/<gpu>/<tile>.yaml`` (the file :mod:`tiles.core.config_store` reads).

Buckets of shapes not tuned in this run are kept; a bucket tuned again is replaced. Writers of one folder take turns
(:func:`locked`: two runs exporting to one file both keep their shapes). The file is written to a temporary file in
the same directory, with the mode a plain ``open`` would give it, and moved over the old one with ``os.replace``, so
a reader sees the old file or the new one, never half of one. An existing file that cannot be read is moved aside
(``<name>.corrupt-<time>``, kept for its owner) rather than silently replaced.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import yaml

from tiles.core.arch import Arch
from tiles.core.config_store import SCHEMA, ResultsError, read_results, results_path
from tiles.core.contract import Tile
from tiles.core.timing import describe_environment


@contextlib.contextmanager
def locked(folder: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``folder`` (created if missing) for a read-merge-write of a file in it: writers in
    other processes wait. A lock on the folder itself, so no lock file is left among the results."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _file_mode(path: Path) -> int:
    """The mode ``path`` has, or the one a new file gets under the process's umask."""
    try:
        return path.stat().st_mode & 0o777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def move_aside(path: Path, why: str) -> Path:
    """Keep an unreadable file as ``<name>.corrupt-<UTC time>`` beside it, and say so on stderr; returns the new path."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    kept = path.with_name(f"{path.name}.corrupt-{stamp}")
    os.replace(path, kept)
    print(f"warning: {path} could not be read ({why}); kept as {kept}, a new file is written", file=sys.stderr)
    return kept


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = _file_mode(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode)  # mkstemp makes 0600 files: results are for everyone who reads the tree
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _round(x: float | None, digits: int = 5) -> float | None:
    return None if x is None else float(f"{x:.{digits}g}")


def export_results(
    tile: Tile, arch: Arch, summaries: list, command: str, root: Path | None = None, environment: dict | None = None
) -> Path:
    """Merge this run's winners (``tuning.study.StudySummary`` list) into the tile's results file of the GPU model
    they were measured on (``environment["gpu"]``; the other models' files are left alone); returns its path."""
    env = environment if environment is not None else describe_environment()
    path = results_path(tile.name, arch, env.get("gpu"), root)
    with locked(path.parent):
        try:
            old = read_results(path, tile.name, arch)
        except ResultsError as exc:  # this run's winners are not lost to a bad file, nor is the file lost
            move_aside(path, str(exc))
            old = None
        _write(tile, arch, summaries, command, env, path, old)
    return path


def _write(tile: Tile, arch: Arch, summaries: list, command: str, env: dict, path: Path, old: dict | None) -> None:
    """Merge ``summaries`` over the ``old`` file's buckets and write ``path`` (under the folder's lock)."""
    shapes = dict(old["shapes"]) if old else {}
    if old:
        # entries kept from an earlier run keep that run's date and command (the file-level block is this run's)
        for entry in shapes.values():
            entry.setdefault("date", old.get("environment", {}).get("date"))
            entry.setdefault("command", old.get("environment", {}).get("command"))
    for s in summaries:
        if s.best is None:
            continue
        shape = tile.shape(s.shape)
        shapes[s.shape] = {
            "phase": shape.phase,
            "dims": dict(shape.dims),
            "config": {k: s.best.params[k] for k in sorted(s.best.params)},
            "ms": _round(s.best_ms),
            "tflops": _round(s.best.user_attrs.get("tflops"), 4),
            "gbps": _round(s.best.user_attrs.get("gbps"), 4),
            "default_ms": _round(s.default_ms),
            "default_config": {k: s.default[k] for k in sorted(s.default)} if s.default is not None else None,
            "speedup": _round(s.speedup, 4),
            "trials": s.trials,
            "outcomes": dict(sorted(s.outcomes.items())),
            "study": s.study,
            "date": env.get("date"),
            "command": command,
        }
        if getattr(s, "rematch", None) is not None:  # the winner timed again against the default (tuning.rematch)
            shapes[s.shape]["rematch"] = s.rematch
    # Plain scalars only: version objects (torch's TorchVersion) are str subclasses yaml.safe_dump refuses.
    env = {k: v if v is None or type(v) in (int, float, bool) else str(v) for k, v in env.items()}
    env["arch"] = arch.name
    env["command"] = command
    data = {"schema": SCHEMA, "tile": tile.name, "arch": arch.name, "environment": env, "shapes": dict(sorted(shapes.items()))}
    write_atomic(path, yaml.safe_dump(data, sort_keys=False, width=140))
