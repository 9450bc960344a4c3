"""Speculative decoding: n-gram (prompt lookup) and draft-model drafts, their verification, and when to speculate.

A decoding sequence proposes up to ``k`` tokens by finding its last ``n`` tokens (``n`` down to ``min_n``)
earlier in its prompt + output and copying what followed the latest such occurrence (vLLM's prompt lookup), or
(method "draft") takes the greedy tokens of a small model of the same vocabulary (``engine.draft``). The
scheduler appends the drafts after the sequence's pending token, so the step computes its ``1 + k`` positions
like a small prefill chunk; the runner keeps the logits of all of them and ``verify`` accepts the longest run
of drafts the target agrees with, then adds the target's own token (the correction, or the bonus after ``k``
accepted drafts). The scheduler then truncates the sequence's KV back to its accepted
tokens (``KVCacheManager.truncate``).

Acceptance is exact. At each position the target's own token is drawn as ``sample`` draws it (the argmax for
greedy; else one uniform from the request's generator over its distribution ``p`` after penalties, temperature,
min-p, top-k and top-p), and the draft is accepted iff it equals that token. For a one-hot draft ``t`` this is
the standard speculative-sampling rule (Leviathan et al. 2023): ``t`` is accepted with probability ``p(t)``, and
a rejected position's token is distributed as ``p`` without ``t``, renormalised, so every position is
distributed as ``p``. As the request draws one uniform per emitted token, in order, with or without drafts,
the outputs equal those of decoding without speculation, seeded sampling included.

When (``Governor``): speculation is run only where it pays, judged by what it yields, not by a model of what
a step costs (that depends on the kernels' row tiles, the model, the machine and its load). Per batch-size
bucket (1, 2-4, 5-16, 17+ decoding sequences) the governor keeps a decayed estimate of output tokens per second
of step time with drafts and without, runs the faster mode for a window of steps and then probes the other for
a few; a probe that confirms the other mode clearly slower doubles the next window, so the steps spent probing a
losing mode shrink geometrically. Its decisions depend only on the timings its clock reports. Inside a
speculating step each sequence takes the drafts its own acceptance ``alpha`` (accepted drafts over accepted +
rejections, decayed) makes likely: the ``j``-th draft while ``alpha^j`` is at least the bucket's bar, what a draft
row has been measured to cost in tokens of a step without drafts (``Governor.min_p``: ~0.1 where the weights
stream from memory, 1 where a step is compute-bound; ``MIN_P`` until measured); a sequence whose drafts keep
failing stops drafting and probes with one draft after a doubling number of steps. A drafting-mode step in which
no sequence took a draft times the mode without drafts. Only decode-only steps
draft (a step that prefills gives its budget to the prompt, and its time would not compare); none with more
than ``max_batch`` decoding sequences, and no constrained sequence (structured outputs: its drafts would need
the grammar's check at every position).
"""

from __future__ import annotations

import re
import time
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import numpy as np

from pagedkv_rs.engine.request import SamplingParams
from pagedkv_rs.engine.sampling import apply_penalties, sorted_probabilities
from pagedkv_rs.units import parse_memory

__all__ = ["Governor", "SpeculativeConfig", "SpecState", "Speculator", "Verified", "propose_ngram", "verify"]

METHODS = ("ngram", "draft")
_FIELDS = {
    "ngram": ("k", "n", "min_n", "max_batch", "adaptive", "window", "probe"),
    "draft": ("k", "max_batch", "adaptive", "window", "probe", "kv"),
}
_OPTION = r"\s*[a-z_]+\s*=\s*[^\s,]+\s*"
DEFAULT_DRAFT_KV = 64 << 20  # bytes of the draft model's KV pool

_METAVARS = {
    "k": "K",
    "n": "N",
    "min_n": "M",
    "max_batch": "B",
    "adaptive": "0|1",
    "window": "W",
    "probe": "P",
    "kv": "BYTES",
}


def _bytes(text: str) -> int:
    try:
        return parse_memory(text)
    except ValueError:
        raise ValueError(f"speculative kv must be bytes or a size like '64MiB', got {text!r}") from None


