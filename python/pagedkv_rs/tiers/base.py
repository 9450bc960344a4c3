"""The tier interface, the block record format, the model fingerprint and the per-tier metrics.

A tier stores opaque records under string keys: ``get_many`` (one batched lookup with a deadline)
and ``put_many`` (idempotent: many writers of one key are fine). Everything that makes a record
safe to use lives here, so every tier verifies the same way.

Record (little-endian, raw bytes, no pickle)::

    magic "PKVB" | version u16 | flags u16 (bit 0: MAC present) | num_tokens u32 | payload_len u64
    | block hash 16 | parent hash 16 | salt digest 16 | model fingerprint 16
    | tokens u32 x num_tokens | payload (all layers' K and V of one block) | crc32 u32 of all before
    | [HMAC-SHA256 32 of all before, when flags bit 0]

Payload: ``[num_layers, 2 (K, V), num_kv_heads, block_size, head_dim]`` in the KV cache's dtype,
exactly the bytes of the cache blocks. A record that fails any check is a miss (``RecordError``).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import threading
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import numpy as np

from pagedkv_rs.metrics import Histogram

__all__ = [
    "Tier",
    "TierError",
    "RecordError",
    "BlockLayout",
    "TierMetrics",
    "LAYOUT_VERSION",
    "LOOKUP_BUCKETS",
    "encode_record",
    "record_sizes",
    "decode_record",
    "chain_hashes",
    "salt_digest",
    "model_fingerprint",
]

LAYOUT_VERSION = 1  # bump when the cache layout or the record format changes: old records stop matching
MAGIC = b"PKVB"
_HEAD = struct.Struct("<4sHHIQ16s16s16s16s")
_CRC = struct.Struct("<I")
_MAC_LEN = 32
FLAG_MAC = 1
# lookup latency buckets (seconds): a disk hit is ~1 ms, a Redis batch tens of ms
LOOKUP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class TierError(Exception):
    """A tier could not be reached or failed an operation (counted; the caller treats it as a miss).

    From ``put_many``: ``stored`` records of the batch (in order) and ``written`` bytes made it before the failure.
    """

    def __init__(self, message: str, *, stored: int = 0, written: int = 0) -> None:
        super().__init__(message)
        self.stored = stored
        self.written = written


class RecordError(ValueError):
    """A stored record does not verify (torn, corrupted, wrong model, wrong MAC, wrong tokens): a miss."""


@dataclass(frozen=True)
class BlockLayout:
    """Geometry of one block's payload: ``[num_layers, 2, num_kv_heads, block_size, head_dim]`` of ``dtype``."""

    num_layers: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: np.dtype

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize


class Tier:
    """A store below the block pool. Subclasses implement ``get_many`` / ``put_many`` / ``close``."""

    name: str = "tier"  # metric label: the spec without secrets or options
    kind: str = "tier"
    secret: Optional[bytes] = None
    # told the keys this tier removed by itself (an eviction, a record that failed verification); set by KVTiers
    on_removed: Optional[Callable[[list[str]], None]] = None

    @property
    def medium(self) -> str:
        """The tier's name in KV events (vLLM's ``medium``): ``DISK``, ``REDIS``."""
        return self.kind.upper()

    def _removed(self, keys: list[str]) -> None:
        if keys and self.on_removed is not None:
            self.on_removed(keys)

    def get_many(self, keys: Sequence[str], deadline: float) -> list[Optional[bytes]]:
        """Records for ``keys`` in order (None = absent); stops at the first absent key or at ``deadline``
        (``time.monotonic()``), returning what it has. Raises ``TierError`` when the store fails."""
        raise NotImplementedError

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> int:
        """Store records (skipping keys already present where that is cheap); returns bytes written.

        On a failure raises ``TierError`` saying how many of ``items`` were stored before it."""
        raise NotImplementedError

    def expect_record_sizes(self, sizes: Sequence[int]) -> None:
        """The byte sizes this engine's records can have; a tier may refuse to read anything else."""

    def use_deadline(self, seconds: float) -> None:
        """The lookup deadline: a tier bounds each blocking call by it where it can (Redis: socket timeouts)."""

    def close(self) -> None:
        """Release connections / handles."""


def salt_digest(salt: Union[str, bytes, None]) -> bytes:
    """16 bytes naming a cache salt (all zero for no salt)."""
    if salt is None or salt == b"" or salt == "":
        return bytes(16)
    raw = salt.encode("utf-8") if isinstance(salt, str) else bytes(salt)
    return hashlib.sha256(b"pagedkv-salt\x00" + raw).digest()[:16]


def chain_hashes(
    tokens: Sequence[int], block_size: int, salt: Union[str, bytes, None], known: Optional[list[bytes]] = None
) -> list[bytes]:
    """Chained 16-byte prefix hashes of the full blocks of ``tokens`` (the prefix cache's own hash at 128 bits:
    SHA-256 of parent, salt length + salt (first block only), tokens as u32; the low 16 bytes).

    ``known``: the hashes of the first blocks, already computed (extended in place and returned).
    """
    out = known if known is not None else []
    raw = salt.encode("utf-8") if isinstance(salt, str) else (salt or b"")
    n = len(tokens) // block_size
    for i in range(len(out), n):
        parent = out[i - 1] if i else bytes(16)
        s = raw if i == 0 else b""
        h = hashlib.sha256()
        h.update(parent)
        h.update(struct.pack("<I", len(s)))
        h.update(s)
        h.update(struct.pack(f"<{block_size}I", *tokens[i * block_size : (i + 1) * block_size]))
        out.append(h.digest()[:16])
    return out


