"""KV-cache events in vLLM's wire format, for routers that track which replica holds which prefix.

``pagedkv serve --kv-events-endpoint tcp://*:5557`` publishes, over a ZMQ PUB socket, msgpack
``KVEventBatch`` messages exactly as vLLM's ``vllm/distributed/kv_events.py`` defines them (array-like
msgspec structs: field order is the wire format), each a multipart ``(topic, seq, payload)`` with an
8-byte big-endian sequence number; ``--kv-events-replay-endpoint`` adds vLLM's ROUTER socket from which
a subscriber re-reads the batches it missed (request: the first wanted seq, 8 bytes big-endian; replies
``(seq, payload)``, then ``(-1, b"")``).

Events come from the block pool's own log (``KVCacheManager.enable_events`` / ``take_events``):
``BlockStored`` when a full block is registered in the prefix cache (after a computation or a tier
load; medium ``CPU``, or the tier's when it was loaded), ``BlockRemoved`` when a cached free block is
reused, ``AllBlocksCleared`` on a prefix-cache reset. With ``kv_tiers``, the tiers' writes and removals
too: ``BlockStored`` with the tier's medium (``DISK``, ``REDIS``) once a block's record is written,
``BlockRemoved`` with it when the tier removes one by itself and says so (disk: LRU evictions; Redis:
a record that failed verification; a Redis TTL or ``maxmemory`` eviction is not seen, so not announced).
The engine step only drains that log into a bounded queue (``collect``); hashing, encoding and sending
happen on the publisher thread, and a full queue drops the batch and counts it. Tier notes that arrive
while the engine is idle are published by the thread itself after ``TIER_IDLE_S``.

Block hashes travel as ints: the low 64 bits of the block's hash, as vLLM sends them by default.
``hash_mode="native"`` sends our own chained hash (SHA-256 over parent, salt and tokens);
``hash_mode="vllm"`` sends vLLM's recipe, which a consumer recomputes from the token ids alone:
``sha256(cbor((parent, tuple(token_ids), extra_keys)))`` with ``parent`` = the previous block's 32-byte
digest or, for the first block, ``NONE_HASH`` = ``sha256(cbor(PYTHONHASHSEED))`` (random when the
variable is unset), and ``extra_keys`` = ``(cache_salt,)`` on the first block of a salted prompt, else
None. The pool itself stays keyed by our hash; the vLLM digests are computed for the events only.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from itertools import count
from typing import Any, Optional, Union

import msgspec
import zmq

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEventBatch",
    "KVEventPublisher",
    "HASH_MODES",
    "none_hash",
    "vllm_block_hash",
]

log = logging.getLogger("pagedkv_rs.kv_events")

HASH_MODES = ("native", "vllm")
MEDIUM_POOL = "CPU"  # the block pool lives in host memory (vLLM's GPU pool says "GPU")
TIER_IDLE_S = 0.2  # tier notes no engine step collected within this long are published by the thread
TIER_WAIT_S = 2.0  # how long a tier block waits for its vLLM hash (its pool event) before it is counted unmapped
LOW64 = (1 << 64) - 1
END_SEQ = (-1).to_bytes(8, "big", signed=True)


# --------------------------------------------------------------------------- wire types (vLLM's field order)
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """Base of the three events; the tag (the class name) is the first array element."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: Optional[str]


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


# --------------------------------------------------------------------------- vLLM's block-hash recipe
def _cbor_head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    for extra, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * size):
            return bytes([major << 5 | extra]) + n.to_bytes(size, "big")
    raise ValueError(f"CBOR integer out of range: {n}")


def _cbor(obj: Any) -> bytes:
    """Canonical CBOR of the few types a block key holds: None, non-negative ints, bytes, str, tuples."""
    if obj is None:
        return b"\xf6"
    if isinstance(obj, int) and not isinstance(obj, bool):
        return _cbor_head(0, obj) if obj >= 0 else _cbor_head(1, -1 - obj)
    if isinstance(obj, bytes):
        return _cbor_head(2, len(obj)) + obj
    if isinstance(obj, str):
        b = obj.encode("utf-8")
        return _cbor_head(3, len(b)) + b
    if isinstance(obj, (tuple, list)):
        return _cbor_head(4, len(obj)) + b"".join(_cbor(x) for x in obj)
    raise TypeError(f"no CBOR encoding here for {type(obj).__name__}")


def none_hash(seed: Optional[str] = None) -> bytes:
    """vLLM's ``NONE_HASH`` for sha256_cbor: the hash of the ``PYTHONHASHSEED`` string, random when unset."""
    seed = os.environ.get("PYTHONHASHSEED") if seed is None else seed
    return os.urandom(32) if seed is None else hashlib.sha256(_cbor(seed)).digest()