@dataclass(frozen=True)
class SpeculativeConfig:
    """``method="ngram"``: up to ``k`` draft tokens per step from the longest match (``n`` .. ``min_n`` tokens)
    of the sequence's suffix in its own prompt + output. ``method="draft"``: up to ``k`` tokens proposed greedily
    by the draft model ``path`` (a GGUF of the target's vocabulary, run in the same process with a KV pool of
    ``kv`` bytes, default 64 MiB). ``max_batch``: decoding sequences above which no sequence speculates.
    ``adaptive``: the governor runs each batch size in its faster mode (drafting or not), probing the other for
    ``probe`` steps after at least ``window`` steps of the faster one, and sequences take only the drafts their
    acceptance makes likely; ``adaptive=False``: every draft on offer is taken, whatever it costs (tests and
    benchmarks)."""

    method: str = "ngram"
    k: int = 4
    n: int = 5  # longer suffixes pick the right one of a copied text's repeated phrases (docs/speculative.md)
    min_n: int = 1
    max_batch: int = 16
    adaptive: bool = True
    window: int = 16
    probe: int = 4
    path: Optional[str] = None  # the draft model (method "draft")
    kv: Optional[int] = None  # bytes of the draft model's KV pool (method "draft"; None: ``DEFAULT_DRAFT_KV``)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        for name, lo, hi in (
            ("k", 1, 32),
            ("n", 1, 64),
            ("min_n", 1, 64),
            ("max_batch", 0, 1 << 20),
            ("window", 1, 1 << 16),
            ("probe", 1, 1 << 16),
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ValueError(f"speculative {name} must be an int in [{lo}, {hi}], got {v!r}")
        if self.min_n > self.n:
            raise ValueError(f"speculative min_n ({self.min_n}) must be <= n ({self.n})")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative adaptive must be a bool, got {self.adaptive!r}")
        if self.method == "draft":
            if not isinstance(self.path, str) or not self.path:
                raise ValueError(f"speculative method 'draft' needs the draft model's path, got {self.path!r}")
            if self.kv is not None and (isinstance(self.kv, bool) or not isinstance(self.kv, int) or self.kv < 1):
                raise ValueError(f"speculative kv must be a positive number of bytes, got {self.kv!r}")
        elif self.path is not None or self.kv is not None:
            raise ValueError(f"speculative path and kv belong to method 'draft', not {self.method!r}")

    @property
    def kv_bytes(self) -> int:
        """The draft model's KV pool in bytes."""
        return DEFAULT_DRAFT_KV if self.kv is None else self.kv

    @classmethod
    def of(cls, spec: Union[None, str, Mapping[str, Any], SpeculativeConfig]) -> Optional[SpeculativeConfig]:
        """A config from ``"ngram"``, ``"ngram:k=5,n=3"``, ``"draft:PATH"``, ``"draft:PATH:k=3,kv=128MiB"``, a dict
        of fields, a config, or None (no speculation).

        A draft path may hold ':': the options are what follows its last ':' when that is empty or a list of
        ``name=value`` items, so a path that itself ends in ``:name=value`` is written with a trailing ':'.
        """
        if spec is None or isinstance(spec, SpeculativeConfig):
            return spec
        if isinstance(spec, Mapping):
            given = dict(spec)
            if isinstance(given.get("kv"), str):
                given["kv"] = _bytes(given["kv"])
            return cls(**given)
        if not isinstance(spec, str):
            raise TypeError(f"speculative must be a str like 'ngram:k=4,n=5', got {type(spec).__name__}")
        method, _, rest = spec.strip().partition(":")
        path = None
        if method == "draft":
            head, sep, tail = rest.rpartition(":")
            if sep and re.fullmatch(rf"(?:{_OPTION}(?:,{_OPTION})*)?", tail):
                path, rest = head, tail
            else:
                path, rest = rest, ""
        allowed = _FIELDS.get(method, _FIELDS["ngram"])
        fields: dict[str, Any] = {} if path is None else {"path": path}
        for item in filter(None, rest.split(",")):
            m = re.fullmatch(r"\s*([a-z_]+)\s*=\s*(\S+)\s*", item)
            if m is None or m.group(1) not in allowed:
                raise ValueError(
                    f"bad speculative option {item!r} in {spec!r}: {method!r} takes "
                    + ", ".join(f"{f}={_METAVARS[f]}" for f in allowed)
                )
            name, text = m.groups()
            if name == "kv":
                fields[name] = _bytes(text)
                continue
            try:
                v = int(text)
            except ValueError:
                raise ValueError(f"speculative {name} must be an int, got {text!r}") from None
            fields[name] = bool(v) if name == "adaptive" and v in (0, 1) else v
        return cls(method=method, **fields)


