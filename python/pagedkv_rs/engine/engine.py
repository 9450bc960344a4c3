"""The engine loop: add / abort / step / generate / start / shutdown / stats; each hop has one owner.

A request moves forward only: ``input.check_request`` (the one door) -> ``Scheduler`` (decisions) -> ``ModelRunner``
(KV caches, swap space, KV tiers, forward, sampling) -> ``OutputProcessor`` (logprobs, stop strings, outputs) ->
``RequestStream`` (a lease: see ``stream``). Locking: ``_lock`` guards scheduler state, held briefly (``snapshot``
never waits for it); ``_step_lock`` serialises steps. The forward runs outside ``_lock``, tier I/O on the runner's
and the tiers' threads, so any thread may add or abort requests mid-step. A failure of the forward fails that step's
requests; a failure in a request's own post-processing fails only it. ``metrics``: bounded counters and histograms.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Optional, Union

import numpy as np

from pagedkv_rs import kernels
from pagedkv_rs._backend import manager_class
from pagedkv_rs.engine.draft import load_drafter
from pagedkv_rs.engine.input import CheckedRequest, check_request, prompt_list
from pagedkv_rs.engine.output import OutputProcessor
from pagedkv_rs.engine.request import RequestOutput, RequestStatus, SamplingParams, UnknownRequestError
from pagedkv_rs.engine.runner import Model, ModelRunner, check_model, check_speculative
from pagedkv_rs.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pagedkv_rs.engine.stream import RequestStream, check_lease, expire_leases, gather_finals, publish
from pagedkv_rs.engine.structured import GrammarCompiler
from pagedkv_rs.metrics import EngineMetrics

if TYPE_CHECKING:
    from pagedkv_rs.tiers import KVTiers

__all__ = ["Model", "LLMEngine", "RequestStream"]

Prompt = Union[str, Sequence[int]]


class LLMEngine:
    """Continuous batching with a paged KV cache over any ``Model``.

    ``stream_buffer`` (outputs) and ``stream_idle_timeout`` (seconds): the lease of ``submit()``
    streams (``engine.stream``). ``kv_tiers``: tier specs (or ``Tier`` objects) below the pool, in
    lookup order (``pagedkv_rs.tiers``), ``kv_tier_secret`` their MAC key, ``kv_tier_deadline`` the
    seconds one lookup may take.
    """

    def __init__(
        self,
        model: Model,
        *,
        num_blocks: int,
        block_size: int = 16,
        kv_cache_dtype: Any = "float32",
        backend: Any = "auto",
        enable_prefix_caching: bool = True,
        scheduler_config: Optional[SchedulerConfig] = None,
        tokenizer: Any = None,
        seed: int = 0,
        stream_buffer: int = 64,
        stream_idle_timeout: float = 30.0,
        kv_tiers: Optional[Sequence[Any]] = None,
        kv_tier_secret: Optional[Union[str, bytes]] = None,
        kv_tier_deadline: float = 0.5,
        **scheduler_kwargs: Any,
    ) -> None:
        vocab = check_model(model)
        check_lease(stream_buffer, stream_idle_timeout)
        if scheduler_config is not None and scheduler_kwargs:
            raise TypeError("pass either scheduler_config or scheduler keyword arguments, not both")
        self.model = model
        self.output = OutputProcessor(tokenizer)
        manager_cls = manager_class(backend)
        config = check_speculative(model, scheduler_config or SchedulerConfig(**scheduler_kwargs))
        drafter = load_drafter(config.speculative, model, manager_cls, block_size, kv_cache_dtype)  # checked first
        self.kv_manager = manager_cls(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
        self.backend = getattr(backend, "name", backend if isinstance(backend, str) else manager_cls.__module__)
        self.scheduler = Scheduler(
            self.kv_manager,
            config,
            eos_token_ids=model.eos_token_ids,
            max_model_len=model.max_model_len,
            vocab_size=int(vocab),
            kv_tiers=bool(kv_tiers),
            drafter=drafter,
        )
        self.runner = ModelRunner(
            model,
            num_blocks,
            block_size,
            kv_cache_dtype,
            kv_tiers=kv_tiers,
            kv_tier_secret=kv_tier_secret,
            kv_tier_deadline=kv_tier_deadline,
            seed=seed,
        )
        self.kv_caches: list[tuple[np.ndarray, np.ndarray]] = self.runner.kv_caches
        self.kv_tiers: Optional[KVTiers] = self.runner.kv_tiers
        self._streams: dict[str, RequestStream] = {}
        self._ids = itertools.count()
        self._lock = threading.RLock()
        self._step_lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        self._idle_steps = 0
        self._handled_error: Optional[BaseException] = None
        self.metrics = EngineMetrics()
        self.stream_buffer = stream_buffer
        self.stream_idle_timeout = float(stream_idle_timeout)
        self._clock = time.monotonic  # the lease clock (tests may replace it)
        self._limits = dataclasses.replace(self.scheduler.limits, **self.runner.unsupported)
        self._last_snapshot = (self.scheduler.stats(), self.kv_manager.stats())
        self.tokenizer = tokenizer

    @property
    def tokenizer(self) -> Any:
        """Encodes text prompts and decodes outputs (``encode`` / ``decode``), or None: token ids only."""
        return self.output.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: Any) -> None:
        self.output.tokenizer = tokenizer
        grammars = GrammarCompiler.of(tokenizer, self.model, self.metrics.record_compile)
        self._limits = dataclasses.replace(self._limits, tokenizer=tokenizer, grammars=grammars)

    # ------------------------------------------------------------------ requests
    def check_request(
        self, prompt: Any, params: Optional[SamplingParams] = None, *, request_id: Any = None, **fields: Any
    ) -> CheckedRequest:
        """Every submission check, changing nothing: ``engine.input.check_request`` against this engine.

        ``fields``: ``arrival_time``, ``cache_salt``. A ``CheckedRequest`` passes as is.
        """
        return check_request(prompt, params, limits=self._limits, request_id=request_id, **fields)

    def add_request(
        self,
        request_id: Optional[str],
        prompt: Union[Prompt, CheckedRequest],
        params: Optional[SamplingParams] = None,
        *,
        arrival_time: Optional[float] = None,
        cache_salt: Optional[Union[str, bytes]] = None,
    ) -> str:
        """Queue a request (token ids, text with a tokenizer, or a ``CheckedRequest``); returns its id."""
        checked = self.check_request(
            prompt, params, request_id=request_id, arrival_time=arrival_time, cache_salt=cache_salt
        )
        with self._lock:
            return self._add(checked)

    def _add(self, checked: CheckedRequest, stream: bool = False, final_only: bool = False) -> Any:
        """Queue (under ``_lock``); returns the request's id, or its stream (``stream``)."""
        if checked.request_id is None:
            rid = f"req-{next(self._ids)}"
            while rid in self.scheduler.requests:
                rid = f"req-{next(self._ids)}"
            checked = dataclasses.replace(checked, request_id=rid)
        req = self.scheduler.add_request(checked)
        req.final_only = final_only
        self.runner.add_generators(req, checked.grammar)
        self._wake.notify_all()
        if not stream:
            return req.request_id
        on_cancel = functools.partial(self._abort, cause="cancelled")
        s = self._streams[req.request_id] = RequestStream(
            req.request_id, self.stream_buffer, clock=lambda: self._clock(), on_cancel=on_cancel
        )
        return s

    def abort_request(self, request_id: str, reason: str = "abort") -> RequestOutput:
        """Abort an unfinished request at any status, freeing its blocks now; returns its final output.

        ``reason`` is the cause counted in ``metrics.aborted_by_cause`` (the server passes
        "client_disconnect", "timeout", ...).
        """
        if not isinstance(reason, str) or not reason:
            raise TypeError(f"abort reason must be a non-empty str, got {reason!r}")
        out = self._abort(request_id, reason)
        if out is None:
            raise UnknownRequestError(f"no unfinished request with id {request_id!r}")
        return out

    def _abort(self, request_id: str, cause: str = "abort") -> Optional[RequestOutput]:
        with self._lock:
            if not isinstance(request_id, str) or request_id not in self.scheduler.requests:
                return None
            req = self.scheduler.abort_request(request_id)
            req.abort_cause = cause
            self.runner.drop(req.group)
            out = self.output.output(req)
            self.metrics.record_finished(req, cause)
            publish(self._streams, [out])
            return out

    def queue_depth(self) -> int:
        """Requests not yet running: waiting, or waiting for their KV from the tiers (the server's bound)."""
        with self._lock:
            return self.scheduler.num_queued()

    @property
    def max_model_len(self) -> int:
        """The longest sequence a request may reach: the model's, the config's and the pool's limits."""
        return self.scheduler.max_model_len

    def has_unfinished_requests(self) -> bool:
        """Whether any request is unfinished (waiting, loading, running or swapped)."""
        with self._lock:
            return self.scheduler.has_unfinished_requests()

    # ---------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one forward pass; returns an output per request that got a token (``generate``'s: final only)."""
        with self._step_lock:
            t0 = time.perf_counter()
            with self._lock:
                self.scheduler.finish_loads(self.runner.finished_loads())
                so = self.scheduler.schedule(defer_drafts=True)
                if so is not None and so.kv_loads:
                    self.runner.start_loads(so.kv_loads)
                loading = self.runner.loads_in_flight() > 0
                if so is None and not loading:
                    self._idle_steps += 1
                    if self._idle_steps > 1 and self.scheduler.has_unfinished_requests():
                        raise RuntimeError(f"scheduler made no progress: {self.scheduler.stats()}")
                    return []
                self._idle_steps = 0
                if so is not None and so.batch is not None:
                    self.runner.apply_memory_ops(so)
                    inputs = self.runner.prepare(so)
            if so is not None and so.draft_plan is not None:  # a draft model's forwards, off _lock
                inputs = self._draft(so)
            if so is None or so.batch is None:  # only tier loads are under way: wait for one to end
                self.runner.wait_loads(0.05)
                return []
            try:
                result = self.runner.execute(inputs)
            except BaseException as e:
                self._fail_step(so, e)
                raise
            with self._lock:
                self.runner.store(so)
                changed = self.scheduler.update_from_output(so, result.tokens.tolist(), result.verified)
                heads, stopped, failed = self.output.process(so.samplers, changed, result)
                for r in stopped:
                    self.scheduler.finish_request(r, RequestStatus.FINISHED_STOPPED)
                for h in heads:
                    if h.group_finished:
                        self.metrics.record_finished(h)
                outputs = [self.output.output(h) for h in heads if h.group_finished or not h.final_only]
                publish(self._streams, outputs)
                for rid, err in failed.items():
                    self._fail_request(rid, err)
                self._expire_leases()
            self.metrics.record_step(time.perf_counter() - t0, result.mask_seconds)
            return outputs

    def _draft(self, so: SchedulerOutput) -> Any:
        """A step's draft-model forwards off ``_lock`` (a catch-up over a long prompt takes a prefill's time: requests
        are added and aborted meanwhile), then its inputs; a failure fails its requests, as the forward's does."""
        try:
            made, error = self.scheduler.spec.draft_for(so), None  # type: ignore[union-attr]
        except BaseException as e:
            made, error = None, e
        with self._lock:
            self.scheduler.finish_drafts(so, made)
            self.runner.apply_memory_ops(so)
            inputs = self.runner.prepare(so)
        if error is not None:
            self._fail_step(so, error)
            raise error
        return inputs

    def _fail_request(self, request_id: str, error: BaseException) -> None:
        """Abort one request (cause "error") and hand its stream the error."""
        stream = self._streams.pop(request_id, None)
        self._abort(request_id, "error")
        if stream is not None:
            stream._put(error)

    def _expire_leases(self) -> None:
        """Abort requests whose stream buffer has been full for longer than ``stream_idle_timeout``."""
        for rid in expire_leases(self._streams, self._clock(), self.stream_idle_timeout):
            self._abort(rid, "lease_expired")

    def _fail_step(self, so: SchedulerOutput, error: BaseException) -> None:
        """The forward failed: abort the step's requests and forget prefix hashes whose KV may be unwritten."""
        with self._lock:
            self._handled_error = error
            for rid in dict.fromkeys(r.head.request_id for r in so.requests):
                if rid in self.scheduler.requests:
                    self._fail_request(rid, error)
            self.kv_manager.reset_prefix_cache()

    def _fail_all(self, error: BaseException) -> None:
        """Abort every unfinished request, handing ``error`` to its stream."""
        with self._lock:
            for rid in list(self.scheduler.requests):
                self._fail_request(rid, error)

    # ------------------------------------------------------------- conveniences
    def generate(
        self,
        prompts: Union[Prompt, Mapping[str, Any], Sequence[Union[Prompt, Mapping[str, Any]]]],
        params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        *,
        use_tqdm: Optional[bool] = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion (stepping here, or alongside the background loop); outputs in order.

        A prompt is text, token ids, or vLLM's dict ``{"prompt": text}`` / ``{"prompt_token_ids": ids}``
        with an optional ``"cache_salt"``.
        """
        checked = [self.check_request(p, sp) for p, sp in prompt_list(prompts, params)]  # all before any is queued
        with self._lock:
            streams: list[RequestStream] = []
            try:
                for c in checked:
                    streams.append(self._add(c, stream=True, final_only=True))
            except BaseException:
                for s in streams:
                    s.cancel()
                raise
        return gather_finals(streams, self.step, use_tqdm=use_tqdm, background=lambda: self._thread is not None)

    # ---------------------------------------------------------- background loop
    def submit(
        self,
        prompt: Union[Prompt, CheckedRequest],
        params: Optional[SamplingParams] = None,
        *,
        request_id: Optional[str] = None,
        cache_salt: Optional[Union[str, bytes]] = None,
    ) -> RequestStream:
        """Queue a request on the background loop (started on first use); returns its output stream."""
        checked = self.check_request(prompt, params, request_id=request_id, cache_salt=cache_salt)
        self.start()
        with self._lock:
            return self._add(checked, stream=True)

    def start(self) -> None:
        """Start the background loop thread (idempotent)."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name="pagedkv-engine", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self.scheduler.has_work():
                    self._wake.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception as e:
                if e is not self._handled_error:  # not a model error already given to its step's requests
                    self._fail_all(e)

    @property
    def is_running(self) -> bool:
        """Whether the background loop thread is alive (``start()`` called and not shut down)."""
        t = self._thread
        return t is not None and t.is_alive()

    def shutdown(self, abort: bool = True) -> None:
        """Stop the background loop; abort what is left unless ``abort=False``."""
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if abort:
            with self._lock:
                for rid in list(self.scheduler.requests):
                    self._abort(rid, "shutdown")
        self.runner.shutdown()  # the loads in flight end
        with self._lock:
            self.scheduler.finish_loads(self.runner.finished_loads())

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # --------------------------------------------------------------------- stats
    def snapshot(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """Scheduler and KV-manager stats read together: fresh when the engine lock is free, else the last read."""
        if self._lock.acquire(blocking=False):  # a scrape never waits on a step
            try:
                self._last_snapshot = (self.scheduler.stats(), self.kv_manager.stats())
            finally:
                self._lock.release()
        return self._last_snapshot

    def stats(self) -> dict[str, Any]:
        """Scheduler and KV stats, running counters, and latencies (seconds; bounded, see ``metrics``).

        Means cover every finished request (histogram sums), medians the last ``metrics.recent_*``
        window. ``prefix_cache_queries`` / ``prefix_cache_hits`` count prompt tokens.
        """
        with self._lock:
            s = self.scheduler.stats(counters=True)
            s.update(self.metrics.summary(), backend=self.backend, kernels=kernels.kernel_source())
            if self.kv_tiers is not None:
                s["kv_tiers"] = self.kv_tiers.stats()
            return s
