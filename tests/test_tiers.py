"""Storage tiers: the disk tier of global KV pages (format, checks, atomic writes under kill -9 and concurrent
processes, faults, retention and LRU budget) and the host pool of SWA state (TTL, LRU budget)."""

from __future__ import annotations

import errno
import hashlib
import json
import multiprocessing
import os
import random
import signal
import time
import warnings
from pathlib import Path

import pytest
import torch

from model import build_model
from model.config import preset
from model.paged import PagedKVCache, PagePool
from model.tiers import (
    CorruptPage,
    DiskPageTier,
    HostStatePool,
    PagePayload,
    TierDegradedWarning,
    decode_page,
    encode_page,
    page_key,
    restore_sequence_state,
    sequence_state,
    state_bytes,
)

FLASH = preset("v4.1-flash")
T0 = 1_700_000_000.0  # the fake clocks' start (epoch seconds: the disk tier stores last use as mtime)
HOUR = 3600.0


class FakeClock:
    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def widths(cfg=FLASH) -> tuple[int, int, int, int]:
    D, Di = cfg.head_dim, cfg.index_head_dim
    return D // 2, D // cfg.main_fp4_group, Di // 2, Di // cfg.index_fp4_group


def make_page(seed: int, page_size: int = 64, cfg=FLASH) -> PagePayload:
    """A page of random bytes (never zeros): uint8 [P, D/2], [P, D/16], [P, Di/2], [P, Di/32]."""
    g = torch.Generator().manual_seed(seed)
    return PagePayload(*(torch.randint(0, 256, (page_size, w), dtype=torch.uint8, generator=g) for w in widths(cfg)))


def poisoned_like(page: PagePayload) -> PagePayload:
    """Destination tensors of a page's shapes filled with a byte pattern a page read must replace or leave alone."""
    return PagePayload(*(torch.full_like(t, 0xA5) for t in page.tensors()))


def key_of(i: int) -> str:
    return page_key("v4.1-flash/test", 2, hashlib.sha256(str(i).encode()).digest())


def page_files(root: Path) -> list[Path]:
    return sorted(root.glob("*/*.page"))


# -- keys and format -------------------------------------------------------------------------------


def test_page_key_is_sha256_hex_over_separate_fields():
    k = page_key("v4.1-flash", 2, b"\x01" * 32)
    assert len(k) == 64 and int(k, 16) >= 0 and k == k.lower()
    assert k == page_key("v4.1-flash", 2, bytearray(b"\x01" * 32))
    others = {page_key("v4.1-flash", 3, b"\x01" * 32), page_key("v4.1-flas", 2, b"h" + b"\x01" * 32), page_key("other", 2, b"\x01" * 32)}
    assert k not in others and len(others) == 3
    with pytest.raises(TypeError, match="chain must be bytes"):
        page_key("m", 2, "abc")
    with pytest.raises(ValueError, match="source"):
        page_key("m", -1, b"abc")


@pytest.mark.parametrize("page_size", [64, 63, 1], ids=lambda p: f"P{p}")
def test_encode_decode_page_round_trip_bit_exact(page_size):
    page, key = make_page(page_size, page_size), key_of(0)
    data = encode_page(key, page)
    assert len(data) > page.nbytes
    back = decode_page(key, data)
    assert back.equal(page) and back.shapes == page.shapes
    assert all(t.is_contiguous() and t.dtype == torch.uint8 for t in back.tensors())


