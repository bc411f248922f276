"""A tile's search space as Optuna sees it, and the configs a study starts from.

The tuner knows nothing of any op: the parameters, their choices and the constraints all
come from :meth:`tiles.contract.Tile.search_space`. A study starts from the tile's default
config, then from winners already stored for this arch and for the archs most like it
(transfer between GPUs), so a new GPU begins where a similar one ended.
"""

from __future__ import annotations

import json
from pathlib import Path

from tiles.arch import ARCHS, Arch
from tiles.contract import Config, SearchSpace, Shape, Tile
from tiles.results import ResultsError, load_winner, results_path


def distributions(space: SearchSpace) -> dict:
    """``{param name: CategoricalDistribution}`` for ``study.ask``."""
    return {p.name: p.to_optuna() for p in space.params}


def config_key(config: Config) -> str:
    """A canonical string for a config, so equal configs compare equal across trials and processes."""
    return json.dumps(config, sort_keys=True, default=str)


_FEATURES = ("wgmma", "tma", "fp4_mma", "cluster_launch")


def similarity_order(arch: Arch) -> list[Arch]:
    """Other archs, most similar first: same family, then fewest differing features, then closest shared memory, then capability.

    For sm90 this gives sm100 (TMA, 227 KiB, clusters) before sm120 and the Ampere parts;
    winners transfer best between GPUs whose kernels are built the same way.
    """

    def score(other: Arch) -> tuple:
        features = sum(getattr(arch, f) != getattr(other, f) for f in _FEATURES)
        cap = abs((arch.capability[0] * 10 + arch.capability[1]) - (other.capability[0] * 10 + other.capability[1]))
        return (other.family != arch.family, features, abs(other.smem_per_block - arch.smem_per_block), cap)

    return sorted((a for a in ARCHS.values() if a.name != arch.name), key=score)


def seed_configs(tile: Tile, shape: Shape, arch: Arch, root: Path | None = None) -> list[tuple[Config, str]]:
    """Configs to enqueue first, in order, with where each came from.

    The default, then the stored winner for ``arch`` itself (an earlier run), then the stored
    winners of the other archs in :func:`similarity_order`, then the tile's own candidates for
    this shape (:meth:`Tile.candidates`). Configs this arch's constraints reject are dropped
    before anything compiles; repeats are dropped.
    """
    space = tile.search_space(arch)
    seeds: list[tuple[Config, str]] = [(dict(tile.default_config(arch)), "default")]
    for other in [arch, *similarity_order(arch)]:
        if not results_path(tile.name, other, root).exists():
            continue
        try:
            config, source = load_winner(tile.name, other, shape, default={}, root=root, allow_stale=True)
        except ResultsError:
            continue  # a bad file for another arch must not stop tuning this one; `lab check` reports it
        if source != "default" and not space.violations(config, shape, arch):
            seeds.append((config, f"transfer:{other.name}" if other.name != arch.name else "stored"))
    for partial, why in tile.candidates(arch, shape):
        config = tile.with_defaults(arch, partial)
        if not space.violations(config, shape, arch):
            seeds.append((config, f"candidate: {why}"))
    unique, seen = [], set()
    for config, source in seeds:
        if config_key(config) not in seen:
            seen.add(config_key(config))
            unique.append((config, source))
    return unique
