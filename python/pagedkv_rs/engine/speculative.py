"""Speculative decoding: n-gram (prompt lookup) drafts, their verification, and when to speculate.

A decoding sequence proposes up to ``k`` tokens by finding its last ``n`` tokens (``n`` down to ``min_n``)
earlier in its prompt + output and copying what followed the latest such occurrence (vLLM's prompt lookup).
The scheduler appends the drafts after the sequence's pending token, so the step computes its ``1 + k``
positions like a small prefill chunk; the runner keeps the logits of all of them and ``verify`` accepts the
longest run of drafts the target agrees with, then adds the target's own token (the correction, or the
bonus after ``k`` accepted drafts). The scheduler then truncates the sequence's KV back to its accepted
tokens (``KVCacheManager.truncate``).

Acceptance is exact. Greedy: a draft is accepted iff it is the argmax (after penalties), so the output is the
one decoding without speculation gives. Temperature > 0: draft ``t`` (a point mass) is accepted with probability
``p(t)``, ``p`` the request's own distribution (penalties, temperature, min-p, top-k, top-p: ``sampling``);
on rejection the token comes from ``p`` with ``t`` removed, renormalised, so every position is distributed as
``p`` (Leviathan et al. 2023 with a one-hot draft).

When (``Speculator``): a sequence speculates while its drafts pay. Its draft length follows its acceptance
(the accepted run plus one, growing back to ``k`` while every draft is accepted), and it pauses, for a
doubling number of steps, when its running acceptance rate falls below ``min_acceptance``. No sequence
speculates in a step with more than ``max_batch`` decoding sequences (the forward is then compute-bound:
drafts cost what they save), nor a constrained one (structured outputs: its drafts would need the grammar's
check at every position).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import numpy as np

from pagedkv_rs.engine.request import SamplingParams
from pagedkv_rs.engine.sampling import apply_penalties, probabilities

__all__ = ["SpeculativeConfig", "SpecState", "Speculator", "propose_ngram", "verify"]

METHODS = ("ngram",)
_FIELDS = {"k": "k", "n": "n", "min_n": "min_n", "max_batch": "max_batch"}


@dataclass(frozen=True)
class SpeculativeConfig:
    """``method="ngram"``: up to ``k`` draft tokens per step from the longest match (``n`` .. ``min_n`` tokens)
    of the sequence's suffix in its own prompt + output. ``max_batch``: decoding sequences above which no
    sequence speculates. ``min_acceptance``: the running acceptance rate under which a sequence pauses."""

    method: str = "ngram"
    k: int = 4
    n: int = 3
    min_n: int = 1
    max_batch: int = 16
    min_acceptance: float = 0.25

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            hint = " (draft models are not implemented yet)" if self.method == "draft" else ""
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}{hint}")
        for name, lo, hi in (("k", 1, 32), ("n", 1, 64), ("min_n", 1, 64), ("max_batch", 0, 1 << 20)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ValueError(f"speculative {name} must be an int in [{lo}, {hi}], got {v!r}")
        if self.min_n > self.n:
            raise ValueError(f"speculative min_n ({self.min_n}) must be <= n ({self.n})")
        if not 0.0 <= self.min_acceptance < 1.0:
            raise ValueError(f"speculative min_acceptance must be in [0, 1), got {self.min_acceptance}")

    @classmethod
    def of(cls, spec: Union[None, str, Mapping[str, Any], SpeculativeConfig]) -> Optional[SpeculativeConfig]:
        """A config from ``"ngram"``, ``"ngram:k=5,n=3"``, a dict of fields, a config, or None (no speculation)."""
        if spec is None or isinstance(spec, SpeculativeConfig):
            return spec
        if isinstance(spec, Mapping):
            return cls(**spec)
        if not isinstance(spec, str):
            raise TypeError(f"speculative must be a str like 'ngram:k=4,n=3', got {type(spec).__name__}")
        method, _, rest = spec.strip().partition(":")
        fields: dict[str, Any] = {}
        for item in filter(None, rest.split(",")) if method != "draft" else ():
            m = re.fullmatch(r"\s*([a-z_]+)\s*=\s*(\S+)\s*", item)
            if m is None or m.group(1) not in _FIELDS:
                raise ValueError(f"bad speculative option {item!r} in {spec!r}: use k=K, n=N, min_n=M, max_batch=B")
            try:
                fields[m.group(1)] = int(m.group(2))
            except ValueError:
                raise ValueError(f"speculative {m.group(1)} must be an int, got {m.group(2)!r}") from None
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


class SpecState:
    """One sequence's speculation: its current draft length, acceptance and pause."""

    __slots__ = ("k", "rate", "pause", "backoff", "drafts", "draft_tokens", "accepted", "new_tokens")

    def __init__(self, k: int) -> None:
        self.k = k
        self.rate = 1.0  # running acceptance rate of its drafts
        self.pause = 0  # steps left without drafting
        self.backoff = 1
        self.drafts = 0  # verification steps with drafts
        self.draft_tokens = 0
        self.accepted = 0
        self.new_tokens = 1  # tokens its last step appended (stop strings look back over them)


