"""Request objects: sampling parameters, per-request state, and the outputs users see (vLLM shapes)."""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import numpy as np

from pagedkv_rs.engine.pooling import PoolingState
from pagedkv_rs.engine.structured import StructuredOutputsParams
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
    "StreamLeaseExpiredError",
    "Logprob",
    "LogprobRows",
    "LogprobsView",
    "MAX_LOGPROBS",
]

MAX_TOKEN_ID = (1 << 32) - 1
MAX_LOGPROBS = 20  # top-k logprobs per token (OpenAI's top_logprobs bound, vLLM's max_logprobs default)
MAX_N = 128  # completions per prompt


class InvalidRequestError(PagedKVError, ValueError):
    """A request was rejected at submission: empty prompt, prompt too long, bad token id, duplicate id.

    ``param`` names the request field at fault when one is (the server's error shape carries it).
    """

    def __init__(self, message: str, *, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.param = param


class UnknownRequestError(PagedKVError, LookupError):
    """No unfinished request has this id."""


class StreamLeaseExpiredError(PagedKVError, TimeoutError):
    """A stream's reader left its output buffer full past the engine's idle timeout: the request was aborted."""


def _int(name: str, value: object, lo: int, hi: Optional[int] = None) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"SamplingParams.{name} must be an int, got {type(value).__name__}")
    v = int(value.__index__())  # type: ignore[attr-defined]
    if v < lo or (hi is not None and v > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"SamplingParams.{name} must be {bound}, got {v}")
    return v


def _float(name: str, value: object, lo: float = -math.inf, hi: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"SamplingParams.{name} must be a number, got {type(value).__name__}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"SamplingParams.{name} must be finite, got {v}")
    if not lo <= v <= hi:
        raise ValueError(f"SamplingParams.{name} must be in [{lo}, {hi}], got {v}")
    return v


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"SamplingParams.{name} must be a bool, got {type(value).__name__}")
    return bool(value)


