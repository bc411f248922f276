"""`lab bench`: compile, check and time one tile at its shapes against its torch reference.

Measures the device copy bandwidth once, then per shape: compile, check against the
reference (fresh inputs, outputs poisoned, run twice bitwise equal), time with CUDA events
on rotating input sets, and time the torch reference in the same run. A shape whose check
failed gets no speed. ``--json`` prints the rows with the environment and the command line.
"""

from __future__ import annotations

import argparse
import json
import sys

from lab.cli import LabError
from tiles.core.arch import ArchError, require_present, resolve
from tiles.core.contract import Config, Tile, TileError
from tiles.core.registry import get_tile


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tile", required=True, help="tile name (see `lab check --compile-only --arch sm90`)")
    parser.add_argument("--shape", default="all", help="a shape name of the tile, or 'all'")
    parser.add_argument(
        "--config",
        default=None,
        help="config overrides: JSON ('{\"threads\": 128}') or k=v,k=v; or 'tuned': each shape's stored winner "
        "(results/<arch>/<tile>.yaml; the default where none applies)",
    )
    parser.add_argument("--arch", default="auto", help="'auto' (the GPU present) or its name, e.g. sm90")
    parser.add_argument("--runs", type=int, default=50, help="timed runs per shape (median reported)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the check and timing inputs")
    parser.add_argument("--json", action="store_true", help="print a JSON document instead of a table")
    parser.add_argument(
        "--save",
        action="store_true",
        help="merge the rows into results/<arch>/bench/<tile>[_tuned].json (one row per shape and GPU model: the "
        "latest) and render bench.md again; with the default config or --config tuned only",
    )


