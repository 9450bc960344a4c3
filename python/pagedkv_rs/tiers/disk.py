"""Disk tier: one directory of plain files, one record per file, bounded by size with LRU eviction.

Layout: ``<dir>/<the key's last two hex digits>/<key>.kvb`` (256 subdirectories); writes go to
``<dir>/tmp/<key>.<pid>.<n>.tmp`` and are renamed into place, so a reader sees a whole file or none.
A file torn by a crash (power loss without ``fsync=1``) or truncated is a record that fails its
checksum: a miss, counted, and the file is removed.
Temporary files left by a killed writer (``kill -9`` mid-write) are removed at the next start.

fsync policy: ``fsync=0`` (default) never fsyncs: a process crash (``kill -9``) loses nothing that was
renamed (the page cache survives it), a power loss may lose or tear the last writes (misses).
``fsync=1`` fsyncs each file before its rename and the directory after it.

The size bound covers what this process knows: the files found at start (oldest access first) plus its
own writes. Hits refresh a file's mtime, so a later process orders the LRU from the last use.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Optional

from pagedkv_rs.tiers.base import Tier, TierError

__all__ = ["DiskTier"]

SUFFIX = ".kvb"


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
        try:
            os.makedirs(self._tmp, exist_ok=True)
        except OSError as e:
            raise ValueError(f"disk tier: cannot create {self.path}: {e}") from e
        self._lock = threading.Lock()
        self._files: OrderedDict[str, int] = OrderedDict()  # key -> bytes, least recently used first
        self._total = 0
        self._seq = itertools.count()
        self.evictions = 0
        self._scan()

    def _file(self, key: str) -> str:
        return os.path.join(self.path, key[-2:], key + SUFFIX)

    def _scan(self) -> None:
        """Index the files already there (oldest mtime first); remove temporaries of dead writers."""
        for e in os.scandir(self._tmp):
            parts = e.name.split(".")
            pid = int(parts[-3]) if len(parts) >= 4 and parts[-3].isdigit() else -1
            if pid != os.getpid() and not _alive(pid):
                try:
                    os.unlink(e.path)
                except OSError:
                    pass
        found = []
        for d in os.scandir(self.path):
            if not d.is_dir() or d.name == "tmp":
                continue
            for e in os.scandir(d.path):
                if e.name.endswith(SUFFIX):
                    try:
                        st = e.stat()
                    except OSError:
                        continue
                    found.append((st.st_mtime_ns, e.name[: -len(SUFFIX)], st.st_size))
        for _, key, size in sorted(found):
            self._files[key] = size
            self._total += size
        self._evict()

    def _evict(self) -> None:
        while self._total > self.size and self._files:
            key, size = self._files.popitem(last=False)
            self._total -= size
            self.evictions += 1
            try:
                os.unlink(self._file(key))
            except OSError:
                pass

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._total

    def get_many(self, keys: Sequence[str], deadline: float) -> list[Optional[bytes]]:
        out: list[Optional[bytes]] = []
        for key in keys:
            if out and time.monotonic() > deadline:
                break
            path = self._file(key)
            try:
                with open(path, "rb") as fh:
                    data = fh.read()
            except FileNotFoundError:
                with self._lock:
                    size = self._files.pop(key, None)  # evicted by another process
                    if size is not None:
                        self._total -= size
                out.append(None)
                break
            except OSError as e:
                raise TierError(f"{self.name}: reading {path}: {e}") from e
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

    def discard(self, key: str) -> None:
        """Remove a record that failed verification."""
        with self._lock:
            size = self._files.pop(key, None)
            if size is not None:
                self._total -= size
        try:
            os.unlink(self._file(key))
        except OSError:
            pass

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> int:
        written = 0
        for key, data in items:
            with self._lock:
                if key in self._files:
                    continue
            final = self._file(key)
            tmp = os.path.join(self._tmp, f"{key}.{os.getpid()}.{next(self._seq)}.tmp")
            try:
                os.makedirs(os.path.dirname(final), exist_ok=True)
                with open(tmp, "wb") as fh:
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
            except OSError as e:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise TierError(f"{self.name}: writing {final}: {e}") from e
            written += len(data)
            with self._lock:
                if key not in self._files:
                    self._files[key] = len(data)
                    self._total += len(data)
                self._evict()
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
