"""Linear-layer benchmarks: rows int8 (pagedkv_rs.QLinear, on each ISA this CPU runs) / float32 (numpy
sgemm), grouped by shape.

Run on a release build: ``pytest benches/test_bench_linear.py --benchmark-only``;
``pagedkv bench linear --isa avx2 --isa scalar`` prints the same shapes with GOP/s, speed-ups and
interleaved rounds from one run. The scalar rows stop at M=32 and leave out lm_head (the portable tile
needs seconds for the larger products).
"""

from __future__ import annotations

import pytest

import pagedkv_rs
from pagedkv_rs.cli.bench.linear import SHAPES, build, build_q4

# One ISA per distinct int8 build: ("int8-avx2", "avx2"), ("int8-scalar", "scalar"), ...
_BUILDS: dict[str, str] = {}
for _isa in reversed(pagedkv_rs.kernel_info()["isas"]):
    _prev = pagedkv_rs.get_isa()
    pagedkv_rs.set_isa(_isa)
    _BUILDS.setdefault(pagedkv_rs.kernel_info()["linear_isa"], _isa)
    pagedkv_rs.set_isa(_prev)
IMPLS = [f"int8-{b}" for b in _BUILDS] + [f"q4-{b}" for b in _BUILDS] + ["float32"]
CASES = [
    (s, impl)
    for impl in IMPLS
    for s in SHAPES
    if impl == "float32" or "scalar" not in impl or (s.m <= 32 and not s.name.startswith("lm_head"))
]


# Every int8 row runs before any float32 one, away from OpenBLAS's worker threads, which keep
# spinning after an sgemm and would steal a core.
@pytest.mark.parametrize("shape,impl", CASES, ids=[f"{i}-{s.name.replace(' ', '-')}" for s, i in CASES])
def test_linear(benchmark, shape, impl):
    benchmark.group = f"linear {shape.name} N={shape.n} K={shape.k}"
    benchmark.extra_info["ops"] = shape.ops
    if impl == "float32":
        fn = build(shape)[1]
    else:
        kind, build_name = impl.split("-", 1)
        fn = build_q4(shape) if kind == "q4" else build(shape)[0]
        prev = pagedkv_rs.get_isa()
        pagedkv_rs.set_isa(_BUILDS[build_name])
    try:
        out = benchmark(fn)
    finally:
        if impl != "float32":
            pagedkv_rs.set_isa(prev)
    assert out.shape == (shape.m, shape.n)
