"""Linear-layer workloads of SmolLM2-135M: ``pagedkv_rs.QLinear`` (int8 blocks) vs numpy float32 sgemm.

Shared by ``benches/test_bench_linear.py`` (pytest-benchmark) and ``pagedkv bench linear``, which
prints per shape the time of each, GOP/s (``2·M·N·K`` per call, what the layer computes; the int8
kernel's two activation digits do twice the integer work), the speed-up over numpy and, for the
whole model's matmuls of one decode step, the fraction of an int8 ``vpdpbusd`` peak estimated from
the same run's FMA probe (one 512-bit ``vpdpbusd`` does 4x the multiply-adds of one FMA).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

import pagedkv_rs

__all__ = ["SHAPES", "Shape", "build", "main"]


@dataclass(frozen=True)
class Shape:
    name: str
    m: int  # tokens in the step
    n: int  # output features
    k: int  # input features

    @property
    def ops(self) -> int:
        return 2 * self.m * self.n * self.k


# SmolLM2-135M: hidden 576, 9+3+3 heads x 64 fused QKV, FFN 1536 (gate+up fused), vocab 49152 (tied).
_LAYER = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536)]
SHAPES = [Shape(f"{name} M={m}", m, n, k) for m in (32, 512) for name, n, k in _LAYER] + [
    Shape("lm_head M=32", 32, 49152, 576)
]


def build(s: Shape, seed: int = 0) -> tuple[Callable[[], object], Callable[[], object]]:
    """``(int8, float32)`` callables computing ``x @ W.T`` for one shape (same W, same x)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((s.n, s.k)) * 0.05).astype(np.float32)
    x = rng.standard_normal((s.m, s.k)).astype(np.float32)
    q = pagedkv_rs.QLinear.from_float(w)
    wt = np.ascontiguousarray(w.T)
    out_q = np.empty((s.m, s.n), np.float32)
    out_f = np.empty((s.m, s.n), np.float32)
    return (lambda: q(x, out=out_q)), (lambda: np.matmul(x, wt, out=out_f))


def _time(fn: Callable[[], object], rounds: int) -> float:
    fn()
    ts = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pagedkv bench linear", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args(argv)
    if pagedkv_rs.build_profile() != "release":
        print("pagedkv bench linear needs a release build (pip install . / maturin develop --release)")
        return 2
    info = pagedkv_rs.kernel_info()
    fma = pagedkv_rs.fma_peak(0.3)
    print(
        f"linear ISA {info['linear_isa']}, {info['num_threads']} threads; FMA probe {fma:.0f} GFLOP/s "
        f"(int8 vpdpbusd peak ~{4 * fma:.0f} GOP/s)"
    )
    print(f"{'shape':<16}{'M':>6}{'N':>7}{'K':>6}{'int8 ms':>10}{'GOP/s':>8}{'f32 ms':>10}{'GFLOP/s':>9}{'x f32':>7}")
    # All int8 rows first, then all float32 ones: OpenBLAS's worker keeps spinning for a while
    # after each sgemm and would steal a core from the int8 kernel timed right after it.
    built = [build(s) for s in SHAPES]
    tq = [_time(fq, args.rounds) for fq, _ in built]
    tf = [_time(ff, args.rounds) for _, ff in built]
    step_q = step_f = 0.0
    for s, a, b in zip(SHAPES, tq, tf):
        print(
            f"{s.name.split()[0]:<16}{s.m:>6}{s.n:>7}{s.k:>6}{a * 1e3:>10.3f}{s.ops / a / 1e9:>8.0f}"
            f"{b * 1e3:>10.3f}{s.ops / b / 1e9:>9.0f}{b / a:>7.2f}"
        )
        if s.m == 32:
            reps = 1 if s.name.startswith("lm_head") else 30
            step_q += reps * a
            step_f += reps * b
    ops = 30 * sum(2 * 32 * n * k for _, n, k in _LAYER) + 2 * 32 * 49152 * 576
    print(
        f"one decode step's matmuls (30 layers + lm_head, M=32): int8 {step_q * 1e3:.1f} ms "
        f"({ops / step_q / 1e9:.0f} GOP/s, {2 * ops / step_q / 1e9 / (4 * fma):.2f} of the int8 peak counting "
        f"both digits), float32 {step_f * 1e3:.1f} ms: {step_f / step_q:.2f}x"
    )
    return 0
