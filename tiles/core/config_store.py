"""Tuned configs as data: ``results/<arch>/tuned/<gpu>/<tile>.yaml``, read at run time.

A results file holds, per shape bucket, the winning config of a tuning run on one GPU model with its latency, the
default's latency, the speedup, the trials run, and the environment that produced it (written by :mod:`tuning.export`).
Winners are kept per GPU model within an arch (:mod:`tiles.core.gpu`): an H100 and an H200 are both sm90, and a
tuning run on one leaves the other's file alone. :func:`load_winner` takes the GPU present's file, else the nearest
model's of the same arch (:func:`tiles.core.gpu.nearest_order`), picks the bucket nearest to the shape asked for
(:meth:`tiles.core.contract.Shape.distance`), and falls back to the tile's default config when no file has a
comparable bucket; it says which one it used. A file that does not parse, or that belongs to another tile, arch or
schema, raises :class:`ResultsError` naming the file.

Where the files are (:func:`tuned_roots`): ``$CSA2_RESULTS_DIR`` alone when set (an explicit tree replaces the
others, so tests and other checkouts see only their own files), else ``results/`` of the source tree the lab runs
from, and for an installed package (``pip install .``) the configs it ships (package ``csa2_lab_results``).
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path
from typing import Any

import yaml

from tiles.core.arch import Arch, get_arch
from tiles.core.contract import Config, Shape, TileError
from tiles.core.gpu import gpu_slug, nearest_order

SCHEMA = "csa2-lab/tuned-configs/v1"
RESULTS_DIR = Path(__file__).resolve().parents[2] / "results"
PACKAGED = "csa2_lab_results"  # the wheel's copy of results/<arch>/tuned/ (setup.py maps it onto results/)


class ResultsError(TileError):
    """A results file that cannot be used: corrupt, foreign, or not matching the tile's search space."""


def results_dir() -> Path:
    """The results tree the lab reads and writes: ``$CSA2_RESULTS_DIR`` when set (tests, other checkouts), else
    ``results/`` of the source tree the lab runs from, else (an installed package) ``./results``."""
    if "CSA2_RESULTS_DIR" in os.environ:
        return Path(os.environ["CSA2_RESULTS_DIR"])
    return RESULTS_DIR if RESULTS_DIR.is_dir() else Path.cwd() / "results"


def packaged_dir() -> Path | None:
    """The tuned configs an installed package ships (a results tree holding ``<arch>/tuned/``), or None."""
    spec = importlib.util.find_spec(PACKAGED)
    locations = list(spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]) if locations else None


def tuned_roots(root: Path | None = None) -> list[Path]:
    """The results trees searched for tuned configs, first first: ``root`` alone when given, ``$CSA2_RESULTS_DIR``
    alone when set, else :func:`results_dir` and the packaged configs (when installed and not the same tree)."""
    if root is not None:
        return [Path(root)]
    if "CSA2_RESULTS_DIR" in os.environ:
        return [results_dir()]
    roots = [results_dir()]
    shipped = packaged_dir()
    if shipped is not None and shipped.resolve() != roots[0].resolve():
        roots.append(shipped)
    return roots


def results_path(tile_name: str, arch: Arch | str, gpu: str, root: Path | None = None) -> Path:
    """``<root>/<arch>/tuned/<gpu slug>/<tile>.yaml``; ``gpu`` a model name or its slug (``"NVIDIA H200"``, ``"h200"``)."""
    arch = get_arch(arch) if isinstance(arch, str) else arch
    return (root or results_dir()) / arch.name / "tuned" / gpu_slug(gpu) / f"{tile_name}.yaml"


