"""The runner: owns the KV caches, the host swap space and the KV tiers, and executes a scheduler output.

A step is ``apply_memory_ops`` (swap-out, swap-in, copy-on-write copies) and ``prepare`` under the
engine lock, then ``execute`` off it (the model forward on the step's ``BatchInputs``, sampling, and
the logprob rows). Tier loads run on the runner's I/O thread (``start_loads``; ``finished_loads``
hands back what arrived), beside the steps: the blocks a load fills belong to a request waiting for
them (``RequestStatus.WAITING_FOR_KV``), which no batch contains and the scheduler frees only once
the load has ended, so a slow tier delays only the requests that wait for it. A load has a deadline (the
tiers' ``deadline`` from ``start_loads``): past it, ``finished_loads`` hands the load back with nothing, the
request computes its blocks, and whatever the I/O thread brings later is dropped, never written (a per-load lock
orders the copy-in against that decision). While the I/O thread is stuck in one tier call past a deadline, new
loads are handed back at once. The runner decides nothing: which blocks to swap, copy, load or store comes from
the scheduler (vLLM v1's worker).
"""

from __future__ import annotations

import inspect
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Union, runtime_checkable

import numpy as np

from pagedkv_rs import kernels
from pagedkv_rs.batch import BatchInputs
from pagedkv_rs.engine.pooling import PoolSpan, pool_spans, pooled_forward, pooling_unavailable
from pagedkv_rs.engine.request import Request, RequestStatus, SamplingParams
from pagedkv_rs.engine.sampling import apply_mask, sample, top_logprobs
from pagedkv_rs.engine.scheduler import KVLoad, SchedulerConfig, SchedulerOutput
from pagedkv_rs.engine.speculative import Verified, verify
from pagedkv_rs.engine.structured import fill_masks
from pagedkv_rs.tiers import BlockLayout, KVTiers, Tier, chain_hashes, model_fingerprint, parse_tier, salt_digest

__all__ = ["Model", "ModelRunner", "StepInputs", "StepResult", "LogprobRow", "check_model", "check_speculative"]

LogprobRow = tuple[list[int], list[float], list[int]]  # token ids, logprobs, ranks
SHUTDOWN_FLUSH_SECONDS = 30.0  # at shutdown, blocks still queued for a tier after this are not stored


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


@dataclass
class StepInputs:
    """What ``execute`` needs besides the batch, gathered under the engine lock."""

    so: SchedulerOutput
    params: list[SamplingParams]
    generators: list[Any]
    history: Optional[tuple[list[list[int]], list[list[int]], list[frozenset[int]]]]
    # prompt_logprobs: [(request, first position, count)] and their token indices in the step
    prompt_spans: list[tuple[Request, int, int]]
    prompt_indices: Optional[np.ndarray]
    # structured outputs: the sample rows with a matcher, and their matchers
    mask_rows: Optional[np.ndarray] = None
    matchers: Optional[list[Any]] = None
    pool: Optional[list[PoolSpan]] = None  # pooling requests in the step: one forward_hidden serves all rows
    # speculative decoding: (sample row, draft tokens) of each speculating row, and the token indices of the
    # positions before each one's last (its pending token and all drafts but the last), in that order
    drafts: Optional[list[tuple[int, list[int]]]] = None
    draft_indices: Optional[np.ndarray] = None


@dataclass
class StepResult:
    """The sampled tokens (one per ``so.sample_rows``) and the logprob rows asked for."""

    tokens: np.ndarray
    logprobs: Optional[dict[int, LogprobRow]]  # sample row -> its row
    prompt_logprobs: list[tuple[Request, int, list[LogprobRow]]]  # (request, first position, rows)
    mask_seconds: Optional[float] = None  # time to compute this step's grammar masks (None: no constrained row)
    pooled: list[tuple[PoolSpan, np.ndarray]] = field(default_factory=list)  # (span, its float64 sum or vector)
    # speculative decoding: the speculating rows' tokens and the forward's cost; sample row -> their logprob rows
    verified: Optional[Verified] = None
    emitted_logprobs: Optional[dict[int, list[LogprobRow]]] = None