def propose_ngram(tokens: np.ndarray, k: int, n: int, min_n: int = 1) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix (``n`` .. ``min_n``
    tokens) of ``tokens`` (int [L]); [] if none matches.

    Candidates are the positions holding the last token; each further suffix token keeps those preceded by it,
    so the cost is one comparison over the history plus one per surviving candidate and length.
    """
    size = len(tokens)
    if size < 2 or k < 1:
        return []
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])  # occurrences of the 1-token suffix, the last one excluded
    best, length = (ends if min_n <= 1 else None), 1
    for j in range(1, min(n, size - 1)):
        ends = ends[ends >= j]
        ends = ends[tokens[ends - j] == tokens[size - 1 - j]]
        if not len(ends):
            break
        length = j + 1
        if length >= min_n:
            best = ends
    if best is None or not len(best) or length < min_n:
        return []
    e = int(best[-1]) + 1
    return tokens[e : e + k].tolist()


@dataclass(frozen=True)
class Verified:
    """What the runner hands the scheduler about a step: the speculating rows' tokens."""

    emitted: dict[int, list[int]]  # sample row -> its accepted drafts, then the target's token


class SpecState:
    """One sequence's speculation: its acceptance and its probing back-off (its counters: ``req.metrics``)."""

    __slots__ = ("hits", "misses", "idle", "backoff", "new_tokens", "stored_blocks")

    def __init__(self) -> None:
        self.hits = 1.0  # decayed accepted drafts (a prior of alpha = 1/2)
        self.misses = 1.0  # decayed rejections (a verification stops at its first)
        self.idle = 0  # steps its low acceptance kept it from drafting since its last draft
        self.backoff = 1  # idle steps after which it probes with one draft
        self.new_tokens = 1  # tokens its last step appended (stop strings look back over them)
        self.stored_blocks = -1  # KV tiers: its blocks up to here were written through (-1: not tracked yet)

    @property
    def alpha(self) -> float:
        """The chance that a draft is accepted, given the previous one was."""
        return self.hits / (self.hits + self.misses)


class _Mode:
    """A mode's decayed output tokens and step seconds."""

    __slots__ = ("tokens", "seconds", "steps")

    def __init__(self) -> None:
        self.tokens = 0.0
        self.seconds = 0.0
        self.steps = 0

    @property
    def rate(self) -> float:
        """Output tokens per second of step time."""
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")


class _Bucket:
    """One batch-size bucket: its modes' estimates and where it is in its schedule."""

    __slots__ = ("modes", "on", "best", "left", "ran", "window", "extra", "rows", "idle")

    def __init__(self, window: int, probe: int) -> None:
        self.modes = (_Mode(), _Mode())  # without drafts, with drafts
        self.extra = self.rows = 0.0  # decayed seconds drafting steps took beyond a step without, and their drafts
        self.on = self.best = True  # first a probe-long window with drafts, then a probe without
        self.left = probe  # steps before the next decision
        self.ran = 0  # steps since the last one
        self.window = window  # the length of the next window of the better mode
        self.idle = 0  # drafting-mode steps without drafts since the last decision (they time the mode without)


