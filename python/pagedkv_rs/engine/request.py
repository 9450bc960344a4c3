"""Request objects: sampling parameters, per-request state, and the outputs users see (vLLM shapes)."""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import numpy as np

from pagedkv_rs.errors import PagedKVError

__all__ = [
    "SamplingParams",
    "RequestStatus",
    "Request",
    "RequestOutput",
    "CompletionOutput",
    "RequestMetrics",
    "InvalidRequestError",
    "UnknownRequestError",
]

MAX_TOKEN_ID = (1 << 32) - 1


class InvalidRequestError(PagedKVError, ValueError):
    """A request was rejected at submission: empty prompt, prompt too long, bad token id, duplicate id."""


class UnknownRequestError(PagedKVError, LookupError):
    """No unfinished request has this id."""


def _int(name: str, value: object, lo: int, hi: Optional[int] = None) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"SamplingParams.{name} must be an int, got {type(value).__name__}")
    v = int(value.__index__())  # type: ignore[attr-defined]
    if v < lo or (hi is not None and v > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"SamplingParams.{name} must be {bound}, got {v}")
    return v


def _float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"SamplingParams.{name} must be a number, got {type(value).__name__}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"SamplingParams.{name} must be finite, got {v}")
    return v


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request; validated on construction.

    temperature 0 means greedy. top_k 0 (or -1) and top_p 1.0 disable those filters.
    A lower ``priority`` value is served earlier under the "priority" policy (as in vLLM).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    priority: int = 0

    def __post_init__(self) -> None:
        s = object.__setattr__
        s(self, "max_tokens", _int("max_tokens", self.max_tokens, 1))
        t = _float("temperature", self.temperature)
        if t < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0 (0 = greedy), got {t}")
        s(self, "temperature", t)
        k = _int("top_k", self.top_k, -1)
        s(self, "top_k", 0 if k == -1 else k)
        p = _float("top_p", self.top_p)
        if not 0.0 < p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {p}")
        s(self, "top_p", p)
        if self.seed is not None:
            s(self, "seed", _int("seed", self.seed, 0, (1 << 64) - 1))
        if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
            raise TypeError("SamplingParams.stop_token_ids must be a sequence of ints")
        s(self, "stop_token_ids", tuple(_int("stop_token_ids[]", t, 0, MAX_TOKEN_ID) for t in self.stop_token_ids))
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            raise TypeError(f"SamplingParams.ignore_eos must be a bool, got {type(self.ignore_eos).__name__}")
        s(self, "ignore_eos", bool(self.ignore_eos))
        s(self, "priority", _int("priority", self.priority, -(1 << 63), (1 << 63) - 1))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # never run, or preempted by recompute (holds no blocks)
    RUNNING = "running"  # holds blocks in the KV cache manager
    SWAPPED = "swapped"  # preempted by swap: its KV sits in a host buffer
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in FINISHED

    @property
    def finish_reason(self) -> Optional[str]:
        return self.value if self in FINISHED else None


FINISHED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED})


