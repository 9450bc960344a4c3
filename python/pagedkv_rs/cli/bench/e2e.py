"""``pagedkv bench e2e``: N concurrent requests through the engine, reported the way vLLM's
``benchmark_serving`` does (throughput, TTFT, TPOT, ITL), plus KV usage and prefix hit rate.

Requests are a fixed-seed synthetic mix (vLLM's "random" dataset): prompt and output lengths
uniform in ``len * [1 - range_ratio, 1 + range_ratio]``, prompts of random vocabulary tokens
after an optional shared prefix, outputs of exactly their length (``ignore_eos``). All requests
arrive at t=0. ``--profile`` splits the wall time into weight matmuls, attention, KV writes,
other model math, sampling and scheduling.

``--workload copy`` asks instead for a ~400-token piece of code (a fixed text in this module) repeated with one
name changed, through the model's chat template: the case speculative decoding (``--speculative``) is for.
``--spec-table`` runs each row of ``--spec-rows`` (``WORKLOAD:SEQS`` items) without and with ``--speculative``
(default ``ngram``), interleaved over ``--rounds``, and prints the medians, their ratio, the acceptance rate
and the mean accepted length (tokens per verification: accepted drafts + 1).

``--table`` runs the comparison table instead of one run: rows of 1, 8 and 32 concurrent requests
(``--table-seqs``) and a 512-token prefill row (``--prefill-len``), one column per model
implementation (``--table-impls``, default ``numpy,fused``: the numpy path with ``--weights``
beside the fused Rust decoder on int8 weights), rows and columns interleaved over ``--rounds``
rounds and the medians printed, prefix caching off.

Weight matmuls run in ``pagedkv_rs.QLinear`` (``--weights int8``, the default where its AVX-512 VNNI
or AVX2 tile runs) on the kernel thread pool, or in numpy's OpenBLAS (``--weights float32``). OpenBLAS's
threads spin-wait between calls; on a machine whose cores are busy with other work they stall
(several times slower with 2 threads than with ``OPENBLAS_NUM_THREADS=1``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np

from pagedkv_rs.cli.formatting import HelpFormatter

__all__ = ["main", "build_parser", "synthetic_requests", "copy_requests", "run_benchmark", "format_report"]

WORKLOADS = ("random", "copy")
# The copy workload's text: a small, self-contained module (original to this benchmark).
COPY_SOURCE = '''\
import heapq
from dataclasses import dataclass, field


@dataclass(order=True)
class Job:
    priority: int
    name: str = field(compare=False)
    cost: float = field(compare=False, default=1.0)


class JobQueue:
    """A priority queue of jobs with a budget: pop_ready returns the jobs that fit."""

    def __init__(self, budget: float) -> None:
        self.budget = budget
        self.heap: list[Job] = []
        self.done: list[str] = []

    def push(self, job: Job) -> None:
        if job.cost <= 0:
            raise ValueError(f"job {job.name} has a non-positive cost {job.cost}")
        heapq.heappush(self.heap, job)

    def pop_ready(self) -> list[Job]:
        ready = []
        left = self.budget
        while self.heap and self.heap[0].cost <= left:
            job = heapq.heappop(self.heap)
            left -= job.cost
            ready.append(job)
            self.done.append(job.name)
        return ready

    def pending(self) -> int:
        return len(self.heap)


def schedule(jobs: list[Job], budget: float, rounds: int) -> list[list[str]]:
    queue = JobQueue(budget)
    for job in jobs:
        queue.push(job)
    plan = []
    for _ in range(rounds):
        batch = queue.pop_ready()
        if not batch:
            break
        plan.append([job.name for job in batch])
    return plan


if __name__ == "__main__":
    jobs = [Job(2, "index", 0.5), Job(1, "fetch", 1.5), Job(3, "report", 2.0), Job(1, "parse", 1.0)]
    for i, names in enumerate(schedule(jobs, budget=2.0, rounds=4)):
        print(i, ", ".join(names))
'''
COPY_RENAMES = [
    ("JobQueue", "TaskQueue"),
    ("pop_ready", "take_ready"),
    ("schedule", "plan_rounds"),
    ("pending", "waiting"),
    ("budget", "capacity"),
    ("heap", "items"),
    ("Job", "Task"),
    ("done", "finished"),
]


def build_parser() -> argparse.ArgumentParser:
    from pagedkv_rs.cli.args import add_llm_args

    p = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="pagedkv bench e2e",
        description=__doc__.splitlines()[0],
        epilog="On a loaded machine set OPENBLAS_NUM_THREADS=1 (see the module docstring).",
    )
    p.add_argument("--num-requests", type=int, default=32, help="concurrent requests (default 32)")
    p.add_argument("--input-len", type=int, default=128, help="mean prompt length in tokens")
    p.add_argument("--output-len", type=int, default=128, help="mean output length in tokens")
    p.add_argument("--range-ratio", type=float, default=0.5, help="lengths uniform in len*[1-r, 1+r]")
    p.add_argument("--prefix-len", type=int, default=0, help="tokens of shared prompt prefix")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic requests")
    p.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="random",
        help="random: random-token prompts; copy: code repeated with one name changed (output: --output-len)",
    )
    add_llm_args(p)
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests in one engine step at most")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens in one engine step at most")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--profile", action="store_true", help="attribute the time (cProfile)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON (default: no file)")
    p.add_argument("--table", action="store_true", help="the 1/8/32-sequence + prefill table, numpy beside fused")
    p.add_argument(
        "--table-impls",
        default="numpy,fused",
        help="columns of --table: IMPL[:WEIGHTS] items (fused defaults to int8 weights, numpy to --weights)",
    )
    p.add_argument("--table-seqs", default="1,8,32", help="concurrent requests of the --table rows")
    p.add_argument("--prefill-len", type=int, default=512, help="prompt tokens of the --table prefill row (0: none)")
    p.add_argument("--rounds", type=int, default=1, help="--table / --spec-table rounds (medians reported)")
    p.add_argument(
        "--bandwidth-probe",
        default=1 << 30,
        type=_probe_bytes,
        metavar="BYTES",
        help="--table: before each round, read a buffer of BYTES (pagedkv_rs.memory_bandwidth) to report the "
        "one-sequence row's weight bytes per second as a fraction of the memory read bandwidth (0: no probe)",
    )
    p.add_argument("--spec-table", action="store_true", help="rows without and with --speculative, side by side")
    p.add_argument(
        "--spec-rows",
        default="copy:1,copy:8,random:1,random:8,random:32",
        help="WORKLOAD:SEQS rows of --spec-table",
    )
    p.add_argument("--no-progress", action="store_true")
    return p


def synthetic_requests(
    num: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    prefix_len: int,
    vocab: int,
    special_ids: Sequence[int] = (),
    seed: int = 0,
) -> list[tuple[list[int], int]]:
    """Fixed-seed ``(prompt_ids, output_len)`` pairs; prompts avoid special tokens."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    allowed = np.setdiff1d(np.arange(vocab), np.asarray(list(special_ids), np.int64))

    def lengths(mean: int) -> np.ndarray:
        lo, hi = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
        return rng.integers(lo, hi + 1, num)

    ins, outs = lengths(input_len), lengths(output_len)
    prefix = rng.choice(allowed, prefix_len).tolist()
    return [(prefix + rng.choice(allowed, int(n)).tolist(), int(m)) for n, m in zip(ins, outs)]


