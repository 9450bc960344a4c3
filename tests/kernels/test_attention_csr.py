"""paged_attention with the CSR block table (indptr, indices[, last_page_len]), as FlashInfer takes it.

The CSR form names the same blocks as the padded one, so every ISA must give the padded call's
result bit for bit, and both stay within the float64 reference's tolerance."""

from __future__ import annotations

import numpy as np
import pytest

import pagedkv_rs as pk
from kernel_util import TOL, make_case, max_err
from pagedkv_rs.kernels import reference as ref

DTYPES = ["float32", "float16", "bfloat16"]


def to_csr(tables: np.ndarray, seq_lens: np.ndarray, bs: int):
    """(indptr, indices, last_page_len) of a padded table: each row's ceil(seq_len / bs) ids."""
    need = -(-seq_lens.astype(np.int64) // bs)
    indptr = np.zeros(len(seq_lens) + 1, np.int32)
    indptr[1:] = np.cumsum(need)
    indices = np.concatenate([tables[i, :n] for i, n in enumerate(need)] + [np.zeros(0, np.int32)]).astype(np.int32)
    last = np.where(need > 0, seq_lens - (need - 1) * bs, 0).astype(np.int32)
    return indptr, indices, last


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bs", [1, 16, 32])
def test_csr_equals_padded_bit_for_bit(isa, dtype, bs):
    rng = np.random.default_rng(bs * 7 + len(dtype))
    seq_lens = [1, bs, bs + 1, 37, 300, 0]
    q_lens = [1, 1, 2, 37, 1, 0]  # decode rows, chunked prefill, a whole prompt, an idle sequence
    case = make_case(rng, seq_lens=seq_lens, q_lens=q_lens, hq=9, hkv=3, d=64, bs=bs, dtype=dtype, pad_cols=3)
    q, k, v, bt, sl, qsl = case.args()
    padded = pk.paged_attention(q, k, v, bt, sl, qsl)
    indptr, indices, last = to_csr(bt, sl, bs)
    for table in [(indptr, indices), (indptr, indices, last)]:
        got = pk.paged_attention(q, k, v, table, sl, qsl)
        assert np.array_equal(got.view(np.uint32), padded.view(np.uint32)), "CSR and padded differ"
        want = ref.paged_attention(q, k, v, table, sl, qsl).astype(np.float64)
        assert max_err(got, want) <= TOL[dtype] + 1e-6
    assert np.array_equal(ref.paged_attention(q, k, v, (indptr, indices), sl, qsl), ref.paged_attention(*case.args()))


def test_csr_with_sliding_window_and_out(isa):
    rng = np.random.default_rng(11)
    case = make_case(rng, seq_lens=[50, 200, 3], q_lens=[50, 1, 2], hq=4, hkv=2, d=64, bs=16)
    q, k, v, bt, sl, qsl = case.args()
    csr = to_csr(bt, sl, 16)
    out = np.full(q.shape, np.nan, np.float32)
    res = pk.paged_attention(q, k, v, csr, sl, qsl, sliding_window=7, soft_cap=10.0, out=out)
    assert res is out
    want = pk.paged_attention(q, k, v, bt, sl, qsl, sliding_window=7, soft_cap=10.0)
    assert np.array_equal(out.view(np.uint32), want.view(np.uint32))


def _bad_tables(indptr, indices, last, nb):
    """(table, exception, message) of CSR inputs the kernel must refuse."""
    i64 = indptr.astype(np.int64)
    dec = indptr.copy()
    dec[1], dec[2] = dec[2], dec[1]
    big = indices.copy()
    big[3] = nb
    neg = indices.copy()
    neg[0] = -1
    short = indptr.copy()
    short[1] -= 1
    wrong_last = last.copy()
    wrong_last[0] -= 1
    zero_last = last.copy()
    zero_last[1] = 0
    return [
        ((indptr[:-1], indices), ValueError, r"indptr must have 3 entries \(B\+1\), got 2"),
        ((indptr + 1, indices), ValueError, "indptr"),
        ((dec, indices), ValueError, "indptr"),
        ((indptr, indices[:-1]), ValueError, "indptr"),
        ((short, indices), ValueError, "needs 3 blocks, indptr gives it 2"),
        ((indptr, big), ValueError, rf"indices\[3\] = {nb} is not a block id in \[0, {nb}\)"),
        ((indptr, neg), ValueError, r"indices\[0\] = -1 is not a block id"),
        ((indptr, indices, wrong_last), ValueError, "last_page_len"),
        ((indptr, indices, zero_last), ValueError, "last_page_len"),
        ((indptr, indices, last[:1]), ValueError, "last_page_len"),
        ((i64, indices), TypeError, "indptr must be int32, got int64"),
        ((indptr, indices.astype(np.int64)), TypeError, "indices must be int32, got int64"),
        ((indptr, indices, last.astype(np.int64)), TypeError, "last_page_len must be int32, got int64"),
        ((indptr,), ValueError, "a tuple of 1"),
        ((indptr, indices, last, last), ValueError, "a tuple of 4"),
        ([indptr, indices], TypeError, r"or a tuple \(indptr, indices\).*got list"),
    ]


def test_bad_csr_tables_raise_and_leave_out_alone(isa):
    rng = np.random.default_rng(4)
    c = make_case(rng, seq_lens=[9, 4], q_lens=[2, 1], hq=4, hkv=2, d=16, bs=4, dtype="float32", spare_blocks=2)
    q, k, v, bt, sl, qsl = c.args()
    indptr, indices, last = to_csr(bt, sl, 4)
    nb = k.shape[0]
    for table, exc, msg in _bad_tables(indptr, indices, last, nb):
        out = np.full(q.shape, 7.0, np.float32)
        with pytest.raises(exc, match=msg):
            pk.paged_attention(q, k, v, table, sl, qsl, out=out)
        assert (out == 7.0).all(), f"out was written for {msg}"
        if exc is ValueError:  # the reference refuses the same inputs (its own messages)
            with pytest.raises(ValueError):
                ref.paged_attention(q, k, v, table, sl, qsl)
    # still fine after all that
    good = pk.paged_attention(q, k, v, (indptr, indices, last), sl, qsl)
    assert np.array_equal(good.view(np.uint32), pk.paged_attention(*c.args()).view(np.uint32))
