"""Registers and spill bytes of a TileLang-generated kernel source, by nvcc's ptxas (no GPU needed).

What a new option must show before it runs on a GPU: no spills, and registers within what its occupancy allows
(``lab sources --out DIR`` writes the sources).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path


def ptxas_log(src: str, workdir: Path, arch: str = "sm_90a", ptxas_options: tuple[str, ...] = ()) -> str:
    """nvcc's output (ptxas -v info and warnings) for the kernel in ``src`` compiled for ``arch`` with TileLang's
    include paths (``nvcc -cubin -O3 -Xptxas -v``, plus ``ptxas_options`` such as ``--register-usage-level=10``);
    files go to ``workdir``. Raises CalledProcessError when nvcc fails, FileNotFoundError when nvcc is not on the
    PATH."""
    import tilelang

    root = Path(tilelang.__file__).parent
    cu = Path(workdir) / "k.cu"
    cu.write_text(src)
    inc = [f"-I{root / d}" for d in ("src", "src/cuda", "3rdparty/cutlass/include")]
    cmd = [
        "nvcc",
        f"-arch={arch}",
        "-cubin",
        "-std=c++17",
        "-O3",
        "-Xptxas",
        ",".join(("-v", *ptxas_options)),
        *inc,
        str(cu),
        "-o",
        str(cu.with_suffix(".cubin")),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return out.stdout + out.stderr


def resource_usage(src: str, workdir: Path, arch: str = "sm_90a") -> tuple[int, int]:
    """(registers per thread, spill bytes stored + loaded) of the kernel in ``src`` compiled for ``arch``
    (:func:`ptxas_log`)."""
    return parse_resource_usage(ptxas_log(src, workdir, arch))


def parse_resource_usage(log: str) -> tuple[int, int]:
    """(registers per thread, spill bytes stored + loaded) from a :func:`ptxas_log` output."""
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = sum(int(v) for v in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
    return regs, spills
