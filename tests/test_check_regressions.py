"""lab check's regression rule for stored winners (the GPU timing itself is exercised by `lab check` on a GPU)."""

from __future__ import annotations

import pytest
import yaml

from lab.matrix import Cell, regressions, stored_winner_cells
from tiles.core.arch import get_arch
from tiles.core.config_store import SCHEMA
from tiles.core.registry import get_tile


def _cell(label, ms, recorded=1.0, outcome="ok"):
    return Cell("t", "sm90", "s", label, outcome=outcome, extra={"ms": ms, "recorded_ms": recorded, "recorded_default_ms": 2.0})


@pytest.mark.parametrize(
    "tuned, default, regressed",
    [
        (_cell("tuned", 1.05), _cell("default", 2.0), None),
        (_cell("tuned", 1.25), _cell("default", 2.0), "recorded"),
        (_cell("tuned", 0.9), _cell("default", 0.5), "lost"),
        (_cell("tuned", None, outcome="wrong_result"), _cell("default", 2.0), "wrong_result"),
        # a 2-us kernel 15% over its record and over the default: 0.3 us, within the floor (session 25's fp4_quant_main)
        (_cell("tuned", 0.0021, recorded=0.00183), _cell("default", 0.00183), None),
        (_cell("tuned", 0.0031, recorded=0.00183), _cell("default", 0.0026), "recorded"),
    ],
    ids=[
        "within_tolerance",
        "slower_than_recorded",
        "slower_than_default_now",
        "wrong_result",
        "tiny_kernel_noise",
        "tiny_kernel_regressed",
    ],
)
def test_regression_rule(tuned, default, regressed):
    found = regressions([tuned, default], tolerance=0.10)
    if regressed is None:
        assert found == []
    else:
        assert len(found) >= 1 and regressed in found[0][1]


def test_stored_winner_cells_pair_each_winner_with_the_default(tmp_path):
    tile, arch = get_tile("fp4_quant_main"), get_arch("sm90")
    shape = tile.shapes()[0]
    winner = {**tile.default_config(arch), "threads": 128}
    doc = {
        "schema": SCHEMA,
        "tile": tile.name,
        "arch": "sm90",
        "environment": {},
        "shapes": {
            shape.name: {
                "phase": shape.phase,
                "dims": dict(shape.dims),
                "config": winner,
                "ms": 0.04,
                "default_ms": 0.05,
                "speedup": 1.25,
                "default_config": tile.default_config(arch),
            },
            "retired_shape": {"phase": "decode", "dims": {"rows": 3, "dim": 512}, "config": winner, "ms": 1.0, "default_ms": 1.0},
        },
    }
    (tmp_path / "sm90" / "tuned" / "h200").mkdir(parents=True)
    (tmp_path / "sm90" / "tuned" / "h200" / f"{tile.name}.yaml").write_text(yaml.safe_dump(doc))
    cells = stored_winner_cells([tile, get_tile("fp4_quant_index")], arch, "NVIDIA H200", root=tmp_path)
    assert [(c.label, c.shape) for c in cells] == [("tuned", shape.name), ("default", shape.name)]
    assert cells[0].config == winner and cells[1].config is None
    assert cells[0].extra == {"recorded_ms": 0.04, "recorded_default_ms": 0.05}


@pytest.mark.gpu
def test_lab_check_passes_on_the_gpu_present():
    """`pytest -m gpu` runs what `lab check` runs: every tile at every shape, and the stored winners, timed.

    Under ``pytest -n N`` it shares the GPU with N - 1 other workers: shapes whose working set exceeds
    half of this worker's share are skipped (listed, not failed). Unbounded, the 1M-entry indexer shapes
    held 131 GiB and ran every other worker out of memory on the H200."""
    import os

    import torch

    from lab.cli import main

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    share = torch.cuda.get_device_properties(0).total_memory / 2**30 / workers / 2
    assert main(["check", "--tile", "all", "--max-gib", f"{share:.1f}"]) == 0


