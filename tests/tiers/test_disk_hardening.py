"""The disk tier touches only what it wrote: no data loss outside it, no escape through symlinks, no read that
hangs or floods memory (issue 32's storage findings, each reproduced on real files)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import tracemalloc

import numpy as np
import pytest

from pagedkv_rs.tiers import BlockLayout, KVTiers, encode_record, record_sizes
from pagedkv_rs.tiers import disk as disk_mod
from pagedkv_rs.tiers.disk import MARKER, DiskTier

LAYOUT = BlockLayout(2, 2, 16, 32, np.dtype(np.float16))
FP = bytes(range(16))
TOKS = list(range(16))


def _record(h: bytes, parent: bytes = bytes(16)) -> bytes:
    return encode_record(h, parent, bytes(16), FP, TOKS, np.ones(LAYOUT.shape, np.float16))


def _tiers(path) -> tuple[KVTiers, DiskTier]:
    t = DiskTier(os.fspath(path), 1 << 30)
    return KVTiers([t], LAYOUT, FP), t


def _store(kv: KVTiers, t: DiskTier, n: int) -> list[bytes]:
    hashes = [bytes([i + 1]) * 16 for i in range(n)]
    t.put_many([(kv.key(h), _record(h, hashes[i - 1] if i else bytes(16))) for i, h in enumerate(hashes)])
    return hashes


def test_foreign_nonempty_directory_is_refused_and_left_intact(tmp_path):
    d = tmp_path / "data"
    (d / "tmp").mkdir(parents=True)
    mine = [d / "tmp" / "notes.txt", d / "tmp" / "x.1.2.tmp", d / "report.kvb"]
    for f in mine:
        f.write_text("user data")
    with pytest.raises(ValueError, match="not empty and holds no .* marker"):
        DiskTier(os.fspath(d), 1 << 20)
    assert all(f.read_text() == "user data" for f in mine)


def test_tmp_symlink_is_refused_and_its_target_untouched(tmp_path):
    d, outside = tmp_path / "kv", tmp_path / "elsewhere"
    outside.mkdir()
    victim = outside / "deadbeef.999999.0.0a0b0c0d.tmp"  # the tier's own temporary pattern, a dead pid
    victim.write_text("precious")
    DiskTier(os.fspath(d), 1 << 20)  # creates the directory and its marker
    os.rmdir(d / "tmp")
    os.symlink(outside, d / "tmp")
    with pytest.raises(ValueError, match="not a directory"):
        DiskTier(os.fspath(d), 1 << 20)
    assert victim.read_text() == "precious"


def test_only_own_temporaries_of_dead_writers_are_removed(tmp_path):
    d = tmp_path / "kv"
    DiskTier(os.fspath(d), 1 << 20)
    stale = d / "tmp" / "abcd.999999.3.00112233.tmp"  # pid 999999 is not running here
    other = d / "tmp" / "keep-me.txt"
    stale.write_bytes(b"x")
    other.write_bytes(b"y")
    t = DiskTier(os.fspath(d), 1 << 20)
    assert not stale.exists() and other.read_bytes() == b"y" and t.skipped == 1


def test_planted_symlink_at_the_temporary_name_is_not_followed(tmp_path, monkeypatch):
    d, outside = tmp_path / "kv", tmp_path / "outside.txt"
    outside.write_text("precious")
    t = DiskTier(os.fspath(d), 1 << 20)
    monkeypatch.setattr(disk_mod.secrets, "token_hex", lambda n: "00000000")  # make the name predictable
    key = "ab" * 16
    planted = d / "tmp" / f"{key}.{os.getpid()}.0.00000000.tmp"
    os.symlink(outside, planted)
    with pytest.raises(disk_mod.TierError):
        t.put_many([(key, b"record bytes")])
    assert outside.read_text() == "precious" and os.path.islink(planted)
    assert t.get_many([key], float("inf")) == [None]


def test_symlinked_key_subdirectory_is_not_written_through(tmp_path):
    d, outside = tmp_path / "kv", tmp_path / "outside"
    outside.mkdir()
    t = DiskTier(os.fspath(d), 1 << 20)
    os.symlink(outside, d / "cd")
    with pytest.raises(disk_mod.TierError, match="not a directory"):
        t.put_many([("ab" * 15 + "cd", b"record bytes")])
    assert os.listdir(outside) == []


def test_symlink_to_dev_zero_is_a_verification_failure_not_a_flood(tmp_path):
    """Run under RLIMIT_AS in a child: an unbounded read of /dev/zero dies there instead of eating the machine."""
    kv, t = _tiers(tmp_path / "kv")
    hashes = _store(kv, t, 3)
    victim = t._file(kv.key(hashes[1]))
    os.unlink(victim)
    os.symlink("/dev/zero", victim)
    probe = f"""