def parse_config(text: str | None) -> Config:
    """``'{"threads": 128}'`` or ``threads=128,staging=shared`` -> dict; numbers become ints/floats."""
    if not text:
        return {}
    text = text.strip()
    if text.startswith(("{", "[")):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise LabError(f"--config is not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(value, dict):
            raise LabError("--config JSON must be an object such as '{\"threads\": 128}'")
        return value
    config: Config = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, raw = part.partition("=")
        if not sep or not key.strip():
            raise LabError(f"--config item {part!r} is not key=value")
        config[key.strip()] = _scalar(raw.strip())
    return config


def _scalar(raw: str):
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(raw.lower(), raw)


def _shapes(tile: Tile, name: str):
    if name == "all":
        return tile.shapes()
    try:
        return [tile.shape(n.strip()) for n in name.split(",") if n.strip()]
    except TileError as exc:
        raise LabError(str(exc)) from None


def shape_configs(tile: Tile, arch, shapes: list, config_text: str | None, root=None, gpu: str | None = None) -> list[tuple[Config, str]]:
    """(config, where it came from) per shape: ``--config`` over the tile's default ("override"/"default"), or with
    ``tuned`` each shape's stored winner for GPU model ``gpu`` by :func:`tiles.core.config_store.load_winner` (its source:
    the winner's file and bucket, the nearest model's when ``gpu`` has none, or why the default runs); every config
    checked against the search space at its shape (a :class:`LabError` if not)."""
    if (config_text or "").strip() == "tuned":
        from tiles.core.config_store import ResultsError, load_winner

        try:
            pairs = [load_winner(tile.name, arch, shape, root=root, gpu=gpu) for shape in shapes]
        except ResultsError as exc:
            raise LabError(str(exc)) from None
        pairs = [(tile.with_defaults(arch, config), source) for config, source in pairs]
    else:
        overrides = parse_config(config_text)
        config = tile.with_defaults(arch, overrides)
        pairs = [(config, "override" if overrides else "default")] * len(shapes)
    for shape, (config, _) in zip(shapes, pairs, strict=True):
        bad = tile.search_space(arch).violations(config, shape, arch)
        if bad:
            raise LabError(f"config {config} is invalid for {tile.name} at shape {shape.name}: {'; '.join(bad)}")
    return pairs


def run(args: argparse.Namespace) -> int:
    try:
        tile = get_tile(args.tile)
    except TileError as exc:
        raise LabError(str(exc)) from None
    shapes = _shapes(tile, args.shape)
    tuned = (args.config or "").strip() == "tuned"
    if not tuned and parse_config(args.config) and args.save:  # a malformed --config is reported before the GPU is looked for
        raise LabError("--save stores the default config's or the stored winners' figures (--config tuned), not an experiment's")
    if args.runs < 1:
        raise LabError(f"--runs must be at least 1, got {args.runs}")
    try:
        arch = resolve(args.arch)
        require_present(arch)
    except ArchError as exc:
        raise LabError(f"{exc}; `lab bench` times on a GPU (use `lab check --compile-only` to only compile)") from None
    from tiles.core.gpu import present_gpu

    configs = shape_configs(tile, arch, shapes, args.config, gpu=present_gpu())

    from tiles.core.harness import evaluate, time_reference
    from tiles.core.hostcost import tilelang_call_us
    from tiles.core.timing import describe_environment, device_copy_bandwidth

    copy_bw = device_copy_bandwidth()
    rows = []
    for shape, (config, source) in zip(shapes, configs, strict=True):
        ev = evaluate(tile, shape, config, arch, seed=args.seed, runs=args.runs)
        row = {
            "shape": shape.name,
            "dims": dict(shape.dims),
            "config": config,
            "config_source": source,
            "outcome": ev.outcome,
            "check": ev.message or "ok",
            "compile_s": ev.compile_s,
            "flops": tile.flops(shape),
            "bytes": tile.bytes_moved(shape),
        }
        if ev.ok:
            ref_ms = time_reference(tile, shape, seed=args.seed)
            row.update(
                ms=ev.ms,
                p10_ms=ev.p10_ms,
                p90_ms=ev.p90_ms,
                timing=ev.extra.get("timing"),
                eager_ms=ev.extra.get("eager_ms"),
                gbps=ev.gbps,
                tflops=ev.tflops,
                copy_fraction=ev.gbps * 1e9 / copy_bw,
                ref_ms=ref_ms,
                speedup=ref_ms / ev.ms if ref_ms else None,
            )
            row.update(_host_time(tile, shape, config, args.seed))
        rows.append(row)
        if not args.json:
            print(f"  {shape.name}: {ev.outcome}", file=sys.stderr)

    doc = {
        "tile": tile.name,
        "arch": arch.name,
        "config": configs[0][0] if all(c == configs[0][0] for c, _ in configs) else None,  # per row otherwise
        "command": args.invocation,
        "environment": describe_environment(),
        "copy_gbps": copy_bw / 1e9,
        "tilelang_call_us": tilelang_call_us(arch),
        "rows": rows,
    }
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        _print_table(doc)
    if args.save:
        _save(doc, arch, tuned)
    return 0 if all(r["outcome"] == "ok" for r in rows) else 1


def _host_time(tile: Tile, shape, config: Config, seed: int) -> dict:
    """``host_us``: CPU microseconds per call of the tile's public function at ``shape`` with ``config``
    (:func:`tiles.core.hostcost.host_us`); None for a tile without one, or with why the call failed."""
    from tiles.core.hostcost import host_us

    inputs = tile.make_inputs(shape, seed)
    call = tile.public_call(shape, inputs, config)
    if call is None:
        return {"host_us": None}
    try:
        return {"host_us": host_us(call)}
    except TileError as exc:  # the public function picks another tile at this shape, say: no host figure for this one
        return {"host_us": None, "host_note": str(exc)}


def _save(doc: dict, arch, tuned: bool) -> None:
    """Merge the run into the results tree and render its bench.md again (lab.results_store)."""
    from lab.results_store import merge_bench
    from lab.summaries import bench_markdown
    from tiles.core.config_store import results_dir
    from tuning.export import write_atomic

    arch_dir = results_dir() / arch.name
    path = merge_bench(doc, arch_dir, tuned)
    write_atomic(arch_dir / "bench.md", bench_markdown(sorted(arch_dir.glob("bench/*.json"))))
    print(f"saved {path} and {arch_dir / 'bench.md'}", file=sys.stderr)


def _print_table(doc: dict) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    any_flops = any(r["flops"] for r in doc["rows"])
    table = Table(title=f"lab bench {doc['tile']} on {doc['environment'].get('gpu', doc['arch'])} (copy {doc['copy_gbps']:.0f} GB/s)")
    cols = (
        ["shape", "ms", "per-call ms", "host us", "GB/s"] + (["TFLOPS"] if any_flops else []) + ["of copy", "torch ms", "speedup", "check"]
    )
    for col in cols:
        table.add_column(col, justify="left" if col in ("shape", "check") else "right")
    for r in doc["rows"]:
        if r["outcome"] != "ok":
            cells = (
                [r["shape"], "-", "-", "-", "-"]
                + (["-"] if any_flops else [])
                + ["-", "-", "-", f"[red]{r['outcome']}: {escape(r['check'])}[/red]"]
            )
        else:
            tf = [f"{r['tflops']:.1f}" if r["tflops"] else "-"] if any_flops else []
            ref = f"{r['ref_ms']:.4f}" if r["ref_ms"] else "n/a"
            sp = f"{r['speedup']:.1f}x" if r["speedup"] else "n/a"
            eager = f"{r['eager_ms']:.4f}" if r.get("eager_ms") else "-"
            host = f"{r['host_us']:.1f}" if r.get("host_us") is not None else "-"
            cells = (
                [r["shape"], f"{r['ms']:.4f}", eager, host, f"{r['gbps']:.0f}"]
                + tf
                + [f"{100 * r['copy_fraction']:.0f}%", ref, sp, "[green]ok[/green]"]
            )
        table.add_row(*cells)
    console = Console()
    console.print(table)
    for r in doc["rows"]:
        console.print(f"{r['shape']}: config ({r['config_source']}) {r['config']}", highlight=False)
    console.print("ms: device time per launch, replayed from a CUDA graph (per call where the launch cannot be captured);", highlight=False)
    console.print("per-call ms: each launch between its own events, the host's launch overhead included.", highlight=False)
    if doc.get("tilelang_call_us") is not None:
        console.print(
            f"host us: CPU time per call of the public function (checks, config, allocation, launch); a plain TileLang kernel "
            f"call costs {doc['tilelang_call_us']:.1f} us here (tiles.core.hostcost).",
            highlight=False,
        )
