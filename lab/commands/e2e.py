"""`lab e2e`: end-to-end decode and prefill latency of the complete model, tiles vs the torch baseline."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lab.cli import LabError


def parse_tokens(text: str) -> list[int]:
    """``"8K,32K,131072"`` -> [8192, 32768, 131072]."""
    out = []
    for given in text.split(","):
        part = given.strip().upper()
        if not part:
            continue
        mult = 1024 if part.endswith("K") else 1024 * 1024 if part.endswith("M") else 1
        try:
            out.append(int(part.rstrip("KM")) * mult)
        except ValueError:
            raise LabError(f"cannot read {given.strip()!r} as a token count: write e.g. 8K,32K,131072") from None
    return out


# --phase names -> the runs of lab.e2e.run (prefill = CED, prefill_full = every layer over every token); one of the
# two prefills alone exists because a torch non-CED 64K prefill takes minutes
PHASE_RUNS = {
    "decode": ["decode"],
    "decode_mixed": ["decode_mixed"],
    "prefill": ["prefill", "prefill_full"],
    "prefill_ced": ["prefill"],
    "prefill_full": ["prefill_full"],
    "multiturn": ["multiturn"],
}


def parse_range(text: str) -> tuple[int, int]:
    """``"8K:64K"`` -> (8192, 65536): the shortest and longest sequence of a mixed-length batch."""
    parts = [parse_tokens(p) for p in text.split(":")]
    if len(parts) != 2 or any(len(p) != 1 for p in parts):
        raise LabError(f"--mixed takes a range LO:HI of token counts, e.g. 8K:64K, got {text!r}")
    (lo,), (hi,) = parts
    if not 1 <= lo <= hi:
        raise LabError(f"--mixed {text}: need 1 <= LO <= HI tokens")
    return lo, hi


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="v4.1-flash")
    parser.add_argument(
        "--phase",
        default="decode,prefill",
        help="decode, decode_mixed (lengths spread over --mixed, paged cache), prefill (prefill times CED and non-CED;"
        " prefill_ced or prefill_full: one of them) and/or multiturn (turn 2 of a conversation after --prefix tokens: pure"
        " continuation, bounded replay from HBM pages, from disk pages, and a cold prefill)",
    )
    parser.add_argument("--ctx", default="8K,32K,128K", help="contexts (decode) and prompt lengths (prefill)")
    parser.add_argument("--prefill-ctx", default=None, help="prompt lengths for prefill when they differ from --ctx")
    parser.add_argument(
        "--mixed", default="8K:64K", help="decode_mixed: the range LO:HI of sequence lengths, spread evenly over each --batch"
    )
    parser.add_argument("--prefix", default="64K", help="multiturn: tokens of turn 1 (the cached prefix)")
    parser.add_argument("--suffix", default="1K", help="multiturn: new tokens of turn 2")
    parser.add_argument("--disk", default=None, metavar="DIR", help="multiturn: the disk tier's directory (default: a temporary one)")
    parser.add_argument("--batch", default="1,16,64", help="decode batch sizes (prefill runs at batch 1)")
    parser.add_argument("--backend", default="torch,tiles")
    parser.add_argument("--configs", default="tuned,default", help="tiles configs: tuned, default or both")
    parser.add_argument("--runs", type=int, default=20, help="timed decode steps (median)")
    parser.add_argument("--repeats", type=int, default=2, help="timed prefill runs (best of), after an untimed warm-up at a short prompt")
    parser.add_argument(
        "--out", default=None, help="directory for e2e.json/.md/.png (default: the results tree, results/<arch>/e2e/<gpu>.json and e2e.md)"
    )
    parser.add_argument("--json", action="store_true", help="print the JSON document")


def variants_from(backends: str, configs: str):
    from lab.e2e.run import Variant

    out = []
    for b in [x.strip() for x in backends.split(",") if x.strip()]:
        if b == "torch":
            out.append(Variant("torch"))
        elif b == "tiles":
            for c in [x.strip() for x in configs.split(",") if x.strip()]:
                if c not in ("tuned", "default"):
                    raise LabError(f"--configs takes tuned and/or default, not {c!r}")
                out.append(Variant("tiles", c))
        else:
            raise LabError(f"unknown backend {b!r}: use torch and/or tiles")
    if not out:
        raise LabError("no backend to time: pass --backend torch,tiles")
    # the torch baseline goes first so every other backend's logits are compared with it
    return sorted(out, key=lambda v: v.backend != "torch")


def parse_turns(prefix: str, suffix: str) -> tuple[int, int]:
    """``--prefix 64K --suffix 1K`` -> (65536, 1024): turn 1's tokens and turn 2's new ones, each at least 1."""
    counts = []
    for flag, text in (("--prefix", prefix), ("--suffix", suffix)):
        got = parse_tokens(text)
        if len(got) != 1 or got[0] < 1:
            raise LabError(f"{flag} takes one token count of at least 1, e.g. {flag} 64K, got {text!r}")
        counts.append(got[0])
    return counts[0], counts[1]


def _check_lengths(
    cfg, phases: list[str], contexts: list[int], prompts: list[int], mixed: tuple[int, int], turns: tuple[int, int] = (1, 1)
) -> None:
    """Refuse, before any GPU work, a context or prompt longer than the preset allows (the model's own check)."""
    from lab.e2e.run import DECODE_HEADROOM
    from model.inputs import InputError, check_length

    try:
        if "decode" in phases:
            what = f"--ctx {max(contexts)} (a decode run holds the context and {DECODE_HEADROOM} more tokens)"
            check_length(max(contexts) + DECODE_HEADROOM, cfg, what)
        if "decode_mixed" in phases:
            what = f"--mixed up to {mixed[1]} (a decode run holds the context and {DECODE_HEADROOM} more tokens)"
            check_length(mixed[1] + DECODE_HEADROOM, cfg, what)
        if any(p.startswith("prefill") for p in phases):
            check_length(max(prompts), cfg, f"prompt of {max(prompts)} tokens")
        if "multiturn" in phases:
            check_length(sum(turns), cfg, f"turn 2 of --prefix {turns[0]} and --suffix {turns[1]} tokens")
    except InputError as exc:
        raise LabError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    import torch

    from lab.e2e.report import render_markdown, write_report, write_to_results
    from lab.e2e.run import run_e2e
    from model import ConfigError, preset
    from model.inputs import InputError
    from tiles.core.arch import ArchError, detect
    from tiles.core.config_store import results_dir
    from tiles.core.timing import describe_environment

    try:
        cfg = preset(args.preset)
    except ConfigError as exc:
        raise LabError(str(exc)) from None
    phases = []
    for p in [x.strip() for x in args.phase.split(",") if x.strip()]:
        if p not in PHASE_RUNS:
            raise LabError(
                f"unknown phase {p!r}: use decode, decode_mixed, prefill (CED and non-CED), prefill_ced, prefill_full or multiturn"
            )
        phases += PHASE_RUNS[p]
    variants = variants_from(args.backend, args.configs)
    contexts, batches = parse_tokens(args.ctx), parse_tokens(args.batch)
    prompts = parse_tokens(args.prefill_ctx) if args.prefill_ctx else contexts
    mixed = parse_range(args.mixed)
    turns = parse_turns(args.prefix, args.suffix)
    _check_lengths(cfg, phases, contexts, prompts, mixed, turns)
    if not torch.cuda.is_available():
        raise LabError("no CUDA GPU is present: lab e2e times the model on a GPU (run it on a GPU machine)")
    try:
        arch = detect()
    except ArchError as exc:
        raise LabError(str(exc)) from None
    meta = describe_environment() | {"preset": args.preset, "arch": arch.name, "command": args.invocation}
    if args.out:
        out_dir = Path(args.out)

        def save(doc: dict) -> list[Path]:
            return write_report(doc, out_dir)
    else:  # the lab's results tree: e2e/<gpu>.json, its plots, and e2e.md over every GPU model (lab.results_store)
        arch_dir = results_dir() / arch.name

        def save(doc: dict) -> list[Path]:
            return write_to_results(doc, arch_dir)

    def document(rows) -> dict:
        return {"kind": "csa2-lab/e2e", "meta": meta, "rows": [r.to_dict() for r in rows]}

    try:
        rows = run_e2e(
            args.preset,
            phases,
            contexts,
            batches,
            variants,
            args.runs,
            args.repeats,
            prompts,
            log=lambda m: print(m, file=sys.stderr),
            on_rows=lambda rows: save(document(rows)),
            mixed=mixed,
            multiturn=turns,
            disk_dir=args.disk,
        )
    except InputError as exc:  # a length or token check of the model that the checks above did not foresee
        raise LabError(str(exc)) from None
    doc = document(rows)
    written = save(doc)
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        from rich.console import Console
        from rich.markdown import Markdown

        Console().print(Markdown(render_markdown(doc)))
    print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    return 0
