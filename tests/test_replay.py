"""Encoder SWA bounded replay after a prefix hit (Model.prefill_with_prefix), its measured error (model.replay_error)
and `lab replay`.

float64 throughout: the oracle, Model.prefill_paged of the whole prompt, rounds the stored formats the same way, so
where the replay covers the whole dependency of the last logits the two agree to ~1e-12."""

from __future__ import annotations

import json
import re

import pytest
import torch

from lab.cli import main
from model import Model, build_model, preset
from model.paged import PagedKVCache
from model.replay_error import ReplayErrorInput, check_points, replay_error_rows

EXACT = {"rtol": 0, "atol": 1e-12}


@pytest.fixture(scope="module")
def tiny() -> Model:
    return build_model(preset("tiny"), dtype=torch.float64, seed=0)  # window 8, 4 encoder layers


def _tokens(vocab: int, n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _published(model: Model, prefix: torch.Tensor, page_size: int, n_pages: int = 64, ced: bool = True) -> tuple[PagedKVCache, int]:
    cache = model.new_paged_cache(n_pages=n_pages, n_slots=3, page_size=page_size)
    g = torch.Generator().manual_seed(9)
    for t in cache.tensors().values():  # a read of a row nobody wrote shows up in the logits
        t.copy_(
            torch.randint(0, 256, t.shape, generator=g).to(t.dtype)
            if t.dtype == torch.uint8
            else torch.randn(t.shape, generator=g, dtype=t.dtype)
        )
    seq = cache.add()
    model.prefill_paged(prefix, cache, seq, ced=ced)
    cache.publish_prefix(seq, prefix)
    return cache, seq


def _exact(model: Model, prompt: torch.Tensor, page_size: int, ced: bool = True) -> tuple[torch.Tensor, PagedKVCache, int]:
    cache = model.new_paged_cache(n_pages=64, n_slots=1, page_size=page_size)
    seq = cache.add()
    return model.prefill_paged(prompt, cache, seq, ced=ced), cache, seq


def _pages(cache: PagedKVCache, seq: int) -> dict[str, torch.Tensor]:
    s, ps = cache.sequence(seq), cache.page_size
    return {
        f"{src}.{n}.{p}": t[p * ps : (p + 1) * ps].clone()
        for src, g in cache.groups.items()
        for p in s.pages[src]
        for n, t in g.tensors().items()
    }


# -- exactness where the replay covers everything ------------------------------------------------------


@pytest.mark.parametrize("ced", [True, False], ids=["ced", "no-ced"])
@pytest.mark.parametrize(("page_size", "hit"), [(1, 6), (2, 8), (4, 8)], ids=["page1-hit6", "page2-hit8", "page4-hit8"])
@pytest.mark.parametrize("suffix", [0, 1, 13], ids=lambda s: f"suffix{s}")
def test_replay_is_exact_when_the_hit_fits_the_window(tiny, page_size, hit, suffix, ced):
    """hit <= window: the replay starts at position 0, so prefill and the decode after it equal the whole prompt's."""
    if hit + suffix == 0:
        pytest.skip("empty prompt")
    prompt = _tokens(tiny.cfg.vocab_size, hit + suffix, 20 + hit)
    cache, _ = _published(tiny, prompt[:hit], page_size, ced=ced)
    got = tiny.prefill_with_prefix(prompt, cache, ced=ced)
    assert (got.hit_tokens, got.replayed) == (hit, hit)
    want, ref, ref_seq = _exact(tiny, prompt, page_size, ced=ced)
    torch.testing.assert_close(got.logits, want, **EXACT)
    for t in (3, 50, 7):  # the rings the replay built carry decode on
        step = tiny.decode_paged(torch.tensor([t]), cache, [got.seq])
        torch.testing.assert_close(step, tiny.decode_paged(torch.tensor([t]), ref, [ref_seq]), **EXACT)


def test_replay_past_the_window_is_exact_once_it_covers_every_encoder_layers_reach(tiny):
    """A hit of 32 > window 8: the default replay of 8 tokens is an approximation; replaying the whole hit, or
    (E - 1) * (window - 1) + window = 29 tokens (each encoder layer's window reaches 7 further back), is exact."""
    prompt = _tokens(tiny.cfg.vocab_size, 40, 3)
    cache, _ = _published(tiny, prompt[:32], page_size=4)
    want = _exact(tiny, prompt, 4)[0]
    errors = {}
    for replay in (0, 8, 29, 32):
        got = tiny.prefill_with_prefix(prompt, cache, publish=False, replay_tokens=replay)
        assert got.hit_tokens == 32 and got.replayed == replay
        errors[replay] = float((got.logits - want).abs().max())
        cache.free(got.seq)
    assert errors[0] > errors[8] > 1e-3
    assert errors[29] < 1e-12 and errors[32] < 1e-12


def test_a_short_replay_before_a_short_suffix_still_feeds_the_decoder_replay(tiny):
    """CED replays the last window encoder outputs through the decoder: with a suffix of 2 < window 8, a requested
    replay of 4 tokens grows to the 6 the decoder needs, the positions stay right and decoding goes on."""
    prompt = _tokens(tiny.cfg.vocab_size, 34, 3)
    cache, _ = _published(tiny, prompt[:32], page_size=4)
    got = tiny.prefill_with_prefix(prompt, cache, publish=False, replay_tokens=4)
    assert got.hit_tokens == 32 and got.replayed == 6
    assert all(ring == [34 - 8, 34] for ring in cache.sequence(got.seq).rings)  # every ring holds the last window, up to 34
    full = tiny.prefill_with_prefix(prompt, cache, publish=False, replay_tokens=6)
    torch.testing.assert_close(got.logits, full.logits, **EXACT)
    assert torch.isfinite(tiny.decode_paged(torch.tensor([5]), cache, [got.seq])).all()


def test_replayed_tokens_never_rewrite_the_cached_prefix(tiny):
    """The hit's pages keep every byte while the new sequence replays over them and decodes after them, and the
    publisher's own decode is unchanged."""
    prompt = _tokens(tiny.cfg.vocab_size, 45, 4)
    cache, a = _published(tiny, prompt[:32], page_size=4)
    shared = _pages(cache, a)
    other, ref_a = _published(tiny, prompt[:32], page_size=4)
    got = tiny.prefill_with_prefix(prompt, cache)
    assert got.hit_tokens == 32
    for _ in range(2):
        tiny.decode_paged(torch.tensor([1, 2]), cache, [got.seq, a])
        tiny.decode_paged(torch.tensor([2]), other, [ref_a])
    assert all(torch.equal(v, shared[k]) for k, v in _pages(cache, a).items() if k in shared)
    torch.testing.assert_close(
        tiny.decode_paged(torch.tensor([9]), cache, [a]), tiny.decode_paged(torch.tensor([9]), other, [ref_a]), **EXACT
    )


def test_small_preset_is_exact_at_the_window():
    """small's layer map and attention geometry (window 64, 8 encoder layers, ratio-2 groups, top-k 128, pool blocks
    of 8): a hit of 64 tokens (two blocks of 32 at page size 16) replays exactly. Widths and the vocabulary are cut
    so the test runs in seconds; replay exactness depends on the window and the layer map, not on the widths."""
    narrow = {"dim": 128, "ffn_inter": 256, "q_lora_rank": 64, "o_lora_rank": 64, "n_heads": 2, "vocab_size": 512}
    m = build_model(preset("small").replace(**narrow), dtype=torch.float64, seed=0)
    prompt = _tokens(512, 71, 5)
    cache, _ = _published(m, prompt[:64], page_size=16, n_pages=16)
    got = m.prefill_with_prefix(prompt, cache)
    assert (got.hit_tokens, got.replayed) == (64, 64)
    torch.testing.assert_close(got.logits, _exact(m, prompt, 16)[0], **EXACT)


# -- the error table ---------------------------------------------------------------------------------


def test_error_table_rows_and_sanity(tiny):
    rows = replay_error_rows(tiny, [0, 8, 32], [0, 1, 40], page_size=4, seed=1)
    assert [(r.hit, r.suffix) for r in rows] == [(h, s) for h in (0, 8, 32) for s in (0, 1, 40) if h + s]
    for r in rows:
        assert r.preset == "tiny" and r.window == 8 and r.replayed == min(8, r.hit)
        if r.hit <= r.window:
            assert r.exact_expected and r.max_abs < 1e-12 and r.rel_l2 < 1e-12 and r.argmax_same, r
        else:
            assert r.max_abs > 1e-6, r  # the approximation is there
    by = {(r.hit, r.suffix): r for r in rows}
    assert by[32, 40].rel_l2 < by[32, 1].rel_l2  # suffix tokens far from the replay's start see fewer truncated windows
    assert set(rows[0].as_dict()) >= {"hit", "suffix", "replayed", "max_abs", "rel_l2", "argmax_same", "exact_expected"}


@pytest.mark.parametrize(
    ("hits", "suffixes", "page_size", "message"),
    [
        ([12], [1], 4, "hit 12 is not a whole number of prefix blocks of 8 tokens"),
        ([8], [-1], 4, "suffix lengths must be at least 0"),
        ([504], [16], 4, "reaches 520 tokens, past max_seq_len 512"),
        ([0], [0], 4, "empty prompt"),
        ([], [1], 4, "at least one hit"),
        ([8], [1], 0, "page size must be at least 1"),
    ],
)
def test_error_table_refuses_points_it_cannot_run(tiny, hits, suffixes, page_size, message):
    with pytest.raises(ReplayErrorInput, match=message):
        check_points(tiny, hits, suffixes, page_size)


# -- lab replay ----------------------------------------------------------------------------------------


def test_lab_replay_json_and_out_dir(tmp_path, capsys):
    out = tmp_path / "replay"
    assert main(["replay", "--preset", "tiny", "--hits", "0,32", "--suffix", "1,8", "--page-size", "4", "--json", "--out", str(out)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["preset"] == "tiny" and doc["block_tokens"] == 8 and doc["dtype"] == "float64"
    assert doc["command"].startswith("lab replay --preset tiny")
    assert [(r["hit"], r["suffix"]) for r in doc["rows"]] == [(0, 1), (0, 8), (32, 1), (32, 8)]
    assert doc["rows"][0]["max_abs"] == 0.0
    assert json.loads((out / "replay_tiny.json").read_text()) == doc
    md = (out / "replay_tiny.md").read_text()
    assert "| hit | suffix | replayed |" in md and md.count("\n| ") == 6  # header, rule, 4 rows
    pytest.importorskip("matplotlib")
    assert (out / "replay_tiny.png").stat().st_size > 0


def test_lab_replay_table(capsys):
    assert main(["replay", "--preset", "tiny", "--hits", "8", "--suffix", "2", "--page-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "bounded replay" in out and "rel L2 error" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--hits", "30", "--page-size", "16"], "hit 30 is not a whole number of prefix blocks of 32 tokens"),
        (["--hits", "x"], "--hits 'x': 'x' is not a whole number of tokens"),
        (["--suffix", ","], "--suffix ',' names no token count"),
        (["--suffix", "4,-2"], "-2 is negative"),
        (["--preset", "v9"], "unknown preset 'v9'"),
        (["--preset", "v4.1-flash"], "too many for a float64 model on the CPU; use --preset tiny or small"),
        (["--out", "results/replay"], "inside results/, which holds GPU-run reports; pass another directory"),
    ],
)
def test_lab_replay_bad_input_is_one_line(argv, message, capsys, monkeypatch):
    monkeypatch.chdir(__import__("pathlib").Path(__file__).resolve().parents[1])
    assert main(["replay", *argv]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lab replay: error: "), err
    assert re.search(re.escape(message), lines[0]), lines[0]
    assert "Traceback" not in out + err
