"""KV tiers below the block pool: a disk tier that survives restarts, a Redis tier that replicas share.

``parse_tier(spec)`` turns one spec string into a tier; ``KVTiers`` (what the engine holds) looks
blocks up in the tiers in order (fast to slow) and writes computed blocks to all of them in the
background. Specs::

    disk:/var/cache/pagedkv?size=8GiB            a directory, at most size bytes (default 4GiB); &fsync=1
    redis://host:6379/0?prefix=pagedkv:&ttl=3600  redis-py URL (rediss:// for TLS, &cluster=1 for a cluster)

Every spec takes ``secret=`` (entries are MACed with it; see ``base``), and ``timeout=`` (seconds, Redis:
socket timeouts, never more than the lookup deadline). The unit, the record format and the verification
rules are in ``pagedkv_rs.tiers.base``.
"""

from __future__ import annotations

import urllib.parse
from typing import Optional, Union

from pagedkv_rs.tiers.base import (
    BlockLayout,
    RecordError,
    Tier,
    TierError,
    TierMetrics,
    chain_hashes,
    decode_record,
    encode_record,
    model_fingerprint,
    record_sizes,
    salt_digest,
)
from pagedkv_rs.tiers.kvtiers import KVTiers
from pagedkv_rs.units import parse_memory

__all__ = [
    "parse_tier",
    "KVTiers",
    "Tier",
    "TierError",
    "RecordError",
    "BlockLayout",
    "TierMetrics",
    "chain_hashes",
    "salt_digest",
    "model_fingerprint",
    "encode_record",
    "decode_record",
    "record_sizes",
    "DEFAULT_DISK_SIZE",
]

DEFAULT_DISK_SIZE = 4 << 30
_DISK_OPTS = {"size", "fsync", "secret"}
_REDIS_OPTS = {"prefix", "ttl", "secret", "timeout", "cluster"}


def _secret(value: Union[str, bytes, None]) -> Optional[bytes]:
    if value is None:
        return None
    raw = value.encode("utf-8") if isinstance(value, str) else bytes(value)
    if not raw:
        raise ValueError("a KV tier secret must not be empty")
    return raw


def _options(spec: str, query: str, allowed: set[str]) -> dict[str, str]:
    try:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError as e:
        raise ValueError(f"KV tier {_redact(spec)!r}: bad options {query!r}") from e
    opts: dict[str, str] = {}
    for k, v in pairs:
        if k not in allowed:
            raise ValueError(f"KV tier {_redact(spec)!r}: unknown option {k!r} (expected one of {sorted(allowed)})")
        if k in opts:
            raise ValueError(f"KV tier {_redact(spec)!r}: option {k!r} given twice")
        opts[k] = v
    return opts


def _redact(spec: str) -> str:
    """The spec without its query string and credentials (secrets never reach messages or labels)."""
    base = spec.split("?", 1)[0]
    if "://" in base:
        scheme, _, rest = base.partition("://")
        netloc, slash, path = rest.partition("/")
        return f"{scheme}://{netloc.rsplit('@', 1)[-1]}{slash}{path}"
    return base


def _flag(spec: str, name: str, value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"KV tier {_redact(spec)!r}: {name} must be 0 or 1, got {value!r}")


def _number(spec: str, name: str, value: str, *, integer: bool = False) -> float:
    try:
        x = int(value) if integer else float(value)
    except ValueError:
        raise ValueError(f"KV tier {_redact(spec)!r}: {name} must be a positive number, got {value!r}") from None
    if not x > 0 or x != x or x == float("inf"):
        raise ValueError(f"KV tier {_redact(spec)!r}: {name} must be a positive number, got {value!r}")
    return x


def parse_tier(spec: str, *, secret: Union[str, bytes, None] = None) -> Tier:
    """One tier from its spec (``disk:/path?size=8GiB`` or ``redis://host:port/db?...``); ValueError if bad.

    ``secret``: the default MAC key (``kv_tier_secret``); a ``secret=`` option in the spec wins.
    """
    if not isinstance(spec, str):
        raise TypeError(f"a KV tier spec must be a str, got {type(spec).__name__}")
    spec = spec.strip()
    if spec.startswith("disk:"):
        rest = spec[len("disk:") :]
        path, _, query = rest.partition("?")
        if not path:
            raise ValueError("KV tier 'disk:' needs a directory: disk:/path/to/dir?size=8GiB")
        opts = _options(spec, query, _DISK_OPTS)
        from pagedkv_rs.tiers.disk import DiskTier

        try:
            size = parse_memory(opts["size"]) if "size" in opts else DEFAULT_DISK_SIZE
        except ValueError:
            raise ValueError(
                f"KV tier {_redact(spec)!r}: size must be like 8GiB or 500MB, got {opts['size']!r}"
            ) from None
        return DiskTier(
            path,
            size,
            fsync=_flag(spec, "fsync", opts.get("fsync", "0")),
            secret=_secret(opts["secret"]) if "secret" in opts else _secret(secret),
        )
    if spec.startswith(("redis://", "rediss://")):
        base, _, query = spec.partition("?")
        opts = _options(spec, query, _REDIS_OPTS)
        u = urllib.parse.urlsplit(base)
        if not u.hostname:
            raise ValueError(f"KV tier {_redact(spec)!r}: needs a host, e.g. redis://127.0.0.1:6379/0")
        try:
            _ = u.port
        except ValueError:
            raise ValueError(f"KV tier {_redact(spec)!r}: bad port") from None
        db = u.path.strip("/")
        if db and not db.isdigit():
            raise ValueError(f"KV tier {_redact(spec)!r}: the database must be a number, got {db!r}")
        from pagedkv_rs.tiers.redis import RedisTier

        return RedisTier(
            base,
            name=_redact(spec),
            prefix=opts.get("prefix", "pagedkv:"),
            ttl=int(_number(spec, "ttl", opts["ttl"], integer=True)) if "ttl" in opts else None,
            timeout=_number(spec, "timeout", opts["timeout"]) if "timeout" in opts else 1.0,
            cluster=_flag(spec, "cluster", opts.get("cluster", "0")),
            secret=_secret(opts["secret"]) if "secret" in opts else _secret(secret),
        )
    raise ValueError(
        f"unknown KV tier {_redact(spec)!r}: expected disk:/path?size=8GiB, redis://host:port/db or rediss://..."
    )
