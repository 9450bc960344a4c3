"""Scheduler step overhead: 256 running decode requests, schedule + batch building + update, no model.

Rows per allocator backend (target for the Rust path: <= 100 us per ``schedule()``), plus the whole
``LLMEngine.step()`` around a zero-cost model.
"""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv_rs.engine import LLMEngine
from pagedkv_rs.engine.request import SamplingParams
from pagedkv_rs.engine.scheduler import Scheduler, SchedulerConfig

NUM_SEQS = 256
PROMPT = 32
BLOCK = 16
ROUNDS = 1000


def decode_scheduler(backend, num_seqs: int = NUM_SEQS, rounds: int = ROUNDS) -> Scheduler:
    """A scheduler with ``num_seqs`` requests past their prefill, with blocks for ``rounds`` more steps."""
    blocks = num_seqs * -(-(PROMPT + rounds + 64) // BLOCK)
    kv = backend.KVCacheManager(blocks, BLOCK)
    s = Scheduler(kv, SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=num_seqs * PROMPT))
    params = SamplingParams(max_tokens=1 << 20, temperature=0, ignore_eos=True)
    for i in range(num_seqs):
        s.add_request(f"r{i}", [(i * 7 + j) % 1000 + 2 for j in range(PROMPT)], params)
    so = s.schedule()
    s.update_from_output(so, [5] * len(so.sample_rows))
    return s


def decode_step(s: Scheduler, tokens: list[int]) -> None:
    so = s.schedule()
    s.update_from_output(so, tokens)


@pytest.mark.benchmark(group="scheduler-step-256-decode")
def test_scheduler_step_256_decode(benchmark, backend):
    s = decode_scheduler(backend)
    tokens = [5] * NUM_SEQS
    decode_step(s, tokens)
    steps_before = s.num_steps
    benchmark.pedantic(decode_step, args=(s, tokens), rounds=ROUNDS, iterations=1, warmup_rounds=10)
    assert len(s.running) == NUM_SEQS and s.num_preemptions == 0
    grown = s.num_steps - steps_before  # rounds (+ warmup) when measuring, 1 with --benchmark-disable
    assert grown >= 1 and all(len(r.output_token_ids) == 2 + grown for r in s.running)


@pytest.mark.benchmark(group="scheduler-step-256-decode")
def test_schedule_only_256_decode(benchmark, backend):
    """Only ``schedule()`` (appends + ``prepare_batch``), the part the target is about."""
    s = decode_scheduler(backend)
    tokens = [5] * NUM_SEQS
    pending: list = []

    def setup():
        if pending:
            s.update_from_output(pending.pop(), tokens)
        return (), {}

    def schedule():
        pending.append(s.schedule())

    benchmark.pedantic(schedule, setup=setup, rounds=ROUNDS, iterations=1, warmup_rounds=10)
    assert s.num_preemptions == 0


class NullModel:
    """Zero-cost model: the engine row measures scheduling, sampling and outputs alone."""

    num_layers, num_kv_heads, head_dim, vocab_size, max_model_len, eos_token_ids = 1, 1, 8, 1024, 1 << 16, (0,)

    def forward(self, batch, kv_caches):
        return np.zeros((batch.num_seqs, self.vocab_size), np.float32)


@pytest.mark.benchmark(group="engine-step-256-decode")
def test_engine_step_null_model_256_decode(benchmark, backend):
    """``LLMEngine.step()`` around a zero-cost model: schedule, batch, greedy sampling, outputs."""
    blocks = NUM_SEQS * -(-(PROMPT + ROUNDS + 64) // BLOCK)
    e = LLMEngine(
        NullModel(),
        num_blocks=blocks,
        block_size=BLOCK,
        backend=backend,
        max_num_seqs=NUM_SEQS,
        max_num_batched_tokens=NUM_SEQS * PROMPT,
    )
    params = SamplingParams(max_tokens=1 << 20, temperature=0, ignore_eos=True)
    for i in range(NUM_SEQS):
        e.add_request(None, [(i * 7 + j) % 1000 + 2 for j in range(PROMPT)], params)
    e.step()
    outs = benchmark.pedantic(e.step, rounds=ROUNDS, iterations=1, warmup_rounds=10)
    assert len(outs) == NUM_SEQS and e.stats()["num_preemptions"] == 0
