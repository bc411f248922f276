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

# The phases whose profile lists are parsed: ``profile`` (its default list) always, ``queued`` (the next session's
# list, when one is written) where gpu/session.sh defines it.
PROFILE_PHASES = ("profile", "queued")
REQUIRED_PHASES = ("profile",)


def _phase_bodies() -> dict[str, str]:
    """The bodies of the phases in PROFILE_PHASES that gpu/session.sh defines (a required one missing is an error)."""
    text = (ROOT / "gpu" / "session.sh").read_text()
    bodies = {}
    for phase in PROFILE_PHASES:
        m = re.search(rf"^phase_{phase}\(\) {{.*?^}}", text, re.DOTALL | re.MULTILINE)
        if m:
            bodies[phase] = m.group(0)
        elif phase in REQUIRED_PHASES:
            raise AssertionError(f"gpu/session.sh has no phase_{phase}")
    return bodies


def _specs(body: str) -> list[str]:
    """Every TILE:SHAPE[:JSON] token of a phase body."""
    names = "|".join(sorted(all_tiles(), key=len, reverse=True))
    return [m.group(0) for m in re.finditer(rf"\b(?:{names}):[a-z0-9_]+(?::\{{[^'\s]*\}})?", body)]


BODIES = _phase_bodies()
SPECS = [spec for body in BODIES.values() for spec in _specs(body)]


def test_the_session_has_profile_specs():
    # the default profile list's 9 specs (the pattern also reads the example in the phase's comment): it finds them
    assert len(_specs(BODIES["profile"])) >= 9
    # a queued phase that hands the profiler a list: the pattern finds at least one spec in it
    if "PROFILE_ARGS" in BODIES.get("queued", ""):
        assert _specs(BODIES["queued"])


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


def _attn_labels(text: str) -> set[str]:
    """The attention labels a session.sh text names as ATTN_LABELS defaults (``ATTN_LABELS=...`` or ``${ATTN_LABELS:-...}``)."""
    return {label for m in re.finditer(r"ATTN_LABELS(?::-|=)([a-z0-9_,]+)", text) for label in m.group(1).split(",")}


def test_session_attention_labels_exist():
    """The attention labels gpu/session.sh names (ATTN_LABELS defaults in its phases) are labels of the check script."""
    # the pattern reads both forms (a session may name none: the attn phase then runs every label)
    assert _attn_labels("ATTN_LABELS=${ATTN_LABELS:-default,bi32} phase_attn") == {"default", "bi32"}
    named = _attn_labels((ROOT / "gpu" / "session.sh").read_text())
    assert named <= set(sparse_attn_check.LABELS), named - set(sparse_attn_check.LABELS)
