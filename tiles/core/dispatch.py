"""What every public function does before it launches: the target of the tensors' GPU and the config for the call,
through one path with one cache.

A call's config is the caller's (checked against the tile's search space at the call's shape), else the tuned winner
for the GPU model present (:func:`tiles.core.config_store.load_winner`), else the tile's default; then the tile's
per-call choices are resolved (:meth:`tiles.core.contract.Tile.resolve_call`). The answer depends only on (tile,
arch, GPU model, call dims, explicit config), so it is computed once per such key and kept in :data:`_CACHE`, the one
cache of the public functions, which also holds each function's launch plans (:func:`plan`): after the first call of a
shape, a call checks only what can change between calls (its tensors' shapes, dtypes, devices and layouts) and
launches. :func:`clear` empties it (a results file rewritten in a running process is read again).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any

import torch

from tiles.core.arch import Arch, device_arch
from tiles.core.contract import Config, Shape, Tile, TileError
from tiles.core.gpu import device_gpu

_CACHE: dict[Hashable, Any] = {}
# Entries kept: a serving process sees a new call signature per prompt length at prefill; past this many, the oldest
# entry goes (a plan is rebuilt in tens of microseconds once its kernel is compiled; the kernels have their own caches).
MAX_ENTRIES = 4096


def _keep(key: Hashable, value: Any) -> Any:
    if len(_CACHE) >= MAX_ENTRIES:
        del _CACHE[next(iter(_CACHE))]
    _CACHE[key] = value
    return value


def clear() -> None:
    """Forget every resolved config and launch plan (and the devices' targets)."""
    _CACHE.clear()


def target(t: torch.Tensor, caller: str) -> tuple[Arch, str]:
    """The arch whose kernels run on ``t``'s GPU and that GPU's model name, asked once per device; ``caller``: the
    public function, named in the error a CPU tensor gets."""
    if t.device.type != "cuda":
        raise TileError(f"{caller}: the kernels run on a CUDA GPU, got tensors on {t.device}: move them with .cuda()")
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    key = ("target", index)
    hit = _CACHE.get(key)
    if hit is None:
        hit = _keep(key, (device_arch(index), device_gpu(index)))
    return hit


def frozen(config: Config | None) -> Hashable:
    """A hashable form of a config (None stays None)."""
    return None if config is None else tuple(sorted(config.items()))


def call_config(tile: Tile, dims: Mapping[str, int], arch: Arch, gpu: str, config: Config | None, phase: str = "any") -> Config:
    """The full, resolved config one call of ``tile`` at ``dims`` runs with (see the module docstring); a
    :class:`TileError` naming the tile, the shape and the reasons when an explicit ``config`` is not usable there."""
    key = ("config", tile.name, arch.name, gpu, tuple(sorted(dims.items())), frozen(config))
    hit = _CACHE.get(key)
    if hit is None:
        hit = _keep(key, _resolve(tile, Shape("call", phase, dict(dims)), arch, gpu, config))
    return dict(hit)


def _resolve(tile: Tile, shape: Shape, arch: Arch, gpu: str, config: Config | None) -> Config:
    from tiles.core.config_store import load_winner

    space = tile.search_space(arch)
    if config is None:
        picked, _ = load_winner(tile.name, arch, shape, default=tile.default_config(arch), tile=tile, gpu=gpu)
        full = tile.fit_call(tile.with_defaults(arch, picked), shape, arch)
    else:
        full = tile.with_defaults(arch, config)
    reasons = space.violations(full, shape, arch)
    if reasons:
        shown = config if config is not None else full
        raise TileError(f"config {shown} is not valid for {tile.name} at {dict(shape.dims)} on {arch.name}: {'; '.join(reasons)}")
    return tile.resolve_call(full, shape.dims, arch)


def plan(key: Hashable, build: Callable[[], Any]) -> Any:
    """The launch plan cached under ``key`` (a public function's name and its call's signature), built by ``build``
    on the first call of that signature."""
    hit = _CACHE.get(key)
    if hit is None:
        hit = _keep(key, build())
    return hit


def signature(*tensors: torch.Tensor | None) -> tuple:
    """What a plan depends on, per tensor: shape, dtype, device and whether it is contiguous (None for an absent
    optional tensor). Two calls with equal signatures pass the same input checks."""
    return tuple(None if t is None else (t.shape, t.dtype, t.device, t.is_contiguous()) for t in tensors)