def _corruptions(data: bytes) -> dict[str, bytes]:
    n = len(data)
    flipped = {f"flip@{at}": data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :] for at in (0, 9, 16, 30, 60, 100, n // 2, n - 1)}
    return {
        **flipped,
        "truncated": data[: n - 1],
        "half": data[: n // 2],
        "header_only": data[:40],
        "empty": b"",
        "padded": data + b"\0",
        "garbage": random.Random(0).randbytes(n),
    }


def test_decode_page_rejects_every_damaged_form():
    page, key = make_page(1), key_of(0)
    data = encode_page(key, page)
    for name, bad in _corruptions(data).items():
        with pytest.raises(CorruptPage):
            decode_page(key, bad)
            pytest.fail(f"{name} decoded")
    with pytest.raises(CorruptPage, match="another key"):
        decode_page(key_of(1), data)


def test_encode_page_rejects_tensors_of_the_wrong_kind():
    page = make_page(0)
    with pytest.raises(ValueError, match="uint8"):
        encode_page(key_of(0), PagePayload(page.main_packed.int(), *page.tensors()[1:]))
    with pytest.raises(ValueError, match="same number of rows"):
        encode_page(key_of(0), PagePayload(page.main_packed[:63], *page.tensors()[1:]))


# -- disk tier: round trip and checks ---------------------------------------------------------------


@pytest.mark.parametrize("into", ["new", "out"])
def test_disk_put_get_round_trip_bit_exact(tmp_path, into):
    tier = DiskPageTier(tmp_path)
    pages = {key_of(i): make_page(i) for i in range(3)}
    for k, p in pages.items():
        assert tier.put(k, p)
    for k, p in pages.items():
        out = poisoned_like(p) if into == "out" else None
        got = tier.get(k, out=out)
        assert got is not None and got.equal(p)
        if out is not None:
            assert got is out
    assert tier.get(key_of(99)) is None
    s = tier.stats
    assert (s.writes, s.hits, s.misses, s.corrupt) == (3, 3, 1, 0)
    assert s.bytes_written == s.bytes_read == sum(p.stat().st_size for p in page_files(tmp_path))
    assert tier.usage() == (3, s.bytes_written)


def test_disk_round_trip_between_page_pools(tmp_path):
    """Pages leave one cache's pool and land in another's rows bit-exactly; other rows stay as they were."""
    cfg = preset("tiny")
    src_pool, dst_pool = PagePool(cfg, 0, 1, 4, 16, "cpu"), PagePool(cfg, 0, 1, 4, 16, "cpu")
    g = torch.Generator().manual_seed(3)
    for t in (*src_pool.tensors().values(), *dst_pool.tensors().values()):
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g))
    before = {n: t.clone() for n, t in dst_pool.tensors().items()}
    tier = DiskPageTier(tmp_path)
    assert tier.put(key_of(0), PagePayload.from_pool(src_pool, 2))
    page = tier.get(key_of(0))
    page.copy_into_pool(dst_pool, 1)
    for n, t in dst_pool.tensors().items():
        assert torch.equal(t[16:32], src_pool.tensors()[n][32:48])
        assert torch.equal(t[:16], before[n][:16]) and torch.equal(t[32:], before[n][32:])


@pytest.mark.parametrize("damage", ["flip@0", "flip@60", "flip@100", "truncated", "half", "empty", "padded", "garbage"])
def test_disk_corrupt_file_is_a_miss_and_removed(tmp_path, damage):
    tier, page, key = DiskPageTier(tmp_path), make_page(5), key_of(5)
    tier.put(key, page)
    path = tier.path_for(key)
    path.write_bytes(_corruptions(path.read_bytes())[damage])
    out = poisoned_like(page)
    assert tier.get(key, out=out) is None
    assert all(bool((t == 0xA5).all()) for t in out.tensors()), "a corrupt page reached the destination"
    assert not path.exists()
    assert (tier.stats.corrupt, tier.stats.misses, tier.stats.hits) == (1, 1, 0)
    assert tier.put(key, page) and tier.get(key).equal(page)


def test_disk_page_copied_under_another_key_is_a_miss(tmp_path):
    tier = DiskPageTier(tmp_path)
    tier.put(key_of(1), make_page(1))
    tier.path_for(key_of(2)).parent.mkdir(exist_ok=True)
    os.replace(tier.path_for(key_of(1)), tier.path_for(key_of(2)))
    assert tier.get(key_of(2)) is None and tier.stats.corrupt == 1


def test_disk_get_into_other_shapes_is_a_miss(tmp_path):
    tier = DiskPageTier(tmp_path)
    tier.put(key_of(0), make_page(0, 64))
    out = poisoned_like(make_page(0, 32))
    assert tier.get(key_of(0), out=out) is None
    assert all(bool((t == 0xA5).all()) for t in out.tensors())
    assert tier.get(key_of(0)).equal(make_page(0, 64))