@dataclass(eq=False)
class _Load:
    """A tier load in flight. ``lock`` orders the I/O thread's copy-in against the engine giving up on it."""

    load: KVLoad
    deadline: float  # time.monotonic()
    lock: threading.Lock = field(default_factory=threading.Lock)
    ended: bool = False  # the I/O thread is done with it (under ``lock``)
    abandoned: bool = False  # handed back empty at its deadline: the I/O thread must not write (under ``lock``)


class ModelRunner:
    """One model, its KV caches (one (K, V) pair per layer), swapped-out KV, and the tiers below the pool."""

    def __init__(
        self,
        model: Any,
        num_blocks: int,
        block_size: int,
        kv_cache_dtype: Any = "float32",
        *,
        kv_tiers: Optional[Sequence[Any]] = None,
        kv_tier_secret: Optional[Union[str, bytes]] = None,
        kv_tier_deadline: float = 0.5,
        seed: int = 0,
    ) -> None:
        self.model = model
        self._rng = np.random.default_rng(seed)
        self.block_size = block_size
        self.kv_caches: list[tuple[np.ndarray, np.ndarray]] = [
            kernels.new_kv_cache(num_blocks, block_size, model.num_kv_heads, model.head_dim, kv_cache_dtype)
            for _ in range(model.num_layers)
        ]
        self.host: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}  # request id -> its swapped-out KV
        self._io: Optional[queue.SimpleQueue[Optional[_Load]]] = None  # the I/O thread's queue; started on first use
        self._pending: list[_Load] = []  # queued or running on the I/O thread, not yet handed back
        self._loaded: list[tuple[KVLoad, int]] = []  # (load, tokens that arrived), not yet handed back
        self._busy_since: Optional[float] = None  # when the I/O thread's current lookup began
        self._load_lock = threading.Lock()
        self._load_done = threading.Event()
        self.kv_tiers: Optional[KVTiers] = None
        self.kv_events: Any = None  # a KVEventPublisher (engine/kv_events.py): drained once per step in store()
        if kv_tiers:
            self.kv_tiers = _make_tiers(model, self.kv_caches, block_size, kv_tiers, kv_tier_secret, kv_tier_deadline)
        self.logits_indices = _takes_logits_indices(model)
        # The model writes each step's logits into rows of this buffer (``forward(out=...)``), valid until the next
        # step: a large vocabulary's fresh [N, V] array a step costs page faults on every element.
        self._logits_buf: Optional[np.ndarray] = None if not _takes(model, "out") else np.empty((0, 0), np.float32)
        # why prompt_logprobs cannot be served, or None
        self._masks: Optional[ThreadPoolExecutor] = None  # grammar masks, beside the forward; started on first use
        self.no_prompt_logprobs = (
            None if self.logits_indices else f"model {type(model).__name__}.forward takes no logits_indices"
        )
        self.no_pooling = pooling_unavailable(model)  # why pooling requests cannot be served, or None

    def _logits_out(self, rows: int, vocab: int) -> dict[str, np.ndarray]:
        """``{"out": [rows, vocab] rows of the reused logits buffer}`` (grown as needed), or ``{}``."""
        buf = self._logits_buf
        if buf is None:
            return {}
        if buf.shape[0] < rows or buf.shape[1] != vocab:
            buf = self._logits_buf = np.empty((max(rows, buf.shape[0]), vocab), np.float32)
        return {"out": buf[:rows]}

    @property
    def unsupported(self) -> dict[str, Optional[str]]:
        """``InputLimits`` fields: why the door refuses prompt logprobs and pooling requests (None: served)."""
        return {"prompt_logprobs": self.no_prompt_logprobs, "pooling": self.no_pooling}

    def add_generators(self, req: Request, grammar: Any = None) -> None:
        """The random streams of a sampled request's completions (``params.seed``, else one drawn here),
        and one matcher per completion of a constrained one (``grammar``: its ``CompiledGrammar``)."""
        if grammar is not None:
            for m in req.group:
                m.matcher = grammar.new_matcher()
        if req.params.greedy:
            return
        seed = req.params.seed if req.params.seed is not None else int(self._rng.integers(1 << 63))
        for m in req.group:  # completion i > 0 of a seeded request: its own stream of the same seed
            m.generator = np.random.default_rng(seed if m.index == 0 else [seed, m.index])

    # ------------------------------------------------------------------ memory
    def apply_memory_ops(self, so: SchedulerOutput) -> None:
        """Swap-out, then swap-in, then copy-on-write copies, in every layer (before the forward)."""
        for s in so.swap_out:
            idx = np.asarray(s.block_ids, np.int64)
            self.host[s.request_id] = [(k[idx].copy(), v[idx].copy()) for k, v in self.kv_caches]
        for si in so.swap_in:
            host = self.host.pop(si.request_id)
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

    def drop(self, requests: Sequence[Request]) -> None:
        """Forget the swapped-out KV of finished requests."""
        for r in requests:
            self.host.pop(r.request_id, None)

    # ------------------------------------------------------------------- tiers
    def start_loads(self, loads: Sequence[KVLoad]) -> None:
        """Queue the lookups and loads of these requests on the I/O thread, each with the tiers' deadline."""
        tiers = self.kv_tiers
        if tiers is None:
            raise RuntimeError("tier loads need KV tiers")
        if self._io is None:  # a daemon thread: a tier call that never returns must not hold the process's exit
            self._io = queue.SimpleQueue()
            threading.Thread(target=self._io_loop, args=(self._io,), name="pagedkv-tier-load", daemon=True).start()
        now = time.monotonic()
        queued: list[_Load] = []
        with self._load_lock:
            if self._busy_since is not None and now - self._busy_since > tiers.deadline:
                tiers.note_abandoned(len(loads))  # stuck in a tier call: these compute at once
                self._loaded += [(ld, 0) for ld in loads]
                self._load_done.set()
                return
            queued = [_Load(ld, now + tiers.deadline) for ld in loads]
            self._pending += queued
        for p in queued:
            self._io.put(p)

    def _io_loop(self, q: queue.SimpleQueue[Optional[_Load]]) -> None:
        while (p := q.get()) is not None:
            self._load(p)

    def finished_loads(self) -> list[tuple[KVLoad, int]]:
        """The loads that ended since the last call, with the tokens each brought; loads past their deadline
        come back with none (what they fetch later is dropped)."""
        now = time.monotonic()
        with self._load_lock:
            late = 0
            for p in [p for p in self._pending if now >= p.deadline]:
                with p.lock:  # held by the I/O thread only while it copies verified blocks in
                    if p.ended:
                        continue  # ended in time: its thread hands it back
                    p.abandoned = True
                self._pending.remove(p)
                self._loaded.append((p.load, 0))
                late += 1
            if late and self.kv_tiers is not None:
                self.kv_tiers.note_abandoned(late)
            done, self._loaded = self._loaded, []
            self._load_done.clear()
            return done

    def loads_in_flight(self) -> int:
        """Loads not yet handed back by ``finished_loads``."""
        with self._load_lock:
            return len(self._pending) + len(self._loaded)

    def wait_loads(self, timeout: float) -> None:
        """Until a load ends (or ``timeout`` seconds, capped at the earliest load's deadline)."""
        with self._load_lock:
            if self._pending:
                timeout = min(timeout, max(0.0, min(p.deadline for p in self._pending) - time.monotonic()))
        self._load_done.wait(timeout)

    def _load(self, p: _Load) -> None:
        """On the I/O thread: look up the request's blocks in the tiers and copy the hits into them.

        A tier never fails a request: on any error, or past the deadline, the request computes those blocks.
        """
        tiers = self.kv_tiers
        assert tiers is not None
        bs = self.block_size
        ld = p.load
        req, first = ld.request, ld.first_block
        last = first + len(ld.block_ids)
        n = 0
        try:
            # else aborted, or the deadline passed while it queued: nothing to fetch
            if req.status is RequestStatus.WAITING_FOR_KV and time.monotonic() < p.deadline:
                toks = req.all_token_ids
                # a copy: past the deadline the engine thread extends the request's own list concurrently
                hashes = chain_hashes(toks[: last * bs], bs, req.cache_salt, list(req.block_hashes))
                parent = hashes[first - 1] if first else bytes(16)
                salt = salt_digest(req.cache_salt)
                with self._load_lock:
                    self._busy_since = time.monotonic()
                got = tiers.lookup(hashes[first:last], parent, toks[first * bs : last * bs], salt, p.deadline)
                with p.lock:
                    if p.abandoned:
                        tiers.note_late()
                    elif got:
                        tiers.load_into(self.kv_caches, ld.block_ids[: len(got)], got)
                        n = len(got) * bs
                        if self.kv_events is not None:
                            self.kv_events.note_loaded(toks[first * bs : first * bs + n])
                    p.ended = True
        except Exception:
            for m in tiers.metrics:
                m.add(errors=1)
            n = 0
        finally:
            with p.lock:
                p.ended = True
                abandoned = p.abandoned
            with self._load_lock:
                self._busy_since = None
                if not abandoned:
                    self._pending.remove(p)
                    self._loaded.append((ld, n))
                    self._load_done.set()

    def store(self, so: SchedulerOutput) -> None:
        """Write-through: queue the blocks this step completed for the KV tiers (copied out now); hand the
        pool's KV events of this step to their publisher."""
        if self.kv_events is not None:
            self.kv_events.collect()
        tiers = self.kv_tiers
        if tiers is None or not so.kv_stores:
            return
        bs = self.block_size
        try:
            for st in so.kv_stores:
                req, lo, hi = st.request, st.first_block, st.first_block + len(st.block_ids)
                if req.status is not RequestStatus.RUNNING:
                    continue  # aborted since the step was scheduled
                toks = req.all_token_ids
                hashes = chain_hashes(toks[: hi * bs], bs, req.cache_salt, req.block_hashes)
                tiers.store(
                    self.kv_caches,
                    st.block_ids,
                    hashes[lo:hi],
                    [hashes[j - 1] if j else bytes(16) for j in range(lo, hi)],
                    [toks[j * bs : (j + 1) * bs] for j in range(lo, hi)],
                    salt_digest(req.cache_salt),
                )
        except Exception:  # never fail a step for a tier
            for m in tiers.metrics:
                m.add(errors=1)

    # ----------------------------------------------------------------- forward
    def prepare(self, so: SchedulerOutput) -> StepInputs:
        """The sampling inputs and prompt-logprob positions of ``so`` (under the engine lock)."""
        to_sample = so.samplers
        params = [r.params for r in to_sample]
        history = None
        if any(p.has_penalties for p in params):
            history = (
                [r.output_token_ids for r in to_sample],
                [r.prompt_token_ids for r in to_sample],
                [r.stop_ids for r in to_sample],
            )
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
        cons = [j for j, r in enumerate(to_sample) if r.matcher is not None]
        drafts = dindex = None
        if so.drafts:
            if not self.logits_indices:
                raise ValueError(f"speculative decoding: {self.no_prompt_logprobs}")
            drafts = [(j, so.drafts[i]) for j, i in enumerate(so.sample_rows) if i in so.drafts]
            starts = [int(qsl[i]) for i in so.sample_rows if i in so.drafts]
            dindex = np.concatenate([np.arange(q, q + len(d), dtype=np.int64) for q, (_, d) in zip(starts, drafts)])
        return StepInputs(
            so,
            params,
            [r.generator for r in to_sample],
            history,
            spans,
            np.concatenate(idx) if idx else None,
            np.asarray(cons, np.int64) if cons else None,
            [to_sample[j].matcher for j in cons] if cons else None,
            pool_spans(so.requests, so.pool_rows, qsl) if so.pool_rows else None,
            drafts,
            dindex,
        )

    def execute(self, si: StepInputs) -> StepResult:
        """The forward, the sampling and the logprob rows of one step (off the engine lock)."""
        so, params = si.so, si.params
        rows = so.sample_rows
        b = so.batch.num_seqs
        vocab = self.model.vocab_size
        masks = None
        if si.matchers:  # every constrained row's bitmask, in llguidance's threads while the forward runs
            if self._masks is None:
                self._masks = ThreadPoolExecutor(1, thread_name_prefix="pagedkv-grammar-mask")
            masks = self._masks.submit(_timed_masks, si.matchers, vocab)
        pooled: list[tuple[PoolSpan, np.ndarray]] = []
        if si.pool is not None:  # one forward_hidden: the pooling rows and the sampled rows' logits
            logits, extra, pooled = pooled_forward(
                self.model, so.batch, self.kv_caches, rows, si.prompt_indices, si.pool
            )
            draft_logits = logits[:0]  # a step with pooling requests has no drafts
        else:
            more = [x for x in (si.prompt_indices, si.draft_indices) if x is not None]
            want = b + sum(len(x) for x in more)
            out = self._logits_out(want, vocab)
            if not more:
                logits = self.model.forward(so.batch, self.kv_caches, **out)
            else:
                last = so.batch.query_start_loc[1:].astype(np.int64) - 1
                idx = np.concatenate([last, *more])
                logits = self.model.forward(so.batch, self.kv_caches, logits_indices=idx, **out)
            if not isinstance(logits, np.ndarray) or logits.shape != (want, vocab):
                raise ValueError(
                    f"model.forward returned {getattr(logits, 'shape', type(logits))}, expected ({want}, {vocab})"
                )
            p_end = b + (0 if si.prompt_indices is None else len(si.prompt_indices))
            extra, draft_logits = logits[b:p_end], logits[p_end:]
            if rows == list(range(len(rows))):
                logits = logits[: len(rows)]  # a view: the sample rows come first
            else:
                logits = logits[rows]
        speculating = {j for j, _ in si.drafts} if si.drafts else ()
        sel = [j for j, p in enumerate(params) if p.logprobs is not None and j not in speculating]
        raw = logits[sel] if sel else None  # logprobs: the raw distribution, taken before any mask
        mask_seconds = None
        if masks is not None:
            bitmask, mask_seconds = masks.result()
            t0 = time.perf_counter()
            if not logits.flags.writeable:
                logits = logits.copy()
            apply_mask(logits, si.mask_rows, bitmask)  # type: ignore[arg-type]
            mask_seconds += time.perf_counter() - t0
        emitted = emitted_lp = None
        if si.drafts:  # speculating rows: verified here, the others sampled as usual
            tokens, emitted, emitted_lp = self._speculate(si, logits, draft_logits)
        elif rows:
            o, pr, st = si.history if si.history is not None else (None, None, None)
            tokens = sample(
                logits,
                params,
                si.generators,
                output_token_ids=o,
                prompt_token_ids=pr,
                stop_ids=st,
                masked_rows=si.mask_rows,
            )
        else:
            tokens = np.empty(0, np.int64)
        lp = None
        if sel:  # top-k logprobs (raw distribution) of the sampled tokens, keyed by sample row
            lp = dict(zip(sel, top_logprobs(raw, tokens[sel], [params[j].logprobs for j in sel])))  # type: ignore[misc]
        prompt_rows = self._prompt_rows(si.prompt_spans, extra)
        verified = Verified(emitted or {})
        return StepResult(tokens, lp, prompt_rows, mask_seconds, pooled, verified, emitted_lp)

    def _speculate(
        self, si: StepInputs, logits: np.ndarray, draft_logits: np.ndarray
    ) -> tuple[np.ndarray, dict[int, list[int]], dict[int, list[LogprobRow]]]:
        """Sample the plain rows and verify the speculating ones: (first token per sample row, sample row ->
        every token it emits, sample row -> their logprob rows when asked for)."""
        assert si.drafts is not None
        params, gens = si.params, si.generators
        spec_js = [j for j, _ in si.drafts]
        plain = sorted(set(range(len(params))) - set(spec_js))
        tokens = np.empty(len(params), np.int64)
        h = si.history
        if plain:
            o, pr, st = (None, None, None) if h is None else ([x[j] for j in plain] for x in h)
            masked = None
            if si.mask_rows is not None:  # constrained rows never speculate: they are plain rows
                masked = np.searchsorted(np.asarray(plain), si.mask_rows)
            tokens[plain] = sample(
                logits[plain],
                [params[j] for j in plain],
                [gens[j] for j in plain],
                output_token_ids=o,
                prompt_token_ids=pr,
                stop_ids=st,
                masked_rows=masked,
            )
        rows: list[tuple[np.ndarray, np.ndarray]] = []
        at = 0
        for j, d in si.drafts:  # the pending token's and every draft's position but the last; the last (views)
            rows.append((draft_logits[at : at + len(d)], logits[j : j + 1]))
            at += len(d)
        hist = None if h is None else tuple([x[j] for j in spec_js] for x in h)
        out = verify(
            rows,
            [d for _, d in si.drafts],
            [params[j] for j in spec_js],
            [gens[j] for j in spec_js],
            hist,  # type: ignore[arg-type]
        )
        emitted = dict(zip(spec_js, out))
        for j, toks in emitted.items():
            tokens[j] = toks[0]
        lps: dict[int, list[LogprobRow]] = {}
        for (j, _), r, toks in zip(si.drafts, rows, out):
            k = params[j].logprobs
            if k is not None:
                lps[j] = top_logprobs(np.concatenate(r)[: len(toks)], np.asarray(toks, np.int64), [k] * len(toks))
        return tokens, emitted, lps

    @staticmethod
    def _prompt_rows(
        spans: list[tuple[Request, int, int]], logits: np.ndarray
    ) -> list[tuple[Request, int, list[LogprobRow]]]:
        if not spans:
            return []
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

    def shutdown(self) -> None:
        """Let the loads in flight end until their deadline (``finished_loads`` hands every one back, empty if
        it did not end), stop the I/O thread, flush the tiers' writers (at most ``SHUTDOWN_FLUSH_SECONDS``)."""
        if self._masks is not None:
            self._masks.shutdown(wait=True)
            self._masks = None
        if self._io is not None:
            self._io.put(None)
            self._io = None
            while True:
                with self._load_lock:
                    ends = [p.deadline for p in self._pending if not p.ended]
                if not ends or time.monotonic() >= max(ends):
                    break
                time.sleep(0.005)
        if self.kv_tiers is not None:
            self.kv_tiers.flush(SHUTDOWN_FLUSH_SECONDS)


