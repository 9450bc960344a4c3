"""The ``pagedkv`` command: ``generate``, ``serve``, ``bench alloc|kernel|linear|e2e|load|serve|tiers``, ``info``...

Ctrl-C ends any command with exit code 130 and no traceback.
"""

from __future__ import annotations

import importlib
import sys

USAGE = """usage: pagedkv [--version] <command> [options]

commands:
  generate "prompt" ...   generate text with the bundled SmolLM2-135M through the paged cache
  bench alloc             allocator / block-table workloads, Rust vs Python
  bench kernel            paged-attention kernel vs memory bandwidth and numpy
  bench linear            int8 QLinear vs numpy float32 sgemm on SmolLM2's layer shapes
  bench e2e               end-to-end serving benchmark (requests/s, tokens/s, TTFT, TPOT)
  bench load              process start to a 32-token answer: wall time and peak RSS per weight format
  bench serve             benchmark any OpenAI-compatible server over HTTP (same table as bench e2e)
  bench tiers             TTFT of a long prefix: cold, in the pool, only on disk, only in Redis
  perplexity FILE         llama-perplexity's measure of a model on a text file (chunks, second halves scored)
  serve                   OpenAI-compatible HTTP server (needs the serve extra)
  simulate                replay a synthetic trace to size a KV cache (paged vs contiguous)
  info                    backend, build profile and CPU features

`pagedkv <command> --help` describes each command's options."""

BENCH_USAGE = "usage: pagedkv bench <program> [options]\n\nprograms:\n" + "\n".join(
    line.replace("  bench ", "  ", 1) for line in USAGE.splitlines() if line.startswith("  bench ")
)

# command path -> module whose main(argv) runs it
COMMANDS = {
    ("generate",): "pagedkv_rs.cli.generate",
    ("bench", "alloc"): "pagedkv_rs.cli.bench.alloc",
    ("bench", "kernel"): "pagedkv_rs.cli.bench.kernel",
    ("bench", "linear"): "pagedkv_rs.cli.bench.linear",
    ("bench", "e2e"): "pagedkv_rs.cli.bench.e2e",
    ("bench", "load"): "pagedkv_rs.cli.bench.load",
    ("bench", "serve"): "pagedkv_rs.cli.bench.serve",
    ("bench", "tiers"): "pagedkv_rs.cli.bench.tiers",
    ("perplexity",): "pagedkv_rs.cli.perplexity",
    ("serve",): "pagedkv_rs.cli.serve",
    ("simulate",): "pagedkv_rs.cli.simulate",
}


def info() -> int:
    import pagedkv_rs

    print(f"pagedkv_rs {pagedkv_rs.__version__}")
    print(f"allocator backend: {pagedkv_rs.BACKEND} (available: {', '.join(pagedkv_rs.BACKENDS)})")
    core = pagedkv_rs._core
    if core is not None:
        print(f"core build: {core.build_profile()}")
        if hasattr(core, "kernel_info"):
            print(f"kernel: {core.kernel_info()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if args else 2
    if args[0] in ("-V", "--version"):
        import pagedkv_rs

        print(f"pagedkv_rs {pagedkv_rs.__version__}")
        return 0
    if args[0] == "info":
        return info()
    if args[0] == "bench" and (len(args) == 1 or args[1] in ("-h", "--help", "help")):
        print(BENCH_USAGE)
        return 0 if len(args) > 1 else 2
    for path, module in COMMANDS.items():
        if tuple(args[: len(path)]) == path:
            try:
                mod = importlib.import_module(module)
            except ImportError as e:
                print(f"pagedkv {' '.join(path)}: unavailable ({e})", file=sys.stderr)
                return 1
            try:
                return int(mod.main(args[len(path) :]) or 0)
            except KeyboardInterrupt:
                print(f"pagedkv {' '.join(path)}: interrupted", file=sys.stderr)
                return 130
    print(f"pagedkv: unknown command {' '.join(args[:2])!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
