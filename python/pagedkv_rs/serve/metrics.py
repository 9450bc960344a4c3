"""Prometheus metrics in vLLM's shape under ``pagedkv:``, one ``CollectorRegistry`` per app.

Gauges and the engine's cumulative counters are read from the scheduler and the KV manager at scrape
time; per-request histograms and counters are fed by the HTTP layer from each request's final
output (``RequestMetrics``: arrival, first scheduled, token times, finish). Step times are the
engine's own histogram (``LLMEngine.metrics.step_time``), read at scrape time, as are the structured-outputs
mask and compile times (``pagedkv:structured_mask_seconds``, ``pagedkv:structured_compile_seconds{cache}``).

``enable_vllm_names`` (``pagedkv serve --metrics-compat vllm``) also exports the series gateways and
dashboards read from vLLM under vLLM's names (``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``,
``vllm:prefix_cache_hits``, ``vllm:cache_config_info{block_size,num_gpu_blocks}``, ...): copies of the same
samples, renamed at scrape time, so both names always agree.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedkv_rs.metrics import ITL_BUCKETS, LATENCY_BUCKETS, TOKEN_BUCKETS

__all__ = ["ServerMetrics", "ABORT_CAUSES", "CONTENT_TYPE", "VLLM_NAMES"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ABORT_CAUSES = ("client_disconnect", "lease_expired", "timeout", "rejected", "shutdown", "error")
disable_created_metrics()  # as vLLM does: no *_created series beside each counter and histogram


class _EngineCollector(Collector):
    """Queue sizes, KV blocks and the engine's cumulative counters, read at scrape time."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self._engine = engine
        self._labels = {"model_name": model_name}

    def collect(self) -> Iterator[Metric]:
        eng = self._engine
        s, kv = eng.snapshot()  # one consistent snapshot; never waits for the engine lock
        lab, val = list(self._labels), list(self._labels.values())

        def gauge(name: str, doc: str, value: float) -> Metric:
            g = GaugeMetricFamily(f"pagedkv:{name}", doc, labels=lab)
            g.add_metric(val, value)
            return g

        def counter(name: str, doc: str, value: float) -> Metric:
            c = CounterMetricFamily(f"pagedkv:{name}", doc, labels=lab)
            c.add_metric(val, value)
            return c

        yield gauge("num_requests_running", "Requests holding KV blocks", s["num_running"])
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled", s["num_waiting"])
        yield gauge("num_requests_swapped", "Requests whose KV is swapped to host memory", s["num_swapped"])
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = 100%)", s["kv_usage"])
        blocks = GaugeMetricFamily("pagedkv:kv_cache_blocks", "KV blocks by state", labels=[*lab, "state"])
        for state in ("live", "cached", "free"):
            blocks.add_metric([*val, state], kv[f"{state}_blocks"])
        yield blocks
        yield counter("num_preemptions", "Preemptions (recompute or swap)", s["num_preemptions"])
        yield counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache", kv.get("prefix_query_tokens", 0)
        )
        yield counter("prefix_cache_hits", "Prompt tokens served from the prefix cache", kv.get("prefix_hit_tokens", 0))
        yield counter("kv_block_evictions", "Cached free blocks reused for new content", kv.get("evictions", 0))
        yield counter("engine_steps", "Engine steps (forward passes)", s["num_steps"])
        yield counter("kv_block_allocations", "Blocks taken off the free list", kv["block_allocations"])
        if "spec_decode_num_drafts" in s:  # speculative decoding, vLLM's spec_decode counters
            yield counter("spec_decode_num_drafts", "Verifications of drafts", s["spec_decode_num_drafts"])
            yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed", s["spec_decode_num_draft_tokens"])
            yield counter(
                "spec_decode_num_accepted_tokens", "Draft tokens accepted", s["spec_decode_num_accepted_tokens"]
            )
        steps = eng.metrics.snapshot_histogram("step_time")
        h = HistogramMetricFamily("pagedkv:engine_step_seconds", "Duration of one engine step", labels=lab)
        h.add_metric(val, [(_le(le), n) for le, n in steps["buckets"]], steps["sum"])
        yield h
        mask = eng.metrics.snapshot_histogram("mask_time")
        h = HistogramMetricFamily(
            "pagedkv:structured_mask_seconds", "Grammar masks of one step's constrained rows", labels=lab
        )
        h.add_metric(val, [(_le(le), n) for le, n in mask["buckets"]], mask["sum"])
        yield h
        h = HistogramMetricFamily(
            "pagedkv:structured_compile_seconds", "An output constraint's compile at admission", labels=[*lab, "cache"]
        )
        for cache in ("cold", "warm"):
            snap = eng.metrics.snapshot_histogram(f"compile_{cache}")
            h.add_metric([*val, cache], [(_le(le), n) for le, n in snap["buckets"]], snap["sum"])
        yield h


