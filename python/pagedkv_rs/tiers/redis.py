"""Redis tier: records as raw-bytes values under ``<prefix><key>``, shared by every engine that reaches the server.

redis-py (the ``tiers`` extra) against a real server: ``redis://``, ``rediss://`` (TLS), or a Redis
Cluster with ``?cluster=1`` (redis-py's ``RedisCluster`` does the sharding). Connection loss, timeouts
and restarts raise ``TierError`` (counted by the caller, treated as misses); after a failure the tier
rests for ``retry`` seconds (no connect attempt per admission while the server is down), then
redis-py reconnects on the next command. Values are written with ``SET ... EX ttl`` when a TTL is
given; keys another replica already wrote are skipped (one ``EXISTS`` per batch).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Optional

from pagedkv_rs.tiers.base import Tier, TierError

__all__ = ["RedisTier"]

GET_CHUNK = 8  # records per round trip: a deadline is checked between chunks


class RedisTier(Tier):
    """A Redis (or Redis Cluster) server as a shared KV tier."""

    kind = "redis"

    def __init__(
        self,
        url: str,
        *,
        name: str,
        prefix: str = "pagedkv:",
        ttl: Optional[int] = None,
        timeout: float = 1.0,
        retry: float = 1.0,
        cluster: bool = False,
        secret: Optional[bytes] = None,
    ) -> None:
        try:
            import redis
        except ImportError as e:  # pragma: no cover - the extra is missing
            raise ImportError('the Redis tier needs redis-py: pip install "pagedkv-rs[tiers]"') from e
        self._errors: tuple[type[BaseException], ...] = (redis.exceptions.RedisError, OSError)
        self.name = name
        self.prefix = prefix
        self.ttl = ttl
        self.retry = float(retry)
        self.secret = secret
        self._down_until = 0.0
        kw: dict[str, Any] = {"socket_timeout": timeout, "socket_connect_timeout": timeout}
        if cluster:
            from redis.cluster import RedisCluster

            self._r: Any = RedisCluster.from_url(url, **kw)
        else:
            self._r = redis.Redis.from_url(url, health_check_interval=30, **kw)

    def _guard(self) -> None:
        if time.monotonic() < self._down_until:
            raise TierError(f"{self.name}: resting after a failure")

    def _failed(self, e: BaseException, what: str) -> TierError:
        self._down_until = time.monotonic() + self.retry
        return TierError(f"{self.name}: {what}: {type(e).__name__}: {e}")

    def get_many(self, keys: Sequence[str], deadline: float) -> list[Optional[bytes]]:
        self._guard()
        out: list[Optional[bytes]] = []
        try:
            for i in range(0, len(keys), GET_CHUNK):
                if out and time.monotonic() > deadline:
                    break
                pipe = self._r.pipeline(transaction=False)
                for k in keys[i : i + GET_CHUNK]:
                    pipe.get(self.prefix + k)
                for v in pipe.execute():
                    out.append(v)
                    if v is None:
                        return out
        except self._errors as e:
            raise self._failed(e, "lookup") from e
        return out

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> int:
        if not items:
            return 0
        self._guard()
        try:
            pipe = self._r.pipeline(transaction=False)
            for k, _ in items:
                pipe.exists(self.prefix + k)
            present = pipe.execute()
            pipe = self._r.pipeline(transaction=False)
            written = 0
            for (k, v), have in zip(items, present):
                if not have:
                    pipe.set(self.prefix + k, v, ex=self.ttl)
                    written += len(v)
            if written:
                pipe.execute()
            return written
        except self._errors as e:
            raise self._failed(e, "store") from e

    def close(self) -> None:
        try:
            self._r.close()
        except self._errors:
            pass
