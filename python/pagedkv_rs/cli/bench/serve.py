"""``pagedkv bench serve``: load any OpenAI-compatible server over HTTP, reported like vLLM's ``benchmark_serving``.

Prompts are fixed-seed random token ids (lengths uniform in ``input_len * [1 - r, 1 + r]``; ``r = 0``
gives fixed lengths) sent to ``/v1/completions`` with ``ignore_eos`` so each request generates exactly
its output length. Requests arrive all at once (``--request-rate inf``) or as a Poisson process,
at most ``--max-concurrency`` in flight. Streaming (the default) timestamps every SSE chunk: TTFT
is the first chunk with text, ITL the gaps between chunks, TPOT (last - first) / (tokens - 1).
Requests go through aiohttp (its C HTTP parser; what vLLM's benchmark_serving uses) and streamed bodies
through ``SSEParser`` on the raw bytes: the client shares the machine with the server it measures, so
its CPU per chunk is kept small (httpx's layers took ~200 us a chunk, about what the server spends).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from pagedkv_rs.cli.formatting import HelpFormatter

__all__ = ["main", "build_parser", "run", "format_report"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        formatter_class=HelpFormatter, prog="pagedkv bench serve", description=__doc__.splitlines()[0]
    )
    p.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="server root, with or without /v1 (…/v1/completions is posted)",
    )
    p.add_argument(
        "--model", default=None, help="model id to send, checked against GET /v1/models (default: the first listed)"
    )
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY' (default: none)")
    p.add_argument("--num-prompts", type=int, default=32, help="requests sent")
    p.add_argument("--input-len", type=int, default=128, help="mean prompt length in tokens")
    p.add_argument("--output-len", type=int, default=128, help="mean output length in tokens")
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len*[1-r, 1+r] (0: fixed)")
    p.add_argument("--token-range", default="100:10000", metavar="LO:HI", help="prompt token ids drawn from [LO, HI)")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: all)")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson (inf: all at t=0)")
    p.add_argument("--no-stream", action="store_true", help="non-streamed requests (TTFT = E2E)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrival times")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request (its whole life)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON (default: no file)")
    p.add_argument("--no-progress", action="store_true")
    return p


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)


def make_prompts(args: argparse.Namespace) -> list[tuple[list[int], int]]:
    """Fixed-seed ``(prompt_ids, output_len)`` pairs."""
    if not 0.0 <= args.range_ratio < 1.0:
        raise ValueError(f"--range-ratio must be in [0, 1), got {args.range_ratio}")
    lo, hi = (int(x) for x in args.token_range.split(":"))
    rng = np.random.default_rng(args.seed)

    def lengths(mean: int) -> np.ndarray:
        a, b = max(1, int(mean * (1 - args.range_ratio))), max(1, int(mean * (1 + args.range_ratio)))
        return rng.integers(a, b + 1, args.num_prompts)

    ins, outs = lengths(args.input_len), lengths(args.output_len)
    return [(rng.integers(lo, hi, int(n)).tolist(), int(m)) for n, m in zip(ins, outs)]


class SSEParser:
    """Server-sent events from body bytes as they arrive: ``feed(bytes)`` -> the data of each completed event.

    No text or line decoding layers: events end at a blank line, lines at LF or CRLF; comment lines
    and other fields are skipped; the lines of a multi-line ``data`` field are joined with LF.
    """

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, raw: bytes) -> list[str]:
        buf = self._buf + raw
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        if b"\n\n" not in buf:
            self._buf = buf
            return []
        *events, self._buf = buf.split(b"\n\n")
        out = []
        for ev in events:
            if b"\n" in ev:
                lines = [ln[5:] for ln in ev.split(b"\n") if ln.startswith(b"data:")]
            elif ev.startswith(b"data:"):
                lines = [ev[5:]]
            else:
                continue
            if lines:
                out.append(b"\n".join(ln[1:] if ln[:1] == b" " else ln for ln in lines).decode())
        return out


async def _one(session: Any, url: str, body: dict[str, Any], stream: bool) -> Result:
    """One request on the aiohttp session; when streaming, every SSE chunk is timestamped."""
    r = Result(prompt_len=len(body["prompt"]))
    t0 = time.perf_counter()
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {(await resp.content.read(4096))[:200]!r}"
                return r
            if not stream:
                r.output_tokens = (await resp.json(content_type=None))["usage"]["completion_tokens"]
                r.ttft = r.latency = time.perf_counter() - t0
                r.ok = True
                return r
            last = None
            sse, done = SSEParser(), False
            async for raw in resp.content.iter_any():
                now = time.perf_counter()  # an event is stamped with the arrival of its last bytes
                for data in sse.feed(raw):
                    if data == "[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        r.error = str(chunk["error"])
                        return r
                    choices = chunk.get("choices")
                    if choices and choices[0].get("text"):
                        if last is None:
                            r.ttft = now - t0
                        else:
                            r.itl.append(now - last)
                        last = now
                    if chunk.get("usage"):
                        r.output_tokens = chunk["usage"]["completion_tokens"]
                if done:
                    break
        r.latency = time.perf_counter() - t0
        r.ok = last is not None
        if not r.ok:
            r.error = "no tokens streamed"
    except Exception as e:
        r.error = f"{type(e).__name__}: {e}"
    return r


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Send the prompts; returns the metrics dict ``format_report`` prints."""
    import aiohttp

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    base = args.base_url.rstrip("/").removesuffix("/v1")  # the root or the OpenAI client's .../v1
    connector = aiohttp.TCPConnector(limit=args.max_concurrency or args.num_prompts)
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout, connector=connector) as client:
        model = await served_model(client, base, args.model)
        url = f"{base}/v1/completions"
        stream = not args.no_stream

        def body(prompt: list[int], n_out: int) -> dict[str, Any]:
            b = {
                "model": model,
                "prompt": prompt,
                "max_tokens": n_out,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": stream,
            }
            if stream:
                b["stream_options"] = {"include_usage": True}
            return b

        reqs = make_prompts(args)
        await _one(client, url, body(reqs[0][0][:16], 4), stream)  # warm-up: connection, server first touch
        sem = asyncio.Semaphore(args.max_concurrency or len(reqs))
        bar = None
        if not args.no_progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(reqs), desc="bench serve", unit="req", file=sys.stderr)

        async def limited(prompt: list[int], n_out: int) -> Result:
            async with sem:
                try:
                    res = await asyncio.wait_for(_one(client, url, body(prompt, n_out), stream), args.timeout)
                except asyncio.TimeoutError:
                    res = Result(prompt_len=len(prompt), error=f"no answer within --timeout {args.timeout} s")
            if bar is not None:
                bar.update(1)
            return res

        rng = np.random.default_rng(args.seed + 1)
        tasks = []
        t0 = time.perf_counter()
        for prompt, n_out in reqs:
            tasks.append(asyncio.ensure_future(limited(prompt, n_out)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(float(rng.exponential(1.0 / args.request_rate)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        if bar is not None:
            bar.close()
    return summarize(results, duration)


async def served_model(client: Any, base: str, model: Optional[str]) -> str:
    """``model``, or the server's first, after checking it against ``GET /v1/models`` (ValueError if not served)."""
    url = f"{base}/v1/models"
    async with client.get(url) as resp:
        if resp.status != 200:
            raise ValueError(f"GET {url}: HTTP {resp.status}: {(await resp.content.read(200))!r}")
        try:
            ids = [m["id"] for m in (await resp.json(content_type=None))["data"]]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"GET {url}: not an OpenAI model list ({e!r})") from None
    if not ids:
        raise ValueError(f"GET {url}: the server lists no model")
    if model is None:
        return str(ids[0])
    if model not in ids:
        raise ValueError(f"--model {model!r} is not served by {base}; it serves {', '.join(map(repr, ids))}")
    return model


def _stats(prefix: str, xs: list[float]) -> dict[str, float]:
    ms = [x * 1e3 for x in xs]
    nan = float("nan")
    return {
        f"mean_{prefix}_ms": statistics.fmean(ms) if ms else nan,
        f"median_{prefix}_ms": statistics.median(ms) if ms else nan,
        f"p99_{prefix}_ms": float(np.percentile(ms, 99)) if ms else nan,
    }


def summarize(results: list[Result], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    n_in = sum(r.prompt_len for r in ok)
    n_out = sum(r.output_tokens or len(r.itl) + 1 for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "num_requests": len(ok),
        "num_failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": n_out / duration,
        "total_token_throughput": (n_in + n_out) / duration,
        **_stats("ttft", [r.ttft for r in ok]),
        **_stats("tpot", tpot),
        **_stats("itl", [x for r in ok for x in r.itl]),
        **_stats("e2el", [r.latency for r in ok]),
    }


def format_report(r: dict[str, Any]) -> str:
    rows: list[tuple[str, Any]] = [
        ("=", " Serving Benchmark Result "),
        ("Successful requests:", r["num_requests"]),
        ("Failed requests:", r["num_failed"]),
        ("Benchmark duration (s):", r["duration_s"]),
        ("Total input tokens:", r["total_input_tokens"]),
        ("Total generated tokens:", r["total_output_tokens"]),
        ("Request throughput (req/s):", r["request_throughput"]),
        ("Output token throughput (tok/s):", r["output_throughput"]),
        ("Total Token throughput (tok/s):", r["total_token_throughput"]),
    ]
    for key, title in (
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token (excl. 1st token)"),
        ("itl", "Inter-token Latency"),
        ("e2el", "End-to-end Latency"),
    ):
        name = key.upper()
        rows += [
            ("-", title),
            (f"Mean {name} (ms):", r[f"mean_{key}_ms"]),
            (f"Median {name} (ms):", r[f"median_{key}_ms"]),
            (f"P99 {name} (ms):", r[f"p99_{key}_ms"]),
        ]
    lines = []
    for k, v in rows:
        if k in ("=", "-"):
            lines.append(f"{v:{k}^50}")
        elif isinstance(v, float):
            lines.append(f"{k:<40}{v:<10.2f}")
        else:
            lines.append(f"{k:<40}{v!s:<10}")
    lines.append("=" * 50)
    for e in r["errors"]:
        lines.append(f"error: {e}")
    return "\n".join(lines)


def _run_loop(main: Any) -> Any:
    """``asyncio.run(main)``, on uvloop when it is installed (a cheaper loop leaves more CPU to the server)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(main)
    return uvloop.run(main)  # pragma: no cover - Python < 3.11


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        res = _run_loop(run(args))
    except (ValueError, OSError) as e:
        print(f"pagedkv bench serve: {e}", file=sys.stderr)
        return 2
    except ImportError as e:
        print(f"pagedkv bench serve: {e}; install with pip install 'pagedkv-rs[serve]'", file=sys.stderr)
        return 1
    res["config"] = {k: v for k, v in vars(args).items() if k not in ("json", "api_key")}
    print(format_report(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0 if res["num_failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
