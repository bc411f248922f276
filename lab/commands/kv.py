"""`lab kv`: global KV bytes per token by group, fixed per-sequence state, and the MLA comparison."""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table

from lab.commands.model import load_preset
from model.cache import MLA_BYTES_PER_TOKEN, KVCache
from model.config import PRESETS, ModelConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="v4.1-flash", help=f"model preset: {', '.join(PRESETS)} (default v4.1-flash)")
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON instead of tables")


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
    return 0
