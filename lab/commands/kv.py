"""`lab kv`: global KV bytes per token by group, fixed per-sequence state, and the MLA comparison.

With a workload (``--lengths``, ``--sequences``, ``--page-size``) it also sizes the paged cache
(:mod:`model.paged`) those live sequences hold: pages and bytes per KV group, state slots, the total,
and what contiguous buffers padded to the longest sequence would take instead.

With ``--turn-interval`` the sequences are conversations that come back every interval, and the report adds what each
tier holds in the steady state (:func:`tier_footprint`): HBM (the ``--active`` sessions decoding now: their pages and
state slots), host memory (idle sessions' SWA state, kept ``--host-ttl``), disk (every session's global KV pages, kept
``--retention``), against what the same workload would need with DeepSeek-V3's MLA cache.
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
from model.paged import DEFAULT_PAGE_SIZE, WorkloadPlan, plan_workload, spread_lengths


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
    tiers = parser.add_argument_group("tiers (the sequences as conversations that come back every --turn-interval)")
    tiers.add_argument("--turn-interval", metavar="T", help="time between a session's turns, e.g. 90s, 5m, 2h (turns on the tier report)")
    tiers.add_argument("--active", type=positive_int, metavar="N", help="sessions decoding at once, held in HBM (default: all)")
    tiers.add_argument("--host-ttl", default="10m", metavar="T", help="how long an idle session's SWA state stays in host memory (10m)")
    tiers.add_argument("--retention", default="72h", metavar="T", help="how long global KV pages stay in the disk tier (72h)")


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str, what: str) -> float:
    """``"90s"``, ``"10m"``, ``"72h"``, ``"3d"`` (or plain seconds) -> seconds, > 0."""
    t = text.strip().lower()
    try:
        seconds = float(t[:-1]) * _UNITS[t[-1]] if t and t[-1] in _UNITS else float(t)
    except ValueError:
        raise LabError(f"{what} {text!r}: write a duration such as 90s, 10m, 72h or 3d") from None
    if not seconds > 0:
        raise LabError(f"{what} {text!r}: the duration must be positive")
    return seconds


def tier_footprint(
    cfg: ModelConfig, lengths: list[int], page_size: int, active: int, interval: float, host_ttl: float, retention: float
) -> dict:
    """Steady-state bytes per tier of ``len(lengths)`` conversations that each come back every ``interval`` seconds.

    HBM holds the ``active`` sessions decoding now (the first ``active`` lengths): their pages and state slots. An
    idle session's SWA state (one slot: rings and tails) sits in host memory for ``min(host_ttl, interval)`` of each
    interval, so on average a fraction ``min(1, host_ttl / interval)`` of the idle sessions' states is there; past the
    TTL it is rebuilt by bounded replay. Every session's global KV pages stay on disk for ``min(retention, interval)``
    of each interval likewise. MLA (DeepSeek-V3): 70,272 B/token in HBM for the active sessions and on disk for all,
    no SWA state. All bytes are exact expectations of that model, not measurements.
    """
    n = len(lengths)
    active = min(active, n)
    hot, idle = plan_workload(cfg, lengths[:active], page_size), plan_workload(cfg, lengths, page_size)
    host_share, disk_share = min(1.0, host_ttl / interval), min(1.0, retention / interval)
    host = (n - active) * hot.slot_bytes * host_share
    disk = idle.page_total_bytes * disk_share
    mla_hot = sum(lengths[:active]) * MLA_BYTES_PER_TOKEN
    mla_disk = sum(lengths) * MLA_BYTES_PER_TOKEN * disk_share
    return {
        "sessions": n,
        "active": active,
        "turn_interval_s": interval,
        "host_ttl_s": host_ttl,
        "retention_s": retention,
        "hbm_bytes": hot.total_bytes,
        "host_bytes": _whole(host),
        "disk_bytes": _whole(disk),
        "mla_hbm_bytes": mla_hot,
        "mla_host_bytes": 0,
        "mla_disk_bytes": _whole(mla_disk),
    }


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
        return spread_lengths(sequences or 1, lo, hi)
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
        if args.turn_interval is not None:
            interval = parse_duration(args.turn_interval, "--turn-interval")
            ttl, keep = parse_duration(args.host_ttl, "--host-ttl"), parse_duration(args.retention, "--retention")
            rep["tiers"] = tier_footprint(cfg, lengths, args.page_size, args.active or len(lengths), interval, ttl, keep)
    if args.lengths is None and (args.turn_interval is not None or args.active is not None):
        raise LabError("--turn-interval and --active need a workload: give e.g. --sequences 1000 --lengths 64K --turn-interval 5m")
    if args.turn_interval is None and args.active is not None:
        raise LabError("--active needs --turn-interval (the tier report): e.g. --turn-interval 5m --active 64")
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
    if "tiers" in rep:
        console.print(_tier_table(cfg, rep["tiers"]))
    return 0


def _duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds // size:.0f}{unit}"
    return f"{seconds:g}s"


def _tier_table(cfg: ModelConfig, t: dict) -> Table:
    table = Table(
        title=f"{cfg.name}: tiers of {t['sessions']:,} conversations, a turn every {_duration(t['turn_interval_s'])},"
        f" {t['active']:,} decoding at once",
        caption=f"host: idle sessions' SWA state for {_duration(t['host_ttl_s'])} (then bounded replay); disk: global KV"
        f" pages for {_duration(t['retention_s'])}; MLA: DeepSeek-V3's cache for the same workload (expected bytes, not measured)",
    )
    for col in ("tier", "CSA2 GiB", "MLA GiB", "MLA / CSA2"):
        table.add_column(col, justify="left" if col == "tier" else "right")
    for tier in ("hbm", "host", "disk"):
        ours, mla = t[f"{tier}_bytes"], t[f"mla_{tier}_bytes"]
        table.add_row(tier.upper() if tier == "hbm" else tier, _gib(ours), _gib(mla), f"{mla / ours:,.1f}x" if ours and mla else "-")
    return table


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