def copy_requests(num: int, tokenizer: Any, output_len: int) -> list[tuple[list[int], int]]:
    """``num`` prompts asking for ``COPY_SOURCE`` back with one name changed (a different one per request):
    through the model's chat template, or as a text to continue when the model has none."""
    from pagedkv_rs.models.chat_template import ChatTemplateError

    out = []
    for i in range(num):
        old, new = COPY_RENAMES[i % len(COPY_RENAMES)]
        text = (
            f"Repeat this Python code exactly, but rename `{old}` to `{new}`. "
            f"Answer with the code only.\n\n```python\n{COPY_SOURCE}```"
        )
        try:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}])
        except ChatTemplateError:
            ids = tokenizer.encode(
                f"{text}\n\nThe code with `{old}` renamed to `{new}`:\n\n```python\n", add_special_tokens=True
            )
        out.append((ids, output_len))
    return out


def workload_requests(args: argparse.Namespace, llm: Any, workload: str, num: int, seed: int) -> list[Any]:
    """The requests of one workload for ``llm``."""
    tok = llm.get_tokenizer()
    if workload == "copy":
        return copy_requests(num, tok, args.output_len)
    v, special = llm.model.vocab_size, sorted(tok.special_ids)
    return synthetic_requests(num, args.input_len, args.output_len, args.range_ratio, args.prefix_len, v, special, seed)


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def _fmean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def run_benchmark(llm: Any, requests: list[tuple[list[int], int]], *, progress: bool = True) -> dict[str, Any]:
    """Drive the engine step by step; per-token timestamps give TTFT/TPOT/ITL."""
    from pagedkv_rs.engine.request import SamplingParams

    engine = llm.engine
    kv0, steps0, pre0 = engine.kv_manager.stats(), engine.scheduler.num_steps, engine.scheduler.num_preemptions
    spec = engine.scheduler.spec
    spec0 = spec.stats() if spec is not None else None
    t0 = time.perf_counter()
    ids = []
    for prompt, n_out in requests:
        ids.append(engine.add_request(None, prompt, SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)))
    stamps: dict[str, list[float]] = {r: [] for r in ids}
    done = 0
    usage: list[float] = []
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(ids), desc="bench e2e", unit="req", file=sys.stderr)
    while done < len(ids):
        outs = engine.step()
        now = time.perf_counter()
        usage.append(engine.scheduler.stats()["kv_usage"])
        for o in outs:
            stamps[o.request_id].extend([now] * len(o.new_token_ids))
            if o.finished:
                done += 1
                if bar is not None:
                    bar.update(1)
    duration = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    stats = engine.stats()
    kv1 = engine.kv_manager.stats()
    queried = kv1.get("prefix_query_tokens", 0) - kv0.get("prefix_query_tokens", 0)
    hits = kv1.get("prefix_hit_tokens", 0) - kv0.get("prefix_hit_tokens", 0)
    ttft = [(s[0] - t0) * 1e3 for s in stamps.values()]
    tpot = [(s[-1] - s[0]) / (len(s) - 1) * 1e3 for s in stamps.values() if len(s) > 1]
    itl = [(b - a) * 1e3 for s in stamps.values() for a, b in zip(s, s[1:])]
    n_in = sum(len(p) for p, _ in requests)
    n_out = sum(len(s) for s in stamps.values())
    return {
        "num_requests": len(ids),
        "duration_s": duration,
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "request_throughput": len(ids) / duration,
        "output_throughput": n_out / duration,
        "total_token_throughput": (n_in + n_out) / duration,
        **{f"{k}_ttft_ms": f(ttft) for k, f in (("mean", _fmean), ("median", _median))},
        "p99_ttft_ms": _pct(ttft, 99),
        **{f"{k}_tpot_ms": f(tpot) for k, f in (("mean", _fmean), ("median", _median))},
        "p99_tpot_ms": _pct(tpot, 99),
        **{f"{k}_itl_ms": f(itl) for k, f in (("mean", _fmean), ("median", _median))},
        "p99_itl_ms": _pct(itl, 99),
        "peak_kv_usage": max(usage, default=0.0),
        "mean_kv_usage": statistics.fmean(usage) if usage else 0.0,
        "prefix_hit_rate": hits / queried if queried else 0.0,
        "num_preemptions": engine.scheduler.num_preemptions - pre0,
        "num_steps": engine.scheduler.num_steps - steps0,
        "kernels": stats["kernels"],
        "weights": getattr(getattr(engine.model, "weights", None), "weight_format", "n/a"),
        "act_digits_one": _one_digit(engine.model),
        "model_impl": getattr(engine.model, "impl", "n/a"),
        "backend": stats["backend"],
        **(_spec_delta(spec0, spec.stats()) if spec is not None and spec0 is not None else {}),
    }