@dataclass
class RequestMetrics:
    """Wall-clock times of one request (``time.monotonic()`` seconds); token times are shared, not copied."""

    arrival_time: float
    first_scheduled_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_preemptions: int = 0
    token_times: list[float] = field(default_factory=list, repr=False)

    @property
    def first_token_time(self) -> Optional[float]:
        return self.token_times[0] if self.token_times else None

    @property
    def last_token_time(self) -> Optional[float]:
        return self.token_times[-1] if self.token_times else None

    @property
    def time_to_first_token(self) -> Optional[float]:
        return self.token_times[0] - self.arrival_time if self.token_times else None

    def inter_token_latencies(self) -> list[float]:
        """Gaps between consecutive output tokens (seconds)."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


class Request:
    """One generation request as the scheduler tracks it.

    Token bookkeeping: ``all_token_ids`` = prompt + outputs. The KV cache manager holds the first
    ``num_kv_tokens`` of them (all, or all but the last sampled token, which is appended when the
    request is next scheduled), and ``num_computed_tokens`` of those have KV in the cache.
    """

    __slots__ = (
        "request_id", "prompt_token_ids", "params", "cache_salt", "prompt", "status", "output_token_ids",
        "all_token_ids", "num_computed_tokens", "num_kv_tokens", "num_cached_tokens", "seq_id", "metrics",
        "token_times", "generator", "swapped_computed", "num_sent", "_order", "stop_ids", "max_output",
        "final_only",
    )  # fmt: skip

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        seq_id: int,
        arrival_time: Optional[float] = None,
        cache_salt: Optional[Union[str, bytes]] = None,
        prompt: Optional[str] = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.cache_salt = cache_salt
        self.prompt = prompt
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_kv_tokens = 0
        self.num_cached_tokens: Optional[int] = None  # prefix-cache hit on first admission
        self.seq_id = seq_id
        self.metrics = RequestMetrics(time.monotonic() if arrival_time is None else arrival_time)
        self.token_times = self.metrics.token_times  # one monotonic time per output token
        self.generator: Optional[np.random.Generator] = None
        self.swapped_computed = 0  # tokens whose KV went to the host buffer on swap-out
        self.num_sent = 0  # output tokens already reported in a RequestOutput
        self._order = 0  # tie-breaker for the priority queue
        self.stop_ids: frozenset[int] = frozenset(params.stop_token_ids)  # the scheduler adds eos ids
        self.max_output = params.max_tokens  # the scheduler caps it by the context limit
        self.final_only = False  # the engine reports only the final output (as vLLM's generate does)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def finished(self) -> bool:
        return self.status in FINISHED

    @property
    def finish_reason(self) -> Optional[str]:
        return self.status.finish_reason

    def inter_token_latencies(self) -> list[float]:
        """Gaps between consecutive output tokens (seconds)."""
        return self.metrics.inter_token_latencies()

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, prompt={self.num_prompt_tokens}, "
            f"out={len(self.output_token_ids)}, computed={self.num_computed_tokens}/{self.num_kv_tokens})"
        )


class CompletionOutput:
    """One generated continuation (vLLM's ``CompletionOutput``); token_ids are cumulative.

    ``text`` is decoded on first access (``detokenize``), so steps nobody reads cost no decoding.
    """

    __slots__ = ("index", "token_ids", "finish_reason", "_text", "_detokenize")

    def __init__(
        self,
        index: int,
        text: Optional[str],
        token_ids: list[int],
        finish_reason: Optional[str] = None,
        detokenize: Optional[Callable[[list[int]], str]] = None,
    ) -> None:
        self.index = index
        self.token_ids = token_ids
        self.finish_reason = finish_reason
        self._text = text
        self._detokenize = detokenize

    @property
    def text(self) -> Optional[str]:
        if self._text is None and self._detokenize is not None:
            self._text = self._detokenize(self.token_ids)
        return self._text

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CompletionOutput):
            return NotImplemented
        return (self.index, self.text, self.token_ids, self.finish_reason) == (
            other.index, other.text, other.token_ids, other.finish_reason,
        )  # fmt: skip

    def __repr__(self) -> str:
        return (
            f"CompletionOutput(index={self.index}, text={self.text!r}, token_ids={self.token_ids}, "
            f"finish_reason={self.finish_reason!r})"
        )


@dataclass
class RequestOutput:
    """What a step (or a stream) reports for one request, shaped like vLLM's ``RequestOutput``.

    ``outputs[0].token_ids`` holds every output token so far; ``new_token_ids`` only this update's.
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    new_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    metrics: Optional[RequestMetrics] = None

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> Optional[str]:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> Optional[str]:
        return self.outputs[0].finish_reason

    @classmethod
    def from_request(cls, req: Request, detokenize: Optional[Callable[[list[int]], str]] = None) -> RequestOutput:
        """Snapshot of ``req``; the delta covers tokens not yet reported (and marks them reported)."""
        new = req.output_token_ids[req.num_sent :]
        req.num_sent = len(req.output_token_ids)
        out = CompletionOutput(0, None, list(req.output_token_ids), req.finish_reason, detokenize)
        return cls(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[out],
            finished=req.finished,
            new_token_ids=new,
            num_cached_tokens=req.num_cached_tokens or 0,
            metrics=req.metrics,
        )