class Governor:
    """Speculate or not, per batch-size bucket, by the output tokens per second each mode has been measured to give: run
    the better mode for a window, then probe the other for ``probe`` steps and decide again.

    A drafting window in which at least ``probe`` steps ran without drafts (drafting measured before) has just measured
    the other mode, and is decided without a probe. After a probe the better mode runs ``window`` steps; each probe that
    finds the other mode more than ``MARGIN`` slower doubles that (up to ``MAX_WINDOWS`` times the first), any other
    probe resets it. Probing thus takes at most ``probe / (window + probe)`` of a bucket's steps, and far less while one
    mode is clearly better; a mode within ``MARGIN`` of the other is probed often but costs little. A window ends early
    (after ``probe`` steps) when its mode's rate falls below the other's last estimate, so a change of workload or load
    is seen within a few steps. Deterministic: the decisions depend only on the observed tokens and seconds.
    """

    BUCKETS = (1, 4, 16)  # decoding sequences: 1 | 2-4 | 5-16 | 17+
    DECAY = 0.9  # per observed step of a mode: about its last 10 steps (a run of rejected drafts moves it little)
    MARGIN = 0.05
    MAX_WINDOWS = 16
    MIN_P_RANGE = (0.05, 1.0)

    def __init__(self, window: int = 16, probe: int = 4) -> None:
        self.window, self.probe = window, probe
        self.buckets = [_Bucket(window, probe) for _ in range(len(self.BUCKETS) + 1)]

    @classmethod
    def bucket(cls, num_decoding: int) -> int:
        """The bucket of a step with ``num_decoding`` decoding sequences."""
        return bisect_left(cls.BUCKETS, num_decoding)

    def speculates(self, bucket: int) -> bool:
        """Whether this bucket's next step drafts."""
        return self.buckets[bucket].on

    def observe(
        self,
        bucket: int,
        on: bool,
        tokens: int,
        seconds: float,
        drafted: Optional[bool] = None,
        seqs: int = 0,
        drafts: int = 0,
    ) -> None:
        """A decode step of ``bucket`` run in the drafting mode (``on``) or not: ``tokens`` output in ``seconds``.
        ``drafted`` (default ``on``): whether any sequence took drafts; a drafting-mode step in which none did
        (their acceptance kept them from it) ran as a step without drafts and times that mode, not drafting's.
        ``seqs`` decoding sequences and ``drafts`` draft rows: what a draft row costs (``min_p``)."""
        b = self.buckets[bucket]
        drafted = on if drafted is None else drafted
        m, off = b.modes[drafted], b.modes[0]
        if drafted and drafts and seqs and off.steps:
            # the step's time beyond what its sequences take without drafts
            b.extra = self.DECAY * b.extra + (max(seconds, 0.0) - seqs / off.rate)
            b.rows = self.DECAY * b.rows + drafts
        m.tokens = self.DECAY * m.tokens + tokens
        m.seconds = self.DECAY * m.seconds + max(seconds, 0.0)
        m.steps += 1
        if on != b.on:
            return
        b.left -= 1
        b.ran += 1
        b.idle += on and not drafted
        cur, other = b.modes[on], b.modes[not on]
        if b.on == b.best and b.ran >= self.probe and other.steps and cur.rate < other.rate:
            b.left = 0  # the better mode fell below the other's last estimate (the workload changed): probe now
        if b.left <= 0:
            self._decide(b)

    def min_p(self, bucket: int) -> Optional[float]:
        """The acceptance chance at which a draft row pays in ``bucket``: its measured cost in seconds times the
        tokens a second of steps without drafts gives (clamped to ``MIN_P_RANGE``); None before both are measured.
        A step reading its weights from memory takes a draft row almost free (a low bar); a compute-bound one
        pays about a sequence's share of the step for it (a bar near 1)."""
        b = self.buckets[bucket]
        if b.rows <= 0 or not b.modes[0].steps:
            return None
        lo, hi = self.MIN_P_RANGE
        return min(hi, max(lo, b.extra / b.rows * b.modes[0].rate))

    def _decide(self, b: _Bucket) -> None:
        b.ran = 0
        idle, b.idle = b.idle, 0
        # A window of the better mode ended: probe the other, unless the window was drafting and at least a probe's
        # worth of its steps ran without drafts (sequences whose acceptance kept them from drafting): those timed
        # the mode without drafts just now, and a probe would only cost drafts.
        if b.on == b.best and not (b.on and idle >= self.probe and b.modes[1].steps):
            b.on, b.left = not b.best, self.probe
            return
        off, on = b.modes[0].rate, b.modes[1].rate
        best = on >= off
        clear = min(off, on) < (1.0 - self.MARGIN) * max(off, on)
        b.window = min(2 * b.window, self.MAX_WINDOWS * self.window) if best == b.best and clear else self.window
        b.on = b.best = best
        b.left = b.window

    def stats(self) -> list[dict[str, Any]]:
        """Per bucket: its mode, and each mode's steps and tokens per second."""
        names = [f"{lo}-{hi}" if hi > lo else str(lo) for lo, hi in zip((1, 2, 5), self.BUCKETS)] + ["17+"]
        return [
            {
                "bucket": name,
                "speculating": b.on,
                "steps_off": b.modes[0].steps,
                "steps_on": b.modes[1].steps,
                "tok_s_off": b.modes[0].rate if b.modes[0].steps else None,
                "tok_s_on": b.modes[1].rate if b.modes[1].steps else None,
            }
            for name, b in zip(names, self.buckets)
        ]


