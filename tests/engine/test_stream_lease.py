"""``submit()`` streams are leases: a bounded buffer, and an idle timeout once it is full."""

from __future__ import annotations

import threading

import pytest

from pagedkv_rs.engine import LLMEngine
from pagedkv_rs.engine.request import SamplingParams, StreamLeaseExpiredError
from pagedkv_rs.models import TinyModel

MODEL = TinyModel(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, vocab_size=128, max_model_len=128)
LONG = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


class Gate(TinyModel):
    """Each forward after ``arm()`` waits for ``release``: the test acts between steps, no wall-clock bounds."""

    def __init__(self) -> None:
        super().__init__(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, vocab_size=128, max_model_len=128)
        self.steps = threading.Semaphore(0)
        self.armed = False

    def forward(self, batch, kv_caches, logits_indices=None):
        if self.armed:
            assert self.steps.acquire(timeout=30)
        return super().forward(batch, kv_caches, logits_indices)


def alone(prompt, params):
    e = LLMEngine(MODEL, num_blocks=64, block_size=16, backend="python", enable_prefix_caching=False)
    return e.generate([prompt], params)[0].token_ids


def assert_clean(e: LLMEngine) -> None:
    assert not e.has_unfinished_requests()
    assert e.kv_manager.num_live_blocks == 0
    assert e._streams == {}


def wait_finished(e: LLMEngine, rid: str) -> None:
    done = threading.Event()

    def poll() -> None:
        while True:
            with e._lock:
                if rid not in e.scheduler.requests:
                    done.set()
                    return
                e._wake.wait(0.01)

    threading.Thread(target=poll, daemon=True).start()
    assert done.wait(60)


def test_a_reader_that_keeps_up_gets_every_token_through_a_one_item_buffer(backend):
    e = LLMEngine(MODEL, num_blocks=64, block_size=4, backend=backend.name, stream_buffer=1, stream_idle_timeout=60)
    try:
        outs = list(e.submit([5, 6, 7], LONG))
    finally:
        e.shutdown()
    toks = [t for o in outs for t in o.new_token_ids]
    assert outs[-1].finished and toks == outs[-1].token_ids == alone([5, 6, 7], LONG)
    assert_clean(e)


def test_a_late_reader_gets_merged_outputs_before_the_timeout(backend):
    m = Gate()
    e = LLMEngine(m, num_blocks=64, block_size=4, backend=backend.name, stream_buffer=2, stream_idle_timeout=3600)
    try:
        s = e.submit([5, 6, 7], LONG)
        wait_finished(e, s.request_id)
        assert len(s._items) == 2 and s.full_since is not None  # 40 outputs folded into 2
        outs = list(s)
    finally:
        e.shutdown()
    assert [t for o in outs for t in o.new_token_ids] == outs[-1].token_ids == alone([5, 6, 7], LONG)
    assert e.stats()["aborted_by_cause"] == {}
    assert_clean(e)


def test_a_full_buffer_past_the_idle_timeout_aborts_and_frees(backend):
    m = Gate()
    e = LLMEngine(m, num_blocks=64, block_size=4, backend=backend.name, stream_buffer=2, stream_idle_timeout=5.0)
    now = [0.0]
    e._clock = lambda: now[0]
    other = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    try:
        m.armed = True
        with e._lock:  # both queued before the loop schedules its first step (it needs this lock)
            s = e.submit([5, 6, 7], LONG)
            reader = e.submit([9, 10], other)
        got = []
        for _ in range(4):  # four steps: three outputs for the idle stream, the buffer is full after the third
            m.steps.release()
            got.append(reader._take(timeout=30))
        assert s.full_since == 0.0 and s.request_id in e.scheduler.requests
        now[0] = 4.0  # not yet past the timeout
        m.steps.release()
        got.append(reader._take(timeout=30))
        assert s.request_id in e.scheduler.requests
        now[0] = 5.5
        m.steps.release()  # this step's end expires the lease
        got.append(reader._take(timeout=30))
        wait_finished(e, s.request_id)
        live = e.kv_manager.block_table(e.scheduler.requests[reader.request_id].seq_id)
        assert e.kv_manager.num_live_blocks == len(live)  # the expired request's blocks are free
        with pytest.raises(StreamLeaseExpiredError, match="stayed full for 5.0 s"):
            s.result(timeout=1)
        m.armed = False
        for _ in range(20):
            m.steps.release()
        final = reader.result(timeout=60)
    finally:
        m.armed = False
        for _ in range(50):
            m.steps.release()
        e.shutdown()
    assert final.token_ids == alone([9, 10], other)  # the other request never noticed
    st = e.stats()
    assert st["aborted_by_cause"] == {"lease_expired": 1} and st["finished_by_reason"] == {"abort": 1, "length": 1}
    assert_clean(e)


def test_stream_settings_are_checked():
    with pytest.raises(ValueError, match="stream_buffer"):
        LLMEngine(MODEL, num_blocks=8, stream_buffer=0)
    with pytest.raises(ValueError, match="stream_idle_timeout"):
        LLMEngine(MODEL, num_blocks=8, stream_idle_timeout=-1)
