"""lab e2e / lab report: argument parsing, the synthetic cache, speedup arithmetic, report files, clean errors."""

from __future__ import annotations

import json

import pytest
import torch

from lab.cli import LabError, main
from lab.commands.e2e import parse_range, parse_tokens, variants_from
from lab.e2e.report import load, render_markdown, speedups, write_report
from lab.e2e.synthetic import fill_cache, fill_paged_cache
from model import build_model, formats, preset


def test_parse_tokens_reads_k_and_m_suffixes():
    assert parse_tokens("8K, 32k,131072,1M") == [8192, 32768, 131072, 1 << 20]
    with pytest.raises(LabError, match="token count"):
        parse_tokens("8Q")


def test_variants_put_the_torch_baseline_first():
    labels = [v.label for v in variants_from("tiles,torch", "tuned,default")]
    assert labels == ["torch", "tiles/tuned", "tiles/default"]
    with pytest.raises(LabError, match="unknown backend"):
        variants_from("cuda", "tuned")
    with pytest.raises(LabError, match="--configs"):
        variants_from("tiles", "best")


@pytest.mark.parametrize("context", [0, 1, 7, 37], ids=lambda c: f"ctx{c}")
def test_fill_cache_holds_valid_encodings_at_the_context(context):
    cfg = preset("tiny")
    model = build_model(cfg, device="cpu", dtype=torch.float32, seed=0)
    cache = fill_cache(model.new_cache(2, context + 8), context, seed=3)
    assert cache.n_tokens == context
    for glob in cache.globals.values():
        assert glob.n == context // glob.ratio
        packed, scales = glob.main()
        values = formats.fp4_dequantize(packed, scales, cfg.main_fp4_group, "e4m3")
        assert torch.isfinite(values).all()
        if glob.n:
            assert values.abs().amax() > 0  # real encodings, not zeros
    for ring in cache.rings:
        assert ring.end == context and ring.end - ring.start == min(context, cfg.window)
    # decoding continues from the synthetic state like from a real one
    logits = model.decode(torch.tensor([1, 2]), cache)
    assert logits.shape == (2, cfg.vocab_size) and torch.isfinite(logits).all()
    assert cache.n_tokens == context + 1


def test_mixed_lengths_spread_evenly_over_the_range():
    """One rule for lab kv's workloads and lab e2e's decode_mixed batches."""
    from model.paged import spread_lengths

    assert spread_lengths(5, 8192, 65536) == [8192, 22528, 36864, 51200, 65536]
    assert spread_lengths(1, 8192, 65536) == [8192]
    assert parse_range("8K:64K") == (8192, 65536)
    for bad in ("8K", "64K:8K", "0:8K", "a:b", "8K,16K:64K", ":64K"):
        with pytest.raises(LabError):
            parse_range(bad)


