"""``pagedkv bench load``: process start to the last token of a 32-token answer, wall time and peak RSS.

Each run is a fresh ``pagedkv generate`` process (``python -m pagedkv_rs.cli.main generate``: greedy,
``--ignore-eos`` so the answer is exactly ``--max-tokens`` long) started by this one; wall time is
spawn to exit, peak RSS the child's own maximum resident set size (``/usr/bin/time``'s ``%M``, or
``ru_maxrss`` from ``os.wait4`` where there is no ``/usr/bin/time``). Reported per weight format:
median, min and max over ``--runs`` runs, against the targets (1.0 s, 300 MB for the bundled model)
and the general bound ``file size + KV pool + 150 MB``.

``--synthetic-1b`` first writes a random-weight 1.1B-parameter Llama GGUF (TinyLlama's shape, Q4_1
projections, Q8_0 embedding and head; ``--synthetic-types q4_k`` for Q4_K with Q6_K ``ffn_down``/``attn_v``,
embedding and head) into a temporary directory, tensor by tensor, measures it the same way, then
reports decode tok/s at 1 and 32 concurrent sequences (``pagedkv bench e2e`` in a fresh process:
decode tok/s = sequences / median TPOT). The file is deleted afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

from pagedkv_rs.cli.formatting import HelpFormatter

__all__ = ["build_parser", "command", "kv_pool_bytes", "main", "measure", "run_once"]

PROMPT = "What is the capital of France?"
SLACK = 150 << 20  # bytes over file size + KV pool the general RSS bound allows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        formatter_class=HelpFormatter, prog="pagedkv bench load", description=__doc__.splitlines()[0]
    )
    p.add_argument("--model", default=None, help="GGUF file (default: bundled SmolLM2-135M)")
    p.add_argument(
        "--weights",
        action="append",
        choices=("auto", "int8", "float32"),
        default=None,
        help="weight format (repeatable; default: auto, int8 and float32)",
    )
    p.add_argument("--max-tokens", type=int, default=32, help="tokens of the answer")
    p.add_argument("--runs", type=int, default=5, help="process starts per weight format")
    p.add_argument("--prompt", default=PROMPT, help="the prompt answered")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--synthetic-1b", action="store_true", help="measure a 1.1B random-weight GGUF written here")
    p.add_argument(
        "--synthetic-types", choices=("q4_1", "q4_k"), default="q4_1", help="(synthetic) the GGUF's weight block type"
    )
    p.add_argument(
        "--decode-seqs",
        type=int,
        action="append",
        default=None,
        help="(synthetic) decoding sequences (repeatable; default: 1 and 32)",
    )
    p.add_argument("--decode-len", type=int, default=16, help="(synthetic) output tokens per decode run")
    p.add_argument(
        "--keep",
        default=None,
        metavar="DIR",
        help="(synthetic) write the file here and keep it (default: a temporary directory)",
    )
    return p


def command(model: Optional[str], weights: str, max_tokens: int, prompt: str) -> list[str]:
    """The measured ``pagedkv generate`` command line."""
    cmd = [sys.executable, "-m", "pagedkv_rs.cli.main", "generate", "--weights", weights]
    cmd += ["--max-tokens", str(max_tokens), "--temperature", "0", "--ignore-eos", "--stats"]
    if model is not None:
        cmd += ["--model", model]
    return cmd + [prompt]


def run_once(cmd: list[str]) -> dict[str, Any]:
    """Spawn ``cmd``; its wall time (s), peak RSS (bytes), exit code and the ``--stats`` line."""
    # A child's ru_maxrss starts at the high-water mark of the process that exec'd it, i.e. of this
    # (maybe large) one; /usr/bin/time is small and reports its own child's figure, so prefer it.
    timer = ["/usr/bin/time", "-f", "PAGEDKV_MAXRSS_KB=%M"] if os.path.exists("/usr/bin/time") else []
    with tempfile.TemporaryFile() as errf:
        t0 = time.perf_counter()
        p = subprocess.Popen(timer + cmd, stdout=subprocess.PIPE, stderr=errf)
        assert p.stdout is not None
        out = p.stdout.read()
        p.stdout.close()
        _, status, ru = os.wait4(p.pid, 0)  # reaped here (not by Popen.wait) for this child's own rusage
        wall = time.perf_counter() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
        errf.seek(0)
        err = errf.read().decode(errors="replace")
    stats = next((ln for ln in err.splitlines() if ln.startswith("[")), "")
    m = re.search(r"PAGEDKV_MAXRSS_KB=(\d+)", err)
    return {
        "wall_s": wall,
        "peak_rss": int(m.group(1) if m else ru.ru_maxrss) * 1024,  # Linux reports KiB
        "returncode": p.returncode,
        "stats": stats,
        "stderr": err[-2000:],
        "answer": out.decode(errors="replace"),
    }


def measure(model: Optional[str], weights: str, max_tokens: int, runs: int, prompt: str) -> dict[str, Any]:
    """``runs`` fresh processes of one weight format: per-run rows and medians."""
    cmd = command(model, weights, max_tokens, prompt)
    rows = [run_once(cmd) for _ in range(runs)]
    bad = [r for r in rows if r["returncode"] != 0]
    if bad:
        raise RuntimeError(f"{' '.join(cmd)} failed ({bad[0]['returncode']}): {bad[0]['stderr']}")
    walls = [r["wall_s"] for r in rows]
    rss = [r["peak_rss"] for r in rows]
    return {
        "weights": weights,
        "command": cmd,
        "wall_s": {"median": statistics.median(walls), "min": min(walls), "max": max(walls)},
        "peak_rss": {"median": statistics.median(rss), "min": min(rss), "max": max(rss)},
        "stats": rows[-1]["stats"],
        "kv_pool_bytes": kv_pool_bytes(rows[-1]["stats"]),
    }


def kv_pool_bytes(stats: str) -> Optional[int]:
    """The KV pool size ``pagedkv generate --stats`` reports (``pool N blocks = X MiB``)."""
    m = re.search(r"pool (\d+) blocks = ([0-9.]+) MiB", stats)
    return None if m is None else int(float(m.group(2)) * (1 << 20))


def decode_rate(model: str, weights: str, seqs: int, output_len: int = 64) -> dict[str, Any]:
    """Decode tok/s of ``seqs`` concurrent sequences (``pagedkv bench e2e`` in a fresh process)."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "e2e.json")
        cmd = [sys.executable, "-m", "pagedkv_rs.cli.main", "bench", "e2e", "--model", model, "--weights", weights]
        cmd += ["--num-requests", str(seqs), "--input-len", "16", "--output-len", str(output_len)]
        cmd += ["--range-ratio", "0", "--no-progress", "--json", out, "--max-num-seqs", str(max(seqs, 1))]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr[-2000:]}")
        with open(out) as f:
            r = json.load(f)
    return {
        "seqs": seqs,
        "weights": weights,
        "decode_tok_s": seqs * 1e3 / r["median_tpot_ms"],
        "median_tpot_ms": r["median_tpot_ms"],
        "output_throughput": r["output_throughput"],
    }