def _timed_masks(matchers: list[Any], vocab: int) -> tuple[np.ndarray, float]:
    t0 = time.perf_counter()
    return fill_masks(matchers, vocab), time.perf_counter() - t0


def check_speculative(model: Any, config: SchedulerConfig) -> SchedulerConfig:
    """``config``, if the model can serve its speculative decoding (logits at every position of a chunk)."""
    if config.speculative is not None and not _takes_logits_indices(model):
        raise ValueError(
            f"speculative decoding needs logits at every draft: model {type(model).__name__}.forward "
            "takes no logits_indices"
        )
    return config


def _takes_logits_indices(model: Any) -> bool:
    return _takes(model, "logits_indices")


def _takes(model: Any, name: str) -> bool:
    """``model.forward`` has a parameter ``name``."""
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - a builtin forward without a signature
        return False


def check_model(model: Any) -> int:
    """``model`` implements ``Model``; returns its vocabulary size."""
    if not isinstance(model, Model):
        raise TypeError(f"model {type(model).__name__} does not implement the Model protocol")
    vocab = getattr(model, "vocab_size", None)
    if isinstance(vocab, bool) or not isinstance(vocab, (int, np.integer)) or vocab < 1:
        raise TypeError(f"model.vocab_size must be a positive int, got {vocab!r}")
    return int(vocab)


def _make_tiers(
    model: Any,
    kv_caches: list[tuple[np.ndarray, np.ndarray]],
    block_size: int,
    specs: Sequence[Any],
    secret: Optional[Union[str, bytes]],
    deadline: float,
) -> KVTiers:
    """Parse the tier specs (or take ``Tier`` objects) and fingerprint the model for them."""
    if isinstance(specs, (str, bytes)):
        raise TypeError("kv_tiers must be a list of tier specs, e.g. ['disk:/var/cache/pagedkv?size=8GiB']")
    tiers = [s if isinstance(s, Tier) else parse_tier(s, secret=secret) for s in specs]
    layout = BlockLayout(model.num_layers, model.num_kv_heads, block_size, model.head_dim, kv_caches[0][0].dtype)
    return KVTiers(tiers, layout, model_fingerprint(model, layout), deadline=deadline)
