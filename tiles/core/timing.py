"""Timing kernels the honest way: CUDA events, warm-up, median of many, rotating inputs.

``time_cuda`` brackets each call with events (a small kernel then also measures the host's launch
overhead); ``time_cuda_graph`` replays the calls from a CUDA graph, the device time alone.

Rotating several input sets (each larger than what L2 could keep warm, where possible)
stops the cache from flattering small kernels. ``device_copy_bandwidth`` measures the
copy ceiling once so results can say what fraction of it a kernel reaches.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Timing:
    median_ms: float
    p10_ms: float
    p90_ms: float
    runs: int


def time_cuda(fn: Callable[[int], object], n_sets: int = 1, warmup: int = 5, runs: int = 50, min_time_ms: float = 50.0) -> Timing:
    """Time ``fn(i)`` where ``i`` picks the input set (``i % n_sets``).

    Each run is bracketed by its own pair of CUDA events; runs grow until ``min_time_ms``
    of device time is covered (capped at 20x ``runs``).
    """
    for i in range(warmup):
        fn(i % n_sets)
    torch.cuda.synchronize()
    times: list[float] = []
    i = 0
    while len(times) < runs or (sum(times) < min_time_ms and len(times) < 20 * runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i % n_sets)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        i += 1
    times.sort()
    q = statistics.quantiles(times, n=10) if len(times) >= 10 else [times[0]] * 9
    return Timing(statistics.median(times), q[0], q[-1], len(times))


def time_cuda_graph(fn: Callable[[int], object], n_sets: int = 1, launches: int = 8, replays: int = 20) -> Timing | None:
    """Device time per call of ``fn(i)`` with the host out of the loop, or None when it cannot be captured.

    ``launches`` calls (rotating the input sets) are captured into one CUDA graph; each of ``replays``
    replays is bracketed by events and divided by ``launches``. Per-call event timing includes the
    host's launch overhead whenever it exceeds the kernel (TileLang's wrapper costs tens of microseconds
    a call), which is not what a decode step under a CUDA graph pays. A call that syncs with the host or
    otherwise refuses capture returns None: its eager time is all there is.
    """
    launches = max(n_sets, -(-launches // n_sets) * n_sets)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):
            for i in range(n_sets):  # lazy initialisation and allocations happen before the capture
                fn(i)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(launches):
                fn(i % n_sets)
        graph.replay()
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 -- capture is best effort; the caller keeps the eager time
        torch.cuda.synchronize()
        return None
    t = time_cuda(lambda _: graph.replay(), warmup=2, runs=replays, min_time_ms=0)
    return Timing(t.median_ms / launches, t.p10_ms / launches, t.p90_ms / launches, t.runs * launches)


def input_sets_for_l2(bytes_per_set: float, l2_bytes: int, max_sets: int = 8) -> int:
    """How many rotating input sets keep the working set past 3x L2 (at least 2, at most ``max_sets``)."""
    if bytes_per_set <= 0:
        return 2
    return int(max(2, min(max_sets, -(-3 * l2_bytes // bytes_per_set))))


def device_copy_bandwidth(n_bytes: int = 2 * 1024**3) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device="cuda").uniform_()
    dst = torch.empty_like(src)
    t = time_cuda(lambda _: dst.copy_(src), warmup=3, runs=20)
    return 2 * n_bytes / (t.median_ms * 1e-3)


def describe_environment() -> dict:
    """GPU, driver, CUDA and package versions for results metadata."""
    import datetime
    import platform
    import subprocess

    info: dict = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), "python": platform.python_version()}
    info["torch"] = torch.__version__
    for pkg in ("tilelang", "optuna"):
        try:
            info[pkg] = __import__(pkg).__version__
        except Exception:  # noqa: BLE001 -- a missing or broken package is recorded, never fatal
            info[pkg] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        info["cuda"] = torch.version.cuda
        info["gpus"] = torch.cuda.device_count()
        try:
            lines = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            ).stdout.split()
            info["driver"] = lines[0] if lines else None  # one line per GPU, all the same driver
        except Exception:  # noqa: BLE001 -- no nvidia-smi: the driver is recorded as unknown
            info["driver"] = None
    return info
