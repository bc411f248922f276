"""`lab replay`: the logits error of a prefix hit with encoder bounded replay, against the exact prefill.

One row per (hit position, suffix length) on a float64 model of the preset (:mod:`model.replay_error`): the
formats round the same way on both sides, so the numbers are the approximation itself. Prints a table (or
``--json``); with ``--out DIR`` also writes ``replay_<preset>.json``, ``replay_<preset>.md`` and, when
matplotlib is installed, ``replay_<preset>.png`` (error against hit position, one line per suffix length).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lab.cli import LabError, non_negative_int, positive_int
from lab.commands.model import load_preset
from model.config import PRESETS

MAX_PARAMETERS = 1_000_000_000  # float64 weights: 8 GB
RESULTS_TREE = Path(__file__).resolve().parents[2] / "results"  # GPU-run reports only: this CPU measurement never lands there


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="tiny", help=f"model preset: {', '.join(PRESETS)} (default tiny)")
    parser.add_argument(
        "--hits", default="0,64,128,256", help="hit positions in tokens, multiples of 2 x --page-size (default 0,64,128,256)"
    )
    parser.add_argument("--suffix", default="1,16,64", help="suffix lengths in tokens after the hit (default 1,16,64)")
    parser.add_argument("--page-size", type=positive_int, default=16, help="compressed entries per page (default 16)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of the weights and the token stream (default 0)")
    parser.add_argument("--no-ced", action="store_true", help="every layer over the prompt on both sides instead of the CED prefill")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    parser.add_argument("--out", type=Path, metavar="DIR", help="also write replay_<preset>.json, .md and (with matplotlib) .png here")


def parse_counts(text: str, flag: str) -> list[int]:
    """``"0,64,128"`` -> [0, 64, 128]; a one-line :class:`LabError` for anything else."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            value = int(part)
        except ValueError:
            raise LabError(f"{flag} {text!r}: {part!r} is not a whole number of tokens; write e.g. {flag} 64,128") from None
        if value < 0:
            raise LabError(f"{flag} {text!r}: {value} is negative; token counts are 0 or more")
        out.append(value)
    if not out:
        raise LabError(f"{flag} {text!r} names no token count; write e.g. {flag} 64,128")
    return out


def markdown_table(rows: list[dict]) -> str:
    """The rows as a markdown table (errors of the last position's float64 logits)."""
    lines = [
        "| hit | suffix | replayed | max abs error | rel L2 error | same argmax |",
        "| ---: | ---: | ---: | ---: | ---: | :---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['hit']} | {r['suffix']} | {r['replayed']} | {r['max_abs']:.3g} | {r['rel_l2']:.3g} | {'yes' if r['argmax_same'] else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], title: str, path: Path) -> bool:
    """Relative L2 error against hit position, one line per suffix length; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for s in sorted({r["suffix"] for r in rows}):
        pts = sorted((r["hit"], r["rel_l2"]) for r in rows if r["suffix"] == s)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"suffix {s}")
    window = rows[0]["window"]
    ax.axvline(window, color="grey", linestyle=":", label=f"window {window}")
    ax.set_xlabel("hit position (tokens)")
    ax.set_ylabel("rel L2 error of last logits")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _check_out(out: Path) -> Path:
    out = out.resolve()
    if out == RESULTS_TREE or RESULTS_TREE in out.parents:
        raise LabError(f"--out {out} is inside results/, which holds GPU-run reports; pass another directory")
    if out.exists() and not out.is_dir():
        raise LabError(f"--out {out} is a file; pass a directory")
    return out


def run(args: argparse.Namespace) -> int:
    cfg = load_preset(args.preset)
    hits, suffixes = parse_counts(args.hits, "--hits"), parse_counts(args.suffix, "--suffix")
    out = _check_out(args.out) if args.out is not None else None

    import torch

    from model.model import build_model, count_parameters
    from model.replay_error import ReplayErrorInput, check_points, replay_error_rows

    if count_parameters(cfg) > MAX_PARAMETERS:
        raise LabError(
            f"preset {cfg.name!r} has {count_parameters(cfg):,} parameters, too many for a float64 model on the CPU;"
            " use --preset tiny or small"
        )
    model = build_model(cfg, dtype=torch.float64, seed=args.seed)
    try:
        block = check_points(model, hits, suffixes, args.page_size)
        rows = [r.as_dict() for r in replay_error_rows(model, hits, suffixes, args.page_size, args.seed, ced=not args.no_ced)]
    except ReplayErrorInput as exc:
        raise LabError(str(exc)) from None
    doc = {
        "preset": cfg.name,
        "window": cfg.window,
        "page_size": args.page_size,
        "block_tokens": block,
        "ced": not args.no_ced,
        "seed": args.seed,
        "dtype": "float64",
        "command": getattr(args, "invocation", None),
        "rows": rows,
    }
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        stem = out / f"replay_{cfg.name}"
        stem.with_suffix(".json").write_text(json.dumps(doc, indent=2) + "\n")
        head = f"`{doc['command']}`: {cfg.name}, window {cfg.window}, page size {args.page_size}, float64, {'CED' if doc['ced'] else 'no CED'}\n\n"
        stem.with_suffix(".md").write_text(head + markdown_table(rows))
        plot(rows, f"{cfg.name}: bounded replay after a prefix hit (window {cfg.window})", stem.with_suffix(".png"))
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{cfg.name}: prefix hit + bounded replay vs exact prefill (float64, window {cfg.window}, block {block} tokens)")
    for col in ("hit", "suffix", "replayed", "max abs error", "rel L2 error", "same argmax"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["hit"]),
            str(r["suffix"]),
            str(r["replayed"]),
            f"{r['max_abs']:.3g}",
            f"{r['rel_l2']:.3g}",
            "yes" if r["argmax_same"] else "no",
        )
    Console().print(table)
    return 0
