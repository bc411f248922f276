"""tiles.core.dispatch: the one config path of the public functions (pick once per call shape, explicit configs
checked with the same clear error), and the host-time reference kernel (tiles.core.hostcost)."""

from __future__ import annotations

import pytest
import yaml

from tiles.core import dispatch
from tiles.core.arch import get_arch
from tiles.core.config_store import SCHEMA
from tiles.core.contract import Shape, TileError
from tiles.core.registry import get_tile

SM90 = get_arch("sm90")
DIMS = {"rows": 64, "dim": 512}


@pytest.fixture
def h200_winner(tmp_path, monkeypatch):
    """An H200 winner of fp4_quant_main at 64 rows in a results tree of its own; the dispatch cache starts empty."""
    tile = get_tile("fp4_quant_main")
    winner = {**tile.default_config(SM90), "threads": 128}
    entry = {"phase": "decode", "dims": DIMS, "config": winner, "ms": 0.001, "default_ms": 0.002}
    entry |= {"default_config": tile.default_config(SM90), "rematch": {"kept": True}}
    doc = {"schema": SCHEMA, "tile": tile.name, "arch": "sm90", "environment": {"gpu": "NVIDIA H200"}, "shapes": {"rows64": entry}}
    (tmp_path / "sm90" / "tuned" / "h200").mkdir(parents=True)
    (tmp_path / "sm90" / "tuned" / "h200" / f"{tile.name}.yaml").write_text(yaml.safe_dump(doc))
    monkeypatch.setenv("CSA2_RESULTS_DIR", str(tmp_path))
    dispatch.clear()
    yield tile, winner
    dispatch.clear()


def test_a_call_shape_is_resolved_once_then_served_from_the_cache(h200_winner, monkeypatch):
    tile, winner = h200_winner
    from tiles.core import config_store

    looked_up = []
    real = config_store.load_winner
    monkeypatch.setattr(config_store, "load_winner", lambda *a, **k: looked_up.append(k["gpu"]) or real(*a, **k))
    for _ in range(3):
        assert dispatch.call_config(tile, DIMS, SM90, "NVIDIA H100 80GB HBM3", None) == winner  # the H200's, nearest
    assert looked_up == ["NVIDIA H100 80GB HBM3"]
    assert dispatch.call_config(tile, {"rows": 1 << 20, "dim": 512}, SM90, "NVIDIA H100 80GB HBM3", None) == tile.default_config(SM90)
    assert len(looked_up) == 2  # another call shape is another key


def test_an_explicit_config_is_checked_with_a_clear_error(h200_winner):
    tile, _ = h200_winner
    assert dispatch.call_config(tile, DIMS, SM90, "NVIDIA H200", {"threads": 512})["threads"] == 512
    with pytest.raises(
        TileError, match=r"config \{'threads': 96\} is not valid for fp4_quant_main at \{'rows': 64, 'dim': 512\} on sm90: "
    ):
        dispatch.call_config(tile, DIMS, SM90, "NVIDIA H200", {"threads": 96})


def test_a_picked_config_is_fitted_to_a_row_width_it_does_not_divide(h200_winner):
    """fp4's per-thread mapping keeps whole groups per thread: a picked config at a width its vector does not divide
    runs one group per thread (Tile.fit_call); a caller's config there is refused instead."""
    tile, _ = h200_winner
    thread = {**tile.default_config(SM90), "mapping": "thread", "code": "divide", "groups_per_thread": 2}
    odd = {"rows": 5, "dim": 48}  # three groups of 16
    assert tile.fit_call(thread, Shape("call", "any", odd), SM90)["groups_per_thread"] == 1
    with pytest.raises(TileError, match="does not divide the 3 groups"):
        dispatch.call_config(tile, odd, SM90, "NVIDIA H200", thread)


def test_signature_tells_calls_apart_by_what_the_checks_look_at():
    import torch

    a = torch.zeros(4, 8)
    assert dispatch.signature(a, None) == dispatch.signature(torch.ones(4, 8), None)
    for other in (torch.zeros(4, 9), torch.zeros(4, 8, dtype=torch.float64), torch.zeros(8, 4).t()):
        assert dispatch.signature(other, None) != dispatch.signature(a, None)
    assert dispatch.signature(a, a) != dispatch.signature(a, None)


def test_the_host_time_reference_kernel_compiles_for_hopper():
    """The reference point of `lab bench`'s host column: a plain TileLang kernel of three tensors in, the output
    allocated by the kernel (TileLang's example call convention)."""
    from tiles.core.hostcost import reference_kernel

    src = reference_kernel("sm_90a").get_kernel_source()
    assert 'extern "C" __global__ void main_kernel(' in src
    for param in ("indices", "q", "kv", "out"):
        assert param in src.split("main_kernel(", 1)[1].split(")", 1)[0]


def test_the_cache_is_bounded(monkeypatch):
    """A serving process meets a new signature per prompt length: the oldest entries go past MAX_ENTRIES."""
    dispatch.clear()
    monkeypatch.setattr(dispatch, "MAX_ENTRIES", 3)
    built = [dispatch.plan(("p", n), lambda n=n: n) for n in range(5)]
    assert built == [0, 1, 2, 3, 4] and list(dispatch._CACHE) == [("p", 2), ("p", 3), ("p", 4)]
    dispatch.clear()
