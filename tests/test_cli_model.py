"""`lab model` and `lab kv` through lab.cli.main."""

from __future__ import annotations

import json

import pytest

from lab.cli import main


def test_lab_model_prints_the_layer_map_and_parameter_count(capsys):
    assert main(["model", "--preset", "v4.1-flash"]) == 0
    out = capsys.readouterr().out
    for word in ("layer", "region", "ratio", "mode", "KV source", "index source", "pool source", "Reindex", "Reuse", "SWA only"):
        assert word in out
    assert "2 SWA only, 4 Full, 4 Reindex, 30 Reuse" in out
    assert "parameters: 16,359,849,984" in out


def test_lab_model_tiny(capsys):
    assert main(["model", "--preset", "tiny"]) == 0
    assert "parameters: 314,784" in capsys.readouterr().out


def test_lab_kv_json_has_global_bytes_per_token(capsys):
    assert main(["kv", "--preset", "v4.1-flash", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["global_bytes_per_token"] == 890
    assert [g["bytes_per_token"] for g in data["groups"]] == [178, 178, 178, 356]
    assert data["mla_bytes_per_token"] == 70272
    assert data["fixed_state_bytes_per_sequence"]["total"] == 40 * 128 * 528 + 3 * 2 * 512 * 4


def test_lab_kv_table(capsys):
    assert main(["kv", "--preset", "small"]) == 0
    out = capsys.readouterr().out
    assert "212" in out and "70,272" in out


@pytest.mark.parametrize("command", ["model", "kv"])
def test_unknown_preset_is_a_one_line_error(capsys, command):
    assert main([command, "--preset", "huge"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"lab {command}: error: unknown preset 'huge': choose one of v4.1-flash, small, tiny, flash-mini"


def test_tilelang_logs_go_to_stderr_not_stdout(capsys):
    """TileLang writes its log lines to stdout (tqdm.write); the compiling commands move them to stderr, so a
    --json document on stdout parses (the H200 run's lab bench JSON had compile lines in front of it)."""
    import logging

    from lab.cli import tilelang_logs_to_stderr

    tilelang_logs_to_stderr()
    tilelang_logs_to_stderr()  # idempotent: one handler, not two
    logging.getLogger("tilelang.jit.kernel").info("TileLang begins to compile kernel `main`")
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("[TileLang:tilelang.jit.kernel:INFO]") == 1  # TileLang's own format, once
    assert [h.get_name() for h in logging.getLogger("tilelang").handlers] == ["csa2-lab: tilelang to stderr"]
