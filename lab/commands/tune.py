"""`lab tune`: not available yet."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    print("lab tune: not available yet (it lands with its issue)", file=sys.stderr)
    return 2
