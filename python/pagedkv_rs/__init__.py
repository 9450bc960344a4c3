"""pagedkv_rs: a paged KV cache for CPU LLM inference.

The block allocator and block tables exist twice with one API: the Rust core
(``pagedkv_rs._core``) and the pure-Python executable spec (``pagedkv_rs.fallback``).
``BlockAllocator`` and ``KVCacheManager`` here are the backend chosen once at import
by ``PAGEDKV_BACKEND=auto|rust|python`` (``auto`` = Rust when built); ``BACKEND`` names it
and ``backend(name)`` hands out either one explicitly.
"""

from __future__ import annotations

import os
import types

from pagedkv_rs import fallback
from pagedkv_rs.errors import (
    DoubleFreeError,
    DuplicateSequenceError,
    OutOfBlocksError,
    PagedKVError,
    SequenceTooLongError,
    UnknownSequenceError,
)

try:
    from pagedkv_rs import _core
except ImportError:  # pragma: no cover - only without a compiled core
    _core = None  # type: ignore[assignment]

__version__ = "0.1.0"

# Kernel functions (Rust only; the float64 numpy spec of the first four is pagedkv_rs.reference).
from pagedkv_rs import reference  # noqa: E402

if _core is not None:
    from pagedkv_rs._core import (  # noqa: E402
        QLinear,
        build_profile,
        copy_blocks,
        fma_peak,
        get_num_threads,
        kernel_info,
        memory_bandwidth,
        new_kv_cache,
        paged_attention,
        rms_norm,
        set_kernel_backend,
        set_num_threads,
        silu_and_mul,
        write_kv,
    )

_KERNEL_NAMES = [
    "new_kv_cache",
    "write_kv",
    "copy_blocks",
    "paged_attention",
    "set_kernel_backend",
    "kernel_info",
    "set_num_threads",
    "get_num_threads",
    "memory_bandwidth",
    "fma_peak",
    "build_profile",
    "QLinear",
    "rms_norm",
    "silu_and_mul",
]

_HAVE_RUST = _core is not None
BACKENDS: tuple[str, ...] = ("rust", "python") if _HAVE_RUST else ("python",)


def backend(name: str = "auto") -> types.SimpleNamespace:
    """Return the allocator classes of one backend: ``.BlockAllocator``, ``.KVCacheManager``, ``.name``."""
    if name == "auto":
        name = "rust" if _HAVE_RUST else "python"
    mod: types.ModuleType
    if name == "rust":
        if not _HAVE_RUST:
            raise ImportError("PAGEDKV_BACKEND=rust but the compiled core pagedkv_rs._core is not built")
        mod = _core
    elif name == "python":
        mod = fallback
    else:
        raise ValueError(f"unknown backend {name!r}: expected 'auto', 'rust' or 'python'")
    return types.SimpleNamespace(
        name=name, BlockAllocator=mod.BlockAllocator, KVCacheManager=mod.KVCacheManager
    )


_selected = backend(os.environ.get("PAGEDKV_BACKEND", "auto").strip().lower() or "auto")
BACKEND: str = _selected.name
BlockAllocator = _selected.BlockAllocator
KVCacheManager = _selected.KVCacheManager

__all__ = [
    "BACKEND",
    "BACKENDS",
    "BlockAllocator",
    "KVCacheManager",
    "backend",
    "fallback",
    "PagedKVError",
    "OutOfBlocksError",
    "UnknownSequenceError",
    "DuplicateSequenceError",
    "SequenceTooLongError",
    "DoubleFreeError",
    "reference",
    *(_KERNEL_NAMES if _core is not None else []),
]

# Scheduler, requests, sampling and engine (pure Python over either allocator backend).
from pagedkv_rs.engine import LLMEngine, Model, RequestStream  # noqa: E402
from pagedkv_rs.request import (  # noqa: E402
    CompletionOutput,
    InvalidRequestError,
    Logprob,
    RequestOutput,
    RequestStatus,
    SamplingParams,
    StreamLeaseExpiredError,
    UnknownRequestError,
)
from pagedkv_rs.scheduler import Scheduler, SchedulerConfig  # noqa: E402

__all__ += [
    "LLMEngine",
    "Model",
    "RequestStream",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "RequestStatus",
    "InvalidRequestError",
    "UnknownRequestError",
    "StreamLeaseExpiredError",
    "Logprob",
    "Scheduler",
    "SchedulerConfig",
]
