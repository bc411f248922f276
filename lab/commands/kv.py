"""`lab kv`: global KV bytes per token by group, fixed per-sequence state, and the MLA comparison.

With a workload (``--lengths``, ``--sequences``, ``--page-size``) it also sizes the paged cache
(:mod:`model.paged`) those live sequences hold: pages and bytes per KV group, state slots, the total,
and what contiguous buffers padded to the longest sequence would take instead.
"""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table

from lab.cli import LabError, positive_int
from lab.commands.e2e import parse_tokens
from lab.commands.model import load_preset
from model.cache import MLA_BYTES_PER_TOKEN, KVCache
from model.config import PRESETS, ModelConfig
from model.paged import DEFAULT_PAGE_SIZE, WorkloadPlan, plan_workload


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="v4.1-flash", help=f"model preset: {', '.join(PRESETS)} (default v4.1-flash)")
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON instead of tables")
    work = parser.add_argument_group("paged workload (sizes the page pools and state slots of live sequences)")
    work.add_argument(
        "--lengths",
        metavar="SPEC",
        help="sequence lengths in tokens: a list (8K,32K,128K; repeated up to --sequences) or a range LO:HI"
        " (--sequences lengths spread evenly from LO to HI)",
    )
    work.add_argument("--sequences", type=positive_int, metavar="N", help="live sequences (default: one per listed length)")
    work.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE, help=f"compressed entries per page (default {DEFAULT_PAGE_SIZE})")


