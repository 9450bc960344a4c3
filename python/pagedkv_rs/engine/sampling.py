"""Batched sampling in numpy: grammar masks, penalties, greedy, temperature, min-p, top-k, top-p, seeded
generators; logprobs."""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence
from typing import Optional

import numpy as np

from pagedkv_rs.engine.request import SamplingParams

__all__ = ["sample", "probabilities", "sorted_probabilities", "apply_mask", "apply_penalties", "top_logprobs"]


def apply_mask(logits: np.ndarray, rows: np.ndarray, bitmask: np.ndarray) -> None:
    """Set ``logits`` [B, V] to -inf, in place, where the bitmask int32 [R, ceil(V / 32)] of ``rows`` [R] has a 0 bit.

    Bit j of word w stands for token 32 w + j (llguidance's layout). Rows not in ``rows`` are untouched.
    """
    b, v = logits.shape
    off = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :v] == 0  # [R, V]
    if len(rows) == b and (rows == np.arange(b)).all():
        np.copyto(logits, -np.inf, where=off)
    else:
        sub = logits[rows]
        np.copyto(sub, -np.inf, where=off)
        logits[rows] = sub


def apply_penalties(
    logits: np.ndarray,
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]],
    prompt_token_ids: Sequence[Sequence[int]],
    stop_ids: Sequence[Collection[int]],
) -> np.ndarray:
    """Logits [B, V] after the min_tokens mask and the penalties (a float64 copy; rows without any unchanged).

    As in vLLM / HF, in this order: ``repetition_penalty`` r divides positive (multiplies negative)
    logits of tokens seen in prompt or output; ``frequency_penalty`` f and ``presence_penalty`` p
    subtract ``f * count`` and ``p * (count > 0)`` over the output; a row with fewer than
    ``min_tokens`` outputs gets -inf at its EOS and stop tokens. Counts come from one bincount over the batch's tokens.
    """
    b, v = logits.shape
    x = logits.astype(np.float64)
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if not rows:
        return x
    r = len(rows)
    y = x[rows]  # [R, V]
    outs = [output_token_ids[i] for i in rows]
    lens = np.fromiter(map(len, outs), np.int64, count=r)
    row_of = np.repeat(np.arange(r), lens)
    flat = np.fromiter(itertools.chain.from_iterable(outs), np.int64, count=int(lens.sum()))
    counts = np.bincount(row_of * v + flat, minlength=r * v).reshape(r, v).astype(np.float64)  # [R, V]
    rep = np.array([params[i].repetition_penalty for i in rows])
    if (rep != 1.0).any():
        prompts = [prompt_token_ids[i] for i in rows]
        plens = np.fromiter(map(len, prompts), np.int64, count=r)
        pflat = np.fromiter(itertools.chain.from_iterable(prompts), np.int64, count=int(plens.sum()))
        seen = np.bincount(np.repeat(np.arange(r), plens) * v + pflat, minlength=r * v).reshape(r, v) > 0
        seen |= counts > 0
        y = np.where(seen, np.where(y > 0, y / rep[:, None], y * rep[:, None]), y)
    freq = np.array([params[i].frequency_penalty for i in rows])
    pres = np.array([params[i].presence_penalty for i in rows])
    y -= freq[:, None] * counts + pres[:, None] * (counts > 0)
    masked = [j for j, i in enumerate(rows) if len(output_token_ids[i]) < params[i].min_tokens]
    if masked:
        ids = [[t for t in stop_ids[rows[j]] if t < v] for j in masked]
        mrow = np.repeat(np.array(masked, np.int64), [len(t) for t in ids])
        y[mrow, np.fromiter(itertools.chain.from_iterable(ids), np.int64, count=len(mrow))] = -np.inf
    x[rows] = y
    return x


def sample(
    logits: np.ndarray,
    params: Sequence[SamplingParams],
    generators: Sequence[np.random.Generator | None],
    *,
    output_token_ids: Optional[Sequence[Sequence[int]]] = None,
    prompt_token_ids: Optional[Sequence[Sequence[int]]] = None,
    stop_ids: Optional[Sequence[Collection[int]]] = None,
    masked_rows: Optional[np.ndarray] = None,
) -> np.ndarray:
    """Pick one token per row of ``logits`` [B, V]; returns int64 [B].

    ``masked_rows``: rows a grammar mask (``apply_mask``) has already limited; should ``min_tokens``
    then mask every token the grammar allows (its end), the grammar wins for that row.

    Rows with penalties or ``min_tokens`` first go through ``apply_penalties`` (which needs each
    row's output and prompt token ids and stop ids). Greedy rows take the argmax (first index on
    ties). Other rows: divide by temperature, drop tokens less likely than ``min_p`` times the most
    likely one, keep the top_k largest, then the smallest prefix of the sorted distribution whose
    mass reaches top_p (the most likely token always survives), and draw by inverse CDF with one
    uniform from the row's generator, so a seeded request samples the same tokens whatever batch
    it runs in.
    """
    logits = np.asarray(logits)
    if logits.ndim != 2 or logits.shape[0] != len(params) or len(generators) != len(params):
        raise ValueError(
            f"sample: logits shape {logits.shape} does not match {len(params)} params / {len(generators)} generators"
        )
    b, v = logits.shape
    if all(p.temperature == 0.0 and not p.has_penalties for p in params):  # greedy, nothing to adjust
        return logits.argmax(axis=1).astype(np.int64, copy=False)
    if any(p.has_penalties for p in params):
        if output_token_ids is None or prompt_token_ids is None or stop_ids is None:
            raise ValueError("sample: penalties and min_tokens need output_token_ids, prompt_token_ids and stop_ids")
        masked = None if masked_rows is None else logits[masked_rows]
        logits = apply_penalties(logits, params, output_token_ids, prompt_token_ids, stop_ids)
        if masked is not None:
            dead = ~np.isfinite(logits[masked_rows]).any(axis=1)
            if dead.any():
                logits[masked_rows[dead]] = masked[dead]
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
    order, probs = sorted_probabilities(logits[rows], [params[i] for i in rows])
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


