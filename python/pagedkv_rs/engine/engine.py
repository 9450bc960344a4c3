"""The engine loop: schedule -> memory ops -> model forward -> sample -> update, plus streaming.

``LLMEngine`` owns one KV cache per model layer, a ``Scheduler`` over a ``KVCacheManager`` of either
allocator backend, and the host buffers of swapped-out requests. ``step()`` runs one forward pass;
``generate()`` runs a batch of prompts to completion; ``submit()`` hands a request to a background
loop thread and returns a ``RequestStream`` (blocking and async iterator of incremental outputs).

Locking: ``_lock`` guards scheduler state and is held only briefly; ``_step_lock`` serialises
steps. The forward runs outside ``_lock``, so any thread may add or abort requests mid-step: an
abort frees the request's blocks at once and its pending result is dropped.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, Optional, Protocol, Union, runtime_checkable

import numpy as np

from pagedkv_rs import kernels
from pagedkv_rs._backend import backend as allocator_backend
from pagedkv_rs.batch import BatchInputs
from pagedkv_rs.engine.request import (
    FINISHED,
    InvalidRequestError,
    Request,
    RequestOutput,
    SamplingParams,
    UnknownRequestError,
)
from pagedkv_rs.engine.sampling import sample
from pagedkv_rs.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

__all__ = ["Model", "LLMEngine", "RequestStream"]

Prompt = Union[str, Sequence[int]]


@runtime_checkable
class Model(Protocol):
    """What the engine needs from a model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]

    def forward(self, batch: BatchInputs, kv_caches: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
        """Float32 logits [batch.num_seqs, vocab_size] of each sequence's last scheduled token.

        Writes this step's K/V of every layer into ``kv_caches[layer]`` at ``batch.slot_mapping``
        (``write_kv``) and attends with ``paged_attention(q, k, v, batch.block_tables,
        batch.seq_lens, batch.query_start_loc)``.
        """
        ...


class RequestStream:
    """Incremental ``RequestOutput``s of one request: iterate (blocking) or ``async for``.

    The last item has ``finished=True``. Leaving the loop early (break + close, cancelling the
    task, or ``cancel()``) aborts the request.
    """

    def __init__(self, engine: LLMEngine, request_id: str) -> None:
        self.request_id = request_id
        self._engine = engine
        self._items: deque[Union[RequestOutput, BaseException]] = deque()
        self._cond = threading.Condition()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._event: Optional[asyncio.Event] = None
        self.finished = False

    def _put(self, item: Union[RequestOutput, BaseException]) -> None:
        with self._cond:
            if self.finished:
                return
            self.finished = isinstance(item, BaseException) or item.finished
            self._items.append(item)
            self._cond.notify_all()
            loop, event = self._loop, self._event
        if loop is not None and event is not None:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the consumer's loop is closed: nobody is listening
                pass

    def _take(self, timeout: Optional[float] = None) -> Union[RequestOutput, BaseException]:
        with self._cond:
            if not self._cond.wait_for(lambda: self._items, timeout):
                raise TimeoutError(f"request {self.request_id!r}: no output within {timeout} s")
            return self._items.popleft()

    def _drain(self) -> list[Union[RequestOutput, BaseException]]:
        with self._cond:
            items = list(self._items)
            self._items.clear()
            return items

    def __iter__(self) -> Iterator[RequestOutput]:
        return self._iter()

    def _iter(self) -> Iterator[RequestOutput]:
        try:
            while True:
                item = self._take()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self.cancel()

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._aiter()

    async def _aiter(self) -> AsyncIterator[RequestOutput]:
        with self._cond:
            self._loop = asyncio.get_running_loop()
            self._event = asyncio.Event()
        try:
            while True:
                with self._cond:
                    item = self._items.popleft() if self._items else None
                    if item is None:
                        self._event.clear()
                if item is None:
                    await self._event.wait()
                    continue
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self.cancel()

    def result(self, timeout: Optional[float] = None) -> RequestOutput:
        """Block until the request finishes; returns its final output."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            item = self._take(left)
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                return item

    def cancel(self) -> None:
        """Abort the request unless it already finished."""
        if not self.finished:
            self._engine._abort(self.request_id)


class LLMEngine:
    """Continuous batching with a paged KV cache over any ``Model``."""

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
        **scheduler_kwargs: Any,
    ) -> None:
        if not isinstance(model, Model):
            raise TypeError(f"model {type(model).__name__} does not implement the Model protocol")
        if scheduler_config is not None and scheduler_kwargs:
            raise TypeError("pass either scheduler_config or scheduler keyword arguments, not both")
        self.model = model
        self.tokenizer = tokenizer
        manager_cls = _manager_class(backend)
        self.kv_manager = manager_cls(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
        self.backend = getattr(backend, "name", backend if isinstance(backend, str) else manager_cls.__module__)
        self.scheduler = Scheduler(
            self.kv_manager,
            scheduler_config or SchedulerConfig(**scheduler_kwargs),
            eos_token_ids=model.eos_token_ids,
            max_model_len=model.max_model_len,
        )
        self.kv_caches: list[tuple[np.ndarray, np.ndarray]] = [
            kernels.new_kv_cache(num_blocks, block_size, model.num_kv_heads, model.head_dim, kv_cache_dtype)
            for _ in range(model.num_layers)
        ]
        self._host: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
        self._streams: dict[str, RequestStream] = {}
        self._rng = np.random.default_rng(seed)
        self._ids = itertools.count()
        self._lock = threading.RLock()
        self._step_lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        self._idle_steps = 0
        self._handled_error: Optional[BaseException] = None
        self._finished_metrics: deque[tuple[float, list[float]]] = deque(maxlen=100_000)

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: Optional[str],
        prompt: Prompt,
        params: Optional[SamplingParams] = None,
        *,
        arrival_time: Optional[float] = None,
        cache_salt: Optional[Union[str, bytes]] = None,
    ) -> str:
        """Queue a request (token ids, or text with a tokenizer); returns its id. Raises on bad input."""
        with self._lock:
            return self._add(request_id, prompt, params, arrival_time, cache_salt).request_id

    def _add(
        self,
        request_id: Optional[str],
        prompt: Prompt,
        params: Optional[SamplingParams],
        arrival_time: Optional[float],
        cache_salt: Any,
        stream: bool = False,
    ) -> Request:
        text = None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("a text prompt needs an engine with a tokenizer; pass token ids instead")
            text, prompt = prompt, _encode(self.tokenizer, prompt)
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
            while request_id in self.scheduler.requests:
                request_id = f"req-{next(self._ids)}"
        req = self.scheduler.add_request(
            request_id, prompt, params, arrival_time=arrival_time, cache_salt=cache_salt, prompt=text
        )
        if not req.params.greedy:
            seed = req.params.seed if req.params.seed is not None else int(self._rng.integers(1 << 63))
            req.generator = np.random.default_rng(seed)
        if stream:
            self._streams[req.request_id] = RequestStream(self, req.request_id)
        self._wake.notify_all()
        return req

    def abort_request(self, request_id: str) -> RequestOutput:
        """Abort an unfinished request at any status, freeing its blocks now; returns its final output."""
        out = self._abort(request_id)
        if out is None:
            raise UnknownRequestError(f"no unfinished request with id {request_id!r}")
        return out

    def _abort(self, request_id: str) -> Optional[RequestOutput]:
        with self._lock:
            if request_id not in self.scheduler.requests:
                return None
            req = self.scheduler.abort_request(request_id)
            self._host.pop(request_id, None)
            out = self._output(req)
            self._publish([out])
            return out

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return self.scheduler.has_unfinished_requests()

    # ---------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one forward pass; returns an output per request that got a token (``generate``'s: final only)."""
        with self._step_lock:
            with self._lock:
                so = self.scheduler.schedule()
                if so is None:
                    self._idle_steps += 1
                    if self._idle_steps > 1 and self.scheduler.has_unfinished_requests():
                        raise RuntimeError(f"scheduler made no progress: {self.scheduler.stats()}")
                    return []
                self._idle_steps = 0
                self._apply_memory_ops(so)
                rows = so.sample_rows
                to_sample = [so.requests[i] for i in rows]
                params = [r.params for r in to_sample]
                gens = [r.generator for r in to_sample]
            try:
                logits = self.model.forward(so.batch, self.kv_caches)
                if not isinstance(logits, np.ndarray) or logits.shape != (so.batch.num_seqs, self.model.vocab_size):
                    raise ValueError(
                        f"model.forward returned {getattr(logits, 'shape', type(logits))}, expected "
                        f"({so.batch.num_seqs}, {self.model.vocab_size})"
                    )
                if len(rows) < logits.shape[0]:
                    logits = logits[rows]
                tokens = sample(logits, params, gens) if rows else np.empty(0, np.int64)
            except BaseException as e:
                self._fail_step(so, e)
                raise
            with self._lock:
                changed = self.scheduler.update_from_output(so, tokens.tolist())
                outputs = [self._output(r) for r in changed if not r.final_only or r.status in FINISHED]
                for r in changed:
                    if r.status in FINISHED:
                        self._finished_metrics.append((r.metrics.time_to_first_token or 0.0, r.inter_token_latencies()))
                self._publish(outputs)
                return outputs

    def _apply_memory_ops(self, so: SchedulerOutput) -> None:
        """Swap-out, then swap-in, then copy-on-write copies, in every layer (before the forward)."""
        for s in so.swap_out:
            idx = np.asarray(s.block_ids, np.int64)
            self._host[s.request_id] = [(k[idx].copy(), v[idx].copy()) for k, v in self.kv_caches]
        for si in so.swap_in:
            host = self._host.pop(si.request_id)
            if si.block_ids:
                idx = np.asarray(si.block_ids, np.int64)
                src = slice(si.first, si.first + len(si.block_ids))
                for (k, v), (hk, hv) in zip(self.kv_caches, host):
                    k[idx] = hk[src]
                    v[idx] = hv[src]
        if so.copy_pairs:
            pairs = np.asarray(so.copy_pairs, np.int64)
            for k, v in self.kv_caches:
                kernels.copy_blocks(k, v, pairs)

    def _fail_step(self, so: SchedulerOutput, error: BaseException) -> None:
        """The forward failed: abort the step's requests and forget prefix hashes whose KV may be unwritten."""
        with self._lock:
            self._handled_error = error
            for r in so.requests:
                if r.request_id in self.scheduler.requests:
                    stream = self._streams.pop(r.request_id, None)
                    self._abort(r.request_id)
                    if stream is not None:
                        stream._put(error)
            self.kv_manager.reset_prefix_cache()

    def _fail_all(self, error: BaseException) -> None:
        """Abort every unfinished request, handing ``error`` to its stream."""
        with self._lock:
            for rid in list(self.scheduler.requests):
                stream = self._streams.pop(rid, None)
                self._abort(rid)
                if stream is not None:
                    stream._put(error)

    def _output(self, req: Request) -> RequestOutput:
        return RequestOutput.from_request(req, None if self.tokenizer is None else self.tokenizer.decode)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        for o in outputs:
            s = self._streams.get(o.request_id)
            if s is not None:
                s._put(o)
                if o.finished:
                    del self._streams[o.request_id]

    # ------------------------------------------------------------- conveniences
    def generate(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        *,
        use_tqdm: Optional[bool] = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion (stepping here, or alongside the background loop); outputs in order."""
        single = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], (int, np.integer)))
        plist_in: list[Prompt] = [prompts] if single else list(prompts)  # type: ignore[list-item, arg-type]
        plist = list(params) if isinstance(params, Sequence) else [params] * len(plist_in)
        if len(plist) != len(plist_in):
            raise ValueError(f"{len(plist_in)} prompts but {len(plist)} SamplingParams")
        with self._lock:
            streams = []
            try:
                for p, sp in zip(plist_in, plist):
                    req = self._add(None, p, sp, None, None, stream=True)
                    req.final_only = True
                    streams.append(self._streams[req.request_id])
            except BaseException:
                for s in streams:
                    s.cancel()
                raise
        bar = None
        if use_tqdm or (use_tqdm is None and len(streams) >= 64):
            from tqdm.auto import tqdm

            bar = tqdm(total=len(streams), desc="generate", unit="req")
        final: dict[str, RequestOutput] = {}
        pending = list(streams)
        try:
            while pending:
                self.step()
                for s in pending:
                    for item in s._drain():
                        if isinstance(item, BaseException):
                            raise item
                        if item.finished:
                            final[s.request_id] = item
                            if bar is not None:
                                bar.update(1)
                pending = [s for s in pending if s.request_id not in final]
                if self._thread is not None and pending:
                    time.sleep(0.0005)  # the background loop may hold the step
        finally:
            if bar is not None:
                bar.close()
            for s in streams:
                s.cancel()
        return [final[s.request_id] for s in streams]

    # ---------------------------------------------------------- background loop
    def submit(
        self,
        prompt: Prompt,
        params: Optional[SamplingParams] = None,
        *,
        request_id: Optional[str] = None,
        cache_salt: Optional[Union[str, bytes]] = None,
    ) -> RequestStream:
        """Queue a request on the background loop (started on first use); returns its output stream."""
        self.start()
        with self._lock:
            req = self._add(request_id, prompt, params, None, cache_salt, stream=True)
            return self._streams[req.request_id]

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
                while not self._stopping and not self.scheduler.has_unfinished_requests():
                    self._wake.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception as e:
                if e is not self._handled_error:  # not a model error already given to its step's requests
                    self._fail_all(e)

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
                    self._abort(rid)

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # --------------------------------------------------------------------- stats
    def stats(self) -> dict[str, Any]:
        """Scheduler and KV stats plus TTFT / inter-token latency over finished requests (seconds)."""
        with self._lock:
            s = self.scheduler.stats()
            ttft = [m[0] for m in self._finished_metrics]
            itl = [x for m in self._finished_metrics for x in m[1]]
            s["num_finished"] = len(ttft)
            s["mean_ttft_s"] = statistics.fmean(ttft) if ttft else None
            s["mean_itl_s"] = statistics.fmean(itl) if itl else None
            s["p50_itl_s"] = statistics.median(itl) if itl else None
            s["backend"] = self.backend
            s["kernels"] = kernels.kernel_source()
            return s


def _encode(tokenizer: Any, text: str) -> list[int]:
    enc = tokenizer.encode(text)
    return list(getattr(enc, "ids", enc))


def _manager_class(backend: Any) -> Any:
    if isinstance(backend, str):
        return allocator_backend(backend).KVCacheManager
    return getattr(backend, "KVCacheManager", backend)
