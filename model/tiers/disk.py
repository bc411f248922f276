"""Disk tier of global KV pages: content-addressed page files kept for days, least recently used dropped first.

Global KV is small per token and reused across many later turns, so a page outlives the sequence that made it:
a page evicted from the HBM pool (or the pool of a restarted server) comes back from here instead of a prefill.

* **Files**: ``root/<k[:2]>/<key>.page`` in the format of :mod:`model.tiers.pagefile` (header, blake2b-256).
* **Atomic writes**: a temp file in the same directory (``.<key>.<pid>.<random>.tmp``), written, fsync'd, then
  ``os.replace``'d over the page; the directory is fsync'd after a rename or a new sub-directory. A reader opens either
  the old file or the new one, never a half-written one, whichever process wrote it.
* **Checked reads**: a file that is not one whole page of its key (torn, flipped, truncated, garbage) counts as corrupt,
  is removed and read as a miss. No byte of it reaches the caller's tensors.
* **Last use** is the file's mtime, set on write and on every hit; retention and LRU eviction read it back from the
  files, so they survive restarts and are shared by every process using the directory.
* **Faults**: a full, read-only or forbidden directory (ENOSPC, EDQUOT, EROFS, EACCES, EPERM) gives one
  :class:`TierDegradedWarning` and turns writes off for this instance; reads go on. No OS error reaches the caller.
"""

from __future__ import annotations

import errno
import os
import secrets
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from model.tiers.keys import check_key
from model.tiers.pagefile import CorruptPage, PagePayload, decode_page, encode_page
from model.tiers.stats import TierDegradedWarning, TierStats

DEFAULT_RETENTION_S = 72 * 3600.0
DEFAULT_TEMP_GRACE_S = 3600.0
_NO_WRITE = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}
_SUFFIX, _TEMP = ".page", ".tmp"


@dataclass(frozen=True)
class SweepReport:
    """What one :meth:`DiskPageTier.sweep` found and did."""

    files: int  # pages kept
    bytes: int  # their bytes
    expired: int
    evicted: int
    temps_removed: int  # temp files of writers that died mid-write


