"""Disk tier: one directory of plain files, one record per file, bounded by size with LRU eviction.

Layout: ``<dir>/<the key's last two hex digits>/<key>.kvb`` (256 subdirectories); writes go to
``<dir>/tmp/<key>.<pid>.<n>.<random>.tmp`` (created with ``O_EXCL|O_NOFOLLOW``, mode 0600) and are renamed
into place, so a reader sees a whole file or none. A file torn by a crash (power loss without ``fsync=1``) or
truncated is a record that fails its checksum: a miss, counted, and the file is removed.

The tier touches only what it can prove is its own: the directory carries a marker file (``MARKER``) written
when the tier created it or found it empty, and a non-empty directory without one is refused; ``tmp/`` and
the key subdirectories must be real directories (never symlinks) owned by this user; only names of the tier's
own pattern are read, counted or deleted. Temporary files left by a killed writer (``kill -9`` mid-write) are
removed at the next start. Records are opened with ``O_NOFOLLOW|O_NONBLOCK`` and read only when they are
regular files of a size a record can have (``expect_record_sizes``), so a symlink to ``/dev/zero``, a FIFO or
a huge sparse file is a verification failure, not a hang or a flood.

fsync policy: ``fsync=0`` (default) never fsyncs: a process crash (``kill -9``) loses nothing that was
renamed (the page cache survives it), a power loss may lose or tear the last writes (misses).
``fsync=1`` fsyncs each file before its rename and the directory after it.

The size bound covers what this process knows: the files found at start (oldest access first, each counted
by the bytes it really occupies, so a sparse file cannot push the others out) plus its own writes. Hits
refresh a file's mtime, so a later process orders the LRU from the last use.
"""

from __future__ import annotations

import errno
import itertools
import os
import re
import secrets
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Optional

from pagedkv_rs.tiers.base import Tier, TierError

__all__ = ["DiskTier"]

SUFFIX = ".kvb"
MARKER = ".pagedkv-disk-tier"
# Standalone (no KVTiers to say the record size), a file larger than this is not read.
DEFAULT_MAX_RECORD = 256 << 20
_KEY = re.compile(r"[0-9a-f-]{2,256}")
_RECORD_NAME = re.compile(r"[0-9a-f-]{2,256}\.kvb")
_TMP_NAME = re.compile(r"[0-9a-f-]{2,256}\.(\d+)\.\d+\.[0-9a-f]{8}\.tmp")
_SUBDIR = re.compile(r"[0-9a-f-]{2}")
_O_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
_O_TMP = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


