"""Hypothesis fuzz of the kernel's validation boundary.

Every bad input must raise TypeError or ValueError (pyo3's PanicException derives from
BaseException, so a panic fails these tests), and every valid random input must match the
float64 reference.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pagedkv_rs as pk
from kernel_util import make_case, max_err
from pagedkv_rs.kernels import reference as ref

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def cases(draw):
    hkv = draw(st.integers(1, 3))
    g = draw(st.integers(1, 4))
    d = draw(st.sampled_from([8, 12, 16, 64]))
    bs = draw(st.sampled_from([1, 2, 5, 16]))
    n = draw(st.integers(0, 4))
    seq_lens = draw(st.lists(st.integers(0, 40), min_size=n, max_size=n))
    q_lens = [draw(st.integers(0, L)) for L in seq_lens]
    dtype = draw(st.sampled_from(["float32", "float16", "bfloat16"]))
    seed = draw(st.integers(0, 2**32 - 1))
    return make_case(
        np.random.default_rng(seed),
        seq_lens=seq_lens,
        q_lens=q_lens,
        hq=hkv * g,
        hkv=hkv,
        d=d,
        bs=bs,
        dtype=dtype,
        share=draw(st.booleans()),
    )


@SETTINGS
@given(
    cases(),
    st.sampled_from(pk.kernel_info()["backends"]),
    st.sampled_from([None, 1, 3, 50]),
    st.sampled_from([None, 1.5]),
)
def test_valid_random_inputs_match_reference(case, backend, window, cap):
    pk.set_kernel_backend(backend)
    try:
        got = pk.paged_attention(*case.args(), sliding_window=window, soft_cap=cap)
    finally:
        pk.set_kernel_backend("auto")
    want = ref.paged_attention(*case.args(), sliding_window=window, soft_cap=cap).astype(np.float64)
    assert max_err(got, want) < 3e-5


def _unaligned(a: np.ndarray) -> np.ndarray:
    buf = np.zeros(a.nbytes + 1, np.uint8)
    out = np.frombuffer(buf[1:].data, dtype=a.dtype, count=a.size).reshape(a.shape)
    out[...] = a
    return out


def _bad_attention_args(case, kind: str, rng: np.random.Generator):
    """One invalid variant of a valid case's arguments: (args, kwargs)."""
    q, k, v, bt, sl, qsl = [x.copy() for x in case.args()]
    kw: dict = {}
    T, hq, d = q.shape
    nb, hkv, bs, _ = k.shape
    used = [(i, j) for i in range(len(sl)) for j in range(-(-int(sl[i]) // bs))]
    if q.size == 0 and kind in ("q_noncontig", "out_noncontig"):
        return None  # numpy calls every empty array contiguous
    if kind == "q_dtype":
        q = q.astype(rng.choice([np.float64, np.float16, np.int32]))
    elif kind == "q_ndim":
        q = q.reshape(T, hq * d)
    elif kind == "q_noncontig":
        q = np.concatenate([q, q], axis=2)[:, :, ::2]
    elif kind == "q_head_dim":
        q = np.zeros((T, hq, d + 8), np.float32)
    elif kind == "q_heads":
        if hkv == 1:
            return None  # every head count is a multiple of 1
        q = np.zeros((T, hq + 1, d), np.float32)
    elif kind == "q_not_array":
        q = q.tolist()
    elif kind == "q_unaligned":
        q = _unaligned(q) if q.size else np.zeros((1, hq, d), np.float64)
    elif kind == "q_byteswapped":
        q = q.astype(">f4")
    elif kind == "cache_dtype":
        k = k.astype(np.float64)
        v = v.astype(np.float64)
    elif kind == "cache_mismatch":
        v = v.astype(np.float32) if v.dtype != np.float32 else v.astype(np.float16)
    elif kind == "cache_shape":
        v = np.zeros((nb + 1, hkv, bs, d), k.dtype)
    elif kind == "cache_noncontig":
        k = np.concatenate([k, k], axis=3)[..., ::2]
    elif kind == "cache_ndim":
        k = k.reshape(nb, hkv, bs * d)
    elif kind == "tables_dtype":
        bt = bt.astype(np.int64)
    elif kind == "tables_id_high":
        if not used:
            return None
        i, j = used[rng.integers(len(used))]
        bt[i, j] = nb + int(rng.integers(0, 5))
    elif kind == "tables_id_negative":
        if not used:
            return None
        i, j = used[rng.integers(len(used))]
        bt[i, j] = int(rng.choice([-1, -7, np.iinfo(np.int32).min]))
    elif kind == "tables_too_narrow":
        if bt.shape[1] == 0 or not used:
            return None
        bt = np.ascontiguousarray(bt[:, : max(j for _, j in used)])
    elif kind == "tables_rows":
        bt = np.zeros((bt.shape[0] + 1, bt.shape[1]), np.int32)
    elif kind == "seq_len_negative":
        if not len(sl):
            return None
        sl[rng.integers(len(sl))] = -int(rng.integers(1, 1000))
    elif kind == "seq_len_over_capacity":
        if not len(sl):
            return None
        sl[rng.integers(len(sl))] = bt.shape[1] * bs + int(rng.integers(1, 100))
    elif kind == "seq_len_below_q_len":
        ql = np.diff(qsl)
        idx = [i for i in range(len(sl)) if ql[i] > 0]
        if not idx:
            return None
        i = idx[rng.integers(len(idx))]
        sl[i] = ql[i] - 1
    elif kind == "seq_lens_dtype":
        sl = sl.astype(np.int64)
    elif kind == "qsl_decreasing":
        if len(qsl) < 3:
            return None
        qsl[1], qsl[2] = qsl[2] + 1, qsl[1]
    elif kind == "qsl_start":
        qsl[0] = 1
    elif kind == "qsl_end":
        qsl[-1] += 1
    elif kind == "qsl_length":
        qsl = np.append(qsl, qsl[-1]).astype(np.int32)
    elif kind == "out_dtype":
        kw["out"] = np.zeros(q.shape, np.float64)
    elif kind == "out_shape":
        kw["out"] = np.zeros((T + 1, hq, d), np.float32)
    elif kind == "out_readonly":
        o = np.zeros(q.shape, np.float32)
        o.flags.writeable = False
        kw["out"] = o
    elif kind == "out_aliases_q":
        if q.size == 0:
            return None
        kw["out"] = q
    elif kind == "out_aliases_cache":
        if q.size == 0:
            return None
        kf = np.zeros((max(1, -(-q.nbytes // (hkv * bs * d * 4))), hkv, bs, d), np.float32)
        k, v = kf, np.zeros_like(kf)
        bt = np.zeros_like(bt)
        sl = np.minimum(sl, bs).astype(np.int32)
        kw["out"] = kf.reshape(-1)[: q.size].reshape(q.shape)
    elif kind == "out_noncontig":
        kw["out"] = np.zeros((T, hq, 2 * d), np.float32)[:, :, ::2]
    elif kind == "scale_nan":
        kw["scale"] = float(rng.choice([np.nan, np.inf, -np.inf, 1e300]))
    elif kind == "window_bad":
        kw["sliding_window"] = int(rng.integers(-5, 1))
    elif kind == "soft_cap_bad":
        kw["soft_cap"] = float(rng.choice([0.0, -1.0, np.nan, np.inf, 1e300, 1e-300]))
    else:
        raise AssertionError(kind)
    return (q, k, v, bt, sl, qsl), kw


ATTN_KINDS = [
    "q_dtype",
    "q_ndim",
    "q_noncontig",
    "q_head_dim",
    "q_heads",
    "q_not_array",
    "q_unaligned",
    "q_byteswapped",
    "cache_dtype",
    "cache_mismatch",
    "cache_shape",
    "cache_noncontig",
    "cache_ndim",
    "tables_dtype",
    "tables_id_high",
    "tables_id_negative",
    "tables_too_narrow",
    "tables_rows",
    "seq_len_negative",
    "seq_len_over_capacity",
    "seq_len_below_q_len",
    "seq_lens_dtype",
    "qsl_decreasing",
    "qsl_start",
    "qsl_end",
    "qsl_length",
    "out_dtype",
    "out_shape",
    "out_readonly",
    "out_aliases_q",
    "out_aliases_cache",
    "out_noncontig",
    "scale_nan",
    "window_bad",
    "soft_cap_bad",
]


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.sampled_from(ATTN_KINDS), st.integers(0, 2**32 - 1))
def test_bad_attention_inputs_raise(case, kind, seed):
    bad = _bad_attention_args(case, kind, np.random.default_rng(seed))
    if bad is None:  # this mutation does not apply to this case
        return
    args, kw = bad
    with pytest.raises((TypeError, ValueError)):
        pk.paged_attention(*args, **kw)


WRITE_KINDS = [
    "slot_high",
    "slot_low",
    "slot_dtype",
    "key_shape",
    "key_dtype",
    "value_shape",
    "readonly",
    "key_aliases_cache",
    "cache_mismatch",
    "slots_2d",
]


@settings(max_examples=80, deadline=None)
@given(
    st.sampled_from(WRITE_KINDS),
    st.sampled_from(["float32", "float16", "bfloat16"]),
    st.integers(1, 6),
    st.integers(0, 2**32 - 1),
)
def test_bad_write_kv_inputs_raise(kind, dtype, T, seed):
    rng = np.random.default_rng(seed)
    k, v = pk.new_kv_cache(4, 4, 2, 8, dtype)
    key = rng.standard_normal((T, 2, 8), dtype=np.float32)
    val = rng.standard_normal((T, 2, 8), dtype=np.float32)
    slots = rng.integers(-1, 16, T).astype(np.int64)
    pk.write_kv(k, v, key, val, slots)  # the valid base works
    if kind == "slot_high":
        slots[rng.integers(T)] = 16 + int(rng.integers(0, 1 << 40))
    elif kind == "slot_low":
        slots[rng.integers(T)] = -2 - int(rng.integers(0, 1 << 40))
    elif kind == "slot_dtype":
        slots = slots.astype(rng.choice([np.int32, np.float64, np.uint64]))
    elif kind == "key_shape":
        key = key[:, :1].copy()
    elif kind == "key_dtype":
        key = key.astype(np.float64)
    elif kind == "value_shape":
        val = np.zeros((T + 1, 2, 8), np.float32)
    elif kind == "readonly":
        v.flags.writeable = False
    elif kind == "key_aliases_cache":
        if dtype != "float32":
            return
        key = k.reshape(-1)[: key.size].reshape(key.shape)
    elif kind == "cache_mismatch":
        v = np.zeros((4, 2, 4, 8), np.float64 if dtype == "float32" else np.float32)
    elif kind == "slots_2d":
        slots = slots.reshape(T, 1)
    with pytest.raises((TypeError, ValueError)):
        pk.write_kv(k, v, key, val, slots)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["high", "negative", "shape", "dtype", "not_pairs", "same_cache"]), st.integers(0, 2**32 - 1))
def test_bad_copy_blocks_inputs_raise(kind, seed):
    rng = np.random.default_rng(seed)
    k, v = pk.new_kv_cache(4, 2, 1, 8, "float16")
    pairs = rng.integers(0, 4, (3, 2)).astype(np.int64)
    pk.copy_blocks(k, v, pairs)
    if kind == "high":
        pairs[rng.integers(3), rng.integers(2)] = 4 + int(rng.integers(0, 1 << 40))
    elif kind == "negative":
        pairs[rng.integers(3), rng.integers(2)] = -1 - int(rng.integers(0, 1 << 40))
    elif kind == "shape":
        pairs = np.zeros((3, 3), np.int64)
    elif kind == "dtype":
        pairs = pairs.astype(np.float64)
    elif kind == "not_pairs":
        pairs = [(1, 2, 3)]
    elif kind == "same_cache":
        v = k
    with pytest.raises((TypeError, ValueError)):
        pk.copy_blocks(k, v, pairs)
