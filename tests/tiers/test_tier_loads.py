"""Tier loads run on the runner, off the engine lock; the request waits in its own state (WAITING_FOR_KV)."""

from __future__ import annotations

import threading

from pagedkv_rs.engine.request import RequestStatus, SamplingParams
from pagedkv_rs.tiers import Tier, parse_tier
from tier_util import PREFIX, make_engine

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


class _HeldLookup(Tier):
    """A disk tier whose lookups wait until the test releases them."""

    kind = "held"

    def __init__(self, inner: Tier) -> None:
        self.name = "held"
        self.inner = inner
        self.entered = threading.Event()
        self.release = threading.Event()

    def get_many(self, keys, deadline):
        self.entered.set()
        self.release.wait(60)
        return self.inner.get_many(keys, float("inf"))

    def put_many(self, items):
        return self.inner.put_many(items)


def _call(fn, *args):
    """``fn(*args)`` on another thread; its result, or an AssertionError if it blocks (a held engine lock)."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    t.start()
    t.join(30)
    assert out, f"{fn.__name__} blocked while a tier lookup was in flight"
    return out[0]


def test_a_held_lookup_blocks_neither_submissions_nor_aborts_and_its_blocks_are_freed(backend, tmp_path):
    prompt = PREFIX + [90, 91, 92]
    want = make_engine(backend=backend.name).generate([prompt], GREEDY)[0].token_ids
    warm = make_engine([f"disk:{tmp_path}/kv"], backend=backend.name)
    warm.generate([prompt], GREEDY)
    warm.kv_tiers.flush()

    held = _HeldLookup(parse_tier(f"disk:{tmp_path}/kv"))
    e = make_engine([held], backend=backend.name)
    try:
        first = e.submit(prompt, GREEDY)
        assert held.entered.wait(60)
        req = e.scheduler.requests[first.request_id]
        assert req.status is RequestStatus.WAITING_FOR_KV and e.scheduler.stats()["num_waiting_for_kv"] == 1
        assert e.kv_manager.num_live_blocks > 0 and e.queue_depth() == 1
        other = _call(e.submit, list(range(60, 97)), GREEDY)  # the engine lock is free while the tier is slow
        _call(e.abort_request, first.request_id)
        assert req.status is RequestStatus.FINISHED_ABORTED
        held.release.set()
        assert other.result(timeout=60).finish_reason == "length"
        second = e.submit(prompt, GREEDY).result(timeout=60)
    finally:
        held.release.set()
        e.shutdown()
    assert second.token_ids == want and second.num_cached_tokens == len(PREFIX)
    assert e.kv_manager.num_live_blocks == 0 and not e.scheduler.loading
    e.kv_manager.check_invariants()
    assert e.stats()["aborted_by_cause"] == {"abort": 1}
