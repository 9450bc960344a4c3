"""Tier loads run on the runner's I/O thread; the request waits in its own state (WAITING_FOR_KV).

A slow tier delays only the requests waiting for it: other requests are submitted, run and finish
meanwhile, and an abort of the waiting request answers at once (its blocks are freed when the
load ends, never while the I/O thread may still write them).
"""

from __future__ import annotations

import threading

from pagedkv_rs.engine.request import RequestStatus, SamplingParams
from pagedkv_rs.tiers import parse_tier
from tier_util import PREFIX, HeldLookup, make_engine

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


def _warm_disk(backend, path, prompt):
    warm = make_engine([f"disk:{path}"], backend=backend)
    warm.generate([prompt], GREEDY)
    warm.kv_tiers.flush()


def test_a_held_lookup_delays_only_its_own_request(backend, tmp_path):
    prompt, other = PREFIX + [90, 91, 92], list(range(60, 70))  # other: shorter than a block, no lookup
    alone = make_engine(backend=backend.name)
    want, want_other = (o.token_ids for o in alone.generate([prompt, other], GREEDY))
    _warm_disk(backend.name, tmp_path / "kv", prompt)
    held = HeldLookup(parse_tier(f"disk:{tmp_path}/kv"))
    e = make_engine([held], backend=backend.name, kv_tier_deadline=60)
    try:
        first = e.submit(prompt, GREEDY)
        assert held.entered.wait(60)
        req = e.scheduler.requests[first.request_id]
        assert req.status is RequestStatus.WAITING_FOR_KV and e.scheduler.stats()["num_waiting_for_kv"] == 1
        assert e.queue_depth() == 1
        assert e.submit(other, GREEDY).result(timeout=60).token_ids == want_other  # while the lookup is held
        assert req.status is RequestStatus.WAITING_FOR_KV
        held.release.set()
        out = first.result(timeout=60)
    finally:
        held.release.set()
        e.shutdown()
    assert out.token_ids == want and out.num_cached_tokens == len(PREFIX)
    assert e.kv_manager.num_live_blocks == 0
    e.kv_manager.check_invariants()


def test_an_abort_during_the_load_answers_at_once_and_frees_the_blocks_after_it(backend, tmp_path):
    prompt = PREFIX + [90, 91, 92]
    want = make_engine(backend=backend.name).generate([prompt], GREEDY)[0].token_ids
    _warm_disk(backend.name, tmp_path / "kv", prompt)
    held = HeldLookup(parse_tier(f"disk:{tmp_path}/kv"))
    e = make_engine([held], backend=backend.name, kv_tier_deadline=60)
    try:
        first = e.submit(prompt, GREEDY)
        assert held.entered.wait(60)
        seq = e.scheduler.requests[first.request_id].seq_id
        e.abort_request(first.request_id)
        assert not e.has_unfinished_requests()
        assert e.kv_manager.block_table(seq)  # still held: the I/O thread may be writing them
        held.release.set()
        second = e.submit(prompt, GREEDY).result(timeout=60)
    finally:
        held.release.set()
        e.shutdown()
    assert second.token_ids == want and second.num_cached_tokens == len(PREFIX)
    assert e.kv_manager.num_live_blocks == 0 and not e.scheduler.loading
    e.kv_manager.check_invariants()
    assert e.stats()["aborted_by_cause"] == {"abort": 1}


def test_shutdown_waits_for_the_loads_in_flight(tmp_path):
    prompt = PREFIX + [90, 91, 92]
    _warm_disk("auto", tmp_path / "kv", prompt)
    held = HeldLookup(parse_tier(f"disk:{tmp_path}/kv"))
    e = make_engine([held], kv_tier_deadline=60)
    e.submit(prompt, GREEDY)
    assert held.entered.wait(60)
    threading.Timer(0.2, held.release.set).start()
    e.shutdown()  # aborts the request; its blocks are freed once the held load ends
    assert e.kv_manager.num_live_blocks == 0 and not e.scheduler.has_work()
