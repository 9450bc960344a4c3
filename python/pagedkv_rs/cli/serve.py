"""``pagedkv serve``: an OpenAI-compatible HTTP server over one engine (FastAPI + uvicorn).

Sampling fields a request leaves unset take the server's defaults; the first that sets a field wins:
the request, then --default-* and --override-generation-config, then the GGUF file's general.sampling.*
keys, then pagedkv generate's defaults (temperature 0.2, top_p 0.9, repetition_penalty 1.1).
--generation-config openai skips the last two: unset fields then take OpenAI's values (temperature 1).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from typing import Any, Optional

__all__ = ["main", "build_parser", "sampling_defaults"]

API_KEY_ENV = "PAGEDKV_API_KEY"

_DEFAULT_OPTIONS = {  # --default-NAME -> (type, help); the request field is NAME with underscores
    "temperature": (float, "0 = greedy"),
    "top-p": (float, "nucleus sampling mass, in (0, 1]"),
    "top-k": (int, "0 = off"),
    "min-p": (float, "0 = off"),
    "repetition-penalty": (float, "1 = off"),
    "presence-penalty": (float, "0 = off"),
    "frequency-penalty": (float, "0 = off"),
}


def _override(text: str) -> dict[str, Any]:
    from pagedkv_rs.cli.sampling_defaults import parse_override

    try:
        return parse_override(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    from pagedkv_rs.cli.args import add_llm_args
    from pagedkv_rs.cli.formatting import HelpFormatter
    from pagedkv_rs.engine.scheduler import POLICIES, PREEMPTION_MODES

    doc = __doc__.split("\n\n")
    p = argparse.ArgumentParser(
        prog="pagedkv serve",
        description=doc[0].split(": ", 1)[1],
        epilog=doc[1].replace("\n", " "),
        formatter_class=HelpFormatter,
    )
    add_llm_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on all but /health, /metrics (default: $PAGEDKV_API_KEY if set, "
        "else none). Visible to other users on the command line: prefer --api-key-file or the environment",
    )
    p.add_argument(
        "--api-key-file",
        default=None,
        metavar="FILE",
        help="read the API key from the first line of FILE (default: none)",
    )
    p.add_argument(
        "--served-model-name", default=None, help="the model id clients send (default: the file name without .gguf)"
    )
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=256,
        help="waiting requests past which new ones get 503 + Retry-After",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        metavar="S",
        help="abort requests older than S s (default: no limit)",
    )
    p.add_argument(
        "--stream-idle-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="abort a stream whose reader has not taken a write for S s",
    )
    p.add_argument(
        "--shutdown-grace",
        type=float,
        default=30.0,
        metavar="S",
        help="on SIGTERM/SIGINT, let running requests finish for S s, then abort them (a second SIGINT: at once)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=None,
        metavar="N",
        help="open connections past which new ones get 503 (16 more are kept for /health and /metrics; "
        "default: 1024, lowered to fit the open-file limit)",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="close a connection whose request head has not arrived within S s (408)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="close a connection whose request body stalls for S s (408)",
    )
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests in one engine step at most")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens in one engine step at most")
    p.add_argument("--no-prefix-caching", action="store_true", help="do not reuse the KV blocks of common prefixes")
    p.add_argument(
        "--policy",
        choices=POLICIES,
        default="fcfs",
        help="scheduling order: fcfs or priority (the request's 'priority' field, lower first)",
    )
    p.add_argument(
        "--preemption-mode", choices=PREEMPTION_MODES, default="recompute", help="what a preempted request loses"
    )
    g = p.add_argument_group("default sampling (for the fields a request leaves unset)")
    for name, (kind, what) in _DEFAULT_OPTIONS.items():
        g.add_argument(
            f"--default-{name}",
            type=kind,
            default=None,
            metavar="X",
            help=f"{what} (default: see below)",
        )
    g.add_argument(
        "--override-generation-config",
        type=_override,
        default=None,
        metavar="JSON",
        help='vLLM\'s spelling: \'{"temperature": 0.2, "top_p": 0.9, ...}\' with the --default-* names '
        "(underscores); each key must not also be given as --default-* (default: none)",
    )
    g.add_argument(
        "--generation-config",
        choices=("auto", "openai"),
        default="auto",
        help="auto: the GGUF's general.sampling.* keys and pagedkv generate's defaults under the operator's; "
        "openai: only the operator's, then OpenAI's (temperature 1)",
    )
    p.add_argument(
        "--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"), help="log level"
    )
    p.add_argument(
        "--access-log", action="store_true", help="log one line per request, with its X-Request-Id (default: off)"
    )
    g = p.add_argument_group("scale-out (routers, gateways: see docs/scaling-out.md)")
    g.add_argument(
        "--kv-events-endpoint",
        default=None,
        metavar="URL",
        help="publish KV-cache events in vLLM's format (ZMQ PUB, msgpack), e.g. tcp://*:5557 (binds; an address "
        "without * connects) (default: off)",
    )
    g.add_argument("--kv-events-topic", default="", metavar="T", help="ZMQ topic of the events (default: empty)")
    g.add_argument(
        "--kv-events-replay-endpoint",
        default=None,
        metavar="URL",
        help="ROUTER socket from which subscribers re-read missed batches, e.g. tcp://*:5558 (default: off)",
    )
    g.add_argument(
        "--prefix-hash",
        choices=("native", "vllm"),
        default="native",
        help="block hashes in KV events: ours, or vLLM's sha256_cbor recipe a consumer recomputes from the token "
        "ids (seeded by PYTHONHASHSEED, as vLLM's) (default: native)",
    )
    g.add_argument(
        "--metrics-compat",
        choices=("none", "vllm"),
        default="none",
        help="vllm: /metrics also exports the series under vLLM's names (vllm:num_requests_waiting, "
        "vllm:kv_cache_usage_perc, vllm:prefix_cache_hits, ...) for gateways and dashboards (default: none)",
    )
    p.add_argument(
        "--embedding-pooling",
        choices=("last", "mean"),
        default="last",
        help="how /v1/embeddings pools the final-normed hidden states: the last token's, or their mean (default: last)",
    )
    return p


def sampling_defaults(args: argparse.Namespace, metadata: Any) -> dict[str, Any]:
    """The server's default sampling settings from the options and the GGUF metadata (ValueError if bad)."""
    from pagedkv_rs.cli.sampling_defaults import from_gguf, resolve

    operator = dict(args.override_generation_config or {})
    for name in _DEFAULT_OPTIONS:
        field = name.replace("-", "_")
        value = getattr(args, f"default_{field}")
        if value is None:
            continue
        if field in operator:
            raise ValueError(f"{field} is set twice: --default-{name} and --override-generation-config")
        operator[field] = value
    auto = args.generation_config == "auto"
    return resolve(operator, from_gguf(metadata) if auto else {}, use_model_defaults=auto)


