"""The tile contract: what a kernel declares so the tuner, `lab bench` and `lab check` can
use it without knowing the op.

A tile says: its name; the shapes it serves (from :mod:`tiles.core.shapes`, tied to the
``v4.1-flash`` preset); how to build a kernel for (shape, config, arch); its search space
as data (parameters with their choices, and constraints checked before anything
compiles); a default config per arch family; an input generator (fresh random data per
seed); the torch reference from ``model/``; FLOP and byte counts; and the comparison rule.

A tile module reads top-down: ``@tilelang.jit``-style kernel builder -> a thin wrapper that
checks inputs and picks the config -> a :class:`Tile` subclass that ties them to this
contract. Tiles are found by :mod:`tiles.core.registry`.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tiles.core.arch import Arch

Config = dict[str, Any]
Inputs = dict[str, torch.Tensor]


class TileError(ValueError):
    """Bad input to a tile (shape, dtype, device, unknown config key), named so the user can fix it."""


@dataclass(frozen=True)
class Param:
    """One tunable parameter: a categorical choice among ``choices``.

    Structural choices (schedule, split strategy, how dequantisation is staged) are
    strings; sizes are ints. The tuner turns each into an Optuna distribution.
    """

    name: str
    choices: tuple
    help: str = ""

    def to_optuna(self):
        import optuna

        return optuna.distributions.CategoricalDistribution(list(self.choices))


@dataclass(frozen=True)
class Constraint:
    """A rule a config must satisfy for a shape and arch before it is compiled.

    ``check(config, shape, arch)`` returns None when the config is fine, otherwise the
    reason (e.g. "shared memory 260 KiB > 227 KiB").
    """

    name: str
    check: Callable[[Config, Shape, Arch], str | None]


@dataclass(frozen=True)
class SearchSpace:
    params: tuple[Param, ...]
    constraints: tuple[Constraint, ...] = ()

    def names(self) -> list[str]:
        return [p.name for p in self.params]

    def size(self) -> int:
        return math.prod(len(p.choices) for p in self.params)

    def violations(self, config: Config, shape: Shape, arch: Arch) -> list[str]:
        """Reasons the config is invalid for (shape, arch); empty when it may be compiled."""
        reasons = []
        unknown = set(config) - set(self.names())
        if unknown:
            reasons.append(f"unknown parameters {sorted(unknown)}")
        for p in self.params:
            if p.name in config and config[p.name] not in p.choices:
                reasons.append(f"{p.name}={config[p.name]!r} is not one of {list(p.choices)}")
        for c in self.constraints:
            why = c.check(config, shape, arch)
            if why:
                reasons.append(f"{c.name}: {why}")
        return reasons

    def all_configs(self) -> list[Config]:
        """Every point of the grid (small spaces only: compile-only sweeps and tests)."""
        configs: list[Config] = [{}]
        for p in self.params:
            configs = [{**c, p.name: v} for c in configs for v in p.choices]
        return configs


@dataclass(frozen=True)
class Shape:
    """One problem size a tile serves, e.g. ``Shape("decode_b64_s1", "decode", {"B": 64, ...})``.

    ``dims`` holds every size the kernel is specialised on; the name is the key under which
    tuned winners are stored.
    """

    name: str
    phase: str  # "decode" | "prefill" | "any"
    dims: Mapping[str, int] = field(default_factory=dict)

    def __getitem__(self, key: str) -> int:
        return self.dims[key]

    def distance(self, other: Shape) -> float:
        """Log-space distance over shared dims; infinite when the dims differ in kind."""
        if set(self.dims) != set(other.dims):
            return math.inf
        return sum(abs(math.log2(max(1, self.dims[k])) - math.log2(max(1, other.dims[k]))) for k in self.dims)


@dataclass
class Comparison:
    """The outcome of comparing a kernel's outputs with the reference."""

    ok: bool
    metric: str  # "bit-exact" or "rel_l2<=tol"
    error: float  # mismatching fraction for bit-exact, relative L2 error otherwise
    detail: str = ""

    def __str__(self) -> str:
        state = "ok" if self.ok else "WRONG"
        return f"{state} ({self.metric}, error {self.error:.3g}{'; ' + self.detail if self.detail else ''})"


