"""Trace replay to size a KV cache: paged blocks vs contiguous max-length reservation.

A synthetic chat-like trace (log-normal prompt and output lengths, Poisson arrivals) runs through
the real ``Scheduler`` and ``KVCacheManager``; the "model" is a cost model (no weights):
``step_time = fixed + per_token * batched_tokens + per_kv_token * attended_kv_tokens``.
Contiguous reservation is the same machinery with one block of ``max_model_len`` slots per
sequence (what systems without paging reserve). Reported per configuration: max and mean
concurrent sequences, KV waste (allocated slots not holding a token, averaged over steps),
preemptions, throughput and latency in simulated time.

``pagedkv simulate --help`` lists the knobs; ``simulate(...)`` is the programmatic entry point.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Optional

import numpy as np

from pagedkv_rs._backend import backend as allocator_backend
from pagedkv_rs.cli.formatting import HelpFormatter
from pagedkv_rs.engine.request import SamplingParams
from pagedkv_rs.engine.scheduler import Scheduler, SchedulerConfig

__all__ = ["Trace", "make_trace", "replay", "simulate", "main"]


@dataclass(frozen=True)
class Trace:
    arrivals: np.ndarray  # float64 [N] seconds, nondecreasing
    prompt_lens: np.ndarray  # int64 [N]
    output_lens: np.ndarray  # int64 [N]


@dataclass(frozen=True)
class CostModel:
    fixed_s: float = 0.004
    per_token_s: float = 0.0001
    per_kv_token_s: float = 2e-7

    def step_time(self, num_tokens: int, kv_tokens: int) -> float:
        return self.fixed_s + self.per_token_s * num_tokens + self.per_kv_token_s * kv_tokens


def make_trace(
    num_requests: int,
    rate: float,
    *,
    prompt_median: float = 256,
    output_median: float = 128,
    sigma: float = 0.8,
    max_model_len: int = 2048,
    seed: int = 0,
) -> Trace:
    """Poisson arrivals at ``rate`` req/s; log-normal lengths, clipped to fit ``max_model_len``."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, num_requests))
    prompt = np.clip(np.rint(rng.lognormal(math.log(prompt_median), sigma, num_requests)), 1, max_model_len - 1)
    output = np.rint(rng.lognormal(math.log(output_median), sigma, num_requests))
    output = np.clip(output, 1, max_model_len - prompt)
    return Trace(arrivals, prompt.astype(np.int64), output.astype(np.int64))


@dataclass
class ReplayResult:
    layout: str
    block_size: int
    num_blocks: int
    kv_tokens: int
    max_concurrent: int
    mean_concurrent: float
    kv_waste: float
    preemptions: int
    steps: int
    makespan_s: float
    throughput_tok_s: float
    mean_ttft_s: float


def replay(
    trace: Trace,
    *,
    kv_tokens: int,
    block_size: int,
    contiguous: bool = False,
    max_model_len: int = 2048,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 2048,
    preemption_mode: str = "recompute",
    cost: CostModel = CostModel(),  # noqa: B008 - frozen dataclass, safe to share
    backend: Any = "auto",
) -> ReplayResult:
    """Replay ``trace`` on a pool of ``kv_tokens`` slots; ``contiguous`` reserves max_model_len per sequence."""
    mgr_cls = allocator_backend(backend).KVCacheManager if isinstance(backend, str) else backend.KVCacheManager
    bs = max_model_len if contiguous else block_size
    num_blocks = kv_tokens // bs
    if num_blocks < 1:
        raise ValueError(f"{kv_tokens} KV tokens hold no block of {bs} slots")
    kv = mgr_cls(num_blocks, bs, enable_prefix_caching=False)
    cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        preemption_mode=preemption_mode,
        max_model_len=max_model_len,
    )
    sched = Scheduler(kv, cfg)
    n = len(trace.arrivals)
    clock, nxt, steps, out_tokens = 0.0, 0, 0, 0
    max_conc, conc_sum, used_sum, alloc_sum = 0, 0, 0, 0
    ttft: list[float] = []
    while nxt < n or sched.has_unfinished_requests():
        if not sched.has_unfinished_requests() and trace.arrivals[nxt] > clock:
            clock = float(trace.arrivals[nxt])
        while nxt < n and trace.arrivals[nxt] <= clock:
            p, o = int(trace.prompt_lens[nxt]), int(trace.output_lens[nxt])
            prompt = [(nxt * 131 + j) % 30000 + 1 for j in range(min(p, sched.max_model_len))]
            sched.add_request(
                str(nxt), prompt, SamplingParams(max_tokens=o, ignore_eos=True), arrival_time=float(trace.arrivals[nxt])
            )
            nxt += 1
        so = sched.schedule()
        if so is None:
            raise RuntimeError(f"simulation stalled at t={clock:.3f}s: {sched.stats()}")
        steps += 1
        held = sum(r.num_kv_tokens for r in sched.running)
        alloc = kv.num_live_blocks * bs
        used_sum += held
        alloc_sum += alloc
        max_conc = max(max_conc, len(sched.running))
        conc_sum += len(sched.running)
        clock += cost.step_time(so.num_tokens, int(so.batch.seq_lens.sum()))
        for r in sched.update_from_output(so, [0] * len(so.sample_rows)):
            out_tokens += 1
            if len(r.output_token_ids) == 1:
                ttft.append(clock - r.metrics.arrival_time)
    return ReplayResult(
        layout="contiguous" if contiguous else "paged",
        block_size=bs,
        num_blocks=num_blocks,
        kv_tokens=num_blocks * bs,
        max_concurrent=max_conc,
        mean_concurrent=conc_sum / max(steps, 1),
        kv_waste=1.0 - used_sum / alloc_sum if alloc_sum else 0.0,
        preemptions=sched.num_preemptions,
        steps=steps,
        makespan_s=clock,
        throughput_tok_s=out_tokens / clock if clock else 0.0,
        mean_ttft_s=float(np.mean(ttft)) if ttft else 0.0,
    )


