"""Requests are validated at the door; a failure inside a step fails only the requests it belongs to.

Each defect test submits the bad request next to good ones: the bad one is rejected with an error
naming the field, nothing is queued, and the good ones finish with the tokens they get alone.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from pagedkv_rs.engine import LLMEngine
from pagedkv_rs.engine.request import InvalidRequestError, SamplingParams
from pagedkv_rs.engine.scheduler import Scheduler
from pagedkv_rs.models import TinyModel

MODEL = TinyModel(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, vocab_size=128, max_model_len=128)
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
GOOD = [[5, 6, 7, 8, 9], [10, 11, 12]]


def engine(backend, **kw) -> LLMEngine:
    kw.setdefault("num_blocks", 64)
    return LLMEngine(MODEL, block_size=4, backend=backend, **kw)


def alone(prompt: list[int]) -> list[int]:
    e = LLMEngine(MODEL, num_blocks=64, block_size=16, backend="python", enable_prefix_caching=False)
    return e.generate([prompt], GREEDY)[0].token_ids


def assert_clean(e: LLMEngine) -> None:
    assert not e.has_unfinished_requests()
    assert e.kv_manager.num_live_blocks == 0
    assert e._streams == {} and e.runner.host == {}


BAD_SUBMISSIONS = [
    ({"cache_salt": 5}, TypeError, "cache_salt"),
    ({"cache_salt": ["a"]}, TypeError, "cache_salt"),
    ({"cache_salt": "\ud800"}, InvalidRequestError, "cache_salt is not valid UTF-8"),  # a lone surrogate
    ({"prompt": [5, 128]}, InvalidRequestError, r"token id 128 at position 1 .*vocabulary \[0, 128\)"),
    ({"prompt": [5, -1]}, InvalidRequestError, "vocabulary"),
    ({"prompt": [5, 1.5]}, TypeError, "token ids must be ints"),
    ({"prompt": [5, True]}, TypeError, "token ids must be ints"),
    ({"prompt": []}, InvalidRequestError, "empty"),
    ({"prompt": [5] * 129}, InvalidRequestError, "max_model_len"),
    ({"prompt": 5}, TypeError, "prompt"),
    ({"prompt": b"\x05"}, TypeError, "prompt"),
    ({"arrival_time": "x"}, TypeError, "arrival_time"),
    ({"arrival_time": math.nan}, InvalidRequestError, "arrival_time"),
    ({"request_id": 5}, TypeError, "request_id"),
    ({"request_id": ""}, InvalidRequestError, "request_id"),
    ({"request_id": "a\x00b"}, InvalidRequestError, "request_id"),
    ({"params": {"max_tokens": 3}}, TypeError, "SamplingParams"),
]


@pytest.mark.parametrize("bad, exc, match", BAD_SUBMISSIONS)
def test_add_request_rejects_bad_fields_and_changes_nothing(backend, bad, exc, match):
    e = engine(backend.name)
    e.add_request("good", GOOD[0], GREEDY)
    before = (list(e.scheduler.requests), len(e.scheduler.waiting), e.kv_manager.stats())
    kw = {"request_id": "bad", "prompt": [5, 6], "params": GREEDY, **bad}
    with pytest.raises(exc, match=match):
        e.add_request(kw.pop("request_id"), kw.pop("prompt"), kw.pop("params"), **kw)
    assert (list(e.scheduler.requests), len(e.scheduler.waiting), e.kv_manager.stats()) == before
    res = {}
    while e.has_unfinished_requests():
        res.update({o.request_id: o for o in e.step()})
    assert res["good"].token_ids == alone(GOOD[0])
    assert_clean(e)


def test_duplicate_request_id_is_rejected(backend):
    e = engine(backend.name)
    e.add_request("a", GOOD[0], GREEDY)
    with pytest.raises(InvalidRequestError, match="already in use"):
        e.add_request("a", GOOD[1], GREEDY)
    assert len(e.scheduler.requests) == 1 and e.scheduler.requests["a"].prompt_token_ids == GOOD[0]


@pytest.mark.parametrize(
    "bad, exc, match", [b for b in BAD_SUBMISSIONS if not {"request_id", "arrival_time"} & b[0].keys()]
)
def test_submit_rejects_bad_fields_and_the_loop_serves_the_rest(backend, bad, exc, match):
    """Before: cache_salt=5 failed inside schedule() and the loop then failed every unfinished request."""
    e = engine(backend.name)
    try:
        streams = [e.submit(p, GREEDY) for p in GOOD]
        kw = {"prompt": [5, 6], "params": GREEDY, **bad}
        with pytest.raises(exc, match=match):
            e.submit(kw.pop("prompt"), kw.pop("params"), **kw)
        assert [s.result(timeout=60).token_ids for s in streams] == [alone(p) for p in GOOD]
    finally:
        e.shutdown()
    assert_clean(e)
    assert e.stats()["aborted_by_cause"] == {}


def test_out_of_vocab_token_does_not_reach_the_forward(backend):
    """Before: id >= vocab was queued and the next step's model.forward raised IndexError for the whole batch."""
    e = engine(backend.name)
    e.add_request("good", GOOD[0], GREEDY)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        e.add_request("bad", [3, MODEL.vocab_size + 7], GREEDY)
    outs = e.generate(GOOD[1:], GREEDY)
    assert outs[0].token_ids == alone(GOOD[1])
    while e.has_unfinished_requests():
        e.step()
    assert_clean(e)


