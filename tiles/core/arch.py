"""GPU architectures the lab knows: the facts that shape search spaces and compile targets.

Numbers are those of the flagship part of each generation (per-block shared memory is
the opt-in maximum a kernel may request). ``detect()`` reads the GPU that is present.
"""

from __future__ import annotations

from dataclasses import dataclass


class ArchError(ValueError):
    """Unknown architecture, or a GPU that does not match the one asked for."""


@dataclass(frozen=True)
class Arch:
    name: str  # "sm90"
    capability: tuple[int, int]
    example_gpu: str
    sm_count: int
    smem_per_block: int  # bytes, opt-in maximum for one block
    smem_per_sm: int
    registers_per_sm: int
    max_registers_per_thread: int
    l2_bytes: int
    wgmma: bool  # warpgroup MMA (Hopper)
    tma: bool  # bulk tensor copies
    fp4_mma: bool  # tensor cores take FP4 operands
    cluster_launch: bool
    nvcc_arch: str  # the target TileLang compiles for ("sm_90a" turns on wgmma/setmaxnreg)

    @property
    def family(self) -> str:
        """Default configs are chosen per family: 'ampere' (sm80-sm89), 'hopper', 'blackwell'."""
        major = self.capability[0]
        return "ampere" if major < 9 else "hopper" if major == 9 else "blackwell"

    def tilelang_target(self) -> dict:
        return cuda_target(self.nvcc_arch)


def cuda_target(nvcc_arch: str) -> dict:
    """The TileLang/TVM target dict of a CUDA arch ("sm_90a", "sm_80", ...), for ``tvm.target.Target``."""
    return {"kind": "cuda", "arch": nvcc_arch}


KIB, MIB = 1024, 1024 * 1024

ARCHS: dict[str, Arch] = {
    a.name: a
    for a in [
        Arch("sm80", (8, 0), "A100", 108, 163 * KIB, 164 * KIB, 65536, 255, 40 * MIB, False, False, False, False, "sm_80"),
        Arch("sm86", (8, 6), "RTX A6000", 84, 99 * KIB, 100 * KIB, 65536, 255, 6 * MIB, False, False, False, False, "sm_86"),
        Arch("sm89", (8, 9), "L40S", 142, 99 * KIB, 100 * KIB, 65536, 255, 96 * MIB, False, False, False, False, "sm_89"),
        Arch("sm90", (9, 0), "H100/H200", 132, 227 * KIB, 228 * KIB, 65536, 255, 50 * MIB, True, True, False, True, "sm_90a"),
        Arch("sm100", (10, 0), "B200", 148, 227 * KIB, 228 * KIB, 65536, 255, 126 * MIB, False, True, True, True, "sm_100a"),
        Arch("sm120", (12, 0), "RTX 5090", 170, 99 * KIB, 100 * KIB, 65536, 255, 96 * MIB, False, True, True, False, "sm_120a"),
    ]
}


def get_arch(name: str) -> Arch:
    """Look an arch up by name (``sm90``, ``sm_90``, ``sm_90a`` and ``90`` all work)."""
    key = name.lower().replace("_", "").rstrip("a")
    key = key if key.startswith("sm") else f"sm{key}"
    if key not in ARCHS:
        raise ArchError(f"unknown arch {name!r}: known archs are {', '.join(ARCHS)} (or 'auto' to detect the GPU)")
    return ARCHS[key]


def parse_arch_list(text: str) -> list[Arch]:
    """``"sm80,sm90"`` -> [Arch, Arch]."""
    return [get_arch(part.strip()) for part in text.split(",") if part.strip()]


def detect() -> Arch:
    """The arch of GPU 0; :class:`ArchError` when there is no CUDA GPU or it is unknown."""
    import torch

    if not torch.cuda.is_available():
        raise ArchError("no CUDA GPU is present: name an arch with --arch and use --compile-only, or run on a GPU machine")
    major, minor = torch.cuda.get_device_capability(0)
    for arch in ARCHS.values():
        if arch.capability == (major, minor):
            return arch
    raise ArchError(f"GPU {torch.cuda.get_device_name(0)} has compute capability {major}.{minor}, which the lab does not know yet")


def device_arch(device) -> Arch:
    """The arch whose kernels a call on CUDA ``device`` runs: its exact compute capability, else its major family's
    (an sm_87 GPU runs sm80's kernels); :class:`ArchError` when neither is known."""
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    for key in (f"sm{major}{minor}", f"sm{major}0"):
        if key in ARCHS:
            return ARCHS[key]
    raise ArchError(f"GPU with compute capability {major}.{minor} is not in tiles.core.arch: add it there first")


def resolve(name: str) -> Arch:
    """``auto`` detects the GPU; anything else is looked up."""
    return detect() if name == "auto" else get_arch(name)


def require_present(arch: Arch) -> None:
    """Refuse to time for an arch that is not the GPU present."""
    present = detect()
    if present.name != arch.name:
        raise ArchError(f"asked to time for {arch.name} but the GPU present is {present.name}: use --arch auto, or --compile-only")
