"""The correctness gate of tiles.core.harness.check_and_time, on CPU: a fake tile whose "kernel" is python, with the timing
functions and CUDA synchronisation stubbed out, so that each way a kernel can be wrong is exercised without a GPU."""

from __future__ import annotations

import types

import pytest
import torch

from tiles.core import harness
from tiles.core.arch import get_arch
from tiles.core.contract import Comparison, Shape, Tile, poisoned

SHAPE = Shape("n64", "decode", {"N": 64})


class CountingTile(Tile):
    """Writes x + 1; from launch number ``flip_at`` on (1-based), one element is off by one ulp-sized step."""

    name = "toy_counting"

    def __init__(self, flip_at: int | None = None, keeps_buffers: bool = True):
        self.flip_at = flip_at
        self.launches = 0
        self.keeps_buffers = keeps_buffers

    def make_inputs(self, shape, seed, device="cuda"):
        return {"x": torch.arange(shape["N"], dtype=torch.float32) + seed}

    def alloc_outputs(self, kernel, inputs):
        return {"y": poisoned(inputs["x"].shape, torch.float32, "cpu")}

    def launch(self, kernel, inputs, outputs):
        self.launches += 1
        outputs["y"].copy_(inputs["x"] + 1)
        if self.flip_at is not None and self.launches >= self.flip_at:
            outputs["y"][3] += 0.5

    def times_launch_only(self) -> bool:
        return self.keeps_buffers

    def reference(self, inputs):
        return {"y": inputs["x"] + 1}

    def compare(self, outputs, expected):
        err = (outputs["y"] - expected["y"]).abs().max().item()
        return Comparison(err <= 1.0, "abs<=1", err)

    def bytes_moved(self, shape):
        return 8.0 * shape["N"]


@pytest.fixture
def no_gpu(monkeypatch):
    """check_and_time's GPU-only calls replaced: each timing function launches the kernel ``runs`` times."""

    def fake_time(call, n_sets=1, runs=10, **_):
        for i in range(runs):
            call(i % n_sets)
        return types.SimpleNamespace(median_ms=1.0, p10_ms=0.9, p90_ms=1.1)

    monkeypatch.setattr(harness, "time_cuda", fake_time)
    monkeypatch.setattr(harness, "time_cuda_graph", lambda call, n_sets=1: fake_time(call, n_sets, 5))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)


def _check(tile: CountingTile) -> harness.Evaluation:
    ev = harness.Evaluation(tile.name, SHAPE.name, {}, "sm90", harness.OK)
    return harness.check_and_time(tile, SHAPE, object(), ev, get_arch("sm90"), runs=10)


@pytest.mark.parametrize("keeps_buffers", [True, False])
def test_a_deterministic_kernel_is_timed(no_gpu, keeps_buffers):
    ev = _check(CountingTile(keeps_buffers=keeps_buffers))
    assert ev.outcome == harness.OK and ev.ms == 1.0


def test_two_runs_that_differ_are_refused_before_timing(no_gpu):
    ev = _check(CountingTile(flip_at=2))
    assert ev.outcome == harness.NONDETERMINISTIC and "two runs" in ev.message and ev.ms is None


@pytest.mark.parametrize("keeps_buffers", [True, False])
def test_a_kernel_that_drifts_during_the_timing_is_refused(no_gpu, keeps_buffers):
    """The first two runs agree; a later launch (here the tenth) does not: the run after the timing catches it, and no
    time is reported."""
    ev = _check(CountingTile(flip_at=10, keeps_buffers=keeps_buffers))
    assert ev.outcome == harness.NONDETERMINISTIC and ev.ms is None
    assert "after the timing" in ev.message or "last timed launch" in ev.message


def test_a_wrong_kernel_is_refused_before_its_determinism_is_asked(no_gpu):
    tile = CountingTile()
    tile.reference = lambda inputs: {"y": inputs["x"] + 5}
    ev = _check(tile)
    assert ev.outcome == harness.WRONG_RESULT and ev.ms is None


def test_repeats_find_a_race_the_two_run_check_misses(no_gpu):
    """A kernel that drifts from its fifth launch passes two runs; with six it is refused, and the message says which."""
    ok = CountingTile(flip_at=5)
    ev = harness.check_and_time(
        ok, SHAPE, object(), harness.Evaluation(ok.name, SHAPE.name, {}, "sm90", harness.OK), get_arch("sm90"), time_it=False
    )
    assert ev.outcome == harness.OK
    racy = CountingTile(flip_at=5)
    ev = harness.check_and_time(
        racy, SHAPE, object(), harness.Evaluation(racy.name, SHAPE.name, {}, "sm90", harness.OK), get_arch("sm90"), time_it=False, repeats=6
    )
    assert ev.outcome == harness.NONDETERMINISTIC and "run 5 of 6" in ev.message


def test_lab_check_refuses_fewer_than_two_repeats(capsys):
    from lab.cli import main

    assert main(["check", "--tile", "fp4_quant_main", "--arch", "sm90", "--compile-only", "--repeats", "1"]) == 2
    assert "--repeats must be at least 2" in capsys.readouterr().err
