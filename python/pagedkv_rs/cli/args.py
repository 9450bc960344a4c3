"""The model and KV-cache options of every command that builds an ``LLM`` (generate, serve, bench e2e)."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any, Optional

from pagedkv_rs.models.llama import MODEL_IMPLS, WEIGHT_FORMATS

if TYPE_CHECKING:
    from pagedkv_rs.llm import LLM

__all__ = ["add_llm_args", "llm_from_args", "read_secret", "resolve_tier_secret", "check_shared_tiers"]

# Secrets also come from the environment or a file: a command line is readable by every user of the
# machine (/proc/PID/cmdline).
KV_TIER_SECRET_ENV = "PAGEDKV_KV_TIER_SECRET"
MAX_SECRET_FILE = 4096


def read_secret(value: Optional[str], path: Optional[str], env: str, flag: str) -> Optional[str]:
    """The secret given by ``--flag``, else ``--flag-file`` (first line, stripped), else ``$env``; None if none.

    An empty secret is refused (ValueError): it would turn a guard on that an empty credential passes.
    """
    if value is not None and path is not None:
        raise ValueError(f"give {flag} or {flag}-file, not both")
    source = flag
    if path is not None:
        source = f"{flag}-file {path}"
        with open(path, "rb") as f:
            raw = f.read(MAX_SECRET_FILE + 1)
        if len(raw) > MAX_SECRET_FILE:
            raise ValueError(f"{source}: longer than {MAX_SECRET_FILE} bytes; a secret is one line")
        lines = raw.decode("utf-8").splitlines()
        value = lines[0].strip() if lines else ""
    elif value is None and env in os.environ:
        source, value = f"${env}", os.environ[env]
    if value is not None and not value:
        raise ValueError(f"{source} is empty: give a non-empty secret or leave it unset")
    return value


def resolve_tier_secret(args: argparse.Namespace) -> None:
    """Settle ``args.kv_tier_secret`` from the flag, its file or the environment (once; ValueError if bad)."""
    if getattr(args, "_tier_secret_resolved", False):
        return
    args.kv_tier_secret = read_secret(
        args.kv_tier_secret, args.kv_tier_secret_file, KV_TIER_SECRET_ENV, "--kv-tier-secret"
    )
    args._tier_secret_resolved = True


def check_shared_tiers(args: argparse.Namespace) -> Optional[str]:
    """A Redis tier without a secret serves whatever anyone who can write to Redis put there: refused unless
    ``--kv-tier-insecure``; returns the warning to log when it is allowed that way."""
    shared = [t for t in args.kv_tiers or () if t.strip().startswith(("redis://", "rediss://"))]
    if not shared or args.kv_tier_secret is not None or "secret=" in " ".join(shared):
        return None
    if not args.kv_tier_insecure:
        raise ValueError(
            "a Redis KV tier without a secret accepts K/V from anyone who can write to that Redis: give "
            f"--kv-tier-secret-file FILE (or ${KV_TIER_SECRET_ENV}), or --kv-tier-insecure to run without one"
        )
    return "KV tier without a secret (--kv-tier-insecure): whoever can write to that Redis can inject K/V"


def add_llm_args(p: argparse.ArgumentParser) -> None:
    """The model and KV-cache options every command that builds an ``LLM`` takes."""
    p.add_argument("--model", default=None, help="Llama-architecture GGUF file (default: bundled SmolLM2-135M)")
    p.add_argument("--kv-dtype", choices=("float16", "float32", "bfloat16"), default="float16", help="KV cache dtype")
    mem = p.add_mutually_exclusive_group()
    mem.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks (default: --kv-memory)")
    mem.add_argument("--kv-memory", default=None, help="KV pool size in bytes, e.g. 1GiB (default: 512MiB)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--backend", choices=("auto", "rust", "python"), default="auto", help="allocator backend")
    p.add_argument(
        "--weights",
        choices=WEIGHT_FORMATS,
        default="auto",
        help="int8: the GGUF's 8/4-bit blocks run by pagedkv_rs.QLinear; float32: dequantized, numpy BLAS; "
        "auto: int8 where a SIMD int8 kernel runs (AVX-512 VNNI or AVX2)",
    )
    p.add_argument(
        "--kv-tier",
        action="append",
        default=None,
        metavar="SPEC",
        dest="kv_tiers",
        help="a KV tier below the pool, looked up in the order given (repeatable): "
        "disk:/path?size=8GiB or redis://host:port/db[?prefix=..&ttl=S] (default: none)",
    )
    p.add_argument(
        "--kv-tier-secret",
        default=None,
        metavar="SECRET",
        help="MAC key of the tiers' entries: with it nobody can inject K/V through a shared store (default: "
        f"${KV_TIER_SECRET_ENV} if set, else none: entries carry a CRC only). Visible to other users on the command "
        "line: prefer --kv-tier-secret-file or the environment",
    )
    p.add_argument(
        "--kv-tier-secret-file",
        default=None,
        metavar="FILE",
        help="read the tiers' MAC key from the first line of FILE (default: none)",
    )
    p.add_argument(
        "--kv-tier-insecure",
        action="store_true",
        help="allow a Redis tier without a secret in pagedkv serve (anyone who can write to it can inject K/V)",
    )
    p.add_argument(
        "--speculative",
        default=None,
        type=_speculative,
        metavar="ngram[:k=K,n=N] | draft:PATH[:k=K]",
        help="speculative decoding: up to K draft tokens per step copied from where the sequence's last N..1 "
        "tokens occurred before in its prompt and output (ngram), or proposed by a small GGUF model of the same "
        "vocabulary run beside the target (draft:PATH, its KV pool kv=BYTES, default 64MiB), verified in the "
        "same step (greedy outputs unchanged, sampling keeps its distribution), in the batch sizes where it "
        "measures faster; also min_n=M (ngram), max_batch=B, window=W, probe=P, adaptive=0 (always draft) "
        "(default: off; ngram means k=4,n=5, draft k=4)",
    )
    p.add_argument(
        "--act-digits",
        default=None,
        type=_act_digits,
        metavar="SPEC",
        help="activation digits of the int8 weights' products: 1 or 2 for every matrix, or per matrix as "
        "head=1,wdown=2 (keys: head, wqkv, wo, wgu, wdown, ROLE.I; pagedkv perplexity --choose-act-digits prints "
        "one for a file); one digit halves batched decode's and prefill's multiply-adds (default: the "
        "architecture's measured choice)",
    )
    p.add_argument(
        "--model-impl",
        choices=MODEL_IMPLS,
        default="auto",
        help="fused: the whole decoder stack in one Rust call per step (int8 weights); numpy: one kernel call "
        "per operation from Python (the readable spec); auto: fused when the weights allow",
    )


def _act_digits(text: str) -> str:
    """The option as given, once its syntax is checked (its keys are checked against the model when it loads)."""
    from pagedkv_rs.models.llama import parse_act_digits

    try:
        parse_act_digits(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _speculative(text: str) -> Any:
    from pagedkv_rs.engine.speculative import SpeculativeConfig

    try:
        return SpeculativeConfig.of(text)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def llm_from_args(args: argparse.Namespace, **engine_kwargs: Any) -> LLM:
    """An ``LLM`` from the options ``add_llm_args`` added; extra keywords go to the engine."""
    from pagedkv_rs.llm import LLM  # the model extra: imported only when a command runs

    resolve_tier_secret(args)
    return LLM(
        args.model,
        kv_dtype=args.kv_dtype,
        num_blocks=args.num_blocks,
        kv_memory=args.kv_memory,
        block_size=args.block_size,
        backend=args.backend,
        weights=args.weights,
        kv_tiers=args.kv_tiers,
        kv_tier_secret=args.kv_tier_secret,
        model_impl=getattr(args, "model_impl", "auto"),
        act_digits=getattr(args, "act_digits", None),
        **({"speculative": args.speculative} if getattr(args, "speculative", None) is not None else {}),
        **engine_kwargs,
    )
