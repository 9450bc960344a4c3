"""write_blocks (whole blocks from a KV tier into the caches) against the numpy reference, on every ISA."""

from __future__ import annotations

import numpy as np
import pytest

import pagedkv_rs as pk
from pagedkv_rs import kernels
from pagedkv_rs.kernels import reference as ref

DTYPES = ["float32", "float16", "bfloat16"]


def poisoned(dtype, nb=6, hkv=2, bs=4, d=8):
    k, v = pk.new_kv_cache(nb, bs, hkv, d, dtype)
    k[...] = np.nan  # unused slots hold NaN: a write that strays into them shows
    v[...] = np.nan
    return k, v


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_blocks_matches_reference(isa, dtype):
    rng = np.random.default_rng(3)
    k1, v1 = poisoned(dtype)
    k2, v2 = k1.copy(), v1.copy()
    ids = np.array([4, 0, 2], np.int64)
    kb = rng.standard_normal((3, 2, 4, 8)).astype(k1.dtype)
    vb = rng.standard_normal((3, 2, 4, 8)).astype(k1.dtype)
    pk.write_blocks(k1, v1, ids, kb, vb)
    ref.write_blocks(k2, v2, ids, kb, vb)
    assert k1.tobytes() == k2.tobytes() and v1.tobytes() == v2.tobytes()
    assert k1[ids].tobytes() == kb.tobytes() and v1[ids].tobytes() == vb.tobytes()
    untouched = [1, 3, 5]
    assert np.isnan(k1[untouched].astype(np.float32)).all() and np.isnan(v1[untouched].astype(np.float32)).all()
    # a sequence of ints, read-only sources, repeated ids (applied in order), none at all
    kb.flags.writeable = vb.flags.writeable = False
    pk.write_blocks(k1, v1, [1, 1], kb[:2], vb[:2])
    ref.write_blocks(k2, v2, [1, 1], kb[:2], vb[:2])
    assert k1.tobytes() == k2.tobytes() and k1[1].tobytes() == kb[1].tobytes()
    pk.write_blocks(k1, v1, [], kb[:0], vb[:0])
    kernels.write_blocks(k1, v1, [5], kb[2:], vb[2:])  # the public path
    assert v1[5].tobytes() == vb[2].tobytes()


@pytest.mark.parametrize("impl", ["rust", "reference"])
def test_write_blocks_rejects_bad_input(impl):
    f = pk.write_blocks if impl == "rust" else ref.write_blocks
    k, v = poisoned("float16")
    before = (k.tobytes(), v.tobytes())
    good = np.zeros((2, 2, 4, 8), np.float16)
    with pytest.raises(ValueError, match="block"):
        f(k, v, [0, 6], good, good)
    with pytest.raises(ValueError, match="block"):
        f(k, v, [-1, 0], good, good)
    with pytest.raises(TypeError, match="float16|caches"):
        f(k, v, [0, 1], good.astype(np.float32), good)
    with pytest.raises(ValueError, match=r"\[2, 2, 4, 8\]"):
        f(k, v, [0, 1], np.zeros((2, 2, 4, 4), np.float16), good)
    with pytest.raises(ValueError, match=r"\[1, 2, 4, 8\]"):
        f(k, v, [0], good, good)
    with pytest.raises(ValueError, match="share memory"):
        f(k, v, [0, 1], good, v[2:4])
    k.flags.writeable = False
    with pytest.raises(ValueError, match="writeable"):
        f(k, v, [0, 1], good, good)
    k.flags.writeable = True
    assert (k.tobytes(), v.tobytes()) == before


def test_write_blocks_rust_only_checks():
    k, v = poisoned("float32")
    good = np.zeros((1, 2, 4, 8), np.float32)
    with pytest.raises(ValueError, match="C-contiguous"):
        pk.write_blocks(k, v, [0], np.zeros((1, 2, 4, 16), np.float32)[..., ::2], good)
    with pytest.raises(TypeError, match="int64"):
        pk.write_blocks(k, v, np.array([0], np.int32), good, good)
    with pytest.raises(TypeError, match="sequence of ints"):
        pk.write_blocks(k, v, "0", good, good)