class Speculator:
    """The scheduler's side: which steps and sequences draft, how many tokens, and the counters."""

    MIN_P = 0.25  # a sequence's j-th draft is taken while its chance of acceptance, alpha^j, is at least this

    def __init__(
        self, config: SpeculativeConfig, clock: Callable[[], float] = time.perf_counter, drafter: Any = None
    ) -> None:
        if (config.method == "draft") != (drafter is not None):
            raise ValueError(
                f"speculative method 'draft' needs its DraftRunner (LLMEngine loads it from {config.path!r})"
                if drafter is None
                else f"speculative method {config.method!r} takes no drafter"
            )
        self.config = config
        self.clock = clock  # the step timer the governor learns from (tests inject a fake one)
        # method "draft": the draft model's runner (``engine.draft.DraftRunner``): ``propose``, ``release``, ``stats``
        self.drafter = drafter
        self.governor = Governor(config.window, config.probe) if config.adaptive else None
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # while the draft model drafts off the engine lock (``hold_releases`` .. ``apply_releases``): requests
        # finished meanwhile, whose draft KV goes afterwards
        self._held: Optional[list[Any]] = None

    def mode(self, num_decoding: int) -> Optional[tuple[int, bool]]:
        """(governor bucket, whether it drafts) for a step with this many decoding sequences; None: the step
        is not governed (it drafts iff ``num_decoding <= max_batch``)."""
        if self.governor is None or num_decoding > self.config.max_batch:
            return None
        g = self.governor.bucket(num_decoding)
        return g, self.governor.speculates(g)

    def batch_speculates(self, num_decoding: int) -> bool:
        """Whether a step with this many decoding sequences may draft at all."""
        return num_decoding <= self.config.max_batch

    def room(self, req: Any, budget: int) -> int:
        """How many drafts a decoding request may take (its pending token not counted) within ``budget``: none
        for a constrained or pooling one, never past its ``max_tokens``."""
        if req.matcher is not None or req.pooling is not None:
            return 0
        if req.spec is None:
            req.spec = SpecState()
        return max(0, min(self.config.k, budget, req.max_output - len(req.output_token_ids) - 1))

    def propose(self, req: Any, budget: int) -> list[int]:
        """The n-gram drafts on offer for a decoding request (its pending token not counted), within ``budget``."""
        room = self.room(req, budget)
        if room < 1:
            return []
        toks = np.fromiter(req.all_token_ids, np.int64, len(req.all_token_ids))
        return propose_ngram(toks, room, self.config.n, self.config.min_n)

    def draft(self, reqs: Sequence[Any], ks: Sequence[int]) -> list[list[int]]:
        """The draft model's tokens for these requests, up to ``ks[i]`` each (fewer or none where its KV pool
        or context runs out)."""
        return self.drafter.propose(reqs, ks)  # type: ignore[no-any-return]

    def draft_for(self, out: Any) -> list[list[int]]:
        """The draft model's tokens for a scheduler output's ``draft_plan`` (``Scheduler.schedule``)."""
        return self.draft([out.requests[i] for i, _ in out.draft_plan], [k for _, k in out.draft_plan])

    def release(self, req: Any) -> None:
        """A request finished or was preempted: the draft model's KV of it goes (it catches up if it runs again);
        while the draft model is drafting, once it is done (``apply_releases``)."""
        if self.drafter is None:
            return
        if self._held is not None:
            self._held.append(req)
        else:
            self.drafter.release(req.seq_id)

    def hold_releases(self) -> None:
        """The draft model is about to draft without the engine lock: releases wait for ``apply_releases``."""
        self._held = []

    def apply_releases(self) -> None:
        """The releases held since ``hold_releases``."""
        held, self._held = self._held or [], None
        for req in held:
            self.release(req)

    def choose(self, req: Any, offered: int, min_p: Optional[float] = None) -> int:
        """How many of ``offered`` drafts the request takes: the ``j``-th while its acceptance makes it likely,
        ``alpha^j >= min_p`` (the governor's ``min_p`` for the step's bucket, ``MIN_P`` until it has one), or a
        probe of one after its back-off."""
        st = req.spec
        if not self.config.adaptive:
            return offered
        bar = self.MIN_P if min_p is None else min_p
        alpha, p, k = st.alpha, 1.0, 0
        while k < offered and p * alpha >= bar:
            p *= alpha
            k += 1
        if k:
            st.idle = 0
            return k
        st.idle += 1
        if st.idle >= st.backoff:
            st.idle = 0
            st.backoff = min(2 * st.backoff, 64)
            return 1
        return 0

    def record(self, req: Any, proposed: int, accepted: int) -> None:
        """A verification: ``accepted`` of ``proposed`` drafts."""
        st = req.spec
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        m = req.metrics
        m.num_drafts += 1
        m.num_draft_tokens += proposed
        m.num_accepted_tokens += accepted
        st.hits = 0.8 * st.hits + accepted
        st.misses = 0.8 * st.misses + (accepted < proposed)
        if accepted:
            st.backoff = 1

    def stats(self) -> dict[str, Any]:
        """Counters (vLLM's spec_decode names): verification steps with drafts, draft tokens, accepted ones; and
        the governor's state per bucket."""
        n, d, a = self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens
        return {
            "spec_decode_num_drafts": n,
            "spec_decode_num_draft_tokens": d,
            "spec_decode_num_accepted_tokens": a,
            "spec_decode_acceptance_rate": a / d if d else 0.0,
            "spec_decode_mean_accepted_length": 1.0 + a / n if n else 0.0,
            **({"spec_decode_governor": self.governor.stats()} if self.governor is not None else {}),
            **(self.drafter.stats() if self.drafter is not None else {}),
        }