def test_disk_stale_temp_file_is_never_read_and_swept(tmp_path):
    """A writer that died leaves a temp file: a get of its key misses, a sweep removes it once it is old."""
    tier, key = DiskPageTier(tmp_path), key_of(7)
    full = encode_page(key, make_page(7))
    tmp = tier.path_for(key).parent / f".{key}.12345.deadbeef.tmp"
    tmp.parent.mkdir(parents=True)
    tmp.write_bytes(full[: len(full) // 2])
    assert tier.get(key) is None and tier.stats.corrupt == 0
    assert tier.sweep().temps_removed == 0 and tmp.exists()  # may be a live writer's
    old = time.time() - 2 * tier.temp_grace_s
    os.utime(tmp, (old, old))
    report = tier.sweep()
    assert report.temps_removed == 1 and not tmp.exists() and report.files == 0


def test_disk_put_of_a_stored_key_only_marks_it_used(tmp_path):
    clock = FakeClock()
    tier = DiskPageTier(tmp_path, clock=clock)
    tier.put(key_of(0), make_page(0))
    clock.t += HOUR
    assert tier.put(key_of(0), make_page(1))  # same key, so same content: not rewritten
    assert tier.get(key_of(0)).equal(make_page(0))
    assert tier.path_for(key_of(0)).stat().st_mtime == clock.t
    assert (tier.stats.writes, tier.stats.skipped) == (1, 1)
    assert tier.put(key_of(0), make_page(1), overwrite=True) and tier.get(key_of(0)).equal(make_page(1))


def test_disk_bad_keys_raise(tmp_path):
    tier = DiskPageTier(tmp_path)
    for bad in ("", "ABCDEF0123456789", "../../etc/passwd", "0123", "g" * 64):
        with pytest.raises(ValueError, match="lowercase hex"):
            tier.get(bad)
        with pytest.raises(ValueError, match="lowercase hex"):
            tier.put(bad, make_page(0))


# -- disk tier: kill -9 and concurrent processes ----------------------------------------------------

KILL_PAGE_SIZE = 4096  # 1.4 MB pages: a put takes milliseconds, so most kills land inside one


def _write_forever(root: str, key: str, pages: list[PagePayload]) -> None:
    tier = DiskPageTier(root)
    i = 0
    while True:
        tier.put(key, pages[i % len(pages)], overwrite=True)
        i += 1


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_disk_kill9_during_page_write_leaves_a_miss_or_a_whole_page(tmp_path):
    """A writer killed with SIGKILL at random moments: the key reads back as a miss or exactly one whole payload."""
    key = key_of(0)
    pages = [make_page(100 + i, KILL_PAGE_SIZE) for i in range(3)]
    rng = random.Random(0)
    outcomes = []
    for _ in range(8):
        pid = os.fork()
        if pid == 0:  # the child only writes files: no torch kernels, nothing that could wait on the parent's threads
            try:
                _write_forever(str(tmp_path), key, pages)
            finally:
                os._exit(1)
        time.sleep(rng.uniform(0.005, 0.06))
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        temps = list(tmp_path.glob("*/.*.tmp"))
        got = DiskPageTier(tmp_path).get(key)
        assert got is None or any(got.equal(p) for p in pages), "a killed write produced a page that was never put"
        outcomes.append((got is not None, len(temps)))
    assert any(hit for hit, _ in outcomes), f"no write ever completed: {outcomes}"
    assert outcomes[-1][1] >= 1, f"no kill landed inside a write (no temp file left): {outcomes}"
    tier = DiskPageTier(tmp_path, temp_grace_s=0.0)
    tier.sweep()
    assert not list(tmp_path.glob("*/.*.tmp"))
    assert tier.get(key) is not None


def _hammer(root: str, worker: int, keys: list[str], rounds: int, result: str, start=None) -> None:
    """One of two processes writing and reading the same keys; every read must be a whole page some worker put."""
    tier = DiskPageTier(root, durable=False)
    # Each key's two pages in stored form: comparing bytes is exact and, on a busy host, far cheaper than torch.equal.
    variants = {k: [encode_page(k, make_page(1000 * i + v, 256)) for v in range(2)] for i, k in enumerate(keys)}
    rng = random.Random(worker)
    hits = misses = 0
    if start is not None:
        start.set()  # ready: the other process hammers from now on too
    for _ in range(rounds):
        k = rng.choice(keys)
        tier.put(k, decode_page(k, variants[k][rng.randrange(2)]), overwrite=True)
        k = rng.choice(keys)
        got = tier.get(k)
        if got is None:
            misses += 1
        elif encode_page(k, got) in variants[k]:
            hits += 1
        else:
            raise AssertionError(f"worker {worker} read a page of {k} that no worker put")
    Path(result).write_text(json.dumps({"hits": hits, "misses": misses, "corrupt": tier.stats.corrupt}))


def test_disk_two_processes_hammering_the_same_keys_read_only_whole_pages(tmp_path):
    """A spawned process and this one put and get the same keys at once; each checks every page it reads."""
    root = tmp_path / "pages"
    keys = [key_of(i) for i in range(3)]
    spawn = multiprocessing.get_context("spawn")
    ready = spawn.Event()
    results = [tmp_path / f"w{w}.json" for w in range(2)]
    other = spawn.Process(target=_hammer, args=(str(root), 1, keys, 400, str(results[1]), ready))
    other.start()
    try:
        assert ready.wait(120), "the spawned writer did not start"
        _hammer(str(root), 0, keys, 400, str(results[0]))
    finally:
        other.join(120)
    assert other.exitcode == 0
    for r in results:
        res = json.loads(r.read_text())
        assert res["corrupt"] == 0 and res["hits"] > 0
    assert not list(root.glob("*/.*.tmp"))


# -- disk tier: faults ------------------------------------------------------------------------------


def _fail_writes_with(tier: DiskPageTier, monkeypatch, code: int) -> list[Path]:
    """Make the tier's file writes fail with ``code`` after half the bytes (a disk filling up mid-write)."""
    temps: list[Path] = []

    def write_half_then_fail(tmp: Path, data: bytes) -> None:
        temps.append(tmp)
        with open(tmp, "xb") as f:
            f.write(data[: len(data) // 2])
        raise OSError(code, os.strerror(code), str(tmp))

    monkeypatch.setattr(tier, "_write_file", write_half_then_fail)
    return temps


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EACCES], ids=errno.errorcode.get)
def test_disk_full_or_read_only_warns_once_and_stops_writing(tmp_path, monkeypatch, code):
    tier = DiskPageTier(tmp_path)
    tier.put(key_of(0), make_page(0))
    temps = _fail_writes_with(tier, monkeypatch, code)
    with pytest.warns(TierDegradedWarning, match=rf"{tmp_path}.*{errno.errorcode[code]}.*writes are off"):
        first = tier.put(key_of(1), make_page(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per tier: later puts are quiet no-ops
        later = [tier.put(key_of(i), make_page(i)) for i in (2, 3)]
    assert first is False and later == [False, False]
    assert len(temps) == 1  # after the fault, puts do not touch the disk
    assert not temps[0].exists()  # the half-written temp file was removed
    assert tier.degraded is not None and errno.errorcode[code] in tier.degraded
    assert (tier.stats.write_errors, tier.stats.skipped) == (1, 2)
    assert tier.get(key_of(0)).equal(make_page(0))  # stored pages are still read
    assert tier.get(key_of(1)) is None


def test_disk_other_write_error_warns_once_and_keeps_writing(tmp_path, monkeypatch):
    tier = DiskPageTier(tmp_path)
    _fail_writes_with(tier, monkeypatch, errno.EIO)
    with pytest.warns(TierDegradedWarning, match="EIO"):
        first = tier.put(key_of(1), make_page(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = tier.put(key_of(2), make_page(2))
    assert first is False and second is False
    assert tier.degraded is None and tier.stats.write_errors == 2
    monkeypatch.undo()
    assert tier.put(key_of(1), make_page(1)) and tier.get(key_of(1)).equal(make_page(1))


def test_disk_read_only_directory(tmp_path):
    """The real thing where chmod binds (not as root): a directory of mode 0o555 degrades the tier, reads go on."""
    root = tmp_path / "ro"
    DiskPageTier(root).put(key_of(0), make_page(0))
    sub = DiskPageTier(root).path_for(key_of(0)).parent
    for d in (root, sub):
        d.chmod(0o555)
    try:
        probe = sub / "probe"
        try:
            probe.write_bytes(b"x")
            probe.unlink()
            pytest.skip("chmod 0o555 does not stop this user from writing (root)")
        except PermissionError:
            pass
        tier = DiskPageTier(root)
        with pytest.warns(TierDegradedWarning, match="EACCES"):
            assert tier.put(key_of(1), make_page(1)) is False
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert tier.put(key_of(2), make_page(2)) is False
        assert tier.get(key_of(0)).equal(make_page(0))
    finally:
        for d in (root, sub):
            d.chmod(0o755)


def test_disk_uncreatable_directory_degrades_without_raising(tmp_path, monkeypatch):
    def refuse(self, *a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(Path, "mkdir", refuse)
    with pytest.warns(TierDegradedWarning, match="EROFS"):
        tier = DiskPageTier(tmp_path / "none")
    monkeypatch.undo()
    assert tier.put(key_of(0), make_page(0)) is False and tier.get(key_of(0)) is None


# -- disk tier: retention and budget ----------------------------------------------------------------


def test_disk_retention_by_last_use_survives_a_new_tier(tmp_path):
    clock = FakeClock()
    tier = DiskPageTier(tmp_path, clock=clock)
    assert tier.retention_s == 72 * HOUR
    for i in range(3):
        tier.put(key_of(i), make_page(i))
    clock.t += 71 * HOUR
    assert tier.get(key_of(0)) is not None  # used: its 72 hours start again
    clock.t += 2 * HOUR
    fresh = DiskPageTier(tmp_path, clock=clock)  # last use lives in the files, not in the instance
    assert fresh.get(key_of(1)) is None and fresh.stats.expired == 1 and not fresh.path_for(key_of(1)).exists()
    assert not fresh.contains(key_of(2)) and fresh.contains(key_of(0))
    report = fresh.sweep()
    assert (report.files, report.expired, report.evicted) == (1, 1, 0)
    clock.t += 70 * HOUR
    assert fresh.get(key_of(0)).equal(make_page(0))
    clock.t += 72 * HOUR + 1
    assert fresh.sweep().expired == 1 and page_files(tmp_path) == []


def test_disk_touch_restarts_retention_of_stored_pages_only(tmp_path):
    """A hit served from HBM marks the page's disk copy used (touch): its 72 hours start again; an expired or absent
    page is not revived."""
    clock = FakeClock()
    tier = DiskPageTier(tmp_path, clock=clock)
    tier.put(key_of(0), make_page(0))
    tier.put(key_of(1), make_page(1))
    clock.t += 71 * HOUR
    assert tier.touch(key_of(0)) and not tier.touch(key_of(2))
    clock.t += 2 * HOUR
    assert not tier.touch(key_of(1)) and not tier.contains(key_of(1))
    assert tier.get(key_of(0)).equal(make_page(0))


def test_disk_budget_evicts_least_recently_used_first_across_instances(tmp_path):
    clock = FakeClock()
    tier = DiskPageTier(tmp_path, clock=clock)
    for i in range(5):
        clock.t += 1
        tier.put(key_of(i), make_page(i))
    clock.t += 1
    tier.get(key_of(0))  # the oldest write, now the latest use
    size = tier.path_for(key_of(0)).stat().st_size
    fresh = DiskPageTier(tmp_path, clock=clock, max_bytes=3 * size, evict_to=1.0)
    report = fresh.sweep()
    assert (report.files, report.bytes, report.evicted) == (3, 3 * size, 2)
    assert {k for k in map(key_of, range(5)) if fresh.contains(k)} == {key_of(0), key_of(3), key_of(4)}
    clock.t += 1
    assert fresh.put(key_of(5), make_page(5))  # over budget: the least recently used (3) goes
    assert {k for k in map(key_of, range(6)) if fresh.contains(k)} == {key_of(0), key_of(4), key_of(5)}
    assert fresh.stats.evictions == 3 and fresh.usage() == (3, 3 * size)


def test_disk_budget_put_evicts_down_to_the_low_water_mark(tmp_path):
    clock = FakeClock()
    size = len(encode_page(key_of(0), make_page(0)))
    tier = DiskPageTier(tmp_path, clock=clock, max_bytes=10 * size, evict_to=0.5)
    for i in range(11):
        clock.t += 1
        assert tier.put(key_of(i), make_page(i))
    kept = [i for i in range(11) if tier.contains(key_of(i))]
    assert kept == list(range(6, 11)) and tier.stats.evictions == 6


# -- host pool --------------------------------------------------------------------------------------


def make_state(seed: int, layers: int = 2, window: int = 8, dim: int = 64) -> dict[str, torch.Tensor]:
    """One sequence's state: per layer ring codes uint8 [W, D] and scales [W, D/32], one tail kv/gate float32 [1, D]."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(layers):
        out[f"ring{i}.codes"] = torch.randint(0, 256, (window, dim), dtype=torch.uint8, generator=g)
        out[f"ring{i}.scales"] = torch.randint(0, 256, (window, dim // 32), dtype=torch.uint8, generator=g)
    out["tail2.kv"], out["tail2.gate"] = torch.randn(2, 1, dim, generator=g, dtype=torch.float32).unbind(0)
    return out


def test_host_pool_round_trip_stores_copies(tmp_path):
    pool = HostStatePool(1 << 20)
    state = make_state(0)
    meta = {"n_tokens": 900, "rings": [[772, 900], [772, 900]], "tail": {2: 1}}
    strided = {n: t.t() if t.dim() == 2 else t for n, t in state.items()}  # any layout in
    assert pool.put("s1", strided, meta)
    for t in state.values():
        t.add_(1)  # the caller's tensors change: the parked copy must not
    meta["rings"][0][0] = -1
    got = pool.get("s1")
    expect = make_state(0)
    for n, t in got.tensors.items():
        assert t.device.type == "cpu" and t.is_contiguous()
        assert torch.equal(t, expect[n].t() if expect[n].dim() == 2 else expect[n])
    assert got.meta == {"n_tokens": 900, "rings": [[772, 900], [772, 900]], "tail": {2: 1}}
    assert got.nbytes == state_bytes(state) == pool.nbytes
    assert pool.pop("s1") is got and "s1" not in pool and pool.nbytes == 0
    assert pool.get("s1") is None
    s = pool.stats
    assert (s.writes, s.hits, s.misses, s.bytes_written, s.bytes_read) == (1, 2, 1, got.nbytes, 2 * got.nbytes)


def test_host_pool_ttl_by_last_use():
    clock = FakeClock(0.0)
    pool = HostStatePool(1 << 20, clock=clock)
    assert pool.ttl_s == 600.0
    pool.put("a", make_state(0))
    pool.put("b", make_state(1))
    clock.t = 590.0
    assert pool.get("a") is not None
    clock.t = 601.0
    assert "b" not in pool and pool.get("b") is None and pool.stats.expired == 1
    assert "a" in pool
    clock.t = 590.0 + 600.0 + 1
    assert pool.sweep() == 1 and len(pool) == 0 and pool.nbytes == 0


def test_host_pool_budget_evicts_least_recently_used():
    clock = FakeClock(0.0)
    size = state_bytes(make_state(0))
    pool = HostStatePool(3 * size, clock=clock)
    for i in range(3):
        clock.t += 1
        assert pool.put(i, make_state(i))
    clock.t += 1
    pool.get(0)
    assert pool.put(3, make_state(3))  # the least recently used (1) goes
    assert pool.keys() == [2, 0, 3] and pool.stats.evictions == 1 and pool.nbytes == 3 * size
    assert pool.put(2, make_state(20))  # replacing a key frees its old bytes first: nothing evicted
    assert pool.keys() == [0, 3, 2] and pool.stats.evictions == 1
    assert torch.equal(pool.get(2).tensors["ring0.codes"], make_state(20)["ring0.codes"])


def test_host_pool_expired_entries_go_before_live_ones():
    clock = FakeClock(0.0)
    size = state_bytes(make_state(0))
    pool = HostStatePool(2 * size, ttl_s=10.0, clock=clock)
    pool.put("old", make_state(0))
    clock.t = 5.0
    pool.put("live", make_state(1))
    clock.t = 12.0
    pool.put("new", make_state(2))
    assert pool.keys() == ["live", "new"] and (pool.stats.expired, pool.stats.evictions) == (1, 0)


def test_host_pool_refuses_a_state_larger_than_the_budget():
    size = state_bytes(make_state(0))
    pool = HostStatePool(size - 1)
    pool.put("s", make_state(0, layers=1))
    assert pool.put("s", make_state(0)) is False
    assert "s" not in pool and pool.nbytes == 0 and pool.stats.skipped == 1
    with pytest.raises(ValueError, match="ttl_s"):
        HostStatePool(10, ttl_s=0)


# -- both tiers behind the paged cache --------------------------------------------------------------


def test_parked_sequence_resumes_in_a_fresh_cache_bit_exact(tmp_path):
    """Park a prefilled sequence (pages to disk, state slot to host memory), resume it in another cache whose rows hold
    random bytes: the next decode steps give the logits the original cache gives, bit for bit."""
    model = build_model(preset("tiny"), dtype=torch.float64, seed=0)
    cfg, N = model.cfg, 37  # an odd length: a ratio-2 group waits in its tail
    prompt = torch.randint(0, cfg.vocab_size, (N,), generator=torch.Generator().manual_seed(0))
    a = model.new_paged_cache(n_pages=8, n_slots=2, page_size=8)
    sa = a.add()
    model.prefill_paged(prompt, a, sa)

    disk, host = DiskPageTier(tmp_path), HostStatePool(1 << 24)
    keys: dict[int, list[str]] = {}
    for src, pages in a.sequence(sa).pages.items():
        keys[src] = [page_key("tiny/test", src, bytes([j])) for j in range(len(pages))]
        for k, p in zip(keys[src], pages, strict=True):
            assert disk.put(k, PagePayload.from_pool(a.groups[src], p))
    assert host.put("session-1", *sequence_state(a, sa))

    b = model.new_paged_cache(n_pages=16, n_slots=3, page_size=8)
    g = torch.Generator().manual_seed(1)
    for t in b.tensors().values():  # a read of a row the resume did not write shows up in the logits
        t.copy_(
            torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g)
            if t.dtype == torch.uint8
            else torch.randn(t.shape, generator=g, dtype=t.dtype)
        )
    b.add()  # another sequence first: the resumed one gets other page ids and another slot
    b.extend([0], 20)
    sb = b.add()
    b.extend([sb], N)
    for src, ks in keys.items():
        for k, p in zip(ks, b.sequence(sb).pages[src], strict=True):
            disk.get(k).copy_into_pool(b.groups[src], p)
        b.sequence(sb).entries[src] = a.sequence(sa).entries[src]
    b.advance([sb], N)
    entry = host.pop("session-1")
    restore_sequence_state(b, sb, entry.tensors, entry.meta)
    assert entry.meta["n_tokens"] == b.length(sb) == N

    for step in range(3):
        tok = torch.tensor([step + 5])
        la, lb = model.decode_paged(tok, a, [sa]), model.decode_paged(tok, b, [sb])
        assert torch.equal(la, lb), f"step {step}: max diff {(la - lb).abs().max()}"


def test_restore_sequence_state_rejects_another_cache_shape():
    cfg = preset("tiny")
    a, b = PagedKVCache(cfg, 2, 1, 8), PagedKVCache(cfg, 2, 1, 8)
    tensors, meta = sequence_state(a, a.add())
    sb = b.add()
    with pytest.raises(ValueError, match="another cache"):
        restore_sequence_state(b, sb, {k: v for k, v in tensors.items() if k != "ring0.codes"}, meta)
    with pytest.raises(ValueError, match="another cache"):
        restore_sequence_state(b, sb, tensors, {**meta, "window": meta["window"] + 1})
    with pytest.raises(ValueError, match=r"ring0.codes is \[3"):
        restore_sequence_state(b, sb, {**tensors, "ring0.codes": tensors["ring0.codes"][:3]}, meta)
    tail = next(k for k in tensors if k.startswith("tail") and k.endswith(".kv"))
    before = {k: v.clone() for k, v in b.tensors().items()}
    with pytest.raises(ValueError, match=rf"{tail} is \[5, "):  # more pending rows than a group holds
        restore_sequence_state(b, sb, {**tensors, tail: torch.zeros(5, tensors[tail].shape[-1])}, meta)
    assert all(torch.equal(v, before[k]) for k, v in b.tensors().items())  # nothing written
