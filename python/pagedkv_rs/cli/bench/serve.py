"""``pagedkv bench serve``: load any OpenAI-compatible server over HTTP, reported like vLLM's ``benchmark_serving``.

Prompts are fixed-seed random token ids (lengths uniform in ``input_len * [1 - r, 1 + r]``; ``r = 0``
gives fixed lengths) sent to ``/v1/completions`` with ``ignore_eos`` so each request generates exactly
its output length. Requests arrive all at once (``--request-rate inf``) or as a Poisson process,
at most ``--max-concurrency`` in flight. Streaming (the default) timestamps every SSE chunk: TTFT
is the first chunk with text, ITL the gaps between chunks, TPOT (last - first) / (tokens - 1).
Requests go through aiohttp (its C HTTP parser; what vLLM's benchmark_serving uses) and streamed bodies
through ``SSEParser`` on the raw bytes: the client shares the machine with the server it measures, so
its CPU per chunk is kept small (httpx's layers took ~200 us a chunk, about what the server spends).

``--workload prefix-repetition`` (vLLM's ``prefix_repetition`` dataset): G prefixes of P tokens, ``num_prompts // G``
requests each, every request one prefix plus its own Q-token question, shuffled (fixed seed) as vLLM's. The prompts are
random token ids made text by the server's ``/detokenize``, so a router that matches on text (sglang-router's
``cache_aware``) sees the shared prefixes. Several ``--base-url`` are taken in turn (client-side round robin);
the prefix-cache hit rate (hit / queried prompt tokens), the tokens loaded from KV tiers and the KV events
published (batches and events a second, dropped batches; servers with ``--kv-events-endpoint``) are the
increase of the servers' counters over the run, read from each ``--metrics-url`` (default: the base URLs;
behind a router, give the replicas'), reported beside TTFT. Where the server reports
``usage.prompt_tokens_details.cached_tokens``, TTFT is also split between warm requests (at least half the
prompt's KV found: prefix cache or a tier) and cold ones, since which of the two the median request is decides
the median TTFT.

``--structured``: the workload constrained and unconstrained, side by side in one run (``--rounds`` pairs,
in ABBA order against a drifting load). Constrained: each request carries a
JSON schema from a mixed set (``response_format`` json_schema; the set is new to the server each run, so
each schema's first compile is cold, its repeats warm) and may stop where its JSON ends; every answer is
parsed and validated (``jsonschema``). Unconstrained: fresh prompts of the same lengths, each asked for
exactly as many tokens as its constrained twin produced (``ignore_eos``), so both do the same work but for
the grammar. Reports both, the throughput ratio, the validity count, and the server's per-step mask time
and compile time p50 / p99 (cold, warm) from its ``/metrics`` histograms (interpolated in their buckets).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import numpy as np

from pagedkv_rs.cli.formatting import HelpFormatter

__all__ = ["main", "build_parser", "run", "format_report"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        formatter_class=HelpFormatter, prog="pagedkv bench serve", description=__doc__.splitlines()[0]
    )
    p.add_argument(
        "--base-url",
        action="append",
        default=None,
        help="server root, with or without /v1 (…/v1/completions is posted); repeat it to take several servers "
        "in turn (default: http://127.0.0.1:8000)",
    )
    p.add_argument(
        "--metrics-url",
        action="append",
        default=None,
        help="server whose /metrics counts prefix-cache and tier hits; repeat it for each replica behind a router "
        "(default: the base URLs)",
    )
    p.add_argument(
        "--workload",
        choices=("random", "prefix-repetition"),
        default="random",
        help="random: independent prompts; prefix-repetition: vLLM's shared-prefix groups (see below)",
    )
    p.add_argument("--prefix-repetition-prefix-len", type=int, default=256, metavar="P", help="tokens per prefix")
    p.add_argument(
        "--prefix-repetition-suffix-len", type=int, default=256, metavar="Q", help="tokens per request's question"
    )
    p.add_argument(
        "--prefix-repetition-num-prefixes", type=int, default=10, metavar="G", help="prefix groups, interleaved"
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
    p.add_argument(
        "--structured",
        action="store_true",
        help="run constrained (a JSON schema per request) then unconstrained, side by side; needs jsonschema",
    )
    p.add_argument(
        "--rounds", type=int, default=2, help="--structured: constrained/unconstrained pass pairs, in ABBA order"
    )
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
    text: str = ""
    finish_reason: Optional[str] = None
    cached_tokens: Optional[int] = None  # usage.prompt_tokens_details.cached_tokens, when the server reports it


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
                whole = await resp.json(content_type=None)
                r.output_tokens = whole["usage"]["completion_tokens"]
                r.prompt_len = whole["usage"].get("prompt_tokens", r.prompt_len)
                r.cached_tokens = _cached(whole["usage"])
                r.text = whole["choices"][0].get("text") or ""
                r.finish_reason = whole["choices"][0].get("finish_reason")
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
                    if choices and choices[0].get("finish_reason"):
                        r.finish_reason = choices[0]["finish_reason"]
                    if choices and choices[0].get("text"):
                        r.text += choices[0]["text"]
                        if last is None:
                            r.ttft = now - t0
                        else:
                            r.itl.append(now - last)
                        last = now
                    if chunk.get("usage"):
                        r.output_tokens = chunk["usage"]["completion_tokens"]
                        r.prompt_len = chunk["usage"].get("prompt_tokens", r.prompt_len)
                        r.cached_tokens = _cached(chunk["usage"])
                if done:
                    break
        r.latency = time.perf_counter() - t0
        r.ok = last is not None
        if not r.ok:
            r.error = "no tokens streamed"
    except Exception as e:
        r.error = f"{type(e).__name__}: {e}"
    return r


def _cached(usage: dict[str, Any]) -> Optional[int]:
    n = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return int(n) if isinstance(n, int) else None


def _root(url: str) -> str:
    return url.rstrip("/").removesuffix("/v1")  # the root or the OpenAI client's .../v1


async def make_prefix_prompts(client: Any, base: str, args: argparse.Namespace) -> list[tuple[str, int]]:
    """vLLM's prefix_repetition: G random P-token prefixes, ``num_prompts // G`` requests each (one prefix plus
    its own Q-token question), shuffled; the ids are made text by the server's ``/detokenize``."""
    g, p, q = (
        args.prefix_repetition_num_prefixes,
        args.prefix_repetition_prefix_len,
        args.prefix_repetition_suffix_len,
    )
    if g < 1 or p < 1 or q < 1:
        raise ValueError("--prefix-repetition-num-prefixes, -prefix-len and -suffix-len must be >= 1")
    if args.num_prompts < g:
        raise ValueError(f"--num-prompts ({args.num_prompts}) must be >= --prefix-repetition-num-prefixes ({g})")
    lo, hi = (int(x) for x in args.token_range.split(":"))
    rng = np.random.default_rng(args.seed)

    async def text(ids: list[int]) -> str:
        async with client.post(f"{base}/detokenize", json={"tokens": ids}) as resp:
            if resp.status != 200:
                raise ValueError(f"POST {base}/detokenize: HTTP {resp.status} (the workload needs it to make text)")
            return str((await resp.json(content_type=None))["prompt"])

    out = []
    for _ in range(g):
        prefix = await text(rng.integers(lo, hi, p).tolist())
        for _ in range(args.num_prompts // g):
            out.append((prefix + await text(rng.integers(lo, hi, q).tolist()), args.output_len))
    return [out[i] for i in rng.permutation(len(out))]


_COUNTERS = {
    "queries": "pagedkv:prefix_cache_queries_total",
    "hits": "pagedkv:prefix_cache_hits_total",
    "tier_hit_tokens": "pagedkv:kv_tier_hit_tokens_total",
    "event_batches": "pagedkv:kv_events_batches_total",
    "events": "pagedkv:kv_events_events_total",
    "event_drops": "pagedkv:kv_events_dropped_batches_total",
}


def _counters(text: str) -> dict[str, float]:
    """The prefix-cache and tier counters of one /metrics page (tiers summed)."""
    out = {}
    for key, name in _COUNTERS.items():
        out[key] = sum(float(v) for v in re.findall(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M))
    return out


async def _read_counters(client: Any, urls: list[str]) -> list[dict[str, float]]:
    return [_counters(await _scrape(client, u)) for u in urls]


def cache_report(before: list[dict[str, float]], after: list[dict[str, float]]) -> dict[str, Any]:
    """Prefix-cache hit rate (hit / queried prompt tokens) over the run, summed and per server."""
    per = [{k: a[k] - b[k] for k in a} for b, a in zip(before, after)]
    q, h = sum(d["queries"] for d in per), sum(d["hits"] for d in per)
    return {
        "prefix_cache_queries": q,
        "prefix_cache_hits": h,
        "prefix_hit_rate": h / q if q else float("nan"),
        "per_server_hit_rate": [d["hits"] / d["queries"] if d["queries"] else float("nan") for d in per],
        "per_server_queries": [d["queries"] for d in per],
        "tier_hit_tokens": sum(d["tier_hit_tokens"] for d in per),
        "kv_event_batches": sum(d["event_batches"] for d in per),
        "kv_events": sum(d["events"] for d in per),
        "kv_event_dropped_batches": sum(d["event_drops"] for d in per),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Send the prompts; returns the metrics dict ``format_report`` prints (``--structured``: two of them)."""
    import aiohttp

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    bases = [_root(u) for u in (args.base_url or ["http://127.0.0.1:8000"])]
    metrics = [_root(u) for u in (args.metrics_url or bases)]
    base = bases[0]
    if args.structured and (len(bases) > 1 or args.workload != "random"):
        raise ValueError("--structured runs the random workload against one --base-url")
    connector = aiohttp.TCPConnector(limit=args.max_concurrency or args.num_prompts)
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout, connector=connector) as client:
        model = await served_model(client, base, args.model)
        for other in bases[1:]:
            await served_model(client, other, model)
        urls = [f"{b}/v1/completions" for b in bases]
        url = urls[0]
        stream = not args.no_stream

        def body(prompt: Any, n_out: int, **extra: Any) -> dict[str, Any]:
            b = {
                "model": model,
                "prompt": prompt,
                "max_tokens": n_out,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": stream,
                **extra,
            }
            if stream:
                b["stream_options"] = {"include_usage": True}
            return b

        if args.workload == "prefix-repetition":
            reqs: list[tuple[Any, int]] = await make_prefix_prompts(client, _root(metrics[0]), args)
        else:
            reqs = make_prompts(args)
        for u in urls:  # warm-up: connection, server first touch (no prefix of the workload)
            await _one(client, u, body(make_prompts(args)[0][0][:16], 4), stream)
        if not args.structured:
            before = await _read_counters(client, metrics)
            bodies = [body(p, n) for p, n in reqs]
            targets = [urls[i % len(urls)] for i in range(len(bodies))]
            results, duration = await _send(client, targets, bodies, args, stream)
            res = summarize(results, duration)
            res.update(cache_report(before, await _read_counters(client, metrics)), workload=args.workload)
            return res
        return await _run_structured(client, base, url, reqs, body, args, stream)


async def _send(
    client: Any,
    url: Union[str, list[str]],
    bodies: list[dict[str, Any]],
    args: argparse.Namespace,
    stream: bool,
    desc: str = "",
) -> tuple[list[Result], float]:
    """Send ``bodies`` (at most ``--max-concurrency`` in flight, arrivals per ``--request-rate``); ``url``: one for
    all, or one per body."""
    urls = url if isinstance(url, list) else [url] * len(bodies)
    sem = asyncio.Semaphore(args.max_concurrency or len(bodies))
    bar = None
    if not args.no_progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(bodies), desc=f"bench serve{desc}", unit="req", file=sys.stderr)

    async def limited(u: str, b: dict[str, Any]) -> Result:
        async with sem:
            try:
                res = await asyncio.wait_for(_one(client, u, b, stream), args.timeout)
            except asyncio.TimeoutError:
                res = Result(prompt_len=len(b["prompt"]), error=f"no answer within --timeout {args.timeout} s")
        if bar is not None:
            bar.update(1)
        return res

    rng = np.random.default_rng(args.seed + 1)
    tasks = []
    t0 = time.perf_counter()
    for u, b in zip(urls, bodies):
        tasks.append(asyncio.ensure_future(limited(u, b)))
        if args.request_rate != float("inf"):
            await asyncio.sleep(float(rng.exponential(1.0 / args.request_rate)))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return list(results), duration


def bench_schemas(tag: str) -> list[dict[str, Any]]:
    """The mixed schema set (enums, nested arrays, $defs/$ref, anyOf, patterns, bounds); ``tag`` makes it new."""
    person = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 99},
            "role": {"enum": ["admin", "user", "guest"]},
        },
        "required": ["name", "age", "role"],
        "additionalProperties": False,
    }
    schemas: list[dict[str, Any]] = [
        {
            "type": "object",
            "properties": {"people": {"type": "array", "items": person, "minItems": 3, "maxItems": 5}},
            "required": ["people"],
            "additionalProperties": False,
        },
        {
            "type": "object",
            "properties": {
                "order": {"type": "integer", "minimum": 1, "maximum": 99999},
                "status": {"enum": ["new", "paid", "shipped", "returned"]},
                "lines": {
                    "type": "array",
                    "minItems": 2,
                    "maxItems": 4,
                    "items": {
                        "type": "object",
                        "properties": {
                            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                            "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                        },
                        "required": ["sku", "qty"],
                        "additionalProperties": False,
                    },
                },
            },
            "required": ["order", "status", "lines"],
            "additionalProperties": False,
        },
        {
            "type": "object",
            "properties": {
                "grid": {
                    "type": "array",
                    "minItems": 3,
                    "maxItems": 4,
                    "items": {
                        "type": "array",
                        "minItems": 3,
                        "maxItems": 4,
                        "items": {"type": "integer", "minimum": 0, "maximum": 9},
                    },
                }
            },
            "required": ["grid"],
            "additionalProperties": False,
        },
        {
            "$defs": {"person": person},
            "type": "object",
            "properties": {
                "owner": {"$ref": "#/$defs/person"},
                "backup": {"anyOf": [{"$ref": "#/$defs/person"}, {"type": "null"}]},
                "active": {"type": "boolean"},
            },
            "required": ["owner", "backup", "active"],
            "additionalProperties": False,
        },
        {
            "type": "object",
            "properties": {
                "colors": {
                    "type": "array",
                    "minItems": 4,
                    "maxItems": 8,
                    "items": {"enum": ["red", "green", "blue", "cyan", "magenta", "yellow", "black", "white"]},
                },
                "code": {"type": "string", "pattern": "^#[0-9a-f]{6}$"},
            },
            "required": ["colors", "code"],
            "additionalProperties": False,
        },
    ]
    return [{**sc, "title": f"bench-{tag}-{i}"} for i, sc in enumerate(schemas)]


def _histograms(text: str, name: str) -> dict[str, list[tuple[float, float]]]:
    """Cumulative buckets of one Prometheus histogram family, keyed by its ``cache`` label ("" if none)."""
    out: dict[str, list[tuple[float, float]]] = {}
    for m in re.finditer(rf"^{re.escape(name)}_bucket\{{([^}}]*)\}} (\S+)$", text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        le = float("inf") if labels["le"] == "+Inf" else float(labels["le"])
        out.setdefault(labels.get("cache", ""), []).append((le, float(m.group(2))))
    return {k: sorted(v) for k, v in out.items()}


def quantile(before: list[tuple[float, float]], after: list[tuple[float, float]], q: float) -> float:
    """The q-quantile of the observations between two scrapes of a histogram, interpolated within its bucket."""
    prev = dict(before)
    cum = [(le, n - prev.get(le, 0.0)) for le, n in after]
    total = cum[-1][1] if cum else 0.0
    if total <= 0:
        return float("nan")
    want, lo, below = q * total, 0.0, 0.0
    for le, n in cum:
        if n >= want:
            if le == float("inf"):
                return lo
            return lo + (le - lo) * ((want - below) / (n - below) if n > below else 1.0)
        lo, below = le, n
    return lo


async def _scrape(client: Any, base: str) -> str:
    try:
        async with client.get(f"{base}/metrics") as resp:
            return await resp.text() if resp.status == 200 else ""
    except Exception:
        return ""


async def _run_structured(
    client: Any,
    base: str,
    url: str,
    reqs: list[tuple[list[int], int]],
    body: Any,
    args: argparse.Namespace,
    stream: bool,
) -> dict[str, Any]:
    """Constrained and unconstrained passes in ABBA order (``--rounds``); both summaries, the ratio, validity,
    the server's mask and compile times."""
    try:
        import jsonschema
    except ImportError:
        raise ImportError("--structured validates answers with jsonschema: pip install jsonschema") from None
    lo, hi = (int(x) for x in args.token_range.split(":"))
    rng = np.random.default_rng(args.seed + 2)
    before = await _scrape(client, base)
    runs: dict[str, list[tuple[list[Result], float]]] = {"c": [], "u": []}
    valid = stops = 0
    lengths: list[int] = []

    def fresh(n: int) -> list[list[int]]:  # new prompts of the workload's lengths: no prefix-cache hit across passes
        return [rng.integers(lo, hi, len(p)).tolist() for p, _ in reqs[:n]]

    async def constrained(k: int) -> None:
        nonlocal valid, stops, lengths
        schemas = bench_schemas(f"{args.seed}-{k}-{time.time_ns()}")  # new to the server: first compiles cold
        prompts = [p for p, _ in reqs] if k == 0 else fresh(len(reqs))
        bodies = []
        for i, (prompt, (_, n_out)) in enumerate(zip(prompts, reqs)):
            sc = schemas[i % len(schemas)]
            fmt = {"type": "json_schema", "json_schema": {"name": sc["title"], "schema": sc, "strict": True}}
            bodies.append(body(prompt, n_out, ignore_eos=False, response_format=fmt))
        res, dur = await _send(client, url, bodies, args, stream, f" (structured {k + 1})")
        runs["c"].append((res, dur))
        for i, r in enumerate(res):
            stops += r.finish_reason == "stop"
            try:
                jsonschema.validate(json.loads(r.text), schemas[i % len(schemas)])
                valid += r.ok
            except (ValueError, jsonschema.ValidationError):
                pass
        lengths = [max(1, r.output_tokens or n) for r, (_, n) in zip(res, reqs)]

    async def unconstrained(k: int) -> None:  # as many tokens as the latest constrained pass, exactly
        bodies = [body(p, n) for p, n in zip(fresh(len(lengths)), lengths)]
        runs["u"].append(await _send(client, url, bodies, args, stream, f" (unconstrained {k + 1})"))

    for k in range(args.rounds):  # C U, then U C, ...: a drifting machine load weighs on both alike
        if k % 2 == 0:
            await constrained(k)
            await unconstrained(k)
        else:
            await unconstrained(k)
            await constrained(k)
    after = await _scrape(client, base)
    res = summarize([r for rs, _ in runs["c"] for r in rs], sum(d for _, d in runs["c"]))
    res["unconstrained"] = summarize([r for rs, _ in runs["u"] for r in rs], sum(d for _, d in runs["u"]))
    res["throughput_ratio"] = res["output_throughput"] / res["unconstrained"]["output_throughput"]
    res["round_ratios"] = [
        (sum(r.output_tokens for r in c) / cd) / (sum(r.output_tokens for r in u) / ud)
        for (c, cd), (u, ud) in zip(runs["c"], runs["u"])
    ]
    res["valid_answers"] = valid
    res["finished_by_stop"] = stops
    timings: dict[str, float] = {}
    for family, label, key in (
        ("pagedkv:structured_mask_seconds", "", "mask"),
        ("pagedkv:structured_compile_seconds", "cold", "compile_cold"),
        ("pagedkv:structured_compile_seconds", "warm", "compile_warm"),
    ):
        a = _histograms(after, family).get(label, [])
        b = _histograms(before, family).get(label, [])
        for q in (0.5, 0.99):
            timings[f"p{int(q * 100)}_{key}_ms"] = quantile(b, a, q) * 1e3
    res["server_timings"] = timings
    return res


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
    # requests that found at least half their prompt's KV (prefix cache or a tier) vs the others
    known = [r for r in ok if r.cached_tokens is not None]
    warm = [r.ttft for r in known if 2 * (r.cached_tokens or 0) >= r.prompt_len]
    cold = [r.ttft for r in known if 2 * (r.cached_tokens or 0) < r.prompt_len]
    by_cache = {"warm_requests": len(warm), "cold_requests": len(cold)} if known else {}
    if known:
        by_cache.update(_stats("ttft_warm", warm), **_stats("ttft_cold", cold))
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
        **by_cache,
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
    if "prefix_hit_rate" in r and r["prefix_cache_queries"]:
        rows2: list[tuple[str, Any]] = [
            ("-", "Prefix cache (servers' /metrics)"),
            ("Prefix hit rate (hit/queried tokens):", r["prefix_hit_rate"]),
            ("Per-server hit rate:", " ".join(f"{x:.3f}" for x in r["per_server_hit_rate"])),
            ("Per-server queried tokens:", " ".join(f"{x:.0f}" for x in r["per_server_queries"])),
            ("Tokens loaded from KV tiers:", f"{r['tier_hit_tokens']:.0f}"),
        ]
        if "warm_requests" in r:  # the servers report usage.prompt_tokens_details.cached_tokens
            rows2 += [
                ("Requests >= half cached (warm/cold):", f"{r['warm_requests']} {r['cold_requests']}"),
                ("Median TTFT warm / cold (ms):", f"{r['median_ttft_warm_ms']:.2f} {r['median_ttft_cold_ms']:.2f}"),
            ]
        if r.get("kv_event_batches"):  # servers publishing KV events (--kv-events-endpoint)
            d = r["duration_s"]
            rows2.append(
                (
                    "KV events batches/s, events/s, dropped:",
                    f"{r['kv_event_batches'] / d:.2f} {r['kv_events'] / d:.2f} {r['kv_event_dropped_batches']:.0f}",
                )
            )
        for k, v in rows2:
            lines.append(f"{v:-^50}" if k == "-" else (f"{k:<40}{v:<10.3f}" if isinstance(v, float) else f"{k:<40}{v}"))
    lines.append("=" * 50)
    for e in r["errors"]:
        lines.append(f"error: {e}")
    if "unconstrained" in r:
        u = r["unconstrained"]
        lines[0] = f"{' Structured (JSON schema per request) ':=^50}"
        lines += ["", format_report(u).replace(" Serving Benchmark Result ", " Unconstrained, same lengths ")]
        extra: list[tuple[str, Any]] = [
            ("=", " Structured vs unconstrained "),
            ("Output tok/s ratio (structured/plain):", r["throughput_ratio"]),
            ("Per-round ratios:", " ".join(f"{x:.3f}" for x in r["round_ratios"])),
            ("Valid answers (parse + schema):", f"{r['valid_answers']}/{r['num_requests'] + r['num_failed']}"),
            ("Finished at the JSON's end (stop):", r["finished_by_stop"]),
        ]
        t = r["server_timings"]
        for key, title in (
            ("mask", "Mask time per step"),
            ("compile_cold", "Compile, cold"),
            ("compile_warm", "Compile, warm"),
        ):
            extra += [(f"{title} P50 (ms):", t[f"p50_{key}_ms"]), (f"{title} P99 (ms):", t[f"p99_{key}_ms"])]
        for k, v in extra:
            if k == "=":
                lines.append(f"{v:=^50}")
            elif isinstance(v, float):
                lines.append(f"{k:<40}{v:<10.3f}")
            else:
                lines.append(f"{k:<40}{v!s:<10}")
        lines.append("=" * 50)
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
