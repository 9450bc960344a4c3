"""Linear-layer workloads of SmolLM2-135M: ``pagedkv_rs.QLinear`` (int8 blocks) vs numpy float32 sgemm.

Shared by ``benches/test_bench_linear.py`` (pytest-benchmark) and ``pagedkv bench linear``, which
prints per shape the time of the int8 kernel on each ISA asked (``--isa``, default the current
setting), of numpy's sgemm, GOP/s (``2·M·N·K`` per call, what the layer computes; the int8 kernel's
two activation digits do twice the integer work), the speed-up over numpy and, per M, the total of
one step's matmuls (30 layers + lm_head). Rounds are interleaved (every cell once per round, all
int8 cells before the float32 ones) and each cell's figure is the median over rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

import pagedkv_rs
from pagedkv_rs.cli.formatting import HelpFormatter

__all__ = ["SHAPES", "Shape", "build", "main", "shapes"]


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
_LM_HEAD = ("lm_head", 49152, 576)
LAYERS = 30


def shapes(ms: tuple[int, ...]) -> list[Shape]:
    """The layer's four products at every M, and lm_head at every M up to 128 (one row per sequence)."""
    out = [Shape(f"{name} M={m}", m, n, k) for m in ms for name, n, k in _LAYER]
    return out + [Shape(f"{_LM_HEAD[0]} M={m}", m, *_LM_HEAD[1:]) for m in ms if m <= 128]


# Decode (1, 8, 32 sequences), a batch of 128 and a 512-token prefill chunk.
SHAPES = shapes((1, 8, 32, 128, 512))


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


def build_q4(s: Shape, seed: int = 0) -> Callable[[], object]:
    """An int8 callable over 4-bit codes (as GGUF Q4_1 weights hold them) for one shape."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 16, (s.n, s.k), dtype=np.uint8)
    d = (rng.random((s.n, s.k // 32), dtype=np.float32) * 0.01).astype(np.float32)
    m = (-8 * d).astype(np.float32)
    q = pagedkv_rs.QLinear.from_parts(codes, d, m)
    x = rng.standard_normal((s.m, s.k)).astype(np.float32)
    out = np.empty((s.m, s.n), np.float32)
    return lambda: q(x, out=out)


class _Cell:
    """One timed callable: calls per sample fixed at warm-up so a sample lasts >= ~2 ms."""

    def __init__(self, fn: Callable[[], object], isa: str | None):
        self.fn, self.isa, self.samples = fn, isa, []
        with _isa(isa):
            fn()
            t = time.perf_counter()
            fn()
            self.reps = max(1, int(2e-3 / max(time.perf_counter() - t, 1e-7)))

    def sample(self) -> None:
        with _isa(self.isa):
            self.fn()
            t = time.perf_counter()
            for _ in range(self.reps):
                self.fn()
            self.samples.append((time.perf_counter() - t) / self.reps)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)


class _isa:
    def __init__(self, name: str | None):
        self.name = name

    def __enter__(self) -> None:
        if self.name is not None:
            self.prev = pagedkv_rs.get_isa()
            pagedkv_rs.set_isa(self.name)

    def __exit__(self, *exc: object) -> None:
        if self.name is not None:
            pagedkv_rs.set_isa(self.prev)


def _ms(text: str) -> tuple[int, ...]:
    try:
        ms = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--m wants comma-separated integers, got {text!r}") from None
    if not ms or min(ms) < 1:
        raise argparse.ArgumentTypeError(f"--m wants positive integers, got {text!r}")
    return ms


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        formatter_class=HelpFormatter, prog="pagedkv bench linear", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds; figures are medians (default 7)")
    p.add_argument("--m", type=_ms, default=(1, 8, 32, 128), help="tokens per step, e.g. 1,8,32,128 (default)")
    p.add_argument(
        "--isa",
        action="append",
        default=None,
        help="time the int8 kernel with this ISA forced (repeatable; default: the current setting)",
    )
    p.add_argument("--q4", action="store_true", help="also time 4-bit codes (GGUF Q4_1 weights)")
    p.add_argument(
        "--threads", type=int, default=None, help="kernel threads (default: all cores; numpy's: OPENBLAS_NUM_THREADS)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.threads is not None:
        pagedkv_rs.set_num_threads(args.threads)
    if pagedkv_rs.build_profile() != "release":
        print("pagedkv bench linear needs a release build (pip install . / maturin develop --release)")
        return 2
    isas = args.isa or [None]
    info = pagedkv_rs.kernel_info()
    names = []
    for isa in isas:
        with _isa(isa):
            names.append(pagedkv_rs.kernel_info()["linear_isa"])
    fma = pagedkv_rs.fma_peak(0.3)
    print(
        f"linear ISA {info['linear_isa']}, {info['num_threads']} threads; FMA probe {fma:.0f} GFLOP/s; "
        f"int8 rows: {', '.join(names)}; {args.rounds} interleaved rounds, medians"
    )
    todo = shapes(args.m)
    built = [build(s) for s in todo]
    cols = [(f"{b} ms", [_Cell(fq, isa) for fq, _ in built]) for isa, b in zip(isas, names)]
    if args.q4:
        cols += [(f"{b} q4", [_Cell(build_q4(s), isa) for s in todo]) for isa, b in zip(isas, names)]
    f32 = [_Cell(ff, None) for _, ff in built]
    # All int8 cells first, then the float32 ones, in every round: OpenBLAS's worker keeps
    # spinning for a while after each sgemm and would steal a core from the int8 kernel after it.
    for _ in range(args.rounds):
        for _, cells in cols:
            for c in cells:
                c.sample()
        for c in f32:
            c.sample()
    head = "".join(f"{name:>12}" for name, _ in cols)
    print(f"{'shape':<10}{'M':>5}{'N':>7}{'K':>6}{head}{'GOP/s':>7}{'f32 ms':>10}{'GFLOP/s':>8}{'x f32':>7}")
    for i, s in enumerate(todo):
        t = [cells[i].median for _, cells in cols]
        b = f32[i].median
        print(
            f"{s.name.split()[0]:<10}{s.m:>5}{s.n:>7}{s.k:>6}"
            + "".join(f"{v * 1e3:>12.4f}" for v in t)
            + f"{s.ops / t[0] / 1e9:>7.0f}{b * 1e3:>10.4f}{s.ops / b / 1e9:>8.0f}{b / t[0]:>7.2f}"
        )
    for m in args.m:
        rows = [i for i, s in enumerate(todo) if s.m == m]
        reps = [1 if todo[i].name.startswith("lm_head") else LAYERS for i in rows]
        step = [sum(r * cells[i].median for r, i in zip(reps, rows)) for _, cells in cols]
        step_f = sum(r * f32[i].median for r, i in zip(reps, rows))
        parts = ", ".join(f"{name.split()[0]} {v * 1e3:.2f} ms ({step_f / v:.2f}x)" for (name, _), v in zip(cols, step))
        lm = "30 layers + lm_head" if m <= 128 else "30 layers"
        print(f"one decode step's matmuls ({lm}, M={m}): float32 {step_f * 1e3:.2f} ms; int8 {parts}")
    return 0
