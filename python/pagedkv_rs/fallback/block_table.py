"""Per-sequence block tables over a ``BlockAllocator`` (mirrors ``rust/block_table.rs``).

Invariants I2, I5, I6 of ``pagedkv_rs.fallback``; builds the kernel inputs (``prepare_batch``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional, Union

import numpy as np

from pagedkv_rs.batch import BatchInputs
from pagedkv_rs.errors import DuplicateSequenceError, OutOfBlocksError, SequenceTooLongError, UnknownSequenceError
from pagedkv_rs.fallback.allocator import (
    MAX_SEQ_ID,
    BlockAllocator,
    Event,
    Salt,
    _blocks_for,
    _check_int,
    _salt_bytes,
    _tokens,
)

__all__ = ["KVCacheManager"]


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

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Shorten a sequence to its first ``num_tokens`` tokens (speculative decoding's rollback).

        Blocks past them are released tail first; a block it alone holds that is no longer full keeps
        no prefix hash (its slots will be written again), so only full blocks of kept tokens stay registered.
        """
        with self._lock:
            seq = self._seq(seq_id)
            n = _check_int("num_tokens", num_tokens, 0, 1 << 40)
            if not 1 <= n <= len(seq.tokens):
                raise ValueError(
                    f"sequence {seq_id}: cannot truncate {len(seq.tokens)} tokens to {n} "
                    f"(need 1 <= n <= {len(seq.tokens)})"
                )
            full, keep = n // self._bs, _blocks_for(n, self._bs)
            for b in seq.blocks[full : max(len(seq.hashes), full)] + seq.blocks[keep:]:
                if self._alloc._ref[b] == 1:
                    self._alloc._drop_hash(b)
            del seq.hashes[full:]
            del seq.tokens[n:]
            seq.computed = min(seq.computed, n)
            dropped = seq.blocks[keep:]
            del seq.blocks[keep:]
            self._alloc._free(dropped[::-1])

    def reset_prefix_cache(self) -> int:
        """Forget every prefix hash; returns how many were dropped."""
        with self._lock:
            return self._alloc.reset_prefix_cache()

    def enable_events(self) -> None:
        """Start logging prefix-cache changes for ``take_events`` (off by default: no cost)."""
        self._alloc.enable_events()

    def take_events(self) -> list[Event]:
        """Changes since the last call, oldest first: ``(kind, hash, parent, token_ids, salt)`` with kind
        ``"stored"`` (a full block registered), ``"removed"`` (a cached block evicted) or ``"cleared"``."""
        return self._alloc.take_events()

    def prepare_batch(self, seq_ids: Sequence[int], num_new_tokens: Optional[Sequence[int]] = None) -> BatchInputs:
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
