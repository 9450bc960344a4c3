"""Helpers of the KV-tier tests (also imported by their subprocesses): prompts and tiny-model engines."""

from __future__ import annotations

from pagedkv_rs.engine import LLMEngine
from pagedkv_rs.models.tiny import TinyModel

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
