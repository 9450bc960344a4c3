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
from typing import Any, Callable, Optional

import numpy as np

__all__ = ["PerplexityResult", "build_parser", "main", "perplexity"]

BLOCK_SIZE = 16
LOGITS_BUDGET = 1 << 24  # float32 logits per step (64 MiB): bounds how many chunks share a step


@dataclass
class PerplexityResult:
    """Final PPL and its +/-, the tokens scored, and the running PPL after each chunk (llama.cpp's [i] values)."""

    ppl: float
    stderr: float
    count: int
    running: list[float] = field(default_factory=list)


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
    from pagedkv_rs import fallback

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
    first = ctx // 2
    scored = ctx - first - 1  # logits at positions first .. ctx - 2 predict tokens first + 1 .. ctx - 1
    per_step = max(1, min(n_chunks, LOGITS_BUDGET // (model.vocab_size * scored)))
    blocks = -(-ctx // BLOCK_SIZE) * per_step
    mgr = fallback.KVCacheManager(blocks, BLOCK_SIZE, enable_prefix_caching=False)
    caches = model.new_kv_caches(blocks, BLOCK_SIZE, "float16")
    tokens = np.asarray(token_ids, np.int64)
    nll = nll2 = 0.0
    count = 0
    running: list[float] = []
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
            x = logits[s]  # float32 [scored, V]; the sums in float64, as llama.cpp's log-softmax
            top = x.max(-1)
            lse = np.log(np.exp(x - top[:, None]).sum(-1, dtype=np.float64)) + top
            target = tokens[c * ctx + first + 1 : (c + 1) * ctx]
            nl = lse - x[np.arange(scored), target].astype(np.float64)
            nll += float(nl.sum())
            nll2 += float((nl * nl).sum())
            count += scored
            running.append(math.exp(nll / count))
            if on_chunk is not None:
                on_chunk(c, running[-1])
            mgr.free(s)
    mean = nll / count
    var = nll2 / count - mean * mean
    ppl = math.exp(mean)
    stderr = math.sqrt(var / (count - 1)) * ppl if var > 0 and count > 1 else float("nan")
    return PerplexityResult(ppl, stderr, count, running)


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
    from pagedkv_rs.models.llama import LlamaModel
    from pagedkv_rs.models.tokenizer import GGUFTokenizer

    try:
        g = load_gguf(args.model)
        model = LlamaModel.load(g, impl=args.impl)
        tok = GGUFTokenizer.from_gguf(g)
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

    try:
        res = perplexity(model, ids, args.ctx, bos_id=bos, max_chunks=args.chunks, on_chunk=on_chunk)
    except ValueError as e:
        print(f"pagedkv perplexity: {e}", file=sys.stderr)
        return 1
    finally:
        if bar is not None:
            bar.close()
    print(f"\nFinal estimate: PPL = {res.ppl:.4f} +/- {res.stderr:.5f}")
    return 0
