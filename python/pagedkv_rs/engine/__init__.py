"""The serving loop over the paged KV cache, laid out along a request's path (vLLM v1, nano-vllm).

``input`` (the one door: ``check_request``) -> ``scheduler`` (continuous batching over a
``KVCacheManager`` of either backend: decisions only) -> ``runner`` (KV caches, swap space, KV
tiers, the forward and sampling) -> ``output`` (logprobs, stop strings, outputs) -> ``stream``
(``RequestStream``); ``engine`` (``LLMEngine``) is the loop. ``request`` holds the parameters,
per-request state and outputs; ``sampling`` the token choice; ``pooling`` the embeddings of pooling requests.
"""

from __future__ import annotations

from pagedkv_rs.engine.engine import LLMEngine, Model, RequestStream
from pagedkv_rs.engine.input import CheckedRequest
from pagedkv_rs.engine.pooling import EmbeddingOutput, EmbeddingRequestOutput, PoolingParams
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
from pagedkv_rs.engine.structured import StructuredOutputsParams

__all__ = [
    "LLMEngine",
    "CheckedRequest",
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
