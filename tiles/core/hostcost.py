"""Host time of a call: what a public function costs the CPU per call, beside the device time it launches.

Eager callers (and prefill, which is not graph-captured) pay it on every layer. :func:`host_us` times many calls back to
back without waiting for the GPU, so what it measures is the CPU's part as long as the launch queue does not fill (50
calls of a few launches each stay far below its depth). :func:`tilelang_call_us` is the reference point: one call of
a plain TileLang kernel compiled the way TileLang's examples compile theirs (``tilelang.jit`` with the output
allocated by the kernel), three tensors in and one out, as the DSV4 sparse-attention example is called
(``out = kernel(q, kv, indices)``); no public function can cost less than the kernel call it makes.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable

import torch

from tiles.core.arch import Arch


def host_us(call: Callable[[], object], calls: int = 50, rounds: int = 5) -> float:
    """Microseconds of host time per ``call()``: the best of ``rounds`` means over ``calls`` back-to-back calls
    (the GPU drained before each round, one warm-up call first)."""
    call()
    best = math.inf
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls)
    torch.cuda.synchronize()
    return best * 1e6


@functools.lru_cache(maxsize=4)
def reference_kernel(nvcc_arch: str):
    """The reference TileLang kernel compiled for ``nvcc_arch`` (no GPU needed to build it)."""
    import tilelang
    import tilelang.language as T

    from tiles.core.arch import cuda_target

    @tilelang.jit(out_idx=[-1], target=tilelang.tvm.target.Target(cuda_target(nvcc_arch)))
    def gather_add(rows: int = 64, width: int = 512, block: int = 128):
        @T.prim_func
        def main(
            q: T.Tensor((rows, width), "bfloat16"),  # [rows, width]
            kv: T.Tensor((rows, width), "bfloat16"),  # [rows, width]
            indices: T.Tensor((rows,), "int32"),  # [rows]
            out: T.Tensor((rows, width), "bfloat16"),  # [rows, width]
        ):
            with T.Kernel(rows, threads=block) as r:
                for i in T.Parallel(width):
                    out[r, i] = q[r, i] + kv[indices[r], i]

        return main

    return gather_add()


def tilelang_call_us(arch: Arch, device: torch.device | str = "cuda") -> float:
    """Host microseconds per call of the reference TileLang kernel (module docstring) on ``device``."""
    kernel = reference_kernel(arch.nvcc_arch)
    q = torch.randn(64, 512, dtype=torch.bfloat16, device=device)  # [rows, width]
    kv = torch.randn(64, 512, dtype=torch.bfloat16, device=device)  # [rows, width]
    indices = torch.randperm(64, device=device, dtype=torch.int32)  # [rows]
    return host_us(lambda: kernel(q, kv, indices))
