"""Engine metrics stay bounded: fixed-bucket histograms, counters, a recent window for medians."""

from __future__ import annotations

import math

import pytest

from pagedkv_rs.engine import LLMEngine
from pagedkv_rs.engine.request import SamplingParams
from pagedkv_rs.metrics import EngineMetrics, Histogram
from pagedkv_rs.models import TinyModel

MODEL = TinyModel(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, vocab_size=128, max_model_len=128)


def test_histogram_buckets_are_fixed_and_cumulative():
    h = Histogram([0.1, 1.0, 10.0])
    for x in [0.05, 0.1, 0.5, 3.0, 50.0, 50.0]:
        h.observe(x)
    assert h.cumulative() == [(0.1, 2), (1.0, 3), (10.0, 4), (math.inf, 6)]
    assert h.count == 6 and h.sum == pytest.approx(103.65) and len(h.counts) == 4
    with pytest.raises(ValueError):
        Histogram([1.0, 0.5])


def test_stats_keep_their_keys_and_count_by_reason(backend):
    e = LLMEngine(MODEL, num_blocks=64, block_size=4, backend=backend.name)
    e.metrics = EngineMetrics(window=5)
    prompts = [[5 + i, 6, 7, 8] for i in range(6)]
    outs = e.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    e.add_request("x", [1, 2, 3])
    e.abort_request("x", reason="client_disconnect")
    e.add_request("y", [1, 2, 3])
    e.abort_request("y")
    e.metrics.record_abort("rejected")  # what the server counts for a request it never queued
    st = e.stats()
    assert st["num_finished"] == 6 and st["finished_by_reason"] == {"length": 6, "abort": 2}
    assert st["aborted_by_cause"] == {"client_disconnect": 1, "abort": 1, "rejected": 1}
    assert st["mean_ttft_s"] > 0 and st["mean_itl_s"] > 0 and st["p50_itl_s"] > 0 and st["p50_ttft_s"] > 0
    assert st["prompt_tokens"] == 6 * 4 + 2 * 3
    assert st["generation_tokens"] == 6 * 4 == sum(len(o.token_ids) for o in outs)
    assert st["prefix_cache_queries"] >= 24 and 0 <= st["prefix_cache_hits"] <= st["prefix_cache_queries"]
    assert {"num_preemptions", "num_running", "num_waiting", "kv_usage"} <= st.keys()
    m = e.metrics
    assert len(m.recent_itl) == 5 and m.itl.count == 6 * 3  # the window is bounded, the histogram counts all
    assert m.e2e.count == 8 and m.queue_time.count == m.ttft.count == 6  # the aborted two never ran
    assert m.step_time.count > 0
    assert m.generation_len.cumulative()[-1] == (math.inf, 8)
    snap = m.snapshot()
    assert snap["hist_ttft"]["count"] == 6 and snap["hist_ttft"]["buckets"][-1] == (math.inf, 6)
    with pytest.raises(TypeError, match="reason"):
        e.abort_request("z", reason="")


def test_nothing_grows_with_the_number_of_requests(backend):
    e = LLMEngine(MODEL, num_blocks=64, block_size=4, backend=backend.name)
    e.metrics = EngineMetrics(window=16)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    sizes = []
    for _ in range(3):
        e.generate([[5, 6, 7]] * 20, params)
        m = e.metrics
        sizes.append((len(m.recent_itl), len(m.recent_ttft), len(m.itl.counts), len(m.finished_by_reason)))
    assert sizes[0] == sizes[1] == sizes[2] and e.stats()["num_finished"] == 60
