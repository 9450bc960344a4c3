"""The serving loop over the paged KV cache (nano-vllm's ``nanovllm/engine/``).

``request`` (sampling parameters, per-request state, outputs), ``sampling`` (token choice),
``scheduler`` (continuous batching over a ``KVCacheManager`` of either backend) and ``engine``
(``LLMEngine``: schedule -> memory ops -> forward -> sample, plus streaming).
"""

from __future__ import annotations

from pagedkv_rs.engine.engine import LLMEngine, Model, RequestStream
from pagedkv_rs.engine.request import (
    CompletionOutput,
    InvalidRequestError,
    Logprob,
    RequestOutput,
    RequestStatus,
    SamplingParams,
    StreamLeaseExpiredError,
    UnknownRequestError,
)
from pagedkv_rs.engine.scheduler import Scheduler, SchedulerConfig

__all__ = [
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
