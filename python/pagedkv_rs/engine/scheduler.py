"""Continuous-batching scheduler (vLLM v1 shape): one ``schedule()`` = one forward pass.

Each step spends a token budget: running requests first (one decode token each, or the next
chunk of a partial prefill), then admission of swapped and waiting requests. A decode token is
appended to the KV cache manager when its request is scheduled; when that needs blocks that are
not there, the newest (FCFS) or lowest-priority (priority policy) running request not yet
scheduled this step is preempted, by recompute (blocks freed, request back at the front of the
waiting queue) or by swap (its KV goes to a host buffer, the engine copies it).

Progress: a request that could not fit the whole pool alone is rejected at submission
(``max_model_len`` is capped by the pool), and the oldest / highest-priority running request is
never preempted for a later one, so it always advances; the waiting queue is FCFS (or priority
order) and its head waits only while something runs.

One prefix, computed once: a waiting request whose prompt shares full blocks with a running (or
tier-loading) request that has not cached them yet stays waiting, and the requests behind it may
pass, until those blocks are in the prefix cache (``_prefix_in_flight``); the request computing
them advances every step, so the wait is bounded by its prefill.

Seats (``max_num_seqs``): every sequence holds one, an ``n > 1`` request's completions included.
A group is admitted only when its whole fan-out fits (vLLM v0's ``get_max_num_running_seqs``): the
head takes one seat and reserves one per completion still to fork, and a fork moves a reservation
into the running set, so ``len(running) + len(loading) + reserved <= max_num_seqs`` always holds.
A request with ``n > max_num_seqs`` can never be admitted: the door refuses it.

KV tiers (``kv_tiers=True``): a request admitted with blocks after the pool's prefix hit that a
tier may hold waits in its own state, ``WAITING_FOR_KV`` (vLLM's ``WAITING_FOR_REMOTE_KVS``),
holding its blocks; ``schedule()`` lists it as a ``KVLoad`` for the runner, and ``finish_loads()``
starts it with the tokens that arrived. The scheduler decides only: no I/O, no callback.

The scheduler only uses the manager's public API, so either allocator backend works.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from pagedkv_rs.batch import BatchInputs
from pagedkv_rs.engine.input import CheckedRequest, InputLimits, check_request
from pagedkv_rs.engine.pooling import PoolingState
from pagedkv_rs.engine.request import (
    MAX_TOKEN_ID,
    InvalidRequestError,
    Request,
    RequestStatus,
    SamplingParams,
    UnknownRequestError,
)
from pagedkv_rs.engine.speculative import SpeculativeConfig, Speculator, Verified
from pagedkv_rs.errors import OutOfBlocksError

__all__ = ["SchedulerConfig", "Scheduler", "SchedulerOutput", "SwapOut", "SwapIn", "KVLoad", "KVStore"]

POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = ("recompute", "swap")


@dataclass(frozen=True)
class SchedulerConfig:
    """Step limits and policies."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    policy: str = "fcfs"
    preemption_mode: str = "recompute"
    enable_chunked_prefill: bool = True
    max_model_len: Optional[int] = None  # capped by the model's and the pool's limits
    swap_space_blocks: Optional[int] = None  # host blocks for swap (None: unbounded)
    watermark: float = 0.01  # fraction of blocks admission keeps free while others run
    # speculative decoding: a ``SpeculativeConfig``, "ngram[:k=K,n=N]", "draft:PATH[:k=K]" or a dict of its
    # fields (None: off)
    speculative: Any = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative", SpeculativeConfig.of(self.speculative))
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.swap_space_blocks is not None and self.swap_space_blocks < 0:
            raise ValueError(f"swap_space_blocks must be >= 0, got {self.swap_space_blocks}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")


@dataclass(frozen=True)
class SwapOut:
    """Copy these blocks (in table order) of every layer to the request's host buffer."""

    request_id: str
    block_ids: list[int]


@dataclass(frozen=True)
class SwapIn:
    """Copy host blocks ``first, first+1, ...`` of the request back into ``block_ids``, then drop the buffer."""

    request_id: str
    first: int
    block_ids: list[int]


@dataclass(frozen=True)
class KVLoad:
    """Fill ``block_ids`` (the request's blocks ``first_block, ...``) from the KV tiers, as far as they hit."""

    request: Request
    first_block: int
    block_ids: list[int]


@dataclass(frozen=True)
class KVStore:
    """Write the request's blocks ``first_block, ...`` (``block_ids``, computed this step) to the KV tiers."""

    request: Request
    first_block: int
    block_ids: list[int]


