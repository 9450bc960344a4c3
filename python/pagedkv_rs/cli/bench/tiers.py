"""``pagedkv bench tiers``: TTFT of a request whose long prefix is cold, in the pool, only on disk, only in Redis.

Three worker processes, each with its own model and pool, started once: the *writer* (tiers: disk and
Redis) runs (a) a request whose ``--prefix-len`` prefix nobody has seen and (b) a second request with
the same prefix (a pool hit), then flushes its tier writers; the *disk reader* (tier: the same
directory) runs (c); the *Redis reader* (tier: the same server) runs (d). Every round uses a new random
prefix and a unique suffix, so (c) and (d) can only hit their tier. Rounds are interleaved; the table
reports medians, the ratios to (a), the MB/s each tier loads at (record bytes read / lookup time) and
the record bytes per block. A private ``redis-server`` is started on a free port unless ``--redis`` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

from pagedkv_rs.cli.formatting import HelpFormatter

__all__ = ["build_parser", "main", "format_table"]

TARGET = 0.25  # (c) and (d) at most this fraction of (a)'s TTFT


def build_parser() -> argparse.ArgumentParser:
    from pagedkv_rs.cli.args import add_llm_args

    p = argparse.ArgumentParser(
        formatter_class=HelpFormatter, prog="pagedkv bench tiers", description=__doc__.splitlines()[0]
    )
    p.add_argument("--prefix-len", type=int, default=2048, help="tokens of shared prefix (default 2048)")
    p.add_argument("--suffix-len", type=int, default=8, help="unique tokens after the prefix")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are reported")
    p.add_argument("--redis", default=None, metavar="URL", help="a Redis server to use (default: start one)")
    p.add_argument("--dir", default=None, help="disk tier directory (default: a temporary one)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON (default: no file)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: run one worker
    add_llm_args(p)
    return p


# --------------------------------------------------------------------------- worker
def _worker(args: argparse.Namespace) -> int:
    """Read JSON commands on stdin, answer one JSON line each (TTFT, cached tokens, tier stats)."""
    from pagedkv_rs.cli.args import llm_from_args
    from pagedkv_rs.engine.request import SamplingParams

    llm = llm_from_args(args)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    # warm-up at full length (unrelated tokens): threads, kernel dispatch, first touch of the step buffers
    n = args.prefix_len + args.suffix_len + 1
    llm.generate([[(7 + 13 * i) % 997 + 1000 for i in range(n)]], params)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("flush"):
            llm.engine.kv_tiers.flush()  # type: ignore[union-attr]
            print(json.dumps({"flushed": True}), flush=True)
            continue
        before = llm.engine.kv_tiers.stats() if llm.engine.kv_tiers else {}
        out = llm.generate([cmd["prompt"]], params)[0]
        after = llm.engine.kv_tiers.stats() if llm.engine.kv_tiers else {}
        delta = {}
        for name, st in after.items():
            b = before[name]
            delta[name] = {
                "hit_blocks": st["hit_blocks"] - b["hit_blocks"],
                "bytes_read": st["bytes_read"] - b["bytes_read"],
                "lookup_s": st["lookup_seconds"]["sum"] - b["lookup_seconds"]["sum"],
                "timeouts": st["timeouts"] - b["timeouts"],
                "errors": st["errors"] - b["errors"],
                "verify_failures": st["verify_failures"] - b["verify_failures"],
            }
        ttft = out.metrics.time_to_first_token if out.metrics is not None else None
        print(json.dumps({"ttft": ttft, "cached": out.num_cached_tokens, "tiers": delta}), flush=True)
    llm.shutdown()
    return 0


class _Worker:
    def __init__(self, argv: list[str], tiers: list[str]) -> None:
        cmd = [sys.executable, "-m", "pagedkv_rs.cli.main", "bench", "tiers", "--worker", "1", *argv]
        for t in tiers:
            cmd += ["--kv-tier", t]
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._read()

    def _read(self) -> dict[str, Any]:
        assert self.p.stdout is not None
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"bench tiers worker exited with {self.p.wait()}")
        return json.loads(line)

    def ask(self, **cmd: Any) -> dict[str, Any]:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.p.stdin is not None:
            self.p.stdin.close()
        self.p.wait()


# ---------------------------------------------------------------------------- redis
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_redis(workdir: str) -> tuple[subprocess.Popen, str]:
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit(
            "pagedkv bench tiers: redis-server not found (apt-get install -y redis-server) or pass --redis"
        )
    port = _free_port()
    args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", workdir]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    import redis

    client = redis.Redis(host="127.0.0.1", port=port)
    for _ in range(500):
        try:
            if client.ping():
                return proc, f"redis://127.0.0.1:{port}/0"
        except redis.exceptions.ConnectionError:
            time.sleep(0.02)
    proc.kill()
    raise SystemExit("pagedkv bench tiers: redis-server did not start")


# ------------------------------------------------------------------------------ run
def _llm_argv(args: argparse.Namespace) -> list[str]:
    out: list[str] = []
    for flag, val in (
        ("--model", args.model),
        ("--kv-dtype", args.kv_dtype),
        ("--num-blocks", args.num_blocks),
        ("--kv-memory", args.kv_memory),
        ("--block-size", args.block_size),
        ("--backend", args.backend),
        ("--weights", args.weights),
        ("--kv-tier-secret", args.kv_tier_secret),
    ):
        if val is not None:
            out += [flag, str(val)]
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    tmp = tempfile.mkdtemp(prefix="pagedkv-bench-tiers-")
    redis_proc = None
    url = args.redis
    try:
        if url is None:
            redis_proc, url = _start_redis(tmp)
        disk = f"disk:{args.dir or os.path.join(tmp, 'disk')}?size=16GiB"
        argv = _llm_argv(args)
        writer = _Worker(argv, [disk, url])
        disk_reader = _Worker(argv, [disk])
        redis_reader = _Worker(argv, [url])
        rows: dict[str, list[float]] = {"a": [], "b": [], "c": [], "d": []}
        cached: dict[str, list[int]] = {k: [] for k in rows}
        loads: dict[str, list[dict[str, Any]]] = {"c": [], "d": []}
        rng = np.random.default_rng(1234)
        for r in range(args.rounds):
            prefix = rng.integers(1000, 40000, args.prefix_len).tolist()

            def prompt(tag: int, prefix: list[int] = prefix) -> list[int]:
                return prefix + rng.integers(1000, 40000, args.suffix_len).tolist() + [tag]

            res = {
                "a": writer.ask(prompt=prompt(1)),
                "b": writer.ask(prompt=prompt(2)),
            }
            writer.ask(flush=True)
            res["c"] = disk_reader.ask(prompt=prompt(3))
            res["d"] = redis_reader.ask(prompt=prompt(4))
            for k, v in res.items():
                rows[k].append(v["ttft"])
                cached[k].append(v["cached"])
            loads["c"].append(next(iter(res["c"]["tiers"].values())))
            loads["d"].append(next(iter(res["d"]["tiers"].values())))
            print(
                f"round {r + 1}/{args.rounds}: "
                + ", ".join(f"({k}) {v['ttft']:.3f} s cached {v['cached']}" for k, v in res.items()),
                file=sys.stderr,
            )
        for w in (writer, disk_reader, redis_reader):
            w.close()
    finally:
        if redis_proc is not None:
            redis_proc.kill()
            redis_proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    out: dict[str, Any] = {"ttft_s": rows, "median_ttft_s": med, "cached_tokens": cached, "prefix_len": args.prefix_len}
    tier_io = {}
    for k, name in (("c", "disk"), ("d", "redis")):
        ls = loads[k]
        nbytes = sum(x["bytes_read"] for x in ls)
        secs = sum(x["lookup_s"] for x in ls)
        blocks = sum(x["hit_blocks"] for x in ls)
        tier_io[name] = {
            "mb_per_s": nbytes / secs / 1e6 if secs else 0.0,
            "bytes_per_block": nbytes / blocks if blocks else 0.0,
            "hit_blocks": blocks,
            "timeouts": sum(x["timeouts"] for x in ls),
            "errors": sum(x["errors"] for x in ls),
            "verify_failures": sum(x["verify_failures"] for x in ls),
        }
    out["tier_io"] = tier_io
    return out


def format_table(r: dict[str, Any]) -> str:
    med = r["median_ttft_s"]
    a = med["a"]
    io = r["tier_io"]
    n = len(r["ttft_s"]["a"])
    lines = [
        f"TTFT, {r['prefix_len']}-token prefix, median of {n} interleaved rounds (target (c), (d) <= {TARGET}x (a))",
        f"{'case':<34}{'TTFT s':>9}{'x (a)':>8}{'cached tokens':>15}{'tier MB/s':>11}",
    ]
    names = {
        "a": "(a) cold",
        "b": "(b) in the pool",
        "c": "(c) only on disk (new process)",
        "d": "(d) only in Redis (other process)",
    }
    for k, label in names.items():
        mbs = {"c": io["disk"]["mb_per_s"], "d": io["redis"]["mb_per_s"]}.get(k)
        cached = statistics.median(r["cached_tokens"][k])
        lines.append(
            f"{label:<34}{med[k]:>9.3f}{med[k] / a:>8.3f}{cached:>15.0f}{'' if mbs is None else f'{mbs:.0f}':>11}"
        )
    bpb = io["disk"]["bytes_per_block"] or io["redis"]["bytes_per_block"]
    lines.append(f"record bytes per block: {bpb:.0f} ({bpb / 1024:.1f} KiB), disk and Redis alike")
    for name in ("disk", "redis"):
        x = io[name]
        if x["timeouts"] or x["errors"] or x["verify_failures"]:
            lines.append(f"{name}: {x['timeouts']} timeouts, {x['errors']} errors, {x['verify_failures']} failures")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        return _worker(args)
    if args.kv_tiers:
        print("pagedkv bench tiers: sets its own tiers; use --redis and --dir", file=sys.stderr)
        return 2
    res = run(args)
    print(format_table(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
