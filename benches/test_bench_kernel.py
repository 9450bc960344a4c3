"""Paged-attention benchmarks: a row per kernel backend this CPU has (rust-scalar, rust-avx2,
rust-avx512) and numpy (gather + matmul), grouped by config.

Run on a release build: ``pytest benches/test_bench_kernel.py --benchmark-only``. Pools exceed the
32 MiB L3 (except Prefill, which is compute-bound). ``pagedkv bench kernel`` prints the same
configs with GB/s and fractions of the measured bandwidth / FMA peak.
"""

from __future__ import annotations

import numpy as np
import pytest

import pagedkv_rs as pk
from pagedkv_rs.cli.bench.kernel import CONFIGS, build, numpy_attention

if pk.build_profile() != "release":
    pytest.exit("benchmarks need a release build of pagedkv_rs._core (maturin develop --release)", returncode=2)

IMPLS = [f"rust-{b}" for b in pk.kernel_info()["isas"]] + ["numpy"]
_cache: dict = {}


def _layers(c):
    if c not in _cache:
        _cache.clear()  # keep one config's pools alive at a time
        _cache[c] = build(c)
    return _cache[c]


# The scalar path on the 2k-token prefill takes tens of seconds: not a useful row.
PARAMS = [(c, i) for c in CONFIGS for i in IMPLS if not (c.name == "Prefill" and i == "rust-scalar")]


@pytest.mark.parametrize("config,impl", PARAMS, ids=[f"{c.name}-{c.dtype}-{i}" for c, i in PARAMS])
def test_paged_attention(benchmark, config, impl):
    layers = _layers(config)
    outs = [np.empty(x[0].shape, np.float32) for x in layers]
    benchmark.group = f"{config.name} {config.dtype} B={config.batch} L={config.seq_len} q_len={config.q_len}"
    benchmark.extra_info["kv_bytes"] = config.kv_bytes
    benchmark.extra_info["flops"] = config.flops

    if impl == "numpy":

        def fn():
            for x, o in zip(layers, outs):
                numpy_attention(*x, out=o)
    else:

        def fn():
            for x, o in zip(layers, outs):
                pk.paged_attention(*x, out=o)

    prev = pk.get_isa()
    pk.set_isa(impl.removeprefix("rust-") if impl != "numpy" else prev)
    try:
        slow = impl in ("rust-scalar", "numpy")
        benchmark.pedantic(fn, rounds=1 if slow else 5, iterations=1, warmup_rounds=0 if slow else 1)
    finally:
        pk.set_isa(prev)
    assert all(np.isfinite(o).all() for o in outs)