class Tile:
    """Base class of every tile; subclasses fill in the class attributes and methods.

    Outputs: :meth:`run` allocates its outputs NaN-filled (or 0xFF-filled for integers)
    before launching, so an unwritten element never passes a comparison.
    """

    name: str = ""
    description: str = ""
    #: archs the tile cannot compile for, with the reason (e.g. {"sm80": "needs wgmma"})
    unsupported: Mapping[str, str] = {}

    # --- shapes and configs ---------------------------------------------------------
    def shapes(self) -> list[Shape]:
        """The benchmark shapes, from :mod:`tiles.core.shapes`."""
        raise NotImplementedError

    def shape(self, name: str) -> Shape:
        for s in self.shapes():
            if s.name == name:
                return s
        raise TileError(f"tile {self.name} has no shape {name!r}: choose one of {', '.join(s.name for s in self.shapes())}")

    def search_space(self, arch: Arch) -> SearchSpace:
        raise NotImplementedError

    def default_config(self, arch: Arch) -> Config:
        """What a careful engineer would pick by hand for this arch family."""
        raise NotImplementedError

    def with_defaults(self, arch: Arch, config: Config) -> Config:
        """``config`` over the default (a tile whose default choices depend on each other overrides this)."""
        return {**self.default_config(arch), **config}

    def fit_call(self, config: Config, shape: Shape, arch: Arch) -> Config:
        """A picked (not caller-given) config adjusted to a call shape that its default choices do not fit, e.g. a row
        width the default vector does not divide (:func:`tiles.core.dispatch.call_config`). Unchanged by default."""
        return config

    def resolve_call(self, config: Config, dims: Mapping[str, int], arch: Arch) -> Config:
        """``config`` (full) with its per-call choices ("auto" values) resolved for one call of ``dims``. Unchanged by
        default; a tile with such choices resolves them here, once per call shape (:mod:`tiles.core.dispatch`)."""
        return config

    def kernel_key(self, shape: Shape, config: Config, arch: Arch) -> str:
        """What identifies the kernel(s) :meth:`build` makes of ``config`` at ``shape``: configs with equal keys build the
        same kernels, so the tuner measures one of them and answers the others from its record. The default: the config
        over the defaults; a tile whose choices resolve per call ("auto" values) keys by what they resolve to."""
        return canonical_key(self.with_defaults(arch, config))

    def candidates(self, arch: Arch, shape: Shape) -> list[tuple[Config, str]]:
        """Structural configs worth one trial each before the tuner samples: partial configs (merged over the default
        by :meth:`with_defaults`), each with the measurement that suggests it, e.g. an option that beat the default at
        this shape in a profile run but is not the default because it loses elsewhere. None by default."""
        return []

    def support_reason(self, arch: Arch) -> str | None:
        """None when the tile compiles for ``arch``, else why not."""
        return self.unsupported.get(arch.name)

    # --- kernels --------------------------------------------------------------------
    def build(self, shape: Shape, config: Config, arch: Arch):
        """Compile the kernel(s) for (shape, config, arch); returns an opaque compiled object.

        Must work without a GPU (TileLang compiles for any target on the CPU).
        """
        raise NotImplementedError

    def kernel_sources(self, shape: Shape, config: Config, arch: Arch) -> dict[str, str]:
        """The CUDA source TileLang generates for each kernel of (shape, config, arch), by kernel name (no GPU needed).

        What a change must leave byte-identical when it adds an option whose default reproduces today's kernel
        (``lab sources``). The default finds the kernels in what :meth:`build` returns (a kernel, or an object or
        tuple holding kernels); a tile whose build keeps its kernels elsewhere overrides this.
        """
        return kernel_sources_of(self.build(shape, self.with_defaults(arch, config), arch))

    def make_inputs(self, shape: Shape, seed: int, device: str | torch.device = "cuda") -> Inputs:
        """Fresh random inputs with realistic magnitudes; a different seed gives different data."""
        raise NotImplementedError

    def run(self, kernel, inputs: Inputs) -> dict[str, torch.Tensor]:
        """Launch the compiled kernel on inputs; outputs poisoned before the launch."""
        outputs = self.alloc_outputs(kernel, inputs)
        self.launch(kernel, inputs, outputs)
        return outputs

    def alloc_outputs(self, kernel, inputs: Inputs) -> dict[str, torch.Tensor]:
        """Output buffers for one launch, poisoned (see :func:`poisoned`)."""
        raise NotImplementedError

    def launch(self, kernel, inputs: Inputs, outputs: dict[str, torch.Tensor]) -> None:
        """Write the kernel's results into ``outputs``. Timing brackets this call alone, so
        filling the poisoned buffers is not counted as the kernel's traffic."""
        raise NotImplementedError

    def public_call(self, shape: Shape, inputs: Inputs, config: Config) -> Callable[[], object] | None:
        """A zero-argument call of the tile's public function on ``inputs`` with ``config`` (what a user calls: input
        checks, config pick, allocation, launch), for its host time (``lab bench``'s host column); None for a tile with
        no public function of its own."""

    def times_launch_only(self) -> bool:
        """True when the tile splits :meth:`run` into :meth:`alloc_outputs` + :meth:`launch`."""
        return type(self).launch is not Tile.launch

    def reference(self, inputs: Inputs) -> dict[str, torch.Tensor]:
        """The torch reference from ``model/`` on the same inputs."""
        raise NotImplementedError

    def compare(self, outputs: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> Comparison:
        raise NotImplementedError

    # --- cost model -----------------------------------------------------------------
    def flops(self, shape: Shape) -> float:
        """Floating-point operations of one call (0 for pure data movement)."""
        return 0.0

    def bytes_moved(self, shape: Shape) -> float:
        """The fewest bytes one call must move through device memory."""
        raise NotImplementedError


def canonical_key(config: Config) -> str:
    """A short digest of a config's canonical JSON (sorted keys): equal configs, equal keys, across processes."""
    text = json.dumps(dict(config), sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def kernel_sources_of(obj, name: str = "main", depth: int = 0) -> dict[str, str]:
    """Sources of the TileLang kernels in ``obj``: a kernel itself (named ``name``), or the kernels among a dict's values,
    an object's attributes or a tuple's items (named by key, attribute, or ``name`` and the index), two levels deep."""
    if hasattr(obj, "get_kernel_source"):
        return {name: obj.get_kernel_source()}
    if depth >= 2:
        return {}
    if isinstance(obj, dict):
        items = list(obj.items())
    elif isinstance(obj, (tuple, list)):
        items = [(f"{name}{i}" if len(obj) > 1 else name, v) for i, v in enumerate(obj)]
    else:
        items = [(k, v) for k, v in vars(obj).items() if not k.startswith("_")] if hasattr(obj, "__dict__") else []
    out: dict[str, str] = {}
    for key, value in items:
        out.update(kernel_sources_of(value, key, depth + 1))
    return out


def poisoned(shape: Sequence[int], dtype: torch.dtype, device) -> torch.Tensor:
    """An output buffer no kernel result can be confused with: NaN for floats, 0xFF.. for ints."""
    if dtype.is_floating_point:
        return torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)
    return (
        torch.full(tuple(shape), -1, dtype=dtype, device=device)
        if dtype.is_signed
        else torch.full(tuple(shape), torch.iinfo(dtype).max, dtype=dtype, device=device)
    )
