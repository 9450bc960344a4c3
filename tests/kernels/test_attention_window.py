"""The sliding window of ``paged_attention`` (Gemma 3's local layers, Mistral): keys older than the window.

A window of ``w`` covers ``w`` positions including the query's own (llama.cpp's ``is_masked_swa``:
key ``p0`` is masked for query ``p1`` when ``p1 - p0 >= w``). Checked on every ISA against the float64
reference and against the scalar path; keys outside every query's window are NaN-poisoned, so a kernel
that reads one (even to multiply it by a zero weight) fails; a window at least as long as the context is
the same computation as no window, to the bit.
"""

from __future__ import annotations

import numpy as np
import pytest

import pagedkv_rs as pk
from kernel_util import TOL, make_case, max_err
from pagedkv_rs.kernels import reference as ref
from session import forced_isa

ISAS = pk.kernel_info()["isas"]


def _poison_outside(case, window):
    """NaN into every cached key/value no query of its sequence can see; returns the poisoned copy."""
    k, v = case.k_cache.copy(), case.v_cache.copy()
    bs = k.shape[2]
    qsl = case.query_start_loc
    for i, seq_len in enumerate(case.seq_lens):
        first_query = int(seq_len) - int(qsl[i + 1] - qsl[i])  # position of the sequence's first new token
        for p in range(max(0, first_query - window + 1)):
            blk = case.block_tables[i, p // bs]
            k[blk, :, p % bs] = np.nan
            v[blk, :, p % bs] = np.nan
    return k, v


@pytest.mark.parametrize("window", [1, 2, 5, 16, 17, 512])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_keys_outside_the_window_are_never_read(isa, window, dtype):
    rng = np.random.default_rng(window)
    # decode rows far past the window, a prefill chunk straddling it, a sequence inside it
    seq_lens, q_lens = [700, 90, 40, 3], [1, 30, 1, 3]
    case = make_case(rng, seq_lens=seq_lens, q_lens=q_lens, hq=4, hkv=1, d=256, bs=16, dtype=dtype)
    want = ref.paged_attention(*case.args(), sliding_window=window).astype(np.float64)
    k, v = _poison_outside(case, window)
    got = pk.paged_attention(
        case.q, k, v, case.block_tables, case.seq_lens, case.query_start_loc, sliding_window=window
    )
    assert max_err(got, want) <= TOL[dtype] + 1e-6  # max_err also asserts every output is finite


def test_window_semantics_match_llama_cpp():
    """Query at position p sees keys p - w + 1 .. p: with w = 1 the output is the query's own value."""
    rng = np.random.default_rng(1)
    case = make_case(rng, seq_lens=[9], q_lens=[9], hq=2, hkv=1, d=64, bs=4)
    v_rows = np.stack([case.v_cache[case.block_tables[0, p // 4], 0, p % 4] for p in range(9)])  # [9, D]
    for got in (
        ref.paged_attention(*case.args(), sliding_window=1),
        pk.paged_attention(*case.args(), sliding_window=1),
    ):
        np.testing.assert_allclose(got, np.repeat(v_rows[:, None], 2, axis=1), rtol=1e-6)
    # w = 2: the query's own key and the one before it, nothing older
    got = ref.paged_attention(*case.args(), sliding_window=2)
    assert not np.allclose(got[1:], np.repeat(v_rows[1:, None], 2, axis=1))


@pytest.mark.parametrize("simd", ISAS[1:])  # none on a CPU without SIMD
def test_every_isa_matches_scalar_with_a_window(simd):
    rng = np.random.default_rng(3)
    case = make_case(rng, seq_lens=[600, 77, 5], q_lens=[1, 40, 5], hq=8, hkv=2, d=128, bs=16)
    for window in (1, 6, 64, 512):
        outs = []
        for name in ("scalar", simd):
            with forced_isa(name):
                outs.append(pk.paged_attention(*case.args(), sliding_window=window))
        np.testing.assert_allclose(outs[1], outs[0], rtol=0, atol=2e-5, err_msg=f"window {window}")


def test_a_window_covering_the_context_is_no_window(isa):
    """Contexts under the window: bit-identical to attention without one (local layers of short prompts)."""
    rng = np.random.default_rng(4)
    case = make_case(rng, seq_lens=[40, 512, 7], q_lens=[40, 1, 3], hq=4, hkv=1, d=256, bs=16, dtype="float16")
    plain = pk.paged_attention(*case.args())
    for window in (512, 513, 4096):
        np.testing.assert_array_equal(pk.paged_attention(*case.args(), sliding_window=window), plain)
