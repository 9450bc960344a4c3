"""Hypothesis fuzz of the kernel's validation boundary.

Every bad input must raise TypeError or ValueError whose message names the problem (pyo3's
PanicException derives from BaseException, so a panic fails these tests), and every valid random
input must match the float64 reference. Every drawn case carries work (at least one sequence, every
sequence with at least one query row), and every mutation applies to the case drawn for it, so no
example is skipped or compares empty arrays. Budgets scale with HYPOTHESIS_PROFILE (``session.scaled``).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import pagedkv_rs as pk
from kernel_util import make_case, max_err
from pagedkv_rs.kernels import reference as ref
from session import forced_isa, scaled


@st.composite
def cases(draw, min_hkv: int = 1, min_seqs: int = 1):
    """A valid batch with work: 1-4 sequences of 1-40 tokens, each scheduling 1..seq_len query rows."""
    hkv = draw(st.integers(min_hkv, 3))
    g = draw(st.integers(1, 4))
    d = draw(st.sampled_from([8, 12, 16, 64]))
    bs = draw(st.sampled_from([1, 2, 5, 16]))
    n = draw(st.integers(min_seqs, 4))
    seq_lens = draw(st.lists(st.integers(1, 40), min_size=n, max_size=n))
    q_lens = [draw(st.integers(1, L)) for L in seq_lens]
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


@scaled(60)
@given(
    cases(),
    st.sampled_from(pk.kernel_info()["isas"]),
    st.sampled_from([None, 1, 3, 50]),
    st.sampled_from([None, 1.5]),
)
def test_valid_random_inputs_match_reference(case, isa, window, cap):
    assert case.q.shape[0] >= len(case.seq_lens) >= 1
    with forced_isa(isa):
        got = pk.paged_attention(*case.args(), sliding_window=window, soft_cap=cap)
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
    used = [(i, j) for i in range(len(sl)) for j in range(-(-int(sl[i]) // bs))]  # never empty
    if kind == "q_dtype":
        q = q.astype(rng.choice([np.float64, np.float16, np.int32]))
    elif kind == "q_ndim":
        q = q.reshape(T, hq * d)
    elif kind == "q_noncontig":
        q = np.concatenate([q, q], axis=2)[:, :, ::2]
    elif kind == "q_head_dim":
        q = np.zeros((T, hq, d + 8), np.float32)
    elif kind == "q_heads":  # drawn with hkv >= 2: hq + 1 is not a multiple of it
        q = np.zeros((T, hq + 1, d), np.float32)
    elif kind == "q_not_array":
        q = q.tolist()
    elif kind == "q_unaligned":
        q = _unaligned(q)
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
        i, j = used[rng.integers(len(used))]
        bt[i, j] = nb + int(rng.integers(0, 5))
    elif kind == "tables_id_negative":
        i, j = used[rng.integers(len(used))]
        bt[i, j] = int(rng.choice([-1, -7, np.iinfo(np.int32).min]))
    elif kind == "tables_too_narrow":
        bt = np.ascontiguousarray(bt[:, : max(j for _, j in used)])
    elif kind == "tables_rows":
        bt = np.zeros((bt.shape[0] + 1, bt.shape[1]), np.int32)
    elif kind == "seq_len_negative":
        sl[rng.integers(len(sl))] = -int(rng.integers(1, 1000))
    elif kind == "seq_len_over_capacity":
        sl[rng.integers(len(sl))] = bt.shape[1] * bs + int(rng.integers(1, 100))
    elif kind == "seq_len_below_q_len":
        ql = np.diff(qsl)
        i = int(rng.integers(len(sl)))  # every q_len >= 1
        sl[i] = ql[i] - 1
    elif kind == "seq_lens_dtype":
        sl = sl.astype(np.int64)
    elif kind == "qsl_decreasing":
        qsl[2] = qsl[1] - 1  # drawn with >= 3 sequences: the end stays right
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
        kw["out"] = q
    elif kind == "out_aliases_cache":
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


# What each mutation must raise: the exception type and a message naming the argument and the problem.
ATTN_ERRORS = {
    "q_dtype": (TypeError, r"^q must be float32, got (float64|float16|int32)$"),
    "q_ndim": (ValueError, r"^q must be 3-d, got shape \[\d+, \d+\]$"),
    "q_noncontig": (ValueError, r"^q must be C-contiguous"),
    "q_head_dim": (ValueError, r"^q head_dim \d+ != cache head_dim \d+$"),
    "q_heads": (ValueError, r"^num_q_heads \(\d+\) must be a positive multiple of num_kv_heads \(\d+\)$"),
    "q_not_array": (TypeError, r"^q must be a numpy\.ndarray, got list$"),
    "q_unaligned": (ValueError, r"^q data is not aligned to its 4-byte items$"),
    "q_byteswapped": (TypeError, r"^q must be in native byte order$"),
    "cache_dtype": (TypeError, r"^k_cache must be float32, float16 or bfloat16, got float64$"),
    "cache_mismatch": (ValueError, r"^k_cache and v_cache must match: "),
    "cache_shape": (ValueError, r"^k_cache and v_cache must match: "),
    "cache_noncontig": (ValueError, r"^k_cache must be C-contiguous"),
    "cache_ndim": (ValueError, r"^k_cache must be 4-d, got shape \[\d+, \d+, \d+\]$"),
    "tables_dtype": (TypeError, r"^block_tables must be int32, got int64$"),
    "tables_id_high": (ValueError, r"^block_tables\[\d+, \d+\] = \d+ is not a block id in \[0, \d+\)"),
    "tables_id_negative": (ValueError, r"^block_tables\[\d+, \d+\] = -\d+ is not a block id in \[0, \d+\)"),
    "tables_too_narrow": (ValueError, r"^sequence \d+: seq_len \d+ needs \d+ blocks, block_tables has \d+ columns$"),
    "tables_rows": (ValueError, r"^need block_tables \[B, max_blocks\], seq_lens \[B\], query_start_loc \[B\+1\]"),
    "seq_len_negative": (ValueError, r"^seq_lens\[\d+\] = -\d+ is negative$"),
    "seq_len_over_capacity": (
        ValueError,
        r"^sequence \d+: seq_len \d+ needs \d+ blocks, block_tables has \d+ columns$",
    ),
    "seq_len_below_q_len": (ValueError, r"^sequence \d+: q_len \d+ > seq_len \d+$"),
    "seq_lens_dtype": (TypeError, r"^seq_lens must be int32, got int64$"),
    "qsl_decreasing": (ValueError, r"^query_start_loc must not decrease: \[1\]=\d+ > \[2\]=\d+$"),
    "qsl_start": (ValueError, r"^query_start_loc\[0\] must be 0, got 1$"),
    "qsl_end": (ValueError, r"^query_start_loc\[-1\] = \d+ but q has \d+ tokens$"),
    "qsl_length": (ValueError, r"^need block_tables \[B, max_blocks\], seq_lens \[B\], query_start_loc \[B\+1\]"),
    "out_dtype": (TypeError, r"^out must be float32, got float64$"),
    "out_shape": (ValueError, r"^out must have q's shape \[\d+, \d+, \d+\], got \[\d+, \d+, \d+\]$"),
    "out_readonly": (ValueError, r"^out must be writeable"),
    "out_aliases_q": (ValueError, r"^out must not share memory with q$"),
    "out_aliases_cache": (ValueError, r"^out must not share memory with k_cache$"),
    "out_noncontig": (ValueError, r"^out must be C-contiguous"),
    "scale_nan": (ValueError, r"^scale must be finite in float32, got (NaN|inf|-inf|1e\+?300|10{300})$"),
    "window_bad": (ValueError, r"^sliding_window must be >= 1, got -?\d+$"),
    "soft_cap_bad": (ValueError, r"^soft_cap must be a finite float32 > 0, got "),
}
assert set(ATTN_ERRORS) == set(ATTN_KINDS)


def _case_for(kind: str):
    """A valid case the mutation ``kind`` applies to (a GQA case for q_heads, three sequences to reorder)."""
    return cases(min_hkv=2 if kind == "q_heads" else 1, min_seqs=3 if kind == "qsl_decreasing" else 1)


@scaled(250)
@given(
    st.sampled_from(ATTN_KINDS).flatmap(lambda kind: st.tuples(st.just(kind), _case_for(kind))),
    st.integers(0, 2**32 - 1),
)
def test_bad_attention_inputs_raise(kind_case, seed):
    kind, case = kind_case
    args, kw = _bad_attention_args(case, kind, np.random.default_rng(seed))
    exc, match = ATTN_ERRORS[kind]
    with pytest.raises(exc, match=match):
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


WRITE_ERRORS = {
    "slot_high": (ValueError, r"^slot_mapping\[\d+\] = \d+ is not -1 or a slot in \[0, 16\)$"),
    "slot_low": (ValueError, r"^slot_mapping\[\d+\] = -\d+ is not -1 or a slot in \[0, 16\)$"),
    "slot_dtype": (TypeError, r"^slot_mapping must be int64, got (int32|float64|uint64)$"),
    "key_shape": (ValueError, r"^key and value must be \[\d+, 2, 8\] \(num_tokens, num_kv_heads, head_dim\)"),
    "key_dtype": (TypeError, r"^key must be float32, got float64$"),
    "value_shape": (ValueError, r"^key and value must be \[\d+, 2, 8\] \(num_tokens, num_kv_heads, head_dim\)"),
    "readonly": (ValueError, r"^k_cache and v_cache must be writeable$"),
    "key_aliases_cache": (ValueError, r"^key must not share memory with the caches$"),
    # a float64 v_cache is the wrong dtype; a float32 one beside a float16/bfloat16 k_cache a mismatch
    "cache_mismatch": (
        (TypeError, ValueError),
        r"^(v_cache must be float32, float16 or bfloat16, got float64|k_cache and v_cache must match: )",
    ),
    "slots_2d": (ValueError, r"^slot_mapping must be 1-d, got shape \[\d+, 1\]$"),
}
assert set(WRITE_ERRORS) == set(WRITE_KINDS)


@scaled(80)
@given(
    st.sampled_from(WRITE_KINDS).flatmap(
        # a float32 key can only alias a float32 cache
        lambda kind: st.tuples(
            st.just(kind),
            st.just("float32") if kind == "key_aliases_cache" else st.sampled_from(["float32", "float16", "bfloat16"]),
        )
    ),
    st.integers(1, 6),
    st.integers(0, 2**32 - 1),
)
def test_bad_write_kv_inputs_raise(kind_dtype, T, seed):
    kind, dtype = kind_dtype
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
        key = k.reshape(-1)[: key.size].reshape(key.shape)
    elif kind == "cache_mismatch":
        v = np.zeros((4, 2, 4, 8), np.float64 if dtype == "float32" else np.float32)
    elif kind == "slots_2d":
        slots = slots.reshape(T, 1)
    exc, match = WRITE_ERRORS[kind]
    with pytest.raises(exc, match=match):
        pk.write_kv(k, v, key, val, slots)


COPY_ERRORS = {
    "high": (ValueError, r"^pairs\[\d, \d\] = \d+ is not a block id in \[0, 4\)$"),
    "negative": (ValueError, r"^pairs\[\d, \d\] = -\d+ is not a block id in \[0, 4\)$"),
    "shape": (ValueError, r"^pairs must be \[n, 2\], got \[3, 3\]$"),
    "dtype": (TypeError, r"^pairs must be int64, got float64$"),
    "not_pairs": (TypeError, r"^pairs must be an int64 array \[n, 2\] or a sequence of \(src, dst\) int pairs$"),
    "same_cache": (ValueError, r"^k_cache and v_cache must not share memory$"),
    "readonly": (ValueError, r"^k_cache and v_cache must be writeable$"),
}


@scaled(60)
@given(st.sampled_from(list(COPY_ERRORS)), st.integers(0, 2**32 - 1))
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
    elif kind == "readonly":
        v.flags.writeable = False
    exc, match = COPY_ERRORS[kind]
    with pytest.raises(exc, match=match):
        pk.copy_blocks(k, v, pairs)
