"""Every error the command line prints for bad input on a machine without a GPU: one line, `lab <command>: error: ...`
naming the fix, exit status 2, no traceback (the storage and argument errors of `lab tune`: tests/test_cli_tune.py)."""

from __future__ import annotations

import re

import pytest

from lab.cli import main

CASES = [
    (["bench", "--tile", "nope"], "unknown tile 'nope'"),
    (["bench", "--tile", "fp4_quant_main", "--shape", "nope"], "tile fp4_quant_main has no shape 'nope'"),
    (["bench", "--tile", "fp4_quant_main", "--config", "{bad json"], "--config is not valid JSON"),
    (["bench", "--tile", "fp4_quant_main", "--config", "[1, 2]"], "--config JSON must be an object"),
    (["bench", "--tile", "fp4_quant_main", "--config", "threads"], "--config item 'threads' is not key=value"),
    (
        ["bench", "--tile", "fp4_quant_main", "--config", "threads=128", "--save"],
        "--save stores the default config's or the stored winners'",
    ),
    (["bench", "--tile", "fp4_quant_main", "--runs", "0"], "--runs must be at least 1, got 0"),
    (["bench", "--tile", "fp4_quant_main"], "no CUDA GPU is present.*`lab bench` times on a GPU"),
    (["check", "--arch", ","], "--arch is empty"),
    (["check", "--compile-only", "--arch", "sm42"], "unknown arch 'sm42'"),
    (["check", "--compile-only", "--arch", "sm90", "--tile", "nope"], "unknown tile 'nope'"),
    (["check", "--compile-only", "--arch", "sm90", "--jobs", "0"], "--jobs must be at least 1, got 0"),
    (["check", "--compile-only", "--arch", "sm90", "--repeats", "1"], "--repeats must be at least 2"),
    (["check", "--tile", "fp4_quant_main"], "no CUDA GPU is present.*--compile-only"),
    (["e2e", "--ctx", "lots"], "cannot read 'lots' as a token count"),
    (["e2e", "--configs", "best"], "--configs takes tuned and/or default, not 'best'"),
    (["e2e", "--backend", "numpy"], "unknown backend 'numpy': use torch and/or tiles"),
    (["e2e", "--phase", "warmup"], "unknown phase 'warmup'"),
    (["e2e"], "no CUDA GPU is present: lab e2e times the model on a GPU"),
    (["model", "--preset", "v9"], "unknown preset 'v9'"),
    (["kv", "--preset", "v9"], "unknown preset 'v9'"),
    (["report", "--results", "/nonexistent/results"], "/nonexistent/results is not a directory: pass --results DIR"),
    (["sources", "--arch", ","], "--arch is empty"),
    (["sources", "--arch", "sm42"], "unknown arch 'sm42'"),
    (["sources", "--arch", "sm90", "--tile", "nope"], "unknown tile 'nope'"),
]


@pytest.mark.parametrize(("argv", "message"), CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_input_is_one_line_naming_the_fix(argv, message, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same on a GPU machine
    assert main(argv) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"lab {argv[0]}: error: "), err
    assert re.search(message, lines[0]), lines[0]
    assert "Traceback" not in out + err
