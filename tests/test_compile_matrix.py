"""Every registered tile compiles (default config, first shape) for sm80, sm89, sm90 and sm100 on this machine.

The matrix comes from the registry, so a tile added by anyone is covered here without
editing this file. Cells compile in a spawned process pool, as ``lab check`` runs them.
"""

from __future__ import annotations

import json
import os

import pytest

from lab.cli import main
from lab.matrix import UNSUPPORTED, Cell, compile_cell, plan, run_compile
from tiles.core.arch import get_arch, parse_arch_list
from tiles.core.harness import OK
from tiles.core.registry import all_tiles, get_tile

ARCHS = parse_arch_list("sm80,sm89,sm90,sm100")


@pytest.fixture(scope="module")
def matrix() -> list[Cell]:
    cells = plan(all_tiles().values(), ARCHS)
    return run_compile(cells, jobs=os.cpu_count())


def test_matrix_covers_every_tile_and_arch(matrix):
    assert {(c.tile, c.arch) for c in matrix} == {(t, a.name) for t in all_tiles() for a in ARCHS}


def test_every_cell_compiles_or_says_why_not(matrix):
    """Each cell compiled the tile's first shape with the arch's full default config (what a cell without a config
    asks for), or names why the tile does not support the arch."""
    failed = [f"{c.tile}@{c.arch}: {c.outcome}: {c.message}" for c in matrix if not c.ok]
    assert not failed, "\n".join(failed)
    for c in matrix:
        tile, arch = get_tile(c.tile), get_arch(c.arch)
        assert c.shape == tile.shapes()[0].name and c.config == tile.with_defaults(arch, {}), c
        if c.outcome == UNSUPPORTED:
            assert c.message and c.message == tile.support_reason(arch), f"{c.tile}@{c.arch} is unsupported without its reason"
        else:
            assert c.outcome == OK and c.compile_s > 0, c


def test_bad_cells_are_reported_not_raised():
    tile = next(iter(all_tiles().values()))
    cell = compile_cell(Cell(tile.name, "sm90", tile.shapes()[0].name, config={"no_such_param": 1}))
    assert cell.outcome == "invalid" and "no_such_param" in cell.message and not cell.ok
    cell = compile_cell(Cell(tile.name, "sm90", "no_such_shape"))
    assert cell.outcome == "compile_error" and "no_such_shape" in cell.message


def test_lab_check_compile_only_json(capsys):
    rc = main(["check", "--compile-only", "--arch", "sm90", "--tile", "fp4_quant_index", "--jobs", "1", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and [(c["tile"], c["arch"], c["outcome"]) for c in doc["cells"]] == [("fp4_quant_index", "sm90", "ok")]
    assert {"date", "python", "torch", "tilelang"} <= set(doc["environment"]) and doc["command"].startswith("lab check")


def test_lab_check_json_stays_one_document_with_compile_workers(capfd, monkeypatch, tmp_path):
    """With --jobs > 1 the cells compile in spawned processes, whose TileLang logging started out on stdout (the fd
    the JSON goes to): it goes to stderr there too. An empty TileLang cache, so that the workers compile and log."""
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))  # read by the spawned workers' TileLang
    rc = main(["check", "--compile-only", "--arch", "sm90", "--tile", "fp4_quant_index", "--all-shapes", "--jobs", "2", "--json"])
    out = capfd.readouterr().out
    doc = json.loads(out)
    assert rc == 0 and len(doc["cells"]) == len(get_tile("fp4_quant_index").shapes()) > 1


@pytest.mark.parametrize(
    "argv, message",
    [
        (["check", "--compile-only", "--arch", "sm90", "--tile", "nope"], "unknown tile 'nope'"),
        (["check", "--compile-only", "--arch", "sm42"], "unknown arch 'sm42'"),
    ],
    ids=["unknown-tile", "unknown-arch"],
)
def test_lab_check_bad_names(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_lab_check_without_gpu_asks_for_compile_only(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: `lab check` runs for real")
    assert main(["check", "--tile", "fp4_quant_main"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU" in err and "--compile-only" in err
