"""The numpy reference against a naive token-by-token loop, and its cache helpers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pagedkv_rs.kernels import reference as ref


def naive_attention(q, k_cache, v_cache, tables, seq_lens, qsl, scale=None, window=None, cap=None):
    """One query row, one head, one key at a time, straight from the definition."""
    _, hkv, bs, d = k_cache.shape
    hq = q.shape[1]
    g = hq // hkv
    sc = 1 / math.sqrt(d) if scale is None else scale
    out = np.zeros(q.shape, np.float64)
    for i, L in enumerate(seq_lens):
        lo, hi = qsl[i], qsl[i + 1]
        for r in range(lo, hi):
            p = L - (hi - lo) + (r - lo)
            for h in range(hq):
                logits, vals = [], []
                for t in range(L):
                    if t > p or (window is not None and t <= p - window):
                        continue
                    b, o = tables[i][t // bs], t % bs
                    x = float(np.dot(q[r, h].astype(np.float64), k_cache[b, h // g, o].astype(np.float64))) * sc
                    if cap is not None:
                        x = cap * math.tanh(x / cap)
                    logits.append(x)
                    vals.append(v_cache[b, h // g, o].astype(np.float64))
                w = np.exp(np.array(logits) - max(logits))
                out[r, h] = (w[:, None] * np.array(vals)).sum(0) / w.sum()
    return out


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("window,cap", [(None, None), (5, None), (None, 3.0), (3, 2.0)])
def test_reference_matches_naive_loop(dtype, window, cap):
    rng = np.random.default_rng(0)
    nb, bs, hkv, g, d = 12, 4, 2, 3, 8
    kc, vc = ref.new_kv_cache(nb, bs, hkv, d, dtype)
    kc[...] = np.nan
    vc[...] = np.nan
    seq_lens = [1, 7, 9]
    q_lens = [1, 3, 9]
    perm = rng.permutation(nb)
    tables = np.full((3, 3), -1, np.int32)
    tables[0, 0] = perm[0]
    tables[1, :2] = perm[1:3]
    tables[2, :3] = [perm[3], perm[3], perm[4]]  # a repeated block id
    for i, L in enumerate(seq_lens):
        pos = np.arange(L)
        slots = tables[i, pos // bs].astype(np.int64) * bs + pos % bs
        ref.write_kv(
            kc,
            vc,
            rng.standard_normal((L, hkv, d), dtype=np.float32),
            rng.standard_normal((L, hkv, d), dtype=np.float32),
            slots,
        )
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((qsl[-1], hkv * g, d)).astype(np.float32)
    got = ref.paged_attention(q, kc, vc, tables, np.array(seq_lens, np.int32), qsl, sliding_window=window, soft_cap=cap)
    want = naive_attention(q, kc, vc, tables, seq_lens, qsl, window=window, cap=cap)
    assert got.dtype == np.float32 and np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_write_kv_skips_minus_one_and_converts():
    kc, vc = ref.new_kv_cache(3, 2, 1, 4, "float16")
    key = np.arange(8, dtype=np.float32).reshape(2, 1, 4)
    ref.write_kv(kc, vc, key, -key, np.array([5, -1], np.int64))
    assert kc.dtype == np.float16
    np.testing.assert_array_equal(kc[2, 0, 1], key[0, 0])
    np.testing.assert_array_equal(vc[2, 0, 1], -key[0, 0])
    assert np.count_nonzero(kc) == 3  # key[0] holds one zero; key[1] was skipped


def test_copy_blocks_in_order():
    kc, vc = ref.new_kv_cache(3, 2, 1, 2, "float32")
    kc[0] = 1
    vc[0] = 2
    ref.copy_blocks(kc, vc, [(0, 1), (1, 2)])
    assert (kc == 1).all() and (vc == 2).all()