def test_fill_paged_cache_holds_each_length_and_decodes_them_in_one_step():
    """Sequences of their own lengths (one below the window, one past it, one with a pending ratio-2 token): entries,
    tails and rings at each length, and a decode step of all of them at once."""
    cfg = preset("tiny")
    model = build_model(cfg, device="cpu", dtype=torch.float32, seed=0)
    lengths = [0, 37, cfg.window + 11]
    cache = model.new_paged_cache(64, 4, page_size=4)
    seqs = fill_paged_cache(cache, lengths, seed=3, headroom=8)
    for seq, n in zip(seqs, lengths, strict=True):
        state = cache.sequence(seq)
        assert cache.length(seq) == n
        for src, pool in cache.groups.items():
            assert state.entries[src] == n // pool.ratio
            if pool.ratio > 1:
                assert state.tail[src] == n % pool.ratio
        assert all(ring == [n - min(n, cfg.window), n] for ring in state.rings)
    for src, pool in cache.groups.items():
        rows = cache.entry_rows(seqs[2], src, 0, lengths[2] // pool.ratio)
        values = formats.fp4_dequantize(pool.main_packed[rows], pool.main_scales[rows], cfg.main_fp4_group, "e4m3")
        assert torch.isfinite(values).all() and values.abs().amax() > 0  # real encodings, not zeros
    logits = model.decode_paged(torch.tensor([1, 2, 3]), cache, seqs)
    assert logits.shape == (3, cfg.vocab_size) and torch.isfinite(logits).all()
    assert [cache.length(s) for s in seqs] == [n + 1 for n in lengths]


def _rows():
    def row(phase, variant, ms):
        return {
            "phase": phase,
            "variant": variant,
            "batch": 1,
            "context": 8192,
            "ms": ms,
            "mode": "eager",
            "breakdown": {"attention": ms / 2},
            "peak_gib": 1.0,
            "kv_gib": 0.1,
            "logits_rel_err": 0.0,
            "note": "",
        }

    return [
        row("decode", "torch", 9.0),
        row("decode", "tiles/tuned", 3.0),
        row("decode", "tiles/default", 4.5),
        row("prefill", "torch", 100.0),
        row("prefill_full", "torch", 190.0),
    ]


def test_speedups_are_ratios_of_rows_of_the_same_run():
    got = {(s["what"], s["phase"]): s["speedup"] for s in speedups(_rows())}
    assert got[("tiles/tuned vs torch", "decode")] == pytest.approx(3.0)
    assert got[("tuned vs default", "decode")] == pytest.approx(1.5)
    assert got[("CED vs non-CED (torch)", "prefill")] == pytest.approx(1.9)


def test_report_shows_what_the_breakdown_adds_up_to():
    """The parts come from an eager pass whose own total (pass_ms) they add up to, shown beside the step's latency;
    rows of runs before pass_ms existed show "-" there."""
    rows = _rows()
    rows[1]["breakdown"] = {"attention": 2.5, "rest": 1.0, "pass_ms": 3.5}  # more than the 3.0 ms graph step
    md = render_markdown({"kind": "csa2-lab/e2e", "meta": {"preset": "tiny"}, "rows": rows})
    header = next(line for line in md.splitlines() if line.startswith("| phase"))
    assert "| breakdown pass | attention |" in header
    tuned = next(line for line in md.splitlines() if "| tiles/tuned |" in line).split(" | ")
    torch_row = next(line for line in md.splitlines() if "| decode | torch |" in line).split(" | ")
    col = header.split(" | ").index("breakdown pass")
    assert (tuned[col], tuned[col + 1], torch_row[col]) == ("3.50", "2.50", "-")


def test_report_round_trip_and_corrupt_files(tmp_path):
    doc = {"kind": "csa2-lab/e2e", "meta": {"preset": "tiny", "command": "lab e2e"}, "rows": _rows()}
    written = write_report(doc, tmp_path)
    assert load(tmp_path / "e2e.json") == doc
    md = (tmp_path / "e2e.md").read_text()
    assert "tiles/tuned vs torch" in md and md == render_markdown(doc)
    assert all(p.exists() for p in written)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        load(tmp_path / "bad.json")
    (tmp_path / "foreign.json").write_text(json.dumps({"kind": "something-else"}))
    with pytest.raises(ValueError, match="not an e2e results file"):
        load(tmp_path / "foreign.json")


def test_lab_report_regenerates_markdown(tmp_path, capsys):
    """results/<arch>/e2e/<gpu>.json -> e2e.md, one section per GPU model; a corrupt document is a one-line error that
    names it and leaves the old e2e.md in place."""
    doc = {"kind": "csa2-lab/e2e", "meta": {"preset": "tiny", "gpu": "NVIDIA H200"}, "rows": _rows()}
    (tmp_path / "sm90" / "e2e").mkdir(parents=True)
    (tmp_path / "sm90" / "e2e" / "h200.json").write_text(json.dumps(doc))
    (tmp_path / "sm90" / "e2e" / "h100.json").write_text(json.dumps({**doc, "meta": {"preset": "tiny", "gpu": "NVIDIA H100"}}))
    assert main(["report", "--results", str(tmp_path)]) == 0
    md = (tmp_path / "sm90" / "e2e.md").read_text()
    assert md.count("tiles/tuned vs torch") == 2 and md.startswith("# End-to-end latency")
    (tmp_path / "sm90" / "e2e" / "h100.json").write_text("[]")
    assert main(["report", "--results", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "h100.json" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert (tmp_path / "sm90" / "e2e.md").read_text() == md


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_lab_e2e_without_gpu_is_a_one_line_error(capsys):
    assert main(["e2e", "--preset", "tiny", "--ctx", "256"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU" in err and "Traceback" not in err
    assert main(["e2e", "--preset", "nope"]) == 2
    assert "unknown preset" in capsys.readouterr().err


def test_lab_e2e_refuses_a_context_past_the_presets_length_before_any_gpu_work(capsys):
    """tiny holds 512 tokens: a 1K decode context (or a 1K prompt) is a one-line error, with or without a GPU."""
    assert main(["e2e", "--preset", "tiny", "--phase", "decode", "--ctx", "1K"]) == 2
    err = capsys.readouterr().err
    assert "max_seq_len=512" in err and "--ctx 1024" in err and "Traceback" not in err
    assert main(["e2e", "--preset", "tiny", "--phase", "prefill_ced", "--ctx", "256", "--prefill-ctx", "1K"]) == 2
    assert "prompt of 1024 tokens" in capsys.readouterr().err
    assert main(["e2e", "--preset", "tiny", "--phase", "decode_mixed", "--mixed", "64:1K"]) == 2
    err = capsys.readouterr().err
    assert "--mixed up to 1024" in err and "Traceback" not in err
    assert main(["e2e", "--preset", "tiny", "--phase", "decode_mixed", "--mixed", "1K"]) == 2
    assert "LO:HI" in capsys.readouterr().err


def test_lab_report_summarises_bench_and_tuning_files(tmp_path):
    import yaml

    arch = tmp_path / "sm90"
    (arch / "bench").mkdir(parents=True)
    env = {"date": "d", "gpu": "G"}
    row = {"shape": "s1", "outcome": "ok", "ms": 0.5, "tflops": None, "gbps": 100.0, "copy_fraction": 0.25, "ref_ms": 2.0, "speedup": 4.0}
    bench = {
        "schema": "csa2-lab/bench/v2",
        "tile": "toy",
        "rows": [{**row, "check": "ok", "environment": env, "command": "lab bench --tile toy"}],
    }
    (arch / "bench" / "toy.json").write_text(json.dumps(bench))
    tuned = {
        "schema": "csa2-lab/tuned-configs/v1",
        "tile": "toy",
        "arch": "sm90",
        "environment": {"date": "d", "command": "lab tune --tile toy"},
        "shapes": {
            "s1": {"config": {"threads": 64}, "ms": 1.0, "default_ms": 2.0, "speedup": 2.0, "trials": 3, "outcomes": {"ok": 3}},
            "s2": {"config": {"threads": 64}, "ms": 1.0, "default_ms": 8.0, "speedup": 8.0, "trials": 3, "outcomes": {"ok": 3}},
        },
    }
    (arch / "tuned" / "g").mkdir(parents=True)
    (arch / "tuned" / "g" / "toy.yaml").write_text(yaml.safe_dump(tuned))
    assert main(["report", "--results", str(tmp_path)]) == 0
    bench_md = (arch / "bench.md").read_text()
    assert "| toy | s1 | G | default | 0.5000 |" in bench_md and "4.0x" in bench_md and "25%" in bench_md
    tuning_md = (arch / "tuning.md").read_text()
    assert "## g (`tuned/g/`)" in tuning_md  # a section per GPU model (no model recorded: its folder's name)
    assert "Geometric mean speedup of the current winners over the defaults: 4.00x over 2 shapes" in tuning_md


@pytest.mark.gpu
def test_lab_e2e_breakdown_adds_up_to_its_pass(tmp_path, capsys):
    """On a GPU, `lab e2e` on the tiny preset (decode and CED prefill, torch and tiles): every row's parts and rest
    add up to its breakdown pass's total, none negative, and the report shows that total."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run `pytest -m gpu` on a GPU machine)")
    argv = ["e2e", "--preset", "tiny", "--phase", "decode,prefill_ced", "--ctx", "256", "--batch", "2", "--runs", "3"]
    assert main([*argv, "--backend", "torch,tiles", "--configs", "default", "--repeats", "1", "--out", str(tmp_path)]) == 0
    doc = load(tmp_path / "e2e.json")
    assert {r["phase"] for r in doc["rows"]} == {"decode", "prefill"} and all(r["ms"] for r in doc["rows"])
    for r in doc["rows"]:
        parts = r["breakdown"]
        assert min(parts.values()) >= 0 and parts["pass_ms"] > 0
        assert sum(v for k, v in parts.items() if k != "pass_ms") == pytest.approx(parts["pass_ms"], rel=1e-3), r
    assert "breakdown pass" in (tmp_path / "e2e.md").read_text()


@pytest.mark.gpu
def test_lab_e2e_mixed_length_decode_row(tmp_path):
    """On a GPU, the decode_mixed row (paged cache, lengths spread over the range) on the tiny preset: timed for torch
    and tiles, the tiles logits near the torch baseline's on the same step."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run `pytest -m gpu` on a GPU machine)")
    argv = ["e2e", "--preset", "tiny", "--phase", "decode_mixed", "--mixed", "40:300", "--batch", "3", "--runs", "3"]
    assert main([*argv, "--backend", "torch,tiles", "--configs", "default", "--out", str(tmp_path)]) == 0
    rows = load(tmp_path / "e2e.json")["rows"]
    assert [(r["phase"], r["variant"]) for r in rows] == [("decode_mixed", "torch"), ("decode_mixed", "tiles/default")]
    assert all(r["ms"] > 0 and r["context"] == 300 for r in rows)
    assert rows[1]["logits_rel_err"] < 5e-2
