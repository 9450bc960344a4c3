"""Redis tier: records as raw-bytes values under ``<prefix><key>``, shared by every engine that reaches the server.

redis-py (the ``tiers`` extra) against a real server: ``redis://``, ``rediss://`` (TLS), or a Redis
Cluster with ``?cluster=1`` (redis-py's ``RedisCluster`` does the sharding). Connection loss, timeouts
and restarts raise ``TierError`` (counted by the caller, treated as misses); after a failure the tier
rests for ``retry`` seconds (no connect attempt per admission while the server is down), then
redis-py reconnects on the next command. Values are written with ``SET ... EX ttl`` when a TTL is
given; keys another replica already wrote are skipped (one ``EXISTS`` per batch). A lookup reads at most
a record's size of each value (``STRLEN`` + ``GETRANGE`` in one round trip): a value of any other size is
handed on empty, so it fails verification, and ``discard`` deletes it so the next store replaces it.
What the server removes by itself (a TTL expiring, a ``maxmemory`` eviction) is not seen here: only
``discard`` reports a removal (``on_removed``).

Deadlines: the socket (and connect) timeout is the smaller of ``timeout`` and the lookup deadline
(``use_deadline``), and redis-py's own retries are off, so a slow, SIGSTOPped or unreachable server holds
one call for at most that long; the failure then rests the tier for ``retry`` seconds.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Optional

from pagedkv_rs.tiers.base import Tier, TierError

__all__ = ["RedisTier"]

GET_CHUNK = 8  # records per round trip: a deadline is checked between chunks
DEFAULT_MAX_RECORD = 256 << 20  # the read cap until KVTiers says the record sizes


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
        self._sizes: Optional[frozenset[int]] = None
        self._url, self._cluster, self.timeout = url, cluster, float(timeout)
        self._r: Any = self._client(self.timeout)

    def _client(self, timeout: float) -> Any:
        """A client whose every socket call (connect, send, receive) waits at most ``timeout`` seconds, once."""
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        kw: dict[str, Any] = {
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
            "retry": Retry(NoBackoff(), 0),
        }
        if self._cluster:
            from redis.cluster import RedisCluster

            return RedisCluster.from_url(self._url, **kw)
        return redis.Redis.from_url(self._url, health_check_interval=30, **kw)

    def use_deadline(self, seconds: float) -> None:
        """Socket timeouts of at most ``seconds`` (a new client: no connection is open yet)."""
        t = min(self.timeout, float(seconds))
        if t != self.timeout:
            old, self._r, self.timeout = self._r, self._client(t), t
            try:
                old.close()
            except self._errors:
                pass

    def _guard(self) -> None:
        if time.monotonic() < self._down_until:
            raise TierError(f"{self.name}: resting after a failure")

    def _failed(self, e: BaseException, what: str) -> TierError:
        self._down_until = time.monotonic() + self.retry
        return TierError(f"{self.name}: {what}: {type(e).__name__}: {e}")

    def expect_record_sizes(self, sizes: Sequence[int]) -> None:
        self._sizes = frozenset(int(n) for n in sizes)

    def get_many(self, keys: Sequence[str], deadline: float) -> list[Optional[bytes]]:
        self._guard()
        out: list[Optional[bytes]] = []
        cap = max(self._sizes) if self._sizes else DEFAULT_MAX_RECORD
        try:
            for i in range(0, len(keys), GET_CHUNK):
                if out and time.monotonic() > deadline:
                    break
                pipe = self._r.pipeline(transaction=False)
                for k in keys[i : i + GET_CHUNK]:
                    pipe.strlen(self.prefix + k)
                    pipe.getrange(self.prefix + k, 0, cap - 1)
                res = pipe.execute()
                for n, v in zip(res[0::2], res[1::2]):
                    if not n:
                        out.append(None)
                        return out
                    ok = n in self._sizes if self._sizes is not None else n <= cap
                    out.append(bytes(v) if ok else b"")
                    if not ok:
                        return out
        except self._errors as e:
            raise self._failed(e, "lookup") from e
        return out

    def discard(self, key: str) -> None:
        """Delete a value that failed verification, so the next store of this block replaces it."""
        try:
            n = self._r.delete(self.prefix + key)
        except self._errors:
            return
        if n:
            self._removed([key])

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