def verify(
    logits: Sequence[Union[np.ndarray, Sequence[np.ndarray]]],
    drafts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    generators: Sequence[Optional[np.random.Generator]],
    history: Optional[tuple[Sequence[Sequence[int]], Sequence[Sequence[int]], Sequence[Any]]] = None,
) -> list[list[int]]:
    """The tokens each speculating sequence emits: its accepted drafts, then the target's token.

    ``logits[s]`` [k_s + 1, V]: the raw logits at the sequence's pending token and at each of its ``k_s``
    ``drafts[s]``, as one array or as a sequence of row blocks stacked in that order (views of the step's
    logits: greedy rows without penalties are read where they are, never copied). ``history`` (outputs,
    prompts, stop ids; needed with penalties): position ``j`` is penalised as if the first ``j`` drafts were
    already output.
    """
    blocks = [tuple(x) if isinstance(x, (list, tuple)) else (x,) for x in logits]
    ks = [len(d) for d in drafts]
    if [sum(len(b) for b in bs) for bs in blocks] != [k + 1 for k in ks]:
        raise ValueError(
            f"verify: logits rows {[sum(len(b) for b in bs) for bs in blocks]} for drafts of lengths {ks} (need k + 1)"
        )
    row_params = [p for p, k in zip(params, ks) for _ in range(k + 1)]
    starts = np.cumsum([0] + [k + 1 for k in ks])
    sampled = [j for j, p in enumerate(params) if p.temperature != 0.0]
    x: Optional[np.ndarray] = None  # every row, where penalties change them: [sum(k + 1), V]
    if any(p.has_penalties for p in params):
        if history is None:
            raise ValueError("verify: penalties and min_tokens need the sequences' history")
        outs, prompts, stops = history
        h_out = [list(o) + list(d[:j]) for o, d, k in zip(outs, drafts, ks) for j in range(k + 1)]
        h_prompt = [p for p, k in zip(prompts, ks) for _ in range(k + 1)]
        h_stop = [s for s, k in zip(stops, ks) for _ in range(k + 1)]
        x = apply_penalties(np.concatenate([b for bs in blocks for b in bs]), row_params, h_out, h_prompt, h_stop)
    greedy: list[int] = []
    if any(p.temperature == 0.0 for p in params):
        greedy = (
            x.argmax(axis=1) if x is not None else np.concatenate([b.argmax(axis=1) for bs in blocks for b in bs])
        ).tolist()
    sorted_rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    if sampled:  # every sampled row's distribution at once, as ``sample`` builds it
        idx = np.concatenate([np.arange(starts[j], starts[j + 1]) for j in sampled])
        rows = x[idx] if x is not None else np.concatenate([b for j in sampled for b in blocks[j]])
        order, probs = sorted_probabilities(rows, [row_params[i] for i in idx])
        cdf = np.cumsum(probs, axis=1)
        at = 0
        for j in sampled:
            sorted_rows[j] = (order[at : at + ks[j] + 1], cdf[at : at + ks[j] + 1])
            at += ks[j] + 1
    emitted: list[list[int]] = []
    lo = 0
    for s, (d, k, p, g) in enumerate(zip(drafts, ks, params, generators)):
        out: list[int] = []
        for j in range(k + 1):
            if p.temperature == 0.0:
                t = greedy[lo + j]
            else:  # one uniform per emitted token, as ``sample`` draws it
                if g is None:
                    raise ValueError(f"verify: a row samples with temperature {p.temperature} but has no generator")
                order, cdf = sorted_rows[s]
                pick = min(int((cdf[j] < g.random() * cdf[j, -1]).sum()), len(cdf[j]) - 1)
                t = int(order[j, pick])
            out.append(t)
            if j == k or t != d[j]:
                break
        emitted.append(out)
        lo += k + 1
    return emitted
