"""``pagedkv bench kernel``: paged-attention speed against this machine's own limits.

For each config: best time of the Rust SIMD kernel, effective GB/s of K+V read, that as a fraction
of ``memory_bandwidth()`` measured in the same run, and the speed-up over a numpy gather+matmul
reference run in the same process (and the forced-scalar Rust kernel). Prefill reports GFLOP/s
and its fraction of ``fma_peak()``. Every pool exceeds the 32 MiB L3 except Prefill's, which
is compute-bound, and Verify's (a speculative step's verification: one sequence, 3 rows). Block
ids are a random permutation, as a long-running server's would be.
``--resident`` adds, for decode configs, the time of the same calls with every table confined to
a few blocks (the same work with K/V in cache: the kernel's compute alone) and how much of it the
DRAM-bound run hid under its memory time.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from pagedkv_rs.cli.formatting import HelpFormatter

__all__ = ["Config", "CONFIGS", "NUMPY_CHUNK", "RESIDENT_BYTES", "build", "numpy_attention", "resident", "main"]


@dataclass(frozen=True)
class Config:
    name: str
    batch: int
    seq_len: int
    hq: int
    hkv: int
    d: int
    dtype: str
    q_len: int = 1  # rows per sequence (decode = 1)
    layers: int = 1  # separate caches, one call each (a decode step of a whole model)
    block_size: int = 16
    targets: dict = field(default_factory=dict, compare=False)

    @property
    def kv_bytes(self) -> int:
        """K+V bytes one call sequence reads (all layers)."""
        item = 4 if self.dtype == "float32" else 2
        return 2 * self.layers * self.batch * self.seq_len * self.hkv * self.d * item

    @property
    def flops(self) -> float:
        """QK and PV multiply-adds (2 flops each) over the causal pairs, all layers."""
        L, q = self.seq_len, self.q_len
        pairs = sum(L - q + 1 + i for i in range(q))
        return 4.0 * self.layers * self.batch * pairs * self.hq * self.d


CONFIGS = [
    Config("A", 32, 1024, 32, 8, 128, "float16", targets={"bw": 0.85, "numpy": 30}),
    Config("A", 32, 1024, 32, 8, 128, "float32", targets={"bw": 0.85, "numpy": 30}),
    Config("Long", 1, 32768, 32, 8, 128, "float16", targets={"bw": 0.75}),
    Config("SmolLM2", 32, 512, 9, 3, 64, "float16", layers=30),
    Config("SmolLM2", 32, 512, 9, 3, 64, "float32", layers=30),
    Config("Prefill", 1, 2048, 32, 8, 128, "float16", q_len=2048, targets={"fma": 0.5}),
    # a speculative step's verification: one sequence, its pending token and two drafts
    Config("Verify", 1, 700, 9, 3, 64, "float16", q_len=3, layers=30),
]


def quick(c: Config) -> Config:
    """A smaller version (still > L3 for the decode configs where it matters less)."""
    scale = {
        "A": dict(batch=8),
        "Long": dict(seq_len=8192),
        "SmolLM2": dict(layers=4),
        "Prefill": dict(seq_len=512, q_len=512),
        "Verify": dict(layers=4),
    }[c.name]
    return Config(**{**c.__dict__, **scale})


def tiny(c: Config) -> Config:
    """A smoke-test version of every config (seconds in all; the figures mean nothing)."""
    return Config(
        **{**c.__dict__, "batch": min(c.batch, 2), "seq_len": min(c.seq_len, 300), "q_len": min(c.q_len, 300)}
        | {"layers": min(c.layers, 2)}
    )


Layer = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def build(c: Config, seed: int = 0) -> list[Layer]:
    """Per layer ``(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)``."""
    import pagedkv_rs as pk

    rng = np.random.default_rng(seed)
    nblk = -(-c.seq_len // c.block_size)
    num_blocks = c.batch * nblk
    layers: list[Layer] = []
    for _ in range(c.layers):
        k, v = pk.new_kv_cache(num_blocks, c.block_size, c.hkv, c.d, c.dtype)
        k[...] = rng.standard_normal(k.shape, dtype=np.float32).astype(k.dtype)
        v[...] = rng.standard_normal(v.shape, dtype=np.float32).astype(v.dtype)
        tables = rng.permutation(num_blocks).astype(np.int32).reshape(c.batch, nblk)
        seq_lens = np.full(c.batch, c.seq_len, np.int32)
        qsl = (np.arange(c.batch + 1) * c.q_len).astype(np.int32)
        q = rng.standard_normal((c.batch * c.q_len, c.hq, c.d), dtype=np.float32)
        layers.append((q, k, v, tables, seq_lens, qsl))
    return layers


RESIDENT_BYTES = 256 << 10  # K+V bytes a `--resident` table touches per layer (fits a core's L2)


def resident(layers: list[Layer]) -> list[Layer]:
    """The same calls with each table's ids taken modulo a few blocks: same work, cache-resident K/V."""
    out = []
    for q, k, v, tables, seq_lens, qsl in layers:
        n = max(1, RESIDENT_BYTES // (2 * k[0].nbytes))
        out.append((q, k, v, (tables % n).astype(np.int32), seq_lens, qsl))
    return out


NUMPY_CHUNK = 128  # query rows per numpy matmul: each chunk reads only the keys it can see


def numpy_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out=None):
    """The obvious numpy way: gather each sequence's blocks, float32 matmul, masked softmax.

    Causal work, like the kernel's: query rows go in chunks of ``NUMPY_CHUNK``, each over the keys up
    to its last row (a full L x L score matrix would do about twice the FLOPs the Prefill row counts).
    """
    _, hkv, bs, d = k_cache.shape
    hq = q.shape[1]
    g = hq // hkv
    out = np.empty(q.shape, np.float32) if out is None else out
    scale = np.float32(1 / math.sqrt(d))
    for i in range(len(seq_lens)):
        L = int(seq_lens[i])
        lo, hi = int(query_start_loc[i]), int(query_start_loc[i + 1])
        nq = hi - lo
        if nq == 0:
            continue
        blocks = block_tables[i, : -(-L // bs)]
        k = k_cache[blocks].transpose(1, 0, 2, 3).reshape(hkv, -1, d)[:, :L].astype(np.float32)
        v = v_cache[blocks].transpose(1, 0, 2, 3).reshape(hkv, -1, d)[:, :L].astype(np.float32)
        for c0 in range(0, nq, NUMPY_CHUNK):
            c1 = min(c0 + NUMPY_CHUNK, nq)
            n, S = c1 - c0, L - nq + c1  # rows in this chunk; keys the last of them sees
            qi = q[lo + c0 : lo + c1].reshape(n, hkv, g, d).transpose(1, 2, 0, 3).reshape(hkv, g * n, d)
            s = np.matmul(qi, k[:, :S].transpose(0, 2, 1)) * scale  # [hkv, g*n, S]
            if n > 1:
                qpos = np.tile(np.arange(S - n, S), g)[:, None]
                s = np.where(np.arange(S)[None, :] <= qpos, s, -np.inf)
            s = np.exp(s - s.max(-1, keepdims=True))
            s /= s.sum(-1, keepdims=True)
            o = np.matmul(s, v[:, :S]).reshape(hkv, g, n, d).transpose(2, 0, 1, 3)
            out[lo + c0 : lo + c1] = o.reshape(n, hq, d)
    return out


def best_time(fn: Callable[[], object], repeat: int, min_time: float = 0.0) -> float:
    fn()  # warm-up
    best = math.inf
    t_end = time.perf_counter() + min_time
    for i in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        if i + 1 >= repeat and time.perf_counter() >= t_end:
            break
    return best


def run_config(
    c: Config,
    probe: Callable[[], float],
    fma: float,
    repeat: int,
    scalar: bool,
    numpy_ref: bool,
    rounds: int = 1,
    resident_row: bool = False,
) -> dict:
    """One config's row. ``rounds`` times: ``probe()`` (the DRAM read bandwidth, GB/s) next to the
    kernel's best of ``repeat``; the row gives the medians, and ``bw_frac`` is the median of the
    per-round ratios (a shared machine's bandwidth can move 2x between single probes)."""
    import pagedkv_rs as pk

    layers = build(c)
    outs = [np.empty(x[0].shape, np.float32) for x in layers]

    def rust():
        for x, o in zip(layers, outs):
            pk.paged_attention(*x, out=o)

    row: dict = {"config": c.name, "dtype": c.dtype, "kv_MiB": c.kv_bytes / 2**20}
    times, bws = [], []
    for _ in range(rounds):
        bws.append(probe())
        times.append(best_time(rust, repeat))
    t = statistics.median(times)
    row["rounds"] = rounds
    row["time_ms"] = t * 1e3
    row["GBps"] = c.kv_bytes / t / 1e9
    row["bw_GBps"] = statistics.median(bws)
    row["bw_frac"] = statistics.median(c.kv_bytes / ti / 1e9 / b for ti, b in zip(times, bws))
    row["bw_frac_range"] = (
        min(c.kv_bytes / ti / 1e9 / b for ti, b in zip(times, bws)),
        max(c.kv_bytes / ti / 1e9 / b for ti, b in zip(times, bws)),
    )
    row["GFLOPs"] = c.flops / t / 1e9
    row["fma_frac"] = row["GFLOPs"] / fma
    if resident_row and c.q_len == 1:
        res = resident(layers)
        tr = best_time(lambda: [pk.paged_attention(*x, out=o) for x, o in zip(res, outs)], repeat)
        mem = c.kv_bytes / (row["bw_GBps"] * 1e9)
        row["resident_ms"] = tr * 1e3
        # 0: time = compute + memory (nothing hidden); 1: time = max(compute, memory).
        row["overlap"] = (tr + mem - t) / min(tr, mem)
    if scalar and c.q_len == 1:  # the scalar path on a 2k-token prefill takes tens of seconds
        prev = pk.get_isa()
        pk.set_isa("scalar")
        try:
            row["scalar_ms"] = best_time(rust, 1) * 1e3
        finally:
            pk.set_isa(prev)
    if numpy_ref:
        row["numpy_ms"] = best_time(lambda: [numpy_attention(*x, out=o) for x, o in zip(layers, outs)], 1) * 1e3
        row["vs_numpy"] = row["numpy_ms"] / row["time_ms"]
    return row


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        formatter_class=HelpFormatter, prog="pagedkv bench kernel", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--quick", action="store_true", help="smaller configs and bandwidth buffer (smoke run)")
    ap.add_argument("--tiny", action="store_true", help="tiny configs, short probes: a smoke test of the command")
    ap.add_argument("--threads", type=int, default=None, help="kernel threads (default: all cores)")
    ap.add_argument(
        "--repeat", type=int, default=None, help="timed repeats per config, best kept (default: 5, --quick 2, --tiny 1)"
    )
    ap.add_argument(
        "--only", default=None, help="comma-separated config names: A,Long,SmolLM2,Prefill,Verify (default: all)"
    )
    ap.add_argument("--block-size", type=int, default=16, help="tokens per cache block (default 16, vLLM's)")
    ap.add_argument("--no-scalar", action="store_true", help="skip the forced-scalar rows")
    ap.add_argument("--no-numpy", action="store_true", help="skip the numpy gather+matmul rows")
    ap.add_argument(
        "--resident",
        action="store_true",
        help="decode configs: also time the same work with K/V in cache, and the overlap of compute and memory",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="bandwidth probe + kernel timing pairs per config; medians are reported (default 5, --quick 2, --tiny 1)",
    )
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    import pagedkv_rs as pk

    ap = build_parser()
    args = ap.parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        ap.error("--rounds must be >= 1")

    if pk.build_profile() != "release":
        ap.error("the compiled core is a debug build: rebuild with `maturin develop --release`")
    if args.threads is not None:
        pk.set_num_threads(args.threads)
    threads = pk.get_num_threads()
    repeat = args.repeat or (1 if args.tiny else 2 if args.quick else 5)
    configs = [tiny(c) if args.tiny else quick(c) if args.quick else c for c in CONFIGS]
    configs = [Config(**{**c.__dict__, "block_size": args.block_size}) for c in configs]
    if args.only:
        names = {n.strip() for n in args.only.split(",")}
        configs = [c for c in configs if c.name in names]

    info = pk.kernel_info()
    rounds = args.rounds or (1 if args.tiny else 2 if args.quick else 5)
    probe_bytes = 1 << (24 if args.tiny else 28 if args.quick else 30)
    bws: list[float] = []

    def probe() -> float:
        bws.append(pk.memory_bandwidth(probe_bytes, threads))
        return bws[-1]

    fma = pk.fma_peak(0.02 if args.tiny else 0.2, threads)
    print(
        f"kernel {info['active_isa']}, {threads} threads, block_size {args.block_size}; "
        f"FMA peak {fma:.0f} GFLOP/s (measured now); {rounds} rounds of a memory-bandwidth probe next to "
        f"the kernel's best of {repeat} per config: medians, 'of bw' = median of the per-round ratios"
    )
    hdr = (
        f"{'config':<9}{'dtype':<9}{'KV MiB':>8}{'time ms':>10}{'GB/s':>8}{'bw GB/s':>9}{'of bw':>7}{'(range)':>12}"
        f"{'GFLOP/s':>9}{'of fma':>8}{'scalar ms':>11}{'numpy ms':>10}{'x numpy':>9}"
        + (f"{'resident ms':>13}{'overlap':>9}" if args.resident else "")
    )
    print(hdr)
    rows = []
    for c in configs:
        r = run_config(c, probe, fma, repeat, not args.no_scalar, not args.no_numpy, rounds, args.resident)
        rows.append(r)
        lo, hi = r["bw_frac_range"]
        print(
            f"{r['config']:<9}{r['dtype']:<9}{r['kv_MiB']:>8.0f}{r['time_ms']:>10.2f}{r['GBps']:>8.1f}"
            f"{r['bw_GBps']:>9.1f}{r['bw_frac']:>7.2f}{f'{lo:.2f}-{hi:.2f}':>12}{r['GFLOPs']:>9.1f}{r['fma_frac']:>8.2f}"
            f"{r.get('scalar_ms', math.nan):>11.1f}{r.get('numpy_ms', math.nan):>10.1f}"
            f"{r.get('vs_numpy', math.nan):>9.1f}"
            + (f"{r.get('resident_ms', math.nan):>13.2f}{r.get('overlap', math.nan):>9.2f}" if args.resident else ""),
            flush=True,
        )
    print(
        f"memory read bandwidth over all {len(bws)} probes: median {statistics.median(bws):.1f} GB/s "
        f"(min {min(bws):.1f}, max {max(bws):.1f})"
    )
    if args.resident:
        print(
            "resident ms: the same calls with each table confined to a few blocks (K/V in cache); overlap: "
            "(resident + KV bytes / bw - time) / min of the two (0 = compute and memory add up, 1 = fully hidden)"
        )
    print("targets: A >= 0.85 of bw (random table), Long >= 0.75, A >= 30x numpy; Prefill >= 0.5 of fma")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
