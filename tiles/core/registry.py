"""Finds every tile: each op package (or module) in ``tiles/`` that defines ``TILES = [...]``."""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache

import tiles
from tiles.core.contract import Tile, TileError

# What holds machinery (this package) or the model's seam, not tiles.
_NOT_TILES = {"core", "backend"}


@cache
def all_tiles() -> dict[str, Tile]:
    found: dict[str, Tile] = {}
    for info in pkgutil.iter_modules(tiles.__path__):
        if info.name in _NOT_TILES or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"tiles.{info.name}")
        for tile in getattr(module, "TILES", []):
            if tile.name in found:
                raise RuntimeError(f"two tiles are named {tile.name!r} (tiles.{info.name} and another module)")
            found[tile.name] = tile
    return dict(sorted(found.items()))


def get_tile(name: str) -> Tile:
    registry = all_tiles()
    if name not in registry:
        raise TileError(f"unknown tile {name!r}: choose one of {', '.join(registry) or '(none registered)'}")
    return registry[name]


def select(names: str) -> list[Tile]:
    """``"all"`` or a comma-separated list of tile names."""
    if names == "all":
        return list(all_tiles().values())
    return [get_tile(n.strip()) for n in names.split(",") if n.strip()]
