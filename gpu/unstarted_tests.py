"""The tests a deadline-bound GPU run did not start, as pytest node ids, one per line: the next call's test list.

    python3 gpu/unstarted_tests.py results/sm90/pytest_gpu_run92.xml > /tmp/ids.txt
    PYTEST_IDS=/tmp/ids.txt OUT=$OUT bash gpu/session.sh pytest

``gpu/session.sh pytest`` runs under ``--deadline`` (tests/conftest.py): a test not started before it is reported as
skipped with the message "--deadline N s passed before this test started", and the junit file keeps its class and
name. This script turns exactly those entries (no other skip: a test skipped for a missing GPU or arch is not
"unstarted") back into node ids ``tests/test_x.py::name[params]``. Ids may contain spaces, so ``PYTEST_IDS`` is read
line by line, not split on blanks.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

DEADLINE_MARK = "passed before this test started"  # the skip message of tests/conftest.py's --deadline


def unstarted_ids(junit_xml: Path) -> list[str]:
    """Node ids of the test cases the run skipped for its --deadline, in the file's order."""
    try:
        root = ET.parse(junit_xml).getroot()
    except (OSError, ET.ParseError) as exc:
        raise SystemExit(f"unstarted_tests: cannot read junit file {junit_xml}: {exc}") from exc
    ids = []
    for case in root.iter("testcase"):
        skipped = case.find("skipped")
        if skipped is None or DEADLINE_MARK not in (skipped.get("message") or ""):
            continue
        module = case.get("classname", "")  # "tests.test_sparse_attn" (a test class would add ".TestX")
        parts = module.split(".")
        # the module path is the dotted prefix that names a file; the rest (if any) are test classes
        for cut in range(len(parts), 0, -1):
            path = Path(*parts[:cut]).with_suffix(".py")
            if cut == 1 or path.exists():
                break
        node = "::".join([path.as_posix(), *parts[cut:], case.get("name", "")])
        ids.append(node)
    return ids


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("junit_xml", type=Path, help="the --junitxml file of a gpu/session.sh pytest phase")
    args = parser.parse_args(argv)
    ids = unstarted_ids(args.junit_xml)
    sys.stdout.write("".join(f"{node}\n" for node in ids))
    print(f"unstarted_tests: {len(ids)} tests not started in {args.junit_xml}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
