"""model.sessions: a conversation's caches between turns. Each start_turn path when it should run (pure, replay,
disk, cold), pure continuation bit-identical to a sequence never parked, the disk path equal to the HBM replay, a
corrupt page ending the hit at its block, HBM eviction and an expired host state, counters and bytes."""

from __future__ import annotations

import pytest
import torch

from model import build_model, preset
from model.paged import PagedKVCache
from model.sessions import SessionCache, SessionError
from model.tiers import DiskPageTier, HostStatePool, sequence_state, state_bytes

PAGE = 8  # tiny: blocks of lcm(2 * 8, 8) = 16 tokens, window 8
N1, N2 = 101, 150  # turn 1 ends 5 tokens into block 6 (a ratio-2 group pending in its tail); turn 2 adds 49 tokens


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def model():
    return build_model(preset("tiny"), dtype=torch.float64, seed=0)


def conversation(model, n: int = N2, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, model.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def first_turn(model, cache: PagedKVCache, tokens: torch.Tensor) -> int:
    seq = cache.add()
    model.prefill_paged(tokens, cache, seq)
    return seq


def never_parked(model, tokens: torch.Tensor, n1: int) -> torch.Tensor:
    """Logits [vocab] of the turn-1 sequence decoding the suffix on, in a cache of its own, never parked."""
    cache = model.new_paged_cache(64, 2, page_size=PAGE)
    seq = first_turn(model, cache, tokens[:n1])
    return model.decode_paged(tokens[n1:].view(1, -1), cache, [seq])[0, -1]


def sessions(model, cache, tmp_path=None, host=True, clock=None) -> SessionCache:
    disk = DiskPageTier(tmp_path, durable=False) if tmp_path is not None else None
    pool = HostStatePool(1 << 26, **({"clock": clock} if clock else {})) if host else None
    return SessionCache(model, cache, disk, pool, model_id="tiny@seed0")


@pytest.mark.parametrize("n1", [N1, 96, 7, 1], ids=lambda n: f"turn1_{n}")
def test_pure_continuation_equals_decoding_on_without_parking(model, n1):
    """Turn 1 ending mid-block (a ratio-2 token pending), on a block boundary, inside the first block, after one token:
    the pure path's turn-2 logits equal the never-parked sequence's bit for bit, and so do the decode steps after."""
    tokens = conversation(model)
    cache = model.new_paged_cache(64, 2, page_size=PAGE)
    sc = sessions(model, cache)
    sc.end_turn("s", first_turn(model, cache, tokens[:n1]), tokens[:n1])
    assert cache.live == []
    r = sc.start_turn("s", tokens)
    assert r.how == "pure" and r.hit_tokens == n1 // cache.block_tokens * cache.block_tokens and r.replayed == 0
    assert cache.length(r.seq) == N2
    assert torch.equal(r.logits, never_parked(model, tokens, n1))

    ref_cache = model.new_paged_cache(64, 2, page_size=PAGE)
    ref = first_turn(model, ref_cache, tokens[:n1])
    model.decode_paged(tokens[n1:].view(1, -1), ref_cache, [ref])
    for step in range(3):
        tok = torch.tensor([step + 3])
        assert torch.equal(model.decode_paged(tok, cache, [r.seq]), model.decode_paged(tok, ref_cache, [ref])), step


def test_start_turn_takes_each_path_when_it_should(model, tmp_path):
    """pure (state parked, blocks in HBM), then replay (the state was taken back by the pure turn), disk (a fresh cache:
    blocks only on disk), cold (no tiers, nothing published)."""
    tokens = conversation(model)
    cache = model.new_paged_cache(64, 4, page_size=PAGE)
    sc = sessions(model, cache, tmp_path)
    sc.end_turn("s", first_turn(model, cache, tokens[:N1]), tokens[:N1])
    hit = N1 // 16 * 16

    pure = sc.start_turn("s", tokens)
    replay = sc.start_turn("s", tokens)
    assert (pure.how, replay.how) == ("pure", "replay")
    assert replay.hit_tokens == hit and replay.replayed == model.cfg.window and replay.disk_pages == 0

    fresh = model.new_paged_cache(64, 2, page_size=PAGE)
    disk = SessionCache(model, fresh, DiskPageTier(tmp_path, durable=False), HostStatePool(1 << 26), model_id="tiny@seed0")
    restored = disk.start_turn("s", tokens)
    assert restored.how == "disk" and restored.hit_tokens == hit and restored.pages_shared == 0 and restored.disk_pages > 0
    again = disk.start_turn("s", tokens)  # the restored blocks are indexed: the next prompt shares them
    assert again.how == "replay" and again.hit_tokens == hit and again.pages_shared == restored.disk_pages

    cold = sessions(model, model.new_paged_cache(64, 2, page_size=PAGE), host=False).start_turn("s", tokens)
    assert cold.how == "cold" and cold.hit_tokens == 0
    ref_cache = model.new_paged_cache(64, 2, page_size=PAGE)
    ref = ref_cache.add()
    assert torch.equal(cold.logits, model.prefill_paged(tokens, ref_cache, ref))
    assert sc.stats.paths == {"pure": 1, "replay": 1, "disk": 0, "cold": 0}
    assert disk.stats.paths == {"pure": 0, "replay": 1, "disk": 1, "cold": 0}


def test_replay_and_disk_paths_give_identical_logits(model, tmp_path):
    """The pages read back from disk are the bytes the HBM pages hold: the same replay, the same logits, bit for bit;
    both equal prefill_with_prefix on the cache that made the pages."""
    tokens = conversation(model)
    cache = model.new_paged_cache(64, 4, page_size=PAGE)
    sc = sessions(model, cache, tmp_path, host=False)
    sc.end_turn("s", first_turn(model, cache, tokens[:N1]), tokens[:N1])
    replay = sc.start_turn("s", tokens)
    disk = sessions(model, model.new_paged_cache(64, 2, page_size=PAGE), tmp_path, host=False).start_turn("s", tokens)
    assert (replay.how, disk.how) == ("replay", "disk")
    assert torch.equal(replay.logits, disk.logits)
    direct = model.prefill_with_prefix(tokens, cache, publish=False)
    assert torch.equal(direct.logits, replay.logits)


def test_corrupt_disk_page_falls_back_to_the_longest_prefix_that_restored(model, tmp_path):
    """A flipped byte in a page of block 3: the tier rejects the file, the hit ends at 3 blocks, the pages taken for
    block 3 go back, and the logits are those of a replay after 48 cached tokens."""
    tokens = conversation(model)
    cache = model.new_paged_cache(64, 4, page_size=PAGE)
    sc = sessions(model, cache, tmp_path, host=False)
    sc.end_turn("s", first_turn(model, cache, tokens[:N1]), tokens[:N1])
    chain = cache.prefix.keys(tokens, 6)
    path = sc.disk.path_for(sc.disk_keys(chain[3], 4)[1])
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x10
    path.write_bytes(bytes(data))

    fresh = model.new_paged_cache(64, 2, page_size=PAGE)
    other = sessions(model, fresh, tmp_path, host=False)
    r = other.start_turn("s", tokens)
    assert r.how == "disk" and r.hit_tokens == 48
    assert other.disk.stats.corrupt == 1 and other.stats.disk_misses == 1 and not path.exists()
    assert r.disk_pages == 3 * sum(16 // (pool.ratio * PAGE) for pool in fresh.groups.values())
    assert len(fresh.prefix) == 3
    want = model.prefill_with_prefix(tokens, cache, publish=False, max_hit_tokens=48).logits
    assert torch.equal(r.logits, want)
    fresh.free(r.seq)
    assert sum(fresh.free_pages().values()) == sum(pool.n_pages for pool in fresh.groups.values())  # nothing leaked


def test_hbm_eviction_forces_the_disk_path(model, tmp_path):
    """Another sequence takes every page, evicting the published blocks: the next turn restores them from disk. With
    the state still parked that turn is pure (exact); without it, a replay after the restored blocks."""
    tokens = conversation(model)
    for parked in (False, True):
        cache = model.new_paged_cache({1: 20, 3: 20, 4: 40}, 3, page_size=PAGE)
        sc = sessions(model, cache, tmp_path / str(parked), host=parked)
        sc.end_turn("s", first_turn(model, cache, tokens[:N1]), tokens[:N1])
        assert len(cache.prefix) == 6
        hog = cache.add()
        cache.extend([hog], 320)  # every page of every group
        cache.free(hog)
        assert len(cache.prefix) == 0 and cache.prefix_stats.blocks_evicted == 6
        r = sc.start_turn("s", tokens)
        assert r.how == ("pure" if parked else "disk") and r.hit_tokens == 96 and r.pages_shared == 0 and r.disk_pages == 24
        if parked:
            assert torch.equal(r.logits, never_parked(model, tokens, N1))


def test_expired_host_state_forces_replay(model):
    """Past the host pool's TTL (a fake clock) the state is a miss: bounded replay after the HBM blocks."""
    tokens = conversation(model)
    clock = FakeClock()
    cache = model.new_paged_cache(64, 2, page_size=PAGE)
    sc = sessions(model, cache, clock=clock)
    sc.end_turn("s", first_turn(model, cache, tokens[:N1]), tokens[:N1])
    clock.t += sc.host.ttl_s + 1
    r = sc.start_turn("s", tokens)
    assert r.how == "replay" and r.host_bytes == 0 and r.hit_tokens == 96 and sc.host.stats.expired == 1


def test_a_prompt_that_does_not_extend_the_turn_drops_the_state(model):
    """An edited history (one token of block 4 changed): the parked state continues nothing; the prompt replays after
    its 4 unchanged blocks."""
    tokens = conversation(model)
    cache = model.new_paged_cache(64, 2, page_size=PAGE)
    sc = sessions(model, cache)
    sc.end_turn("s", first_turn(model, cache, tokens[:N1]), tokens[:N1])
    edited = tokens.clone()
    edited[70] = (edited[70] + 1) % model.cfg.vocab_size
    r = sc.start_turn("s", edited)
    assert r.how == "replay" and r.hit_tokens == 64 and sc.stats.states_dropped == 1 and "s" not in sc.host


def test_counters_and_bytes(model, tmp_path):
    """end_turn writes each block's pages once; the host holds rings, tails and the partial block's pages; the bytes a
    start_turn reports are what the tiers moved."""
    tokens = conversation(model)
    cache = model.new_paged_cache(64, 3, page_size=PAGE)
    sc = sessions(model, cache, tmp_path)
    seq = first_turn(model, cache, tokens[:N1])
    ring_bytes = state_bytes(sequence_state(cache, seq)[0])
    page_bytes = {src: sum(t[:PAGE].numel() for t in pool.tensors().values()) for src, pool in cache.groups.items()}  # uint8 rows
    sc.end_turn("s", seq, tokens[:N1])
    per_block = {src: 16 // (pool.ratio * PAGE) for src, pool in cache.groups.items()}
    assert sc.stats.blocks_published == 6 and sc.stats.pages_written == 6 * sum(per_block.values())
    # the partial block: entries 96 // r .. N1 // r - 1 of each group, in ceil(entries / PAGE) - 6 * per_block pages
    partial = {src: -(-(N1 // pool.ratio) // PAGE) - 6 * per_block[src] for src, pool in cache.groups.items()}
    assert partial == {1: 1, 3: 1, 4: 1}
    parked = ring_bytes + sum(n * page_bytes[src] for src, n in partial.items())
    assert sc.stats.host_bytes_parked == parked == sc.host.nbytes

    r = sc.start_turn("s", tokens)
    assert (r.how, r.host_bytes, r.disk_bytes, r.pages_shared) == ("pure", parked, 0, 6 * sum(per_block.values()))
    sc.end_turn("s", r.seq, tokens)  # turn 2's prompt: blocks 0-5 are on disk already, 6-8 are new
    assert sc.stats.blocks_published == 9 and sc.stats.pages_written == 9 * sum(per_block.values())

    other = sessions(model, model.new_paged_cache(64, 2, page_size=PAGE), tmp_path, host=False)
    r = other.start_turn("s", torch.cat([tokens, conversation(model, 20, seed=1)]))
    files = [other.disk.path_for(k) for key in cache.prefix.keys(tokens, 9) for src in cache.groups for k in other.disk_keys(key, src)]
    assert r.how == "disk" and r.disk_pages == len(files) == 9 * sum(per_block.values())
    assert r.disk_bytes == other.stats.disk_bytes_read == sum(f.stat().st_size for f in files)
    assert sc.stats.paths["pure"] == 1 and sc.stats.turns_ended == 2


def test_one_line_errors(model, tmp_path):
    cache = model.new_paged_cache(8, 2, page_size=PAGE)
    with pytest.raises(SessionError, match="model_id"):
        SessionCache(model, cache, DiskPageTier(tmp_path, durable=False))
    with pytest.raises(SessionError, match="new_paged_cache"):
        SessionCache(model, PagedKVCache(preset("v4.1-flash"), 1, 1))
    sc = sessions(model, cache)
    seq = first_turn(model, cache, conversation(model, 9))
    with pytest.raises(SessionError, match="consumed 9 tokens, got 8"):
        sc.end_turn("s", seq, conversation(model, 8))
    with pytest.raises(SessionError, match="empty"):
        sc.start_turn("s", torch.tensor([], dtype=torch.int64))


# -- lab e2e --phase multiturn --------------------------------------------------------------------


def test_measure_multiturn_on_tiny_float64(model, tmp_path):
    """The measuring function on the CPU (perf_counter): one row per path in the order cold, pure, replay, disk; each
    took its path; replay and disk give the same logits (the same page bytes), cold is its own reference; the report
    renders the rows with their path and a ratio against cold."""
    from lab.e2e.multiturn import measure_multiturn
    from lab.e2e.report import render_markdown, speedups
    from lab.e2e.run import Row

    rows = measure_multiturn(model, 200, 30, disk_dir=str(tmp_path), repeats=1, page_size=PAGE)
    by = {t.path: t for t in rows}
    assert [t.path for t in rows] == ["cold", "pure", "replay", "disk"] and all(t.ms > 0 for t in rows)
    assert by["cold"].rel_err == 0 and by["cold"].hit_tokens == 0
    assert by["pure"].hit_tokens == by["replay"].hit_tokens == by["disk"].hit_tokens == 192
    assert by["pure"].host_bytes > 0 and by["pure"].replayed == 0 and by["replay"].replayed == model.cfg.window
    # 12 blocks of 16 tokens: a page of each ratio-2 group, two of the ratio-1 group
    assert by["disk"].disk_pages == by["replay"].pages_shared == 12 * 4 and by["disk"].disk_bytes > 0
    assert by["replay"].rel_err == by["disk"].rel_err and by["replay"].max_abs_err == by["disk"].max_abs_err
    assert by["pure"].rel_err > 0  # pure decodes the suffix through every layer, cold is a CED prefill
    assert any(tmp_path.rglob("*.page"))

    doc_rows = [
        Row(f"multiturn/{t.path}", "torch", 1, 230, t.ms, "eager", logits_rel_err=t.rel_err, note=f"path {t.path}").to_dict() for t in rows
    ]
    md = render_markdown({"kind": "csa2-lab/e2e", "meta": {"preset": "tiny"}, "rows": doc_rows})
    assert "| multiturn/disk | torch | 1 | 230 |" in md and "path disk" in md and "`multiturn/<path>`" in md
    assert {s["what"] for s in speedups(doc_rows)} == {f"turn 2 {p} vs cold (torch)" for p in ("pure", "replay", "disk")}


def test_lab_e2e_multiturn_checks_its_arguments_before_any_gpu_work(capsys):
    from lab.cli import main

    assert main(["e2e", "--preset", "tiny", "--phase", "multiturn", "--prefix", "500", "--suffix", "32"]) == 2
    err = capsys.readouterr().err
    assert "--prefix 500 and --suffix 32" in err and "max_seq_len=512" in err and len(err.strip().splitlines()) == 1
    assert main(["e2e", "--preset", "tiny", "--phase", "multiturn", "--suffix", "0"]) == 2
    assert "--suffix takes one token count" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["e2e", "--preset", "tiny", "--phase", "multiturn", "--prefix", "256", "--suffix", "32"]) == 2
        err = capsys.readouterr().err
        assert "no CUDA GPU" in err and "Traceback" not in err


@pytest.mark.gpu
def test_lab_e2e_multiturn_rows(tmp_path):
    """On a GPU, `lab e2e --phase multiturn` on flash-mini (torch and tiles): four rows per backend, each timed, the
    path named in the note, replay and disk with the same logits error, the tiles cold path near torch's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run `pytest -m gpu` on a GPU machine)")
    from lab.cli import main
    from lab.e2e.report import load

    argv = ["e2e", "--preset", "flash-mini", "--phase", "multiturn", "--prefix", "2K", "--suffix", "256", "--repeats", "1"]
    assert main([*argv, "--backend", "torch,tiles", "--configs", "default", "--disk", str(tmp_path / "disk"), "--out", str(tmp_path)]) == 0
    rows = load(tmp_path / "e2e.json")["rows"]
    paths = ["multiturn/cold", "multiturn/pure", "multiturn/replay", "multiturn/disk"]
    assert [(r["phase"], r["variant"]) for r in rows] == [(p, v) for v in ("torch", "tiles/default") for p in paths]
    for r in rows:
        assert r["ms"] > 0 and r["context"] == 2304 and f"path {r['phase'].split('/')[1]}" in r["note"]
    for v in ("torch", "tiles/default"):
        got = {r["phase"]: r for r in rows if r["variant"] == v}
        assert got["multiturn/replay"]["logits_rel_err"] == got["multiturn/disk"]["logits_rel_err"]
        assert got["multiturn/disk"]["moved"]["disk_bytes"] > 0 and got["multiturn/pure"]["moved"]["host_bytes"] > 0
    assert "turn 2 disk vs cold" in (tmp_path / "e2e.md").read_text()


def test_a_turn_that_fails_keeps_the_parked_state_for_a_retry(model):
    """No free slot: start_turn raises OutOfSlots, and the session's SWA state stays parked, so the retry after a slot
    is freed still continues exactly (pure)."""
    from model.paged import OutOfSlots

    tokens = conversation(model)
    cache = model.new_paged_cache(64, 1, page_size=PAGE)
    sc = sessions(model, cache)
    sc.end_turn("s", first_turn(model, cache, tokens[:N1]), tokens[:N1])
    blocker = cache.add()  # takes the only slot
    with pytest.raises(OutOfSlots):
        sc.start_turn("s", tokens)
    assert "s" in sc.host
    cache.free(blocker)
    r = sc.start_turn("s", tokens)
    assert r.how == "pure" and torch.equal(r.logits, never_parked(model, tokens, N1))
    assert "s" not in sc.host  # continued: the state now lives in the sequence's slot
