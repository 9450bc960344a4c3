"""The block pool: ref counts, an O(1) free list, the prefix-hash index (mirrors ``rust/allocator.rs``).

Invariants I1, I3, I4 of ``pagedkv_rs.fallback``; the input checks shared with the block tables live here.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections.abc import Sequence
from typing import Optional, Union

from pagedkv_rs.errors import (
    DoubleFreeError,
    OutOfBlocksError,
)

__all__ = ["BlockAllocator", "MAX_NUM_BLOCKS", "MAX_BLOCK_SIZE"]

MAX_NUM_BLOCKS = 1 << 24  # block ids are int32; larger pools are a configuration mistake
MAX_BLOCK_SIZE = 1 << 16
MAX_TOKEN_ID = (1 << 32) - 1
MAX_SEQ_ID = (1 << 64) - 1
POLICIES = ("lru", "mru")

Salt = Optional[Union[str, bytes]]
Event = tuple[str, int, int, list[int], bytes]  # (kind, hash, parent, token_ids, salt)


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
        self._allocations = 0
        self._events: Optional[list[Event]] = None  # None until enable_events: one branch when off

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
            if self._events is not None:
                self._events.append(("removed", h, 0, [], b""))

    def _check_block(self, b: object) -> int:
        return _check_int("block id", b, 0, self._num_blocks - 1)

    # ------------------------------------------------------------------ public API
    def allocate(self, num_blocks: int) -> list[int]:
        """Hand out ``num_blocks`` fresh blocks (ref count 1), evicting cached ones as needed."""
        with self._lock:
            k = _check_int("num_blocks", num_blocks, 0, MAX_NUM_BLOCKS)
            if k > self._num_on_list:
                raise OutOfBlocksError(f"out of KV-cache blocks: need {k} blocks, {self._num_on_list} free")
            return self._allocate(k)

    def _allocate(self, k: int) -> list[int]:
        self._allocations += k
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
                    raise DoubleFreeError(f"block {b} freed {need[b]} time(s) but its ref count is {self._ref[b]}")
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
            if self._events is not None:
                self._events.append(("stored", h, parent, list(toks), salt))
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
            events, self._events = self._events, None  # a reset logs one "cleared", not each hash
            for b in list(self._index.values()):
                self._drop_hash(b)
            self._events = events
            if events is not None:
                events.append(("cleared", 0, 0, [], b""))
            self._num_cached = 0
            return dropped

    def enable_events(self) -> None:
        """Start logging prefix-cache changes for ``take_events`` (off by default: no cost)."""
        with self._lock:
            if self._events is None:
                self._events = []

    def take_events(self) -> list[Event]:
        """Changes since the last call, oldest first: ``(kind, hash, parent, token_ids, salt)`` with kind
        ``"stored"`` (a full block registered), ``"removed"`` (a cached block evicted) or ``"cleared"``."""
        with self._lock:
            if self._events is None:
                return []
            out, self._events = self._events, []
            return out

    def stats(self) -> dict[str, Union[int, float]]:
        """Block counts, eviction and allocation counts."""
        with self._lock:
            return {
                "num_blocks": self._num_blocks,
                "block_size": self._block_size,
                "free_blocks": self.num_free_blocks,
                "cached_blocks": self._num_cached,
                "live_blocks": self.num_live_blocks,
                "usage": self.usage,
                "evictions": self._evictions,
                "block_allocations": self._allocations,
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
