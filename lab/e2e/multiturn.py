"""Turn 2 of a conversation, four ways: what each :class:`model.sessions.SessionCache` path costs and how far its
logits are from a cold prefill.

Turn 1 is a real CED prefill of ``prefix`` tokens (untimed setup), ended with :meth:`SessionCache.end_turn`: its
whole blocks published in HBM and written to a disk tier, its state parked in a host pool. Turn 2's prompt is those
tokens plus ``suffix`` new ones, started by :meth:`SessionCache.start_turn` on each path:

* ``pure``: the parked state and the HBM pages (exact continuation: the suffix through every layer);
* ``replay``: the HBM pages, the state gone (encoder bounded replay);
* ``disk``: a fresh cache (HBM lost the pages): pages read from the disk tier, then the replay;
* ``cold``: a fresh cache and no tiers: CED prefill of the whole prompt (the reference of the logits errors).

Runs on any device: CUDA events time a GPU run, ``time.perf_counter`` a CPU one. Each path runs once untimed, then
``repeats`` timed runs (best of). The page files a disk run reads were just written or read, so they come from the
OS page cache, not the device: the disk path's time is the tier's checks and copies, not the storage's latency.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from model.model import Model
from model.paged import DEFAULT_PAGE_SIZE, pages_for
from model.sessions import SessionCache, TurnStart
from model.tiers import DiskPageTier, HostStatePool

SESSION = "conversation"
HOST_BYTES = 1 << 30  # room for one parked state of any preset (v4.1-flash: 2.7 MB)


@dataclass(frozen=True)
class TurnTiming:
    """One path's turn 2: best time of the timed runs, what moved, and the logits error against the cold path."""

    path: str  # one of model.sessions.PATHS
    ms: float
    hit_tokens: int
    replayed: int
    pages_shared: int
    disk_pages: int
    disk_bytes: int
    host_bytes: int
    rel_err: float  # relative L2 error of the last logits [vocab] against the cold path's
    max_abs_err: float
    same_argmax: bool

    def to_dict(self) -> dict:
        return asdict(self)


def timer_for(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """ms of one call of ``fn``: CUDA events on a GPU (after a synchronize), ``time.perf_counter`` elsewhere."""
    if device.type == "cuda":

        def cuda_ms(fn: Callable[[], object]) -> float:
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)

        return cuda_ms

    def cpu_ms(fn: Callable[[], object]) -> float:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    return cpu_ms


@torch.no_grad()
def measure_multiturn(
    model: Model,
    prefix: int,
    suffix: int,
    *,
    disk_dir: str | None = None,
    repeats: int = 2,
    seed: int = 0,
    page_size: int = DEFAULT_PAGE_SIZE,
    model_id: str | None = None,
) -> list[TurnTiming]:
    """Time turn 2 (``prefix + suffix`` tokens after a turn 1 of ``prefix``) on each path, cold first.

    Args:
        model: any preset, device and dtype (float64 on the CPU for exact comparisons in tests).
        disk_dir: the disk tier's directory (default: a temporary one, removed afterwards).
        model_id: names the weights in the disk keys (default: preset, seed, dtype and backend class).
    Returns:
        one :class:`TurnTiming` per path, in the order cold, pure, replay, disk.
    Raises:
        RuntimeError when a path other than the one set up ran (the scenario does not fit its caches).
    """
    if prefix < 1 or suffix < 1:
        raise ValueError(f"multiturn: prefix and suffix must be at least 1 token, got {prefix} and {suffix}")
    cfg, dev = model.cfg, model.device
    model_id = model_id or f"{cfg.name}@seed{seed}/{str(model.dtype).removeprefix('torch.')}/{type(model.backend).__name__}"
    n = prefix + suffix
    tokens = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))
    # Room for turn 1's pages (kept in HBM by the index) and one turn-2 sequence beside them.
    n_pages = {src: 2 * p + 2 for src, p in pages_for(cfg, n, page_size).items()}
    ms_of = timer_for(dev)
    with tempfile.TemporaryDirectory(prefix="csa2-multiturn-") as tmp:
        disk = DiskPageTier(disk_dir or tmp, durable=False)  # turn 1's writes are setup; fsync would only slow it
        host = HostStatePool(HOST_BYTES)
        warm = model.new_paged_cache(n_pages, 2, page_size)
        sessions = SessionCache(model, warm, disk, host, model_id=model_id)
        seq = warm.add()
        model.prefill_paged(tokens[:prefix].to(dev), warm, seq)
        sessions.end_turn(SESSION, seq, tokens[:prefix])
        parked = host.get(SESSION)
        if parked is None:
            raise RuntimeError(f"multiturn: the host pool did not take turn 1's state ({HOST_BYTES} bytes of room)")
        parked_state = (dict(parked.tensors), dict(parked.meta))

        def on_warm(path: str) -> Callable[[], SessionCache]:
            def setup() -> SessionCache:
                if path == "pure":
                    host.put(SESSION, *parked_state)
                else:
                    host.discard(SESSION)
                return sessions

            return setup

        def on_fresh(with_disk: bool) -> Callable[[], SessionCache]:
            def setup() -> SessionCache:
                return SessionCache(
                    model, model.new_paged_cache(n_pages, 1, page_size), disk if with_disk else None, None, model_id=model_id
                )

            return setup

        setups = {"cold": on_fresh(False), "pure": on_warm("pure"), "replay": on_warm("replay"), "disk": on_fresh(True)}
        out, ref = [], None
        for path in ("cold", "pure", "replay", "disk"):
            best, result = float("inf"), None
            for i in range(1 + max(1, repeats)):
                sc = setups[path]()
                got: dict[str, TurnStart] = {}
                ms = ms_of(lambda sc=sc, got=got: got.__setitem__("r", sc.start_turn(SESSION, tokens)))
                r = got["r"]
                if r.how != path:
                    raise RuntimeError(f"multiturn: the {path} run took the {r.how} path; the caches do not hold what it needs")
                sc.cache.free(r.seq)
                if i:  # the first run is a warm-up
                    best = min(best, ms)
                result = r
            if ref is None:
                ref = result.logits.double()
            diff = result.logits.double() - ref
            out.append(
                TurnTiming(
                    path,
                    best,
                    result.hit_tokens,
                    result.replayed,
                    result.pages_shared,
                    result.disk_pages,
                    result.disk_bytes,
                    result.host_bytes,
                    (diff.norm() / ref.norm().clamp_min(1e-30)).item(),
                    diff.abs().max().item(),
                    bool(result.logits.argmax() == ref.argmax()),
                )
            )
    return out
