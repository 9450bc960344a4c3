"""Allocator / block-table workloads, shared by ``benches/`` (pytest-benchmark) and ``pagedkv bench alloc``.

Each workload builds its state once per backend and returns the callable to time; it is timed for a
fixed number of rounds (the decode step grows its sequences by one token per round, so the pool is sized
for that many rounds).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import pagedkv_rs
from pagedkv_rs.cli.formatting import HelpFormatter

Workload = Callable[[object], Callable[[], object]]


def alloc_free_churn(be) -> Callable[[], object]:
    """Allocate and free 32 blocks, 64 times, on a 4,096-block pool."""
    a = be.BlockAllocator(4096, 16)

    def run() -> None:
        for _ in range(64):
            a.free(a.allocate(32))

    return run


def decode_step_256(be) -> Callable[[], object]:
    """One decode step of bookkeeping: 256 running sequences (~1k tokens) append a token, then the
    step's padded tables + CSR + slot mapping are built."""
    m = be.KVCacheManager(40_000, 16)  # room for ROUNDS + warm-up steps
    ids = list(range(256))
    for s in ids:
        m.allocate(s, [s % 97] * (1000 + s % 48))
    m.prepare_batch(ids, [m.num_tokens(s) for s in ids])
    tokens = [7] * 256
    ones = [1] * 256

    def run() -> object:
        m.append_batch(ids, tokens)
        return m.prepare_batch(ids, ones)

    return run


def export_256x2048(be) -> Callable[[], object]:
    """Export block tables (padded + CSR) for 256 sequences of 2,048 tokens."""
    m = be.KVCacheManager(256 * 128, 16)
    ids = list(range(256))
    for s in ids:
        m.allocate(s, [s] * 2048)

    def run() -> object:
        return m.prepare_batch(ids)

    return run


def prefix_lookup_4096(be) -> Callable[[], object]:
    """Prefix lookup (hash + verify, 256 blocks) of a 4,096-token prompt whose prefix is cached."""
    m = be.KVCacheManager(1024, 16)
    prompt = [(i * 7919) % 32000 for i in range(4096)]
    m.allocate(0, prompt)
    m.prepare_batch([0], [4096])
    m.free(0)

    def run() -> object:
        return m.blocks_needed(prompt)

    return run


WORKLOADS: dict[str, Workload] = {
    "alloc-free-churn": alloc_free_churn,
    "decode-step-256": decode_step_256,
    "export-256x2048": export_256x2048,
    "prefix-lookup-4096": prefix_lookup_4096,
}
ROUNDS = {"alloc-free-churn": 300, "decode-step-256": 1000, "export-256x2048": 300, "prefix-lookup-4096": 300}
WARMUP = 5


def median_seconds(fn: Callable[[], object], rounds: int) -> float:
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(formatter_class=HelpFormatter, prog="pagedkv bench alloc", description=__doc__)
    p.add_argument("--quick", action="store_true", help="a tenth of the rounds (smoke run)")
    p.add_argument(
        "--workload", choices=sorted(WORKLOADS), action="append", help="run only these (repeatable; default: all)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    names = args.workload or list(WORKLOADS)
    rounds = {n: max(5, r // 10) if args.quick else r for n, r in ROUNDS.items()}
    backends = pagedkv_rs.BACKENDS
    if "rust" in backends and pagedkv_rs._core.build_profile() != "release":
        print("warning: the Rust core is a debug build; figures are not representative")
    header = f"{'workload':<22}" + "".join(f"{b + ' median':>16}" for b in backends)
    print(header + (f"{'python/rust':>13}" if len(backends) == 2 else ""))
    for name in names:
        med = {b: median_seconds(WORKLOADS[name](pagedkv_rs.backend(b)), rounds[name]) for b in backends}
        row = f"{name:<22}" + "".join(f"{med[b] * 1e6:>13.1f} us" for b in backends)
        if len(backends) == 2:
            row += f"{med['python'] / med['rust']:>12.1f}x"
        print(row, flush=True)
    return 0