def banner(llm: Any, app: Any, args: argparse.Namespace) -> str:
    """The start-up line: what is served and on what (the address is added once bound)."""
    import pagedkv_rs

    state = app.state.pagedkv
    kv = llm.engine.snapshot()[1]
    blocks = kv["free_blocks"] + kv["live_blocks"] + kv["cached_blocks"]
    pool = blocks * llm.model.kv_bytes_per_block(args.block_size, args.kv_dtype)
    if pagedkv_rs._core is not None:
        info = pagedkv_rs.kernel_info()
        isa = f"ISA {info['active_isa']} (linear {info['linear_isa']}), {pagedkv_rs.get_num_threads()} threads"
    else:
        isa = "no Rust core: numpy reference kernels"
    defaults = ", ".join(f"{k}={v}" for k, v in sorted(state.sampling_defaults.items())) or "OpenAI's"
    return (
        f"pagedkv_rs {pagedkv_rs.__version__} serving {state.model_name!r} ({os.path.basename(llm.model_path)}): "
        f"architecture {llm.model.config.architecture}, weights {llm.weight_format} ({llm.model.impl}), "
        f"KV pool {blocks} blocks of {args.block_size} tokens = {pool / (1 << 20):.1f} MiB {args.kv_dtype}, "
        f"context length {state.max_model_len}, {isa}; sampling defaults {defaults}"
    )


def _check_event_options(args: argparse.Namespace) -> None:
    if args.kv_events_endpoint is None and (args.prefix_hash != "native" or args.kv_events_replay_endpoint):
        raise ValueError("--prefix-hash and --kv-events-replay-endpoint name the KV events: add --kv-events-endpoint")


