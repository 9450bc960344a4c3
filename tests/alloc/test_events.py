"""The pool's event log (``enable_events`` / ``take_events``): the same entries, same order, both backends."""

from __future__ import annotations

import pytest

import pagedkv_rs
from pagedkv_rs import fallback

BACKENDS = {"rust": pagedkv_rs._core, "python": fallback}


def run_allocator(mod) -> list:
    a = mod.BlockAllocator(3, 2)
    b0 = a.allocate(1)[0]
    a.cache_block(b0, None, [1, 2])
    log = [a.take_events()]  # off: nothing
    a.enable_events()
    b1 = a.allocate(1)[0]
    h1 = a.cache_block(b1, None, [3, 4], cache_salt="s")
    a.cache_block(b1, None, [3, 4], cache_salt="s")  # already registered: no second entry
    b2 = a.allocate(1)[0]
    a.cache_block(b2, h1, [5, 6])
    a.free([b2, b1, b0])
    a.allocate(2)  # LRU: evicts b2 then b1
    log.append(a.take_events())
    a.reset_prefix_cache()
    log.append(a.take_events())
    log.append(a.take_events())
    return log


def run_manager(mod) -> list:
    m = mod.KVCacheManager(8, 2)
    m.enable_events()
    m.allocate(1, [1, 2, 3, 4, 5], cache_salt=b"t")
    m.prepare_batch([1], [5])
    m.free(1)
    return m.take_events()


@pytest.mark.parametrize("backend", BACKENDS)
def test_log_order_and_content(backend):
    mod = BACKENDS[backend]
    off, changes, reset, empty = run_allocator(mod)
    assert off == [] and empty == []
    h1 = mod.BlockAllocator(3, 2).hash_block(None, [3, 4], "s")
    h2 = mod.BlockAllocator(3, 2).hash_block(h1, [5, 6])
    assert changes == [
        ("stored", h1, 0, [3, 4], b"s"),
        ("stored", h2, h1, [5, 6], b""),
        ("removed", h2, 0, [], b""),
        ("removed", h1, 0, [], b""),
    ]
    assert reset == [("cleared", 0, 0, [], b"")]


def test_backends_log_the_same():
    assert run_allocator(pagedkv_rs._core) == run_allocator(fallback)
    assert run_manager(pagedkv_rs._core) == run_manager(fallback)
    kinds = [e[0] for e in run_manager(fallback)]
    assert kinds == ["stored", "stored"]
