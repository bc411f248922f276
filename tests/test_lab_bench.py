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
