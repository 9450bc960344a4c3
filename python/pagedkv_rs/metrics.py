"""Bounded metrics: fixed-bucket histograms, running counters, and a recent window for medians.

Neutral ground below the engine, the tiers and the server: it imports nothing of the package.

Nothing here grows with the number of requests served: a ``Histogram`` is a fixed list of bucket
counts plus a sum, a counter is an int (or a dict of ints keyed by a small set of labels), and the
recent window holds the last ``window`` observations. An exporter (``pagedkv serve``'s Prometheus
endpoint) reads ``EngineMetrics.snapshot()`` or the objects themselves under ``EngineMetrics.lock``;
the buckets are cumulative-ready (``Histogram.cumulative()``), as Prometheus expects.
"""

from __future__ import annotations

import bisect
import math
import statistics
import threading
from collections import Counter, deque
from collections.abc import Sequence
from typing import Any, Optional

__all__ = ["Histogram", "EngineMetrics", "LATENCY_BUCKETS", "ITL_BUCKETS", "TOKEN_BUCKETS", "GRAMMAR_BUCKETS"]

# vLLM's bucket edges (seconds / tokens), so dashboards built for vLLM read these unchanged
LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
# vLLM's ITL edges start at 10 ms; a CPU decode step is often shorter, so finer edges come first
ITL_BUCKETS = (
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
# structured outputs: a step's masks take tens of microseconds to milliseconds, a grammar build up to seconds
GRAMMAR_BUCKETS = (
    1e-5,
    2.5e-5,
    5e-5,
    7.5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    7.5e-4,
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class Histogram:
    """Counts of observations per fixed bucket (upper bounds ``le``; one overflow bucket), plus sum and count."""

    __slots__ = ("buckets", "counts", "sum", "count")

    def __init__(self, buckets: Sequence[float]) -> None:
        b = tuple(float(x) for x in buckets)
        if not b or list(b) != sorted(set(b)) or not all(math.isfinite(x) for x in b):
            raise ValueError("Histogram buckets must be finite, strictly increasing and non-empty")
        self.buckets = b
        self.counts = [0] * (len(b) + 1)  # the last one counts observations above buckets[-1] (+Inf)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[float, int]]:
        """``(le, observations <= le)`` for each bucket, ending with ``(inf, count)``."""
        out, acc = [], 0
        for le, c in zip((*self.buckets, math.inf), self.counts):
            acc += c
            out.append((le, acc))
        return out

    @property
    def mean(self) -> Optional[float]:
        return self.sum / self.count if self.count else None

    def snapshot(self) -> dict[str, Any]:
        return {"buckets": self.cumulative(), "sum": self.sum, "count": self.count}


class EngineMetrics:
    """Every running counter and histogram of one engine (all bounded); updated under ``lock``.

    Counters: ``finished_by_reason`` ("stop" | "length" | "abort"), ``aborted_by_cause`` (the
    ``reason`` given to ``LLMEngine.abort_request``: "abort" by default, "cancelled" for a stream
    left early, "lease_expired", "error", "shutdown", and whatever the server passes:
    "client_disconnect", "timeout", "rejected" -- see ``record_abort``), ``prompt_tokens`` and
    ``generation_tokens`` (of finished requests), ``num_preemptions``, ``prefix_cache_queries`` and
    ``prefix_cache_hits`` (tokens; read from the KV manager), ``num_steps``.
    Histograms (seconds or tokens): ``ttft``, ``itl``, ``e2e``, ``queue_time``, ``step_time``,
    ``prompt_len``, ``generation_len``; structured outputs: ``mask_time`` (a step's grammar masks, steps
    with a constrained row only), ``compile_cold`` / ``compile_warm`` (a constraint's compile at the
    door: built, or found in the cache). ``recent_itl`` / ``recent_ttft`` keep the last ``window``
    values for medians.
    """

    def __init__(self, window: int = 4096) -> None:
        self.lock = threading.Lock()
        self.finished_by_reason: Counter[str] = Counter()
        self.aborted_by_cause: Counter[str] = Counter()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(LATENCY_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(LATENCY_BUCKETS)
        self.queue_time = Histogram(LATENCY_BUCKETS)
        self.step_time = Histogram(ITL_BUCKETS)
        self.prompt_len = Histogram(TOKEN_BUCKETS)
        self.generation_len = Histogram(TOKEN_BUCKETS)
        self.mask_time = Histogram(GRAMMAR_BUCKETS)
        self.compile_cold = Histogram(GRAMMAR_BUCKETS)
        self.compile_warm = Histogram(GRAMMAR_BUCKETS)
        self.recent_ttft: deque[float] = deque(maxlen=window)
        self.recent_itl: deque[float] = deque(maxlen=window)

    @property
    def num_finished(self) -> int:
        """Requests that finished by stop or length (aborted ones are in ``finished_by_reason["abort"]``)."""
        return sum(n for reason, n in self.finished_by_reason.items() if reason != "abort")

    def record_abort(self, cause: str) -> None:
        """Count an abort (or a request rejected before it reached the engine) under ``cause``."""
        if not isinstance(cause, str) or not cause:
            raise TypeError(f"abort cause must be a non-empty str, got {cause!r}")
        with self.lock:
            self.aborted_by_cause[cause] += 1

    def record_finished(self, req: Any, cause: Optional[str] = None) -> None:
        """Fold one finished request (its group's completions) into the aggregates; ``cause``: why it was aborted."""
        m = req.metrics
        generated = sum(len(c.output_token_ids) for c in req.group)
        with self.lock:
            self.finished_by_reason[req.finish_reason] += 1
            if cause is not None:
                self.aborted_by_cause[cause] += 1
            self.prompt_tokens += req.num_prompt_tokens
            self.generation_tokens += generated
            self.prompt_len.observe(req.num_prompt_tokens)
            self.generation_len.observe(generated)
            if m.first_scheduled_time is not None:
                self.queue_time.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
            if m.finished_time is not None:
                self.e2e.observe(max(0.0, m.finished_time - m.arrival_time))
            ttft = m.time_to_first_token
            if ttft is not None:
                self.ttft.observe(ttft)
                self.recent_ttft.append(ttft)
            for c in req.group:
                for x in c.metrics.inter_token_latencies():
                    self.itl.observe(x)
                    self.recent_itl.append(x)

    def record_step(self, seconds: float, mask_seconds: Optional[float] = None) -> None:
        with self.lock:
            self.step_time.observe(seconds)
            if mask_seconds is not None:
                self.mask_time.observe(mask_seconds)

    def record_compile(self, seconds: float, cold: bool) -> None:
        """One structured-outputs constraint compiled (``cold``) or found in the compile cache."""
        with self.lock:
            (self.compile_cold if cold else self.compile_warm).observe(seconds)

    def summary(self) -> dict[str, Any]:
        """The ``LLMEngine.stats()`` latency keys (means over every finished request, medians over the window)."""
        with self.lock:
            itl = list(self.recent_itl)
            ttft = list(self.recent_ttft)
            return {
                "num_finished": self.num_finished,
                "mean_ttft_s": self.ttft.mean,
                "mean_itl_s": self.itl.mean,
                "p50_ttft_s": statistics.median(ttft) if ttft else None,
                "p50_itl_s": statistics.median(itl) if itl else None,
                "finished_by_reason": dict(self.finished_by_reason),
                "aborted_by_cause": dict(self.aborted_by_cause),
                "prompt_tokens": self.prompt_tokens,
                "generation_tokens": self.generation_tokens,
            }

    def snapshot_histogram(self, name: str) -> dict[str, Any]:
        """One histogram's snapshot (``{"buckets": [(le, cumulative)], "sum", "count"}``), read under the lock."""
        with self.lock:
            return getattr(self, name).snapshot()

    def snapshot(self) -> dict[str, Any]:
        """Counters and histogram snapshots (``{"buckets": [(le, cumulative)], "sum", "count"}``)."""
        s = self.summary()
        with self.lock:
            for name in (
                "ttft",
                "itl",
                "e2e",
                "queue_time",
                "step_time",
                "prompt_len",
                "generation_len",
                "mask_time",
                "compile_cold",
                "compile_warm",
            ):
                s[f"hist_{name}"] = getattr(self, name).snapshot()
        return s
