"""A tile's search space as Optuna sees it, the configs a study starts from, and its valid configs.

The tuner knows nothing of any op: the parameters, their choices and the constraints all
come from :meth:`tiles.core.contract.Tile.search_space`. A study starts from the tile's default
config, then from winners already stored for this arch and for the archs most like it
(transfer between GPUs), so a new GPU begins where a similar one ended.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from tiles.core.arch import ARCHS, Arch
from tiles.core.config_store import ResultsError, candidate_files, load_winner
from tiles.core.contract import Config, SearchSpace, Shape, Tile
from tiles.core.gpu import present_gpu


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
        if not candidate_files(tile.name, other, None, root):
            continue
        try:
            # this arch: the GPU present's winner first (tiles.core.gpu.nearest_order); another arch: any model's
            gpu = present_gpu() if other.name == arch.name else None
            config, source = load_winner(tile.name, other, shape, default={}, root=root, allow_stale=True, gpu=gpu)
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


# Compile-only compiles every config of a space up to this size (each point a trial, constraint-refused ones recorded
# as invalid); a larger space is sampled (the compressor's 53.7M points, the attention's and the indexer's millions):
# compiling every valid config of those would take months, and listing their points took 22.7 GB.
MAX_COMPILE_GRID = 10_000


def grid_configs(space: SearchSpace, first: Config | None = None) -> Iterator[Config]:
    """Every point of ``space``, ``first`` (the default) before the others, one at a time: the grid is never held
    whole (:meth:`tiles.core.contract.SearchSpace.all_configs` lists it)."""
    names = space.names()
    if first is not None:
        yield dict(first)
    for values in itertools.product(*(p.choices for p in space.params)):
        config = dict(zip(names, values, strict=True))
        if config != first:
            yield config


# Spaces up to this size are enumerated to find their valid configs (4M points take ~7 s on one core, in the
# background while the study's first configs compile); larger ones are searched around each proposal instead
# (NearbyValidConfigs: the attention spaces, 6.9-13.8M points, and the indexer's 29M).
MAX_ENUMERATED = 4_000_000
# NearbyValidConfigs: constraint checks per proposal before it gives up (~1-2 us each on one core)
MAX_NEARBY_CHECKS = 200_000


class ValidConfigs:
    """The configs a shape's constraints accept, and the one nearest to any config a sampler proposes.

    The structural parameters of the attention and compressor spaces constrain each other, so most of their points
    are invalid for a given shape (0.26% of the FP4 attention's decode_b64_s1 space, 0.42% of the compressor's): an
    independent sampler proposing points of such a space almost never proposes a valid one, and a study would stop
    at its invalid limit having measured one or two configs. The tuner replaces each invalid proposal by the valid
    config that differs from it in the fewest parameters (ties broken at random) and has not been tried, so every
    proposal turns into a measurement near what the sampler asked for.

    Configs that build the same kernel (``kernel_key``, e.g. :meth:`tiles.core.contract.Tile.kernel_key`: an "auto" choice
    and the choice it resolves to) count once: ``len`` is the number of distinct kernels, and :meth:`nearest` skips
    a config whose kernel was tried (the prefill attention's 14,224 valid configs at 4K are 4,200 kernels).

    The enumeration runs in a background thread from construction; :meth:`nearest` waits for it. Spaces larger
    than :data:`MAX_ENUMERATED` are searched around each proposal instead (:class:`NearbyValidConfigs`).
    """

    exhaustible = True  # ``len`` is known: a study can tell that it has tried every valid kernel

    def __init__(self, space: SearchSpace, shape: Shape, arch: Arch, seed: int = 0, kernel_key: Callable[[Config], str] | None = None):
        self._space, self._shape, self._arch = space, shape, arch
        self._names = space.names()
        self._rng = np.random.default_rng(seed)
        self._kernel_key = kernel_key or config_key
        self._configs: list[Config] = []
        self._kernels: list[str] = []  # each valid config's kernel key
        self._codes: np.ndarray | None = None  # [valid configs, params] choice indices
        self.error: str | None = None  # why the enumeration stopped, if it did (then nothing is replaced)
        self._done = threading.Event()
        threading.Thread(target=self._enumerate, name=f"valid-configs-{shape.name}", daemon=True).start()

    def _enumerate(self) -> None:
        try:
            choices = [p.choices for p in self._space.params]
            configs = []
            for combo in itertools.product(*(range(len(c)) for c in choices)):
                config = {name: choices[i][j] for i, (name, j) in enumerate(zip(self._names, combo, strict=True))}
                if not any(c.check(config, self._shape, self._arch) for c in self._space.constraints):
                    configs.append((config, combo))
            self._codes = np.array([combo for _, combo in configs], dtype=np.int16).reshape(len(configs), len(self._names))
            self._kernels = [self._kernel_key(config) for config, _ in configs]
            self._configs = [config for config, _ in configs]
        except Exception as exc:  # noqa: BLE001 -- a constraint (or key) that raises on some point: no replacement, the study goes on
            self.error, self._configs, self._kernels, self._codes = f"{type(exc).__name__}: {exc}", [], [], None
        finally:
            self._done.set()

    def __len__(self) -> int:
        """The number of distinct kernels the valid configs build."""
        self._done.wait()
        return len(set(self._kernels))

    def wait(self) -> None:
        """Until the enumeration has finished."""
        self._done.wait()

    @property
    def ready(self) -> bool:
        """The enumeration has finished (``len`` and :meth:`nearest` answer without waiting)."""
        return self._done.is_set()

    def nearest(self, config: Config, exclude: set[str], exclude_kernels: set[str] = frozenset()) -> Config | None:
        """The valid config differing from ``config`` in the fewest parameters whose :func:`config_key` is not in
        ``exclude`` and whose kernel key is not in ``exclude_kernels`` (ties: random), or None when every valid config
        is excluded."""
        self._done.wait()
        if not self._configs:
            return None
        code = np.array([_choice_index(p.choices, config.get(p.name)) for p in self._space.params], dtype=np.int16)
        distance = (self._codes != code).sum(axis=1) + self._rng.random(len(self._configs))  # fraction: the tie-break
        for i in np.argsort(distance):
            if config_key(self._configs[i]) not in exclude and self._kernels[i] not in exclude_kernels:
                return dict(self._configs[i])
        return None


class NearbyValidConfigs:
    """:class:`ValidConfigs`' replacement of invalid proposals for a space too large to enumerate: the valid configs
    one parameter away from the proposal, then two, then three, ... (each radius in full, up to
    :data:`MAX_NEARBY_CHECKS` constraint checks a proposal), and of the nearest radius holding an untried one (config
    and kernel not excluded), one at random. The enumeration's answer up to the tie-break, at the cost of the
    neighbourhood: for uniformly random proposals (the sampler's first trials) on the H200 attention spaces, 2-6
    parameters away, 0.04-0.2 s a proposal on one core (tests/test_tuning.py). Where the search runs out of checks
    first (the valid configs lie too many parameters away: 1 in 30 random proposals on the prefill attention's space,
    7 in 30 on the FP4 decode's; 28c2d59), the proposal is repaired greedily (one parameter at a time, each step
    the change that leaves the fewest constraints failing, sideways where none lowers it) and the search starts again
    from there: a valid config near the proposal, no longer the nearest. Not ``exhaustible``: the study cannot know
    when every valid kernel was tried, and stops by its budget and its invalid limit. Safe to call from several lanes
    at once (each search keeps its own count).
    """

    exhaustible = False
    ready = True

    def __init__(self, space: SearchSpace, shape: Shape, arch: Arch, seed: int = 0, kernel_key: Callable[[Config], str] | None = None):
        self._space, self._shape, self._arch = space, shape, arch
        self._rng = np.random.default_rng(seed)
        self._kernel_key = kernel_key or config_key
        self.error: str | None = None  # why a search stopped early, if one did (a constraint raised)

    def wait(self) -> None:
        """Nothing to wait for: each search runs when asked."""

    def _failing(self, config: Config) -> int:
        return sum(1 for c in self._space.constraints if c.check(config, self._shape, self._arch))

    def _untried_valid(self, config: Config, exclude: set[str], exclude_kernels: set[str]) -> bool:
        if self._failing(config):
            return False
        return config_key(config) not in exclude and self._kernel_key(config) not in exclude_kernels

    def _pick(self, found: list[Config]) -> Config | None:
        return found[int(self._rng.integers(len(found)))] if found else None

    def _around(self, base: Config, exclude: set[str], exclude_kernels: set[str]) -> Config | None:
        """The untried valid configs fewest parameters away from ``base``, one at random; None once
        :data:`MAX_NEARBY_CHECKS` constraint checks found none."""
        if self._untried_valid(base, exclude, exclude_kernels):
            return base
        checks, params = 1, self._space.params
        for radius in range(1, len(params) + 1):
            found = []
            for chosen in itertools.combinations(params, radius):
                others = [[v for v in p.choices if v != base[p.name]] for p in chosen]
                for values in itertools.product(*others):
                    candidate = base | {p.name: v for p, v in zip(chosen, values, strict=True)}
                    if self._untried_valid(candidate, exclude, exclude_kernels):
                        found.append(candidate)
                    checks += 1
                    if checks >= MAX_NEARBY_CHECKS:
                        return self._pick(found)
            if found:
                return self._pick(found)
        return None

    def _repair(self, config: Config) -> Config:
        """``config`` changed one parameter at a time, each step the change (ties: random) that leaves the fewest
        constraints failing; where no change lowers that number, one that keeps it, to a config not yet visited (at
        most two steps a parameter)."""
        failing, visited = self._failing(config), {config_key(config)}
        for _ in range(2 * len(self._space.params)):
            if not failing:
                break
            best, moves = failing + 1, []
            for p in self._space.params:
                for v in p.choices:
                    candidate = config | {p.name: v}
                    if v == config[p.name] or config_key(candidate) in visited:
                        continue
                    n = self._failing(candidate)
                    if n < best:
                        best, moves = n, []
                    if n == best:
                        moves.append(candidate)
            if best > failing or not moves:
                break
            config, failing = self._pick(moves), best
            visited.add(config_key(config))
        return config

    def nearest(self, config: Config, exclude: set[str], exclude_kernels: set[str] = frozenset()) -> Config | None:
        """The untried valid config fewest parameters away from ``config`` (ties: random); where none lies within
        :data:`MAX_NEARBY_CHECKS` checks of it, the one nearest to its greedy repair; None if neither search finds one."""
        base = {p.name: config.get(p.name, p.choices[0]) for p in self._space.params}
        try:
            found = self._around(base, exclude, exclude_kernels)
            if found is None:
                repaired = self._repair(base)
                if repaired != base:
                    found = self._around(repaired, exclude, exclude_kernels)
            return found
        except Exception as exc:  # noqa: BLE001 -- a constraint that raises: no replacement, the study goes on
            self.error = f"{type(exc).__name__}: {exc}"
        return None


def valid_configs(space: SearchSpace, shape: Shape, arch: Arch, seed: int = 0, kernel_key: Callable[[Config], str] | None = None):
    """:class:`ValidConfigs` (enumerated) for a space of up to :data:`MAX_ENUMERATED` points, else
    :class:`NearbyValidConfigs` (searched around each proposal)."""
    if space.size() <= MAX_ENUMERATED:
        return ValidConfigs(space, shape, arch, seed=seed, kernel_key=kernel_key)
    return NearbyValidConfigs(space, shape, arch, seed=seed, kernel_key=kernel_key)


def _choice_index(choices: tuple, value) -> int:
    return list(choices).index(value) if value in choices else -1  # -1 differs from every valid choice
