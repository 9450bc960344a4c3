"""pagedkv_rs: a paged KV cache for CPU LLM inference.

The block allocator and block tables exist twice with one API: the Rust core
(``pagedkv_rs._core``) and the pure-Python executable spec (``pagedkv_rs.fallback``).
``BlockAllocator`` and ``KVCacheManager`` here are the backend chosen once at import
by ``PAGEDKV_BACKEND=auto|rust|python`` (``auto`` = Rust when built); ``BACKEND`` names it
and ``backend(name)`` hands out either one explicitly (see ``pagedkv_rs._backend``).
The kernel functions come from the compiled core (their float64 numpy spec is
``pagedkv_rs.kernels.reference``); the scheduler and engine
are pure Python over either backend. ``LLM`` (the offline API, ``pagedkv_rs.llm``) loads on first
use: it needs the ``model`` extra.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

from pagedkv_rs import fallback
from pagedkv_rs._backend import BACKEND, BACKENDS, BlockAllocator, KVCacheManager, _core, backend
from pagedkv_rs.engine import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    InvalidRequestError,
    LLMEngine,
    Logprob,
    Model,
    PoolingParams,
    RequestOutput,
    RequestStatus,
    RequestStream,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    StreamLeaseExpiredError,
    StructuredOutputsParams,
    UnknownRequestError,
)
from pagedkv_rs.errors import (
    DoubleFreeError,
    DuplicateSequenceError,
    OutOfBlocksError,
    PagedKVError,
    SequenceTooLongError,
    UnknownSequenceError,
)
from pagedkv_rs.kernels import reference

if TYPE_CHECKING:
    from pagedkv_rs.llm import LLM as LLM  # the lazy attribute below, for type checkers

__version__ = "0.1.0"

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
    "LLMEngine",
    "Model",
    "RequestStream",
    "SamplingParams",
    "PoolingParams",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "StructuredOutputsParams",
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
# LLM is listed (for help() and star imports) only when the `model` extra is installed: `from pagedkv_rs
# import *` must work without it. Found, not imported: llm.py loads on first use.
_LAZY = ("LLM",) if all(importlib.util.find_spec(m) is not None for m in ("gguf", "jinja2", "tokenizers")) else ()
__all__ += _LAZY


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


def __getattr__(name: str) -> Any:
    # PEP 562: LLM needs the `model` extra, so it is imported on first use (llm.py names what is missing).
    if name == "LLM":
        from pagedkv_rs.llm import LLM

        return LLM
    raise AttributeError(f"module 'pagedkv_rs' has no attribute {name!r}")


if _core is not None:  # the kernel functions exist only in the compiled core
    from pagedkv_rs._core import (
        QLinear,
        build_profile,
        copy_blocks,
        fma_peak,
        gelu_tanh_and_mul,
        get_isa,
        get_num_threads,
        kernel_info,
        memory_bandwidth,
        new_kv_cache,
        paged_attention,
        rms_norm,
        set_isa,
        set_num_threads,
        silu_and_mul,
        write_blocks,
        write_kv,
    )

    __all__ += [
        "new_kv_cache",
        "write_kv",
        "copy_blocks",
        "write_blocks",
        "paged_attention",
        "set_isa",
        "get_isa",
        "kernel_info",
        "set_num_threads",
        "get_num_threads",
        "memory_bandwidth",
        "fma_peak",
        "build_profile",
        "QLinear",
        "rms_norm",
        "silu_and_mul",
        "gelu_tanh_and_mul",
    ]
