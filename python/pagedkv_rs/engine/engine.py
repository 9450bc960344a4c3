"""The engine loop: schedule -> memory ops -> model forward -> sample -> update, plus streaming.

``LLMEngine`` owns one KV cache per model layer, a ``Scheduler`` over a ``KVCacheManager`` of either
allocator backend, and the host buffers of swapped-out requests. ``step()`` runs one forward pass;
``generate()`` runs a batch of prompts to completion; ``submit()`` hands a request to a background
loop thread and returns a ``RequestStream`` (blocking and async iterator of incremental outputs).

Locking: ``_lock`` guards scheduler state and is held only briefly; ``_step_lock`` serialises
steps. The forward runs outside ``_lock``, so any thread may add or abort requests mid-step: an
abort frees the request's blocks at once and its pending result is dropped.

Isolation: every request is checked completely at submission (``Scheduler.check_request``:
types, ranges, token ids against ``model.vocab_size``, lengths); nothing changes on rejection.
A failure of the forward or of the batched sampling fails that step's requests; a failure in a
request's own post-processing (detokenizing for stop strings, decoding logprob tokens) fails
only that request.

Streams are leases: each ``submit()`` stream buffers at most ``stream_buffer`` outputs (later
ones are merged into the last); if the buffer stays full for ``stream_idle_timeout`` seconds the
request is aborted with cause "lease_expired", its blocks are freed, and the stream raises
``StreamLeaseExpiredError``.

Metrics: ``self.metrics`` (``pagedkv_rs.metrics.EngineMetrics``) holds bounded counters and
fixed-bucket histograms; ``stats()`` reports them with the scheduler's and the KV manager's.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Optional, Protocol, Union, runtime_checkable

import numpy as np

from pagedkv_rs import kernels
from pagedkv_rs._backend import backend as allocator_backend
from pagedkv_rs.batch import BatchInputs
from pagedkv_rs.engine.input import CheckedRequest, check_request, check_request_id
from pagedkv_rs.engine.request import (
    Logprob,
    Request,
    RequestOutput,
    RequestStatus,
    SamplingParams,
    StreamLeaseExpiredError,
    UnknownRequestError,
)
from pagedkv_rs.engine.sampling import sample, top_logprobs
from pagedkv_rs.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pagedkv_rs.engine.stream import RequestStream, wake_all
from pagedkv_rs.metrics import EngineMetrics

if TYPE_CHECKING:
    import asyncio  # imported where a stream is read asynchronously: ~45 ms of start-up otherwise

    from pagedkv_rs.tiers import KVTiers

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
        batch.seq_lens, batch.query_start_loc)``. A model whose forward also takes
        ``logits_indices`` (int [N] into the step's tokens; returns [N, vocab_size]) serves
        ``prompt_logprobs`` requests.
        """
        ...


