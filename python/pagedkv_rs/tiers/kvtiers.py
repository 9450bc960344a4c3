"""``KVTiers``: the engine's view of its tiers — one batched lookup at admission, background write-through.

Lookup: the blocks after the pool's own prefix hit are asked of each tier in order (fast to slow),
each tier from where the previous one's run of hits ended, within one deadline; a record that does
not verify ends the run (a miss, counted). Hits from a slower tier are also queued for the faster
ones. Store: each tier has a writer thread with a bounded queue (blocks); a full queue drops the
block and counts it (``store_drops``), so a slow tier never slows a step. Records are encoded on the
writer threads. A write that fails (a full disk, a server gone) counts the blocks it did write as
stored and the rest as ``store_failures``; the first failure of a run is logged (once, until a write
succeeds again) and the engine goes on serving.

Listener (``listen``; the KV-events publisher): told each batch of blocks a tier stored, after the write,
with the tier's medium (``DISK``, ``REDIS``), the blocks a tier removed by itself (disk: LRU evictions,
reported after the write that caused them; any tier: a record that failed verification), and the blocks a
lookup found in a tier. It runs on the writer and I/O threads and must not block.

Deadlines: every tier is told the lookup deadline (``Tier.use_deadline``) and bounds each blocking call
by it (Redis: socket timeouts). The runner gives each load its deadline and stops waiting at it
(``note_abandoned``: counted as ``timeouts``); a lookup that ends later is dropped (``note_late``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from pagedkv_rs import kernels
from pagedkv_rs.tiers.base import (
    BlockLayout,
    RecordError,
    Tier,
    TierError,
    TierMetrics,
    decode_record,
    encode_record,
    record_sizes,
)

__all__ = ["KVTiers", "BlockEntry"]

log = logging.getLogger("pagedkv_rs.tiers")

WRITE_BATCH = 16  # records per put_many


@dataclass(frozen=True)
class BlockEntry:
    """One computed block to store: its chained hash, parent hash, salt digest, tokens and K/V payload."""

    block_hash: bytes
    parent: bytes
    salt: bytes
    tokens: tuple[int, ...]
    payload: np.ndarray  # [num_layers, 2, num_kv_heads, block_size, head_dim], the cache dtype


class _Writer:
    """One tier's background writer: a bounded queue of blocks drained by a daemon thread."""

    def __init__(self, owner: KVTiers, tier: Tier, metrics: TierMetrics, capacity: int) -> None:
        self.tier, self.metrics, self.capacity, self._owner = tier, metrics, capacity, owner
        self._q: deque[BlockEntry] = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self._failing = False  # the last write failed (logged once per run of failures)
        self._thread = threading.Thread(target=self._run, name=f"pagedkv-tier-{tier.kind}", daemon=True)
        self._thread.start()

    def room(self) -> int:
        with self._cond:
            return self.capacity - len(self._q)

    def offer(self, entries: Sequence[BlockEntry]) -> None:
        with self._cond:
            take = max(0, min(len(entries), self.capacity - len(self._q)))
            self._q.extend(entries[:take])
            if take:
                self._cond.notify_all()
        if take < len(entries):
            self.metrics.add(store_drops=len(entries) - take)

    def flush(self, timeout: Optional[float] = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: not self._q and not self._busy, timeout)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        fp = self._owner.fingerprint
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._q or self._closed)
                if not self._q:
                    return
                batch = [self._q.popleft() for _ in range(min(WRITE_BATCH, len(self._q)))]
                self._busy = True
            try:
                items = [
                    (
                        self._owner.key(e.block_hash),
                        encode_record(e.block_hash, e.parent, e.salt, fp, e.tokens, e.payload, self.tier.secret),
                    )
                    for e in batch
                ]
                written = self.tier.put_many(items)
                self.metrics.add(stored_blocks=len(batch), bytes_written=written)
                self._owner.notify_stored(self.tier, batch)
                if self._failing:
                    self._failing = False
                    log.warning("KV tier %s: stores succeed again", self.tier.name)
            except Exception as e:  # TierError, or a bug: never kill the writer; count what was written
                stored = min(len(batch), getattr(e, "stored", 0))
                self._owner.notify_stored(self.tier, batch[:stored])
                self.metrics.add(
                    errors=1,
                    stored_blocks=stored,
                    bytes_written=getattr(e, "written", 0),
                    store_failures=len(batch) - stored,
                )
                if not self._failing:
                    self._failing = True
                    log.warning(
                        "KV tier %s: a store failed (%s); blocks are not stored until writes succeed again, "
                        "requests are served as before",
                        self.tier.name,
                        e,
                    )
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()


