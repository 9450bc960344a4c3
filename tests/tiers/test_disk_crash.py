"""kill -9 in the middle of disk-tier writes leaves a directory a later process reads: whole records or misses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np

from pagedkv_rs.tiers import BlockLayout, RecordError, decode_record, encode_record
from pagedkv_rs.tiers.disk import DiskTier

LAYOUT = BlockLayout(4, 2, 16, 64, np.dtype(np.float16))  # 32 KiB records
TOKS = list(range(16))

WRITER = """
import sys, numpy as np
from pagedkv_rs.tiers import encode_record
from pagedkv_rs.tiers.disk import DiskTier
t = DiskTier(sys.argv[1], 1 << 30)
payload = np.ones((4, 2, 2, 16, 64), np.float16)
i = 0
while True:  # until killed
    key = f"{i:08x}" + "00" * 12
    rec = encode_record(bytes.fromhex(key[:32]), bytes(16), bytes(16), bytes(16), list(range(16)), payload)
    t.put_many([(key, rec)])
    i += 1
    if i == 20:
        print("ready", flush=True)
"""


def test_kill9_mid_write_leaves_a_readable_directory(tmp_path):
    d = os.fspath(tmp_path / "kv")
    p = subprocess.Popen([sys.executable, "-c", WRITER, d], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        time.sleep(0.05)  # mid-stream: some write is usually in flight now
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    # a torn record as a power loss without fsync could leave it, under a final name
    keys = sorted(os.path.basename(f)[:-4] for _, _, fs in os.walk(d) for f in fs if f.endswith(".kvb"))
    assert len(keys) >= 20
    torn = keys[0]
    path = os.path.join(d, torn[-2:], torn + ".kvb")
    with open(path, "r+b") as fh:
        fh.truncate(os.path.getsize(path) // 2)
    tier = DiskTier(d, 1 << 30)  # the next process: stale temporaries of the dead writer are gone
    assert os.listdir(os.path.join(d, "tmp")) == []
    good = bad = 0
    for key in keys:
        (data,) = tier.get_many([key], float("inf"))
        assert data is not None
        try:
            decode_record(
                data,
                block_hash=bytes.fromhex(key[:32]),
                parent=bytes(16),
                salt=bytes(16),
                fingerprint=bytes(16),
                tokens=TOKS,
                payload_len=LAYOUT.nbytes,
            )
            good += 1
        except RecordError:
            bad += 1
    assert bad == 1 and good == len(keys) - 1  # only the torn one fails, as a miss


def test_records_of_another_process_are_found(tmp_path):
    """A file another process wrote after our scan is still a hit (and counted in the bound)."""
    d = os.fspath(tmp_path)
    a, b = DiskTier(d, 1 << 20), DiskTier(d, 1 << 20)
    rec = encode_record(bytes(16), bytes(16), bytes(16), bytes(16), [1], np.zeros(4, np.float16))
    a.put_many([("ab" * 16, rec)])
    assert b.get_many(["ab" * 16], float("inf")) == [rec] and b.used_bytes == len(rec)