def tuned_gpus(arch: Arch | str, root: Path | None = None) -> list[str]:
    """The GPU slugs with a tuned-config folder for ``arch`` under ``root`` (default :func:`results_dir`), by name."""
    arch = get_arch(arch) if isinstance(arch, str) else arch
    folder = (root or results_dir()) / arch.name / "tuned"
    return sorted(p.name for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []


def candidate_files(tile_name: str, arch: Arch, gpu: str | None, root: Path | None = None) -> list[tuple[str, Path]]:
    """``(gpu slug, path)`` of every existing results file of ``tile_name`` on ``arch``, in the order their winners
    are tried for ``gpu`` (:func:`tiles.core.gpu.nearest_order`; a root listed earlier wins a tie of the same GPU)."""
    found = []
    for tree in tuned_roots(root):
        for slug in tuned_gpus(arch, tree):
            path = results_path(tile_name, arch, slug, tree)
            if path.is_file():
                found.append((slug, path))
    order = nearest_order(gpu_slug(gpu) if gpu else None, list(dict.fromkeys(slug for slug, _ in found)))
    return sorted(found, key=lambda hit: order.index(hit[0]))


_CACHE: dict[Path, tuple[float, dict]] = {}


def read_results(path: Path, tile_name: str, arch: Arch | str) -> dict | None:
    """The parsed, validated file, or None when it does not exist. Cached by modification time."""
    arch = get_arch(arch) if isinstance(arch, str) else arch
    try:
        mtime = path.stat().st_mtime_ns
    except FileNotFoundError:
        return None
    hit = _CACHE.get(path)
    if hit and hit[0] == mtime:
        return hit[1]
    try:
        data = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ResultsError(f"results file {path} is corrupt ({type(exc).__name__}): delete it or re-run `lab tune`") from None
    if not isinstance(data, dict):
        raise ResultsError(
            f"results file {path} is corrupt (expected a mapping, got {type(data).__name__}): delete it or re-run `lab tune`"
        )
    if data.get("schema") != SCHEMA:
        raise ResultsError(f"results file {path} has schema {data.get('schema')!r}, expected {SCHEMA!r}: re-run `lab tune`")
    if data.get("tile") != tile_name or data.get("arch") != arch.name:
        raise ResultsError(
            f"results file {path} is for tile {data.get('tile')!r} on {data.get('arch')!r}, not {tile_name!r} on {arch.name!r}: "
            "it is misplaced or foreign"
        )
    shapes = data.get("shapes")
    if not isinstance(shapes, dict) or not all(isinstance(e, dict) and isinstance(e.get("config"), dict) for e in shapes.values()):
        raise ResultsError(f"results file {path} is corrupt (every entry under 'shapes' needs a 'config' mapping): re-run `lab tune`")
    tile = _registered(tile_name)
    for bucket, entry in shapes.items():
        why = entry_problem(entry, tile, arch)
        if why:
            raise ResultsError(f"results file {path}: shapes.{bucket}.{why}: fix or delete the entry, or re-run `lab tune`")
    _CACHE[path] = (mtime, data)
    return data


_NUMBERS = ("ms", "default_ms", "speedup", "tflops", "gbps")


def entry_problem(entry: dict, tile, arch: Arch) -> str | None:
    """What is wrong with one stored bucket, as ``"<key>: <why>"`` under it, or None: its config names only parameters
    of the tile's search space with values among their choices (unregistered tiles: not checked), its latencies are
    positive numbers (or null), its dims whole numbers."""
    if tile is not None:
        params = {p.name: p for p in tile.search_space(arch).params}
        for key, value in entry["config"].items():
            if key not in params:
                return f"config.{key}: not a parameter of {tile.name} (its parameters: {', '.join(sorted(params))})"
            if not any(type(value) is type(choice) and value == choice for choice in params[key].choices):
                return f"config.{key}: {value!r} is not one of {list(params[key].choices)}"
    for key in _NUMBERS:
        value = entry.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or not value > 0):
            return f"{key}: {value!r} is not a positive number"
    dims = entry.get("dims", {})
    if not isinstance(dims, dict) or not all(isinstance(k, str) and type(v) is int for k, v in dims.items()):
        return f"dims: {dims!r} is not a mapping of names to whole numbers"
    return None


# A winner transfers to shapes within a factor of 4 in all dims together (sum of |log2 ratio|).
# Further away it is not evidence: on the H200 the B=64 attention winner ran 1.8x slower than
# the default at B=1 (fb47ce4), and a config tuned on 64 rows says little about 1M.
MAX_TRANSFER_DISTANCE = 2.0


def nearest_entry(data: dict, shape: Shape, max_distance: float = MAX_TRANSFER_DISTANCE) -> tuple[str, dict] | None:
    """The stored bucket nearest to ``shape`` (same dims, smallest log distance, at most ``max_distance``), or None."""
    best, best_d = None, math.inf
    for name, entry in sorted(data["shapes"].items()):
        dims = entry.get("dims") or {}
        d = 0.0 if name == shape.name else shape.distance(Shape(name, entry.get("phase", "any"), dims))
        if d < best_d and d <= max_distance:
            best, best_d = (name, entry), d
    return best


_NOT_CHECKED = object()
CURRENT_DEFAULT = "the current default"  # what a winner timed against another default config predates


def stale_params(tile, arch: Arch, config: Config, tuned_default: Any = _NOT_CHECKED) -> list[str]:
    """The parameters of ``tile``'s current search space that a stored ``config`` does not name: a winner
    tuned before they existed, which won nothing over them (empty when the config is current).

    ``tuned_default``: the default config the winner was timed against (a results entry's ``default_config``;
    None for entries written before it was recorded). Unless it is the tile's current default, the list also
    holds :data:`CURRENT_DEFAULT`: the winner never ran against the default it would replace."""
    stale = sorted(set(tile.search_space(arch).names()) - set(config))
    if tuned_default is not _NOT_CHECKED and tuned_default != tile.default_config(arch):
        stale.append(CURRENT_DEFAULT)
    return stale