def test_max_gib_skips_big_cells():
    from lab.commands.check import _over_budget

    big = Cell("indexer_topk", "sm90", "decode_b64_n1024k", "default")
    assert _over_budget(big, None) is None
    assert "--max-gib 4" in _over_budget(big, 4.0)
    assert _over_budget(Cell("fp4_quant_main", "sm90", "decode_b64", "default"), 4.0) is None


@pytest.mark.parametrize(
    ("speedup", "rematch", "unconfirmed"),
    [(1.003, None, "1.003x"), (1.003, {"kept": True}, None), (1.25, None, None), (1.008, None, "1.008x")],
)
def test_a_tie_stored_before_the_rematch_rule_is_unconfirmed(tmp_path, speedup, rematch, unconfirmed):
    """A stored winner with no rematch record and a recorded lead under tuning.rematch.REMATCH_MARGIN is flagged; a
    rematched one or a clear lead is not."""
    tile, arch = get_tile("fp4_quant_main"), get_arch("sm90")
    shape = tile.shapes()[0]
    entry = {
        "phase": shape.phase,
        "dims": dict(shape.dims),
        "config": {**tile.default_config(arch), "threads": 128},
        "ms": round(0.05 / speedup, 6),
        "default_ms": 0.05,
        "default_config": tile.default_config(arch),
    }
    if rematch is not None:
        entry["rematch"] = rematch
    doc = {"schema": SCHEMA, "tile": tile.name, "arch": "sm90", "environment": {}, "shapes": {shape.name: entry}}
    (tmp_path / "sm90" / "tuned" / "h200").mkdir(parents=True)
    (tmp_path / "sm90" / "tuned" / "h200" / f"{tile.name}.yaml").write_text(yaml.safe_dump(doc))
    tuned = stored_winner_cells([tile], arch, "NVIDIA H200", root=tmp_path)[0]
    assert tuned.extra.get("unconfirmed") == unconfirmed


def test_a_winner_borrowed_from_another_gpu_model_has_no_record_to_regress_from(tmp_path):
    """On an H100 with only H200 winners stored: the H200's winners are checked (they are what runs here) but carry no
    recorded latency, so being slower than the H200's record is not a regression, and losing to the default here is
    reported as a reason to tune this GPU (lost_here), not a regression. A wrong result still is one."""
    from lab.matrix import lost_here

    tile, arch = get_tile("fp4_quant_main"), get_arch("sm90")
    shape = tile.shapes()[0]
    entry = {"phase": shape.phase, "dims": dict(shape.dims), "config": {**tile.default_config(arch), "threads": 128}, "ms": 0.001}
    entry |= {"default_ms": 0.002, "default_config": tile.default_config(arch), "rematch": {"kept": True}}
    doc = {"schema": SCHEMA, "tile": tile.name, "arch": "sm90", "environment": {"gpu": "NVIDIA H200"}, "shapes": {shape.name: entry}}
    (tmp_path / "sm90" / "tuned" / "h200").mkdir(parents=True)
    (tmp_path / "sm90" / "tuned" / "h200" / f"{tile.name}.yaml").write_text(yaml.safe_dump(doc))

    tuned, default = stored_winner_cells([tile], arch, "NVIDIA H100 80GB HBM3", root=tmp_path)
    assert tuned.extra == {"borrowed": "h200"} and default.extra == {"borrowed": "h200"}
    tuned.outcome = default.outcome = "ok"
    tuned.extra["ms"], default.extra["ms"] = 0.010, 0.005  # 10x its H200 record, 2x the default here
    assert regressions([tuned, default]) == []
    assert "vs the default's 0.0050 ms here" in lost_here([tuned, default])[(tile.name, shape.name)]
    tuned.outcome, tuned.message = "wrong_result", "max error 1.0"
    assert [why for _, why in regressions([tuned, default])] == ["wrong_result: max error 1.0"]
    # the H200 itself compares with its records
    tuned, _ = stored_winner_cells([tile], arch, "NVIDIA H200", root=tmp_path)
    assert tuned.extra["recorded_ms"] == 0.001 and "borrowed" not in tuned.extra
