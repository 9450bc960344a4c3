"""``pagedkv serve``: an OpenAI-compatible HTTP server over one engine (FastAPI + uvicorn)."""

from __future__ import annotations

import argparse
import gc
import sys
from typing import Optional

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    from pagedkv_rs.cli.args import add_llm_args
    from pagedkv_rs.engine.scheduler import POLICIES, PREEMPTION_MODES

    p = argparse.ArgumentParser(prog="pagedkv serve", description=__doc__.splitlines()[0])
    add_llm_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (not on /health, /metrics)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: the file name)")
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=256,
        help="waiting requests past which new ones get 503 + Retry-After (default 256)",
    )
    p.add_argument("--request-timeout", type=float, default=None, metavar="S", help="abort requests older than S s")
    p.add_argument(
        "--stream-idle-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="abort a stream whose reader has not taken a write for S s (default 30)",
    )
    p.add_argument(
        "--shutdown-grace",
        type=float,
        default=30.0,
        metavar="S",
        help="on SIGTERM/SIGINT, let running requests finish for S s, then abort them (default 30)",
    )
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument(
        "--policy",
        choices=POLICIES,
        default="fcfs",
        help="scheduling order: fcfs (default) or priority (the request's 'priority' field, lower first)",
    )
    p.add_argument("--preemption-mode", choices=PREEMPTION_MODES, default="recompute")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from pagedkv_rs.serve import build_app, serve
    except ImportError as e:
        print(f"pagedkv serve: {e}; install the server with pip install 'pagedkv-rs[serve]'", file=sys.stderr)
        return 1
    from pagedkv_rs.cli.args import llm_from_args
    from pagedkv_rs.errors import PagedKVError

    try:
        llm = llm_from_args(
            args,
            enable_prefix_caching=not args.no_prefix_caching,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            policy=args.policy,
            preemption_mode=args.preemption_mode,
        )
        app = build_app(
            llm,
            api_key=args.api_key,
            max_queued_requests=args.max_queued_requests,
            request_timeout=args.request_timeout,
            served_model_name=args.served_model_name,
            stream_idle_timeout=args.stream_idle_timeout,
        )
    except (PagedKVError, ValueError, TypeError, OSError) as e:
        print(f"pagedkv serve: {e}", file=sys.stderr)
        return 2
    gc.freeze()  # the model, tokenizer and app live until exit: out of every later collection's walk
    serve(app, host=args.host, port=args.port, grace=args.shutdown_grace, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