def workload_lengths(spec: str, sequences: int | None) -> list[int]:
    """``--lengths`` and ``--sequences`` -> one length per live sequence.

    ``"8K,32K"`` gives those lengths (cycled up to ``sequences``); ``"8K:64K"`` gives ``sequences`` lengths spread
    evenly from 8K to 64K inclusive.
    """
    if ":" in spec:
        parts = spec.split(":")
        if len(parts) != 2:
            raise LabError(f"--lengths {spec!r}: a range is LO:HI, e.g. 8K:64K")
        lo_hi = [parse_tokens(p) for p in parts]
        if any(len(v) != 1 for v in lo_hi):
            raise LabError(f"--lengths {spec!r}: a range is LO:HI, e.g. 8K:64K")
        lo, hi = lo_hi[0][0], lo_hi[1][0]
        if lo > hi:
            raise LabError(f"--lengths {spec!r}: the range's low end {lo} is above its high end {hi}")
        n = sequences or 1
        return [lo + (hi - lo) * i // max(1, n - 1) for i in range(n)] if n > 1 else [lo]
    listed = parse_tokens(spec)
    if not listed:
        raise LabError(f"--lengths {spec!r} names no length: write e.g. 8K,32K or 8K:64K")
    n = sequences or len(listed)
    return [listed[i % len(listed)] for i in range(n)]


def workload_report(cfg: ModelConfig, plan: WorkloadPlan) -> dict:
    """The paged cache a workload holds, as plain data (bytes are exact integers)."""
    groups = {g.source: g for g in KVCache.layout(cfg)}
    longest = max(plan.lengths, default=0)
    padded = len(plan.lengths) * longest * KVCache.global_bytes_per_token(cfg)  # contiguous buffers at the longest length
    return {
        "sequences": len(plan.lengths),
        "tokens": sum(plan.lengths),
        "shortest": min(plan.lengths, default=0),
        "longest": longest,
        "page_size": plan.page_size,
        "page_bytes": plan.page_bytes,
        "groups": [
            {"source_layer": src, "region": groups[src].region, "ratio": groups[src].ratio, "pages": n, "bytes": plan.group_bytes[src]}
            for src, n in plan.pages.items()
        ],
        "pages": sum(plan.pages.values()),
        "page_total_bytes": plan.page_total_bytes,
        "slots": plan.slots,
        "slot_bytes": plan.slot_bytes,
        "slot_total_bytes": plan.slot_total_bytes,
        "total_bytes": plan.total_bytes,
        "contiguous_padded_bytes": _whole(padded + plan.slot_total_bytes),
    }


def kv_report(cfg: ModelConfig) -> dict:
    """Everything `lab kv` shows, as plain data."""
    groups = KVCache.layout(cfg)
    per_token = KVCache.global_bytes_per_token(cfg)
    return {
        "preset": cfg.name,
        "global_bytes_per_token": _whole(per_token),
        "groups": [
            {
                "source_layer": g.source,
                "region": g.region,
                "ratio": g.ratio,
                "readers": list(g.readers),
                "main_entry_bytes": g.main_entry_bytes,
                "index_entry_bytes": g.index_entry_bytes,
                "bytes_per_token": _whole(g.bytes_per_token),
            }
            for g in groups
        ],
        "fixed_state_bytes_per_sequence": KVCache.fixed_state_bytes(cfg),
        "mla_bytes_per_token": MLA_BYTES_PER_TOKEN,
        "mla_ratio": MLA_BYTES_PER_TOKEN / per_token,
    }


def _whole(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


def _num(x: float) -> str:
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.1f}"


def run(args: argparse.Namespace) -> int:
    cfg = load_preset(args.preset)
    rep = kv_report(cfg)
    if args.page_size < 1:
        raise LabError(f"--page-size must be at least 1, got {args.page_size}")
    if args.lengths is None and args.sequences is not None:
        raise LabError("--sequences needs --lengths: give e.g. --sequences 64 --lengths 8K:64K")
    if args.lengths is not None:
        lengths = workload_lengths(args.lengths, args.sequences)
        if max(lengths) > cfg.max_seq_len:
            raise LabError(f"--lengths reaches {max(lengths):,} tokens, past max_seq_len={cfg.max_seq_len:,} of preset {cfg.name!r}")
        rep["workload"] = workload_report(cfg, plan_workload(cfg, lengths, args.page_size))
    if args.json:
        print(json.dumps(rep, indent=2))
        return 0
    console = Console()
    table = Table(title=f"{cfg.name}: global KV per token (grows with the context)")
    for col in ("KV source", "region", "ratio", "readers", "main B/entry", "index B/entry", "B/token"):
        table.add_column(col, justify="left" if col in ("region", "readers") else "right")
    for g in rep["groups"]:
        readers = f"{g['readers'][0]}-{g['readers'][-1]} ({len(g['readers'])})"
        table.add_row(
            str(g["source_layer"]),
            g["region"],
            str(g["ratio"]),
            readers,
            str(g["main_entry_bytes"]),
            str(g["index_entry_bytes"]),
            _num(g["bytes_per_token"]),
        )
    table.add_section()
    table.add_row("total", "", "", "", "", "", _num(rep["global_bytes_per_token"]), style="bold")
    console.print(table)
    fixed = rep["fixed_state_bytes_per_sequence"]
    state = Table(title="fixed state per sequence (does not grow with the context)")
    state.add_column("state")
    state.add_column("bytes", justify="right")
    state.add_row(f"SWA rings ({cfg.n_layers} layers x {cfg.window} tokens, FP8 + E8M0)", f"{fixed['swa_rings']:,}")
    state.add_row("compressor tails (pending group, fp32 kv + gate)", f"{fixed['compressor_tails']:,}")
    state.add_row("total", f"{fixed['total']:,}", style="bold")
    console.print(state)
    console.print(
        f"MLA (DeepSeek-V3, 61 layers x 576 bf16): {MLA_BYTES_PER_TOKEN:,} B/token = {rep['mla_ratio']:.1f}x the global KV of {cfg.name}"
    )
    if "workload" in rep:
        console.print(_workload_table(cfg, rep["workload"]))
    return 0


def _gib(n: float) -> str:
    return f"{n / 2**30:,.3f}"


def _workload_table(cfg: ModelConfig, w: dict) -> Table:
    lengths = f"{w['shortest']:,}" if w["shortest"] == w["longest"] else f"{w['shortest']:,}-{w['longest']:,}"
    table = Table(
        title=f"{cfg.name}: paged cache of {w['sequences']:,} sequences, {lengths} tokens",
        caption=f"pages of {w['page_size']} entries ({w['page_bytes']:,} B); a slot ({w['slot_bytes']:,} B) holds one"
        f" sequence's SWA rings and compressor tails; padded = contiguous buffers at the longest length",
    )
    for col in ("storage", "ratio", "count", "bytes", "GiB"):
        table.add_column(col, justify="left" if col == "storage" else "right")
    for g in w["groups"]:
        table.add_row(f"pages, group {g['source_layer']}", str(g["ratio"]), f"{g['pages']:,}", f"{g['bytes']:,}", _gib(g["bytes"]))
    table.add_row("pages, all", "", f"{w['pages']:,}", f"{w['page_total_bytes']:,}", _gib(w["page_total_bytes"]))
    table.add_row("state slots", "", f"{w['slots']:,}", f"{w['slot_total_bytes']:,}", _gib(w["slot_total_bytes"]))
    table.add_section()
    table.add_row("total", "", "", f"{w['total_bytes']:,}", _gib(w["total_bytes"]), style="bold")
    padded = w["contiguous_padded_bytes"]
    table.add_row("padded", "", "", _num(padded), _gib(padded))
    return table
