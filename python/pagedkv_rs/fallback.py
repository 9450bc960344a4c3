"""Pure-Python block allocator and block tables: the executable spec of the Rust core.

Both backends have the same names, signatures, results and exception types; the test suite
(and a Hypothesis state machine driving both side by side) holds them to it.

Model
-----
A pool of ``num_blocks`` blocks of ``block_size`` token slots. A block is *live* (ref count > 0,
held by one or more sequences), *cached* (ref count 0 but holding a prefix hash, so a later
prompt can take it back), or *free* (ref count 0, no hash). Blocks with ref count 0 sit on one
intrusive doubly linked free list; ``allocate`` takes from its head (policy ``"lru"``: the block
freed longest ago, so cached blocks are evicted in LRU order) or its tail (policy ``"mru"``:
the block freed last, warm in CPU caches; evicts the newest cached blocks first). Freeing a
sequence releases its blocks tail first, so a sequence's deepest prefix blocks go first.

Prefix caching: once a full block of a sequence has been computed, it gets the chained hash
``H(parent hash, its token ids, cache_salt if it is the first block)`` where ``H`` is SHA-256
truncated to ``hash_bits`` (128 by default) bits, little-endian. A hit is collision-safe: the
stored (parent hash, salt, token ids) of the block must equal the query's. A hit never covers
the whole prompt: at least one token is left to compute.

Invariants (tags used in assertions, debug_assert! and test names)
------------------------------------------------------------------
I1  free + cached + live == num_blocks
I2  a block's ref count == the number of sequences whose block table holds it
I3  a block is on the free list iff its ref count is 0
I4  a block holds a hash iff the prefix index maps that hash to it
I5  a sequence holds exactly ceil(num_tokens / block_size) blocks; num_computed <= num_tokens
I6  a prefix hit leaves at least one prompt token to compute
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections.abc import Sequence
from typing import Optional, Union

import numpy as np

from pagedkv_rs.batch import BatchInputs
from pagedkv_rs.errors import (
    DoubleFreeError,
    DuplicateSequenceError,
    OutOfBlocksError,
    SequenceTooLongError,
    UnknownSequenceError,
)

__all__ = ["BlockAllocator", "KVCacheManager", "MAX_NUM_BLOCKS", "MAX_BLOCK_SIZE"]

MAX_NUM_BLOCKS = 1 << 24  # block ids are int32; larger pools are a configuration mistake
MAX_BLOCK_SIZE = 1 << 16
MAX_TOKEN_ID = (1 << 32) - 1
MAX_SEQ_ID = (1 << 64) - 1
POLICIES = ("lru", "mru")

Salt = Optional[Union[str, bytes]]


def _check_int(name: str, value: object, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    v = int(value.__index__())  # type: ignore[attr-defined]
    if not lo <= v <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {v}")
    return v


def _tokens(token_ids: Sequence[int]) -> list[int]:
    if isinstance(token_ids, (str, bytes)):
        raise TypeError("token_ids must be a sequence of ints")
    toks = [_check_int("token id", t, 0, MAX_TOKEN_ID) for t in token_ids]
    return toks


def _salt_bytes(cache_salt: Salt) -> bytes:
    if cache_salt is None:
        return b""
    if isinstance(cache_salt, str):
        return cache_salt.encode("utf-8")
    if isinstance(cache_salt, bytes):
        return cache_salt
    raise TypeError(f"cache_salt must be str, bytes or None, got {type(cache_salt).__name__}")


def _blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockAllocator:
    """Physical block pool: ref counts, an O(1) free list, and the prefix-hash index."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        policy: str = "lru",
        hash_bits: int = 128,
    ) -> None:
        n = _check_int("num_blocks", num_blocks, 1, MAX_NUM_BLOCKS)
        self._block_size = _check_int("block_size", block_size, 1, MAX_BLOCK_SIZE)
        self._hash_bits = _check_int("hash_bits", hash_bits, 1, 128)
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self._num_blocks = n
        self._policy = policy
        self._caching = bool(enable_prefix_caching)
        self._mask = (1 << self._hash_bits) - 1
        self._lock = threading.RLock()
        self._ref = [0] * n
        # Free list over nodes 0..n-1 with sentinel n; "lru" takes from head, "mru" from tail,
        # and the initial order makes both hand out block 0 first.
        self._next = [0] * (n + 1)
        self._prev = [0] * (n + 1)
        order = range(n) if policy == "lru" else range(n - 1, -1, -1)
        last = n
        for b in order:
            self._next[last] = b
            self._prev[b] = last
            last = b
        self._next[last] = n
        self._prev[n] = last
        self._num_on_list = n
        self._hash: list[Optional[int]] = [None] * n
        self._key: list[Optional[tuple[int, bytes, tuple[int, ...]]]] = [None] * n
        self._index: dict[int, int] = {}
        self._num_cached = 0
        self._evictions = 0

    # ----------------------------------------------------------------- properties
    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def enable_prefix_caching(self) -> bool:
        return self._caching

    @property
    def policy(self) -> str:
        return self._policy

    @property
    def hash_bits(self) -> int:
        return self._hash_bits

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0 and no prefix hash."""
        return self._num_on_list - self._num_cached

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with ref count 0 that still hold a prefix hash (reclaimable)."""
        return self._num_cached

    @property
    def num_live_blocks(self) -> int:
        return self._num_blocks - self._num_on_list

    @property
    def num_evictions(self) -> int:
        return self._evictions

    @property
    def usage(self) -> float:
        """Fraction of blocks that are live."""
        return self.num_live_blocks / self._num_blocks

    # ------------------------------------------------------------ free list (O(1))
    def _unlink(self, b: int) -> None:
        p, nx = self._prev[b], self._next[b]
        self._next[p] = nx
        self._prev[nx] = p
        self._num_on_list -= 1

    def _push_tail(self, b: int) -> None:
        s = self._num_blocks
        last = self._prev[s]
        self._next[last] = b
        self._prev[b] = last
        self._next[b] = s
        self._prev[s] = b
        self._num_on_list += 1

    def _pop(self) -> int:
        s = self._num_blocks
        b = self._next[s] if self._policy == "lru" else self._prev[s]
        self._unlink(b)
        return b

    def _drop_hash(self, b: int) -> None:
        h = self._hash[b]
        if h is not None:
            del self._index[h]
            self._hash[b] = None
            self._key[b] = None

    def _check_block(self, b: object) -> int:
        return _check_int("block id", b, 0, self._num_blocks - 1)

    # ------------------------------------------------------------------ public API
    def allocate(self, num_blocks: int) -> list[int]:
        """Hand out ``num_blocks`` fresh blocks (ref count 1), evicting cached ones as needed."""
        with self._lock:
            k = _check_int("num_blocks", num_blocks, 0, MAX_NUM_BLOCKS)
            if k > self._num_on_list:
                raise OutOfBlocksError(
                    f"out of KV-cache blocks: need {k} blocks, {self._num_on_list} free"
                )
            return self._allocate(k)

    def _allocate(self, k: int) -> list[int]:
        out = []
        for _ in range(k):
            b = self._pop()
            if self._hash[b] is not None:
                self._drop_hash(b)
                self._num_cached -= 1
                self._evictions += 1
            self._ref[b] = 1
            out.append(b)
        return out

    def incref(self, block_ids: Sequence[int]) -> None:
        """Add a reference to each block; a cached block is taken back off the free list."""
        with self._lock:
            ids = [self._check_block(b) for b in block_ids]
            for b in ids:
                if self._ref[b] == 0 and self._hash[b] is None:
                    raise ValueError(f"block {b} is free and holds no prefix hash; allocate it instead")
            self._incref(ids)

    def _incref(self, ids: Sequence[int]) -> None:
        for b in ids:
            if self._ref[b] == 0:
                self._unlink(b)
                self._num_cached -= 1
            self._ref[b] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference per listed block; blocks reaching 0 join the free-list tail in list order."""
        with self._lock:
            ids = [self._check_block(b) for b in block_ids]
            need: dict[int, int] = {}
            for b in ids:
                need[b] = need.get(b, 0) + 1
                if need[b] > self._ref[b]:
                    raise DoubleFreeError(
                        f"block {b} freed {need[b]} time(s) but its ref count is {self._ref[b]}"
                    )
            self._free(ids)

    def _free(self, ids: Sequence[int]) -> None:
        for b in ids:
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._push_tail(b)
                if self._hash[b] is not None:
                    self._num_cached += 1

    def ref_count(self, block_id: int) -> int:
        """Current reference count of a block."""
        with self._lock:
            return self._ref[self._check_block(block_id)]

    def free_order(self) -> list[int]:
        """Blocks with ref count 0, in the order ``allocate`` would hand them out."""
        with self._lock:
            s, out = self._num_blocks, []
            step = self._next if self._policy == "lru" else self._prev
            b = step[s]
            while b != s:
                out.append(b)
                b = step[b]
            return out

    def hash_block(self, parent_hash: Optional[int], token_ids: Sequence[int], cache_salt: Salt = None) -> int:
        """Chained prefix hash of one block's tokens (SHA-256, truncated to ``hash_bits``)."""
        toks = _tokens(token_ids)
        parent = 0 if parent_hash is None else _check_int("parent_hash", parent_hash, 0, self._mask)
        return self._hash_of(parent, _salt_bytes(cache_salt), toks)

    def _hash_of(self, parent: int, salt: bytes, toks: Sequence[int]) -> int:
        h = hashlib.sha256()
        h.update(parent.to_bytes(16, "little"))
        h.update(struct.pack("<I", len(salt)))
        h.update(salt)
        h.update(struct.pack(f"<{len(toks)}I", *toks))
        return int.from_bytes(h.digest()[:16], "little") & self._mask

    def block_hash(self, block_id: int) -> Optional[int]:
        """The prefix hash a block is registered under, or None."""
        with self._lock:
            return self._hash[self._check_block(block_id)]

    def cache_block(
        self, block_id: int, parent_hash: Optional[int], token_ids: Sequence[int], cache_salt: Salt = None
    ) -> int:
        """Register a live, full block under its chained hash; returns the hash.

        The first block registered under a hash keeps it; a later block with the same hash stays
        unregistered (its hash is still returned so the caller can chain on it).
        """
        with self._lock:
            b = self._check_block(block_id)
            toks = _tokens(token_ids)
            if len(toks) != self._block_size:
                raise ValueError(f"a cached block holds {self._block_size} tokens, got {len(toks)}")
            if self._ref[b] == 0:
                raise ValueError(f"block {b} is not live")
            parent = 0 if parent_hash is None else _check_int("parent_hash", parent_hash, 0, self._mask)
            return self._cache(b, parent, _salt_bytes(cache_salt), toks)

    def _cache(self, b: int, parent: int, salt: bytes, toks: Sequence[int]) -> int:
        h = self._hash_of(parent, salt, toks)
        if self._caching and self._hash[b] is None and h not in self._index:
            self._index[h] = b
            self._hash[b] = h
            self._key[b] = (parent, salt, tuple(toks))
        return h

    def lookup(self, parent_hash: Optional[int], token_ids: Sequence[int], cache_salt: Salt = None) -> Optional[int]:
        """The block registered for exactly these (parent, salt, tokens), or None. Changes nothing."""
        with self._lock:
            toks = _tokens(token_ids)
            parent = 0 if parent_hash is None else _check_int("parent_hash", parent_hash, 0, self._mask)
            return self._lookup(parent, _salt_bytes(cache_salt), toks)[0]

    def _lookup(self, parent: int, salt: bytes, toks: Sequence[int]) -> tuple[Optional[int], int]:
        h = self._hash_of(parent, salt, toks)
        b = self._index.get(h) if self._caching else None
        if b is not None and self._key[b] != (parent, salt, tuple(toks)):
            b = None  # hash collision: same hash, different content
        return b, h

    def reset_prefix_cache(self) -> int:
        """Forget every prefix hash (cached blocks become plain free blocks); returns how many."""
        with self._lock:
            dropped = len(self._index)
            for b in list(self._index.values()):
                self._drop_hash(b)
            self._num_cached = 0
            return dropped

    def stats(self) -> dict[str, Union[int, float]]:
        """Block counts and eviction count."""
        with self._lock:
            return {
                "num_blocks": self._num_blocks,
                "block_size": self._block_size,
                "free_blocks": self.num_free_blocks,
                "cached_blocks": self._num_cached,
                "live_blocks": self.num_live_blocks,
                "usage": self.usage,
                "evictions": self._evictions,
            }

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant (I1, I3, I4)."""
        with self._lock:
            on_list = self.free_order()
            assert len(on_list) == self._num_on_list, "I3 free list length"
            assert all(self._ref[b] == 0 for b in on_list), "I3 free list holds a live block"
            assert sum(1 for r in self._ref if r == 0) == len(on_list), "I3 ref-0 block off the free list"
            cached = sum(1 for b in on_list if self._hash[b] is not None)
            assert cached == self._num_cached, "I1 cached count"
            live = sum(1 for r in self._ref if r > 0)
            assert self.num_free_blocks + cached + live == self._num_blocks, "I1"
            assert all(self._hash[b] == h for h, b in self._index.items()), "I4 index -> block"
            assert sum(1 for h in self._hash if h is not None) == len(self._index), "I4 block -> index"


class _Seq:
    __slots__ = ("tokens", "blocks", "hashes", "computed", "salt")

    def __init__(self, tokens: list[int], blocks: list[int], hashes: list[int], computed: int, salt: bytes):
        self.tokens = tokens
        self.blocks = blocks
        self.hashes = hashes  # chained hashes of the first len(hashes) full computed blocks
        self.computed = computed
        self.salt = salt


class KVCacheManager:
    """Per-sequence block tables on top of a ``BlockAllocator``."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        policy: str = "lru",
        hash_bits: int = 128,
        max_seq_len: Optional[int] = None,
    ) -> None:
        self._alloc = BlockAllocator(
            num_blocks, block_size, enable_prefix_caching=enable_prefix_caching, policy=policy, hash_bits=hash_bits
        )
        cap = self._alloc.num_blocks * self._alloc.block_size
        self._max_seq_len = cap if max_seq_len is None else _check_int("max_seq_len", max_seq_len, 1, 1 << 40)
        self._max_seq_len = min(self._max_seq_len, cap)
        self._bs = self._alloc.block_size
        self._seqs: dict[int, _Seq] = {}
        self._lock = self._alloc._lock
        self._query_tokens = 0
        self._hit_tokens = 0

    # ----------------------------------------------------------------- properties
    @property
    def num_blocks(self) -> int:
        return self._alloc.num_blocks

    @property
    def block_size(self) -> int:
        return self._bs

    @property
    def enable_prefix_caching(self) -> bool:
        return self._alloc.enable_prefix_caching

    @property
    def policy(self) -> str:
        return self._alloc.policy

    @property
    def max_seq_len(self) -> int:
        """Longest sequence accepted: ``max_seq_len`` if given, capped by the whole pool."""
        return self._max_seq_len

    @property
    def num_free_blocks(self) -> int:
        return self._alloc.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self._alloc.num_cached_blocks

    @property
    def num_live_blocks(self) -> int:
        return self._alloc.num_live_blocks

    @property
    def usage(self) -> float:
        return self._alloc.usage

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, seq_id: object) -> bool:
        if isinstance(seq_id, bool) or not hasattr(seq_id, "__index__"):
            return False
        return seq_id.__index__() in self._seqs

    # ------------------------------------------------------------------- helpers
    def _seq(self, seq_id: int) -> _Seq:
        if isinstance(seq_id, bool) or not hasattr(seq_id, "__index__"):
            raise TypeError(f"seq_id must be an int, got {type(seq_id).__name__}")
        seq = self._seqs.get(seq_id.__index__())
        if seq is None:
            raise UnknownSequenceError(f"unknown sequence id {seq_id}")
        return seq

    def _check_len(self, n: int) -> None:
        if n > self._max_seq_len:
            raise SequenceTooLongError(
                f"sequence of {n} tokens exceeds the limit of {self._max_seq_len} tokens "
                f"({self.num_blocks} blocks x {self._bs})"
            )

    def _prefix_hits(self, toks: list[int], salt: bytes) -> tuple[list[int], list[int]]:
        """Blocks (and their hashes) of the longest cached prefix, leaving >= 1 token to compute (I6)."""
        blocks: list[int] = []
        hashes: list[int] = []
        if not self._alloc.enable_prefix_caching:
            return blocks, hashes
        parent = 0
        for i in range((len(toks) - 1) // self._bs):
            b, h = self._alloc._lookup(parent, salt if i == 0 else b"", toks[i * self._bs : (i + 1) * self._bs])
            if b is None:
                break
            blocks.append(b)
            hashes.append(h)
            parent = h
        return blocks, hashes

    def _prompt_demand(self, toks: list[int], hits: list[int]) -> int:
        """Blocks a prompt takes off the free list: fresh ones plus cached hits with ref count 0."""
        fresh = _blocks_for(len(toks), self._bs) - len(hits)
        return fresh + sum(1 for b in hits if self._alloc._ref[b] == 0)

    def _append_demand(self, seq: _Seq, k: int) -> int:
        """Blocks an append of k tokens takes: new blocks plus one copy-on-write block."""
        if k == 0:
            return 0
        n = len(seq.tokens)
        cow = 1 if n % self._bs and self._alloc._ref[seq.blocks[-1]] > 1 else 0
        return cow + _blocks_for(n + k, self._bs) - len(seq.blocks)

    def _check_available(self, need: int) -> None:
        have = self._alloc._num_on_list
        if need > have:
            raise OutOfBlocksError(f"out of KV-cache blocks: need {need} blocks, {have} free")

    # ------------------------------------------------------------------ queries
    def blocks_needed(self, token_ids: Sequence[int], cache_salt: Salt = None) -> int:
        """Blocks that ``allocate`` of this prompt would take off the free list now."""
        with self._lock:
            toks = _tokens(token_ids)
            hits, _ = self._prefix_hits(toks, _salt_bytes(cache_salt))
            return self._prompt_demand(toks, hits)

    def blocks_needed_to_append(self, seq_id: int, num_new_tokens: int = 1) -> int:
        """Blocks that appending ``num_new_tokens`` to the sequence would take (copy-on-write included)."""
        with self._lock:
            k = _check_int("num_new_tokens", num_new_tokens, 0, 1 << 40)
            return self._append_demand(self._seq(seq_id), k)

    def can_allocate(self, token_ids: Sequence[int], cache_salt: Salt = None) -> bool:
        """Whether ``allocate`` of this prompt would succeed now (length limit included)."""
        with self._lock:
            toks = _tokens(token_ids)
            if not toks or len(toks) > self._max_seq_len:
                return False
            return self.blocks_needed(toks, cache_salt) <= self._alloc._num_on_list

    def can_append(self, seq_id: int, num_new_tokens: int = 1) -> bool:
        """Whether ``append`` of ``num_new_tokens`` tokens would succeed now."""
        with self._lock:
            seq = self._seq(seq_id)
            k = _check_int("num_new_tokens", num_new_tokens, 0, 1 << 40)
            if len(seq.tokens) + k > self._max_seq_len:
                return False
            return self._append_demand(seq, k) <= self._alloc._num_on_list

    def block_table(self, seq_id: int) -> list[int]:
        with self._lock:
            return list(self._seq(seq_id).blocks)

    def token_ids(self, seq_id: int) -> list[int]:
        with self._lock:
            return list(self._seq(seq_id).tokens)

    def num_tokens(self, seq_id: int) -> int:
        with self._lock:
            return len(self._seq(seq_id).tokens)

    def num_computed_tokens(self, seq_id: int) -> int:
        with self._lock:
            return self._seq(seq_id).computed

    def seq_ids(self) -> list[int]:
        """Held sequence ids, sorted."""
        with self._lock:
            return sorted(self._seqs)

    def ref_count(self, block_id: int) -> int:
        return self._alloc.ref_count(block_id)

    def block_hash(self, block_id: int) -> Optional[int]:
        return self._alloc.block_hash(block_id)

    def free_order(self) -> list[int]:
        return self._alloc.free_order()

    def stats(self) -> dict[str, Union[int, float]]:
        """Block counts, usage, prefix-cache query/hit tokens, evictions, sequences held."""
        with self._lock:
            s = self._alloc.stats()
            s["num_seqs"] = len(self._seqs)
            s["prefix_query_tokens"] = self._query_tokens
            s["prefix_hit_tokens"] = self._hit_tokens
            return s

    # ------------------------------------------------------------------ mutation
    def allocate(self, seq_id: int, token_ids: Sequence[int], cache_salt: Salt = None) -> int:
        """Admit a sequence with its prompt; returns how many prompt tokens were served from the prefix cache."""
        with self._lock:
            sid = _check_int("seq_id", seq_id, 0, MAX_SEQ_ID)
            toks = _tokens(token_ids)
            salt = _salt_bytes(cache_salt)
            if sid in self._seqs:
                raise DuplicateSequenceError(f"sequence id {sid} is already allocated")
            if not toks:
                raise ValueError("a sequence needs at least one prompt token")
            self._check_len(len(toks))
            hits, hashes = self._prefix_hits(toks, salt)
            self._check_available(self._prompt_demand(toks, hits))
            self._alloc._incref(hits)
            blocks = hits + self._alloc._allocate(_blocks_for(len(toks), self._bs) - len(hits))
            cached = len(hits) * self._bs
            self._seqs[sid] = _Seq(toks, blocks, hashes, cached, salt)
            if self._alloc.enable_prefix_caching:
                self._query_tokens += len(toks)
                self._hit_tokens += cached
            return cached

    def append(self, seq_id: int, token_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Add tokens to a sequence, growing its table; returns (src, dst) block copies to do first."""
        with self._lock:
            seq = self._seq(seq_id)
            toks = _tokens(token_ids)
            self._check_len(len(seq.tokens) + len(toks))
            self._check_available(self._append_demand(seq, len(toks)))
            return self._append(seq, toks)

    def append_batch(self, seq_ids: Sequence[int], token_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Append one token to each sequence, all or nothing; returns all (src, dst) block copies."""
        with self._lock:
            if len(seq_ids) != len(token_ids):
                raise ValueError(f"{len(seq_ids)} sequence ids but {len(token_ids)} tokens")
            seqs = [self._seq(s) for s in seq_ids]
            if len({id(s) for s in seqs}) != len(seqs):
                raise ValueError("append_batch got a sequence id more than once")
            toks = _tokens(token_ids)
            for s in seqs:
                self._check_len(len(s.tokens) + 1)
            self._check_available(sum(self._append_demand(s, 1) for s in seqs))
            pairs: list[tuple[int, int]] = []
            for s, t in zip(seqs, toks):
                pairs += self._append(s, [t])
            return pairs

    def _append(self, seq: _Seq, toks: list[int]) -> list[tuple[int, int]]:
        pairs = []
        n = len(seq.tokens)
        if toks and n % self._bs and self._alloc._ref[seq.blocks[-1]] > 1:
            src = seq.blocks[-1]
            (dst,) = self._alloc._allocate(1)
            self._alloc._free([src])
            seq.blocks[-1] = dst
            pairs.append((src, dst))
        seq.blocks += self._alloc._allocate(_blocks_for(n + len(toks), self._bs) - len(seq.blocks))
        seq.tokens += toks
        return pairs

    def fork(self, parent_id: int, child_id: int) -> None:
        """Make ``child_id`` share all of the parent's blocks (copy-on-write on append)."""
        with self._lock:
            parent = self._seq(parent_id)
            cid = _check_int("child_id", child_id, 0, MAX_SEQ_ID)
            if cid in self._seqs:
                raise DuplicateSequenceError(f"sequence id {cid} is already allocated")
            self._alloc._incref(parent.blocks)
            self._seqs[cid] = _Seq(
                list(parent.tokens), list(parent.blocks), list(parent.hashes), parent.computed, parent.salt
            )

    def free(self, seq_id: int) -> None:
        """Release a sequence's blocks, tail first."""
        with self._lock:
            seq = self._seq(seq_id)
            del self._seqs[seq_id.__index__()]
            self._alloc._free(seq.blocks[::-1])

    def reset_prefix_cache(self) -> int:
        """Forget every prefix hash; returns how many were dropped."""
        with self._lock:
            return self._alloc.reset_prefix_cache()

    def prepare_batch(
        self, seq_ids: Sequence[int], num_new_tokens: Optional[Sequence[int]] = None
    ) -> BatchInputs:
        """Build one step's kernel inputs and mark the scheduled tokens computed.

        Sequence ``seq_ids[i]`` computes its next ``num_new_tokens[i]`` tokens (default 0: just
        export the tables). Newly full, computed blocks enter the prefix cache.
        """
        with self._lock:
            seq_ids = list(seq_ids)  # iterated twice below; a one-pass iterable must not skip the checks
            seqs = [self._seq(s) for s in seq_ids]
            if len({id(s) for s in seqs}) != len(seqs):
                raise ValueError("prepare_batch got a sequence id more than once")
            if num_new_tokens is None:
                ns = [0] * len(seqs)
            else:
                if len(num_new_tokens) != len(seqs):
                    raise ValueError(f"{len(seqs)} sequence ids but {len(num_new_tokens)} token counts")
                ns = [_check_int("num_new_tokens", n, 0, 1 << 40) for n in num_new_tokens]
            for sid, s, n in zip(seq_ids, seqs, ns):
                if s.computed + n > len(s.tokens):
                    raise ValueError(
                        f"sequence {sid}: {n} new tokens after {s.computed} computed exceeds its {len(s.tokens)} tokens"
                    )
            return self._prepare(seqs, ns)

    def _prepare(self, seqs: list[_Seq], ns: list[int]) -> BatchInputs:
        bs = self._bs
        b_count = len(seqs)
        total = sum(ns)
        input_ids = np.empty(total, np.int64)
        positions = np.empty(total, np.int64)
        slots = np.empty(total, np.int64)
        qsl = np.zeros(b_count + 1, np.int32)
        seq_lens = np.empty(b_count, np.int32)
        indptr = np.zeros(b_count + 1, np.int32)
        last = np.zeros(b_count, np.int32)
        nb = [_blocks_for(s.computed + n, bs) for s, n in zip(seqs, ns)]
        width = max(nb, default=0)
        tables = np.full((b_count, width), -1, np.int32)
        indices: list[int] = []
        t = 0
        for i, (s, n) in enumerate(zip(seqs, ns)):
            start, end = s.computed, s.computed + n
            for p in range(start, end):
                input_ids[t] = s.tokens[p]
                positions[t] = p
                slots[t] = s.blocks[p // bs] * bs + p % bs
                t += 1
            qsl[i + 1] = t
            seq_lens[i] = end
            row = s.blocks[: nb[i]]
            tables[i, : nb[i]] = row
            indices += row
            indptr[i + 1] = len(indices)
            last[i] = end - (nb[i] - 1) * bs if end else 0
            s.computed = end
            self._register_full_blocks(s)
        return BatchInputs(
            input_ids=input_ids,
            positions=positions,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_tables=tables,
            indptr=indptr,
            indices=np.asarray(indices, np.int32),
            last_page_len=last,
            slot_mapping=slots,
        )

    def _register_full_blocks(self, s: _Seq) -> None:
        if not self._alloc.enable_prefix_caching:
            return
        bs = self._bs
        for j in range(len(s.hashes), s.computed // bs):
            parent = s.hashes[-1] if s.hashes else 0
            h = self._alloc._cache(s.blocks[j], parent, s.salt if j == 0 else b"", s.tokens[j * bs : (j + 1) * bs])
            s.hashes.append(h)

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant (I1-I5)."""
        with self._lock:
            self._alloc.check_invariants()
            held: dict[int, int] = {}
            for s in self._seqs.values():
                assert len(s.blocks) == _blocks_for(len(s.tokens), self._bs), "I5 blocks per sequence"
                assert s.computed <= len(s.tokens), "I5 computed <= tokens"
                for b in s.blocks:
                    held[b] = held.get(b, 0) + 1
            for b in range(self.num_blocks):
                assert self._alloc._ref[b] == held.get(b, 0), f"I2 block {b}"
