"""Helpers of the KV-tier tests (also imported by their subprocesses): prompts and tiny-model engines."""

from __future__ import annotations

import threading

from pagedkv_rs.engine import LLMEngine
from pagedkv_rs.models.tiny import TinyModel
from pagedkv_rs.tiers import Tier

PREFIX = list(range(3, 3 + 80))  # 5 full blocks of 16


def prompts() -> list[list[int]]:
    """Prompts sharing a prefix, plus one that shares nothing."""
    return [PREFIX + [90, 91, 92], PREFIX + [100, 101, 102, 103, 104, 105], list(range(60, 60 + 37))]


def make_engine(tiers=None, *, backend="auto", seed=0, kv_dtype="float32", num_blocks=64, **kw) -> LLMEngine:
    return LLMEngine(
        TinyModel(seed=seed),
        num_blocks=num_blocks,
        block_size=16,
        kv_cache_dtype=kv_dtype,
        backend=backend,
        kv_tiers=tiers,
        **kw,
    )


class HeldLookup(Tier):
    """A tier whose lookups hang until the test releases them (a hung mount, a read that never returns).

    ``store``: False stores nothing (``put_many`` reports 0), so every lookup depends on what the test puts.
    """

    kind = "held"

    def __init__(self, inner: Tier, *, store: bool = True) -> None:
        self.name = "held"
        self.inner = inner
        self.store = store
        self.entered = threading.Event()
        self.release = threading.Event()

    def get_many(self, keys, deadline):
        self.entered.set()
        self.release.wait(60)
        return self.inner.get_many(keys, float("inf"))

    def put_many(self, items):
        return self.inner.put_many(items) if self.store else 0
