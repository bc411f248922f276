"""Isolated worker processes: the compile pool and the GPU workers.

A trial's kernel is compiled in a pool of spawned processes (one per core) and then run,
checked and timed in a spawned GPU worker (one per GPU, pinned with ``CUDA_VISIBLE_DEVICES``).
Every worker is a separate process so a config that hangs, segfaults or poisons the CUDA
context (an illegal memory access is sticky: nothing on that context works afterwards) is
killed and replaced while the study goes on.

Compiled TileLang kernels cannot be pickled across processes, so the pool and the GPU worker
share work through TileLang's on-disk kernel cache (``TILELANG_CACHE_DIR``, keyed by the
lowered program, the target and the TileLang build): the pool's ``tile.build()`` fills the
cache and the GPU worker's ``tile.build()`` of the same (shape, config, arch) loads the
cached binary instead of running nvcc again. Both sides record their build time
(``compile_s`` in the pool, ``load_s`` in the GPU worker) so the saving is measured per trial.

Tiles are named across processes by a reference ``"module:tile_name"`` (the module defines
``TILES = [...]``), so tiles outside ``tiles/`` (the tests' toy tiles) work the same way.

A worker writes nothing to the command's stdout (its stdout is the parent's stderr: TileLang
logs every compile there) and is out of reach of Ctrl-C: it runs in a process group of its own,
so the terminal's SIGINT reaches the parent alone, which reports the interrupt and shuts its
workers down, killing each one's group (a compiler it started goes with it).
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import resource_tracker

from tiles.core.contract import Tile

_CTX = mp.get_context("spawn")


class WorkerTimeout(Exception):
    """The task ran past its time limit; the worker was killed."""


class WorkerDied(Exception):
    """The worker process exited during the task (segfault, CUDA abort, os._exit)."""


def tile_ref(tile: Tile) -> str:
    """How a worker process finds ``tile`` again: ``"module:tile_name"``."""
    return f"{type(tile).__module__}:{tile.name}"


def load_tile(ref: str) -> Tile:
    module_name, _, name = ref.partition(":")
    module = importlib.import_module(module_name)
    for tile in getattr(module, "TILES", []):
        if tile.name == name:
            return tile
    raise LookupError(f"module {module_name} has no tile named {name!r} in TILES")


def resolve_function(ref: str) -> Callable:
    module_name, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module_name), attr)


# --- tasks (run inside the workers) -----------------------------------------------------------


def compile_task(tile_ref_: str, shape_name: str, config: dict, arch_name: str) -> dict:
    """Constraints + ``tile.build`` in a pool worker: the Evaluation as a dict, plus resource use when known."""
    from tiles.core.arch import get_arch
    from tiles.core.harness import compile_tile

    tile = load_tile(tile_ref_)
    kernel, ev = compile_tile(tile, tile.shape(shape_name), config, get_arch(arch_name))
    if kernel is not None:
        ev.extra.update(kernel_resources(kernel))
    return ev.to_dict()


def evaluate_on_gpu(tile_ref_: str, shape_name: str, config: dict, arch_name: str, seed: int, runs: int) -> dict:
    """Build (a kernel-cache hit after the pool compiled it), check on fresh inputs, time: the Evaluation as a dict."""
    from tiles.core.arch import get_arch
    from tiles.core.harness import check_and_time, compile_tile

    tile = load_tile(tile_ref_)
    shape, arch = tile.shape(shape_name), get_arch(arch_name)
    t0 = time.perf_counter()
    kernel, ev = compile_tile(tile, shape, config, arch)
    ev.extra["load_s"] = time.perf_counter() - t0
    # which GPU ran the trial (the worker is pinned to one): a multi-GPU study shows its spread from these
    ev.extra["gpu"] = f"{os.environ.get('CUDA_VISIBLE_DEVICES', '')}@{socket.gethostname()}"
    if kernel is None:
        return ev.to_dict()
    ev = check_and_time(tile, shape, kernel, ev, arch, seed=seed, runs=runs)
    ev.extra["gpu_s"] = time.perf_counter() - t0  # the worker's whole time on this trial: a GPU's busy share
    return ev.to_dict()


def kernel_resources(kernel) -> dict:
    """Registers and spills per thread of the TileLang kernels inside ``kernel``, where TileLang reports them.

    TileLang 0.1.15 fills ``JITKernel.n_regs``/``n_spills`` for HIP only; CUDA builds give an
    empty dict here (reading the cubin needs ``cuobjdump``, which the CPU image does not ship).
    Tiles often wrap several kernels in one object, so its attributes are searched one level deep.
    """
    found = [kernel] if hasattr(kernel, "get_kernel_source") else []
    parts = kernel if isinstance(kernel, list | tuple) else list(getattr(kernel, "__dict__", {}).values())
    found += [k for k in parts if hasattr(k, "get_kernel_source")]
    regs = [k.n_regs for k in found if getattr(k, "n_regs", None) is not None]
    spills = [k.n_spills for k in found if getattr(k, "n_spills", None) is not None]
    return ({"registers": max(regs)} if regs else {}) | ({"spills": max(spills)} if spills else {})


def _quiet_worker() -> None:
    """Leave the terminal's process group and ignore SIGINT (a Ctrl-C printed a worker's traceback; the parent shuts
    the workers down), then take SIGINT out of the mask the parent blocked it with while starting this process.

    Point stdout at stderr: TileLang logs each compile with ``tqdm.write`` (stdout), 116 lines in one `lab tune
    --compile-only`, and a compiler may print too; what a command prints on stdout is its output only. The descriptor
    itself is redirected, so output written below Python (by a native library) follows."""
    try:
        os.setsid()
    except OSError:  # already a group leader (not started by IsolatedWorker): SIG_IGN alone keeps Ctrl-C out
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        sys.stdout.flush()
        os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):  # no real stdout or stderr (an embedding host): nothing to redirect
        pass


def _thread_lock_for_tqdm() -> None:
    """TileLang logs through ``tqdm.write``, which guards its writes with a multiprocessing lock: a named semaphore that
    a worker killed mid-compile (Ctrl-C, a timeout) leaves to multiprocessing's resource tracker, which then warned
    about "leaked semaphore objects" as `lab tune` exited. A worker is one process: a thread lock does."""
    try:
        import tqdm
    except ImportError:
        return
    tqdm.tqdm.set_lock(threading.RLock())


def _worker_main(conn, env: dict[str, str]) -> None:
    _quiet_worker()
    os.environ.update(env)
    _thread_lock_for_tqdm()
    try:
        import tilelang  # noqa: F401  (imported up front so compile_s / load_s time the build, not the import)
    except ImportError:
        pass
    while True:
        try:
            fn_ref, args = conn.recv()
        except (EOFError, OSError):  # the parent went away: nothing left to do
            return
        try:
            result = ("ok", resolve_function(fn_ref)(*args))
        except BaseException as exc:  # noqa: BLE001  (reported to the parent, which decides what it means)
            result = ("error", "".join(traceback.format_exception_only(type(exc), exc)).strip()[-2000:])
        try:
            conn.send(result)
        except (BrokenPipeError, OSError):
            return


# --- the parent's handle on one worker ----------------------------------------------------------


class IsolatedWorker:
    """One spawned process running tasks one at a time; killed and respawned on timeout or death."""

    def __init__(self, name: str, env: dict[str, str] | None = None):
        self.name = name
        self.env = dict(env or {})
        self.restarts = 0
        self.stopped = False  # by stop(): no task starts it again (a lane still running at Ctrl-C would have)
        self._proc = None
        self._conn = None

    def _start(self) -> None:
        parent, child = _CTX.Pipe()
        # The child applies env before anything touches CUDA (torch reads CUDA_VISIBLE_DEVICES at CUDA init, not import).
        self._proc = _CTX.Process(target=_worker_main, args=(child, self.env), name=self.name, daemon=True)
        # SIGINT blocked while it starts: the child inherits the mask, so a Ctrl-C before it leaves the terminal's process
        # group in _quiet_worker (its imports take seconds) stays pending, then is dropped, instead of ending it with a
        # traceback. Only this thread's mask changes: a Ctrl-C meanwhile still reaches the parent's main thread.
        # multiprocessing's resource tracker is started first: starting it unblocks SIGINT on its way out, which inside
        # the block would undo it for the first worker.
        resource_tracker.ensure_running()
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            self._proc.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        child.close()
        self._conn = parent

    def kill(self) -> None:
        """Kill the worker and its process group (a compiler it is running), and close the pipe."""
        # pid None: not started yet (a Ctrl-C reached the main thread while a lane was starting it); such a worker is a
        # daemon, ended by multiprocessing when the parent exits
        if self._proc is not None and self._proc.pid is not None:
            if self._proc.is_alive():
                try:
                    if os.getpgid(self._proc.pid) == self._proc.pid:  # its own group (see _quiet_worker)
                        os.killpg(self._proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self._proc.kill()  # still starting (no group of its own yet), or already gone: a no-op then
            self._proc.join(5)
        if self._conn is not None:
            self._conn.close()
        self._proc = self._conn = None

    def stop(self, grace_s: float = 3.0) -> None:
        """End the worker at the close of a run: with its pipe closed it returns from its loop and exits normally,
        releasing what it holds (a killed worker leaves its semaphores to multiprocessing's resource tracker, which
        warned about them when `lab tune` exited). Killed if it is still busy after ``grace_s``."""
        self.stopped = True
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._proc is not None and self._proc.is_alive():
            self._proc.join(grace_s)
        self.kill()

    def restart(self) -> None:
        self.kill()
        self.restarts += 1

    def call(self, fn_ref: str, args: tuple, timeout_s: float | None):
        """Run ``fn_ref(*args)`` in the worker; raises WorkerTimeout / WorkerDied (and respawns next call)."""
        if self.stopped:
            raise WorkerDied(f"worker {self.name} was stopped")
        if self._proc is None or not self._proc.is_alive():
            self._start()
        self._conn.send((fn_ref, args))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            wait = 0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic()))
            if self._conn.poll(wait):
                try:
                    status, value = self._conn.recv()
                except (EOFError, OSError):
                    self._proc.join(2)  # reap it so the exit code (e.g. -11, 134) can be reported
                    code = self._proc.exitcode
                    self.restart()
                    raise WorkerDied(f"worker {self.name} died (exit code {code})") from None
                if status == "error":
                    raise RuntimeError(value)
                return value
            if not self._proc.is_alive():
                code = self._proc.exitcode
                self.restart()
                raise WorkerDied(f"worker {self.name} died (exit code {code})")
            if deadline is not None and time.monotonic() >= deadline:
                self.restart()
                raise WorkerTimeout(f"worker {self.name} exceeded {timeout_s:g} s and was killed")


def visible_gpus(n: int) -> list[str]:
    """The first ``n`` GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` entries: ``CUDA_VISIBLE_DEVICES=2,3``
    with ``n=2`` gives ``["2", "3"]`` (a worker told ``0`` would run on the GPU the user had excluded)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = [d.strip() for d in visible.split(",") if d.strip()] if visible is not None else [str(i) for i in range(max(1, n))]
    return devices[: max(1, n)]


@dataclass
class WorkerPool:
    """A fixed set of isolated workers handed out one task at a time (threads wait for a free one)."""

    workers: list[IsolatedWorker]

    def __post_init__(self):
        self._free: queue.Queue[IsolatedWorker] = queue.Queue()
        for w in self.workers:
            self._free.put(w)
        self._lock = threading.Lock()

    @classmethod
    def compile_pool(cls, jobs: int) -> WorkerPool:
        # Compilation needs no GPU; hiding it keeps pool workers from creating CUDA contexts.
        return cls([IsolatedWorker(f"compile-{i}", {"CUDA_VISIBLE_DEVICES": ""}) for i in range(max(1, jobs))])

    @classmethod
    def gpu_pool(cls, n_gpus: int) -> WorkerPool:
        """One worker per GPU, each seeing only its own: the first ``n_gpus`` of this process's visible GPUs."""
        return cls([IsolatedWorker(f"gpu-{i}", {"CUDA_VISIBLE_DEVICES": device}) for i, device in enumerate(visible_gpus(n_gpus))])

    def call(self, fn_ref: str, args: tuple, timeout_s: float | None, restart_if: Callable[[object], bool] | None = None):
        """Run a task on the next free worker; ``restart_if(result)`` replaces the worker after a result that poisons it."""
        worker = self._free.get()
        try:
            result = worker.call(fn_ref, args, timeout_s)
            if restart_if is not None and restart_if(result):
                worker.restart()  # e.g. a CUDA fault: the context is unusable for every later trial
            return result
        finally:
            self._free.put(worker)

    def evaluate(self, evaluator: str, args: tuple, timeout_s: float | None) -> dict:
        """One GPU evaluation by ``evaluator`` (check, then time; ``args`` as :func:`evaluate_on_gpu` takes them): the
        worker's Evaluation dict, or an outcome for a worker that hung (TIMEOUT) or died (RUNTIME_FAULT). A worker
        whose result is a runtime fault is replaced."""
        from tiles.core import harness

        try:
            return self.call(evaluator, args, timeout_s, restart_if=lambda r: r.get("outcome") == harness.RUNTIME_FAULT)
        except WorkerTimeout as exc:
            return {"outcome": harness.TIMEOUT, "message": str(exc)}
        except WorkerDied as exc:
            return {"outcome": harness.RUNTIME_FAULT, "message": str(exc)}
        except RuntimeError as exc:
            return {"outcome": harness.RUNTIME_FAULT, "message": f"GPU worker: {exc}"}

    @property
    def restarts(self) -> int:
        return sum(w.restarts for w in self.workers)

    def close(self, grace_s: float = 3.0) -> None:
        """Stop every worker, each given ``grace_s`` to finish a task (0 on Ctrl-C: killed at once)."""
        for w in self.workers:
            w.stop(grace_s)
