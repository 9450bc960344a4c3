"""End to end: 32 concurrent synthetic requests through LLM (SmolLM2-135M), greedy, f16 KV.

    pytest benches/test_bench_e2e.py --benchmark-only

``extra_info`` carries the vLLM-style figures (output tok/s, TTFT, TPOT) of the measured round;
``pagedkv bench e2e`` is the full report.
"""

from __future__ import annotations

import pytest

from pagedkv_rs.cli.bench.e2e import run_benchmark, synthetic_requests
from pagedkv_rs.llm import LLM


@pytest.fixture(scope="module")
def llm():
    engine = LLM(kv_dtype="float16", kv_memory="256MiB")
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("num_requests", [1, 32])
def test_e2e_generate(benchmark, llm, num_requests):
    benchmark.group = "e2e SmolLM2-135M (in 64, out 32)"
    tok = llm.get_tokenizer()
    reqs = synthetic_requests(num_requests, 64, 32, 0.0, 0, llm.model.vocab_size, sorted(tok.special_ids), seed=0)
    run_benchmark(llm, [(reqs[0][0][::-1][:16], 2)], progress=False)  # warm-up
    result = benchmark.pedantic(lambda: run_benchmark(llm, reqs, progress=False), rounds=1, iterations=1)
    assert result["total_output_tokens"] == num_requests * 32
    for key in ("output_throughput", "mean_ttft_ms", "mean_tpot_ms", "kernels"):
        benchmark.extra_info[key] = result[key]
