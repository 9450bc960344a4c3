"""paged_attention / write_kv / copy_blocks against the float64 numpy reference, both backends."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import pagedkv_rs as pk
from kernel_util import TOL, gil_released_during, make_case, max_err, python_busy
from pagedkv_rs.kernels import reference as ref
from session import forced_isa

DTYPES = ["float32", "float16", "bfloat16"]
# Every ISA this CPU runs ("scalar", then e.g. "avx2"); the SIMD ones are compared with scalar.
ISAS = pk.kernel_info()["isas"]
SIMD_ISAS = ISAS[1:]  # empty on a CPU without SIMD: the comparisons are then not generated (reported)


def check(case, dtype, **kw):
    want = ref.paged_attention(*case.args(), **kw).astype(np.float64)
    # Recompute the reference in float64 end to end (its output is rounded to float32).
    got = pk.paged_attention(*case.args(), **kw)
    err = max_err(got, want)
    assert err <= TOL[dtype] + 1e-6, f"max abs err {err}"
    return got


def test_isa_switch_and_info():
    """The expectations come from kernel_info()["isas"]: what this CPU runs (x86-64 or aarch64)."""
    assert ISAS[0] == "scalar" and set(ISAS) <= {"scalar", "avx2", "avx512", "neon"}
    prev = pk.get_isa()
    try:
        assert not hasattr(pk, "set_kernel_backend")  # the unreleased alias of set_isa is gone
        pk.set_isa("scalar")
        assert pk.kernel_info()["isa"] == "scalar" and not {"backend", "backends"} & pk.kernel_info().keys()
        pk.set_isa("auto")
        info = pk.kernel_info()
        assert info["active_isa"] == info["detected_isa"] == ISAS[-1] and info["isa"] == "auto"
        with pytest.raises(ValueError, match="'auto', 'scalar', 'avx2' or 'avx512'"):
            pk.set_isa("avx9000")
        for name in ISAS:
            pk.set_isa(name)
            assert pk.kernel_info()["isa"] == name and pk.kernel_info()["active_isa"] == name
        for name in {"avx2", "avx512", "neon"} - set(ISAS):
            with pytest.raises(ValueError, match=f'ISA "{name}" is not supported by this CPU'):
                pk.set_isa(name)
    finally:
        pk.set_isa(prev)
    assert pk.get_isa() == prev


def test_env_var_forces_scalar():
    code = "import pagedkv_rs as p; print(p.kernel_info()['isa'])"
    env = {k: v for k, v in os.environ.items() if k != "PAGEDKV_KERNEL"} | {"PAGEDKV_ISA": "scalar"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "scalar"


def test_threads_settable():
    n = pk.get_num_threads()
    try:
        pk.set_num_threads(1)
        assert pk.get_num_threads() == 1
        pk.set_num_threads(3)
        assert pk.get_num_threads() == 3
        with pytest.raises(ValueError):
            pk.set_num_threads(0)
    finally:
        pk.set_num_threads(n)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (9, 3), (32, 8)])
@pytest.mark.parametrize("d", [64, 80, 96, 128, 256])
def test_gqa_and_head_dims(isa, dtype, hq, hkv, d):
    rng = np.random.default_rng(hq * 1000 + d)
    case = make_case(rng, seq_lens=[1, 37, 20], q_lens=[1, 1, 20], hq=hq, hkv=hkv, d=d, bs=16, dtype=dtype)
    check(case, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bs", [1, 16, 32, 128])
def test_block_sizes_and_edge_lengths(isa, dtype, bs):
    rng = np.random.default_rng(bs)
    lens = sorted({1, max(bs - 1, 1), bs, bs + 1})
    seq_lens = lens + lens
    q_lens = [1] * len(lens) + [max(1, L // 2) for L in lens]  # decode rows, then chunked prefill
    case = make_case(rng, seq_lens=seq_lens, q_lens=q_lens, hq=8, hkv=2, d=64, bs=bs, dtype=dtype, share=True)
    check(case, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_random_long_mixed_batch(isa, dtype):
    rng = np.random.default_rng(42)
    seq_lens = rng.integers(1, 4096, size=4)
    q_lens = [1, 1, int(min(seq_lens[2], 64)), int(seq_lens[3] % 300 + 1 if seq_lens[3] > 300 else seq_lens[3])]
    case = make_case(rng, seq_lens=seq_lens, q_lens=q_lens, hq=9, hkv=3, d=64, bs=32, dtype=dtype, share=True)
    check(case, dtype)


@pytest.mark.parametrize("window,cap", [(1, None), (7, None), (100, None), (None, 2.5), (13, 10.0)])
def test_sliding_window_and_soft_cap(isa, window, cap):
    rng = np.random.default_rng(window or 0)
    case = make_case(rng, seq_lens=[50, 200, 3], q_lens=[50, 1, 2], hq=4, hkv=2, d=64, bs=16)
    check(case, "float32", sliding_window=window, soft_cap=cap)


def test_custom_scale_and_out(isa):
    rng = np.random.default_rng(5)
    case = make_case(rng, seq_lens=[30], q_lens=[5], hq=2, hkv=1, d=64, bs=8)
    out = np.full(case.q.shape, np.nan, np.float32)
    res = pk.paged_attention(*case.args(), scale=0.3, out=out)
    assert res is out
    assert max_err(out, ref.paged_attention(*case.args(), scale=0.3)) < 3e-5


def test_empty_and_zero_length_rows(isa):
    rng = np.random.default_rng(6)
    # A sequence scheduling no tokens (q_len 0) next to one decoding, and one with seq_len 0.
    case = make_case(rng, seq_lens=[10, 0, 5], q_lens=[0, 0, 1], hq=2, hkv=1, d=64, bs=4)
    check(case, "float32")
    empty = make_case(rng, seq_lens=[], q_lens=[], hq=2, hkv=1, d=64, bs=4)
    assert pk.paged_attention(*empty.args()).shape == (0, 2, 64)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_split_kv_long_single_sequence(isa, dtype):
    # B=1, one KV head: one work item < 4 * threads, so the keys are split and LSE-merged.
    rng = np.random.default_rng(9)
    case = make_case(rng, seq_lens=[4000], q_lens=[1], hq=4, hkv=1, d=128, bs=16, dtype=dtype)
    n = pk.get_num_threads()
    try:
        outs = []
        for t in (1, 2, 5):
            pk.set_num_threads(t)
            outs.append(check(case, dtype))
        np.testing.assert_allclose(outs[0], outs[2], atol=3e-6)
    finally:
        pk.set_num_threads(n)


@pytest.mark.parametrize("simd", SIMD_ISAS)
def test_simd_equals_scalar_closely(simd):
    rng = np.random.default_rng(11)
    case = make_case(rng, seq_lens=[300, 77], q_lens=[1, 40], hq=8, hkv=2, d=96, bs=16, dtype="float16")
    with forced_isa("scalar"):
        a = pk.paged_attention(*case.args())
    with forced_isa(simd):
        assert pk.kernel_info()["active_isa"] == simd
        b = pk.paged_attention(*case.args())
    assert np.abs(a - b).max() < 2e-5


@pytest.mark.parametrize("isa_name", ISAS)
def test_gil_released_during_a_call(isa_name):
    rng = np.random.default_rng(3)
    case = make_case(rng, seq_lens=[1024] * 4, q_lens=[64] * 4, hq=8, hkv=2, d=128, bs=32)
    with forced_isa(isa_name):
        assert gil_released_during(lambda: pk.paged_attention(*case.args()))


def test_the_gil_probe_sees_a_call_that_keeps_the_gil():
    """The control: pure-Python work of the same length never lets the waiting thread in."""
    assert not gil_released_during(python_busy, attempts=3)


# ------------------------------------------------------------------------------ cache writes


@pytest.mark.parametrize("dtype", DTYPES)
def test_new_kv_cache_layout(dtype):
    k, v = pk.new_kv_cache(5, 16, 3, 64, dtype)
    assert k.shape == v.shape == (5, 3, 16, 64) and k.dtype.name == dtype
    assert k.flags.c_contiguous and not np.shares_memory(k, v) and not k.any()
    assert pk.new_kv_cache(1, 1, 1, 8)[0].dtype == np.float16
    assert pk.new_kv_cache(1, 1, 1, 8, np.float32)[0].dtype == np.float32
    with pytest.raises(ValueError):
        pk.new_kv_cache(1, 1, 1, 8, "int8")
    with pytest.raises(ValueError):
        pk.new_kv_cache(1, 0, 1, 8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_matches_reference(dtype):
    rng = np.random.default_rng(1)
    k1, v1 = pk.new_kv_cache(6, 4, 2, 16, dtype)
    k2, v2 = ref.new_kv_cache(6, 4, 2, 16, dtype)
    key = rng.standard_normal((9, 2, 16), dtype=np.float32) * 100
    val = rng.standard_normal((9, 2, 16), dtype=np.float32)
    slots = np.array([0, 5, -1, 23, 7, -1, 12, 3, 22], np.int64)
    pk.write_kv(k1, v1, key, val, slots)
    ref.write_kv(k2, v2, key, val, slots)
    assert k1.tobytes() == k2.tobytes() and v1.tobytes() == v2.tobytes()
    with pytest.raises(ValueError, match="slot_mapping"):
        pk.write_kv(k1, v1, key, val, np.array([0] * 8 + [24], np.int64))
    with pytest.raises(TypeError, match="int64"):
        pk.write_kv(k1, v1, key, val, slots.astype(np.int32))
    with pytest.raises(TypeError, match="float32"):
        pk.write_kv(k1, v1, key.astype(np.float64), val, slots)
    k1.flags.writeable = False
    with pytest.raises(ValueError, match="writeable"):
        pk.write_kv(k1, v1, key, val, slots)


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_matches_reference(dtype):
    rng = np.random.default_rng(2)
    k1, v1 = pk.new_kv_cache(5, 4, 2, 8, dtype)
    k1[...] = rng.standard_normal(k1.shape).astype(k1.dtype)
    v1[...] = rng.standard_normal(v1.shape).astype(v1.dtype)
    k2, v2 = k1.copy(), v1.copy()
    pairs = np.array([[0, 3], [3, 4], [2, 2], [1, 0]], np.int64)
    pk.copy_blocks(k1, v1, pairs)
    ref.copy_blocks(k2, v2, pairs)
    assert k1.tobytes() == k2.tobytes() and v1.tobytes() == v2.tobytes()
    pk.copy_blocks(k1, v1, [(4, 1)])
    assert k1[1].tobytes() == k1[4].tobytes()
    pk.copy_blocks(k1, v1, [])
    with pytest.raises(ValueError, match="block id"):
        pk.copy_blocks(k1, v1, [(0, 5)])
    with pytest.raises(TypeError):
        pk.copy_blocks(k1, v1, "nope")
    for ro in (k1, v1):  # either cache read-only: refused before any copy
        before = (k1.tobytes(), v1.tobytes())
        ro.flags.writeable = False
        try:
            with pytest.raises(ValueError, match="k_cache and v_cache must be writeable"):
                pk.copy_blocks(k1, v1, [(0, 1)])
        finally:
            ro.flags.writeable = True
        assert (k1.tobytes(), v1.tobytes()) == before


@pytest.mark.parametrize("backend", ["rust", "python"])
def test_end_to_end_with_kv_manager(backend):
    """Inputs exactly as KVCacheManager.prepare_batch returns them, padded and CSR tables (the same
    bits); fork + copy-on-write blocks, a fork sharing a partial block."""
    from pagedkv_rs import fallback

    rng = np.random.default_rng(8)
    bs, hkv, hq, d = 4, 2, 4, 64
    cls = pk.KVCacheManager if backend == "rust" else fallback.KVCacheManager
    m = cls(32, bs, enable_prefix_caching=False)
    k, v = pk.new_kv_cache(32, bs, hkv, d, "float16")
    k[...] = np.nan
    v[...] = np.nan
    m.allocate(1, list(range(10)))
    m.allocate(2, list(range(3)))
    seqs, n_new = [1, 2], [10, 3]
    for step in range(4):
        if step == 1:
            m.fork(1, 3)  # shares seq 1's blocks, including its partial last block
            seqs = [1, 2, 3]
        if step >= 1:
            for sid in seqs:
                pk.copy_blocks(k, v, m.append(sid, [7]))
            n_new = [1] * len(seqs)
        batch = m.prepare_batch(seqs, n_new)
        T = batch.num_tokens
        pk.write_kv(
            k,
            v,
            rng.standard_normal((T, hkv, d), dtype=np.float32),
            rng.standard_normal((T, hkv, d), dtype=np.float32),
            batch.slot_mapping,
        )
        q = rng.standard_normal((T, hq, d), dtype=np.float32)
        args = (q, k, v, batch.block_tables, batch.seq_lens, batch.query_start_loc)
        padded = pk.paged_attention(*args)
        assert max_err(padded, ref.paged_attention(*args).astype(np.float64)) < 3e-5
        csr = (batch.indptr, batch.indices, batch.last_page_len)
        got = pk.paged_attention(q, k, v, csr, batch.seq_lens, batch.query_start_loc)
        assert np.array_equal(got.view(np.uint32), padded.view(np.uint32))


def test_validation_messages():
    rng = np.random.default_rng(4)
    c = make_case(rng, seq_lens=[9, 4], q_lens=[2, 1], hq=4, hkv=2, d=16, bs=4, dtype="float32", spare_blocks=0)
    q, k, v, bt, sl, qsl = c.args()
    with pytest.raises(ValueError, match="out must not share memory with q"):
        pk.paged_attention(q, k, v, bt, sl, qsl, out=q)
    alias = k.reshape(-1)[: q.size].reshape(q.shape)
    with pytest.raises(ValueError, match="out must not share memory with k_cache"):
        pk.paged_attention(q, k, v, bt, sl, qsl, out=alias)
    bad = bt.copy()
    bad[0, 2] = k.shape[0]
    nb = k.shape[0]
    with pytest.raises(ValueError, match=rf"block_tables\[0, 2\] = {nb} is not a block id in \[0, {nb}\)"):
        pk.paged_attention(q, k, v, bad, sl, qsl)
    with pytest.raises(ValueError, match="needs 5 blocks, block_tables has 4 columns"):
        pk.paged_attention(q, k, v, bt, np.array([17, 4], np.int32), qsl)
    with pytest.raises(ValueError, match=r"block_tables\[0, 3\] = -1"):
        pk.paged_attention(q, k, v, bt, np.array([13, 4], np.int32), qsl)
    with pytest.raises(ValueError, match="q_len 2 > seq_len 1"):
        pk.paged_attention(q, k, v, bt, np.array([1, 4], np.int32), qsl)
    with pytest.raises(TypeError, match="block_tables must be int32, got int64"):
        pk.paged_attention(q, k, v, bt.astype(np.int64), sl, qsl)
    with pytest.raises(ValueError, match="C-contiguous"):
        pk.paged_attention(np.asfortranarray(q), k, v, bt, sl, qsl)
    buf = np.zeros(q.nbytes + 1, np.uint8)
    unaligned = np.frombuffer(buf[1:].data, np.float32).reshape(q.shape)
    with pytest.raises(ValueError, match="not aligned"):
        pk.paged_attention(unaligned, k, v, bt, sl, qsl)
    with pytest.raises(TypeError, match="k_cache must be float32, float16 or bfloat16"):
        pk.paged_attention(q, k.astype(np.float64), v.astype(np.float64), bt, sl, qsl)
    with pytest.raises(ValueError, match="sliding_window"):
        pk.paged_attention(q, k, v, bt, sl, qsl, sliding_window=0)


def test_bench_numpy_baseline_matches_reference():
    """The numpy gather+matmul row of the benchmarks computes the same attention."""
    from pagedkv_rs.cli.bench.kernel import numpy_attention

    rng = np.random.default_rng(12)
    # 300 rows: three chunks of NUMPY_CHUNK, each over only the keys it can see (causal work)
    case = make_case(rng, seq_lens=[40, 17, 5, 310], q_lens=[1, 17, 3, 300], hq=6, hkv=2, d=32, bs=8, dtype="float16")
    got = numpy_attention(*case.args())
    assert max_err(got, ref.paged_attention(*case.args()).astype(np.float64)) < 1e-4


def test_bench_numpy_baseline_does_causal_work(monkeypatch):
    """The Prefill row counts causal FLOPs; the numpy baseline's matmuls must do about that, not L x L."""
    from pagedkv_rs.cli.bench import kernel as bench

    c = bench.Config("Prefill", 1, 1024, 2, 1, 8, "float32", q_len=1024, block_size=16)
    x = bench.build(c)[0]
    done = [0.0]
    matmul = np.matmul

    def counting(a, b, *args, **kw):
        done[0] += 2.0 * np.prod(a.shape[:-1]) * a.shape[-1] * b.shape[-1]  # flops of this product
        return matmul(a, b, *args, **kw)

    monkeypatch.setattr(np, "matmul", counting)
    got = bench.numpy_attention(*x)
    monkeypatch.undo()
    # chunks of 128 rows over L = 1024 keys: at most 1 + 128/1024 times the causal work
    assert 1.0 <= done[0] / c.flops < 1.13, done[0] / c.flops
    assert max_err(got, ref.paged_attention(*x).astype(np.float64)) < 1e-4
