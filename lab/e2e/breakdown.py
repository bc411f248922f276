"""Where a step's time goes: CUDA events around backend calls and FFN modules.

The backend seam already separates the accelerated ops, so a proxy around the backend
times attention, indexer and compressor calls; forward hooks time the FFNs. "rest" is the
step's total minus the parts (projections, norms, RoPE, quantising the SWA KV, the head).
Events are recorded on the stream without synchronising, so a timed pass costs about what
an untimed one does; the totals still come from separate untimed passes.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Self

import torch

PARTS = ("attention", "indexer", "compressor", "ffn", "rest")
PASS = "pass_ms"  # the breakdown pass's own total (eager), which the parts add up to

# Backend method -> part of the breakdown.
METHOD_PART = {
    "sparse_attention": "attention",
    "indexer_topk": "indexer",
    "candidate_pool": "indexer",
    "reindex_topk": "indexer",
    "fp4_quantize": "indexer",  # the indexer query's FP4 fake-quant
    "compressor": "compressor",
}


class EventLog:
    """Pairs of CUDA events per part; :meth:`totals_ms` reads them after a synchronise."""

    def __init__(self) -> None:
        self.pairs: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = defaultdict(list)

    def start(self) -> torch.cuda.Event:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def stop(self, part: str, start: torch.cuda.Event) -> None:
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.pairs[part].append((start, end))

    def totals_ms(self) -> dict[str, float]:
        torch.cuda.synchronize()
        return {part: sum(s.elapsed_time(e) for s, e in pairs) for part, pairs in self.pairs.items()}


class TimedBackend:
    """Wraps a backend; every call of a method in :data:`METHOD_PART` is bracketed by events."""

    def __init__(self, inner, log: EventLog) -> None:
        self._inner, self._log = inner, log
        self.name = f"timed-{inner.name}"

    def __getattr__(self, attr: str):
        fn = getattr(self._inner, attr)
        part = METHOD_PART.get(attr)
        if part is None or not callable(fn):
            return fn

        def timed(*args, **kwargs):
            start = self._log.start()
            out = fn(*args, **kwargs)
            self._log.stop(part, start)
            return out

        return timed


class FfnHooks:
    """Forward hooks on every block's FFN recording events into ``log``; use as a context manager."""

    def __init__(self, model, log: EventLog) -> None:
        self.model, self.log, self.handles, self._starts = model, log, [], {}

    def __enter__(self) -> Self:
        for i, block in enumerate(self.model.layers):
            self.handles.append(block.ffn.register_forward_pre_hook(lambda m, a, i=i: self._starts.__setitem__(i, self.log.start())))
            self.handles.append(block.ffn.register_forward_hook(lambda m, a, o, i=i: self.log.stop("ffn", self._starts.pop(i))))
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()


def measure_breakdown(model, step_fn) -> dict[str, float]:
    """Run ``step_fn()`` once, eagerly, with events around each part and around the whole pass; returns ms per part
    of :data:`PARTS` and the pass's own total as ``pass_ms``.

    ``rest`` = ``pass_ms`` minus the timed parts, floored at 0. The parts are measured against this pass and not
    against the step's timed latency: an eager pass's event intervals include the GPU's idle gaps between launches,
    which a CUDA-graph replay does not have, so at a launch-bound decode step the parts can add up to more than the
    graph's step time (H200, ec0c4e1: tiles decode B=64 at 64K, attention 24.6 ms of events against a 22.5 ms step).
    """
    log = EventLog()
    inner = model.backend
    model.backend = TimedBackend(inner, log)
    try:
        with FfnHooks(model, log):
            start = log.start()
            step_fn()
            log.stop(PASS, start)
        parts = log.totals_ms()
    finally:
        model.backend = inner
    out = {p: parts.get(p, 0.0) for p in PARTS if p != "rest"}
    out["rest"] = max(0.0, parts[PASS] - sum(out.values()))
    out[PASS] = parts[PASS]
    return out
