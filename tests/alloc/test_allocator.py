"""BlockAllocator behaviour, on both backends (the ``backend`` fixture)."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

import pytest

import pagedkv_rs
from pagedkv_rs.errors import DoubleFreeError, OutOfBlocksError


def ref_hash(parent: int, tokens: list[int], salt: bytes = b"", bits: int = 128) -> int:
    """Independent statement of the documented prefix hash."""
    h = hashlib.sha256(parent.to_bytes(16, "little") + struct.pack("<I", len(salt)) + salt)
    h.update(b"".join(struct.pack("<I", t) for t in tokens))
    return int.from_bytes(h.digest()[:16], "little") & ((1 << bits) - 1)


def state(a) -> tuple:
    return (a.free_order(), [a.ref_count(b) for b in range(a.num_blocks)], a.stats())


def test_rust_backend_is_built():
    # tests/conftest.py stops the session when the core is missing; this says so in the test report too.
    assert "rust" in pagedkv_rs.BACKENDS, f"pagedkv_rs._core did not import: {pagedkv_rs._backend.CORE_IMPORT_ERROR}"
    assert pagedkv_rs.BACKEND in pagedkv_rs.BACKENDS


def _import_in_subprocess(prelude: str, **env: str) -> subprocess.CompletedProcess:
    code = prelude + "\nimport pagedkv_rs as p; print(p.BACKEND, p.BlockAllocator.__module__, p.BACKENDS)"
    full = {k: v for k, v in os.environ.items() if k != "PAGEDKV_BACKEND"}
    return subprocess.run([sys.executable, "-c", code], env={**full, **env}, capture_output=True, text=True)


@pytest.mark.parametrize("value,name", [("", "rust"), ("auto", "rust"), ("rust", "rust"), (" Python ", "python")])
def test_pagedkv_backend_is_read_at_import(value, name):
    r = _import_in_subprocess("", PAGEDKV_BACKEND=value)
    assert r.returncode == 0, r.stderr
    got_name, got_module, _ = r.stdout.split(maxsplit=2)
    assert got_name == name
    assert got_module.startswith("pagedkv_rs.fallback") if name == "python" else "fallback" not in got_module


def test_pagedkv_backend_errors_name_the_problem():
    r = _import_in_subprocess("", PAGEDKV_BACKEND="gpu")
    assert r.returncode != 0 and "ValueError: unknown backend 'gpu'" in r.stderr
    # A pure-Python install (no core module): auto falls back, rust says why it cannot.
    no_core = "import sys; sys.modules['pagedkv_rs._core'] = None"
    r = _import_in_subprocess(no_core)
    assert r.returncode == 0 and r.stdout.split()[0] == "python" and "('python',)" in r.stdout, r.stderr
    r = _import_in_subprocess(no_core, PAGEDKV_BACKEND="rust")
    assert r.returncode != 0 and "compiled core pagedkv_rs._core is not built (ModuleNotFoundError" in r.stderr


def test_a_broken_core_fails_the_import_loudly():
    """An installed core that does not load (ABI, symbols) is an error, not a silent pure-Python fallback."""
    broken = (
        "import importlib.abc, sys\n"
        "class Broken(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'pagedkv_rs._core':\n"
        "            raise ImportError('undefined symbol: PyFoo')\n"
        "sys.meta_path.insert(0, Broken())"
    )
    r = _import_in_subprocess(broken)
    assert r.returncode != 0 and "ImportError: undefined symbol: PyFoo" in r.stderr


def test_backend_selection_errors():
    with pytest.raises(ValueError, match="unknown backend"):
        pagedkv_rs.backend("gpu")
    assert pagedkv_rs.backend("python").BlockAllocator is pagedkv_rs.fallback.BlockAllocator


@pytest.mark.parametrize(
    "args, kwargs, exc",
    [
        ((0, 16), {}, ValueError),
        ((-1, 16), {}, ValueError),
        ((1 << 24 + 1, 16), {}, ValueError),
        ((8, 0), {}, ValueError),
        ((8, (1 << 16) + 1), {}, ValueError),
        ((8.0, 16), {}, TypeError),
        ((True, 16), {}, TypeError),
        (("8", 16), {}, TypeError),
        ((8, 16), {"policy": "fifo"}, ValueError),
        ((8, 16), {"hash_bits": 0}, ValueError),
        ((8, 16), {"hash_bits": 129}, ValueError),
    ],
)
def test_construction_rejects_bad_sizes(backend, args, kwargs, exc):
    with pytest.raises(exc):
        backend.BlockAllocator(*args, **kwargs)


def test_properties(backend):
    a = backend.BlockAllocator(10, 4, enable_prefix_caching=False, policy="mru", hash_bits=64)
    assert (a.num_blocks, a.block_size, a.enable_prefix_caching, a.policy, a.hash_bits) == (10, 4, False, "mru", 64)
    assert (a.num_free_blocks, a.num_cached_blocks, a.num_live_blocks, a.usage) == (10, 0, 0, 0.0)


def test_lru_allocation_and_free_order(backend):
    a = backend.BlockAllocator(6, 2)
    assert a.free_order() == [0, 1, 2, 3, 4, 5]
    assert a.allocate(3) == [0, 1, 2]
    a.free([2, 0])
    assert a.free_order() == [3, 4, 5, 2, 0]
    assert a.allocate(4) == [3, 4, 5, 2]
    assert a.usage == 5 / 6
    a.check_invariants()


def test_mru_hands_out_most_recently_freed(backend):
    a = backend.BlockAllocator(6, 2, policy="mru")
    assert a.allocate(3) == [0, 1, 2]
    a.free([0, 2])
    assert a.free_order() == [2, 0, 3, 4, 5]
    assert a.allocate(2) == [2, 0]
    a.check_invariants()


def test_out_of_blocks_changes_nothing(backend):
    a = backend.BlockAllocator(4, 2)
    a.allocate(3)
    before = state(a)
    with pytest.raises(OutOfBlocksError, match="need 2 blocks, 1 free"):
        a.allocate(2)
    assert state(a) == before


def test_ref_counts_and_double_free(backend):
    a = backend.BlockAllocator(4, 2)
    (b,) = a.allocate(1)
    cached = a.allocate(1)[0]
    a.cache_block(cached, None, [1, 2])
    a.free([cached])  # ref 0 with a hash: reclaimable
    a.incref([b, cached])
    assert (a.ref_count(b), a.ref_count(cached)) == (2, 1)
    a.free([b])
    assert a.ref_count(b) == 1 and b not in a.free_order()
    before = state(a)
    with pytest.raises(DoubleFreeError):
        a.free([b, b])  # one too many: nothing may change
    assert state(a) == before
    a.free([b])
    with pytest.raises(DoubleFreeError):
        a.free([b])
    with pytest.raises(ValueError):
        a.free([4])
    with pytest.raises(ValueError):
        a.incref([3])  # free and uncached: must be allocated, not incref'd
    a.check_invariants()


def test_hash_matches_documented_function(backend):
    a = backend.BlockAllocator(4, 3)
    assert a.hash_block(None, [1, 2, 3]) == ref_hash(0, [1, 2, 3])
    h0 = a.hash_block(None, [1, 2, 3], "tenant-a")
    assert h0 == ref_hash(0, [1, 2, 3], b"tenant-a")
    assert a.hash_block(h0, [4, 5, 6]) == ref_hash(h0, [4, 5, 6])
    assert a.hash_block(None, [7], b"\x00\xff") == ref_hash(0, [7], b"\x00\xff")
    assert a.hash_block(None, [2**32 - 1]) == ref_hash(0, [2**32 - 1])
    short = backend.BlockAllocator(4, 3, hash_bits=5)
    assert short.hash_block(None, [1, 2, 3]) == ref_hash(0, [1, 2, 3], bits=5)
    with pytest.raises(ValueError):
        a.hash_block(None, [-1])
    with pytest.raises(ValueError):
        a.hash_block(None, [2**32])
    with pytest.raises(TypeError):
        a.hash_block(None, [1, 2, 3], 5)


def test_cache_lookup_and_lazy_lru_eviction(backend):
    a = backend.BlockAllocator(3, 2)
    b0, b1, b2 = a.allocate(3)
    h0 = a.cache_block(b0, None, [1, 2])
    h1 = a.cache_block(b1, h0, [3, 4])
    assert a.block_hash(b1) == h1 and a.block_hash(b2) is None
    assert a.lookup(None, [1, 2]) == b0
    assert a.lookup(h0, [3, 4]) == b1
    assert a.lookup(None, [3, 4]) is None  # right tokens, wrong parent
    assert a.lookup(None, [1, 2], "salt") is None
    a.free([b1, b0, b2])  # cached blocks stay findable while free
    assert (a.num_free_blocks, a.num_cached_blocks, a.num_live_blocks) == (1, 2, 0)
    assert a.lookup(None, [1, 2]) == b0
    a.incref([b0])  # a prefix hit takes a cached block off the free list in O(1)
    assert a.free_order() == [b1, b2]
    assert a.allocate(1) == [b1]  # the least recently freed goes first, evicting its hash
    assert a.stats()["evictions"] == 1
    assert a.stats()["block_allocations"] == 4  # 3 + 1; incref of a cached block is not one
    assert a.lookup(h0, [3, 4]) is None and a.block_hash(b1) is None
    a.check_invariants()


def test_first_registration_wins_and_caching_off(backend):
    a = backend.BlockAllocator(4, 2)
    x, y = a.allocate(2)
    hx = a.cache_block(x, None, [5, 5])
    assert a.cache_block(y, None, [5, 5]) == hx
    assert a.block_hash(y) is None and a.lookup(None, [5, 5]) == x
    off = backend.BlockAllocator(4, 2, enable_prefix_caching=False)
    (z,) = off.allocate(1)
    off.cache_block(z, None, [5, 5])
    assert off.block_hash(z) is None and off.lookup(None, [5, 5]) is None


def test_hash_collisions_are_verified(backend):
    a = backend.BlockAllocator(64, 1, hash_bits=2)  # 4 hash values: collisions are certain
    blocks = a.allocate(40)
    hashes = {}
    for t, b in enumerate(blocks):
        hashes[t] = a.cache_block(b, None, [t])
    assert len(set(hashes.values())) <= 4
    for t in range(40):
        found = a.lookup(None, [t])
        if found is not None:
            assert a.block_hash(found) == hashes[t]
            assert blocks.index(found) == t  # never another token's block
    assert sum(a.lookup(None, [t]) is not None for t in range(40)) == len(set(hashes.values()))
    a.check_invariants()


def test_cache_block_validation(backend):
    a = backend.BlockAllocator(4, 2)
    (b,) = a.allocate(1)
    with pytest.raises(ValueError):
        a.cache_block(b, None, [1])  # not a full block
    with pytest.raises(ValueError):
        a.cache_block(3, None, [1, 2])  # not live
    with pytest.raises(ValueError):
        a.cache_block(9, None, [1, 2])


def test_reset_prefix_cache(backend):
    a = backend.BlockAllocator(4, 1)
    bs = a.allocate(3)
    for t, b in enumerate(bs):
        a.cache_block(b, None, [t])
    a.free(bs[:2])
    assert a.reset_prefix_cache() == 3
    assert (a.num_free_blocks, a.num_cached_blocks, a.num_live_blocks) == (3, 0, 1)
    assert all(a.block_hash(b) is None for b in bs)
    a.check_invariants()
