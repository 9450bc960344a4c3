"""KVCacheManager (per-sequence block tables) behaviour, on both backends."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from pagedkv_rs.errors import (
    DuplicateSequenceError,
    OutOfBlocksError,
    SequenceTooLongError,
    UnknownSequenceError,
)


def snapshot(m) -> tuple:
    seqs = m.seq_ids()
    return (
        seqs,
        [m.block_table(s) for s in seqs],
        [m.token_ids(s) for s in seqs],
        [m.num_computed_tokens(s) for s in seqs],
        m.free_order(),
        [m.ref_count(b) for b in range(m.num_blocks)],
        m.stats(),
    )


def compute_all(m, seq_ids):
    """Mark every known token of the sequences computed (one prefill step)."""
    return m.prepare_batch(seq_ids, [m.num_tokens(s) - m.num_computed_tokens(s) for s in seq_ids])


def test_I1_I2_allocate_grow_free_no_leak(backend):
    m = backend.KVCacheManager(16, 4)
    assert m.allocate(1, list(range(10))) == 0
    assert m.block_table(1) == [0, 1, 2] and m.num_tokens(1) == 10 and 1 in m and len(m) == 1
    assert m.append(1, [10, 11, 12]) == []
    assert m.block_table(1) == [0, 1, 2, 3]
    m.allocate(2, [7, 7])
    m.check_invariants()
    m.free(1)
    m.free(2)
    s = m.stats()
    assert s["free_blocks"] + s["cached_blocks"] == 16 and s["live_blocks"] == 0  # I1, no leak
    assert all(m.ref_count(b) == 0 for b in range(16))
    assert len(m) == 0 and 1 not in m
    m.check_invariants()


def test_free_releases_tail_first(backend):
    m = backend.KVCacheManager(8, 2, enable_prefix_caching=False)
    m.allocate(1, list(range(6)))  # blocks 0, 1, 2
    m.free(1)
    assert m.free_order() == [3, 4, 5, 6, 7, 2, 1, 0]


def test_prefix_hit_shares_blocks_and_lru_order(backend):
    """vLLM-style: exact hits, ref counts and the free (eviction) order after frees and hits."""
    m = backend.KVCacheManager(10, 4)
    p = list(range(100, 112))  # 3 full blocks
    assert m.allocate(1, p + [1]) == 0
    compute_all(m, [1])
    assert m.allocate(2, p + [2, 3]) == 12  # all three full blocks hit
    assert m.block_table(2)[:3] == m.block_table(1)[:3]
    assert [m.ref_count(b) for b in m.block_table(1)] == [2, 2, 2, 1]  # I2
    assert m.num_computed_tokens(2) == 12
    s = m.stats()
    assert (s["prefix_query_tokens"], s["prefix_hit_tokens"]) == (13 + 14, 12)
    m.free(1)
    m.free(2)
    # seq 1 freed tail first releases only block 3 (0-2 are still held by seq 2), then seq 2: 4, 2, 1, 0
    assert m.free_order() == [5, 6, 7, 8, 9, 3, 4, 2, 1, 0]
    assert m.num_cached_blocks == 3
    assert m.allocate(3, p + [9]) == 12  # hits on free cached blocks take them back
    assert m.block_table(3)[:3] == [0, 1, 2]
    m.check_invariants()


def test_I6_hit_never_covers_whole_prompt(backend):
    m = backend.KVCacheManager(8, 4)
    p = list(range(8))
    m.allocate(1, p)
    compute_all(m, [1])
    assert m.allocate(2, p) == 4  # one block left to compute, though both are cached
    assert m.allocate(3, p[:4]) == 0


def test_blocks_registered_only_once_computed(backend):
    m = backend.KVCacheManager(8, 4)
    p = list(range(8))
    m.allocate(1, p + [8])
    m.prepare_batch([1], [5])  # chunked prefill: only block 0 is full and computed
    assert m.block_hash(m.block_table(1)[0]) is not None
    assert m.block_hash(m.block_table(1)[1]) is None
    assert m.allocate(2, p + [9]) == 4
    m.prepare_batch([1], [4])
    assert m.allocate(3, p + [10]) == 8


def test_cache_salt_isolates_tenants(backend):
    m = backend.KVCacheManager(16, 2)
    p = [1, 2, 3, 4, 5]
    m.allocate(1, p, cache_salt="a")
    compute_all(m, [1])
    assert m.allocate(2, p, cache_salt="b") == 0
    assert m.allocate(3, p) == 0
    assert m.allocate(4, p, cache_salt=b"a") == 4


def test_prefix_caching_off(backend):
    m = backend.KVCacheManager(8, 2, enable_prefix_caching=False)
    m.allocate(1, [1, 2, 3])
    compute_all(m, [1])
    assert m.allocate(2, [1, 2, 3]) == 0
    assert m.stats()["prefix_query_tokens"] == 0 and m.num_cached_blocks == 0


def test_eviction_lru_and_counter(backend):
    m = backend.KVCacheManager(4, 1)
    for sid, t in enumerate([10, 11, 12]):  # one at a time: each evicts the oldest cached blocks
        m.allocate(sid, [t, 99])
        compute_all(m, [sid])
        m.free(sid)
    assert m.stats()["evictions"] == 2  # seq 2 reused seq 0's blocks
    assert m.stats()["block_allocations"] == 6  # every block taken off the free list, evicting or not
    assert m.free_order() == [3, 2, 0, 1] and m.num_cached_blocks == 4
    m.allocate(10, [50, 51, 52])  # 3 fresh blocks: evicts seq 1's two and seq 2's tail block
    assert m.stats()["evictions"] == 5
    m.free(10)
    assert m.allocate(11, [12, 99]) == 1  # seq 2's first block survived
    assert m.stats()["block_allocations"] == 10  # the prefix hit took a cached block back: not an allocation
    assert m.allocate(12, [11, 99]) == 0
    m.check_invariants()


def test_block_allocations_count_appends_and_copy_on_write(backend):
    m = backend.KVCacheManager(8, 2)
    m.allocate(0, [1, 2, 3])  # 2 blocks
    m.append(0, [4, 5])  # fills block 2, opens block 3
    assert m.stats()["block_allocations"] == 3
    m.fork(0, 1)  # shares all three: no allocation
    assert m.stats()["block_allocations"] == 3
    assert len(m.append(1, [6])) == 1  # the shared half-full tail is copied on write
    assert m.stats()["block_allocations"] == 4
    m.check_invariants()


def test_reset_prefix_cache(backend):
    m = backend.KVCacheManager(8, 2)
    m.allocate(1, [1, 2, 3])
    compute_all(m, [1])
    assert m.reset_prefix_cache() == 1
    assert m.allocate(2, [1, 2, 3]) == 0


def test_fork_and_copy_on_write(backend):
    m = backend.KVCacheManager(8, 4)
    m.allocate(1, list(range(6)))  # blocks [0, 1], block 1 partial
    compute_all(m, [1])
    m.fork(1, 2)
    assert m.block_table(2) == [0, 1] and m.ref_count(0) == 2 and m.ref_count(1) == 2
    assert m.num_computed_tokens(2) == 6 and m.token_ids(2) == list(range(6))
    assert m.blocks_needed_to_append(2, 1) == 1  # the copy-on-write block
    pairs = m.append(2, [42])
    assert pairs == [(1, 2)]
    assert m.block_table(2) == [0, 2] and m.ref_count(1) == 1 and m.ref_count(2) == 1
    assert m.append(1, [43]) == []  # block 1 is now the parent's alone
    m.check_invariants()


def test_fork_of_full_block_needs_no_copy(backend):
    m = backend.KVCacheManager(8, 4)
    m.allocate(1, list(range(8)))
    m.fork(1, 2)
    assert m.append(2, [1]) == [] and m.block_table(2)[:2] == m.block_table(1)
    with pytest.raises(DuplicateSequenceError):
        m.fork(1, 2)
    with pytest.raises(UnknownSequenceError):
        m.fork(7, 8)


def test_can_and_blocks_needed_match_allocation(backend):
    m = backend.KVCacheManager(6, 4)
    m.allocate(1, list(range(9)))  # 3 blocks
    compute_all(m, [1])
    m.free(1)  # 2 cached + 1 free + 3 free
    p = list(range(8)) + [77] * 13  # 21 tokens: 6 blocks, 2 of them cached hits
    assert m.blocks_needed(p) == 6 and m.can_allocate(p)
    assert m.allocate(2, p) == 8 and m.num_free_blocks + m.num_cached_blocks == 0
    assert m.can_append(2, 3) and m.blocks_needed_to_append(2, 3) == 0  # 24 tokens fill the 6 blocks
    assert not m.can_append(2, 4) and m.blocks_needed_to_append(2, 4) == 1
    m.free(2)
    assert m.can_allocate(list(range(24))) and not m.can_allocate(list(range(25)))
    assert not m.can_allocate([])


def test_can_append_tracks_capacity(backend):
    m = backend.KVCacheManager(2, 4)
    m.allocate(1, [1, 2, 3])
    assert m.can_append(1, 1) and m.blocks_needed_to_append(1, 1) == 0
    assert m.can_append(1, 5) and m.blocks_needed_to_append(1, 5) == 1
    assert not m.can_append(1, 6)


def test_never_fit_refused_at_admission(backend):
    m = backend.KVCacheManager(4, 4, max_seq_len=10)
    assert m.max_seq_len == 10
    with pytest.raises(SequenceTooLongError):
        m.allocate(1, list(range(11)))
    m2 = backend.KVCacheManager(4, 4)
    assert m2.max_seq_len == 16
    with pytest.raises(SequenceTooLongError, match="17 tokens"):
        m2.allocate(1, list(range(17)))
    m2.allocate(1, list(range(16)))
    with pytest.raises(SequenceTooLongError):
        m2.append(1, [1])


def test_failed_calls_change_nothing(backend):
    m = backend.KVCacheManager(4, 2)
    m.allocate(1, [1, 2, 3])
    m.allocate(2, [4, 5])
    m.fork(2, 3)
    before = snapshot(m)
    with pytest.raises(OutOfBlocksError, match="need 2 blocks, 1 free"):
        m.allocate(4, [1, 2, 3])
    with pytest.raises(OutOfBlocksError):
        m.append(1, [4, 5, 6, 7, 8])
    with pytest.raises(OutOfBlocksError):
        m.append_batch([1, 2, 3], [9, 9, 9])  # each fits alone, not all together
    with pytest.raises(DuplicateSequenceError):
        m.allocate(2, [1])
    with pytest.raises(ValueError):
        m.allocate(5, [])
    with pytest.raises(ValueError):
        m.allocate(5, [1, -2])
    with pytest.raises(ValueError):
        m.allocate(-1, [1])
    with pytest.raises(TypeError):
        m.allocate("x", [1])
    with pytest.raises(UnknownSequenceError):
        m.append(9, [1])
    with pytest.raises(UnknownSequenceError):
        m.free(9)
    with pytest.raises(ValueError):
        m.append_batch([1, 1], [1, 1])
    with pytest.raises(ValueError):
        m.append_batch([1], [1, 2])
    with pytest.raises(ValueError):
        m.prepare_batch([1], [4])  # only 3 tokens known
    with pytest.raises(ValueError):
        m.prepare_batch([1, 1], [1, 1])
    with pytest.raises(UnknownSequenceError):
        m.prepare_batch([1, 9], [1, 1])
    assert snapshot(m) == before
    m.free(3)
    with pytest.raises(UnknownSequenceError):
        m.free(3)  # double free of a sequence
    m.check_invariants()


def test_unknown_ids_and_types(backend):
    m = backend.KVCacheManager(4, 2)
    for bad in (-1, 2**64, 2**70):
        with pytest.raises(UnknownSequenceError):
            m.block_table(bad)
        assert bad not in m
    with pytest.raises(TypeError):
        m.block_table("1")
    assert "1" not in m and None not in m
    m.allocate(np.int64(3), np.array([1, 2, 3]))
    assert 3 in m and m.token_ids(np.int32(3)) == [1, 2, 3]


def test_prepare_batch_arrays(backend):
    bs = 4
    m = backend.KVCacheManager(32, bs, enable_prefix_caching=False)
    m.allocate(10, list(range(100, 109)))  # 9 tokens: 3 blocks
    m.allocate(11, [5])
    m.allocate(12, list(range(20)))
    compute_all(m, [11, 12])
    m.append(11, [6])
    b = m.prepare_batch([10, 11, 12], [6, 1, 0])  # chunk of a prefill, a decode, nothing
    assert b.input_ids.dtype == np.int64 and b.positions.dtype == np.int64 and b.slot_mapping.dtype == np.int64
    for arr in (b.query_start_loc, b.seq_lens, b.block_tables, b.indptr, b.indices, b.last_page_len):
        assert arr.dtype == np.int32
    assert b.input_ids.tolist() == list(range(100, 106)) + [6]
    assert b.positions.tolist() == list(range(6)) + [1]
    assert b.query_start_loc.tolist() == [0, 6, 7, 7]
    assert b.seq_lens.tolist() == [6, 2, 20]
    t10, t11, t12 = (m.block_table(s) for s in (10, 11, 12))
    assert b.block_tables.shape == (3, 5)
    assert b.block_tables.tolist() == [t10[:2] + [-1] * 3, t11[:1] + [-1] * 4, t12]
    assert b.indptr.tolist() == [0, 2, 3, 8] and b.indices.tolist() == t10[:2] + t11[:1] + t12
    assert b.last_page_len.tolist() == [2, 2, 4]
    want = [t10[p // bs] * bs + p % bs for p in range(6)] + [t11[0] * bs + 1]
    assert b.slot_mapping.tolist() == want
    assert (b.num_seqs, b.num_tokens) == (3, 7)
    assert [m.num_computed_tokens(s) for s in (10, 11, 12)] == [6, 2, 20]
    e = m.prepare_batch([])
    assert e.block_tables.shape == (0, 0) and e.query_start_loc.tolist() == [0] and e.num_tokens == 0


def test_prepare_batch_export_csr_matches_padded(backend):
    rng = np.random.default_rng(0)
    m = backend.KVCacheManager(256, 16)
    ids = list(range(20))
    for s in ids:
        m.allocate(s, rng.integers(0, 1000, int(rng.integers(1, 200))).tolist())
    compute_all(m, ids)
    b = m.prepare_batch(ids)  # export only
    assert b.num_tokens == 0
    for i, s in enumerate(ids):
        row = b.indices[b.indptr[i] : b.indptr[i + 1]].tolist()
        assert row == m.block_table(s)
        assert b.block_tables[i, : len(row)].tolist() == row and (b.block_tables[i, len(row) :] == -1).all()
        assert b.seq_lens[i] == m.num_tokens(s)
        assert b.last_page_len[i] == b.seq_lens[i] - 16 * (len(row) - 1)


def test_append_batch(backend):
    m = backend.KVCacheManager(8, 2)
    m.allocate(1, [1])
    m.allocate(2, [1, 2])
    assert m.append_batch([1, 2], [7, 8]) == []
    assert m.token_ids(1) == [1, 7] and m.token_ids(2) == [1, 2, 8]
    assert len(m.block_table(2)) == 2


def test_stats_keys(backend):
    m = backend.KVCacheManager(8, 2)
    assert set(m.stats()) == {
        "num_blocks",
        "block_size",
        "num_seqs",
        "free_blocks",
        "cached_blocks",
        "live_blocks",
        "usage",
        "evictions",
        "block_allocations",
        "prefix_query_tokens",
        "prefix_hit_tokens",
    }


def test_many_threads_share_one_manager(backend):
    m = backend.KVCacheManager(64, 4)
    errors: list[BaseException] = []

    def worker(tid: int) -> None:
        try:
            for i in range(200):
                sid = tid * 1000 + i
                try:
                    m.allocate(sid, [tid, i % 7, 1, 2, 3])
                except OutOfBlocksError:
                    continue
                try:
                    m.append(sid, [9] * (i % 5))
                except OutOfBlocksError:
                    pass
                m.prepare_batch([sid], [1])
                m.free(sid)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert m.num_live_blocks == 0 and len(m) == 0
    m.check_invariants()
