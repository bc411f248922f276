"""What the indexer's and the compressor's public functions do before they launch: the arch of the tensors' GPU and
the config for the call (explicit, tuned winner, or default). The attention keeps its own config pick
(``tiles.sparse_attn.api``): it resolves per-call choices and caches the pick per shape."""

import torch

from tiles.core.arch import Arch, device_arch
from tiles.core.contract import Config, Shape, Tile, TileError


def tensor_arch(t: torch.Tensor, caller: str) -> Arch:
    """The arch of the GPU ``t`` is on (:func:`tiles.core.arch.device_arch`); ``caller``: the public function, named in the
    error a CPU tensor gets."""
    if t.device.type != "cuda":
        raise TileError(f"{caller}: the kernels run on a CUDA GPU, got tensors on {t.device}: move them with .cuda()")
    return device_arch(t.device)


def pick_config(tile: Tile, shape: Shape, arch: Arch, config: Config | None) -> Config:
    """An explicit config (checked), else the tuned winner from results/, else the tile's default."""
    if config is None:
        try:
            from tiles.core.config_store import load_winner
        except ImportError:
            config = tile.default_config(arch)
        else:
            config, _ = load_winner(tile.name, arch, shape, default=tile.default_config(arch))
    full = tile.with_defaults(arch, config)
    reasons = tile.search_space(arch).violations(full, shape, arch)
    if reasons:
        raise TileError(f"{tile.name}: config {config} is not usable here: {'; '.join(reasons)}")
    return full
