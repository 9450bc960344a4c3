"""Storage never holds the engine: a tier lookup has a deadline that holds (a SIGSTOPped Redis, a hung read),
what comes later is dropped, FIFOs in the disk tier block nothing, scrapes never wait for the engine lock, and a
full disk counts what it wrote and what failed (issue 32). Bounded in time: every wait has a timeout far above
the deadline it checks, and a regression shows as that timeout."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np

from pagedkv_rs.engine.request import SamplingParams
from pagedkv_rs.models.tokenizer import GGUFTokenizer
from pagedkv_rs.serve import build_app
from pagedkv_rs.tiers import chain_hashes, encode_record, salt_digest
from pagedkv_rs.tiers.disk import SUFFIX, DiskTier
from tier_util import PREFIX, HeldLookup, make_engine

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
A = PREFIX + [90, 91, 92]
B = list(range(20, 100)) + [5, 6, 7]
C = list(range(40, 120)) + [8, 9]


def _serve_running():
    """``running(app)`` of the serve tests (a real uvicorn on a free loopback port), defined once there."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "serve", "conftest.py")
    spec = importlib.util.spec_from_file_location("serve_conftest", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.running


def _wait_for(cond, timeout: float = 30.0) -> bool:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def _stats(engine, name):
    return engine.stats()["kv_tiers"][name]


def test_a_sigstopped_redis_holds_no_request_past_the_deadline_and_recovers_after_sigcont(redis_server):
    spec = redis_server.url + "?timeout=60"  # a long socket timeout: the lookup deadline must bound it
    want = [o.token_ids for o in make_engine().generate([A, B, C], GREEDY)]
    warm = make_engine([spec])
    warm.generate([A, B, C], GREEDY)
    assert warm.kv_tiers.flush(60)
    e = make_engine([spec], kv_tier_deadline=0.3)
    (tier,) = e.kv_tiers.tiers
    pid = redis_server.proc.pid
    app = build_app(e, tokenizer=GGUFTokenizer.from_gguf(), served_model_name="tiny", shutdown_engine=False)
    with _serve_running()(app) as (url, _), httpx.Client(base_url=url, timeout=10) as http:
        os.kill(pid, signal.SIGSTOP)
        try:
            streams = [e.submit(p, GREEDY) for p in (A, C)]
            # while the lookups hang on the stopped server: the server answers its probes
            assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200
            outs = [s.result(timeout=20) for s in streams]  # before: the first lookup alone waited 60 s
            assert http.get("/health").status_code == 200
            assert [o.token_ids for o in outs] == [want[0], want[2]]
            assert [o.num_cached_tokens for o in outs] == [0, 0]  # computed, not loaded
            st = _stats(e, tier.name)
            assert st["hit_blocks"] == 0 and st["timeouts"] + st["errors"] >= 2
            # the I/O thread comes back on its own, the server still stopped: the socket timeout is the deadline's
            assert _wait_for(lambda: e.runner._busy_since is None and _stats(e, tier.name)["errors"] >= 1, 20)
        finally:
            os.kill(pid, signal.SIGCONT)
    try:
        assert _wait_for(lambda: time.monotonic() > tier._down_until, 20)  # the rest after the failure
        out = e.submit(B, GREEDY).result(timeout=20)
        assert out.token_ids == want[1] and out.num_cached_tokens == len(PREFIX)  # loaded from Redis again
        assert _stats(e, tier.name)["hit_blocks"] == len(PREFIX) // 16
    finally:
        e.shutdown()
    assert e.kv_manager.num_live_blocks == 0
    e.kv_manager.check_invariants()


def test_a_hung_lookup_is_given_up_at_its_deadline_and_its_late_result_is_dropped(tmp_path):
    want = make_engine().generate([A], GREEDY)[0].token_ids
    held = HeldLookup(DiskTier(os.fspath(tmp_path / "kv"), 1 << 30), store=False)
    e = make_engine([held], kv_tier_deadline=0.2)
    kv = e.kv_tiers
    # records that verify but hold zeros: written into the blocks late, they would poison the prefix cache
    hashes = chain_hashes(A, 16, None)
    zeros = np.zeros(kv.layout.shape, kv.layout.dtype)
    held.inner.put_many(
        [
            (
                kv.key(h),
                encode_record(
                    h,
                    hashes[i - 1] if i else bytes(16),
                    salt_digest(None),
                    kv.fingerprint,
                    A[i * 16 : (i + 1) * 16],
                    zeros,
                ),
            )
            for i, h in enumerate(hashes)
        ]
    )
    try:
        out = e.submit(A, GREEDY).result(timeout=20)  # before: waited for the hung lookup for good
        assert held.entered.is_set() and not held.release.is_set()
        assert out.token_ids == want and out.num_cached_tokens == 0
        assert _stats(e, "held")["timeouts"] == 1
        # while the I/O thread is stuck past a deadline, a new load is handed back at once
        out = e.submit(C, GREEDY).result(timeout=20)
        assert out.num_cached_tokens == 0 and _stats(e, "held")["timeouts"] == 2
        held.release.set()
        assert _wait_for(lambda: _stats(e, "held")["late_results"] == 1)
        again = e.submit(A, GREEDY).result(timeout=20)  # the pool's own prefix: never overwritten by the late load
        assert again.token_ids == want and again.num_cached_tokens == len(PREFIX)
        assert _stats(e, "held")["hit_blocks"] == len(PREFIX) // 16  # verified, then dropped as late
    finally:
        held.release.set()
        e.shutdown()
    assert e.kv_manager.num_live_blocks == 0
    e.kv_manager.check_invariants()


def test_fifos_in_the_disk_tier_directory_block_nothing(tmp_path):
    d = tmp_path / "kv"
    want = make_engine().generate([A], GREEDY)[0].token_ids
    warm = make_engine([f"disk:{d}"])
    warm.generate([A], GREEDY)
    assert warm.kv_tiers.flush(60)
    records = [os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs if f.endswith(SUFFIX)]
    assert len(records) == len(PREFIX) // 16
    for path in records:  # every record becomes a FIFO nobody writes to
        os.unlink(path)
        os.mkfifo(path)
    os.mkfifo(d / "tmp" / f"{'ab' * 8}.999999999.0.0badf00d.tmp")  # a dead writer's name
    os.mkfifo(d / "fe")  # a key subdirectory's name
    made = []
    th = threading.Thread(target=lambda: made.append(make_engine([f"disk:{d}"], kv_tier_deadline=5)), daemon=True)
    th.start()
    th.join(30)  # the start-up scan stats, never opens
    assert made, "the disk tier's start-up scan hung on a FIFO"
    (e,) = made
    try:
        out = e.submit(A, GREEDY).result(timeout=20)
        assert out.token_ids == want and out.num_cached_tokens == 0
        (st,) = e.stats()["kv_tiers"].values()
        assert st["verify_failures"] == 1 and st["timeouts"] == 0  # refused at once, not waited out
    finally:
        e.shutdown()


def test_scrapes_never_wait_for_the_engine_lock():
    from pagedkv_rs.serve.metrics import ServerMetrics

    e = make_engine()
    e.generate([A], GREEDY)
    metrics = ServerMetrics(e, "tiny")
    held, release = threading.Event(), threading.Event()

    def hold():
        with e._lock:  # a step's locked section that takes long
            held.set()
            release.wait(60)

    th = threading.Thread(target=hold, daemon=True)
    th.start()
    assert held.wait(30)
    got: list = []
    scrape = threading.Thread(target=lambda: got.append((e.snapshot(), metrics.render())), daemon=True)
    scrape.start()
    scrape.join(30)
    waited = scrape.is_alive()
    release.set()
    th.join(30)
    assert not waited and got, "a scrape waited for the engine lock"
    (sched, kv), text = got[0]
    assert sched["num_running"] == 0 and kv["free_blocks"] + kv["cached_blocks"] == e.kv_manager.num_blocks
    assert b"pagedkv:num_requests_running" in text


FULL_DISK = r"""
import json, logging, os, resource, signal, sys
sys.path.insert(0, {tests!r})
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past RLIMIT_FSIZE, write() fails with EFBIG (a full disk's path)
from pagedkv_rs.engine.request import SamplingParams
from pagedkv_rs.models.tokenizer import GGUFTokenizer
from pagedkv_rs.serve import build_app
from pagedkv_rs.tiers import TierError, record_sizes
from pagedkv_rs.tiers.disk import DiskTier
from tier_util import make_engine

messages = []
class Catch(logging.Handler):
    def emit(self, record):
        messages.append(record.getMessage())
logging.getLogger("pagedkv_rs.tiers").addHandler(Catch())
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
out = {{}}

t = DiskTier({d1!r}, 1 << 30)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
try:
    t.put_many([("aa", b"x" * 100), ("ab", b"y" * 200), ("ac", b"z" * 10000), ("ad", b"w" * 100)])
except TierError as e:
    out["tier"] = [e.stored, e.written, str(e.__cause__)]
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
out["tier_read"] = [len(r) if r else 0 for r in t.get_many(["aa", "ab", "ac"], float("inf"))]
out["tier_tmp"] = os.listdir(os.path.join({d1!r}, "tmp"))

g = SamplingParams(max_tokens=6, temperature=0.0)
p1, p2, p3 = [list(range(s, s + 80)) + [5] for s in (3, 20, 40)]
want = [o.token_ids for o in make_engine().generate([p1, p2, p3], g)]
e = make_engine(["disk:" + {d2!r}])
resource.setrlimit(resource.RLIMIT_FSIZE, (record_sizes(e.kv_tiers.layout)[0] // 2, hard))
got = []
for p in (p1, p2):  # two separate runs of failing stores, each flushed (else the writer may take both at once)
    got.append(e.generate([p], g)[0].token_ids)
    assert e.kv_tiers.flush(60)
out["full"] = dict(e.stats()["kv_tiers"][e.kv_tiers.tiers[0].name])
out["full_messages"] = list(messages)
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
got.append(e.generate([p3], g)[0].token_ids)
assert e.kv_tiers.flush(60)
out["after"] = dict(e.stats()["kv_tiers"][e.kv_tiers.tiers[0].name])
out["messages"] = messages
out["same_tokens"] = got == want
out["tmp"] = os.listdir(os.path.join({d2!r}, "tmp"))
e.shutdown()
print(json.dumps(out, default=str))
"""


def test_a_full_disk_counts_written_and_failed_blocks_logs_once_and_keeps_serving(tmp_path):
    tests = os.path.dirname(os.path.abspath(__file__))
    code = FULL_DISK.format(tests=tests, d1=os.fspath(tmp_path / "t"), d2=os.fspath(tmp_path / "e"))
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    stored, written, cause = out["tier"]
    assert (stored, written) == (2, 300) and "File too large" in cause  # the two before the failure
    assert out["tier_read"] == [100, 200, 0] and out["tier_tmp"] == []  # kept; the torn temporary removed
    full = out["full"]
    assert full["stored_blocks"] == 0 and full["bytes_written"] == 0
    assert full["store_failures"] == 2 * 5 and full["store_drops"] == 0  # failed, not dropped
    assert full["errors"] >= 2  # at least one failing write per run
    assert len(out["full_messages"]) == 1  # logged once for both runs of failing stores
    after = out["after"]
    assert after["stored_blocks"] == 5 and after["store_failures"] == 2 * 5
    first, recovered = out["messages"]  # one line when the stores start failing, one when they succeed again
    assert "a store failed" in first and "File too large" in first and recovered.endswith("stores succeed again")
    assert out["same_tokens"] and out["tmp"] == []
