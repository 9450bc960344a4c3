"""llama.cpp's own activation-quantization error on a GGUF file: the mean KL divergence of its logits over a text
against the same file with every tensor dequantized to F32 (where llama.cpp multiplies float32 activations instead
of its Q8 ones). `pagedkv perplexity --kl-divergence` measures the same thing for pagedkv_rs's int8 products, so
the two figures compare directly (docs/models.md: how activation digits are chosen).

    python benches/llamacpp_activation_kl.py MODEL.gguf TEXT --llama-bin /path/to/llama.cpp/build/bin --ctx 256

llama.cpp is not a dependency: build `llama-perplexity` as tests/models/make_llamacpp_goldens.py says. The F32
copy (4 bytes a weight) is written to a temporary directory and removed afterwards.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import gguf
import numpy as np


def dequantize_gguf(src: str, dst: str) -> None:
    """Write GGUF ``src`` as ``dst`` with the same metadata and every tensor as F32 (``gguf.quants.dequantize``)."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))  # GGUF lists dims innermost first
        writer.add_tensor(t.name, values.reshape(shape), raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def llama_perplexity(bin_dir: str, model: str, text: str, ctx: int, threads: int, *extra: str) -> str:
    exe = os.path.join(bin_dir, "llama-perplexity")
    cmd = [exe, "-m", model, "-f", text, "-c", str(ctx), "-t", str(threads), *extra]
    env = dict(os.environ, LD_LIBRARY_PATH=bin_dir)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return done.stdout + done.stderr


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="the GGUF file")
    p.add_argument("text", help="a UTF-8 text file")
    p.add_argument("--llama-bin", required=True, help="directory holding llama-perplexity and llama.cpp's libraries")
    p.add_argument("--ctx", type=int, default=256, help="tokens per chunk (default: 256)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--chunks", type=int, default=None, help="score the first N chunks only (as pagedkv perplexity --chunks N)"
    )
    args = p.parse_args(argv)
    chunks = () if args.chunks is None else ("--chunks", str(args.chunks))
    with tempfile.TemporaryDirectory() as tmp:
        f32, base = os.path.join(tmp, "f32.gguf"), os.path.join(tmp, "base.kld")
        dequantize_gguf(args.model, f32)
        llama_perplexity(args.llama_bin, f32, args.text, args.ctx, args.threads, *chunks, "--kl-divergence-base", base)
        out = llama_perplexity(
            args.llama_bin,
            args.model,
            args.text,
            args.ctx,
            args.threads,
            *chunks,
            "--kl-divergence-base",
            base,
            "--kl-divergence",
        )
    stats = {k: re.search(rf"{k}:\s+([-\d.]+)", out) for k in ("Mean    KLD", "Maximum KLD", "Same top p")}
    if stats["Mean    KLD"] is None:
        raise SystemExit(f"no KL statistics in llama-perplexity's output:\n{out[-2000:]}")
    scope = "" if args.chunks is None else f", first {args.chunks} chunks"
    print(f"llama.cpp, {os.path.basename(args.model)} against its F32 copy, ctx {args.ctx}{scope}:")
    for key, m in stats.items():
        print(f"  {' '.join(key.split())}: {m.group(1) if m else '?'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
