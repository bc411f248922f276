"""The lab installed like a library (``pip install .``, not editable): the wheel ships the tuned configs and a stored
winner is found from outside any source tree."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "setup.py", "README.md", "lab", "tiles", "tuning", "model", "results")

# Run by the installed copy, from a folder that is no source tree: which copy of the lab loaded, and the winner it
# finds for the H200 at a shape that was tuned there.
PROBE = """
import json, sys
import tiles
from tiles.core.arch import get_arch
from tiles.core.config_store import load_winner, results_dir, tuned_roots
from tiles.core.registry import get_tile

tile = get_tile("sparse_attn_decode")
config, source = load_winner(tile.name, get_arch("sm90"), tile.shape("decode_b64_s1"), gpu="NVIDIA H200")
print(json.dumps({"tiles": tiles.__file__, "source": source, "config": config, "roots": [str(r) for r in tuned_roots()]}))
"""


def _copy_sources(dest: Path) -> None:
    """What the wheel is built from: the tracked sources, without local state (studies, logs) or build leftovers."""
    ignore = shutil.ignore_patterns("__pycache__", "*.db*", "*.log", "*.egg-info", "build")
    for name in SOURCES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        else:
            shutil.copy2(src, dest / name)


def test_the_wheel_ships_the_tuned_configs_and_loads_them(tmp_path):
    src, wheels, venv, elsewhere = (tmp_path / n for n in ("src", "wheels", "venv", "elsewhere"))
    src.mkdir()
    elsewhere.mkdir()
    _copy_sources(src)
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(src)]
    subprocess.run(build, check=True, capture_output=True, timeout=300)
    (wheel,) = wheels.glob("csa2_lab-*.whl")

    # A fresh venv that sees this environment's packages (torch, yaml) but not the lab's source tree: a .pth of the
    # plain site-packages folders, whose own .pth files (an editable install's finder) are not processed.
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=300)
    python = venv / "bin" / "python"
    venv_site = Path(
        subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip()
    )
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *sys.path}
    deps = [p for p in deps if p.endswith("-packages") and Path(p).is_dir()]
    (venv_site / "zz_lab_deps.pth").write_text("\n".join(deps) + "\n")
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True, capture_output=True, timeout=300
    )

    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}  # no CSA2_RESULTS_DIR, no PYTHONPATH
    out = subprocess.run([python, "-c", PROBE], cwd=elsewhere, env=env, check=True, capture_output=True, text=True, timeout=300)
    found = __import__("json").loads(out.stdout.strip().splitlines()[-1])
    assert Path(found["tiles"]).is_relative_to(venv_site), found["tiles"]  # the installed copy, not the source tree
    assert found["roots"] == [str(elsewhere / "results"), str(venv_site / "csa2_lab_results")]
    assert found["source"] == "tuned:csa2_lab_results/sm90/tuned/h200/sparse_attn_decode.yaml#decode_b64_s1", found
    stored = __import__("yaml").safe_load((REPO / "results/sm90/tuned/h200/sparse_attn_decode.yaml").read_text())
    assert found["config"] == stored["shapes"]["decode_b64_s1"]["config"]
