"""`lab model`: a preset's layer map (region, ratio, mode, shared sources) and its parameter count."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from lab.cli import LabError
from model.config import PRESETS, ConfigError, LayerMode, ModelConfig, preset
from model.model import count_parameters

_MODE_STYLE = {LayerMode.FULL: "bold green", LayerMode.REINDEX: "yellow", LayerMode.REUSE: "", LayerMode.SWA_ONLY: "dim"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="v4.1-flash", help=f"model preset: {', '.join(PRESETS)} (default v4.1-flash)")


def load_preset(name: str) -> ModelConfig:
    """The preset, or a one-line :class:`LabError` naming the choices."""
    try:
        return preset(name)
    except ConfigError as exc:
        raise LabError(str(exc)) from None


def layer_table(cfg: ModelConfig) -> Table:
    table = Table(title=f"{cfg.name}: {cfg.n_layers} layers ({cfg.n_encoder_layers} encoder)")
    for col in ("layer", "region", "ratio", "mode", "KV source", "index source", "pool source"):
        table.add_column(col, justify="right" if col in ("layer", "ratio") else "left")

    def show(v: int | None) -> str:
        return "-" if v is None else str(v)

    for p in cfg.layer_plan():
        ratio = "-" if p.ratio == 0 else str(p.ratio)
        table.add_row(
            str(p.index),
            p.region,
            ratio,
            p.mode.value,
            show(p.kv_source),
            show(p.index_source),
            show(p.pool_source),
            style=_MODE_STYLE[p.mode],
        )
    return table


def run(args: argparse.Namespace) -> int:
    cfg = load_preset(args.preset)
    console = Console()
    console.print(layer_table(cfg))
    counts = {m: sum(p.mode == m for p in cfg.layer_plan()) for m in LayerMode}
    console.print(", ".join(f"{counts[m]} {m.value}" for m in LayerMode))
    n = count_parameters(cfg)
    console.print(
        f"parameters: {n:,} ({n / 1e9:.2f} B; dense SwiGLU FFN of width {cfg.ffn_inter})"
        if not cfg.n_routed_experts
        else f"parameters: {n:,} ({n / 1e9:.2f} B; MoE FFN)"
    )
    return 0
