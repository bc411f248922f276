"""GPU models within an arch: tuned configs are kept per model (an H100 and an H200 are both sm90 but differ in memory
bandwidth and clocks, so their winners and latencies differ), under the model's file-name form (:func:`gpu_slug`).

At run time the winner of the GPU present is used; when none was tuned there, the nearest model of the same arch
(:func:`nearest_order`): one of the same family first (``h100-pcie`` before ``h200`` for an ``h100-80gb-hbm3``),
then the others by name.
"""

from __future__ import annotations

import functools
import re


def gpu_slug(gpu: str | None) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"h100-80gb-hbm3"``: the file-name form of a GPU model (``"unknown"`` for None)."""
    name = re.sub(r"^nvidia\s+", "", (gpu or "unknown").strip(), flags=re.IGNORECASE)
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def family(slug: str) -> str:
    """``"h100-80gb-hbm3"`` -> ``"h100"``: the model family a slug starts with."""
    return slug.split("-", 1)[0]


def nearest_order(present: str | None, available: list[str]) -> list[str]:
    """The GPU slugs of ``available`` in the order their winners are tried for ``present`` (a slug, or None when no
    particular GPU is asked for: then by name): ``present`` itself, then the same family, then the rest, by name."""
    if present is None:
        return sorted(available)
    return sorted(available, key=lambda s: (s != present, family(s) != family(present), s))


@functools.lru_cache(maxsize=16)
def device_gpu(index: int) -> str:
    """The model name of CUDA device ``index`` (``torch.cuda.get_device_name``), asked once per device."""
    import torch

    return torch.cuda.get_device_name(index)


def present_gpu() -> str | None:
    """The model name of GPU 0, or None without a CUDA GPU."""
    import torch

    return device_gpu(0) if torch.cuda.is_available() else None
