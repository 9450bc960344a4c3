"""Scheduler step overhead: 256 running decode requests, schedule + batch building + update, no model.

Rows per allocator backend (target for the Rust path: <= 100 us per step).
"""

from __future__ import annotations

import pytest

from pagedkv_rs.request import SamplingParams
from pagedkv_rs.scheduler import Scheduler, SchedulerConfig

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
    benchmark.pedantic(decode_step, args=(s, tokens), rounds=ROUNDS, iterations=1, warmup_rounds=10)
    assert len(s.running) == NUM_SEQS and s.num_preemptions == 0
    assert all(len(r.output_token_ids) == ROUNDS + 12 for r in s.running)


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