def test_generate_checks_every_prompt_before_queueing_any(backend):
    e = engine(backend.name)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        e.generate([GOOD[0], [1, 500], GOOD[1]], GREEDY)
    assert_clean(e)
    assert e.stats()["aborted_by_cause"] == {} and e.stats()["num_finished"] == 0
    with pytest.raises(TypeError, match="cache_salt"):
        e.add_request(None, GOOD[0], GREEDY, cache_salt=object())
    assert_clean(e)


def test_scheduler_add_request_validates_salt_and_arrival_time(backend):
    s = Scheduler(backend.KVCacheManager(16, 4), vocab_size=64)
    with pytest.raises(TypeError, match="cache_salt"):
        s.add_request("a", [1, 2], cache_salt=5)
    with pytest.raises(TypeError, match="arrival_time"):
        s.add_request("a", [1, 2], arrival_time="x")
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        s.add_request("a", [1, 64])
    assert not s.requests and len(s.waiting) == 0
    r = s.add_request("a", np.array([1, 2, 63]), cache_salt=b"salt", arrival_time=3)
    assert r.prompt_token_ids == [1, 2, 63] and r.metrics.arrival_time == 3


class FailingDecode:
    """Character-level toy tokenizer whose decode fails on the ``poison`` ids."""

    def __init__(self, poison: set[int]) -> None:
        self.poison = poison

    def encode(self, text: str) -> list[int]:
        return [2 + ord(c) % 126 for c in text]

    def decode(self, ids: list[int]) -> str:
        if self.poison & set(ids):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "poisoned token")
        return "".join(chr(32 + i % 90) for i in ids)


def test_a_detokenize_error_fails_only_its_request(backend):
    """Stop strings are detokenized inside the step: a failure there fails that request, not the batch."""
    a, b = alone(GOOD[0]), alone(GOOD[1])
    poison = {a[2]} - set(b)
    assert poison, "pick prompts whose outputs differ"
    e = engine(backend.name, tokenizer=FailingDecode(poison))
    try:
        sa = e.submit(GOOD[0], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop=["\x7f\x7f"]))
        sb = e.submit(GOOD[1], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop=["\x7f\x7f"]))
        with pytest.raises(UnicodeDecodeError, match="poisoned"):
            sa.result(timeout=60)
        assert sb.result(timeout=60).token_ids == b
    finally:
        e.shutdown()
    assert_clean(e)
    assert e.stats()["aborted_by_cause"] == {"error": 1}


def test_model_without_vocab_size_is_refused():
    m = TinyModel()
    m.vocab_size = 0
    with pytest.raises(TypeError, match="vocab_size"):
        LLMEngine(m, num_blocks=8)
