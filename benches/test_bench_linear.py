"""Linear-layer benchmarks: rows int8 (pagedkv_rs.QLinear) / float32 (numpy sgemm), grouped by shape.

Run on a release build: ``pytest benches/test_bench_linear.py --benchmark-only``;
``pagedkv bench linear`` prints the same shapes with GOP/s and speed-ups from one run.
"""

from __future__ import annotations

import pytest

from pagedkv_rs.cli.bench.linear import SHAPES, build


# pytest varies the top decorator fastest: every int8 row runs before any float32 one, away from
# OpenBLAS's worker threads, which keep spinning after an sgemm and would steal a core.
@pytest.mark.parametrize("shape", SHAPES, ids=[s.name.replace(" ", "-") for s in SHAPES])
@pytest.mark.parametrize("impl", ["int8", "float32"])
def test_linear(benchmark, shape, impl):
    benchmark.group = f"linear {shape.name} N={shape.n} K={shape.k}"
    benchmark.extra_info["ops"] = shape.ops
    fq, ff = build(shape)
    out = benchmark(fq if impl == "int8" else ff)
    assert out.shape == (shape.m, shape.n)