def _le(le: float) -> str:
    return "+Inf" if le == float("inf") else repr(float(le))


# pagedkv:NAME -> the vLLM names of the same series (v1 engine; a few older aliases dashboards still use)
VLLM_NAMES = {
    "num_requests_running": ("num_requests_running",),
    "num_requests_waiting": ("num_requests_waiting",),
    "num_requests_swapped": ("num_requests_swapped",),
    "kv_cache_usage_perc": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
    "num_preemptions": ("num_preemptions",),
    "prefix_cache_queries": ("prefix_cache_queries",),
    "prefix_cache_hits": ("prefix_cache_hits",),
    "prompt_tokens": ("prompt_tokens",),
    "generation_tokens": ("generation_tokens",),
    "request_success": ("request_success",),
    "time_to_first_token_seconds": ("time_to_first_token_seconds",),
    "inter_token_latency_seconds": ("inter_token_latency_seconds", "time_per_output_token_seconds"),
    "e2e_request_latency_seconds": ("e2e_request_latency_seconds",),
    "request_queue_time_seconds": ("request_queue_time_seconds",),
    "request_prompt_tokens": ("request_prompt_tokens",),
    "request_generation_tokens": ("request_generation_tokens",),
}


def _renamed(m: Metric, name: str) -> Metric:
    """A copy of a metric family (samples included) under another family name."""
    out = Metric(name, m.documentation, m.type, m.unit)
    out.samples = [s._replace(name=name + s.name[len(m.name) :]) for s in m.samples]
    return out


class _VllmNames(Collector):
    """vLLM's names for the series the sources yield (same snapshot, renamed), and ``vllm:cache_config_info``."""

    def __init__(self, sources: list[Any], model_name: str, cache_info: dict[str, str]) -> None:
        self._sources = sources
        self._model = model_name
        self._cache_info = cache_info

    def collect(self) -> Iterator[Metric]:
        for src in self._sources:
            for m in src.collect():
                for alias in VLLM_NAMES.get(m.name.removeprefix("pagedkv:"), ()):
                    yield _renamed(m, f"vllm:{alias}")
        info = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the KV cache config", labels=["model_name", *self._cache_info]
        )
        info.add_metric([self._model, *self._cache_info.values()], 1.0)
        yield info


class _KVEventsCollector(Collector):
    """The KV-events publisher's counters (``pagedkv serve --kv-events-endpoint``)."""

    COUNTERS = (
        ("batches", "KV event batches published"),
        ("events", "KV events published (BlockStored, BlockRemoved, AllBlocksCleared)"),
        ("dropped_batches", "KV event batches dropped because the publisher's queue was full"),
    )

    def __init__(self, publisher: Any, model_name: str) -> None:
        self._pub = publisher
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        stats = dict(self._pub.stats)
        for key, doc in self.COUNTERS:
            c = CounterMetricFamily(f"pagedkv:kv_events_{key}", doc, labels=["model_name"])
            c.add_metric([self._model], stats[key])
            yield c


class _TierCollector(Collector):
    """Per KV tier (label ``tier``: the spec without options or credentials): counters and lookup latency."""

    COUNTERS = (
        ("lookups", "Batched tier lookups at admission"),
        ("hit_blocks", "Blocks loaded from the tier"),
        ("hit_tokens", "Prompt tokens loaded from the tier"),
        ("miss_blocks", "Blocks asked of the tier and not served by it"),
        ("verify_failures", "Tier records that failed verification (used as misses)"),
        ("errors", "Tier operations that failed (connection, timeout, I/O)"),
        ("timeouts", "Lookups cut short by their deadline"),
        ("late_results", "Lookups that ended after their request stopped waiting (results dropped)"),
        ("stored_blocks", "Blocks handed to the tier's writer and written"),
        ("store_drops", "Blocks not stored because the writer's queue was full"),
        ("store_failures", "Blocks not stored because the write failed (full disk, server gone)"),
        ("bytes_read", "Record bytes read from the tier"),
        ("bytes_written", "Record bytes written to the tier"),
    )

    def __init__(self, tiers: Any, model_name: str) -> None:
        self._tiers = tiers
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self._tiers.stats()
        labels = ["model_name", "tier"]
        for key, doc in self.COUNTERS:
            c = CounterMetricFamily(f"pagedkv:kv_tier_{key}", doc, labels=labels)
            for name, st in stats.items():
                c.add_metric([self._model, name], st[key])
            yield c
        h = HistogramMetricFamily("pagedkv:kv_tier_lookup_seconds", "Duration of one tier lookup", labels=labels)
        for name, st in stats.items():
            hist = st["lookup_seconds"]
            buckets = [(_le(le), n) for le, n in hist["buckets"]]
            h.add_metric([self._model, name], buckets, hist["sum"])
        yield h