def sorted_probabilities(logits: np.ndarray, params: Sequence[SamplingParams]) -> tuple[np.ndarray, np.ndarray]:
    """Per row of ``logits`` [R, V] (temperature > 0): the token order (most likely first) and the
    unnormalised probabilities in that order after temperature, min-p, top-k and top-p."""
    v = logits.shape[1]
    temps = np.array([p.temperature for p in params])
    x = logits.astype(np.float64) / temps[:, None]  # [R, V]
    order = np.argsort(-x, axis=1, kind="stable")
    xs = np.take_along_axis(x, order, axis=1)
    min_p = np.array([p.min_p for p in params])
    if (min_p > 0).any():  # p < min_p * p_max  <=>  x < x_max + log(min_p)
        with np.errstate(divide="ignore"):
            xs[xs < xs[:, :1] + np.log(min_p)[:, None]] = -np.inf
    top_k = np.array([p.top_k or v for p in params])
    xs[np.arange(v)[None, :] >= top_k[:, None]] = -np.inf
    probs = np.exp(xs - xs[:, :1])
    probs /= probs.sum(axis=1, keepdims=True)
    top_p = np.array([p.top_p for p in params])
    before = np.cumsum(probs, axis=1) - probs  # mass of strictly more likely tokens
    probs[before >= top_p[:, None]] = 0.0
    probs[:, 0] = np.maximum(probs[:, 0], np.finfo(np.float64).tiny)
    return order, probs


def probabilities(logits: np.ndarray, params: Sequence[SamplingParams]) -> np.ndarray:
    """The distribution ``sample`` draws from, per row of (penalised) ``logits`` [R, V]: float64 [R, V]
    in vocabulary order, summing to 1; a greedy row is one-hot at its argmax (first index on ties)."""
    r, v = logits.shape
    out = np.zeros((r, v))
    greedy = np.array([p.temperature == 0.0 for p in params], bool)
    if greedy.any():
        g = np.flatnonzero(greedy)
        out[g, logits[g].argmax(axis=1)] = 1.0
    rows = np.flatnonzero(~greedy)
    if len(rows):
        order, probs = sorted_probabilities(logits[rows], [params[i] for i in rows])
        probs /= probs.sum(axis=1, keepdims=True)
        sub = np.zeros((len(rows), v))
        np.put_along_axis(sub, order, probs, axis=1)
        out[rows] = sub
    return out


def top_logprobs(
    logits: np.ndarray, tokens: np.ndarray, k: Sequence[int]
) -> list[tuple[list[int], list[float], list[int]]]:
    """Per row of raw ``logits`` [R, V]: (ids, logprobs, ranks) of the top ``k[row]`` tokens and then ``tokens[row]``.

    Log-softmax in float64 over the whole row; rank 1 = the most likely (1 + the number of tokens
    with a strictly larger logprob). The chosen token comes last, also when it is among the top k.
    """
    x = np.asarray(logits, np.float64)
    r, v = x.shape
    if r == 0:
        return []
    mx = x.max(axis=1, keepdims=True)
    lp = x - (mx + np.log(np.exp(x - mx).sum(axis=1, keepdims=True)))  # [R, V]
    tokens = np.asarray(tokens, np.int64)
    chosen = lp[np.arange(r), tokens]
    chosen_rank = (lp > chosen[:, None]).sum(axis=1) + 1
    kmax = min(max(k), v)
    if kmax > 0:
        top = np.argpartition(-lp, kmax - 1, axis=1)[:, :kmax]
        top_lp = np.take_along_axis(lp, top, axis=1)
        o = np.lexsort((top, -top_lp), axis=1)  # by logprob descending, then by id
        top = np.take_along_axis(top, o, axis=1)
        top_lp = np.take_along_axis(top_lp, o, axis=1)
    out = []
    for i in range(r):
        ki = min(k[i], v)
        ids = top[i, :ki].tolist() if ki else []
        lps = top_lp[i, :ki].tolist() if ki else []
        ranks = list(range(1, ki + 1))
        ids.append(int(tokens[i]))
        lps.append(float(chosen[i]))
        ranks.append(int(chosen_rank[i]))
        out.append((ids, lps, ranks))
    return out
