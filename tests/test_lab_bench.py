"""`lab bench`: clear one-line errors for bad names and configs, and a clean refusal without a GPU."""

from __future__ import annotations

import pytest
import torch

from lab.cli import LabError, main
from lab.commands.bench import parse_config


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: `lab bench` would time for real")
def test_no_gpu_exits_non_zero_with_message(capsys):
    assert main(["bench", "--tile", "fp4_quant_main", "--shape", "decode_b64"]) == 2
    err = _one_line_error(capsys)
    assert err.startswith("lab bench: error:") and "no CUDA GPU" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "--tile", "no_such_tile"], "unknown tile 'no_such_tile': choose one of"),
        (["bench", "--tile", "fp4_quant_main", "--shape", "decode_b3"], "has no shape 'decode_b3': choose one of decode_b64"),
        (["bench", "--tile", "fp4_quant_main", "--config", "{threads: 1"], "--config is not valid JSON"),
        (["bench", "--tile", "fp4_quant_main", "--config", "threads"], "'threads' is not key=value"),
        (["bench", "--tile", "fp4_quant_main", "--runs", "0"], "--runs must be at least 1"),
    ],
    ids=["unknown-tile", "unknown-shape", "bad-json", "bad-kv", "bad-runs"],
)
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
    assert main(argv) == 2
    assert message in _one_line_error(capsys)


def test_parse_config_forms():
    assert parse_config(None) == {}
    assert parse_config('{"threads": 128, "staging": "shared"}') == {"threads": 128, "staging": "shared"}
    assert parse_config("threads=128, staging=shared,grid=persistent") == {"threads": 128, "staging": "shared", "grid": "persistent"}
    assert parse_config("scale=0.5,flag=true") == {"scale": 0.5, "flag": True}
    with pytest.raises(LabError, match="must be an object"):
        parse_config("[1, 2]")


def test_tuned_config_is_each_shapes_winner(tmp_path):
    """`--config tuned`: each shape runs its stored winner (the nearest bucket), the default where none is stored or
    the entry is stale, each named with its source; overrides keep one config for every shape."""
    from types import SimpleNamespace

    from lab.commands.bench import shape_configs
    from tiles.core.arch import get_arch
    from tiles.core.registry import get_tile
    from tuning.export import export_results

    sm90, tile = get_arch("sm90"), get_tile("fp4_quant_main")
    default = tile.default_config(sm90)
    winner = {**default, "threads": 128}
    best = SimpleNamespace(params=winner, user_attrs={"ms": 1.0, "tflops": None, "gbps": 100.0})
    summary = SimpleNamespace(
        shape="decode_b64", best=best, best_ms=1.0, default_ms=1.5, speedup=1.5, trials=9, outcomes={"ok": 9}, study="s", default=default
    )
    export_results(tile, sm90, [summary], "lab tune", tmp_path, environment={"gpu": "test"})
    shapes = [tile.shape("decode_b64"), tile.shapes()[-1]]
    (first, src1), (last, src2) = shape_configs(tile, sm90, shapes, "tuned", root=tmp_path)
    assert first == winner and src1.startswith("tuned:")
    assert last == default and src2.startswith("default"), src2
    pairs = shape_configs(tile, sm90, shapes, "threads=128", root=tmp_path)
    assert [p[1] for p in pairs] == ["override", "override"] and all(p[0] == winner for p in pairs)
    assert shape_configs(tile, sm90, shapes, None) == [(default, "default")] * 2
    with pytest.raises(LabError, match="invalid for fp4_quant_main"):
        shape_configs(tile, sm90, shapes, "threads=3")
