"""Smoke test of an installed pagedkv_rs wheel (run by .ci/wheel in a fresh venv, outside the checkout).

Import, the Rust allocator, one prefill through the block manager into paged_attention against the
float64 reference, and a QLinear call. Only names the `pagedkv_rs` package exports.
"""

from __future__ import annotations

import sys

import numpy as np

import pagedkv_rs as pk

assert "site-packages" in pk.__file__, f"imported {pk.__file__}, not the installed wheel"
assert pk.BACKEND == "rust", f"BACKEND is {pk.BACKEND!r}: the compiled core did not load"

# Allocator: allocate, run out, free.
alloc = pk.BlockAllocator(8, 16)
ids = alloc.allocate(3)
assert len(set(ids)) == 3 and alloc.num_free_blocks == 5, (ids, alloc.num_free_blocks)
try:
    alloc.allocate(6)
except Exception as e:  # a Python exception, not a Rust panic (PanicException is not an Exception)
    assert "6" in str(e) and "5" in str(e), e
else:
    raise AssertionError("allocate(6) with 5 free blocks did not raise")
alloc.free(ids)
assert alloc.num_free_blocks == 8

# Kernel: 10 prompt tokens through the block manager, the cache and paged_attention.
rng = np.random.default_rng(0)
t, hq, hkv, d, bs = 10, 4, 2, 64, 4
m = pk.KVCacheManager(num_blocks=8, block_size=bs)
m.allocate(seq_id=1, token_ids=list(range(t)))
batch = m.prepare_batch([1], [t])
k_cache, v_cache = pk.new_kv_cache(8, bs, hkv, d, "float16")
k, v = (rng.standard_normal((t, hkv, d), dtype=np.float32) for _ in range(2))
pk.write_kv(k_cache, v_cache, k, v, batch.slot_mapping)
q = rng.standard_normal((t, hq, d), dtype=np.float32)
args = (q, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc)
got = pk.paged_attention(*args)
want = pk.reference.paged_attention(*args)
attn_err = float(np.abs(got - want).max())
assert got.shape == (t, hq, d) and attn_err <= 3e-5, f"paged_attention max abs err {attn_err}"

# QLinear: 8-bit blocks of a float matrix, against the float64 spec of the same blocks.
w = rng.standard_normal((48, 128), dtype=np.float32)
x = rng.standard_normal((3, 128), dtype=np.float32)
ql = pk.QLinear.from_float(w)
y = ql(x)
y_ref = pk.reference.qlinear(x, *ql.unpack())
assert y.shape == (3, 48), y.shape
np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6)

print(
    f"wheel smoke ok: python {sys.version.split()[0]}, numpy {np.__version__}, BACKEND={pk.BACKEND}, "
    f"paged_attention err {attn_err:.1e}, kernel_info {pk.kernel_info()}"
)
