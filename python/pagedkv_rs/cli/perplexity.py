"""``pagedkv perplexity FILE [--model GGUF] [--ctx N]``: llama.cpp's ``llama-perplexity`` method on our model.

The text is tokenized whole (BOS first where the model's vocabulary adds one) and cut into chunks of N tokens
(a tail shorter than N is dropped). Each chunk runs alone from an empty cache with its first token replaced by
BOS (where the model adds BOS), and only its second half is scored: the log p of tokens ``N/2 + 1 .. N - 1``
given everything before them in the chunk. PPL = exp(mean negative log p); the +/- is llama.cpp's: the standard
error of the mean negative log p, times PPL. The same text, N and quant type give llama-perplexity's number.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import numpy as np

__all__ = [
    "KLResult",
    "PerplexityResult",
    "build_parser",
    "choose_act_digits",
    "chunk_logits",
    "kl_divergence",
    "main",
    "perplexity",
]

BLOCK_SIZE = 16
LOGITS_BUDGET = 1 << 24  # float32 logits per step (64 MiB): bounds how many chunks share a step


@dataclass
class PerplexityResult:
    """Final PPL and its +/-, the tokens scored, and the running PPL after each chunk (llama.cpp's [i] values)."""

    ppl: float
    stderr: float
    count: int
    running: list[float] = field(default_factory=list)


def _checked_chunks(model: Any, token_ids: list[int], ctx: int, max_chunks: Optional[int]) -> int:
    """The number of chunks scored (ValueError for a ctx or text llama-perplexity would refuse)."""
    if ctx < 4:
        raise ValueError(f"ctx must be at least 4, got {ctx}")
    if ctx > model.config.max_model_len:
        raise ValueError(f"ctx {ctx} exceeds the model's context length {model.config.max_model_len}")
    if len(token_ids) < 2 * ctx:
        raise ValueError(
            f"the text tokenizes to only {len(token_ids)} tokens; perplexity with a context of {ctx} needs at least "
            f"{2 * ctx} (as llama-perplexity does)"
        )
    n_chunks = len(token_ids) // ctx if max_chunks is None else min(max_chunks, len(token_ids) // ctx)
    if n_chunks < 1:
        raise ValueError(f"max_chunks must be at least 1, got {max_chunks}")
    return n_chunks


def chunk_logits(
    model: Any, token_ids: list[int], ctx: int, n_chunks: int, *, bos_id: Optional[int] = None
) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """Per chunk ``c`` (in order): ``(c, logits float32 [S, V], targets int64 [S])``, the scored positions' logits
    (``S = ctx - ctx/2 - 1``) and the tokens they predict; several chunks share a forward step."""
    from pagedkv_rs import fallback

    first = ctx // 2
    scored = ctx - first - 1  # logits at positions first .. ctx - 2 predict tokens first + 1 .. ctx - 1
    per_step = max(1, min(n_chunks, LOGITS_BUDGET // (model.vocab_size * scored)))
    blocks = -(-ctx // BLOCK_SIZE) * per_step
    mgr = fallback.KVCacheManager(blocks, BLOCK_SIZE, enable_prefix_caching=False)
    caches = model.new_kv_caches(blocks, BLOCK_SIZE, "float16")
    tokens = np.asarray(token_ids, np.int64)
    for c0 in range(0, n_chunks, per_step):
        chunks = range(c0, min(c0 + per_step, n_chunks))
        seqs = list(range(len(chunks)))
        for s, c in zip(seqs, chunks):
            ids = tokens[c * ctx : (c + 1) * ctx].tolist()
            if bos_id is not None:
                ids[0] = bos_id
            mgr.allocate(s, ids)
        batch = mgr.prepare_batch(seqs, [ctx] * len(seqs))
        rows = (np.arange(len(seqs))[:, None] * ctx + np.arange(first, ctx - 1)[None, :]).reshape(-1)
        logits = model.forward(batch, caches, logits_indices=rows).reshape(len(seqs), scored, -1)
        for s, c in zip(seqs, chunks):
            yield c, logits[s], tokens[c * ctx + first + 1 : (c + 1) * ctx]
            mgr.free(s)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    """float64 log-softmax of float32 rows ``[S, V]`` (llama.cpp's: the sums in float64)."""
    top = x.max(-1, keepdims=True)
    y = x.astype(np.float64) - top
    return y - np.log(np.exp(y).sum(-1, keepdims=True))


def perplexity(
    model: Any,
    token_ids: list[int],
    ctx: int,
    *,
    bos_id: Optional[int] = None,
    max_chunks: Optional[int] = None,
    on_chunk: Optional[Callable[[int, float], None]] = None,
) -> PerplexityResult:
    """llama-perplexity over ``token_ids`` (the whole tokenized text) with chunks of ``ctx`` tokens.

    ``bos_id``: replaces each chunk's first token (llama.cpp does so where the vocabulary adds BOS).
    ``on_chunk(i, running_ppl)`` is called after each chunk.
    """
    n_chunks = _checked_chunks(model, token_ids, ctx, max_chunks)
    nll = nll2 = 0.0
    count = 0
    running: list[float] = []
    for c, x, target in chunk_logits(model, token_ids, ctx, n_chunks, bos_id=bos_id):
        # x: float32 [scored, V]; the sums in float64, as llama.cpp's log-softmax
        top = x.max(-1)
        lse = np.log(np.exp(x - top[:, None]).sum(-1, dtype=np.float64)) + top
        nl = lse - x[np.arange(len(target)), target].astype(np.float64)
        nll += float(nl.sum())
        nll2 += float((nl * nl).sum())
        count += len(target)
        running.append(math.exp(nll / count))
        if on_chunk is not None:
            on_chunk(c, running[-1])
    mean = nll / count
    var = nll2 / count - mean * mean
    ppl = math.exp(mean)
    stderr = math.sqrt(var / (count - 1)) * ppl if var > 0 and count > 1 else float("nan")
    return PerplexityResult(ppl, stderr, count, running)


@dataclass
class KLResult:
    """``llama-perplexity --kl-divergence``'s figures of a model against a reference over the same scored tokens:
    mean KL(reference || model) in nats and its standard error, the largest, the share of tokens whose top-1 agrees,
    and the mean |delta log p| of the text's tokens."""

    kl: float
    kl_stderr: float
    kl_max: float
    top1: float
    dlogp: float
    count: int


def kl_divergence(
    model: Any,
    reference: Any,
    token_ids: list[int],
    ctx: int,
    *,
    bos_id: Optional[int] = None,
    max_chunks: Optional[int] = None,
    reference_logits: Optional[list[np.ndarray]] = None,
    on_chunk: Optional[Callable[[int, float], None]] = None,
) -> KLResult:
    """KL divergence of ``model``'s next-token distributions from ``reference``'s (the same model with float32
    activations, say), at llama-perplexity's scored positions. ``reference_logits``: the reference's per-chunk
    logits from an earlier call (a list filled on the first call when empty), so several models compare against
    one reference pass. ``on_chunk(i, running_mean_kl)`` after each chunk."""
    n_chunks = _checked_chunks(model, token_ids, ctx, max_chunks)
    if reference_logits is None or not reference_logits:
        ref = [x.copy() for _, x, _ in chunk_logits(reference, token_ids, ctx, n_chunks, bos_id=bos_id)]
        if reference_logits is not None:
            reference_logits.extend(ref)
    else:
        ref = reference_logits
    if len(ref) != n_chunks:
        raise ValueError(f"reference_logits holds {len(ref)} chunks, this text and ctx give {n_chunks}")
    kls: list[np.ndarray] = []
    agree = 0
    dlogp = 0.0
    for c, x, target in chunk_logits(model, token_ids, ctx, n_chunks, bos_id=bos_id):
        p, q = _log_softmax(ref[c]), _log_softmax(x)
        kl = (np.exp(p) * (p - q)).sum(-1)  # [S]
        kls.append(kl)
        agree += int((ref[c].argmax(-1) == x.argmax(-1)).sum())
        rows = np.arange(len(target))
        dlogp += float(np.abs(p[rows, target] - q[rows, target]).sum())
        if on_chunk is not None:
            on_chunk(c, float(np.concatenate(kls).mean()))
    allkl = np.concatenate(kls)
    n = len(allkl)
    return KLResult(
        kl=float(allkl.mean()),
        kl_stderr=float(allkl.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan"),
        kl_max=float(allkl.max()),
        top1=agree / n,
        dlogp=dlogp / n,
        count=n,
    )


# Mean KL (nats) from the float32-activation logits that one-digit matrices may bring a model to, together
# (``choose_act_digits``). On the Apache-2.0 text at ctx 256 a one-digit head takes SmolLM2-135M to ~7.2e-4, where
# its greedy answers start to flip; a model without such answers to keep may take more (Gemma 3's architecture
# default, every matrix at one digit, costs its 270M file ~2.8e-3, below llama.cpp's own ~6.7e-3: docs/models.md).
KL_BUDGET = 6e-4
# The order matrices are tried in: the largest product of a decode step first.
DIGIT_CANDIDATES = ("head", "wdown", "wgu", "wqkv", "wo")


def choose_act_digits(
    set_digits: Callable[[dict[str, int]], None],
    kl_of_current: Callable[[], float],
    candidates: tuple[str, ...] = DIGIT_CANDIDATES,
    budget: float = KL_BUDGET,
) -> dict[str, int]:
    """Greedy per-matrix activation digits: starting from two digits everywhere, each candidate in turn gets one
    digit when the model's mean KL from float32 activations (``kl_of_current()``, as ``kl_divergence`` measures it)
    then stays within ``budget``, else it keeps two. Returns the choice (every candidate: 1 or 2), also left set."""
    choice = dict.fromkeys(candidates, 2)
    set_digits(choice)
    for name in candidates:
        set_digits({name: 1})
        if kl_of_current() <= budget:
            choice[name] = 1
        else:
            set_digits({name: 2})
    return choice


def build_parser() -> argparse.ArgumentParser:
    from pagedkv_rs.cli.formatting import HelpFormatter

    p = argparse.ArgumentParser(
        prog="pagedkv perplexity", description=__doc__.splitlines()[0], formatter_class=HelpFormatter
    )
    p.add_argument("file", metavar="FILE", help="a UTF-8 text file")
    p.add_argument("--model", default=None, metavar="GGUF", help="GGUF model file (default: the bundled SmolLM2)")
    p.add_argument("--ctx", type=int, default=512, help="tokens per chunk (llama-perplexity -c)")
    p.add_argument(
        "--chunks", type=int, default=None, help="score at most this many chunks (llama's --chunks; default: all)"
    )
    p.add_argument("--impl", choices=("auto", "numpy", "fused"), default="auto", help="model implementation")
    p.add_argument(
        "--act-digits",
        default=None,
        metavar="SPEC",
        help="activation digits of int8 matrices, e.g. head=1,wdown=2 (keys: head, wqkv, wo, wgu, wdown, ROLE.I; "
        "default: the architecture's measured choice)",
    )
    p.add_argument(
        "--kl-divergence",
        action="store_true",
        help="as llama-perplexity --kl-divergence: KL of the model's distributions from the same file's with float32 "
        "activations (dequantized weights, numpy), at the scored positions, instead of the PPL",
    )
    p.add_argument(
        "--choose-act-digits",
        type=float,
        nargs="?",
        const=KL_BUDGET,
        default=None,
        metavar="BUDGET",
        help=f"with --kl-divergence: choose each matrix's activation digits greedily ({', '.join(DIGIT_CANDIDATES)}: "
        f"one digit while the mean KL stays within BUDGET, {KL_BUDGET:g} when given alone) and print the choice "
        "(default: off, the model's own digits)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        with open(args.file, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        p.error(f"cannot read {args.file}: {e}")
    from pagedkv_rs.errors import PagedKVError
    from pagedkv_rs.models.gguf_loader import load_gguf
    from pagedkv_rs.models.llama import LlamaModel, parse_act_digits
    from pagedkv_rs.models.tokenizer import GGUFTokenizer

    try:
        digits = parse_act_digits(args.act_digits) if args.act_digits is not None else None
        g = load_gguf(args.model)
        model = LlamaModel.load(g, impl=args.impl)
        if digits is not None:
            model.weights.set_act_digits(digits)
        tok = GGUFTokenizer.from_gguf(g)
        reference = LlamaModel.load(g, weights="float32", impl="numpy") if args.kl_divergence else None
    except (PagedKVError, ValueError) as e:
        print(f"pagedkv perplexity: {e}", file=sys.stderr)
        return 1
    ids = tok.encode(text, add_special_tokens=True)
    bos = tok.bos_token_id if tok.add_bos_token else None
    n_chunks = len(ids) // max(args.ctx, 1)
    if args.chunks is not None:
        n_chunks = min(n_chunks, args.chunks)
    print(f"perplexity: {len(ids)} tokens, {n_chunks} chunks of {args.ctx}, scoring the second half of each")
    bar = None
    if not args.no_progress and n_chunks > 0:
        from tqdm import tqdm

        bar = tqdm(total=n_chunks, unit="chunk", file=sys.stderr, leave=False)

    def on_chunk(i: int, running: float) -> None:
        print(f"[{i + 1}]{running:.4f},", end="", flush=True)
        if bar is not None:
            bar.update(1)

    if args.choose_act_digits is not None:
        if reference is None:
            p.error("--choose-act-digits needs --kl-divergence")
        cache: list[np.ndarray] = []

        def kl_now() -> float:
            r = kl_divergence(
                model, reference, ids, args.ctx, bos_id=bos, max_chunks=args.chunks, reference_logits=cache
            )
            print(f"  {model.weights.act_digits_spec()}: mean KLD {r.kl:.6f}", flush=True)
            return r.kl

        try:
            choice = choose_act_digits(model.weights.set_act_digits, kl_now, budget=args.choose_act_digits)
        except ValueError as e:
            print(f"pagedkv perplexity: {e}", file=sys.stderr)
            return 1
        finally:
            if bar is not None:
                bar.close()
        print("act digits: " + ",".join(f"{k}={d}" for k, d in choice.items()))
        return 0
    try:
        if reference is not None:
            kl = kl_divergence(model, reference, ids, args.ctx, bos_id=bos, max_chunks=args.chunks, on_chunk=on_chunk)
        else:
            res = perplexity(model, ids, args.ctx, bos_id=bos, max_chunks=args.chunks, on_chunk=on_chunk)
    except ValueError as e:
        print(f"pagedkv perplexity: {e}", file=sys.stderr)
        return 1
    finally:
        if bar is not None:
            bar.close()
    if reference is not None:
        print(
            f"\nKL divergence from float32 activations over {kl.count} tokens "
            f"(one activation digit: {model.weights.act_digits_spec()}):\n"
            f"Mean    KLD: {kl.kl:.6f} +/- {kl.kl_stderr:.6f}\nMaximum KLD: {kl.kl_max:.6f}\n"
            f"Same top p: {100 * kl.top1:.3f} %\nMean |delta log p|: {kl.dlogp:.6f}"
        )
        return 0
    print(f"\nFinal estimate: PPL = {res.ppl:.4f} +/- {res.stderr:.5f}")
    return 0