def synthetic_main(args: argparse.Namespace) -> int:
    from pagedkv_rs.models.synthetic import TINYLLAMA_1B, write_synthetic_gguf

    spec = TINYLLAMA_1B
    if args.synthetic_types == "q4_k":
        import dataclasses

        spec = dataclasses.replace(spec, weight_type="Q4_K", down_type="Q6_K", embed_type="Q6_K", output_type="Q6_K")
    with tempfile.TemporaryDirectory(dir=args.keep) as d:
        path = os.path.join(args.keep or d, f"synthetic-1b-{args.synthetic_types}.gguf")
        t0 = time.perf_counter()
        write_synthetic_gguf(path, spec)
        write_s = time.perf_counter() - t0
        size = os.path.getsize(path)
        mb = 1 << 20
        print(
            f"{os.path.basename(path)}: {spec.num_params / 1e9:.3f}B parameters, {size / mb:.0f} MiB ({write_s:.1f} s)"
        )
        weights = args.weights or ["int8", "float32"]
        loads = [measure(path, w, args.max_tokens, args.runs, args.prompt) for w in weights]
        rates = [decode_rate(path, w, n, args.decode_len) for w in weights for n in args.decode_seqs or [1, 32]]
        if args.json:
            print(
                json.dumps(
                    {"model": path, "file_bytes": size, "params": spec.num_params, "load": loads, "decode": rates},
                    indent=2,
                )
            )
            return 0
        print(f"{'weights':>8} {'wall s (median)':>16} {'peak RSS MiB':>13} {'bound MiB':>10}   stats")
        for r in loads:
            kv = r["kv_pool_bytes"] or 0
            print(
                f"{r['weights']:>8} {r['wall_s']['median']:>16.2f} {r['peak_rss']['median'] / mb:>13.0f} "
                f"{(size + kv + SLACK) / mb:>10.0f}   {r['stats']}"
            )
        print("bound = file + KV pool + 150 MiB")
        for r in rates:
            print(
                f"decode {r['weights']:>8} {r['seqs']:>3} seqs: {r['decode_tok_s']:7.1f} tok/s "
                f"(median TPOT {r['median_tpot_ms']:.1f} ms, output throughput {r['output_throughput']:.1f} tok/s)"
            )
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.synthetic_1b:
        return synthetic_main(args)
    from pagedkv_rs.models.gguf_loader import bundled_model_path

    path = args.model or bundled_model_path()
    size = os.path.getsize(path)
    results = [
        measure(args.model, w, args.max_tokens, args.runs, args.prompt)
        for w in args.weights or ["auto", "int8", "float32"]
    ]
    if args.json:
        print(json.dumps({"model": path, "file_bytes": size, "results": results}, indent=2))
        return 0
    mb = 1 << 20
    print(f"{os.path.basename(path)}: {size / mb:.0f} MiB; {args.runs} runs each of")
    print(f"  {' '.join(results[0]['command'])}")
    print(f"{'weights':>8} {'wall s (median, min..max)':>28} {'peak RSS MiB (median, min..max)':>34}")
    for r in results:
        w, m = r["wall_s"], r["peak_rss"]
        print(
            f"{r['weights']:>8} {w['median']:>12.2f} ({w['min']:.2f}..{w['max']:.2f}) "
            f"{m['median'] / mb:>18.0f} ({m['min'] / mb:.0f}..{m['max'] / mb:.0f})   {r['stats']}"
        )
    print(
        f"targets (bundled model): wall <= 1.0 s, peak RSS <= 300 MB; in general <= file + KV pool + "
        f"{SLACK // mb} MiB = {(size + SLACK) / mb:.0f} MiB + KV pool"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