def model_fingerprint(model: Any, layout: BlockLayout) -> bytes:
    """16 bytes that two engines share only if their K/V for the same tokens are interchangeable.

    Covers the model's own ``kv_fingerprint()`` (GGUF content hash, config and weight format, or a tiny
    model's seed and config), the KV dtype, the block geometry and the layout version.
    """
    fp = getattr(model, "kv_fingerprint", None)
    if fp is None:
        raise ValueError(f"KV tiers need a model fingerprint: {type(model).__name__} has no kv_fingerprint() method")
    desc = (
        f"pagedkv-kv-layout={LAYOUT_VERSION};model={fp()};kv_dtype={layout.dtype.name};"
        f"block_size={layout.block_size};layers={layout.num_layers};kv_heads={layout.num_kv_heads};"
        f"head_dim={layout.head_dim}"
    )
    return hashlib.sha256(desc.encode()).digest()[:16]


def encode_record(
    block_hash: bytes,
    parent: bytes,
    salt: bytes,
    fingerprint: bytes,
    tokens: Sequence[int],
    payload: Union[bytes, memoryview, np.ndarray],
    secret: Optional[bytes] = None,
) -> bytes:
    """One record's bytes (see the module docstring)."""
    if isinstance(payload, np.ndarray):  # bfloat16 has no buffer format: view the bytes
        payload = np.ascontiguousarray(payload).reshape(-1).view(np.uint8)
    body = memoryview(payload).cast("B")
    head = _HEAD.pack(
        MAGIC,
        LAYOUT_VERSION,
        FLAG_MAC if secret else 0,
        len(tokens),
        len(body),
        block_hash,
        parent,
        salt,
        fingerprint,
    )
    toks = struct.pack(f"<{len(tokens)}I", *tokens)
    buf = bytearray(len(head) + len(toks) + len(body) + _CRC.size + (_MAC_LEN if secret else 0))
    mv = memoryview(buf)
    a = len(head)
    b = a + len(toks)
    c = b + len(body)
    mv[:a] = head
    mv[a:b] = toks
    mv[b:c] = body
    crc = zlib.crc32(mv[:c])
    _CRC.pack_into(buf, c, crc)
    if secret:
        mv[c + _CRC.size :] = hmac.digest(secret, mv[: c + _CRC.size], "sha256")
    return bytes(buf)


def record_sizes(layout: BlockLayout) -> tuple[int, int]:
    """The two sizes a record of ``layout`` can have: without and with its MAC."""
    n = _HEAD.size + 4 * layout.block_size + layout.nbytes + _CRC.size
    return n, n + _MAC_LEN


def decode_record(
    data: Union[bytes, bytearray, memoryview],
    *,
    block_hash: bytes,
    parent: bytes,
    salt: bytes,
    fingerprint: bytes,
    tokens: Sequence[int],
    payload_len: int,
    secret: Optional[bytes] = None,
) -> memoryview:
    """The payload of a record that verifies against every expected field; raises ``RecordError`` otherwise.

    Arbitrary bytes never raise anything else.
    """
    mv = memoryview(data).cast("B") if not isinstance(data, memoryview) else data.cast("B")
    n = len(mv)
    if n < _HEAD.size + _CRC.size:
        raise RecordError(f"record of {n} bytes is shorter than its header")
    magic, version, flags, ntok, plen, h, p, s, f = _HEAD.unpack_from(mv, 0)
    if magic != MAGIC or version != LAYOUT_VERSION:
        raise RecordError("not a block record of this layout version")
    if f != fingerprint:
        raise RecordError("model fingerprint differs")
    if h != block_hash or p != parent or s != salt:
        raise RecordError("block hash, parent hash or salt differs")
    if ntok != len(tokens) or plen != payload_len:
        raise RecordError(
            f"record holds {ntok} tokens and {plen} payload bytes, expected {len(tokens)} and {payload_len}"
        )
    has_mac = bool(flags & FLAG_MAC)
    end = _HEAD.size + 4 * ntok + plen
    want = end + _CRC.size + (_MAC_LEN if has_mac else 0)
    if n != want:
        raise RecordError(f"record is {n} bytes, its header says {want} (torn or truncated)")
    if secret:
        if not has_mac:
            raise RecordError("record carries no MAC but this tier has a secret")
        mac = hmac.digest(secret, mv[: end + _CRC.size], "sha256")
        if not hmac.compare_digest(mac, mv[end + _CRC.size :]):
            raise RecordError("MAC does not verify")
    (crc,) = _CRC.unpack_from(mv, end)
    if zlib.crc32(mv[:end]) != crc:
        raise RecordError("checksum does not verify")
    a = _HEAD.size
    if list(struct.unpack_from(f"<{ntok}I", mv, a)) != list(tokens):
        raise RecordError("tokens differ")
    return mv[a + 4 * ntok : end]


class TierMetrics:
    """One tier's counters and lookup-latency histogram (bounded); read with ``snapshot()``."""

    FIELDS = (
        "lookups",
        "hit_blocks",
        "hit_tokens",
        "miss_blocks",
        "verify_failures",
        "errors",
        "timeouts",
        "late_results",
        "stored_blocks",
        "store_drops",
        "store_failures",
        "bytes_read",
        "bytes_written",
    )

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts = dict.fromkeys(self.FIELDS, 0)
        self.lookup_seconds = Histogram(LOOKUP_BUCKETS)

    def add(self, **kw: int) -> None:
        with self.lock:
            for k, v in kw.items():
                self.counts[k] += v

    def observe(self, seconds: float) -> None:
        with self.lock:
            self.lookup_seconds.observe(seconds)

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            out: dict[str, Any] = dict(self.counts)
            out["lookup_seconds"] = self.lookup_seconds.snapshot()
            return out
