"""``pagedkv generate "prompt" [...]``: stream text from a GGUF model through the paged KV cache.

All prompts are submitted at once and batched continuously; the first streams to the terminal
token by token while the others generate alongside, then each of the rest is printed (streaming
whatever is still being produced).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from typing import Any, Optional, TextIO

from pagedkv_rs.cli.formatting import HelpFormatter
from pagedkv_rs.cli.sampling_defaults import GENERATE_DEFAULTS

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    from pagedkv_rs.cli.args import add_llm_args

    p = argparse.ArgumentParser(
        formatter_class=HelpFormatter, prog="pagedkv generate", description=__doc__.splitlines()[0]
    )
    p.add_argument("prompts", nargs="+", metavar="PROMPT", help="one or more prompts (batched together)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--system", default=None, help="system message for the chat template (default: none)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most per prompt")
    # the defaults `pagedkv serve` falls back to as well (see cli/sampling_defaults.py)
    p.add_argument("--temperature", type=float, default=GENERATE_DEFAULTS["temperature"], help="0 = greedy")
    p.add_argument("--top-p", type=float, default=GENERATE_DEFAULTS["top_p"], help="nucleus sampling mass, in (0, 1]")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    p.add_argument("--repetition-penalty", type=float, default=GENERATE_DEFAULTS["repetition_penalty"], help="1 = off")
    p.add_argument(
        "--stop", action="append", default=None, metavar="TEXT", help="stop string (repeatable; default: none)"
    )
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    p.add_argument("--ignore-eos", action="store_true", help="generate all --max-tokens tokens (benchmarks)")
    add_llm_args(p)
    p.add_argument("--stats", action="store_true", help="print throughput and cache stats to stderr")
    return p


def main(argv: Optional[list[str]] = None, out: Optional[TextIO] = None) -> int:
    out = sys.stdout if out is None else out  # looked up per call: the stdout of whoever runs it now
    args = build_parser().parse_args(argv)
    from pagedkv_rs.cli.args import llm_from_args
    from pagedkv_rs.engine.request import SamplingParams
    from pagedkv_rs.errors import PagedKVError
    from pagedkv_rs.models.gguf_loader import load_gguf
    from pagedkv_rs.models.tokenizer import GGUFTokenizer, IncrementalDecoder

    gc_was = gc.isenabled()
    gc.disable()  # no collections while loading (as LLM's load); what it keeps is frozen below
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            stop=args.stop,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
        )
        g = load_gguf(args.model)
        tok = GGUFTokenizer(g.metadata, path=g.path)
        prompts = _prompt_ids(args, tok)
        if args.num_blocks is None and args.kv_memory is None:
            # a pool just big enough for these prompts and their answers, not the 512 MiB default
            args.num_blocks = sum(-(-(len(p) + args.max_tokens) // args.block_size) for p in prompts)
        args.model = g
        llm = llm_from_args(args, tokenizer=tok)
        # What is loaded now lives until exit: keep it out of every later garbage collection (a full
        # collection walked ~100k module/tokenizer objects inside the first step).
        gc.freeze()
    except (PagedKVError, ValueError, TypeError, ImportError) as e:
        print(f"pagedkv generate: {e}", file=sys.stderr)
        return 2
    finally:
        if gc_was:
            gc.enable()
    t0 = time.perf_counter()
    n_out = 0
    try:
        streams = [llm.stream(p, params) for p in prompts]
        for i, stream in enumerate(streams):
            if len(streams) > 1:
                out.write(f"{'' if i == 0 else chr(10)}--- [{i + 1}/{len(streams)}] {args.prompts[i]}\n")
            dec = IncrementalDecoder(tok, continuation=True)  # the text continues the prompt
            if args.raw:
                out.write(args.prompts[i])
            shown = ""
            for o in stream:
                if params.stop:  # the engine's text holds back a possible stop string and cuts it at the end
                    text = o.text or ""
                    out.write(text[len(shown) :])
                    shown = text
                else:
                    out.write(dec.push(o.new_token_ids))
                out.flush()
                if o.finished:
                    n_out += len(o.token_ids)
            if not params.stop:
                out.write(dec.flush())
            out.write("\n")
            out.flush()
    except KeyboardInterrupt:
        return 130
    finally:
        llm.shutdown()
    if args.stats:
        dt = time.perf_counter() - t0
        s = llm.stats()
        kv_blocks = llm.engine.kv_caches[0][0].shape[0]
        kv_bytes = sum(k.nbytes + v.nbytes for k, v in llm.engine.kv_caches)
        print(
            f"[{len(prompts)} requests, {n_out} tokens in {dt:.2f} s: {n_out / dt:.1f} tok/s; "
            f"kv {args.kv_dtype}, pool {kv_blocks} blocks = {kv_bytes / (1 << 20):.1f} MiB, "
            f"{s['kernels']} kernels, {s['backend']} allocator, {llm.weight_format} weights; "
            f"prefix hit rate {s['prefix_hit_rate']:.0%}]",
            file=sys.stderr,
        )
    return 0


def _prompt_ids(args: argparse.Namespace, tok: Any) -> list[list[int]]:
    """The prompts' token ids: raw text, or in the chat template."""
    if args.raw:
        return [tok.encode(t) for t in args.prompts]
    system = [{"role": "system", "content": args.system}] if args.system else []
    return [tok.apply_chat_template(system + [{"role": "user", "content": t}]) for t in args.prompts]


if __name__ == "__main__":
    sys.exit(main())
