"""The kernel functions the engine and models call, looked up in one place at call time.

``write_kv``, ``paged_attention``, ``copy_blocks``, ``new_kv_cache``, ``rms_norm`` and ``silu_and_mul`` come from the compiled core
when it has them, else from the float64 numpy reference (``pagedkv_rs.reference``), which has the
same signatures. ``PAGEDKV_KERNEL=reference`` forces the reference; ``kernel_source()`` says which.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

__all__ = ["write_kv", "paged_attention", "copy_blocks", "new_kv_cache", "rms_norm", "silu_and_mul", "kernel_source"]


_FOUND: dict[tuple[str, str], Any] = {}


def _lookup(name: str) -> Any:
    # Called for every kernel call of every layer: resolve once per (name, PAGEDKV_KERNEL value).
    mode = os.environ.get("PAGEDKV_KERNEL", "auto").strip().lower()
    fn = _FOUND.get((name, mode))
    if fn is None:
        fn = _resolve(name, mode)
        _FOUND[(name, mode)] = fn
    return fn


def _resolve(name: str, mode: str) -> Any:
    if mode != "reference":
        try:
            core = importlib.import_module("pagedkv_rs._core")
        except ImportError:
            core = None
        fn = getattr(core, name, None)
        if fn is not None:
            return fn
    return getattr(importlib.import_module("pagedkv_rs.reference"), name)


def kernel_source() -> str:
    """"rust" when the compiled kernels are used, else "reference"."""
    return "rust" if _lookup("paged_attention").__module__ != "pagedkv_rs.reference" else "reference"


def write_kv(*args: Any, **kwargs: Any) -> None:
    """Scatter this step's K/V into the caches at ``slot_mapping`` (see ``pagedkv_rs.reference.write_kv``)."""
    return _lookup("write_kv")(*args, **kwargs)


def paged_attention(*args: Any, **kwargs: Any) -> Any:
    """Causal attention of each sequence's new tokens over its cached blocks."""
    return _lookup("paged_attention")(*args, **kwargs)


def copy_blocks(*args: Any, **kwargs: Any) -> None:
    """Whole-block (src, dst) copies in both caches."""
    return _lookup("copy_blocks")(*args, **kwargs)


def new_kv_cache(*args: Any, **kwargs: Any) -> Any:
    """Allocate one layer's (k_cache, v_cache) ``[num_blocks, num_kv_heads, block_size, head_dim]``."""
    return _lookup("new_kv_cache")(*args, **kwargs)


def rms_norm(*args: Any, **kwargs: Any) -> Any:
    """RMSNorm per row, optionally fused with the residual add (see ``pagedkv_rs.reference.rms_norm``)."""
    return _lookup("rms_norm")(*args, **kwargs)


def silu_and_mul(*args: Any, **kwargs: Any) -> Any:
    """SwiGLU activation ``silu(gate) * up`` of a fused ``[T, 2F]`` projection."""
    return _lookup("silu_and_mul")(*args, **kwargs)