class DiskTier(Tier):
    """Records as files under ``path``, at most ``size`` bytes in total (LRU)."""

    kind = "disk"

    def __init__(self, path: str, size: int, *, fsync: bool = False, secret: Optional[bytes] = None) -> None:
        if size <= 0:
            raise ValueError(f"disk tier size must be positive, got {size}")
        self.path = os.path.abspath(path)
        self.size = int(size)
        self.fsync = bool(fsync)
        self.secret = secret
        self.name = f"disk:{self.path}"
        self._tmp = os.path.join(self.path, "tmp")
        self._own_dir()
        self._lock = threading.Lock()
        self._files: OrderedDict[str, int] = OrderedDict()  # key -> bytes, least recently used first
        self._total = 0
        self._seq = itertools.count()
        self._subdirs: set[str] = set()  # key subdirectories checked to be real directories of ours
        self._sizes: Optional[frozenset[int]] = None
        self.evictions = 0
        self.skipped = 0  # entries the start-up scan could not read or did not recognise
        self._scan()

    def _own_dir(self) -> None:
        """Create the directory (and ``tmp/``) or check that it is this tier's; ValueError otherwise."""
        try:
            os.makedirs(self.path, mode=0o700, exist_ok=True)
            if not os.path.isdir(self.path):
                raise ValueError(f"disk tier: {self.path} is not a directory")
            marker = os.path.join(self.path, MARKER)
            if not os.path.lexists(marker):
                if os.listdir(self.path):
                    raise ValueError(
                        f"disk tier: {self.path} is not empty and holds no {MARKER} marker, so it is not a "
                        "pagedkv disk tier; give a new or empty directory (the tier deletes files in it)"
                    )
                fd = os.open(marker, _O_TMP, 0o600)
                os.close(fd)
            elif not stat.S_ISREG(os.lstat(marker).st_mode):
                raise ValueError(f"disk tier: {marker} is not a regular file")
            try:
                os.mkdir(self._tmp, 0o700)
            except FileExistsError:
                pass
            self._check_subdir(self._tmp)
        except OSError as e:
            raise ValueError(f"disk tier: cannot use {self.path}: {e}") from e

    def _check_subdir(self, path: str) -> None:
        """``path`` must be a real directory (not a symlink) owned by this user; ValueError otherwise."""
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            raise ValueError(f"disk tier: {path} is not a directory (a symlink or a file is refused)")
        if st.st_uid != os.geteuid():
            raise ValueError(f"disk tier: {path} belongs to uid {st.st_uid}, not to this user ({os.geteuid()})")

    def expect_record_sizes(self, sizes: Sequence[int]) -> None:
        """Read only files of these sizes (the records of one layout, with and without a MAC)."""
        self._sizes = frozenset(int(n) for n in sizes)

    def _file(self, key: str) -> str:
        return os.path.join(self.path, key[-2:], key + SUFFIX)

    def _scan(self) -> None:
        """Index the records already there (oldest mtime first); remove temporaries of dead writers."""
        for e in os.scandir(self._tmp):
            m = _TMP_NAME.fullmatch(e.name)
            if m is None:
                self.skipped += 1
                continue
            pid = int(m.group(1))
            if pid != os.getpid() and not _alive(pid):
                try:
                    os.unlink(e.path)  # removes the name only, never a symlink's target
                except OSError:
                    pass
        found = []
        for d in os.scandir(self.path):
            if d.name in ("tmp", MARKER):
                continue
            if not _SUBDIR.fullmatch(d.name) or not d.is_dir(follow_symlinks=False):
                self.skipped += 1
                continue
            try:
                entries = list(os.scandir(d.path))
            except OSError:
                self.skipped += 1
                continue
            self._subdirs.add(d.path)
            for e in entries:
                if not _RECORD_NAME.fullmatch(e.name):
                    continue
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    self.skipped += 1
                    continue
                if not stat.S_ISREG(st.st_mode):
                    self.skipped += 1
                    continue
                used = min(st.st_size, st.st_blocks * 512)  # a sparse file counts what it occupies
                found.append((st.st_mtime_ns, e.name[: -len(SUFFIX)], used))
        for _, key, size in sorted(found):
            self._files[key] = size
            self._total += size
        self._evict()

    def _evict(self) -> list[str]:
        """Remove least recently used records until the total fits; returns their keys."""
        gone = []
        while self._total > self.size and self._files:
            key, size = self._files.popitem(last=False)
            self._total -= size
            self.evictions += 1
            gone.append(key)
            try:
                os.unlink(self._file(key))
            except OSError:
                pass
        return gone

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._total

    def get_many(self, keys: Sequence[str], deadline: float) -> list[Optional[bytes]]:
        out: list[Optional[bytes]] = []
        for key in keys:
            if out and time.monotonic() > deadline:
                break
            if not _KEY.fullmatch(key):
                out.append(None)
                break
            path = self._file(key)
            try:
                data = self._read(path)
            except FileNotFoundError:
                with self._lock:
                    size = self._files.pop(key, None)  # evicted by another process
                    if size is not None:
                        self._total -= size
                out.append(None)
                break
            except OSError as e:
                raise TierError(f"{self.name}: reading {path}: {e}") from e
            if not data:  # not a record this tier could have written: the caller's check fails it
                out.append(data)
                break
            with self._lock:
                if key in self._files:
                    self._files.move_to_end(key)
                else:  # written by another process since our scan
                    self._files[key] = len(data)
                    self._total += len(data)
            try:
                os.utime(path)
            except OSError:
                pass
            out.append(data)
        return out

    def _read(self, path: str) -> bytes:
        """The file's bytes, or b"" when it is not a regular file of a record's size (symlink, FIFO, device,
        oversized or sparse file): never blocks on a special file and never reads more than a record."""
        try:
            fd = os.open(path, _O_READ)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
                return b""
            raise
        try:
            st = os.fstat(fd)
            n = st.st_size
            ok = n in self._sizes if self._sizes is not None else 0 < n <= DEFAULT_MAX_RECORD
            if not stat.S_ISREG(st.st_mode) or not ok:
                return b""
            buf = bytearray(n)
            view = memoryview(buf)
            got = 0
            while got < n:
                k = os.readv(fd, [view[got:]])
                if k == 0:
                    return b""  # shrank while read: torn
                got += k
            return bytes(buf)
        finally:
            os.close(fd)

    def discard(self, key: str) -> None:
        """Remove a record that failed verification."""
        with self._lock:
            size = self._files.pop(key, None)
            if size is not None:
                self._total -= size
        try:
            os.unlink(self._file(key))
        except OSError:
            return
        self._removed([key])

    def _subdir(self, path: str) -> None:
        """Create a key subdirectory, or check once that the existing one is a real directory of ours."""
        if path in self._subdirs:
            return
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        self._check_subdir(path)
        self._subdirs.add(path)

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> int:
        """Write the records in order; a failure (a full disk: ENOSPC, EDQUOT, EFBIG) raises ``TierError`` with
        the records stored and bytes written before it. The records evicted to make room are reported
        (``on_removed``) when the call ends."""
        gone: list[str] = []
        try:
            return self._put_many(items, gone)
        finally:
            self._removed(gone)

    def _put_many(self, items: Sequence[tuple[str, bytes]], gone: list[str]) -> int:
        written = 0
        for i, (key, data) in enumerate(items):
            with self._lock:
                if key in self._files:
                    continue
            if not _KEY.fullmatch(key):
                raise TierError(
                    f"{self.name}: {key!r} is not a key of this tier (lower-case hex and '-')",
                    stored=i,
                    written=written,
                )
            final = self._file(key)
            tmp = os.path.join(self._tmp, f"{key}.{os.getpid()}.{next(self._seq)}.{secrets.token_hex(4)}.tmp")
            created = False
            try:
                self._subdir(os.path.dirname(final))
                fd = os.open(tmp, _O_TMP, 0o600)
                created = True
                with open(fd, "wb", closefd=True) as fh:
                    fh.write(data)
                    if self.fsync:
                        fh.flush()
                        os.fsync(fh.fileno())
                os.replace(tmp, final)
                if self.fsync:
                    fd = os.open(os.path.dirname(final), os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
            except (OSError, ValueError) as e:
                if created:  # never remove a name this call did not create
                    try:
                        os.unlink(tmp)
                    except OSError:
                        pass
                raise TierError(f"{self.name}: writing {final}: {e}", stored=i, written=written) from e
            written += len(data)
            with self._lock:
                if key not in self._files:
                    self._files[key] = len(data)
                    self._total += len(data)
                gone += self._evict()
        return written


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