class DiskPageTier:
    """Content-addressed global KV pages under one directory.

    Args:
        root: the directory (created if missing); several processes may share it.
        retention_s: a page whose last use is longer ago than this is dropped (72 hours by default).
        max_bytes: the byte budget of all page files; None for no budget. Over it, the least recently used pages go
            first until the total is at most ``evict_to * max_bytes``.
        evict_to: the fraction of the budget an eviction brings the total down to (room for the next puts).
        clock: seconds since the epoch (``time.time``); last use is stored in that time base as the mtime.
        durable: fsync files and directories (off only where losing pages on power loss is fine, e.g. tmpfs).
        temp_grace_s: a temp file older than this (wall time) belongs to a writer that died; sweep removes it.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        retention_s: float = DEFAULT_RETENTION_S,
        max_bytes: int | None = None,
        evict_to: float = 0.9,
        clock: Callable[[], float] = time.time,
        durable: bool = True,
        temp_grace_s: float = DEFAULT_TEMP_GRACE_S,
    ) -> None:
        if retention_s <= 0 or (max_bytes is not None and max_bytes < 0) or not 0 <= evict_to <= 1:
            raise ValueError(
                f"retention_s must be > 0, max_bytes >= 0 or None, evict_to in [0, 1]; got {retention_s}, {max_bytes}, {evict_to}"
            )
        self.root = Path(root)
        self.retention_s, self.max_bytes, self.evict_to = retention_s, max_bytes, evict_to
        self.clock, self.durable, self.temp_grace_s = clock, durable, temp_grace_s
        self.stats = TierStats()
        self._degraded: str | None = None
        self._warned_error = False
        self._used: int | None = None  # bytes on disk as this instance last counted them (sweep recounts)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self._fault(e, "creating the directory")

    # -- state -----------------------------------------------------------------------------------

    @property
    def degraded(self) -> str | None:
        """Why writes are off (the OS error), or None while the tier writes."""
        return self._degraded

    def path_for(self, key: str) -> Path:
        """The file of a page key (whether or not it exists)."""
        check_key(key)
        return self.root / key[:2] / f"{key}{_SUFFIX}"

    def _fault(self, e: OSError, doing: str) -> None:
        """One warning per instance; a full or read-only disk turns writes off for good (nothing raises)."""
        name = errno.errorcode.get(e.errno or 0, "no errno")
        if e.errno in _NO_WRITE:
            if self._degraded is None:
                self._degraded = f"{name}: {e.strerror or e}"
                warnings.warn(
                    f"KV disk tier {self.root}: {name} ({e.strerror or e}) while {doing}; writes are off for this tier,"
                    " stored pages are still read. Free space or fix the directory's permissions, then open a new tier.",
                    TierDegradedWarning,
                    stacklevel=3,
                )
        elif not self._warned_error:
            self._warned_error = True
            warnings.warn(
                f"KV disk tier {self.root}: {name} ({e.strerror or e}) while {doing}; that page was not stored"
                " (later errors of this kind are only counted in stats.write_errors).",
                TierDegradedWarning,
                stacklevel=3,
            )

    # -- pages -----------------------------------------------------------------------------------

    def put(self, key: str, page: PagePayload, *, overwrite: bool = False) -> bool:
        """Store a page under ``key``; True when the page is on disk afterwards.

        A key names its content, so a key already stored is only marked used (unless ``overwrite``). Raises
        ValueError for a malformed key or tensors that are not uint8 [page_size, width]; OS errors are absorbed
        (see the module doc) and give False.
        """
        path = self.path_for(key)
        data = encode_page(key, page)
        if self._degraded is not None:
            self.stats.skipped += 1
            return False
        if not overwrite and self._touch(path):
            self.stats.skipped += 1
            return True
        tmp = path.parent / f".{key}.{os.getpid()}.{secrets.token_hex(4)}{_TEMP}"
        try:
            self._make_dir(path.parent)
            self._write_file(tmp, data)
            os.replace(tmp, path)
            if self.durable:
                self._fsync_dir(path.parent)
        except OSError as e:
            self.stats.write_errors += 1
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            self._fault(e, f"writing page {key}")
            return False
        self.stats.writes += 1
        self.stats.bytes_written += len(data)
        if self.max_bytes is not None:
            # the first count is a sweep's, which already sees the file just written
            self._used = self.sweep().bytes if self._used is None else self._used + len(data)
            if self._used > self.max_bytes:
                self.sweep()
        return True

    def get(self, key: str, out: PagePayload | None = None) -> PagePayload | None:
        """The page stored under ``key``, or None (a miss: absent, expired, corrupt or of other shapes than ``out``).

        With ``out`` (four uint8 tensors of the page's shapes, any device, e.g. views of pool rows) the page is
        copied into it and ``out`` is returned; ``out`` is written only after the whole file passed its checks.
        Without it, new contiguous CPU uint8 tensors are returned.
        """
        path = self.path_for(key)
        try:
            with open(path, "rb", buffering=0) as f:
                st = os.fstat(f.fileno())
                if self.clock() - st.st_mtime > self.retention_s:
                    self._remove_if_same(path, st)
                    self.stats.expired += 1
                    self.stats.misses += 1
                    return None
                data = f.read()
        except OSError:
            self.stats.misses += 1
            return None
        try:
            page = decode_page(key, data)
        except CorruptPage:
            self._remove_if_same(path, st)
            self.stats.corrupt += 1
            self.stats.misses += 1
            return None
        if out is not None:
            if out.shapes != page.shapes:
                self.stats.misses += 1
                return None
            for dst, src in zip(out.tensors(), page.tensors(), strict=True):
                dst.copy_(src)
            page = out
        self.stats.hits += 1
        self.stats.bytes_read += len(data)
        if self._degraded is None:
            self._touch(path)
        return page

    def contains(self, key: str) -> bool:
        """Whether a page file of ``key`` exists and has not expired (its content is checked only by :meth:`get`)."""
        try:
            return self.clock() - self.path_for(key).stat().st_mtime <= self.retention_s
        except OSError:
            return False

    def touch(self, key: str) -> bool:
        """Mark a stored, unexpired page used now (what a hit served from HBM does for its copy here, so that the
        page's retention runs from its last use); False when there is none."""
        return self._degraded is None and self.contains(key) and self._touch(self.path_for(key))

    def delete(self, key: str) -> bool:
        """Remove a page; True when a file was removed."""
        try:
            self.path_for(key).unlink()
            return True
        except OSError:
            return False

    # -- upkeep ----------------------------------------------------------------------------------

    def sweep(self) -> SweepReport:
        """Drop expired pages and dead writers' temp files, then the least recently used pages while over budget."""
        now, wall = self.clock(), time.time()
        pages: list[tuple[int, int, Path]] = []  # (mtime ns, bytes, path)
        expired = temps = 0
        for path, st in self._scan():
            if path.name.endswith(_TEMP):
                if wall - st.st_mtime > self.temp_grace_s and self._unlink(path):
                    temps += 1
            elif now - st.st_mtime > self.retention_s:
                expired += self._unlink(path)
            else:
                pages.append((st.st_mtime_ns, st.st_size, path))
        total, evicted = sum(p[1] for p in pages), 0
        if self.max_bytes is not None and total > self.max_bytes:
            target = self.evict_to * self.max_bytes
            for _, size, path in sorted(pages, key=lambda p: p[0]):
                if total <= target:
                    break
                if self._unlink(path):
                    evicted += 1
                total -= size  # gone either way: removed here or by another process meanwhile
        self.stats.expired += expired
        self.stats.evictions += evicted
        self._used = total
        return SweepReport(len(pages) - evicted, total, expired, evicted, temps)

    def usage(self) -> tuple[int, int]:
        """(page files, bytes) on disk now, expired ones included until a sweep."""
        sizes = [st.st_size for p, st in self._scan() if p.name.endswith(_SUFFIX)]
        return len(sizes), sum(sizes)

    # -- files -----------------------------------------------------------------------------------

    def _scan(self) -> list[tuple[Path, os.stat_result]]:
        """Every page and temp file with its stat; files that vanish meanwhile (other processes) are skipped."""
        found = []
        try:
            subdirs = [d for d in os.scandir(self.root) if len(d.name) == 2 and d.is_dir(follow_symlinks=False)]
        except OSError:
            return found
        for d in subdirs:
            try:
                entries = list(os.scandir(d.path))
            except OSError:
                continue
            for e in entries:
                if e.name.endswith(_SUFFIX) or (e.name.startswith(".") and e.name.endswith(_TEMP)):
                    try:
                        found.append((Path(e.path), e.stat(follow_symlinks=False)))
                    except OSError:
                        continue
        return found

    def _touch(self, path: Path) -> bool:
        """Mark a page used now; False when it does not exist (or cannot be marked)."""
        ns = int(self.clock() * 1e9)
        try:
            os.utime(path, ns=(ns, ns))
            return True
        except OSError:
            return False

    def _write_file(self, tmp: Path, data: bytes) -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            ns = int(self.clock() * 1e9)
            os.utime(fd if os.utime in os.supports_fd else tmp, ns=(ns, ns))
            if self.durable:
                os.fsync(fd)
        finally:
            os.close(fd)

    def _make_dir(self, d: Path) -> None:
        if d.is_dir():
            return
        try:
            d.mkdir()
        except FileExistsError:
            return
        if self.durable:
            self._fsync_dir(d.parent)

    @staticmethod
    def _fsync_dir(d: Path) -> None:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    @staticmethod
    def _unlink(path: Path) -> bool:
        try:
            path.unlink()
            return True
        except OSError:
            return False

    @staticmethod
    def _remove_if_same(path: Path, st: os.stat_result) -> None:
        """Remove the file that was read, not a good page another process has put in its place since."""
        try:
            now = path.stat()
            if (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev):
                path.unlink()
        except OSError:
            pass