@dataclass
class SchedulerOutput:
    """One step: the batch to run and the memory operations to apply first (swap-out, swap-in, copies)."""

    requests: list[Request]  # batch order
    num_scheduled_tokens: list[int]
    sample_rows: list[int] = field(default_factory=list)  # rows whose request has all its KV: sample these
    pool_rows: list[int] = field(default_factory=list)  # rows of pooling requests (never sampled)
    # the request each sample_rows entry samples for: requests[row], or (a row listed n times) the
    # completions of an n > 1 request whose prompt finishes this step, forked from it in update_from_output
    samplers: list[Request] = field(default_factory=list)
    forks: list[tuple[Request, Request]] = field(default_factory=list)  # (head, completion) to fork
    seq_ids: list[int] = field(default_factory=list)  # the requests' KV-manager sequence ids
    batch: BatchInputs = None  # type: ignore[assignment]  # set once the step's requests are chosen
    copy_pairs: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[SwapOut] = field(default_factory=list)
    swap_in: list[SwapIn] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    kv_loads: list[KVLoad] = field(default_factory=list)  # admitted requests now WAITING_FOR_KV
    kv_stores: list[KVStore] = field(default_factory=list)
    drafts: dict[int, list[int]] = field(default_factory=dict)  # batch row -> draft tokens after its pending one
    # speculative decoding's governor: (bucket, whether it drafted, the step's start on its clock), if it decided
    governed: Optional[tuple[int, bool, float]] = None
    # ``schedule(defer_drafts=True)``: (batch row, drafts it may take) for the draft model to make off the engine
    # lock; ``finish_drafts`` applies them and builds the batch (None: nothing deferred)
    draft_plan: Optional[list[tuple[int, int]]] = None

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)


class _WaitQueue:
    """FCFS deque, or a list sorted by (priority, arrival, submission order)."""

    def __init__(self, policy: str) -> None:
        self._priority = policy == "priority"
        self._q: Any = [] if self._priority else deque()
        self._keys: list[tuple[int, float, int]] = []

    @staticmethod
    def _key(r: Request) -> tuple[int, float, int]:
        return (r.params.priority, r.metrics.arrival_time, r._order)

    def push(self, r: Request) -> None:
        if self._priority:
            self._insert(r)
        else:
            self._q.append(r)

    def push_front(self, r: Request) -> None:
        if self._priority:
            self._insert(r)
        else:
            self._q.appendleft(r)

    def _insert(self, r: Request) -> None:
        k = self._key(r)
        i = bisect.bisect(self._keys, k)
        self._keys.insert(i, k)
        self._q.insert(i, r)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        if self._priority:
            self._keys.pop(0)
            return self._q.pop(0)
        return self._q.popleft()

    def remove(self, r: Request) -> None:
        i = next(i for i, x in enumerate(self._q) if x is r)
        del self._q[i]
        if self._priority:
            del self._keys[i]

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._q))