def simulate(
    trace: Trace,
    *,
    kv_tokens: int,
    block_sizes: Sequence[int] = (8, 16, 32, 64, 128),
    **kwargs: Any,
) -> list[ReplayResult]:
    """Contiguous reservation first, then paged with each block size."""
    rows = [replay(trace, kv_tokens=kv_tokens, block_size=0, contiguous=True, **kwargs)]
    rows += [replay(trace, kv_tokens=kv_tokens, block_size=b, **kwargs) for b in block_sizes]
    return rows


def _table(rows: list[ReplayResult]) -> str:
    head = (
        f"{'layout':<11}{'block':>6}{'blocks':>8}{'max seqs':>10}{'mean seqs':>11}{'KV waste':>10}"
        f"{'preempt':>9}{'tok/s':>9}{'TTFT s':>9}{'makespan s':>12}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.layout:<11}{r.block_size:>6}{r.num_blocks:>8}{r.max_concurrent:>10}{r.mean_concurrent:>11.1f}"
            f"{r.kv_waste:>9.1%}{r.preemptions:>9}{r.throughput_tok_s:>9.0f}{r.mean_ttft_s:>9.2f}{r.makespan_s:>12.1f}"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="pagedkv simulate",
        description="Replay a synthetic chat trace through the scheduler with a cost model, to size a KV cache: "
        "paged blocks of several sizes vs a contiguous max-length reservation per sequence.",
    )
    ap.add_argument("--num-requests", type=int, default=500, help="requests in the trace")
    ap.add_argument("--rate", type=float, default=32.0, help="Poisson arrival rate, requests/s (default 32)")
    ap.add_argument("--prompt-median", type=float, default=256, help="median prompt length in tokens (log-normal)")
    ap.add_argument("--output-median", type=float, default=128, help="median output length in tokens (log-normal)")
    ap.add_argument("--sigma", type=float, default=0.8, help="log-normal sigma of both lengths")
    ap.add_argument("--max-model-len", type=int, default=2048, help="longest sequence in tokens")
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--kv-tokens", type=int, help="KV capacity in tokens (default 32768)")
    size.add_argument(
        "--kv-gib",
        type=float,
        help="KV memory in GiB; tokens = GiB / bytes per token (model dims; default: --kv-tokens)",
    )
    ap.add_argument("--num-layers", type=int, default=30, help="model dims for --kv-gib (default SmolLM2-135M)")
    ap.add_argument("--num-kv-heads", type=int, default=3, help="model dims for --kv-gib")
    ap.add_argument("--head-dim", type=int, default=64, help="model dims for --kv-gib")
    ap.add_argument("--dtype-bytes", type=int, default=2, help="bytes per KV element (2 = float16)")
    ap.add_argument("--block-sizes", default="8,16,32,64,128", help="comma-separated paged block sizes")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="requests in one step at most")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens in one step at most")
    ap.add_argument(
        "--preemption", choices=("recompute", "swap"), default="recompute", help="what a preempted request loses"
    )
    ap.add_argument("--backend", default="auto", help="allocator backend: auto, rust or python")
    ap.add_argument("--seed", type=int, default=0, help="seed of the trace")
    ap.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    bytes_per_token = 2 * a.num_layers * a.num_kv_heads * a.head_dim * a.dtype_bytes
    if a.kv_gib is not None:
        kv_tokens = int(a.kv_gib * (1 << 30) // bytes_per_token)
    else:
        kv_tokens = a.kv_tokens if a.kv_tokens is not None else 32768
    try:
        block_sizes = [int(b) for b in a.block_sizes.split(",") if b.strip()]
    except ValueError:
        ap.error(f"--block-sizes must be comma-separated ints, got {a.block_sizes!r}")
    if kv_tokens < a.max_model_len:
        ap.error(f"KV capacity of {kv_tokens} tokens is below --max-model-len {a.max_model_len}")
    trace = make_trace(
        a.num_requests,
        a.rate,
        prompt_median=a.prompt_median,
        output_median=a.output_median,
        sigma=a.sigma,
        max_model_len=a.max_model_len,
        seed=a.seed,
    )
    rows = simulate(
        trace,
        kv_tokens=kv_tokens,
        block_sizes=block_sizes,
        max_model_len=a.max_model_len,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        preemption_mode=a.preemption,
        backend=a.backend,
    )
    if a.json:
        print(json.dumps([asdict(r) for r in rows], indent=2))
        return 0
    gib = kv_tokens * bytes_per_token / (1 << 30)
    print(
        f"trace: {a.num_requests} requests at {a.rate}/s, prompt median {a.prompt_median:g}, "
        f"output median {a.output_median:g}, max_model_len {a.max_model_len}"
    )
    print(f"KV pool: {kv_tokens} tokens = {gib:.2f} GiB at {bytes_per_token} bytes/token\n")
    print(_table(rows))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
