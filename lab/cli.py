"""``lab``: the command line.

Each subcommand lives in ``lab/commands/<name>.py`` and exposes ``add_arguments(parser)``
and ``run(args) -> int``; its module is imported only when that command is parsed, so ``lab --help``
imports neither torch nor TileLang. Errors a user can hit are raised as :class:`LabError` and
printed as one line, without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import math
import shlex
import sys

# (name, one-line help): the order is the order of `lab --help`.
COMMANDS: list[tuple[str, str]] = [
    ("model", "print a preset's layer map (region, ratio, mode, shared source)"),
    ("kv", "KV cache bytes per token and per-sequence state for a preset"),
    ("replay", "logits error of a prefix hit with SWA bounded replay against the exact prefill (CPU, float64)"),
    ("bench", "compile, check and time one tile against its torch reference"),
    ("check", "check every tile against the reference (or compile-only for any arch)"),
    ("tune", "autotune tiles for a GPU architecture with Optuna"),
    ("e2e", "end-to-end decode/prefill latency: tiles vs the torch baseline"),
    ("report", "regenerate reports and plots from results/"),
    ("sources", "hash (or write out) the CUDA source of each tile's kernels: what a no-op change must leave identical"),
]


class LabError(Exception):
    """An error caused by the user's input or machine, printed as one line naming the fix."""


class CommandParser(argparse.ArgumentParser):
    """A subcommand's parser that imports its module and adds the module's arguments only when that command is parsed
    or its help is shown: `lab --help` and each command import no other command's modules (several import torch and
    TileLang, which took `lab --help` to 1.6 s)."""

    def __init__(self, *args, command_module: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.command_module = command_module
        self._loaded = False

    def load(self) -> None:
        """Import the command's module and add its arguments (once)."""
        if not self._loaded:
            self._loaded = True
            module = importlib.import_module(self.command_module)
            module.add_arguments(self)
            self.set_defaults(_module=module)

    def parse_known_args(self, args=None, namespace=None):
        self.load()
        return super().parse_known_args(args, namespace)

    def format_usage(self) -> str:
        self.load()
        return super().format_usage()

    def format_help(self) -> str:
        self.load()
        return super().format_help()


def build_parser() -> argparse.ArgumentParser:
    """The ``lab`` parser; each command's module loads when that command is parsed (:class:`CommandParser`)."""
    parser = argparse.ArgumentParser(prog="lab", description="csa2-lab: CSA2/CED attention kernels, tuned per GPU architecture.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=CommandParser)
    for name, help_text in COMMANDS:
        sub.add_parser(name, help=help_text, description=help_text, command_module=f"lab.commands.{name}")
    return parser


# --- argument types: a bad number is refused while parsing, in one line ----------------------------


def _whole_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def positive_int(text: str) -> int:
    """``type=`` of a count that must be at least 1 (trials, workers, jobs)."""
    value = _whole_number(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive count: give 1 or more")
    return value


def non_negative_int(text: str) -> int:
    """``type=`` of a count where 0 means none (rematch rounds)."""
    value = _whole_number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative: give 0 or more")
    return value


def positive_seconds(text: str) -> float:
    """``type=`` of a time limit: a finite number of seconds above 0 (a negative or zero limit used to be accepted
    and then did nothing, or ended every trial at once)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a time limit: give a number of seconds above 0")
    return value


# Commands that compile kernels: TileLang logs while they run.
COMPILING = ("bench", "check", "tune", "e2e", "sources")


_STDERR_HANDLER = "csa2-lab: tilelang to stderr"


class _StderrHandler(logging.StreamHandler):
    """A stream handler bound to whatever ``sys.stderr`` is when a record is emitted (pytest swaps it)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def tilelang_logs_to_stderr() -> None:
    """Send TileLang's log records to stderr. It writes them with ``tqdm.write``, i.e. to stdout, where its
    compile lines landed in front of ``lab bench --json`` documents; stdout carries the command's output only."""
    import tilelang  # noqa: F401  (installs the handler this replaces)

    log = logging.getLogger("tilelang")
    if [h.get_name() for h in log.handlers] == [_STDERR_HANDLER]:
        return
    # TileLang installs its handler on import (again if re-imported): keep its format, drop every handler, add ours
    formatter = log.handlers[0].formatter if log.handlers else None
    for handler in list(log.handlers):
        log.removeHandler(handler)
    replacement = _StderrHandler()
    replacement.set_name(_STDERR_HANDLER)
    replacement.setFormatter(formatter)
    log.addHandler(replacement)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # what results files record as the command that made them: the arguments given here, also when main() is called
    # with a list (tests, scripts) rather than from the shell; a storage URL's password never leaves the process
    from tuning.credentials import mask_argv

    args.invocation = shlex.join(["lab", *mask_argv(sys.argv[1:] if argv is None else argv)])
    if args.command is None:
        parser.print_help()
        return 0
    if args.command in COMPILING:
        tilelang_logs_to_stderr()
    try:
        return int(args._module.run(args) or 0)
    except LabError as exc:
        print(f"lab {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"lab {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
