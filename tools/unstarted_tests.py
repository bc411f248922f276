"""The tests a deadline-bound GPU run did not start, as pytest node ids, one per line: the next call's test list.

    python3 tools/unstarted_tests.py pytest_gpu.xml > /tmp/ids.txt
    PYTEST_IDS=/tmp/ids.txt OUT=$OUT bash tools/gpu_session.sh pytest

``tools/gpu_session.sh pytest`` runs under ``--deadline`` (tests/conftest.py): a test not started before it is reported as
skipped with the message "--deadline N s passed before this test started", and the junit file keeps its class and
name. This script turns exactly those entries (no other skip: a test skipped for a missing GPU or arch is not
"unstarted") back into node ids ``tests/test_x.py::name[params]``. Ids may contain spaces, so ``PYTEST_IDS`` is read
line by line, not split on blanks.

A run cut off at its time limit (SIGINT) writes no entry for the tests still queued in its workers: the junit file
cannot name them. ``--collected FILE`` (the run's ids, e.g. ``pytest --collect-only -q -m gpu tests/test_x.py``, lines
without ``::`` ignored) adds every collected id the file does not report at all:

    python3 -m pytest --collect-only -q -m gpu tests/test_compressor.py > /tmp/collected.txt
    python3 tools/unstarted_tests.py pytest_gpu.xml --collected /tmp/collected.txt > /tmp/ids.txt
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

DEADLINE_MARK = "passed before this test started"  # the skip message of tests/conftest.py's --deadline


def _read_cases(junit_xml: Path) -> list[ET.Element]:
    try:
        return list(ET.parse(junit_xml).getroot().iter("testcase"))
    except (OSError, ET.ParseError) as exc:
        raise SystemExit(f"unstarted_tests: cannot read junit file {junit_xml}: {exc}") from exc


def _node_id(case: ET.Element) -> str:
    """A junit test case's pytest node id: ``tests/test_x.py[::TestClass]::name[params]``."""
    module = case.get("classname", "")  # "tests.test_sparse_attn" (a test class would add ".TestX")
    parts = module.split(".")
    # the module path is the dotted prefix that names a file; the rest (if any) are test classes
    for cut in range(len(parts), 0, -1):
        path = Path(*parts[:cut]).with_suffix(".py")
        if cut == 1 or path.exists():
            break
    return "::".join([path.as_posix(), *parts[cut:], case.get("name", "")])


def unstarted_ids(junit_xml: Path) -> list[str]:
    """Node ids of the test cases the run skipped for its --deadline, in the file's order."""
    ids = []
    for case in _read_cases(junit_xml):
        skipped = case.find("skipped")
        if skipped is not None and DEADLINE_MARK in (skipped.get("message") or ""):
            ids.append(_node_id(case))
    return ids


def unreported_ids(junit_xml: Path, collected: list[str]) -> list[str]:
    """The ``collected`` node ids (in their order) that have no test case in the junit file at all."""
    # an entry without a classname is the run's own (pytest's interrupt or an internal error), not a test
    reported = {_node_id(case) for case in _read_cases(junit_xml) if case.get("classname")}
    return [node for node in collected if node not in reported]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("junit_xml", type=Path, help="the --junitxml file of a tools/gpu_session.sh pytest phase")
    parser.add_argument("--collected", type=Path, help="the run's collected node ids, one per line (pytest --collect-only -q)")
    args = parser.parse_args(argv)
    ids = unstarted_ids(args.junit_xml)
    unreported = []
    if args.collected:
        try:
            collected = [line.strip() for line in args.collected.read_text().splitlines() if "::" in line]
        except OSError as exc:
            raise SystemExit(f"unstarted_tests: cannot read the collected ids {args.collected}: {exc}") from exc
        unreported = unreported_ids(args.junit_xml, collected)  # disjoint from ids: a deadline skip is reported
    sys.stdout.write("".join(f"{node}\n" for node in ids + unreported))
    print(
        f"unstarted_tests: {len(ids)} tests not started in {args.junit_xml}"
        + (f", {len(unreported)} collected and not reported at all" if args.collected else ""),
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
