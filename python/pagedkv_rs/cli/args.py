"""The model and KV-cache options of every command that builds an ``LLM`` (generate, serve, bench e2e)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from pagedkv_rs.models.llama import MODEL_IMPLS, WEIGHT_FORMATS

if TYPE_CHECKING:
    from pagedkv_rs.llm import LLM

__all__ = ["add_llm_args", "llm_from_args"]


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
        help="MAC key of the tiers' entries: with it nobody can inject K/V through a shared store (default: none, "
        "entries carry a CRC only)",
    )
    p.add_argument(
        "--model-impl",
        choices=MODEL_IMPLS,
        default="auto",
        help="fused: the whole decoder stack in one Rust call per step (int8 weights); numpy: one kernel call "
        "per operation from Python (the readable spec); auto: fused when the weights allow",
    )


def llm_from_args(args: argparse.Namespace, **engine_kwargs: Any) -> LLM:
    """An ``LLM`` from the options ``add_llm_args`` added; extra keywords go to the engine."""
    from pagedkv_rs.llm import LLM  # the model extra: imported only when a command runs

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
        **engine_kwargs,
    )
