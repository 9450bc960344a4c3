"""Allocator / block-table workloads; Rust and Python rows side by side in each group.

pytest benches/test_bench_allocator.py --benchmark-only --benchmark-group-by=group
"""

from __future__ import annotations

import pytest

from pagedkv_rs.cli.bench.alloc import ROUNDS, WARMUP, WORKLOADS


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_allocator(benchmark, backend, workload):
    benchmark.group = workload
    benchmark.extra_info["backend"] = backend.name
    run = WORKLOADS[workload](backend)
    benchmark.pedantic(run, rounds=ROUNDS[workload], warmup_rounds=WARMUP)