class LLMEngine:
    """Continuous batching with a paged KV cache over any ``Model``.

    ``stream_buffer`` (outputs) and ``stream_idle_timeout`` (seconds) set the lease of
    ``submit()`` streams (see the module docstring). ``kv_tiers``: tier specs (or ``Tier`` objects)
    below the pool, in lookup order (``pagedkv_rs.tiers``; the model needs a ``kv_fingerprint()``),
    ``kv_tier_secret`` their MAC key, ``kv_tier_deadline`` the seconds one admission lookup may take.
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
        if not isinstance(model, Model):
            raise TypeError(f"model {type(model).__name__} does not implement the Model protocol")
        vocab = getattr(model, "vocab_size", None)
        if isinstance(vocab, bool) or not isinstance(vocab, (int, np.integer)) or vocab < 1:
            raise TypeError(f"model.vocab_size must be a positive int, got {vocab!r}")
        if isinstance(stream_buffer, bool) or not isinstance(stream_buffer, int) or stream_buffer < 1:
            raise ValueError(f"stream_buffer must be an int >= 1, got {stream_buffer!r}")
        if not isinstance(stream_idle_timeout, (int, float)) or not stream_idle_timeout >= 0:
            raise ValueError(f"stream_idle_timeout must be a number of seconds >= 0, got {stream_idle_timeout!r}")
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
            vocab_size=int(vocab),
        )
        self.kv_caches: list[tuple[np.ndarray, np.ndarray]] = [
            kernels.new_kv_cache(num_blocks, block_size, model.num_kv_heads, model.head_dim, kv_cache_dtype)
            for _ in range(model.num_layers)
        ]
        self._host: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
        self.kv_tiers: Optional[KVTiers] = None
        if kv_tiers:
            self.kv_tiers = _make_tiers(model, self.kv_caches, block_size, kv_tiers, kv_tier_secret, kv_tier_deadline)
            self.scheduler.tier_loader = self._tier_load
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
        self.metrics = EngineMetrics()
        self.stream_buffer = stream_buffer
        self.stream_idle_timeout = float(stream_idle_timeout)
        self._clock = time.monotonic  # the lease clock (tests may replace it)
        try:
            self._logits_indices = "logits_indices" in inspect.signature(model.forward).parameters
        except (TypeError, ValueError):  # pragma: no cover - a builtin forward without a signature
            self._logits_indices = False
        no_plp = f"model {type(model).__name__}.forward takes no logits_indices"
        self._limits = dataclasses.replace(
            self.scheduler.limits, tokenizer=tokenizer, prompt_logprobs=None if self._logits_indices else no_plp
        )

    # ------------------------------------------------------------------ requests
    def check_request(
        self,
        prompt: Any,
        params: Optional[SamplingParams] = None,
        *,
        request_id: Optional[str] = None,
        arrival_time: Optional[float] = None,
        cache_salt: Optional[Union[str, bytes]] = None,
    ) -> CheckedRequest:
        """Every submission check, changing nothing (``engine.input.check_request`` against this engine)."""
        if self._limits.tokenizer is not self.tokenizer:
            self._limits = dataclasses.replace(self._limits, tokenizer=self.tokenizer)
        return check_request(
            prompt,
            params,
            limits=self._limits,
            request_id=request_id,
            arrival_time=arrival_time,
            cache_salt=cache_salt,
        )

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
        checked = self._checked(prompt, params, request_id=request_id, arrival_time=arrival_time, cache_salt=cache_salt)
        with self._lock:
            return self._add(checked).request_id

    def _checked(self, prompt: Any, params: Any, **fields: Any) -> CheckedRequest:
        """``prompt`` checked now, or as ``check_request`` returned it (then it carries every field)."""
        if not isinstance(prompt, CheckedRequest):
            return self.check_request(prompt, params, **fields)
        rid = fields.pop("request_id", None)
        if params is not None or any(v is not None for v in fields.values()):
            raise TypeError("a CheckedRequest carries its params, arrival_time and cache_salt")
        if rid is None:
            return prompt
        if prompt.request_id is not None:
            raise TypeError(f"the CheckedRequest is already named {prompt.request_id!r}")
        return dataclasses.replace(prompt, request_id=check_request_id(rid))

    def _add(self, checked: CheckedRequest, stream: bool = False) -> Request:
        if checked.request_id is None:
            rid = f"req-{next(self._ids)}"
            while rid in self.scheduler.requests:
                rid = f"req-{next(self._ids)}"
            checked = dataclasses.replace(checked, request_id=rid)
        req = self.scheduler.add_request(checked)
        if not req.params.greedy:
            seed = req.params.seed if req.params.seed is not None else int(self._rng.integers(1 << 63))
            for m in req.group:  # completion i > 0 of a seeded request: its own stream of the same seed
                m.generator = np.random.default_rng(seed if m.index == 0 else [seed, m.index])
        if stream:
            self._streams[req.request_id] = RequestStream(
                req.request_id, self.stream_buffer, clock=lambda: self._clock(), on_cancel=self._cancel
            )
        self._wake.notify_all()
        return req

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

    def _cancel(self, request_id: str) -> None:
        """A stream's reader left early."""
        self._abort(request_id, "cancelled")

    def _abort(self, request_id: str, cause: str = "abort") -> Optional[RequestOutput]:
        with self._lock:
            if not isinstance(request_id, str) or request_id not in self.scheduler.requests:
                return None
            req = self.scheduler.abort_request(request_id)
            req.abort_cause = cause
            for m in req.group:
                self._host.pop(m.request_id, None)
            out = self._output(req)
            self.metrics.record_finished(req, cause)
            self._publish([out])
            return out

    def queue_depth(self) -> int:
        """Requests waiting to be scheduled (the server's admission bound)."""
        return len(self.scheduler.waiting)

    @property
    def max_model_len(self) -> int:
        """The longest sequence a request may reach: the model's, the config's and the pool's limits."""
        return self.scheduler.max_model_len

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return self.scheduler.has_unfinished_requests()

    # ---------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one forward pass; returns an output per request that got a token (``generate``'s: final only)."""
        with self._step_lock:
            t0 = time.perf_counter()
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
                to_sample = so.samplers
                params = [r.params for r in to_sample]
                gens = [r.generator for r in to_sample]
                history = None
                if any(p.has_penalties for p in params):
                    history = (
                        [r.output_token_ids for r in to_sample],
                        [r.prompt_token_ids for r in to_sample],
                        [r.stop_ids for r in to_sample],
                    )
                plp = self._prompt_logprob_positions(so)
            try:
                b = so.batch.num_seqs
                if plp is None:
                    logits = self.model.forward(so.batch, self.kv_caches)
                else:
                    last = so.batch.query_start_loc[1:].astype(np.int64) - 1
                    idx = np.concatenate([last, plp[1]])
                    logits = self.model.forward(so.batch, self.kv_caches, logits_indices=idx)
                want = b if plp is None else b + len(plp[1])
                if not isinstance(logits, np.ndarray) or logits.shape != (want, self.model.vocab_size):
                    raise ValueError(
                        f"model.forward returned {getattr(logits, 'shape', type(logits))}, expected "
                        f"({want}, {self.model.vocab_size})"
                    )
                extra = None if plp is None else logits[b:]
                if len(rows) != logits.shape[0] or rows != list(range(len(rows))):
                    logits = logits[rows]
                if rows:
                    o, pr, st = history if history is not None else (None, None, None)
                    tokens = sample(logits, params, gens, output_token_ids=o, prompt_token_ids=pr, stop_ids=st)
                else:
                    tokens = np.empty(0, np.int64)
                lp = self._sample_logprobs(params, logits, tokens)
                prompt_lp = None if plp is None else self._prompt_logprobs(plp, extra)
            except BaseException as e:
                self._fail_step(so, e)
                raise
            with self._lock:
                if self.kv_tiers is not None:
                    self._tier_store(so)
                changed = self.scheduler.update_from_output(so, tokens.tolist())
                failed: dict[str, BaseException] = {}
                if lp is not None or prompt_lp is not None:
                    self._attach_logprobs(to_sample, lp, prompt_lp, failed)
                for r in changed:
                    if r.params.stop and r.head.request_id not in failed:
                        try:
                            self._check_stop_strings(r)
                        except Exception as e:
                            failed[r.head.request_id] = e
                heads: dict[str, Request] = {}
                for r in changed:
                    if r.head.request_id not in failed:
                        heads.setdefault(r.head.request_id, r.head)
                outputs = []
                for h in heads.values():
                    done = h.group_finished
                    if done:
                        self.metrics.record_finished(h)
                    if done or not h.final_only:
                        outputs.append(self._output(h))
                self._publish(outputs)
                for rid, e in failed.items():
                    self._fail_request(rid, e)
                self._expire_leases()
            self.metrics.record_step(time.perf_counter() - t0)
            return outputs

    def _prompt_logprob_positions(
        self, so: SchedulerOutput
    ) -> Optional[tuple[list[tuple[Request, int, int]], np.ndarray]]:
        """For prompt_logprobs requests in the step: ([(request, first position, count)], token indices)."""
        spans: list[tuple[Request, int, int]] = []
        idx: list[np.ndarray] = []
        qsl = so.batch.query_start_loc
        for i, r in enumerate(so.requests):
            if r.prompt_logprobs is None:
                continue
            q = int(qsl[i + 1] - qsl[i])
            first = r.num_computed_tokens - q  # position of the step's first token
            done = len(r.prompt_logprobs) - 1  # positions whose next-token logprob is known
            lo, hi = max(first, done), min(first + q, r.num_prompt_tokens - 1)
            if hi > lo:
                spans.append((r, lo, hi - lo))
                idx.append(np.arange(int(qsl[i]) + lo - first, int(qsl[i]) + hi - first, dtype=np.int64))
        if not spans:
            return None
        return spans, np.concatenate(idx)

    def _prompt_logprobs(
        self, plp: tuple[list[tuple[Request, int, int]], np.ndarray], logits: np.ndarray
    ) -> list[tuple[Request, int, list[tuple[list[int], list[float], list[int]]]]]:
        spans, _ = plp
        targets: list[int] = []
        ks: list[int] = []
        for r, lo, n in spans:
            targets += r.prompt_token_ids[lo + 1 : lo + 1 + n]
            ks += [r.params.prompt_logprobs] * n  # type: ignore[list-item]
        rows = top_logprobs(logits, np.asarray(targets, np.int64), ks)
        out, j = [], 0
        for r, lo, n in spans:
            out.append((r, lo, rows[j : j + n]))
            j += n
        return out

    @staticmethod
    def _sample_logprobs(
        params: list[SamplingParams], logits: np.ndarray, tokens: np.ndarray
    ) -> Optional[dict[int, tuple[list[int], list[float], list[int]]]]:
        """Top-k logprobs (raw distribution) of the sampled tokens, keyed by sample row."""
        sel = [j for j, p in enumerate(params) if p.logprobs is not None]
        if not sel:
            return None
        rows = top_logprobs(logits[sel], tokens[sel], [params[j].logprobs for j in sel])  # type: ignore[misc]
        return dict(zip(sel, rows))

    def _attach_logprobs(
        self,
        samplers: list[Request],
        lp: Optional[dict[int, tuple[list[int], list[float], list[int]]]],
        prompt_lp: Optional[list[tuple[Request, int, list[tuple[list[int], list[float], list[int]]]]]],
        failed: dict[str, BaseException],
    ) -> None:
        """Append this step's logprob dicts to the requests that got them (decoding each token once)."""
        for j, row in (lp or {}).items():
            r = samplers[j]
            if r.logprobs is None or len(r.logprobs) != len(r.output_token_ids) - 1:
                continue  # aborted (or the fork did not happen) since the step was scheduled
            try:
                r.logprobs.append(self._logprob_dict(row))
            except Exception as e:
                failed.setdefault(r.head.request_id, e)
        for r, lo, rows in prompt_lp or ():
            # a request that finished in this very step keeps them (max_tokens=1); an aborted one is gone
            if r.status is RequestStatus.FINISHED_ABORTED or len(r.prompt_logprobs) != lo + 1:  # type: ignore[arg-type]
                continue
            try:
                r.prompt_logprobs += [self._logprob_dict(row) for row in rows]  # type: ignore[operator]
            except Exception as e:
                failed.setdefault(r.head.request_id, e)

    def _logprob_dict(self, row: tuple[list[int], list[float], list[int]]) -> dict[int, Logprob]:
        dec = None if self.tokenizer is None else self.tokenizer.decode
        return {t: Logprob(lp, rank, None if dec is None else dec([t])) for t, lp, rank in zip(*row)}

    def _check_stop_strings(self, r: Request) -> None:
        """Finish ``r`` if its output text contains a stop string (after min_tokens); cut the text there."""
        if self.tokenizer is None or r.status not in (RequestStatus.RUNNING, RequestStatus.FINISHED_LENGTH):
            return
        if len(r.output_token_ids) < r.params.min_tokens:
            return
        text = self.tokenizer.decode(r.output_token_ids)
        hits = [(i, s) for s in r.params.stop if (i := text.find(s)) >= 0]
        if not hits:
            return
        i, stop = min(hits)
        r.stop_text = text[: i + len(stop)] if r.params.include_stop_str_in_output else text[:i]
        r.stop_reason = stop
        self.scheduler.finish_request(r, RequestStatus.FINISHED_STOPPED)

    def _fail_request(self, request_id: str, error: BaseException) -> None:
        """One request's own post-processing failed: abort it (cause "error") and hand its stream the error."""
        stream = self._streams.pop(request_id, None)
        self._abort(request_id, "error")
        if stream is not None:
            stream._put(error)

    def _expire_leases(self) -> None:
        """Abort requests whose stream buffer has been full for longer than ``stream_idle_timeout``."""
        now = self._clock()
        for rid, st in list(self._streams.items()):
            since = st.full_since
            if since is not None and now - since >= self.stream_idle_timeout and not st.finished:
                del self._streams[rid]
                self._abort(rid, "lease_expired")
                st._expire(
                    StreamLeaseExpiredError(
                        f"request {rid!r} aborted: its stream buffer of {st.maxlen} outputs stayed full for "
                        f"{self.stream_idle_timeout} s without a read"
                    )
                )

    def _tier_load(self, req: Request, cached: int) -> int:
        """Admission: load the blocks after the pool's prefix hit from the KV tiers; returns computed tokens."""
        from pagedkv_rs.tiers import chain_hashes, salt_digest  # not at module level: tiers import engine.metrics

        tiers = self.kv_tiers
        bs = self.kv_manager.block_size
        toks = req.all_token_ids
        first, last = cached // bs, (len(toks) - 1) // bs  # a hit leaves at least one token to compute (I6)
        if tiers is None or last <= first or req.params.prompt_logprobs is not None:
            return cached
        try:
            hashes = chain_hashes(toks[: last * bs], bs, req.cache_salt, req.block_hashes)
            parent = hashes[first - 1] if first else bytes(16)
            got = tiers.lookup(hashes[first:last], parent, toks[first * bs : last * bs], salt_digest(req.cache_salt))
            if not got:
                return cached
            ids = self.kv_manager.block_table(req.seq_id)[first : first + len(got)]
            tiers.load_into(self.kv_caches, ids, got)
        except Exception:  # a tier never fails a request: compute instead
            for m in tiers.metrics:
                m.add(errors=1)
            return cached
        n = len(got) * bs
        self.kv_manager.prepare_batch([req.seq_id], [n])  # the loaded KV counts as computed; registers the blocks
        return cached + n

    def _tier_store(self, so: SchedulerOutput) -> None:
        """Write-through: queue the blocks this step completed for the KV tiers (copied out now)."""
        from pagedkv_rs.tiers import chain_hashes, salt_digest

        tiers = self.kv_tiers
        assert tiers is not None
        bs = self.kv_manager.block_size
        try:
            for req, n in zip(so.requests, so.num_scheduled_tokens):
                c = req.num_computed_tokens
                lo, hi = (c - n) // bs, c // bs
                if hi <= lo or req.status is not RequestStatus.RUNNING or req.params.prompt_logprobs is not None:
                    continue
                toks = req.all_token_ids
                hashes = chain_hashes(toks[: hi * bs], bs, req.cache_salt, req.block_hashes)
                table = self.kv_manager.block_table(req.seq_id)
                tiers.store(
                    self.kv_caches,
                    table[lo:hi],
                    hashes[lo:hi],
                    [hashes[j - 1] if j else bytes(16) for j in range(lo, hi)],
                    [toks[j * bs : (j + 1) * bs] for j in range(lo, hi)],
                    salt_digest(req.cache_salt),
                )
        except Exception:  # never fail a step for a tier
            for m in tiers.metrics:
                m.add(errors=1)

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
                rid = r.head.request_id
                if rid in self.scheduler.requests:
                    stream = self._streams.pop(rid, None)
                    self._abort(rid, "error")
                    if stream is not None:
                        stream._put(error)
            self.kv_manager.reset_prefix_cache()

    def _fail_all(self, error: BaseException) -> None:
        """Abort every unfinished request, handing ``error`` to its stream."""
        with self._lock:
            for rid in list(self.scheduler.requests):
                stream = self._streams.pop(rid, None)
                self._abort(rid, "error")
                if stream is not None:
                    stream._put(error)

    def _output(self, req: Request) -> RequestOutput:
        return RequestOutput.from_request(req, None if self.tokenizer is None else self.tokenizer.decode)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        """Hand each output to its stream; then wake each asyncio loop once for all its streams."""
        woken: dict[asyncio.AbstractEventLoop, list[RequestStream]] = {}
        for o in outputs:
            s = self._streams.get(o.request_id)
            if s is not None:
                if s._put(o, wake=False):
                    woken.setdefault(s._loop, []).append(s)  # type: ignore[arg-type]
                if o.finished:
                    del self._streams[o.request_id]
        for loop, streams in woken.items():
            wake_all(loop, streams)

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
        single = isinstance(prompts, (str, Mapping)) or (len(prompts) > 0 and isinstance(prompts[0], (int, np.integer)))
        items = [prompts] if single else list(prompts)  # type: ignore[list-item, arg-type]
        plist = list(params) if isinstance(params, Sequence) else [params] * len(items)
        if len(plist) != len(items):
            raise ValueError(f"{len(items)} prompts but {len(plist)} SamplingParams")
        checked = [self._checked(p, sp) for p, sp in zip(items, plist)]  # every prompt before any is queued
        with self._lock:
            streams = []
            try:
                for c in checked:
                    req = self._add(c, stream=True)
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
        prompt: Union[Prompt, CheckedRequest],
        params: Optional[SamplingParams] = None,
        *,
        request_id: Optional[str] = None,
        cache_salt: Optional[Union[str, bytes]] = None,
    ) -> RequestStream:
        """Queue a request on the background loop (started on first use); returns its output stream."""
        checked = self._checked(prompt, params, request_id=request_id, cache_salt=cache_salt)
        self.start()
        with self._lock:
            req = self._add(checked, stream=True)
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
        if self.kv_tiers is not None:
            self.kv_tiers.flush()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # --------------------------------------------------------------------- stats
    def snapshot(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """Scheduler stats and KV-manager stats, read together under the engine lock (cheap: for scrapes)."""
        with self._lock:
            return self.scheduler.stats(), self.kv_manager.stats()

    def stats(self) -> dict[str, Any]:
        """Scheduler and KV stats, running counters, and latencies (seconds; bounded, see ``metrics``).

        Means cover every finished request (histogram sums), medians the last ``metrics.recent_*``
        window. ``prefix_cache_queries`` / ``prefix_cache_hits`` count prompt tokens.
        """
        with self._lock:
            s = self.scheduler.stats()
            kv = self.kv_manager.stats()
            s["prefix_cache_queries"] = int(kv.get("prefix_query_tokens", 0))
            s["prefix_cache_hits"] = int(kv.get("prefix_hit_tokens", 0))
            s["kv_block_evictions"] = int(kv.get("evictions", 0))
            s["kv_block_allocations"] = int(kv.get("block_allocations", 0))
            s.update(self.metrics.summary())
            s["backend"] = self.backend
            s["kernels"] = kernels.kernel_source()
            if self.kv_tiers is not None:
                s["kv_tiers"] = self.kv_tiers.stats()
            return s


def _make_tiers(
    model: Any,
    kv_caches: list[tuple[np.ndarray, np.ndarray]],
    block_size: int,
    specs: Sequence[Any],
    secret: Optional[Union[str, bytes]],
    deadline: float,
) -> KVTiers:
    """Parse the tier specs (or take ``Tier`` objects) and fingerprint the model for them."""
    from pagedkv_rs.tiers import BlockLayout, KVTiers, Tier, model_fingerprint, parse_tier

    if isinstance(specs, (str, bytes)):
        raise TypeError("kv_tiers must be a list of tier specs, e.g. ['disk:/var/cache/pagedkv?size=8GiB']")
    tiers = [s if isinstance(s, Tier) else parse_tier(s, secret=secret) for s in specs]
    layout = BlockLayout(model.num_layers, model.num_kv_heads, block_size, model.head_dim, kv_caches[0][0].dtype)
    return KVTiers(tiers, layout, model_fingerprint(model, layout), deadline=deadline)


def _manager_class(backend: Any) -> Any:
    if isinstance(backend, str):
        return allocator_backend(backend).KVCacheManager
    return getattr(backend, "KVCacheManager", backend)
