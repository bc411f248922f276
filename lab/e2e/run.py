"""The end-to-end measurement: one model, several backends, decode and prefill, one run.

All backends share one set of random bf16 weights (the backend is swapped on the same
model), and every decode cache is filled from the same seed, so the numbers compare like
with like. Each row also records how far the backend's logits are from the torch
baseline's on the same step, so a fast but wrong backend is visible in the table.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from lab.e2e.breakdown import measure_breakdown
from lab.e2e.multiturn import measure_multiturn, timer_for
from lab.e2e.synthetic import fill_cache, fill_paged_cache
from model import build_model, preset
from model.backend import load_backend
from model.cache import KVCache
from model.paged import plan_workload, spread_lengths
from tiles.core.timing import time_cuda

# prefill = CED; prefill_full = every layer over every token; decode_mixed = one decode step of sequences of lengths spread
# evenly over a range, on the paged cache; multiturn = turn 2 of a conversation on each path of model.sessions
PHASES = ("decode", "decode_mixed", "prefill", "prefill_full", "multiturn")


@dataclass
class Variant:
    """One backend to time: ``torch``, or ``tiles`` with ``tuned`` or ``default`` configs."""

    backend: str
    configs: str = "-"

    @property
    def label(self) -> str:
        return self.backend if self.configs == "-" else f"{self.backend}/{self.configs}"


@dataclass
class Row:
    phase: str
    variant: str
    batch: int
    context: int
    ms: float | None
    mode: str
    breakdown: dict[str, float] = field(default_factory=dict)
    peak_gib: float | None = None
    kv_gib: float | None = None
    logits_rel_err: float | None = None  # vs the torch baseline on the same inputs (multiturn: vs the cold path)
    note: str = ""
    moved: dict[str, int] = field(default_factory=dict)  # multiturn: hit tokens, pages shared, disk and host bytes

    def to_dict(self) -> dict:
        return asdict(self)


# tokens a decode run's cache holds past its context (the steps it times write there)
DECODE_HEADROOM = 64


def make_backend(variant: Variant, device: torch.device):
    if variant.backend == "torch":
        return load_backend("torch", device)
    from tiles.backend import TilesBackend

    return TilesBackend(device, configs=variant.configs)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _time_decode_step(model, cache: KVCache, tokens: torch.Tensor, runs: int) -> tuple[float, str]:
    """Median ms of one decode step: a CUDA graph replay when the backend allows capture, else eager."""
    for _ in range(2):
        model.decode(tokens, cache)
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model.decode(tokens, cache)  # warm the side stream's allocator before capture
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            model.decode(tokens, cache)
        t = time_cuda(lambda _: graph.replay(), warmup=3, runs=runs, min_time_ms=0)
        return t.median_ms, "cuda-graph"
    except Exception as exc:  # noqa: BLE001 -- capture needs a step without host syncs; fall back to eager timing
        torch.cuda.synchronize()
        reason = str(exc).splitlines()[0][:80] if str(exc) else type(exc).__name__
        t = time_cuda(lambda _: model.decode(tokens, cache), warmup=1, runs=runs, min_time_ms=0)
        return t.median_ms, f"eager (no graph: {reason})"


def run_decode(model, variants: list[Variant], batch: int, context: int, runs: int, seed: int) -> list[Row]:
    """Time one decode step (1 token per sequence) at ``context`` for each variant."""
    device = model.device
    tokens = torch.randint(0, model.cfg.vocab_size, (batch,), generator=torch.Generator().manual_seed(seed)).to(device)
    rows, ref_logits = [], None
    for variant in variants:
        model.backend = make_backend(variant, device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        try:
            cache = fill_cache(model.new_cache(batch, context + DECODE_HEADROOM), context, seed)
            logits = model.decode(tokens, cache)  # the first step after the fill: compared across backends
            if ref_logits is None and variant.backend == "torch":
                ref_logits = logits
            err = _rel_err(logits, ref_logits) if ref_logits is not None else None
            ms, mode = _time_decode_step(model, cache, tokens, runs)
            parts = measure_breakdown(model, lambda c=cache: model.decode(tokens, c))
            kv = cache.global_bytes_used() * batch / 2**30
            rows.append(Row("decode", variant.label, batch, context, ms, mode, parts, torch.cuda.max_memory_allocated() / 2**30, kv, err))
            cache = None  # free the filled cache before the next variant's
        except torch.cuda.OutOfMemoryError:
            rows.append(Row("decode", variant.label, batch, context, None, "skipped", note="out of GPU memory"))
    return rows


def run_decode_mixed(model, variants: list[Variant], batch: int, lo: int, hi: int, runs: int, seed: int) -> list[Row]:
    """Time one decode step of ``batch`` sequences whose lengths spread evenly from ``lo`` to ``hi`` tokens, on the
    paged cache (64-entry pages, the manager's default) for each variant. Eager: a paged step builds its block tables
    and ring rows on the host, so it is not graph-captured. ``context`` of the row is the longest length."""
    device = model.device
    lengths = spread_lengths(batch, lo, hi)
    tokens = torch.randint(0, model.cfg.vocab_size, (batch,), generator=torch.Generator().manual_seed(seed)).to(device)
    note = f"lengths {lo}..{hi} evenly spread, paged cache"
    rows, ref_logits = [], None
    for variant in variants:
        model.backend = make_backend(variant, device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        try:
            plan = plan_workload(model.cfg, [n + DECODE_HEADROOM for n in lengths])
            cache = model.new_paged_cache(plan.pages, batch)
            seqs = fill_paged_cache(cache, lengths, seed, headroom=DECODE_HEADROOM)
            logits = model.decode_paged(tokens, cache, seqs)  # the first step after the fill: compared across backends
            if ref_logits is None and variant.backend == "torch":
                ref_logits = logits
            err = _rel_err(logits, ref_logits) if ref_logits is not None else None
            steps = min(runs, DECODE_HEADROOM - 2)  # each timed step consumes a token of the headroom
            t = time_cuda(lambda _, c=cache, s=seqs: model.decode_paged(tokens, c, s), warmup=1, runs=steps, min_time_ms=0)
            kv = plan.page_total_bytes / 2**30
            peak = torch.cuda.max_memory_allocated() / 2**30
            rows.append(Row("decode_mixed", variant.label, batch, max(lengths), t.median_ms, "eager", {}, peak, kv, err, note))
            cache = None  # free the filled cache before the next variant's
        except torch.cuda.OutOfMemoryError:
            rows.append(Row("decode_mixed", variant.label, batch, max(lengths), None, "skipped", note="out of GPU memory"))
    return rows


# Tokens of torch's untimed warm-up prefill (cuBLAS handles, the allocator's pools). The tiles backend warms
# up at full length: the kernels (tuned winners) it picks can depend on the prompt length.
WARMUP_PROMPT = 2048


def run_prefill(model, variants: list[Variant], context: int, ced: bool, repeats: int, seed: int) -> list[Row]:
    """Time a prefill of one ``context``-token prompt (batch 1) per variant: an untimed warm-up prefill (torch:
    ``min(context, WARMUP_PROMPT)`` tokens, since at 64K one torch run takes tens of seconds; tiles: full
    length), then the best of ``repeats`` timed runs."""
    device = model.device
    phase = "prefill" if ced else "prefill_full"
    tokens = torch.randint(0, model.cfg.vocab_size, (1, context), generator=torch.Generator().manual_seed(seed)).to(device)
    rows, ref_logits = [], None
    for variant in variants:
        model.backend = make_backend(variant, device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        try:
            out = {}
            warmup = min(context, WARMUP_PROMPT) if variant.backend == "torch" else context
            model.prefill(tokens[:, :warmup], ced=ced)
            time_once = timer_for(device)
            times = [time_once(lambda o=out: o.__setitem__("r", model.prefill(tokens, ced=ced))) for _ in range(max(1, repeats))]
            ms = min(times)
            logits, cache = out["r"]
            if ref_logits is None and variant.backend == "torch":
                ref_logits = logits
            err = _rel_err(logits, ref_logits) if ref_logits is not None else None
            parts = measure_breakdown(model, lambda: model.prefill(tokens, ced=ced))
            kv = cache.global_bytes_used() / 2**30
            note = "" if len(times) > 1 else "single timed run"
            rows.append(Row(phase, variant.label, 1, context, ms, "eager", parts, torch.cuda.max_memory_allocated() / 2**30, kv, err, note))
            cache = None  # free the prefill cache before the next variant's
        except torch.cuda.OutOfMemoryError:
            rows.append(Row(phase, variant.label, 1, context, None, "skipped", note="out of GPU memory"))
    return rows


def run_multiturn(model, variants: list[Variant], prefix: int, suffix: int, repeats: int, seed: int, disk_dir: str | None) -> list[Row]:
    """Turn 2 (``prefix + suffix`` tokens) after a real turn-1 prefill of ``prefix`` tokens, per variant: one row per
    path of :mod:`model.sessions` (phase ``multiturn/<path>``), its logits error against the variant's cold path."""
    device = model.device
    rows = []
    for variant in variants:
        model.backend = make_backend(variant, device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        try:
            timings = measure_multiturn(model, prefix, suffix, disk_dir=disk_dir, repeats=repeats, seed=seed, model_id=None)
        except torch.cuda.OutOfMemoryError:
            rows.append(Row("multiturn/cold", variant.label, 1, prefix + suffix, None, "skipped", note="out of GPU memory"))
            continue
        peak = torch.cuda.max_memory_allocated() / 2**30
        for t in timings:
            moved = {k: getattr(t, k) for k in ("hit_tokens", "replayed", "pages_shared", "disk_pages", "disk_bytes", "host_bytes")}
            note = (
                f"path {t.path}: {t.hit_tokens} cached tokens, {t.replayed} replayed, {t.pages_shared} pages shared,"
                f" {t.disk_pages} pages / {t.disk_bytes} B from disk, {t.host_bytes} B from host;"
                f" err vs cold, argmax {'same' if t.same_argmax else 'differs'}"
            )
            rows.append(
                Row(f"multiturn/{t.path}", variant.label, 1, prefix + suffix, t.ms, "eager", {}, peak, None, t.rel_err, note, moved)
            )
    return rows


def run_e2e(
    preset_name: str,
    phases: list[str],
    contexts: list[int],
    batches: list[int],
    variants: list[Variant],
    runs: int = 20,
    repeats: int = 2,
    prompts: list[int] | None = None,
    seed: int = 0,
    log: Callable[[str], None] = print,
    on_rows: Callable[[list[Row]], None] | None = None,
    mixed: tuple[int, int] | None = None,
    multiturn: tuple[int, int] = (65536, 1024),
    disk_dir: str | None = None,
) -> list[Row]:
    """Every (phase, context, batch) for every variant. Prefill runs at batch 1 over ``prompts`` (default: ``contexts``);
    ``decode_mixed`` at each batch over lengths spread across ``mixed`` = (lo, hi) tokens; ``multiturn`` at batch 1 with
    ``multiturn`` = (prefix, suffix) tokens and its disk tier in ``disk_dir`` (default: a temporary directory).

    ``on_rows(rows so far)`` is called after each measurement group, so a run stopped by a time
    limit still leaves what it measured.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("lab e2e needs a CUDA GPU")
    t0 = time.perf_counter()
    model = build_model(preset(preset_name), backend="torch", device="cuda", dtype=torch.bfloat16, seed=seed)
    log(f"built {preset_name} in {time.perf_counter() - t0:.1f} s")
    rows: list[Row] = []
    if "decode" in phases:
        for ctx in contexts:
            for b in batches:
                rows += run_decode(model, variants, b, ctx, runs, seed)
                log(f"decode ctx={ctx} B={b} done")
                if on_rows:
                    on_rows(rows)
    if "decode_mixed" in phases:
        lo, hi = mixed or (min(contexts), max(contexts))
        for b in batches:
            rows += run_decode_mixed(model, variants, b, lo, hi, runs, seed)
            log(f"decode_mixed lengths={lo}..{hi} B={b} done")
            if on_rows:
                on_rows(rows)
    for n in prompts or contexts:
        for phase in ("prefill", "prefill_full"):
            if phase in phases:
                rows += run_prefill(model, variants, n, phase == "prefill", repeats, seed)
                log(f"{phase} prompt={n} done")
                if on_rows:
                    on_rows(rows)
    if "multiturn" in phases:
        prefix, suffix = multiturn
        rows += run_multiturn(model, variants, prefix, suffix, repeats, seed, disk_dir)
        log(f"multiturn prefix={prefix} suffix={suffix} done")
        if on_rows:
            on_rows(rows)
    return rows