def _check_connection_options(args: argparse.Namespace) -> None:
    for name in ("header_timeout", "body_timeout", "shutdown_grace"):
        v = getattr(args, name)
        if not (v >= 0 if name == "shutdown_grace" else v > 0):
            raise ValueError(f"--{name.replace('_', '-')} must be {'>= 0' if name == 'shutdown_grace' else '> 0'}")
    if args.max_connections is not None and args.max_connections < 1:
        raise ValueError(f"--max-connections must be >= 1, got {args.max_connections}")


def kv_events(llm: Any, args: argparse.Namespace) -> Any:
    """The KV-events publisher the options ask for, attached to the engine (None when off)."""
    if args.kv_events_endpoint is None:
        return None
    try:
        from pagedkv_rs.engine.kv_events import KVEventPublisher
    except ImportError as e:
        raise ValueError(f"{e}; install KV events with pip install 'pagedkv-rs[events]'") from None
    engine = llm.engine
    tiers = engine.kv_tiers.tiers if engine.kv_tiers is not None else []
    pub = KVEventPublisher(
        engine.kv_manager,
        endpoint=args.kv_events_endpoint,
        topic=args.kv_events_topic,
        replay_endpoint=args.kv_events_replay_endpoint,
        hash_mode=args.prefix_hash,
        tier_medium=tiers[0].medium if len(tiers) == 1 else "KV_TIER",
        kv_tiers=engine.kv_tiers,
    )
    engine.runner.kv_events = pub
    return pub


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from pagedkv_rs.serve import build_app, serve
        from pagedkv_rs.serve.logs import log_config
    except ImportError as e:
        print(f"pagedkv serve: {e}; install the server with pip install 'pagedkv-rs[serve]'", file=sys.stderr)
        return 1
    import logging.config

    from pagedkv_rs.cli.args import llm_from_args
    from pagedkv_rs.errors import PagedKVError
    from pagedkv_rs.models.gguf_loader import load_gguf

    config = log_config(args.log_level)
    logging.config.dictConfig(config)  # now, so that warnings while loading get the same format
    try:  # credentials and tier safety first: a bad one fails before the model loads
        from pagedkv_rs.cli.args import check_shared_tiers, read_secret, resolve_tier_secret

        args.api_key = read_secret(args.api_key, args.api_key_file, API_KEY_ENV, "--api-key")
        resolve_tier_secret(args)
        warning = check_shared_tiers(args)
        _check_connection_options(args)
        _check_event_options(args)
    except (ValueError, OSError) as e:
        print(f"pagedkv serve: {e}", file=sys.stderr)
        return 2
    if warning:
        logging.getLogger("pagedkv_rs.serve").warning(warning)
    try:
        g = load_gguf(args.model)
        defaults = sampling_defaults(args, g.metadata)
        args.model = g
        llm = llm_from_args(
            args,
            enable_prefix_caching=not args.no_prefix_caching,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            policy=args.policy,
            preemption_mode=args.preemption_mode,
        )
        del g
        app = build_app(
            llm,
            api_key=args.api_key,
            max_queued_requests=args.max_queued_requests,
            request_timeout=args.request_timeout,
            served_model_name=args.served_model_name,
            stream_idle_timeout=args.stream_idle_timeout,
            default_sampling=defaults,
            access_log=args.access_log,
            embedding_pooling=args.embedding_pooling,
        )
        if args.metrics_compat == "vllm":
            app.state.pagedkv.metrics.enable_vllm_names(args.block_size, llm.engine.kv_manager.num_blocks)
        publisher = kv_events(llm, args)
        if publisher is not None:
            app.state.pagedkv.metrics.add_kv_events(publisher)
    except (PagedKVError, ValueError, TypeError, OSError) as e:
        print(f"pagedkv serve: {e}", file=sys.stderr)
        return 2
    gc.freeze()  # the model, tokenizer and app live until exit: out of every later collection's walk
    srv = serve(
        app,
        host=args.host,
        port=args.port,
        grace=args.shutdown_grace,
        log_level=args.log_level,
        log_config=config,
        banner=banner(llm, app, args),
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        max_connections=args.max_connections,
    )
    if publisher is not None:
        publisher.shutdown()
    if srv.forced:
        print("pagedkv serve: stopped by a second interrupt; running requests were cut off", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
