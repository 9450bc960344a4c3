"""The engine over KV tiers (tiny model): identical greedy tokens, hits after a restart, isolation, integrity."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from pagedkv_rs.engine.request import SamplingParams
from pagedkv_rs.tiers import KVTiers, Tier, TierError, parse_tier
from tier_util import PREFIX, make_engine, prompts

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


def run(engine, ps=None, salt=None):
    ps = prompts() if ps is None else ps
    items = [{"prompt_token_ids": p, "cache_salt": salt} for p in ps]
    outs = engine.generate(items, GREEDY)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def tier_stats(engine):
    (st,) = engine.stats()["kv_tiers"].values()
    return st


def test_greedy_tokens_identical_with_and_without_tiers(backend, tmp_path):
    spec = f"disk:{tmp_path}/kv?size=64MiB"
    base = make_engine(backend=backend)
    want, _ = run(base)
    first = make_engine([spec], backend=backend)
    got, _ = run(first)
    first.shutdown()  # flushes the writers
    assert got == want
    assert tier_stats(first)["stored_blocks"] > 0
    again = make_engine([spec], backend=backend)  # a fresh pool: every hit comes from the disk tier
    got2, cached = run(again, [p for p in prompts()])
    assert got2 == want
    assert cached[0] >= len(PREFIX) and cached[2] == 32  # 37 tokens: two full blocks, one token left (I6)
    st = tier_stats(again)
    assert st["hit_blocks"] >= 5 and st["verify_failures"] == st["errors"] == 0
    assert st["bytes_read"] > 0 and st["lookup_seconds"]["count"] == st["lookups"]


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16"])
def test_half_precision_caches_round_trip_bit_for_bit(tmp_path, kv_dtype):
    spec = f"disk:{tmp_path}/kv"
    w = make_engine([spec], kv_dtype=kv_dtype)
    want, _ = run(w)
    w.shutdown()
    r = make_engine([spec], kv_dtype=kv_dtype)
    got, cached = run(r)
    assert got == want and cached[0] >= len(PREFIX)
    # the prefix's blocks hold the same bytes in the writer's and the reader's pools
    ids_w = [b for b in range(w.kv_manager.num_blocks) if w.kv_manager.block_hash(b) is not None]
    hashes_r = {r.kv_manager.block_hash(b): b for b in range(r.kv_manager.num_blocks)}
    same = 0
    for b in ids_w:
        h = w.kv_manager.block_hash(b)
        if h in hashes_r:
            rb = hashes_r[h]
            assert w.kv_caches[0][0][b].tobytes() == r.kv_caches[0][0][rb].tobytes()
            assert w.kv_caches[-1][1][b].tobytes() == r.kv_caches[-1][1][rb].tobytes()
            same += 1
    assert same >= len(PREFIX) // 16


def test_pool_eviction_refilled_from_tier(backend, tmp_path):
    """A pool too small to keep the prefix: later requests load it back from the tier."""
    eng = make_engine([f"disk:{tmp_path}/kv"], backend=backend, num_blocks=12, max_num_seqs=1)
    base = make_engine(backend=backend, num_blocks=12, max_num_seqs=1)
    flood = [[(i * 31 + j * 7) % 125 + 2 for j in range(90)] for i in range(3)]  # evicts the prefix blocks
    want, _ = run(base, [PREFIX + [7]] + flood + [PREFIX + [8]])
    eng.generate([PREFIX + [7]], GREEDY)
    eng.kv_tiers.flush()
    eng.generate(flood, GREEDY)
    eng.kv_tiers.flush()
    got = eng.generate([PREFIX + [8]], GREEDY)[0]
    assert got.outputs[0].token_ids == want[-1]
    assert got.num_cached_tokens == len(PREFIX)
    assert tier_stats(eng)["hit_blocks"] >= 5


SCRIPT = """
import json, sys
from pagedkv_rs.engine.request import SamplingParams
sys.path.insert(0, {tests!r})
from tier_util import make_engine, prompts
eng = make_engine([{spec!r}], backend={backend!r})
outs = eng.generate(prompts(), SamplingParams(max_tokens=6, temperature=0.0))
eng.shutdown()
print(json.dumps([[o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]]))
"""


def run_process(spec, backend):
    tests = os.path.dirname(os.path.abspath(__file__))
    code = SCRIPT.format(tests=tests, spec=spec, backend=backend)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_process_hits_disk_tier_after_restart(backend, tmp_path):
    spec = f"disk:{tmp_path}/kv?size=64MiB"
    toks1, cached1 = run_process(spec, backend.name)
    toks2, cached2 = run_process(spec, backend.name)
    assert toks1 == toks2
    assert cached1[0] == 0 and cached2[0] >= len(PREFIX)


def test_two_processes_share_through_redis(redis_server, backend):
    toks1, cached1 = run_process(redis_server.url, backend.name)
    eng = make_engine([redis_server.url], backend=backend)  # this process: the other replica
    toks2, cached2 = run(eng)
    assert toks2 == toks1 and cached1[0] == 0 and cached2[0] >= len(PREFIX)
    assert tier_stats(eng)["hit_blocks"] >= 5


def test_killing_redis_mid_run_costs_only_speed(redis_server):
    base = make_engine()
    long = SamplingParams(max_tokens=40, temperature=0.0)
    batch = [PREFIX + [i] for i in range(4)] + prompts()
    want = [o.outputs[0].token_ids for o in base.generate(batch, long)]
    eng = make_engine([redis_server.url + "?timeout=0.5"])
    streams = [eng.submit(p, long) for p in batch]  # the background loop runs them
    first = iter(streams[0])
    next(first)  # a first token is out: the run is under way
    redis_server.stop()  # mid-run: blocks completed from here on cannot be stored
    *_, last = first
    got = [last.outputs[0].token_ids] + [s.result(timeout=120).outputs[0].token_ids for s in streams[1:]]
    eng.shutdown()
    assert got == want
    fresh = make_engine([redis_server.url + "?timeout=0.5"])
    assert run(fresh)[0] == run(base)[0]  # lookups and stores fail: the requests compute and finish
    fresh.kv_tiers.flush()
    st = tier_stats(fresh)
    assert st["errors"] >= 1 and st["hit_blocks"] == 0
    redis_server.start()  # an empty server on the same port: the tier reconnects
    tier = fresh.kv_tiers.tiers[0]
    for _ in range(400):  # until the tier's rest after the failure is over and a store lands
        fresh.kv_manager.reset_prefix_cache()
        run(fresh, [PREFIX + [9]])
        fresh.kv_tiers.flush()
        if tier_stats(fresh)["stored_blocks"] > st["stored_blocks"]:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the Redis tier never reconnected: {tier_stats(fresh)}")
    assert tier._r.dbsize() > 0
    again = make_engine([redis_server.url])
    assert run(again, [PREFIX + [9]])[1] == [len(PREFIX)]  # and serves hits again


@pytest.mark.parametrize(
    "change",
    [{"kv_dtype": "float16"}, {"seed": 1}, {"salt": "tenant-b"}],
    ids=["kv_dtype", "model_weights", "cache_salt"],
)
def test_different_fingerprint_or_salt_never_hits(tmp_path, change):
    spec = f"disk:{tmp_path}/kv"
    w = make_engine([spec])
    run(w, salt="tenant-a")
    w.shutdown()
    salt = change.get("salt", "tenant-a")
    kw = {k: v for k, v in change.items() if k != "salt"}
    other = make_engine([spec], **kw)
    toks, cached = run(other, salt=salt)
    assert cached[0] == 0 and cached[2] == 0 and tier_stats(other)["hit_blocks"] == 0
    same = make_engine([spec])
    assert run(same, salt="tenant-a")[1][0] == len(PREFIX)


def test_corrupted_truncated_and_wrong_mac_entries_are_counted_misses(tmp_path):
    d = tmp_path / "kv"
    w = make_engine([f"disk:{d}?secret=s3cret"])
    want, _ = run(w)
    w.shutdown()
    files = sorted(p for p in d.rglob("*.kvb"))
    assert files
    wrong = make_engine([f"disk:{d}?secret=other"])  # wrong MAC: every record fails
    assert run(wrong)[0] == want
    st = tier_stats(wrong)
    assert st["hit_blocks"] == 0 and st["verify_failures"] >= 1
    w = make_engine([f"disk:{d}?secret=s3cret"])
    run(w)
    w.shutdown()
    files = sorted(p for p in d.rglob("*.kvb"))
    for i, f in enumerate(files):
        data = bytearray(f.read_bytes())
        if i % 2:
            data[len(data) // 2] ^= 0x40  # flip one bit in the payload
            f.write_bytes(bytes(data))
        else:
            f.write_bytes(bytes(data[: len(data) - 7]))  # truncated
    r = make_engine([f"disk:{d}?secret=s3cret"])
    toks, cached = run(r)
    assert toks == want
    st = tier_stats(r)
    assert st["verify_failures"] >= 1 and st["errors"] == 0


class _StuckTier(Tier):
    """A tier whose writes block until released, and whose lookups fail."""

    kind = "stuck"

    def __init__(self) -> None:
        import threading

        self.name = "stuck"
        self.release = threading.Event()

    def get_many(self, keys, deadline):
        raise TierError("down")

    def put_many(self, items):
        self.release.wait()
        return 0


def test_full_writer_queue_drops_and_counts_and_a_failing_tier_is_skipped(tmp_path):
    stuck = _StuckTier()
    disk = parse_tier(f"disk:{tmp_path}/kv")
    eng = make_engine([stuck, disk])
    kv: KVTiers = eng.kv_tiers
    kv._writers[0].capacity = 2
    want, _ = run(make_engine())
    assert run(eng)[0] == want
    st = eng.stats()["kv_tiers"]
    assert st["stuck"]["store_drops"] >= 1
    stuck.release.set()
    eng.kv_tiers.flush()
    again = make_engine([stuck, parse_tier(f"disk:{tmp_path}/kv")])
    toks, cached = run(again)
    assert toks == want and cached[0] >= len(PREFIX)  # the failing first tier is counted and skipped
    st = again.stats()["kv_tiers"]
    assert st["stuck"]["errors"] >= 1 and st[f"disk:{tmp_path}/kv"]["hit_blocks"] >= 5


def test_prompt_dicts_are_checked():
    from pagedkv_rs.engine.request import InvalidRequestError

    eng = make_engine()
    with pytest.raises(InvalidRequestError, match="exactly one"):
        eng.generate([{"prompt_token_ids": [1, 2], "prompt": "x"}])
    with pytest.raises(InvalidRequestError, match="unknown keys"):
        eng.generate([{"prompt_token_ids": [1, 2], "salt": "x"}])
    with pytest.raises(TypeError, match="cache_salt"):
        eng.generate([{"prompt_token_ids": [1, 2], "cache_salt": 3}])
    assert len(eng.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY)) == 1


def test_bad_tier_specs_fail_at_construction(tmp_path):
    with pytest.raises(ValueError, match="unknown KV tier"):
        make_engine(["s3://bucket"])
    with pytest.raises(TypeError, match="list of tier specs"):
        make_engine(f"disk:{tmp_path}")
    with pytest.raises(ValueError, match="listed twice"):
        make_engine([f"disk:{tmp_path}/a", f"disk:{tmp_path}/a"])