import os, resource, numpy as np
from pagedkv_rs.tiers import BlockLayout, KVTiers
from pagedkv_rs.tiers.disk import DiskTier
t = DiskTier({os.fspath(tmp_path / "kv")!r}, 1 << 30)
kv = KVTiers([t], BlockLayout(2, 2, 16, 32, np.dtype(np.float16)), bytes(range(16)))
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, resource.getrlimit(resource.RLIMIT_AS)[1]))
got = kv.lookup({hashes!r}, bytes(16), list(range(16)) * 3, bytes(16))
st = kv.stats()[t.name]
print(len(got), st["hit_blocks"], st["verify_failures"], int(os.path.lexists({victim!r})))
"""
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"the lookup died reading /dev/zero: {r.stderr[-2000:]}"
    # the run of hits ends at the bad record, which is counted and its name discarded (/dev/zero untouched)
    assert r.stdout.split() == ["1", "1", "1", "0"]


def test_fifo_in_place_of_a_record_does_not_block(tmp_path):
    kv, t = _tiers(tmp_path / "kv")
    hashes = _store(kv, t, 2)
    victim = t._file(kv.key(hashes[0]))
    os.unlink(victim)
    os.mkfifo(victim)
    out: list = []
    th = threading.Thread(target=lambda: out.append(kv.lookup(hashes, bytes(16), TOKS * 2, bytes(16))), daemon=True)
    th.start()
    th.join(10)
    assert not th.is_alive(), "a FIFO in the tier directory blocked the lookup"
    assert out == [[]] and kv.stats()[t.name]["verify_failures"] == 1


def test_oversized_sparse_record_is_neither_read_nor_counted(tmp_path):
    kv, t = _tiers(tmp_path / "kv")
    hashes = _store(kv, t, 2)
    victim = t._file(kv.key(hashes[0]))
    with open(victim, "r+b") as fh:
        fh.truncate(1 << 30)  # 1 GiB apparent, a few KiB on disk
    probe = """
import os, resource, sys, numpy as np
from pagedkv_rs.tiers import BlockLayout, KVTiers
from pagedkv_rs.tiers.disk import DiskTier
layout = BlockLayout(2, 2, 16, 32, np.dtype(np.float16))
t = DiskTier(sys.argv[1], 1 << 20)  # the sparse file must not evict the other record
kv = KVTiers([t], layout, bytes(range(16)))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
h = [bytes([1]) * 16, bytes([2]) * 16]
kv.lookup(h, bytes(16), list(range(16)) * 2, bytes(16))
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(len(t._files), t.used_bytes, grew, kv.stats()[t.name]["verify_failures"])
"""
    r = subprocess.run([sys.executable, "-c", probe, os.fspath(tmp_path / "kv")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    n_files, used, grew_kib, failures = map(int, r.stdout.split())
    assert n_files == 1 and used == record_sizes(LAYOUT)[0] and failures == 1
    assert grew_kib < 64 * 1024, f"reading a sparse 1 GiB record grew RSS by {grew_kib} KiB"


def test_scan_skips_an_unreadable_subdirectory(tmp_path, monkeypatch):
    kv, t = _tiers(tmp_path / "kv")
    hashes = _store(kv, t, 2)
    bad = os.path.dirname(t._file(kv.key(hashes[0])))
    real = os.scandir

    def scandir(path="."):
        if os.fspath(path) == bad:
            raise PermissionError(13, "Permission denied", bad)
        return real(path)

    monkeypatch.setattr(disk_mod.os, "scandir", scandir)
    t2 = DiskTier(os.fspath(tmp_path / "kv"), 1 << 20)
    assert t2.skipped >= 1 and len(t2._files) == 1


def test_marker_is_written_once_and_reopening_keeps_records(tmp_path):
    kv, t = _tiers(tmp_path / "kv")
    hashes = _store(kv, t, 2)
    assert (tmp_path / "kv" / MARKER).is_file()
    kv2, _ = _tiers(tmp_path / "kv")
    assert len(kv2.lookup(hashes, bytes(16), TOKS * 2, bytes(16))) == 2


def _redis_tiers(url: str, secret: bytes | None = None):
    from pagedkv_rs.tiers.redis import RedisTier

    t = RedisTier(url, name="redis", secret=secret)
    return KVTiers([t], LAYOUT, FP), t


def test_redis_reads_at_most_a_record_of_a_forged_oversized_value(redis_server):
    import redis

    kv, t = _redis_tiers(redis_server.url)
    hashes = [bytes([i + 1]) * 16 for i in range(8)]
    r = redis.Redis.from_url(redis_server.url)
    huge = b"\0" * (32 << 20)
    for h in hashes:
        r.set(t.prefix + kv.key(h), huge)
    tracemalloc.start()
    try:
        assert kv.lookup(hashes, bytes(16), TOKS * 8, bytes(16)) == []
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"a lookup of forged 32 MiB values allocated {peak >> 20} MiB"
    assert kv.stats()["redis"]["verify_failures"] == 1


def test_redis_record_failing_verification_is_replaced_by_the_next_store(redis_server):
    import redis

    kv, t = _redis_tiers(redis_server.url, secret=b"s3cret")
    h = bytes([7]) * 16
    key = t.prefix + kv.key(h)
    forged = encode_record(h, bytes(16), bytes(16), FP, TOKS, np.zeros(LAYOUT.shape, np.float16), b"wrong")
    redis.Redis.from_url(redis_server.url).set(key, forged)
    assert kv.lookup([h], bytes(16), TOKS, bytes(16)) == []  # rejected: wrong MAC
    good = encode_record(h, bytes(16), bytes(16), FP, TOKS, np.ones(LAYOUT.shape, np.float16), b"s3cret")
    t.put_many([(kv.key(h), good)])
    (payload,) = kv.lookup([h], bytes(16), TOKS, bytes(16))
    assert np.frombuffer(payload, np.float16).min() == 1.0