class KVTiers:
    """Tiers in lookup order over one engine's block layout and model fingerprint."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        layout: BlockLayout,
        fingerprint: bytes,
        *,
        deadline: float = 0.5,
        queue_blocks: int = 512,
    ) -> None:
        if not tiers:
            raise ValueError("KVTiers needs at least one tier")
        if not deadline > 0:
            raise ValueError(f"the tier lookup deadline must be > 0 seconds, got {deadline!r}")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"a KV tier is listed twice: {names}")
        self.tiers = list(tiers)
        self.layout = layout
        self.fingerprint = fingerprint
        self.deadline = float(deadline)
        self._ns = fingerprint.hex()
        for t in self.tiers:
            t.expect_record_sizes(record_sizes(layout))
            t.use_deadline(self.deadline)
        self.metrics = [TierMetrics() for _ in self.tiers]
        self._writers = [_Writer(self, t, m, queue_blocks) for t, m in zip(self.tiers, self.metrics)]
        self._stage: Optional[np.ndarray] = None  # reused staging buffer for loads
        self._asking = 0  # index of the tier the current lookup asks (for the deadline counters)
        self._listener: Any = None

    def key(self, block_hash: bytes) -> str:
        """The store key of a block: model fingerprint, then chained hash (hex)."""
        return f"{self._ns}-{block_hash.hex()}"

    # ------------------------------------------------------------------ listener
    def listen(self, listener: Any) -> None:
        """Tell ``listener`` what the tiers store, remove and find: ``tier_stored(medium, entries)``,
        ``tier_removed(medium, block_hashes)``, ``tier_found(medium, token_ids)`` (see the module docstring)."""
        self._listener = listener
        for t in self.tiers:
            t.on_removed = lambda keys, t=t: self._notify_removed(t, keys)

    def notify_stored(self, tier: Tier, entries: Sequence[BlockEntry]) -> None:
        """Tell the listener ``tier`` holds these blocks' records now (called by the writers)."""
        if self._listener is not None and entries:
            try:
                self._listener.tier_stored(tier.medium, list(entries))
            except Exception:  # a listener's failure never fails a store
                log.exception("KV tiers: the listener failed on a store")

    def _notify_removed(self, tier: Tier, keys: Sequence[str]) -> None:
        ns = self._ns + "-"
        hashes = []
        for k in keys:
            try:
                if k.startswith(ns):  # other models' records (same directory or Redis) are not ours to announce
                    hashes.append(bytes.fromhex(k[len(ns) :]))
            except ValueError:
                continue
        if self._listener is not None and hashes:
            try:
                self._listener.tier_removed(tier.medium, hashes)
            except Exception:
                log.exception("KV tiers: the listener failed on a removal")

    # ------------------------------------------------------------------ lookup
    def lookup(
        self,
        hashes: Sequence[bytes],
        parent: bytes,
        tokens: Sequence[int],
        salt: bytes,
        deadline: Optional[float] = None,
    ) -> list[memoryview]:
        """Payloads of the longest run of verified blocks for ``hashes`` (``tokens``: theirs, concatenated),
        asked until ``deadline`` (``time.monotonic()``; default: ``self.deadline`` seconds from now)."""
        bs, plen = self.layout.block_size, self.layout.nbytes
        if deadline is None:
            deadline = time.monotonic() + self.deadline
        got: list[memoryview] = []
        for ti, (tier, m) in enumerate(zip(self.tiers, self.metrics)):
            i = len(got)
            if i >= len(hashes) or time.monotonic() > deadline:
                break
            self._asking = ti
            keys = [self.key(h) for h in hashes[i:]]
            t0 = time.monotonic()
            try:
                recs = tier.get_many(keys, deadline)
            except TierError:
                m.add(lookups=1, errors=1, miss_blocks=len(keys))
                continue
            hits: list[memoryview] = []
            nread = 0
            bad = 0
            for j, rec in enumerate(recs):
                if rec is None:
                    break
                b = i + j
                try:
                    p = decode_record(
                        rec,
                        block_hash=hashes[b],
                        parent=hashes[b - 1] if b else parent,
                        salt=salt,
                        fingerprint=self.fingerprint,
                        tokens=tokens[b * bs : (b + 1) * bs],
                        payload_len=plen,
                        secret=tier.secret,
                    )
                except RecordError:
                    bad = 1
                    discard = getattr(tier, "discard", None)
                    if discard is not None:
                        discard(keys[j])
                    break
                hits.append(p)
                nread += len(rec)
            m.observe(time.monotonic() - t0)
            late = len(recs) < len(keys) and (not recs or recs[-1] is not None) and not bad
            m.add(
                lookups=1,
                hit_blocks=len(hits),
                hit_tokens=len(hits) * bs,
                miss_blocks=len(keys) - len(hits),
                verify_failures=bad,
                bytes_read=nread,
                timeouts=int(late),
            )
            if hits and self._listener is not None:
                try:
                    self._listener.tier_found(tier.medium, tokens[i * bs : (i + len(hits)) * bs])
                except Exception:
                    log.exception("KV tiers: the listener failed on a lookup")
            if hits and ti > 0:  # promote to the faster tiers
                entries = [self._entry(hashes, parent, tokens, salt, i + j, p) for j, p in enumerate(hits)]
                for w in self._writers[:ti]:
                    w.offer(entries)
            got += hits
        return got

    def note_abandoned(self, loads: int) -> None:
        """``loads`` lookups were given up at their deadline (counted as timeouts of the tier being asked)."""
        self.metrics[self._asking].add(timeouts=loads)

    def note_late(self) -> None:
        """A lookup ended after its request stopped waiting: its hits are dropped, never loaded."""
        self.metrics[self._asking].add(late_results=1)

    def _entry(
        self, hashes: Sequence[bytes], parent: bytes, tokens: Sequence[int], salt: bytes, b: int, payload: Any
    ) -> BlockEntry:
        bs = self.layout.block_size
        arr = np.frombuffer(payload, np.uint8).view(self.layout.dtype).reshape(self.layout.shape)
        return BlockEntry(hashes[b], hashes[b - 1] if b else parent, salt, tuple(tokens[b * bs : (b + 1) * bs]), arr)

    # ------------------------------------------------------------- cache I/O
    def load_into(
        self, kv_caches: list[tuple[np.ndarray, np.ndarray]], block_ids: Sequence[int], payloads: Sequence[Any]
    ) -> None:
        """Write verified payloads into ``block_ids`` of every layer's caches (``kernels.write_blocks``)."""
        n = len(block_ids)
        lay = self.layout
        shape = (lay.num_layers, 2, n, lay.num_kv_heads, lay.block_size, lay.head_dim)
        st = self._stage
        if st is None or st.shape[2] < n:
            st = self._stage = np.empty(shape, lay.dtype)
        for j, p in enumerate(payloads):
            st[:, :, j] = np.frombuffer(p, np.uint8).view(lay.dtype).reshape(lay.shape)
        ids = np.asarray(block_ids, np.int64)
        for layer, (k, v) in enumerate(kv_caches):
            kernels.write_blocks(k, v, ids, st[layer, 0, :n], st[layer, 1, :n])

    def has_room(self) -> bool:
        return any(w.room() > 0 for w in self._writers)

    def store(
        self,
        kv_caches: list[tuple[np.ndarray, np.ndarray]],
        block_ids: Sequence[int],
        hashes: Sequence[bytes],
        parents: Sequence[bytes],
        tokens: Sequence[Sequence[int]],
        salt: bytes,
    ) -> None:
        """Copy blocks out of the caches now and queue them for every tier (dropped, counted, if full)."""
        n = len(block_ids)
        if not n:
            return
        if not self.has_room():
            for m in self.metrics:
                m.add(store_drops=n)
            return
        lay = self.layout
        buf = np.empty((n, *lay.shape), lay.dtype)
        ids = np.asarray(block_ids, np.int64)
        for layer, (k, v) in enumerate(kv_caches):
            buf[:, layer, 0] = k[ids]
            buf[:, layer, 1] = v[ids]
        entries = [BlockEntry(hashes[j], parents[j], salt, tuple(tokens[j]), buf[j]) for j in range(n)]
        for w in self._writers:
            w.offer(entries)

    # ------------------------------------------------------------- lifecycle
    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until every queued block is written (or ``timeout`` seconds pass); True if all were."""
        end = None if timeout is None else time.monotonic() + timeout
        ok = True
        for w in self._writers:
            left = None if end is None else max(0.0, end - time.monotonic())
            ok = w.flush(left) and ok
        return ok

    def close(self) -> None:
        """Flush, stop the writers and close the tiers."""
        for w in self._writers:
            w.close()
        for t in self.tiers:
            t.close()

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per tier (by name): lookups, hit/miss blocks, hit tokens, verify failures, errors, timeouts,
        stored blocks, store drops, bytes read/written, the lookup latency histogram."""
        return {t.name: m.snapshot() for t, m in zip(self.tiers, self.metrics)}