def vllm_block_hash(parent: bytes, token_ids: Sequence[int], extra_keys: Optional[tuple[Any, ...]]) -> bytes:
    """One block's digest by vLLM's ``hash_block_tokens`` with ``sha256_cbor``."""
    return hashlib.sha256(_cbor((parent, tuple(token_ids), extra_keys))).digest()


def _salt_key(salt: bytes) -> Union[str, bytes]:
    """The request's ``cache_salt`` as vLLM sees it (a str); our pool keeps its UTF-8 bytes."""
    try:
        return salt.decode("utf-8")
    except UnicodeDecodeError:
        return salt


# --------------------------------------------------------------------------- the publisher
class KVEventPublisher:
    """Drains a KV manager's event log on each step; a thread hashes, encodes and publishes over ZMQ.

    ``endpoint``: PUB address (``tcp://*:5557`` binds; an address without ``*`` connects, as in vLLM).
    ``replay_endpoint``: optional ROUTER address for replays of the last ``buffer_steps`` batches.
    ``max_queue``: batches waiting for the thread past which new ones are dropped (and counted).
    ``kv_tiers``: the engine's ``KVTiers``, whose writes and removals are announced with each tier's medium;
    ``tier_medium``: the medium of a tier load when the tier is not known (a load noted without a lookup).
    """

    def __init__(
        self,
        kv_manager: Any,
        *,
        endpoint: str,
        topic: str = "",
        replay_endpoint: Optional[str] = None,
        hash_mode: str = "native",
        buffer_steps: int = 10_000,
        max_queue: int = 10_000,
        hwm: int = 100_000,
        tier_medium: str = "KV_TIER",
        kv_tiers: Any = None,
    ) -> None:
        if hash_mode not in HASH_MODES:
            raise ValueError(f"hash_mode must be one of {HASH_MODES}, got {hash_mode!r}")
        if not isinstance(endpoint, str) or "://" not in endpoint:
            raise ValueError(f"a KV-events endpoint looks like tcp://*:5557, got {endpoint!r}")
        self._kv = kv_manager
        self.block_size = int(kv_manager.block_size)
        self.hash_mode = hash_mode
        self.tier_medium = tier_medium
        self._topic = topic.encode("utf-8")
        self._queue: queue.Queue[Optional[tuple[float, list[Any], list[Any], list[Any]]]] = queue.Queue(max_queue)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = count()
        self._none_hash = none_hash() if hash_mode == "vllm" else b""
        if hash_mode == "vllm" and os.environ.get("PYTHONHASHSEED") is None:
            log.warning(
                "--prefix-hash vllm without PYTHONHASHSEED: the first block's parent (NONE_HASH) is random, so a "
                "consumer cannot recompute these hashes; set PYTHONHASHSEED as the consumer's hash seed"
            )
        # our hash -> vLLM digest: every registered block's, and (bounded) those of recently removed ones, since a
        # sequence can register a child whose parent's hash left the index meanwhile
        self._live: dict[int, bytes] = {}
        self._gone: OrderedDict[int, bytes] = OrderedDict()
        self._gone_cap = 2 * int(kv_manager.num_blocks) + 1024
        # token tuples tier loads brought -> the tier's medium (2 windows: a load registers in this batch or the next)
        self._loaded: list[dict[tuple[int, ...], str]] = [{}, {}]
        self._loaded_lock = threading.Lock()  # guards the notes below, written by the I/O and tier writer threads
        self._loaded_new: list[tuple[tuple[int, ...], str]] = []
        self._found: OrderedDict[tuple[int, ...], str] = OrderedDict()  # blocks a lookup found -> that tier's medium
        self._tier_new: list[tuple[str, str, Any]] = []  # ("stored", medium, entries) / ("removed", medium, hashes)
        self._tier_since = 0.0  # when the oldest uncollected tier note arrived
        self._tier_retry: list[tuple[float, str, str, Any]] = []  # (give up at, kind, medium, block): hash unknown
        self.stats = {"batches": 0, "events": 0, "dropped_batches": 0, "unmapped_blocks": 0, "replays": 0}
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: Optional[zmq.Socket] = None
        try:
            self._pub.set_hwm(hwm)
            if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"KV events: cannot open {endpoint!r} / {replay_endpoint!r}: {e}") from None
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = None if self._replay is None else self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        kv_manager.enable_events()
        if kv_tiers is not None:
            kv_tiers.listen(self)
        self._running = True
        self._thread = threading.Thread(target=self._run, name="pagedkv-kv-events", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ engine side (cheap, never blocks)
    def collect(self) -> None:
        """Move the pool's logged changes to the publisher thread; a full queue drops them (counted)."""
        events = self._kv.take_events()
        if not events and not self._loaded_new and not self._tier_new:
            return
        with self._loaded_lock:
            loaded, self._loaded_new = self._loaded_new, []
            tier, self._tier_new = self._tier_new, []
        self._enqueue(events, loaded, tier)

    def _enqueue(self, events: list[Any], loaded: list[Any], tier: list[Any]) -> None:
        try:
            self._queue.put_nowait((time.time(), events, loaded, tier))
        except queue.Full:
            self.stats["dropped_batches"] += 1

    def _blocks(self, token_ids: Sequence[int]) -> list[tuple[int, ...]]:
        bs = self.block_size
        return [tuple(token_ids[i : i + bs]) for i in range(0, len(token_ids) - bs + 1, bs)]

    def note_loaded(self, token_ids: Sequence[int]) -> None:
        """A tier load brought these blocks' tokens (called on the tier I/O thread): their BlockStored
        events carry the medium of the tier the lookup found them in."""
        with self._loaded_lock:
            self._loaded_new += [(b, self._found.pop(b, self.tier_medium)) for b in self._blocks(token_ids)]

    # ------------------------------------------------------------------ KVTiers listener (I/O and writer threads)
    def tier_found(self, medium: str, token_ids: Sequence[int]) -> None:
        """A lookup found these blocks in the tier ``medium`` (they may still be dropped at the deadline)."""
        with self._loaded_lock:
            for b in self._blocks(token_ids):
                self._found[b] = medium
                self._found.move_to_end(b)
            while len(self._found) > self._gone_cap:
                self._found.popitem(last=False)

    def tier_stored(self, medium: str, entries: Sequence[Any]) -> None:
        """The tier ``medium`` holds these blocks' records now (``KVTiers`` ``BlockEntry`` objects; their K/V
        payloads are not kept)."""
        self._note_tier(("stored", medium, [(e.block_hash, e.parent, e.salt, e.tokens) for e in entries]))

    def tier_removed(self, medium: str, block_hashes: Sequence[bytes]) -> None:
        """The tier ``medium`` removed the records of these blocks (16-byte chained hashes)."""
        self._note_tier(("removed", medium, list(block_hashes)))

    def _note_tier(self, note: tuple[str, str, Any]) -> None:
        with self._loaded_lock:
            if not self._tier_new:
                self._tier_since = time.monotonic()
            self._tier_new.append(note)

    # ------------------------------------------------------------------ publisher thread
    def _run(self) -> None:
        enc = msgspec.msgpack.Encoder()
        while True:
            if self._replay is not None:
                try:
                    while self._replay.poll(0):
                        self._serve_replay()
                except Exception:
                    log.exception("KV events: replay request failed")
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                if not self._running:
                    break
                self._flush_idle_tier_notes()
                continue
            if item is None:
                break
            try:
                ts, raw, loaded, tier = item
                # an item of tier notes alone must not age the loads' windows
                events = (self._convert(raw, loaded) if raw or loaded else []) + self._convert_tier(tier)
                if not events:
                    continue
                batch = KVEventBatch(ts=ts, events=events)
                payload = enc.encode(batch)
                seq = next(self._seq)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                self.stats["batches"] += 1
                self.stats["events"] += len(batch.events)
            except Exception:
                log.exception("KV events: publishing a batch failed")

    def _flush_idle_tier_notes(self) -> None:
        """Tier notes no engine step collected (the engine is idle): a batch of their own. Blocks still
        waiting for their vLLM hash are retried with them."""
        with self._loaded_lock:
            due = bool(self._tier_new) and time.monotonic() - self._tier_since >= TIER_IDLE_S
            tier, self._tier_new = (self._tier_new, []) if due else ([], self._tier_new)
        if due or self._tier_retry:
            self._enqueue([], [], tier)

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        self.stats["replays"] += 1
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def _convert(self, raw: Iterable[tuple[str, int, int, list[int], bytes]], loaded: list[tuple[int, ...]]) -> list:
        """Pool log entries -> vLLM events; consecutive blocks of one chain share one BlockStored."""
        old, new = self._loaded
        new.update(loaded)
        out: list[Any] = []
        chain_tail: Optional[int] = None  # our hash of the last block in out[-1] when it is a BlockStored
        for kind, h, parent, toks, salt in raw:
            if kind == "stored":
                key = tuple(toks)
                medium = new.get(key) or old.get(key) or MEDIUM_POOL
                ext, ext_parent = self._external(h, parent, toks, salt)
                if ext is None:
                    self.stats["unmapped_blocks"] += 1
                    chain_tail = None
                    continue
                last = out[-1] if out else None
                if isinstance(last, BlockStored) and chain_tail == parent and parent and last.medium == medium:
                    last.block_hashes.append(ext)
                    last.token_ids.extend(toks)
                else:
                    out.append(BlockStored([ext], ext_parent, list(toks), self.block_size, None, medium))
                chain_tail = h
            elif kind == "removed":
                ext = self._removed(h)
                chain_tail = None
                if ext is None:
                    self.stats["unmapped_blocks"] += 1
                    continue
                last = out[-1] if out else None
                if isinstance(last, BlockRemoved):
                    last.block_hashes.append(ext)
                else:
                    out.append(BlockRemoved([ext], MEDIUM_POOL))
            else:
                out.append(AllBlocksCleared())
                for old_h, digest in self._live.items():
                    self._forget(old_h, digest)
                self._live.clear()
                chain_tail = None
        self._loaded = [new, {}]  # a load noted in this window may register in the next one
        return out

    def _convert_tier(self, notes: list[tuple[str, str, Any]]) -> list[Any]:
        """Tier notes -> events with the tier's medium; runs of one chain share one BlockStored. In vLLM hash
        mode a block whose hash is not known yet (its pool event is still to come) waits up to ``TIER_WAIT_S``."""
        out: list[Any] = []
        now = time.monotonic()
        todo, self._tier_retry = self._tier_retry, []
        for kind, medium, items in notes:
            todo += [(now + TIER_WAIT_S, kind, medium, x) for x in items]
        chain_tail: Optional[int] = None  # our hash of the last block in out[-1] when it is a BlockStored
        for give_up, kind, medium, x in todo:
            last = out[-1] if out else None
            if kind == "removed":  # x: a 16-byte chained hash
                ext = self._tier_hash(int.from_bytes(x, "little"))
                parent, h = 0, 0
            else:  # x: (hash, parent hash, salt digest, tokens)
                h, parent = int.from_bytes(x[0], "little"), int.from_bytes(x[1], "little")
                ext = self._tier_hash(h, parent, x[3], x[2])
            if ext is None:
                chain_tail = None
                if now < give_up:
                    self._tier_retry.append((give_up, kind, medium, x))
                else:
                    self.stats["unmapped_blocks"] += 1
            elif kind == "removed":
                chain_tail = None
                if isinstance(last, BlockRemoved) and last.medium == medium:
                    last.block_hashes.append(ext)
                else:
                    out.append(BlockRemoved([ext], medium))
            elif isinstance(last, BlockStored) and last.medium == medium and parent and chain_tail == parent:
                last.block_hashes.append(ext)
                last.token_ids.extend(x[3])
                chain_tail = h
            else:
                pext = self._tier_hash(parent) if parent else None
                out.append(BlockStored([ext], pext, list(x[3]), self.block_size, None, medium))
                chain_tail = h
        return out

    def _tier_hash(self, h: int, parent: int = 0, toks: Sequence[int] = (), salt_digest: bytes = b"") -> Optional[int]:
        """A tier block's hash as sent. vLLM mode: the digest its pool event gave it, else (a block a tier
        promoted before the pool registered it) computed from its parent's; None when neither is known."""
        if self.hash_mode == "native":
            return h & LOW64
        digest = self._live.get(h) or self._gone.get(h)
        if digest is None and toks:
            if parent:
                pv = self._live.get(parent) or self._gone.get(parent)
            else:  # a first block: computable only without a salt (the note carries the salt's digest only)
                pv = self._none_hash if not any(salt_digest) else None
            if pv is not None:
                digest = vllm_block_hash(pv, toks, None)
                self._forget(h, digest)  # known from now on, without claiming the pool holds it
        return None if digest is None else int.from_bytes(digest, "big") & LOW64

    def _external(self, h: int, parent: int, toks: list[int], salt: bytes) -> tuple[Optional[int], Optional[int]]:
        """(this block's hash, its parent's) as sent: low 64 bits of ours, or of vLLM's recipe."""
        if self.hash_mode == "native":
            return h & LOW64, (parent & LOW64) if parent else None
        if parent:
            pv = self._live.get(parent) or self._gone.get(parent)
            if pv is None:
                return None, None
            extra = None
        else:
            pv = self._none_hash
            extra = (_salt_key(salt),) if salt else None
        digest = vllm_block_hash(pv, toks, extra)
        self._live[h] = digest
        self._gone.pop(h, None)
        return int.from_bytes(digest, "big") & LOW64, (int.from_bytes(pv, "big") & LOW64) if parent else None

    def _removed(self, h: int) -> Optional[int]:
        if self.hash_mode == "native":
            return h & LOW64
        digest = self._live.pop(h, None)
        if digest is None:
            return None
        self._forget(h, digest)
        return int.from_bytes(digest, "big") & LOW64

    def _forget(self, h: int, digest: bytes) -> None:
        self._gone[h] = digest
        self._gone.move_to_end(h)
        while len(self._gone) > self._gone_cap:
            self._gone.popitem(last=False)

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self, timeout: float = 1.0) -> None:
        """Publish what is queued (at most ``timeout`` seconds), then close the sockets."""
        if not self._running:
            return
        self._running = False
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
