"""Two compile-only tuner processes against one study in a real PostgreSQL server: every config lands, none is done twice.

The server comes from ``CSA2_TEST_POSTGRES_URL`` (``.ci/postgres.sh`` starts one and prints it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import optuna
import pytest
import test_tuning_toys as toys

from tiles.core.arch import get_arch
from tuning.space import config_key
from tuning.study import counts_toward_budget, open_storage

URL = os.environ.get("CSA2_TEST_POSTGRES_URL")
REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(
    not URL, reason="CSA2_TEST_POSTGRES_URL is not set (run `export CSA2_TEST_POSTGRES_URL=$(bash .ci/postgres.sh)`)"
)


def test_two_compile_only_workers_share_one_study(tmp_path):
    name = "toy_scale:sm90:decode_n4k:compile"
    try:
        optuna.delete_study(study_name=name, storage=open_storage(URL))
    except KeyError:
        pass
    script = textwrap.dedent(
        f"""
        import sys
        sys.path[:0] = [{str(REPO)!r}, {str(REPO / "tests")!r}]
        import test_tuning_toys as toys
        from tiles.core.arch import get_arch
        from tuning.study import TuneOptions, tune
        if __name__ == "__main__":
            tune([toys.ScaleToy()], TuneOptions(arch=get_arch("sm90"), storage={URL!r}, compile_only=True, compile_jobs=2), "decode")
        """
    )
    (tmp_path / "worker.py").write_text(script)
    env = os.environ | {"TOY_BUILD_SLEEP": "0.2"}  # builds long enough that the two processes interleave
    procs = [subprocess.Popen([sys.executable, str(tmp_path / "worker.py")], env=env, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]

    study = optuna.load_study(study_name=name, storage=open_storage(URL))
    done = [t for t in study.get_trials() if counts_toward_budget(t) and "repeat_of" not in t.user_attrs]
    space = toys.ScaleToy().search_space(get_arch("sm90"))
    per_config = Counter(config_key(t.params) for t in done)
    assert set(per_config) == {config_key(c) for c in space.all_configs()}  # all trials landed
    assert max(per_config.values()) == 1  # none was compiled twice
    assert len({t.user_attrs["owner"] for t in done}) == 2  # both processes did part of the work
