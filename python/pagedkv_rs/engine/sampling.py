"""Batched sampling in numpy: greedy, temperature, top-k, top-p, per-request seeded generators."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pagedkv_rs.engine.request import SamplingParams

__all__ = ["sample"]


def sample(
    logits: np.ndarray, params: Sequence[SamplingParams], generators: Sequence[np.random.Generator | None]
) -> np.ndarray:
    """Pick one token per row of ``logits`` [B, V]; returns int64 [B].

    Greedy rows take the argmax (first index on ties). Other rows: divide by temperature, keep the
    top_k largest, then the smallest prefix of the sorted distribution whose mass reaches top_p
    (the most likely token always survives), and draw by inverse CDF with one uniform from the
    row's generator, so a seeded request samples the same tokens whatever batch it runs in.
    """
    logits = np.asarray(logits)
    if logits.ndim != 2 or logits.shape[0] != len(params) or len(generators) != len(params):
        raise ValueError(
            f"sample: logits shape {logits.shape} does not match {len(params)} params / {len(generators)} generators"
        )
    b, v = logits.shape
    out = np.empty(b, np.int64)
    temps = np.fromiter((p.temperature for p in params), np.float64, count=b)
    greedy = temps == 0.0
    if greedy.all():
        return logits.argmax(axis=1).astype(np.int64, copy=False)
    if greedy.any():
        out[greedy] = logits[greedy].argmax(axis=1)
    rows = np.flatnonzero(~greedy).tolist()
    if not rows:
        return out
    x = logits[rows].astype(np.float64) / temps[rows, None]  # [R, V]
    order = np.argsort(-x, axis=1, kind="stable")
    xs = np.take_along_axis(x, order, axis=1)
    top_k = np.array([params[i].top_k or v for i in rows])
    xs[np.arange(v)[None, :] >= top_k[:, None]] = -np.inf
    probs = np.exp(xs - xs[:, :1])
    probs /= probs.sum(axis=1, keepdims=True)
    top_p = np.array([params[i].top_p for i in rows])
    before = np.cumsum(probs, axis=1) - probs  # mass of strictly more likely tokens
    probs[before >= top_p[:, None]] = 0.0
    probs[:, 0] = np.maximum(probs[:, 0], np.finfo(np.float64).tiny)
    cdf = np.cumsum(probs, axis=1)
    u = np.empty(len(rows))
    for j, i in enumerate(rows):
        g = generators[i]
        if g is None:
            raise ValueError(f"sample: row {i} samples with temperature {temps[i]} but has no generator")
        u[j] = g.random()
    pick = np.minimum((cdf < (u * cdf[:, -1])[:, None]).sum(axis=1), v - 1)
    out[rows] = order[np.arange(len(rows)), pick]
    return out
