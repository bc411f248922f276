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


# -- lab kv with a paged workload ---------------------------------------------------------------------


def test_lab_kv_workload_json_counts_pages_slots_and_bytes(capsys):
    """64 sequences spread over 8K..64K on v4.1-flash, worked out by hand from the lengths."""
    assert main(["kv", "--preset", "v4.1-flash", "--sequences", "64", "--lengths", "8K:64K", "--page-size", "64", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["global_bytes_per_token"] == 890  # the per-token report is still there
    w = data["workload"]
    lengths = [8192 + (65536 - 8192) * i // 63 for i in range(64)]
    enc = sum(-(-(n // 2) // 64) for n in lengths)
    dec = sum(-(-n // 64) for n in lengths)
    assert [(g["source_layer"], g["pages"]) for g in w["groups"]] == [(2, enc), (8, enc), (14, enc), (20, dec)]
    page = 64 * 356
    assert w["page_bytes"] == page and w["pages"] == 3 * enc + dec and w["page_total_bytes"] == (3 * enc + dec) * page
    slot = 40 * 128 * 528 + 3 * 2 * 512 * 4
    assert (w["slots"], w["slot_bytes"], w["slot_total_bytes"]) == (64, slot, 64 * slot)
    assert w["total_bytes"] == (3 * enc + dec) * page + 64 * slot
    assert (w["sequences"], w["shortest"], w["longest"], w["tokens"]) == (64, 8192, 65536, sum(lengths))
    assert w["contiguous_padded_bytes"] == 64 * 65536 * 890 + 64 * slot


def test_lab_kv_workload_list_is_cycled_up_to_the_sequence_count(capsys):
    assert main(["kv", "--preset", "tiny", "--lengths", "5,13", "--sequences", "3", "--page-size", "4", "--json"]) == 0
    w = json.loads(capsys.readouterr().out)["workload"]
    # lengths 5, 13, 5: ratio-2 entries 2, 6, 2 -> pages 1, 2, 1; ratio-1 entries 5, 13, 5 -> pages 2, 4, 2
    assert [g["pages"] for g in w["groups"]] == [4, 4, 8] and w["tokens"] == 23 and w["slots"] == 3


def test_lab_kv_workload_table(capsys):
    assert main(["kv", "--preset", "v4.1-flash", "--sequences", "64", "--lengths", "8192:65536"]) == 0
    out = capsys.readouterr().out
    assert "890" in out  # the existing tables come first
    assert "paged cache of 64 sequences, 8,192-65,536 tokens" in out
    assert "pages, group 20" in out and "state slots" in out and "2,276,126,720" in out


def test_lab_kv_without_a_workload_prints_no_workload(capsys):
    assert main(["kv", "--preset", "tiny", "--json"]) == 0
    assert "workload" not in json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sequences", "3"], "--sequences needs --lengths"),
        (["--lengths", "5,x"], "cannot read 'x' as a token count"),
        (["--lengths", "9:3", "--sequences", "2"], "low end 9 is above its high end 3"),
        (["--lengths", "1:2:3"], "a range is LO:HI"),
        (["--lengths", ","], "names no length"),
        (["--lengths", "2M"], "past max_seq_len=1,048,576"),
        (["--lengths", "8K", "--page-size", "0"], "--page-size must be at least 1, got 0"),
        (["--turn-interval", "5m"], "--turn-interval and --active need a workload"),
        (["--lengths", "8K", "--active", "2"], "--active needs --turn-interval"),
        (["--lengths", "8K", "--turn-interval", "soon"], "--turn-interval 'soon': write a duration such as 90s"),
        (["--lengths", "8K", "--turn-interval", "5m", "--host-ttl", "0s"], "--host-ttl '0s': the duration must be positive"),
    ],
    ids=[
        "sequences-alone",
        "bad-length",
        "reversed-range",
        "three-part-range",
        "empty-list",
        "too-long",
        "page-size-0",
        "interval-alone",
        "active-alone",
        "bad-duration",
        "negative-ttl",
    ],
)
def test_lab_kv_bad_workload_is_a_one_line_error(capsys, argv, message):
    assert main(["kv", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_lab_kv_tiers_hold_what_each_tier_keeps(capsys):
    """10 conversations of 64K, 2 decoding, a turn every 5 min: HBM holds the 2 active sessions (pages + slots), host
    memory the 8 idle sessions' SWA state (TTL 10 min > the interval: all of it), disk every session's pages; with a
    turn every hour the host keeps 10/60 of the idle states. MLA: 70,272 B/token in HBM and on disk."""
    from model import preset
    from model.paged import plan_workload

    cfg = preset("v4.1-flash")
    argv = ["kv", "--sequences", "10", "--lengths", "64K", "--active", "2", "--json"]
    assert main([*argv, "--turn-interval", "5m"]) == 0
    t = json.loads(capsys.readouterr().out)["tiers"]
    hot, every = plan_workload(cfg, [65536] * 2), plan_workload(cfg, [65536] * 10)
    assert t["hbm_bytes"] == hot.total_bytes and t["disk_bytes"] == every.page_total_bytes
    assert t["host_bytes"] == 8 * hot.slot_bytes
    assert (t["mla_hbm_bytes"], t["mla_host_bytes"], t["mla_disk_bytes"]) == (2 * 65536 * 70272, 0, 10 * 65536 * 70272)
    assert main([*argv, "--turn-interval", "1h", "--retention", "30m"]) == 0
    t = json.loads(capsys.readouterr().out)["tiers"]
    assert t["host_bytes"] == pytest.approx(8 * hot.slot_bytes / 6) and t["disk_bytes"] == pytest.approx(every.page_total_bytes / 2)
    assert main(["kv", "--sequences", "10", "--lengths", "64K", "--active", "2", "--turn-interval", "5m"]) == 0
    out = capsys.readouterr().out
    assert "tiers of 10" in out and "MLA / CSA2" in out and "HBM" in out
