"""Pooling requests: embeddings from a decoder's hidden states (vLLM's pooling for decoder models).

A pooling request (``PoolingParams`` passed where ``SamplingParams`` go) is a prompt run by prefill only:
never sampled, finished once its prompt is computed, its blocks then freed. Its vector is the hidden state
after the final norm (what vLLM pools) at the last prompt token (``"last"``) or averaged over every prompt
token (``"mean"``: summed chunk by chunk in float64, so chunked prefill gives the same mean), then
L2-normalized (``normalize``). A step with pooling rows runs the model's ``forward_hidden`` once and takes the
generation rows' logits from it (``final_norm`` + ``compute_logits``); steps without keep the model's
``forward``. Mean pooling needs every position computed: its request takes no prefix-cache or tier hit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

__all__ = [
    "POOLING_TYPES",
    "PoolingParams",
    "PoolingState",
    "PoolSpan",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "pooling_unavailable",
    "pool_spans",
    "pooled_forward",
    "absorb",
    "embedding_output",
]

POOLING_TYPES = ("last", "mean")
MODEL_METHODS = ("forward_hidden", "final_norm", "compute_logits")


@dataclass(frozen=True)
class PoolingParams:
    """How to pool one prompt: ``pooling`` "last" (the last token's state) or "mean"; ``normalize``: L2."""

    pooling: str = "last"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling not in POOLING_TYPES:
            raise ValueError(f"PoolingParams.pooling must be one of {POOLING_TYPES}, got {self.pooling!r}")
        if not isinstance(self.normalize, (bool, np.bool_)):
            raise TypeError(f"PoolingParams.normalize must be a bool, got {type(self.normalize).__name__}")


class PoolingState:
    """One pooling request's progress: the float64 sum of the positions pooled so far, then its embedding."""

    __slots__ = ("params", "sum", "count", "embedding")

    def __init__(self, params: PoolingParams) -> None:
        self.params = params
        self.sum: Optional[np.ndarray] = None
        self.count = 0  # prompt positions in ``sum`` (mean)
        self.embedding: Optional[np.ndarray] = None  # float32 [H] once the prompt is computed

    @property
    def mean(self) -> bool:
        return self.params.pooling == "mean"


@dataclass
class PoolSpan:
    """Rows ``lo:hi`` of the step's tokens to pool for ``request``, the first at prompt position ``first``."""

    request: Any
    first: int
    lo: int
    hi: int


@dataclass
class EmbeddingOutput:
    """vLLM's ``EmbeddingOutput``: the pooled vector."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """vLLM's ``EmbeddingRequestOutput``: ``outputs.embedding`` (empty when aborted)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool
    prompt: Optional[str] = None
    finish_reason: Optional[str] = None
    num_cached_tokens: int = 0
    metrics: Any = None
    new_token_ids: list[int] = field(default_factory=list)  # none: the stream and server read it as they do outputs


def pooling_unavailable(model: Any) -> Optional[str]:
    """Why ``model`` cannot serve pooling requests (None when it can)."""
    missing = [m for m in MODEL_METHODS if not callable(getattr(model, m, None))]
    if missing:
        return f"model {type(model).__name__} has no {', '.join(missing)}: it cannot pool hidden states"
    return None


def pool_spans(requests: list[Any], rows: list[int], query_start_loc: np.ndarray) -> list[PoolSpan]:
    """The rows each pooling request (``requests[i]`` for i in ``rows``) pools this step (under the engine lock):
    mean, its prompt positions not pooled yet; last, its last prompt token when this step computes it."""
    spans = []
    for i in rows:
        r = requests[i]
        st = r.pooling
        a, b = int(query_start_loc[i]), int(query_start_loc[i + 1])
        first = r.num_computed_tokens - (b - a)  # prompt position of the step's first token
        if st.mean:
            skip = max(st.count - first, 0)  # positions already pooled (recomputed after a preemption)
            if a + skip < b:
                spans.append(PoolSpan(r, first + skip, a + skip, b))
        elif r.num_computed_tokens == r.num_prompt_tokens:
            spans.append(PoolSpan(r, r.num_prompt_tokens - 1, b - 1, b))
    return spans


def pooled_forward(
    model: Any,
    batch: Any,
    kv_caches: list[tuple[np.ndarray, np.ndarray]],
    rows: list[int],
    prompt_indices: Optional[np.ndarray],
    spans: list[PoolSpan],
) -> tuple[np.ndarray, np.ndarray, list[tuple[PoolSpan, np.ndarray]]]:
    """One ``forward_hidden`` for a step with pooling rows: (logits [len(rows), V] of the sampled sequences' last
    tokens, logits of ``prompt_indices``, each span's float64 sum (mean) or vector (last))."""
    hidden = model.forward_hidden(batch, kv_caches)  # [T, H]
    last = np.asarray(batch.query_start_loc, np.int64)[1:] - 1
    idx = last[np.asarray(rows, np.int64)]
    if prompt_indices is not None:
        idx = np.concatenate([idx, prompt_indices])
    if len(idx):
        logits = model.compute_logits(model.final_norm(hidden[idx]))
    else:
        logits = np.empty((0, model.vocab_size), np.float32)
    take = np.concatenate([np.arange(s.lo, s.hi, dtype=np.int64) for s in spans]) if spans else idx[:0]
    normed = model.final_norm(hidden[take]) if len(take) else hidden[:0]
    pooled, at = [], 0
    for s in spans:
        part = normed[at : at + s.hi - s.lo]
        at += s.hi - s.lo
        pooled.append((s, part.sum(axis=0, dtype=np.float64)))
    return logits[: len(rows)], logits[len(rows) :], pooled


def absorb(pooled: list[tuple[PoolSpan, np.ndarray]]) -> tuple[list[Any], dict[str, BaseException]]:
    """Fold a step's pooled rows into their requests (under the engine lock); returns (the requests whose
    embedding is now complete, request id -> its failure)."""
    done: list[Any] = []
    failed: dict[str, BaseException] = {}
    for s, vec in pooled:
        r = s.request
        st = r.pooling
        if r.finished:
            continue  # aborted since the step was scheduled
        if st.mean:
            if s.first != st.count:
                failed[r.request_id] = RuntimeError(f"mean pooling lost positions {st.count}..{s.first}")
                continue
            st.sum = vec if st.sum is None else st.sum + vec
            st.count += s.hi - s.lo
            if st.count < r.num_prompt_tokens:
                continue
            vec = st.sum / st.count
        if st.params.normalize:
            vec = vec / max(float(np.linalg.norm(vec)), 1e-12)
        st.embedding = vec.astype(np.float32)
        done.append(r)
    return done, failed


def embedding_output(req: Any) -> EmbeddingRequestOutput:
    """The ``EmbeddingRequestOutput`` of a pooling request (an empty embedding until it is complete)."""
    emb = req.pooling.embedding
    return EmbeddingRequestOutput(
        request_id=req.request_id,
        outputs=EmbeddingOutput([] if emb is None else emb.tolist()),
        prompt_token_ids=req.prompt_token_ids,
        finished=req.finished,
        prompt=req.prompt,
        finish_reason=req.finish_reason,
        num_cached_tokens=req.num_cached_tokens or 0,
        metrics=req.metrics,
    )