class ServerMetrics:
    """Every metric the server exposes, in its own registry."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):  # process_*, python_*
            self.registry.register(collector)  # prometheus_client's own instances: one gc callback per process
        self._engine_collector = _EngineCollector(engine, model_name)
        self.registry.register(self._engine_collector)
        self._engine = engine
        if getattr(engine, "kv_tiers", None) is not None:
            self.registry.register(_TierCollector(engine.kv_tiers, model_name))
        r, lab = self.registry, ["model_name"]
        self._name = model_name

        self._families: list[Any] = []  # the request-fed families, for enable_vllm_names

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            h = Histogram(f"pagedkv:{name}", doc, lab, buckets=buckets, registry=r)
            self._families.append(h)
            return h.labels(model_name)

        def counter(name: str, doc: str, labels: list[str]) -> Any:
            c = Counter(f"pagedkv:{name}", doc, labels, registry=r)
            self._families.append(c)
            return c

        self.prompt_tokens = counter("prompt_tokens", "Prefill tokens processed", lab).labels(model_name)
        self.generation_tokens = counter("generation_tokens", "Generated tokens", lab).labels(model_name)
        self._success = counter("request_success", "Requests finished by the engine", [*lab, "finished_reason"])
        self._aborted = Counter("pagedkv:request_aborted", "Requests aborted, by cause", [*lab, "cause"], registry=r)
        for cause in ABORT_CAUSES:
            self._aborted.labels(model_name, cause)
        for reason in ("stop", "length"):
            self._success.labels(model_name, reason)
        self.ttft = hist("time_to_first_token_seconds", "Time to first token", LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish", LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled", LATENCY_BUCKETS)
        self.req_prompt = hist("request_prompt_tokens", "Prompt tokens per request", TOKEN_BUCKETS)
        self.req_generation = hist("request_generation_tokens", "Generated tokens per request", TOKEN_BUCKETS)

    def enable_vllm_names(self, block_size: int, num_blocks: int) -> None:
        """Also export vLLM's names for the same series (``--metrics-compat vllm``)."""
        caching = bool(self._engine.kv_manager.enable_prefix_caching)
        info = {"block_size": str(block_size), "num_gpu_blocks": str(num_blocks), "enable_prefix_caching": str(caching)}
        sources = [self._engine_collector, *self._families]
        self.registry.register(_VllmNames(sources, self._name, info))

    def add_kv_events(self, publisher: Any) -> None:
        """Export the KV-events publisher's counters."""
        self.registry.register(_KVEventsCollector(publisher, self._name))

    def aborted(self, cause: str) -> None:
        self._aborted.labels(self._name, cause).inc()

    def finished(self, out: Any) -> None:
        """Record one engine request's final output (finished by the engine: stop or length)."""
        m = out.metrics
        n_out = sum(len(c.token_ids) for c in out.outputs) if isinstance(out.outputs, list) else 0  # 0: embeddings
        self.req_prompt.observe(len(out.prompt_token_ids))
        self.req_generation.observe(n_out)
        if out.finish_reason in ("stop", "length"):
            self._success.labels(self._name, out.finish_reason).inc()
        if m is None:
            return
        if m.first_scheduled_time is not None:
            self.queue.observe(m.first_scheduled_time - m.arrival_time)
        t = m.token_times
        if t:
            self.ttft.observe(t[0] - m.arrival_time)
            obs = self.itl.observe
            for a, b in zip(t, t[1:]):
                obs(b - a)
        end = m.finished_time if m.finished_time is not None else time.monotonic()
        self.e2e.observe(end - m.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)
