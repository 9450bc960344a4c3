"""Per-request bounds (issue 32): an ``n > 1`` fan-out holds a seat per sequence, logprobs stay compact
arrays until the API edge, and a text prompt too long for the context is refused before it is tokenized."""

from __future__ import annotations

import pytest

from pagedkv_rs.engine import LLMEngine
from pagedkv_rs.engine.request import InvalidRequestError, RequestStatus, SamplingParams
from pagedkv_rs.models import TinyModel

MODEL = TinyModel(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, vocab_size=96, max_model_len=256)


@pytest.fixture
def engines():
    made: list[LLMEngine] = []
    yield made
    for e in made:
        e.shutdown()


def make(engines, **kw) -> LLMEngine:
    kw.setdefault("num_blocks", 512)
    kw.setdefault("block_size", 4)
    e = LLMEngine(MODEL, **kw)
    engines.append(e)
    return e


def seats(e: LLMEngine) -> int:
    s = e.scheduler
    return len(s.running) + len(s.loading) + s.reserved_seats


# ------------------------------------------------------------------------------------------ n > 1 fan-out
def test_fan_out_never_runs_more_sequences_than_max_num_seqs_and_a_bystander_is_served(engines):
    """64 prompts x n=16 against max_num_seqs=64 ran 928 sequences at once; now a group waits for all its seats."""
    e = make(engines, max_num_seqs=64, max_num_batched_tokens=512)
    params = SamplingParams(n=16, max_tokens=3, temperature=1.0, seed=1, ignore_eos=True)
    for i in range(64):
        e.add_request(f"p{i}", [2 + i % 90, 3, 4, 5, 6], params)
    e.add_request("bystander", [7, 8, 9], SamplingParams(max_tokens=2, ignore_eos=True))
    peak = peak_seats = 0
    finished: dict[str, object] = {}
    while e.has_unfinished_requests():
        for o in e.step():
            if o.finished:
                finished[o.request_id] = o
        assert len(e.scheduler.running) <= 64
        peak = max(peak, len(e.scheduler.running))
        peak_seats = max(peak_seats, seats(e))
        assert seats(e) <= 64
    assert peak == 64 and peak_seats == 64  # the seats are used, not left idle
    assert len(finished) == 65 and finished["bystander"].outputs[0].finish_reason == "length"
    assert all(len(o.outputs) == 16 for k, o in finished.items() if k != "bystander")
    assert e.scheduler.reserved_seats == 0 and e.kv_manager.stats()["live_blocks"] == 0


def test_a_group_waits_for_its_whole_fan_out_while_a_smaller_one_runs(engines):
    e = make(engines, max_num_seqs=4)
    e.add_request("a", [2, 3, 4], SamplingParams(n=3, max_tokens=4, ignore_eos=True))
    e.add_request("b", [5, 6, 7], SamplingParams(n=2, max_tokens=4, ignore_eos=True))
    e.step()
    s = e.scheduler
    assert len(s.running) == 3 and s.requests["b"].status is RequestStatus.WAITING  # 3 + 2 > 4 seats
    while e.has_unfinished_requests():
        e.step()
        assert seats(e) <= 4
    assert s.reserved_seats == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_seats_reserved_for_forks_are_released_on_preemption_and_abort(engines, mode):
    e = make(engines, num_blocks=24, max_num_seqs=8, max_num_batched_tokens=8, preemption_mode=mode)
    p = SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=2, ignore_eos=True)
    for i in range(4):
        e.add_request(f"g{i}", list(range(10 + i, 30 + i)), p)  # 20-token prompts: several chunks each
    e.step()
    assert e.scheduler.reserved_seats > 0  # admitted heads hold seats for their forks mid-prefill
    e.abort_request("g0")
    while e.has_unfinished_requests():
        e.step()
        assert seats(e) <= 8
    assert e.scheduler.num_preemptions > 0
    assert e.scheduler.reserved_seats == 0 and e.kv_manager.stats()["live_blocks"] == 0


def test_a_fan_out_that_can_never_fit_is_refused_at_the_door(engines):
    e = make(engines, max_num_seqs=8)
    with pytest.raises(InvalidRequestError, match=r"n=9 .*max_num_seqs=8") as ei:
        e.add_request("x", [2, 3], SamplingParams(n=9))
    assert ei.value.param == "n"
    assert not e.has_unfinished_requests()
    e.add_request("y", [2, 3], SamplingParams(n=8, max_tokens=2))  # exactly the seats: runs
    while e.has_unfinished_requests():
        e.step()
