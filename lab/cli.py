"""``lab``: the command line.

Each subcommand lives in ``lab/commands/<name>.py`` and exposes ``add_arguments(parser)``
and ``run(args) -> int``. Errors a user can hit are raised as :class:`LabError` and
printed as one line, without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import shlex
import sys

# (name, one-line help): the order is the order of `lab --help`.
COMMANDS: list[tuple[str, str]] = [
    ("model", "print a preset's layer map (region, ratio, mode, shared source)"),
    ("kv", "KV cache bytes per token and per-sequence state for a preset"),
    ("bench", "compile, check and time one tile against its torch reference"),
    ("check", "check every tile against the reference (or compile-only for any arch)"),
    ("tune", "autotune tiles for a GPU architecture with Optuna"),
    ("e2e", "end-to-end decode/prefill latency: tiles vs the torch baseline"),
    ("report", "regenerate reports and plots from results/"),
    ("sources", "hash (or write out) the CUDA source of each tile's kernels: what a no-op change must leave identical"),
]


class LabError(Exception):
    """An error caused by the user's input or machine, printed as one line naming the fix."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lab", description="csa2-lab: CSA2/CED attention kernels, tuned per GPU architecture.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in COMMANDS:
        module = importlib.import_module(f"lab.commands.{name}")
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_module=module)
    return parser


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
    # with a list (tests, scripts) rather than from the shell
    args.invocation = shlex.join(["lab", *(sys.argv[1:] if argv is None else argv)])
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