def _registered(tile_name: str):
    """The registered tile of that name, or None (tests use unregistered toy tiles)."""
    from tiles.core.registry import get_tile

    try:
        return get_tile(tile_name)
    except TileError:
        return None


def _shown(path: Path) -> str:
    """``path`` relative to its results tree's parent when it is in the lab's own ``results/`` or the packaged configs
    (sources land in JSON reports, which should not carry one machine's checkout path), else as given."""
    for tree in (RESULTS_DIR, packaged_dir()):
        if tree is not None:
            try:
                return str(path.relative_to(tree.parent))
            except ValueError:
                pass
    return str(path)


def load_winner(
    tile_name: str,
    arch: Arch | str,
    shape: Shape,
    default: Config | None = None,
    root: Path | None = None,
    allow_stale: bool = False,
    tile=None,
    gpu: str | None = None,
) -> tuple[Config, str]:
    """The config to run ``tile_name`` with on (arch, GPU model, shape), and where it came from.

    ``gpu``: the model name of the GPU the call runs on (``torch.cuda.get_device_name``); its own winners are tried
    first, then those of the nearest model of the arch (:func:`candidate_files`); None tries every model by name.
    Returns ``(config, "tuned:<file>#<bucket>")`` (``<file>`` repo-relative for the lab's own ``results/``, and
    ``" (nearest GPU: <slug>)"`` appended when the winner was tuned on another model than ``gpu``) for the first file
    with a bucket within :data:`MAX_TRANSFER_DISTANCE`, else ``(default, "default")``. ``default`` is the tile's
    default config for ``arch``; when not given it is looked up through :mod:`tiles.core.registry`. A stored config
    that the tile's current search space rejects at its own bucket's shape raises :class:`ResultsError` (the file is
    stale); one valid there but not at ``shape`` (a nearer bucket was not stored) gives the default, with source
    ``"default (tuned:<file>#<bucket> does not apply to <shape>: ...)"``. ``tile``: the tile object (else looked up by
    name; unregistered tiles are not checked against a search space).

    A winner that does not name every parameter of the tile's current search space was tuned before a
    structural option existed: it won nothing over that option, so the default runs instead, with source
    ``"default (stale: ...)"`` (``allow_stale=True`` returns it anyway: the tuner seeds studies with it).
    """
    arch = get_arch(arch) if isinstance(arch, str) else arch
    tile = tile if tile is not None else _registered(tile_name)
    if default is None:
        if tile is None:
            from tiles.core.registry import get_tile

            get_tile(tile_name)  # raises the registry's error for an unknown name
        default = tile.default_config(arch)
    for slug, path in candidate_files(tile_name, arch, gpu, root):
        data = read_results(path, tile_name, arch)
        hit = nearest_entry(data, shape) if data else None
        if hit is not None:
            nearest = f" (nearest GPU: {slug})" if gpu is not None and slug != gpu_slug(gpu) else ""
            return _usable(tile, arch, shape, path, *hit, default, allow_stale, nearest)
    return dict(default), "default"


def _usable(tile, arch: Arch, shape: Shape, path: Path, bucket: str, entry: dict, default: Config, allow_stale: bool, nearest: str):
    """:func:`load_winner`'s answer for the stored ``entry`` of ``bucket`` in ``path``: the winner, or the default
    when it is stale or does not apply at ``shape``."""
    config = dict(entry["config"])
    missing = stale_params(tile, arch, config, entry.get("default_config")) if tile is not None else []
    if missing and not allow_stale:
        return dict(default), f"default (stale: {_shown(path)}#{bucket} predates {', '.join(missing)})"
    if tile is not None:
        space = tile.search_space(arch)
        own = Shape(bucket, entry.get("phase", "any"), entry.get("dims") or {})
        bad = space.violations(config, own, arch)
        if bad:
            raise ResultsError(
                f"results file {path} bucket {bucket!r} holds a config the tile no longer accepts ({'; '.join(bad)}): re-run `lab tune`"
            )
        if bucket != shape.name and (bad := space.violations(config, shape, arch)):
            # Valid where it was tuned, not at this nearby shape (a constraint that depends on the shape, e.g. a
            # choice that needs bf16 rows): not evidence here, so the default runs.
            return dict(default), f"default (tuned:{_shown(path)}#{bucket} does not apply to {shape.name}: {'; '.join(bad)})"
    return config, f"tuned:{_shown(path)}#{bucket}{nearest}"


def config_for(tile, shape: Shape, arch: Arch, gpu: str | None = None) -> tuple[Config, str]:
    """What a tile calls at run time on GPU model ``gpu``: its tuned config for (arch, gpu, shape) or its default, with
    the source."""
    return load_winner(tile.name, arch, shape, default=tile.default_config(arch), tile=tile, gpu=gpu)