class Scheduler:
    """Waiting / running / swapped queues over a ``KVCacheManager`` (either backend)."""

    def __init__(
        self,
        kv_manager: Any,
        config: Optional[SchedulerConfig] = None,
        *,
        eos_token_ids: Sequence[int] = (),
        max_model_len: Optional[int] = None,
        vocab_size: Optional[int] = None,
        kv_tiers: bool = False,
        drafter: Any = None,
    ) -> None:
        self.kv = kv_manager
        self.kv_tiers = kv_tiers  # admission asks the tiers for the blocks after the pool's prefix hit
        self.vocab_size = MAX_TOKEN_ID + 1 if vocab_size is None else int(vocab_size)
        self.config = config or SchedulerConfig()
        self.block_size = int(kv_manager.block_size)
        limits = [int(kv_manager.max_seq_len)]
        limits += [x for x in (max_model_len, self.config.max_model_len) if x is not None]
        self.max_model_len = min(limits)
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.watermark_blocks = int(self.config.watermark * kv_manager.num_blocks)
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting = _WaitQueue(self.config.policy)
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.loading: list[Request] = []  # WAITING_FOR_KV: blocks held, the runner fills them from the tiers
        self._loads_of_aborted: set[int] = set()  # seq ids whose blocks wait for their load to end to be freed
        self.swap_blocks_used = 0
        self.reserved_seats = 0  # completions of admitted heads not forked yet (pending_forks)
        self._seq_ids = itertools.count()
        self._order = itertools.count()
        self.num_preemptions = 0
        self.num_swaps = 0
        self.num_steps = 0
        self.num_pooling = 0  # unfinished pooling requests (a step without them pays nothing for pooling)
        spec = self.config.speculative
        self.spec: Optional[Speculator] = None if spec is None else Speculator(spec, drafter=drafter)
        self._step_started = 0.0  # on the speculator's clock: the step the governor may time
        # ``schedule(defer_drafts=True)`` until ``finish_drafts``: the step's sequences, whose blocks a finish
        # leaves allocated (``_held_frees``) until the batch is built
        self._held: set[int] = set()
        self._held_frees: list[int] = []
        self._num_decoding = 0  # the step's decode rows (``_schedule_running``'s fast path)

    # ------------------------------------------------------------------ requests
    @property
    def limits(self) -> InputLimits:
        """What ``check_request`` holds a request to here: the vocabulary and the context limit."""
        pool = f" (model context, config and KV pool of {self.kv.num_blocks} blocks x {self.block_size})"
        return InputLimits(self.vocab_size, self.max_model_len, pool=pool, max_num_seqs=self.config.max_num_seqs)

    def add_request(
        self,
        request: Union[CheckedRequest, str],
        prompt_token_ids: Optional[Sequence[int]] = None,
        params: Optional[SamplingParams] = None,
        *,
        arrival_time: Optional[float] = None,
        cache_salt: Any = None,
        prompt: Optional[str] = None,
    ) -> Request:
        """Queue a checked request (or a request id and its fields, checked here); returns it.

        Nothing changes on rejection. ``params.n > 1`` queues one request (the head, ``request_id``)
        whose other completions fork its prompt's blocks once the prompt is computed.
        """
        if not isinstance(request, CheckedRequest):
            if request is None:
                raise TypeError("request_id must be a str, got NoneType")
            if isinstance(prompt_token_ids, (str, bytes)):  # the scheduler has no tokenizer
                raise TypeError(
                    f"prompt_token_ids must be a sequence of ints (pass text to an engine with a tokenizer), "
                    f"got {type(prompt_token_ids).__name__}"
                )
            request = check_request(
                prompt_token_ids,
                params,
                limits=self.limits,
                request_id=request,
                arrival_time=arrival_time,
                cache_salt=cache_salt,
                text=prompt,
            )
        request_id = request.request_id
        if request_id is None:
            raise TypeError("request_id must be a str, got NoneType")
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use by an unfinished request")
        toks, params, arrival_time = request.prompt_token_ids, request.params, request.arrival_time
        cache_salt, prompt = request.cache_salt, request.prompt
        req = self._new_request(request_id, toks, params, arrival_time, cache_salt, prompt)
        if request.pooling is not None:
            req.pooling = PoolingState(request.pooling)
            self.num_pooling += 1
            if req.pooling.mean:
                req.kv_salt = _own_salt(cache_salt, f"mean_pooling:{req.seq_id}")
        if params.n > 1:
            req.group = (req,) + tuple(
                self._new_request(f"{request_id}\x00{i}", toks, params, req.metrics.arrival_time, cache_salt, prompt)
                for i in range(1, params.n)
            )
            for i, m in enumerate(req.group):
                m.index, m.head = i, req
            req.pending_forks = list(req.group[1:])
        self.requests[request_id] = req
        self.waiting.push(req)
        return req

    def _new_request(
        self, request_id: str, toks: list[int], params: SamplingParams, arrival_time: Any, cache_salt: Any, prompt: Any
    ) -> Request:
        req = Request(
            request_id,
            toks,
            params,
            seq_id=next(self._seq_ids),
            arrival_time=arrival_time,
            cache_salt=cache_salt,
            prompt=prompt,
        )
        req._order = next(self._order)
        if params.prompt_logprobs is not None:  # its own salt: every prompt position is computed, none hit
            req.kv_salt = _own_salt(cache_salt, f"prompt_logprobs:{req.seq_id}")
        if not params.ignore_eos:
            req.stop_ids = req.stop_ids | self.eos_token_ids
        req.max_output = min(params.max_tokens, self.max_model_len - len(toks))
        return req

    def abort_request(self, request_id: str) -> Request:
        """Finish a request (every unfinished completion of it) at any status, freeing its blocks now.

        Raises ``UnknownRequestError``; returns the request (the head of an ``n > 1`` group).
        """
        head = self.requests.get(request_id)
        if head is None:
            raise UnknownRequestError(f"no unfinished request with id {request_id!r}")
        pending = head.pending_forks
        if head.status in (RequestStatus.RUNNING, RequestStatus.WAITING_FOR_KV):
            self.reserved_seats -= len(pending)
        head.pending_forks = []
        for m in pending:  # never queued: nothing to free
            m.status = RequestStatus.FINISHED_ABORTED
            m.metrics.finished_time = time.monotonic()
        for req in head.group:
            if req.status is RequestStatus.RUNNING:
                self.running.remove(req)
            elif req.status is RequestStatus.SWAPPED:
                self.swapped.remove(req)
            elif req.status is RequestStatus.WAITING:
                self.waiting.remove(req)
            elif req.status is RequestStatus.WAITING_FOR_KV:
                self.loading.remove(req)
            else:
                continue
            self._finish(req, RequestStatus.FINISHED_ABORTED)
        return head

    def finish_request(self, req: Request, status: RequestStatus) -> None:
        """Finish one running or just-finished completion (a stop string matched after the update)."""
        if req.status is RequestStatus.RUNNING:
            self._stop(req, status)
        elif req.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED):
            req.status = status

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:
        """Unfinished requests, or blocks of aborted ones still waiting for their tier load to end."""
        return bool(self.requests or self._loads_of_aborted)

    def num_queued(self) -> int:
        """Requests admitted to nothing yet: waiting, or waiting for their KV from the tiers."""
        return len(self.waiting) + len(self.loading)

    def get_request(self, request_id: str) -> Request:
        req = self.requests.get(request_id)
        if req is None:
            raise UnknownRequestError(f"no unfinished request with id {request_id!r}")
        return req

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status is RequestStatus.RUNNING:
            if req.seq_id in self._held:
                self._held_frees.append(req.seq_id)
            else:
                self.kv.free(req.seq_id)
        elif req.status is RequestStatus.WAITING_FOR_KV:  # the runner may still write its blocks
            self._loads_of_aborted.add(req.seq_id)
        elif req.status is RequestStatus.SWAPPED:
            self.swap_blocks_used -= self._blocks(req.swapped_computed)
        if self.spec is not None:
            self.spec.release(req)
        req.status = status
        req.metrics.finished_time = time.monotonic()
        if req.pooling is not None:
            self.num_pooling -= 1
        head = req.head
        if head.group_finished and not head.pending_forks:
            del self.requests[head.request_id]

    def _blocks(self, n: int) -> int:
        return -(-n // self.block_size)

    # ------------------------------------------------------------------ schedule
    def schedule(self, defer_drafts: bool = False) -> Optional[SchedulerOutput]:
        """Pick this step's requests and token counts and build their batch; None if nothing can run.

        An output may hold only ``kv_loads`` (no batch): requests admitted to wait for the KV tiers.
        ``defer_drafts``: a draft model's drafts are not made here; an output with a ``draft_plan`` has no batch
        yet, and ``finish_drafts`` (the drafts made meanwhile, by ``spec.draft_for(out)``) completes it. Until then
        the blocks of its requests stay allocated (an abort frees them there) and the draft model's KV of
        finished requests is released there: the engine makes the drafts off its lock.
        """
        out = SchedulerOutput([], [])
        if self.spec is not None:
            self._step_started = self.spec.clock()
        self._num_decoding = 0
        budget = self._schedule_running(self.config.max_num_batched_tokens, out)
        if not out.preempted:
            budget = self._schedule_swapped(budget, out)
            self._schedule_waiting(budget, out)
        if self.spec is not None and 0 < self._num_decoding == len(out.requests) and not self.num_pooling:
            # decode-only steps: a prefill goes first, and is not the governor's
            self._add_drafts(out, budget, defer_drafts)
            if out.draft_plan is not None:
                self._held = {r.seq_id for r in out.requests}
                self.spec.hold_releases()
                return out
        if not out.requests:
            return out if out.kv_loads else None
        return self._build(out)

    def finish_drafts(self, out: SchedulerOutput, made: Optional[Sequence[Sequence[int]]]) -> SchedulerOutput:
        """Complete a ``schedule(defer_drafts=True)`` output: ``made`` (the draft model's tokens for each
        ``draft_plan`` entry, None if it failed) appended for the requests still running, then the batch. The
        blocks of requests finished meanwhile are freed once the batch is built (as after an abort during the
        forward: their rows run, their tokens are dropped)."""
        plan, out.draft_plan = out.draft_plan or [], None
        running = RequestStatus.RUNNING
        if made is not None:
            self._apply_drafts(
                out, [(i, list(d)) for (i, _), d in zip(plan, made) if out.requests[i].status is running]
            )
        out = self._build(out)
        freed, self._held, self._held_frees = self._held_frees, set(), []
        for sid in freed:
            self.kv.free(sid)
        assert self.spec is not None
        self.spec.apply_releases()
        return out

    def _build(self, out: SchedulerOutput) -> SchedulerOutput:
        """The step's batch, tier stores, pooling and sample rows, forks."""
        out.batch = self.kv.prepare_batch(out.seq_ids, out.num_scheduled_tokens)
        self.num_steps += 1
        if self.kv_tiers:
            self._plan_stores(out)
        reqs = out.requests
        if self.num_pooling:  # pooling rows are pooled, never sampled
            out.pool_rows = [i for i, r in enumerate(reqs) if r.pooling is not None]
            out.sample_rows = [i for i in out.sample_rows if reqs[i].pooling is None]
        out.samplers = [reqs[i] for i in out.sample_rows]
        if any(r.pending_forks for r in out.samplers):
            rows: list[int] = []
            samplers: list[Request] = []
            for i in out.sample_rows:
                r = reqs[i]
                rows.append(i)
                samplers.append(r)
                for c in r.pending_forks:
                    rows.append(i)
                    samplers.append(c)
                    out.forks.append((r, c))
            out.sample_rows, out.samplers = rows, samplers
        return out

    def _plan_stores(self, out: SchedulerOutput) -> None:
        """The blocks each request completes this step, for the tiers' write-through."""
        bs = self.block_size
        for i, (req, n) in enumerate(zip(out.requests, out.num_scheduled_tokens)):
            c = req.num_computed_tokens
            lo, hi = (c - n) // bs, (c - len(out.drafts.get(i, ()))) // bs  # drafts are not stored
            st = req.spec
            if st is not None:  # blocks that accepted drafts filled were not stored in their step
                if st.stored_blocks >= 0:
                    lo = min(lo, st.stored_blocks)
                st.stored_blocks = hi
            if hi > lo and not req.computes_whole_prompt:
                out.kv_stores.append(KVStore(req, lo, self.kv.block_table(req.seq_id)[lo:hi]))

    def finish_loads(self, done: Sequence[tuple[KVLoad, int]]) -> None:
        """The runner's tier loads that ended, with the tokens each brought: those requests run from now."""
        for ld, n in done:
            req = ld.request
            if req.seq_id in self._loads_of_aborted:  # aborted while it loaded: its blocks are free now
                self._loads_of_aborted.remove(req.seq_id)
                self.kv.free(req.seq_id)
                continue
            self.loading.remove(req)
            cached = req.num_computed_tokens
            if n:
                self._mark_computed(req, n)
            self._start(req, cached + n)

    def _mark_computed(self, req: Request, n: int) -> None:
        """KV copied in (swap-in, tier load) counts as computed: ``prepare_batch`` is how the manager learns it
        (it registers the blocks' prefix hashes); the batch itself is not used."""
        self.kv.prepare_batch([req.seq_id], [n])

    def _start(self, req: Request, cached: int) -> None:
        """An admitted request whose first ``cached`` tokens have KV: it runs from the next chunk on."""
        if req.num_cached_tokens is None:
            req.num_cached_tokens = cached
        req.num_kv_tokens = len(req.all_token_ids)
        req.num_computed_tokens = cached
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def _emit(self, out: SchedulerOutput, req: Request, n: int) -> None:
        """Add ``n`` of the request's tokens to the step (admission paths)."""
        if req.metrics.first_scheduled_time is None:
            req.metrics.first_scheduled_time = time.monotonic()
        req.num_computed_tokens += n
        if req.num_computed_tokens == req.num_kv_tokens:
            out.sample_rows.append(len(out.requests))
        out.requests.append(req)
        out.num_scheduled_tokens.append(n)
        out.seq_ids.append(req.seq_id)

    def _schedule_running(self, budget: int, out: SchedulerOutput) -> int:
        """Running requests in order; their decode tokens go to the manager in one ``append_batch``."""
        bs = self.block_size
        reqs, counts, rows = out.requests, out.num_scheduled_tokens, out.sample_rows
        app_ids: list[int] = []
        app_toks: list[int] = []
        # bound appends: this loop runs once per running request per step
        add_id, add_tok, add_row = app_ids.append, app_toks.append, rows.append
        add_req, add_n = reqs.append, counts.append
        need = i = 0
        for req in self.running:
            if budget == 0:
                break
            kv = req.num_kv_tokens
            toks = req.all_token_ids
            if kv < len(toks):  # decode (all kv tokens computed): the last sampled token is pending
                if not kv % bs:
                    need += 1
                add_id(req.seq_id)
                add_tok(toks[kv])
                req.num_kv_tokens = req.num_computed_tokens = kv + 1
                add_row(i)
                n = 1
            else:  # the next prefill chunk
                n = kv - req.num_computed_tokens
                if n >= budget:
                    n = budget
                elif n == 0:
                    continue
                req.num_computed_tokens += n
                if req.num_computed_tokens == kv:
                    add_row(i)
            add_req(req)
            add_n(n)
            budget -= n
            i += 1
        if app_ids and not self._append_all(app_ids, app_toks, need, out):
            decode = set(app_ids)
            for req, n in zip(reqs, counts):  # undo, then go request by request
                req.num_computed_tokens -= n
                if req.seq_id in decode:
                    req.num_kv_tokens -= 1
            reqs.clear()
            counts.clear()
            rows.clear()
            return self._schedule_running_slow(out)
        out.seq_ids = app_ids if len(app_ids) == len(reqs) else [r.seq_id for r in reqs]
        self._num_decoding = len(app_ids)
        return budget

    def _add_drafts(self, out: SchedulerOutput, budget: int, defer: bool = False) -> None:
        """Append draft tokens after the pending token of a decode-only step's requests, if the governor runs
        this batch size with drafts, as many as each one's acceptance makes likely, while budget and free blocks
        last. ``defer``: a draft model's plan goes to ``out.draft_plan`` instead (``schedule``).

        Drafts only take free blocks above the watermark (never a cached block, never a preemption); the
        KV of the rejected ones is truncated in ``update_from_output``.
        """
        spec = self.spec
        assert spec is not None
        if not spec.batch_speculates(len(out.requests)):
            return
        mode = spec.mode(len(out.requests))
        if mode is not None:
            out.governed = (*mode, self._step_started)
            if not mode[1]:
                return
        free = self.kv.num_free_blocks - self.watermark_blocks
        bar = spec.governor.min_p(mode[0]) if mode is not None and spec.governor is not None else None
        model = spec.drafter is not None  # a draft model drafts whatever a sequence takes, all at once below
        plan: list[tuple[int, Any]] = []  # (batch row, its n-gram drafts or how many the draft model makes)
        for i, req in enumerate(out.requests):
            if budget <= 0:
                break
            offer: Any = spec.room(req, budget) if model else spec.propose(req, budget)
            k = spec.choose(req, offer if model else len(offer), bar) if offer else 0
            if not k:
                continue
            need = self.kv.blocks_needed_to_append(req.seq_id, k)
            if need > free:
                continue
            free -= need
            budget -= k
            plan.append((i, k if model else offer[:k]))
        if model and plan:  # one batched forward per draft position (the draft time counts in this step's)
            if defer:
                out.draft_plan = plan
                return
            made = spec.draft([out.requests[i] for i, _ in plan], [k for _, k in plan])
            plan = [(i, d) for (i, _), d in zip(plan, made)]
        self._apply_drafts(out, plan)

    def _apply_drafts(self, out: SchedulerOutput, plan: list[tuple[int, Any]]) -> None:
        """Each planned row's drafts appended to its KV and scheduled after its pending token."""
        for i, drafts in plan:
            if not drafts:
                continue  # the draft model's pool or context is full for it: it does not draft this step
            req = out.requests[i]
            out.copy_pairs += self.kv.append(req.seq_id, drafts)
            k = len(drafts)
            req.num_kv_tokens += k
            req.num_computed_tokens += k
            out.num_scheduled_tokens[i] += k
            out.drafts[i] = drafts

    def _append_all(self, seq_ids: list[int], tokens: list[int], need: int, out: SchedulerOutput) -> bool:
        """One ``append_batch`` for every decode token, if the blocks are there (all or nothing)."""
        if need > self.kv.num_free_blocks + self.kv.num_cached_blocks:
            return False
        try:
            out.copy_pairs += self.kv.append_batch(seq_ids, tokens)
        except OutOfBlocksError:  # pragma: no cover - only if a copy-on-write needs a block (forked tables)
            return False
        return True

    def _schedule_running_slow(self, out: SchedulerOutput) -> int:
        """Request by request, preempting victims until each decode append fits."""
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_kv_tokens < req.num_tokens:
                while not self.kv.can_append(req.seq_id, 1):
                    victim = self._pick_victim(i)
                    self._preempt(victim, out)
                    if victim is req:
                        break
                if req.status is not RequestStatus.RUNNING:
                    continue  # preempted itself; running[i] is now the next request
                out.copy_pairs += self.kv.append(req.seq_id, [req.all_token_ids[req.num_kv_tokens]])
                req.num_kv_tokens += 1
                n = 1
            else:
                n = min(req.num_kv_tokens - req.num_computed_tokens, budget)
            if n:
                self._emit(out, req, n)
                budget -= n
            i += 1
        return budget

    def _pick_victim(self, first: int) -> Request:
        """Newest (fcfs) or lowest-priority running request among those not yet scheduled (index >= first)."""
        cands = self.running[first:]
        if self.config.policy == "priority":
            return max(cands, key=lambda r: (r.params.priority, r.metrics.arrival_time, r._order))
        return cands[-1]

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.reserved_seats -= len(req.pending_forks)  # taken again when it is admitted again
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(req)
        if self.spec is not None:
            self.spec.release(req)
        nblk = self._blocks(req.num_computed_tokens)
        cap = self.config.swap_space_blocks
        if self.config.preemption_mode == "swap" and (cap is None or self.swap_blocks_used + nblk <= cap):
            out.swap_out.append(SwapOut(req.request_id, self.kv.block_table(req.seq_id)[:nblk]))
            self.kv.free(req.seq_id)
            req.swapped_computed = req.num_computed_tokens
            self.swap_blocks_used += nblk
            self.num_swaps += 1
            req.status = RequestStatus.SWAPPED
            self.swapped.append(req)
            return
        self.kv.free(req.seq_id)
        req.num_computed_tokens = 0
        req.num_kv_tokens = 0
        req.status = RequestStatus.WAITING
        self.waiting.push_front(req)

    def _seats_taken(self) -> int:
        """Sequences holding a seat: running, loading from the tiers, and completions reserved to fork."""
        return len(self.running) + len(self.loading) + self.reserved_seats

    def _admission_room(self) -> int:
        room = self.kv.num_free_blocks + self.kv.num_cached_blocks
        return room - self.watermark_blocks if self.running or self.loading else room

    def _schedule_swapped(self, budget: int, out: SchedulerOutput) -> int:
        """Swap requests back in, oldest first; stops at the first that does not fit."""
        while self.swapped and budget > 0:
            req = self.swapped[0]
            if self._seats_taken() + 1 + len(req.pending_forks) > self.config.max_num_seqs:
                break
            kv_toks = req.all_token_ids[: req.num_kv_tokens]
            if self.kv.blocks_needed(kv_toks, req.kv_salt) > self._admission_room():
                break
            self.swapped.popleft()
            cached = self.kv.allocate(req.seq_id, kv_toks, req.kv_salt)
            first = self._blocks(cached) if cached < req.swapped_computed else self._blocks(req.swapped_computed)
            table = self.kv.block_table(req.seq_id)
            out.swap_in.append(SwapIn(req.request_id, first, table[first : self._blocks(req.swapped_computed)]))
            if req.swapped_computed > cached:  # the copied-back KV counts as computed
                self._mark_computed(req, req.swapped_computed - cached)
            req.num_computed_tokens = max(cached, req.swapped_computed)
            self.swap_blocks_used -= self._blocks(req.swapped_computed)
            req.swapped_computed = 0
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self.reserved_seats += len(req.pending_forks)
            budget = self._schedule_one(req, budget, out)
        return budget

    def _schedule_one(self, req: Request, budget: int, out: SchedulerOutput) -> int:
        """Schedule a just-admitted request: its decode token, or the next prefill chunk."""
        if req.num_kv_tokens < req.num_tokens:
            if not self.kv.can_append(req.seq_id, 1):
                return budget  # runs next step; progress comes from the requests ahead of it
            out.copy_pairs += self.kv.append(req.seq_id, [req.all_token_ids[req.num_kv_tokens]])
            req.num_kv_tokens += 1
            n = 1
        else:
            n = min(req.num_kv_tokens - req.num_computed_tokens, budget)
        if n:
            self._emit(out, req, n)
        return budget - n

    def _schedule_waiting(self, budget: int, out: SchedulerOutput) -> None:
        """Admit waiting requests in queue order while blocks, budget and seats last."""
        chunked = self.config.enable_chunked_prefill
        bs = self.block_size
        if not self.waiting:
            return
        prefills = self._prefills_in_flight() if self.kv.enable_prefix_caching else None
        for req in self.waiting:  # a snapshot, in queue order
            if budget <= 0:
                break
            if self._seats_taken() + 1 + len(req.pending_forks) > self.config.max_num_seqs:
                break  # the whole fan-out waits for its seats (FCFS: nothing passes it)
            if prefills is not None and self._prefix_in_flight(req, prefills):
                continue  # admitted once the request computing its prefix has cached it; later ones may pass
            toks = req.all_token_ids
            if self.kv.blocks_needed(toks, req.kv_salt) > self._admission_room():
                break
            if not chunked and out.requests and len(toks) > budget:
                break  # a whole prompt must fit the rest of this step; alone it may exceed the budget
            self.waiting.remove(req)
            self.reserved_seats += len(req.pending_forks)
            cached = self.kv.allocate(req.seq_id, toks, req.kv_salt)
            if prefills is not None:  # the requests behind it see its prefill in flight
                self._index_prefill(req, prefills)
            first, last = cached // bs, (len(toks) - 1) // bs  # a hit leaves at least one token to compute (I6)
            if self.kv_tiers and last > first and not req.computes_whole_prompt:
                req.num_computed_tokens = cached
                req.status = RequestStatus.WAITING_FOR_KV
                self.loading.append(req)
                out.kv_loads.append(KVLoad(req, first, self.kv.block_table(req.seq_id)[first:last]))
                continue
            self._start(req, cached)
            n = req.num_kv_tokens - cached
            if chunked:
                n = min(n, budget)
            self._emit(out, req, n)
            budget -= n

    def _prefills_in_flight(self) -> dict[tuple[Any, tuple[int, ...]], list[Request]]:
        """Running and tier-loading requests whose prompt has full blocks not in the prefix cache yet, by their
        salt and first block (``_prefix_in_flight`` looks a waiting request up there)."""
        index: dict[tuple[Any, tuple[int, ...]], list[Request]] = {}
        for o in itertools.chain(self.running, self.loading):
            self._index_prefill(o, index)
        return index

    def _index_prefill(self, o: Request, index: dict[tuple[Any, tuple[int, ...]], list[Request]]) -> None:
        bs = self.block_size
        whole = o.num_prompt_tokens // bs * bs
        if whole and not o.computes_whole_prompt and self.kv.num_computed_tokens(o.seq_id) < whole:
            index.setdefault((o.kv_salt, tuple(o.all_token_ids[:bs])), []).append(o)

    def _prefix_in_flight(self, req: Request, prefills: dict[tuple[Any, tuple[int, ...]], list[Request]]) -> bool:
        """Whether a running or loading request is computing (or loading from a tier) full blocks of ``req``'s
        prompt that the prefix cache does not hold yet (``prefills``: ``_prefills_in_flight``). Admitted now,
        ``req`` would compute them a second time; a step or a few later (that request's prefill advances every
        step) it finds them cached. Requests sent together with one long shared prefix (a tenant's document, a
        burst of one system prompt) then compute it once."""
        if req.computes_whole_prompt:
            return False
        bs = self.block_size
        toks = req.all_token_ids
        full = (len(toks) - 1) // bs  # blocks it can take from the cache (its last token is always computed)
        if full < 1:
            return False
        for o in prefills.get((req.kv_salt, tuple(toks[:bs])), ()):
            done = self.kv.num_computed_tokens(o.seq_id) // bs  # its blocks cached before this step
            if _common_blocks(toks, o.all_token_ids, bs, min(full, o.num_prompt_tokens // bs)) > done:
                return True
        return False

    # -------------------------------------------------------------------- update
    def update_from_output(
        self, out: SchedulerOutput, sampled: Sequence[int], verified: Optional[Verified] = None
    ) -> list[Request]:
        """Record the tokens (Python ints) sampled for ``out.sample_rows``; returns the requests that got one.

        ``verified``: the step's speculating rows (sample row -> every token it emits: its accepted drafts,
        then the target's; ``sampled`` holds the first). A decode step the speculator's governor decided is
        timed for it, with the tokens it output. Requests aborted since ``schedule()`` are skipped.
        Finished requests free their blocks; a speculating one that runs on keeps the KV of its accepted tokens.
        """
        rows = out.sample_rows
        if len(sampled) != len(rows):
            raise ValueError(f"{len(rows)} rows to sample but {len(sampled)} tokens")
        now = time.monotonic()
        running = RequestStatus.RUNNING
        for head, child in out.forks:  # before any token: a head that stops at once must still be forkable
            if head.status is running and child in head.pending_forks:
                self._fork(head, child)
        samplers = out.samplers if len(out.samplers) == len(rows) else [out.requests[i] for i in rows]
        spec, g = self.spec, out.governed  # a decode-only step the governor decided: timed for it
        timed = g is not None and spec is not None and spec.governor is not None
        before = sum(len(r.output_token_ids) for r in samplers) if timed else 0
        if out.drafts:
            changed = self._update_speculative(out, samplers, sampled, verified.emitted if verified else {}, now)
        else:
            changed = self._update_plain(samplers, sampled, now)
        if timed:
            assert spec is not None and spec.governor is not None and g is not None
            tokens = sum(len(r.output_token_ids) for r in samplers) - before
            drafts = sum(len(d) for d in out.drafts.values())
            seconds = spec.clock() - g[2]
            spec.governor.observe(g[0], g[1], tokens, seconds, bool(drafts), len(out.requests), drafts)
        return changed

    def _update_plain(self, samplers: Sequence[Request], sampled: Sequence[int], now: float) -> list[Request]:
        """``update_from_output`` for a step without drafts: one token per sample row."""
        running = RequestStatus.RUNNING
        changed: list[Request] = []
        add = changed.append
        for req, tok in zip(samplers, sampled):
            if req.status is not running:
                continue
            outs = req.output_token_ids
            outs.append(tok)
            req.all_token_ids.append(tok)
            req.token_times.append(now)
            add(req)
            if tok in req.stop_ids and len(outs) > req.params.min_tokens:
                if tok in req.params.stop_token_ids:
                    req.stop_reason = tok
                self._stop(req, RequestStatus.FINISHED_STOPPED)
            elif len(outs) >= req.max_output:
                self._stop(req, RequestStatus.FINISHED_LENGTH)
        return changed

    def _update_speculative(
        self,
        out: SchedulerOutput,
        samplers: Sequence[Request],
        sampled: Sequence[int],
        emitted: dict[int, list[int]],
        now: float,
    ) -> list[Request]:
        """``update_from_output`` for a step with drafts: each row appends its tokens one by one until one stops
        it; then the KV of its rejected drafts is truncated."""
        spec = self.spec
        assert spec is not None
        running = RequestStatus.RUNNING
        changed: list[Request] = []
        for j, (req, row) in enumerate(zip(samplers, out.sample_rows)):
            drafts = out.drafts.get(row)
            toks = emitted[j] if drafts is not None else [sampled[j]]
            if drafts is not None and (len(toks) < 1 or len(toks) > len(drafts) + 1 or toks[0] != sampled[j]):
                raise ValueError(f"row {row}: {len(drafts)} drafts but tokens {toks!r} emitted")
            if req.status is not running:
                continue
            if drafts is not None:
                spec.record(req, len(drafts), len(toks) - 1)
            outs = req.output_token_ids
            before = len(outs)
            for tok in toks:
                outs.append(tok)
                req.all_token_ids.append(tok)
                req.token_times.append(now)
                if tok in req.stop_ids and len(outs) > req.params.min_tokens:
                    if tok in req.params.stop_token_ids:
                        req.stop_reason = tok
                    self._stop(req, RequestStatus.FINISHED_STOPPED)
                    break
                if len(outs) >= req.max_output:
                    self._stop(req, RequestStatus.FINISHED_LENGTH)
                    break
            if req.spec is not None:
                req.spec.new_tokens = len(outs) - before
            changed.append(req)
            if drafts is not None and req.status is running:
                kept = len(req.all_token_ids) - 1  # the pending token, as after a plain decode step
                self.kv.truncate(req.seq_id, kept)
                req.num_kv_tokens = req.num_computed_tokens = kept
        return changed

    def _fork(self, head: Request, child: Request) -> None:
        """Start a completion of ``head``'s group on the head's computed prompt blocks (shared, copy-on-write)."""
        head.pending_forks.remove(child)
        self.reserved_seats -= 1  # the reservation becomes the child's running seat
        self.kv.fork(head.seq_id, child.seq_id)
        child.num_kv_tokens = head.num_kv_tokens
        child.num_computed_tokens = head.num_computed_tokens
        child.num_cached_tokens = head.num_cached_tokens
        child.metrics.first_scheduled_time = head.metrics.first_scheduled_time
        child.status = RequestStatus.RUNNING
        self.running.append(child)

    def _stop(self, req: Request, status: RequestStatus) -> None:
        self.running.remove(req)
        self._finish(req, status)

    # --------------------------------------------------------------------- stats
    def stats(self, counters: bool = False) -> dict[str, Any]:
        """Queue sizes, KV usage (live / cached / free blocks), prefix hit rate, preemptions.

        ``counters``: also the KV manager's running counters (prefix-cache tokens, evictions, allocations).
        """
        kv = self.kv.stats()
        q = kv.get("prefix_query_tokens", 0)
        s = {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "num_swapped": len(self.swapped),
            "num_waiting_for_kv": len(self.loading),
            "kv_live_blocks": kv["live_blocks"],
            "kv_cached_blocks": kv["cached_blocks"],
            "kv_free_blocks": kv["free_blocks"],
            "kv_usage": kv["usage"],
            "prefix_hit_rate": kv.get("prefix_hit_tokens", 0) / q if q else 0.0,
            "num_preemptions": self.num_preemptions,
            "num_swaps": self.num_swaps,
            "swap_blocks_used": self.swap_blocks_used,
            "num_steps": self.num_steps,
        }
        if self.spec is not None:
            s.update(self.spec.stats())
        if counters:
            s["prefix_cache_queries"] = int(q)
            s["prefix_cache_hits"] = int(kv.get("prefix_hit_tokens", 0))
            s["kv_block_evictions"] = int(kv.get("evictions", 0))
            s["kv_block_allocations"] = int(kv.get("block_allocations", 0))
        return s


def _common_blocks(a: Sequence[int], b: Sequence[int], bs: int, limit: int) -> int:
    """The number of whole ``bs``-token blocks (at most ``limit``) ``a`` and ``b`` start with, given that the
    first one is shared: a binary search of slice comparisons."""
    lo, hi = 1, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo * bs : mid * bs] == b[lo * bs : mid * bs]:
            lo = mid
        else:
            hi = mid - 1
    return min(lo, limit)


def _own_salt(cache_salt: Union[str, bytes, None], tag: str) -> Union[str, bytes]:
    """A salt no other request has: its prompt takes no prefix-cache hit (but may hit its own blocks again)."""
    t = "\x00" + tag
    return cache_salt + t.encode() if isinstance(cache_salt, bytes) else (cache_salt or "") + t
