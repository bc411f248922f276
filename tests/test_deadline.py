"""``pytest --deadline``: tests that have not started when the deadline passes are skipped, so a GPU call's time
limit ends the run cleanly (with its report and junit file) instead of killing it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path


def test_tests_after_the_deadline_are_skipped_and_reported(tmp_path):
    (tmp_path / "conftest.py").write_text((Path(__file__).parent / "conftest.py").read_text())
    (tmp_path / "test_slow.py").write_text(
        textwrap.dedent(
            """
            import time

            def test_first():
                time.sleep(1.5)

            def test_second():
                pass
            """
        )
    )
    junit = tmp_path / "out.xml"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "--deadline", "1", f"--junitxml={junit}", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed, 1 skipped" in run.stdout and "--deadline 1 s passed" in run.stdout
    assert junit.exists() and 'skipped="1"' in junit.read_text()