def _one_digit(model: Any) -> str:
    """The int8 matrices whose products take one activation digit (``LlamaWeights.act_digits_spec``)."""
    w = getattr(model, "weights", None)
    return w.act_digits_spec() if getattr(w, "weight_format", None) == "int8" else "n/a"


def _spec_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Speculative decoding over one run: drafts, draft and accepted tokens, acceptance, mean accepted length,
    and the share of the governed decode steps that drafted (when no step was governed: 1 if any step drafted,
    as every step may without a governor; 0 if none did, as when every batch was above ``max_batch``)."""
    n, d, a = (
        after[k] - before[k]
        for k in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
    )
    on = off = 0
    for b0, b1 in zip(before.get("spec_decode_governor", ()), after.get("spec_decode_governor", ())):
        on += b1["steps_on"] - b0["steps_on"]
        off += b1["steps_off"] - b0["steps_off"]
    return {
        "spec_governed_on_share": on / (on + off) if on + off else float(n > 0),
        "spec_num_drafts": n,
        "spec_num_draft_tokens": d,
        "spec_num_accepted_tokens": a,
        "spec_acceptance_rate": a / d if d else 0.0,
        "spec_mean_accepted_length": 1.0 + a / n if n else 0.0,
    }


def format_report(r: dict[str, Any]) -> str:
    rows = [
        ("=", " Serving Benchmark Result "),
        ("Successful requests:", r["num_requests"]),
        ("Benchmark duration (s):", r["duration_s"]),
        ("Total input tokens:", r["total_input_tokens"]),
        ("Total generated tokens:", r["total_output_tokens"]),
        ("Request throughput (req/s):", r["request_throughput"]),
        ("Output token throughput (tok/s):", r["output_throughput"]),
        ("Total Token throughput (tok/s):", r["total_token_throughput"]),
        ("-", "Time to First Token"),
        ("Mean TTFT (ms):", r["mean_ttft_ms"]),
        ("Median TTFT (ms):", r["median_ttft_ms"]),
        ("P99 TTFT (ms):", r["p99_ttft_ms"]),
        ("-", "Time per Output Token (excl. 1st token)"),
        ("Mean TPOT (ms):", r["mean_tpot_ms"]),
        ("Median TPOT (ms):", r["median_tpot_ms"]),
        ("P99 TPOT (ms):", r["p99_tpot_ms"]),
        ("-", "Inter-token Latency"),
        ("Mean ITL (ms):", r["mean_itl_ms"]),
        ("Median ITL (ms):", r["median_itl_ms"]),
        ("P99 ITL (ms):", r["p99_itl_ms"]),
        ("-", "KV cache"),
        ("Peak KV usage:", f"{r['peak_kv_usage']:.1%}"),
        ("Mean KV usage:", f"{r['mean_kv_usage']:.1%}"),
        ("Prefix cache hit rate:", f"{r['prefix_hit_rate']:.1%}"),
        ("Preemptions:", r["num_preemptions"]),
        ("Engine steps:", r["num_steps"]),
        ("Kernels / allocator:", f"{r['kernels']} / {r['backend']}"),
        ("Weights:", r.get("weights", "n/a")),
        ("One activation digit:", r.get("act_digits_one", "n/a")),
        ("Model implementation:", r.get("model_impl", "n/a")),
    ]
    if "spec_num_drafts" in r:
        rows += [
            ("-", "Speculative decoding"),
            ("Drafts (verifications):", r["spec_num_drafts"]),
            ("Draft tokens:", r["spec_num_draft_tokens"]),
            ("Accepted draft tokens:", r["spec_num_accepted_tokens"]),
            ("Acceptance rate:", f"{r['spec_acceptance_rate']:.1%}"),
            ("Mean accepted length:", r["spec_mean_accepted_length"]),
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
    return "\n".join(lines)


def profile_breakdown(stats: Any, total: float) -> dict[str, float]:
    """Seconds per category from a ``pstats.Stats`` of a benchmark run (cumulative times)."""
    cum: dict[str, float] = {}
    wanted = {
        ("models/llama.py", "linear"),
        ("models/llama.py", "forward"),
        ("kernels/__init__.py", "paged_attention"),
        ("kernels/__init__.py", "write_kv"),
        ("engine/sampling.py", "sample"),
        ("engine/engine.py", "step"),
    }
    for (filename, _line, name), (_cc, _nc, _tt, ct, _callers) in stats.stats.items():
        parts = filename.replace(os.sep, "/").rsplit("/", 2)
        if ("/".join(parts[-2:]), name) in wanted:
            cum[name] = cum.get(name, 0.0) + ct
    g = cum.get
    mm, att, kv, fwd = g("linear", 0.0), g("paged_attention", 0.0), g("write_kv", 0.0), g("forward", 0.0)
    smp, step = g("sample", 0.0), g("step", 0.0)
    return {
        "weight matmuls": mm,
        "paged attention": att,
        "KV write": kv,
        "other model math (norm, RoPE, SiLU, embed)": max(0.0, fwd - mm - att - kv),
        "sampling": smp,
        "scheduling + engine bookkeeping": max(0.0, step - fwd - smp),
        "benchmark loop outside engine.step": max(0.0, total - step),
    }


def _table_columns(spec: str, weights: str) -> list[tuple[str, str]]:
    """``"numpy,fused:int8"`` -> ``[("numpy", weights), ("fused", "int8")]``."""
    from pagedkv_rs.models.llama import MODEL_IMPLS, WEIGHT_FORMATS

    cols = []
    for item in spec.split(","):
        impl, _, w = item.strip().partition(":")
        w = w or ("int8" if impl == "fused" else weights)
        if impl not in MODEL_IMPLS or w not in WEIGHT_FORMATS:
            raise SystemExit(f"--table-impls: {item!r} is not IMPL[:WEIGHTS] with IMPL in {MODEL_IMPLS}")
        cols.append((impl, w))
    return cols


def run_table(args: argparse.Namespace) -> dict[str, Any]:
    """Every (row, column) of the ``--table``, interleaved over the rounds; medians per cell."""
    from pagedkv_rs.cli.args import llm_from_args

    cols = _table_columns(args.table_impls, args.weights)
    seqs = [int(n) for n in args.table_seqs.split(",") if n.strip()]
    llms = []
    for impl, w in cols:
        # --act-digits applies to the int8 columns (float32 weights have no activation digits)
        digits = args.act_digits if w != "float32" else None
        a = argparse.Namespace(**{**vars(args), "model_impl": impl, "weights": w, "act_digits": digits})
        llm = llm_from_args(
            a,
            enable_prefix_caching=False,
            max_num_seqs=max(seqs + [args.max_num_seqs]),
            max_num_batched_tokens=max(args.max_num_batched_tokens, args.prefill_len),
        )
        run_benchmark(llm, [(list(range(100, 116)), 4)], progress=False)  # warm-up
        llms.append(llm)
    tok = llms[0].get_tokenizer()
    vocab, special = llms[0].model.vocab_size, sorted(tok.special_ids)
    rows: list[tuple[str, list[tuple[list[int], int]]]] = []
    for n in seqs:
        reqs = synthetic_requests(
            n, args.input_len, args.output_len, args.range_ratio, args.prefix_len, vocab, special, args.seed + n
        )
        rows.append((f"{n} seq" + ("s" if n > 1 else ""), reqs))
    if args.prefill_len:
        rows.append(
            (
                f"prefill {args.prefill_len}",
                synthetic_requests(1, args.prefill_len, 1, 0.0, 0, vocab, special, args.seed),
            )
        )
    import pagedkv_rs as pk

    probe = args.bandwidth_probe
    bandwidth: list[float] = []
    cells: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for _ in range(max(1, args.rounds)):
        if probe:
            bandwidth.append(pk.memory_bandwidth(probe))
        for ri, (_, reqs) in enumerate(rows):
            for ci, llm in enumerate(llms):
                cells.setdefault((ri, ci), []).append(run_benchmark(llm, reqs, progress=False))
    med = statistics.median
    table = []
    for ri, (name, _) in enumerate(rows):
        row = {"row": name, "cells": []}
        for ci in range(len(cols)):
            rs = cells[(ri, ci)]
            row["cells"].append(
                {
                    "output_throughput": med(r["output_throughput"] for r in rs),
                    "median_tpot_ms": med(r["median_tpot_ms"] for r in rs),
                    "mean_ttft_ms": med(r["mean_ttft_ms"] for r in rs),
                    "prefill_throughput": med(r["total_input_tokens"] / (r["mean_ttft_ms"] / 1e3) for r in rs),
                }
            )
        table.append(row)
    names = [f"{llm.model.impl}/{llm.weight_format}" for llm in llms]
    return {
        "columns": names,
        "rows": table,
        "rounds": max(1, args.rounds),
        "kernels": llms[0].engine.stats()["kernels"],
        "weight_bytes": [_decode_weight_bytes(llm.model) for llm in llms],
        "bandwidth_gbs": med(bandwidth) if bandwidth else None,
    }


def _probe_bytes(text: str) -> int:
    """``--bandwidth-probe``: a size like 1GiB, or 0 (no probe)."""
    from pagedkv_rs.units import parse_memory

    if text.strip() == "0":
        return 0
    try:
        return parse_memory(text, "--bandwidth-probe")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _decode_weight_bytes(model: Any) -> Optional[int]:
    """Bytes of the int8 matrices one decode step reads (every layer's and the output head), None for others."""
    mats = getattr(getattr(model, "weights", None), "act_matrices", dict)()
    return sum(q.nbytes for qs in mats.values() for q in qs) if mats else None


def format_table(t: dict[str, Any], args: argparse.Namespace) -> str:
    """One row per workload, one column per implementation, then each column's ratio to the first."""
    names = t["columns"]
    head = f"{'':<14}" + "".join(f"{n:>32}" for n in names) + "".join(f"{n + ' / ' + names[0]:>30}" for n in names[1:])
    title = (
        f" bench e2e: input {args.input_len}, output {args.output_len}, range {args.range_ratio}, "
        f"median of {t['rounds']} round(s) "
    )
    lines = [f"{title:=^{len(head)}}", head, "-" * len(head)]
    for row in t["rows"]:
        cs = row["cells"]
        if row["row"].startswith("prefill"):
            vals = [c["prefill_throughput"] for c in cs]
            txt = [f"{c['prefill_throughput']:.0f} tok/s (TTFT {c['mean_ttft_ms']:.0f} ms)" for c in cs]
        else:
            vals = [c["output_throughput"] for c in cs]
            txt = [f"{c['output_throughput']:.1f} tok/s (TPOT {c['median_tpot_ms']:.2f} ms)" for c in cs]
        ratios = [f"{v / vals[0]:.2f}x" if vals[0] else "n/a" for v in vals[1:]]
        lines.append(f"{row['row']:<14}" + "".join(f"{x:>32}" for x in txt) + "".join(f"{r:>30}" for r in ratios))
    lines.append("=" * len(head))
    lines.append(f"kernels: {t['kernels']}; output tok/s of the decode rows, prompt tok/s of the prefill row")
    one = next((r for r in t["rows"] if r["row"] == "1 seq"), None)
    for name, nbytes, c in zip(names, t["weight_bytes"], one["cells"] if one else ()):
        if nbytes is None or not c["median_tpot_ms"]:
            continue
        rate = nbytes / (c["median_tpot_ms"] / 1e3) / 1e9
        line = f"{name}: {nbytes / 1e6:.0f} MB of weights a decode step; 1 seq reads them at {rate:.1f} GB/s"
        if t["bandwidth_gbs"]:
            line += (
                f", {rate / t['bandwidth_gbs']:.2f} of the {t['bandwidth_gbs']:.1f} GB/s memory read bandwidth probed"
            )
        lines.append(line)
    return "\n".join(lines)


def run_spec_table(args: argparse.Namespace) -> dict[str, Any]:
    """Each ``--spec-rows`` row without and with speculation, interleaved over the rounds; medians per cell."""
    from pagedkv_rs.cli.args import llm_from_args
    from pagedkv_rs.engine.speculative import SpeculativeConfig

    spec = args.speculative or SpeculativeConfig()
    rows = []
    for item in args.spec_rows.split(","):
        w, _, n = item.strip().partition(":")
        if w not in WORKLOADS or not n.isdigit() or int(n) < 1:
            raise SystemExit(f"--spec-rows: {item!r} is not WORKLOAD:SEQS with WORKLOAD in {WORKLOADS}")
        rows.append((w, int(n)))
    llms = []
    for s in (None, spec):
        a = argparse.Namespace(**{**vars(args), "speculative": s})
        llm = llm_from_args(
            a,
            enable_prefix_caching=False,
            max_num_seqs=max([n for _, n in rows] + [args.max_num_seqs]),
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
        run_benchmark(llm, [(list(range(100, 116)), 4)], progress=False)  # warm-up
        llms.append(llm)
    reqs = [workload_requests(args, llms[0], w, n, args.seed + n) for w, n in rows]
    cells: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for _ in range(max(1, args.rounds)):
        for ri in range(len(rows)):
            for ci, llm in enumerate(llms):
                cells.setdefault((ri, ci), []).append(run_benchmark(llm, reqs[ri], progress=False))
    med = statistics.median
    table = []
    for ri, (w, n) in enumerate(rows):
        off, on = cells[(ri, 0)], cells[(ri, 1)]
        table.append(
            {
                "row": f"{w} {n}",
                "off_tok_s": med(r["output_throughput"] for r in off),
                "on_tok_s": med(r["output_throughput"] for r in on),
                # the ratio of each round's side-by-side pair, then the median
                "ratio": med(b["output_throughput"] / a["output_throughput"] for a, b in zip(off, on)),
                # decode alone (prefill is the same both ways): the pairs' median TPOT, off over on
                "decode_ratio": med(_tpot_ratio(a, b) for a, b in zip(off, on)),
                "acceptance_rate": med(r["spec_acceptance_rate"] for r in on),
                "mean_accepted_length": med(r["spec_mean_accepted_length"] for r in on),
                "drafting_share": med(r["spec_governed_on_share"] for r in on),
            }
        )
    return {"speculative": repr(spec), "rows": table, "rounds": max(1, args.rounds)}


def _tpot_ratio(off: dict[str, Any], on: dict[str, Any]) -> float:
    """How much faster ``on`` decodes than ``off``: their median TPOTs' ratio (0 where a side has none)."""
    return off["median_tpot_ms"] / on["median_tpot_ms"] if off["median_tpot_ms"] and on["median_tpot_ms"] else 0.0


def format_spec_table(t: dict[str, Any]) -> str:
    head = (
        f"{'':<12}{'off tok/s':>12}{'on tok/s':>12}{'on / off':>10}{'decode':>9}"
        f"{'accepted':>10}{'mean len':>10}{'drafting':>10}"
    )
    lines = [f"{' bench e2e --spec-table, median of ' + str(t['rounds']) + ' round(s) ':=^{len(head)}}", head]
    lines.append("-" * len(head))
    for r in t["rows"]:
        lines.append(
            f"{r['row']:<12}{r['off_tok_s']:>12.1f}{r['on_tok_s']:>12.1f}{r['ratio']:>9.2f}x{r['decode_ratio']:>8.2f}x"
            f"{r['acceptance_rate']:>10.1%}{r['mean_accepted_length']:>10.2f}{r['drafting_share']:>10.1%}"
        )
    lines.append("=" * len(head))
    lines.append(t["speculative"])
    lines.append("tok/s: output tokens over the whole run, prefill included;")
    lines.append("decode: median TPOT off / on, prefill left out; accepted: draft tokens accepted;")
    lines.append("mean len: tokens per verification; drafting: the share of decode steps the governor ran")
    lines.append("with drafts (each batch size in its faster mode)")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from pagedkv_rs.cli.args import llm_from_args

    if args.spec_table:
        t = run_spec_table(args)
        print(format_spec_table(t))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({**t, "config": {k: repr(v) for k, v in vars(args).items() if k != "json"}}, f, indent=2)
        return 0
    if args.table:
        t = run_table(args)
        print(format_table(t, args))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({**t, "config": {k: v for k, v in vars(args).items() if k != "json"}}, f, indent=2)
        return 0

    llm = llm_from_args(
        args,
        enable_prefix_caching=not args.no_prefix_caching,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    reqs = workload_requests(args, llm, args.workload, args.num_requests, args.seed)
    # warm-up: BLAS threads, kernel dispatch, first-touch of the KV pool
    run_benchmark(llm, [(reqs[0][0][::-1][:16], 4)], progress=False)
    if args.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        res = run_benchmark(llm, reqs, progress=not args.no_progress)
        prof.disable()
        total = time.perf_counter() - t
        res["profile_s"] = profile_breakdown(pstats.Stats(prof), total)
    else:
        res = run_benchmark(llm, reqs, progress=not args.no_progress)
    llm.shutdown()  # flushes what the KV tiers still have to write
    res["config"] = {k: v for k, v in vars(args).items() if k not in ("json", "kv_tier_secret")}
    if args.speculative is not None:
        res["config"]["speculative"] = repr(args.speculative)
    if llm.engine.kv_tiers is not None:
        res["kv_tiers"] = llm.engine.kv_tiers.stats()
    print(format_report(res))
    if "profile_s" in res:
        total = sum(res["profile_s"].values())
        print(f"{' Where the time goes (cProfile) ':-^60}")
        for k, v in res["profile_s"].items():
            print(f"{k + ':':<46}{v:7.2f} s {v / total:6.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
