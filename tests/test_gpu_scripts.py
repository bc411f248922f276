"""The GPU session's queued specs are valid on the CPU: a typo must not cost a device call.

Device time is scarce (one batched call per session), so every ``TILE:SHAPE[:CONFIG_JSON]`` that
``gpu/session.sh`` hands to ``gpu/profile_tiles.py`` is parsed, validated (tile, shape, config keys) and checked
against the tile's constraints for sm90 here, with the config merged over the default as the profiler does.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tiles.arch import get_arch
from tiles.registry import all_tiles, get_tile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "gpu"))

import profile_tiles  # gpu/ is not a package: imported from the path above
import sparse_attn_check


def _session_specs() -> list[str]:
    """Every TILE:SHAPE[:JSON] token of the profile lists in gpu/session.sh (the phases ``profile`` and ``queued``)."""
    text = (ROOT / "gpu" / "session.sh").read_text()
    bodies = [re.search(rf"^phase_{phase}\(\) {{.*?^}}", text, re.DOTALL | re.MULTILINE).group(0) for phase in ("profile", "queued")]
    names = "|".join(sorted(all_tiles(), key=len, reverse=True))
    return [m.group(0) for body in bodies for m in re.finditer(rf"\b(?:{names}):[a-z0-9_]+(?::\{{[^'\s]*\}})?", body)]


SPECS = _session_specs()


def test_the_session_has_profile_specs():
    assert len(SPECS) >= 10  # the default profile list (9 specs) and the queued one: the pattern finds them


@pytest.mark.parametrize("text", SPECS)
def test_session_profile_spec_is_valid_for_sm90(text):
    spec = profile_tiles.parse_spec(text)
    profile_tiles.validate([spec])
    tile, arch = get_tile(spec.tile), get_arch("sm90")
    config = tile.with_defaults(arch, spec.config)
    assert tile.search_space(arch).violations(config, tile.shape(spec.shape), arch) == [], text


@pytest.mark.parametrize("row", sparse_attn_check.CHECKS, ids=lambda r: f"{r[0]}-{r[1] if isinstance(r[1], str) else r[1][0]}-{r[2]}")
def test_attention_check_row_is_valid_for_sm90(row):
    """Every (tile, shape, label) gpu/sparse_attn_check.py compiles, checks and times: the label exists and its
    config, merged over the default as the script does, passes sm90's constraints at that shape."""
    tile_name, spec, label = row
    tile, arch = get_tile(tile_name), get_arch("sm90")
    config = tile.with_defaults(arch, sparse_attn_check.LABELS[label])
    assert tile.search_space(arch).violations(config, sparse_attn_check._shape(tile, spec), arch) == [], row


def test_queued_attention_labels_exist():
    """The attention labels gpu/session.sh names (ATTN_LABELS defaults in its phases) are labels of the check script."""
    text = (ROOT / "gpu" / "session.sh").read_text()
    named = {label for m in re.finditer(r"ATTN_LABELS(?::-|=)([a-z0-9_,]+)", text) for label in m.group(1).split(",")}
    assert named <= set(sparse_attn_check.LABELS), named - set(sparse_attn_check.LABELS)