def _stop_strings(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if isinstance(items, bytes) or not hasattr(items, "__iter__"):
        raise TypeError(f"SamplingParams.stop must be a str or a list of str, got {type(value).__name__}")
    out = []
    for x in items:  # type: ignore[union-attr]
        if not isinstance(x, str):
            raise TypeError(f"SamplingParams.stop must be a str or a list of str, got an item {type(x).__name__}")
        if not x:
            raise ValueError("SamplingParams.stop strings must be non-empty")
        out.append(x)
    return tuple(out)


@dataclass(frozen=True)
class Logprob:
    """Log-probability of one token under the model's raw distribution; ``rank`` 1 = the most likely."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


class LogprobRows:
    """One request's logprob rows as growing arrays, until the API edge builds ``{token_id: Logprob}`` dicts.

    A row is the top k tokens and then the chosen one (``sampling.top_logprobs``): ids and ranks int32,
    logprobs float64 (the log-softmax as computed), ``width`` = k + 1 columns fixed by the first row.
    ``lead`` rows come first as None (prompt logprobs: the first prompt token has none). About 16 bytes
    per entry, where a dict of ``Logprob`` objects took ~500.
    """

    __slots__ = ("ids", "lps", "ranks", "n", "lead")

    def __init__(self, lead: int = 0) -> None:
        self.ids = np.empty((0, 0), np.int32)
        self.lps = np.empty((0, 0), np.float64)
        self.ranks = np.empty((0, 0), np.int32)
        self.n = 0
        self.lead = lead

    def __len__(self) -> int:
        return self.lead + self.n

    def append(self, ids: Sequence[int], lps: Sequence[float], ranks: Sequence[int]) -> None:
        """Add one row (its width must be the first row's)."""
        if self.n == len(self.ids):  # full: double (a row width fixed by the first row)
            w = len(ids) if self.n == 0 else self.ids.shape[1]
            cap = max(8, 2 * self.n)
            self.ids, self.lps, self.ranks = (
                np.concatenate([a, np.empty((cap - self.n, w), a.dtype)]) if self.n else np.empty((cap, w), a.dtype)
                for a in (self.ids, self.lps, self.ranks)
            )
        if len(ids) != self.ids.shape[1]:
            raise ValueError(f"a logprob row of {len(ids)} entries where the request's rows have {self.ids.shape[1]}")
        self.ids[self.n], self.lps[self.n], self.ranks[self.n] = ids, lps, ranks
        self.n += 1

    def truncate(self, size: int) -> None:
        """Keep the first ``size`` rows (lead rows included)."""
        self.n = max(0, min(self.n, size - self.lead))

    def view(self, decode: Optional[Callable[[list[int]], str]] = None) -> LogprobsView:
        """The rows so far as vLLM's list of dicts, built on access (later appends do not change it)."""
        return LogprobsView(self, self.n, decode)


class LogprobsView(Sequence):  # type: ignore[type-arg]
    """A read-only ``list[dict[int, Logprob]]`` (None for lead rows) over ``LogprobRows``: each dict is built
    when it is read, ``decoded_token`` by ``decode``; nothing is kept, so a request's logprobs stay arrays."""

    __slots__ = ("_ids", "_lps", "_ranks", "_lead", "_lo", "_hi", "_decode")

    def __init__(self, rows: LogprobRows, n: int, decode: Optional[Callable[[list[int]], str]], lo: int = 0) -> None:
        self._ids, self._lps, self._ranks, self._lead = rows.ids, rows.lps, rows.ranks, rows.lead
        self._lo, self._hi, self._decode = lo, rows.lead + n, decode

    def __len__(self) -> int:
        return self._hi - self._lo

    def _sub(self, lo: int, hi: int) -> LogprobsView:
        v = object.__new__(LogprobsView)
        v._ids, v._lps, v._ranks, v._lead, v._decode = self._ids, self._lps, self._ranks, self._lead, self._decode
        v._lo, v._hi = lo, hi
        return v

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                return [self[j] for j in range(start, stop, step)]
            return self._sub(self._lo + start, self._lo + max(start, stop))
        n = len(self)
        j = i.__index__()
        if not -n <= j < n:
            raise IndexError("logprobs index out of range")
        j = self._lo + (j % n) - self._lead
        if j < 0:
            return None
        dec = self._decode
        return {
            t: Logprob(lp, rk, None if dec is None else dec([t]))
            for t, lp, rk in zip(self._ids[j].tolist(), self._lps[j].tolist(), self._ranks[j].tolist())
        }

    def chosen_logprobs(self) -> list[float]:
        """Each row's last column: the logprob of the token the row was made for."""
        lo, hi = max(self._lo - self._lead, 0), self._hi - self._lead
        return self._lps[lo:hi, -1].tolist() if hi > lo else []

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(list(self))


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request; validated on construction.

    temperature 0 means greedy. top_k 0 (or -1), top_p 1.0 and min_p 0 disable those filters.
    A lower ``priority`` value is served earlier under the "priority" policy (as in vLLM).

    The rest follow vLLM: ``n`` completions of the prompt (its KV blocks shared through ``fork``);
    ``stop`` strings matched on the detokenized output across token boundaries (cut from the text
    unless ``include_stop_str_in_output``); ``logprobs`` / ``prompt_logprobs`` = k top tokens'
    log-probabilities (raw model distribution) per output / prompt token, plus the chosen token's;
    ``repetition_penalty`` (> 0, 1 = off; over prompt and output), ``presence_penalty`` and
    ``frequency_penalty`` (in [-2, 2], 0 = off; over the output); ``min_tokens`` masks EOS and stop
    tokens (and ignores stop strings) until that many tokens were generated. ``structured_outputs``
    constrains the output to a JSON schema, regex, choice or grammar (``StructuredOutputsParams``;
    logprobs stay those of the unconstrained distribution).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    priority: int = 0
    n: int = 1
    stop: Union[str, Sequence[str], None] = None
    include_stop_str_in_output: bool = False
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    structured_outputs: Optional[StructuredOutputsParams] = None

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
        s(self, "n", _int("n", self.n, 1, MAX_N))
        s(self, "stop", _stop_strings(self.stop))
        s(self, "include_stop_str_in_output", _bool("include_stop_str_in_output", self.include_stop_str_in_output))
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                s(self, name, _int(name, getattr(self, name), 0, MAX_LOGPROBS))
        s(self, "presence_penalty", _float("presence_penalty", self.presence_penalty, -2.0, 2.0))
        s(self, "frequency_penalty", _float("frequency_penalty", self.frequency_penalty, -2.0, 2.0))
        r = _float("repetition_penalty", self.repetition_penalty)
        if r <= 0:
            raise ValueError(f"SamplingParams.repetition_penalty must be > 0 (1 = off), got {r}")
        s(self, "repetition_penalty", r)
        s(self, "min_p", _float("min_p", self.min_p, 0.0, 1.0))
        s(self, "min_tokens", _int("min_tokens", self.min_tokens, 0))
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"SamplingParams.min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}"
            )
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise TypeError(
                f"SamplingParams.structured_outputs must be StructuredOutputsParams, got {type(so).__name__}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether the logits are changed before the argmax / draw (penalties or a min_tokens mask)."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or self.min_tokens > 0
        )


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # never run, or preempted by recompute (holds no blocks)
    RUNNING = "running"  # holds blocks in the KV cache manager
    SWAPPED = "swapped"  # preempted by swap: its KV sits in a host buffer
    WAITING_FOR_KV = "waiting_for_kv"  # admitted (holds blocks); the runner loads its prefix from the KV tiers
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
    """Wall-clock times of one request (``time.monotonic()`` seconds); token times are shared, not copied.

    Speculative decoding: ``num_drafts`` verifications of its drafts, ``num_draft_tokens`` drafted and
    ``num_accepted_tokens`` accepted.
    """

    arrival_time: float
    first_scheduled_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_preemptions: int = 0
    token_times: list[float] = field(default_factory=list, repr=False)
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

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
        "request_id",
        "prompt_token_ids",
        "params",
        "cache_salt",
        "prompt",
        "status",
        "output_token_ids",
        "all_token_ids",
        "num_computed_tokens",
        "num_kv_tokens",
        "num_cached_tokens",
        "seq_id",
        "metrics",
        "token_times",
        "generator",
        "swapped_computed",
        "num_sent",
        "_order",
        "stop_ids",
        "max_output",
        "final_only",
        "index",
        "head",
        "group",
        "pending_forks",
        "kv_salt",
        "stop_reason",
        "stop_text",
        "logprobs",
        "prompt_logprobs",
        "abort_cause",
        "block_hashes",
        "matcher",
        "pooling",
        "spec",
    )

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
        # n > 1: the head (index 0, the id users see) holds the group; the others fork its prompt's blocks
        self.index = 0
        self.head: Request = self
        self.group: tuple[Request, ...] = (self,)
        self.pending_forks: list[Request] = []  # completions not yet forked (the head's prompt still runs)
        self.kv_salt = cache_salt  # the salt the KV manager sees (unique for prompt_logprobs: no prefix hits)
        self.stop_reason: Union[str, int, None] = None  # the stop string or stop token id that finished it
        self.stop_text: Optional[str] = None  # output text once a stop string finished it
        self.logprobs: Optional[LogprobRows] = LogprobRows() if params.logprobs is not None else None
        # prompt logprobs: None for the first prompt token, then one row per position
        self.prompt_logprobs: Optional[LogprobRows] = (
            LogprobRows(lead=1) if params.prompt_logprobs is not None else None
        )
        self.abort_cause: Optional[str] = None
        self.block_hashes: list[bytes] = []  # chained hashes of its full blocks (KV tiers; filled lazily)
        self.matcher: Any = None  # structured outputs: this sequence's llguidance matcher
        self.pooling: Optional[PoolingState] = None  # a pooling request's progress (never sampled)
        self.spec: Any = None  # speculative decoding: its ``SpecState`` once it has drafted

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def computes_whole_prompt(self) -> bool:
        """Every prompt position must be computed (prompt logprobs, mean pooling): no prefix or tier hit."""
        return self.params.prompt_logprobs is not None or (self.pooling is not None and self.pooling.mean)

    @property
    def finished(self) -> bool:
        return self.status in FINISHED

    @property
    def finish_reason(self) -> Optional[str]:
        return self.status.finish_reason

    @property
    def group_finished(self) -> bool:
        if len(self.group) == 1:
            return self.status in FINISHED
        return all(m.status in FINISHED for m in self.group)

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

    ``stop_reason`` is the stop string or stop token id that finished it (None for EOS / length);
    ``logprobs`` (when asked for) holds one ``{token_id: Logprob}`` per output token: the top-k and
    the sampled token. While a request with stop strings runs, ``text`` holds back the last
    ``max(len(stop)) - 1`` characters (they may begin a stop string), as vLLM does.
    """

    __slots__ = (
        "index",
        "token_ids",
        "finish_reason",
        "_text",
        "_detokenize",
        "stop_reason",
        "logprobs",
        "new_token_ids",
        "_hold_back",
    )

    def __init__(
        self,
        index: int,
        text: Optional[str],
        token_ids: list[int],
        finish_reason: Optional[str] = None,
        detokenize: Optional[Callable[[list[int]], str]] = None,
        stop_reason: Union[str, int, None] = None,
        logprobs: Optional[Sequence[dict[int, Logprob]]] = None,
        new_token_ids: Optional[list[int]] = None,
        hold_back: int = 0,
    ) -> None:
        self.index = index
        self.token_ids = token_ids
        self.finish_reason = finish_reason
        self._text = text
        self._detokenize = detokenize
        self.stop_reason = stop_reason
        self.logprobs = logprobs
        self.new_token_ids = [] if new_token_ids is None else new_token_ids
        self._hold_back = hold_back

    @property
    def text(self) -> Optional[str]:
        if self._text is None and self._detokenize is not None:
            t = self._detokenize(self.token_ids)
            self._text = t[: max(0, len(t) - self._hold_back)] if self._hold_back else t
        return self._text

    @property
    def cumulative_logprob(self) -> Optional[float]:
        if self.logprobs is None:
            return None
        if isinstance(self.logprobs, LogprobsView):  # each row's last entry is its own token's
            return float(sum(self.logprobs.chosen_logprobs()))
        return float(sum(d[t].logprob for d, t in zip(self.logprobs, self.token_ids)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CompletionOutput):
            return NotImplemented
        return (self.index, self.text, self.token_ids, self.finish_reason) == (
            other.index,
            other.text,
            other.token_ids,
            other.finish_reason,
        )

    def __repr__(self) -> str:
        return (
            f"CompletionOutput(index={self.index}, text={self.text!r}, token_ids={self.token_ids}, "
            f"finish_reason={self.finish_reason!r}, stop_reason={self.stop_reason!r})"
        )


@dataclass
class RequestOutput:
    """What a step (or a stream) reports for one request, shaped like vLLM's ``RequestOutput``.

    ``outputs[0].token_ids`` holds every output token so far; ``new_token_ids`` only this update's
    (each ``CompletionOutput`` of an ``n > 1`` request has its own ``new_token_ids``).
    ``prompt_logprobs`` (when asked for): None for the first prompt token, then ``{token_id: Logprob}``.
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    new_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    metrics: Optional[RequestMetrics] = None
    prompt_logprobs: Optional[Sequence[Optional[dict[int, Logprob]]]] = None

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
        """Snapshot of ``req``'s group (one output per completion); deltas cover tokens not yet reported."""
        head = req.head
        hold = max(map(len, head.params.stop), default=1) - 1
        outs = []
        for m in head.group:
            new = m.output_token_ids[m.num_sent :]
            m.num_sent = len(m.output_token_ids)
            lps = None if m.logprobs is None else m.logprobs.view(detokenize)
            outs.append(
                CompletionOutput(
                    m.index,
                    m.stop_text,
                    list(m.output_token_ids),
                    m.finish_reason,
                    detokenize,
                    m.stop_reason,
                    lps,
                    new,
                    0 if m.finished else hold,
                )
            )
        return cls(
            request_id=head.request_id,
            prompt=head.prompt,
            prompt_token_ids=head.prompt_token_ids,
            outputs=outs,
            finished=head.group_finished,
            new_token_ids=outs[0].new_token_ids,
            num_cached_tokens=head.num_cached_tokens or 0,
            metrics=head.metrics,
            prompt_logprobs=None if head.prompt_logprobs is None else head.prompt_logprobs.view(detokenize),
        )
