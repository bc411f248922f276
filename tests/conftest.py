"""Shared test setup: seeded RNGs, the ``gpu`` marker (skipped with a reason on CPU) and ``--deadline``."""

from __future__ import annotations

import gc
import os
import random
import time

import pytest
import torch


def pytest_addoption(parser):
    parser.addoption(
        "--deadline",
        type=float,
        default=None,
        metavar="SECONDS",
        help="skip the tests that have not started this many seconds after the session began (a GPU call's time "
        "budget): the run ends by itself, reports what ran and writes --junitxml, where a kill loses the report",
    )


_SESSION_START = time.monotonic()


def pytest_configure(config):
    """Each xdist worker's torch takes its share of the cores: with every core per worker, ``-n 2`` on 2 cores runs
    4 compute threads that spin against each other, and small float64 model tests ran 20-40x slower."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_runtest_setup(item):
    deadline = item.config.getoption("--deadline")
    if deadline is not None and time.monotonic() - _SESSION_START > deadline:
        pytest.skip(f"--deadline {deadline:g} s passed before this test started")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed_everything():
    random.seed(0)
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    """Hand cached GPU memory back after each test: under ``pytest -n 4`` one worker's caching allocator
    otherwise keeps the peak of its largest test (131 GiB once on the H200) and the others run out."""
    yield
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