class Speculator:
    """The scheduler's side: which sequences draft, how many tokens, and the counters."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def batch_speculates(self, num_decoding: int) -> bool:
        """Whether a step with this many decoding sequences drafts at all (not compute-bound)."""
        return num_decoding <= self.config.max_batch

    def propose(self, req: Any, budget: int) -> list[int]:
        """Drafts for a decoding request (its pending token not counted), within ``budget`` tokens."""
        if req.matcher is not None or req.pooling is not None:
            return []
        st = req.spec
        if st is None:
            st = req.spec = SpecState(self.config.k)
        if st.pause:
            st.pause -= 1
            return []
        room = min(st.k, budget, req.max_output - len(req.output_token_ids) - 1)
        if room < 1:
            return []
        toks = np.fromiter(req.all_token_ids, np.int64, len(req.all_token_ids))
        return propose_ngram(toks, room, self.config.n, self.config.min_n)

    def record(self, req: Any, proposed: int, accepted: int) -> None:
        """A verification: ``accepted`` of ``proposed`` drafts; adapts the request's draft length and pause."""
        st = req.spec
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        st.drafts += 1
        st.draft_tokens += proposed
        st.accepted += accepted
        st.rate = 0.7 * st.rate + 0.3 * (accepted / proposed)
        st.k = min(self.config.k, accepted + 1 + (accepted == proposed))
        if st.rate < self.config.min_acceptance:
            st.pause = st.backoff
            st.backoff = min(2 * st.backoff, 64)
            st.rate = 0.5  # a fresh start once the pause ends
        elif accepted:
            st.backoff = 1

    def stats(self) -> dict[str, Any]:
        """Counters (vLLM's spec_decode names): verification steps with drafts, draft tokens, accepted ones."""
        n, d, a = self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens
        return {
            "spec_decode_num_drafts": n,
            "spec_decode_num_draft_tokens": d,
            "spec_decode_num_accepted_tokens": a,
            "spec_decode_acceptance_rate": a / d if d else 0.0,
            "spec_decode_mean_accepted_length": 1.0 + a / n if n else 0.0,
        }


def verify(
    logits: Sequence[np.ndarray],
    drafts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    generators: Sequence[Optional[np.random.Generator]],
    history: Optional[tuple[Sequence[Sequence[int]], Sequence[Sequence[int]], Sequence[Any]]] = None,
) -> list[list[int]]:
    """The tokens each speculating sequence emits: its accepted drafts, then the target's token.

    ``logits[s]`` [k_s + 1, V]: the raw logits at the sequence's pending token and at each of its ``k_s``
    ``drafts[s]``. ``history`` (outputs, prompts, stop ids; needed with penalties): position ``j`` is
    penalised as if the first ``j`` drafts were already output.
    """
    ks = [len(d) for d in drafts]
    if [len(x) for x in logits] != [k + 1 for k in ks]:
        raise ValueError(f"verify: logits rows {[len(x) for x in logits]} for drafts of lengths {ks} (need k + 1)")
    x = np.concatenate(logits) if len(logits) > 1 else logits[0]  # [sum(k + 1), V]
    row_params = [p for p, k in zip(params, ks) for _ in range(k + 1)]
    if any(p.has_penalties for p in params):
        if history is None:
            raise ValueError("verify: penalties and min_tokens need the sequences' history")
        outs, prompts, stops = history
        h_out = [list(o) + list(d[:j]) for o, d, k in zip(outs, drafts, ks) for j in range(k + 1)]
        h_prompt = [p for p, k in zip(prompts, ks) for _ in range(k + 1)]
        h_stop = [s for s, k in zip(stops, ks) for _ in range(k + 1)]
        x = apply_penalties(x, row_params, h_out, h_prompt, h_stop)
    emitted: list[list[int]] = []
    if all(p.temperature == 0.0 for p in params):
        top = x.argmax(axis=1).tolist()
        lo = 0
        for d, k in zip(drafts, ks):
            t = top[lo : lo + k + 1]
            a = 0
            while a < k and t[a] == d[a]:
                a += 1
            emitted.append(list(d[:a]) + [t[a]])
            lo += k + 1
        return emitted
    p_all = probabilities(x, row_params)
    lo = 0
    for d, k, p, g in zip(drafts, ks, params, generators):
        rows = p_all[lo : lo + k + 1]
        lo += k + 1
        if p.temperature == 0.0:
            t = rows.argmax(axis=1).tolist()
            a = 0
            while a < k and t[a] == d[a]:
                a += 1
            emitted.append(list(d[:a]) + [t[a]])
            continue
        if g is None:
            raise ValueError(f"verify: a row samples with temperature {p.temperature} but has no generator")
        out: list[int] = []
        for j in range(k + 1):
            q = rows[j]
            if j == k:  # every draft accepted: the bonus token
                out.append(_draw(q, g))
                break
            t = int(d[j])
            if g.random() < q[t]:
                out.append(t)
                continue
            r = q.copy()
            r[t] = 0.0
            out.append(_draw(r, g) if r.sum() > 0 else t)
            break
        emitted.append(out)
    return emitted


def _draw(q: np.ndarray, g: np.random.Generator) -> int:
    """One token from the (unnormalised) distribution ``q`` [V], by inverse CDF."""
    cdf = np.cumsum(q)
    return int(min(np.searchsorted(cdf, g.random() * cdf[-1], side="right"), len(q) - 1))
