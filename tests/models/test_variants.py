"""Llama-family variants from GGUF metadata: each a small synthetic GGUF vs gguf's own float64 forward.

Every file is written by ``pagedkv_rs.models.synthetic`` (random blocks, tiny dims) into tmp_path; the
oracle (``dense_oracle.GGUFOracle``) reads it back with ``gguf.GGUFReader`` and ``gguf.quants`` only.
The paged model's greedy token must equal the oracle's at every step (fed the oracle's tokens) whose
margin over the runner-up is not a near-tie.
"""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np
import pytest

import pagedkv_rs
from pagedkv_rs.models.gguf_loader import GGUFError, load_gguf
from pagedkv_rs.models.llama import LlamaModel, LlamaWeights
from pagedkv_rs.models.synthetic import SyntheticSpec, write_synthetic_gguf
from pagedkv_rs.models.tokenizer import GGUFTokenizer

gguf = pytest.importorskip("gguf")
from dense_oracle import GGUFOracle  # noqa: E402

BASE = SyntheticSpec(hidden_size=256, intermediate_size=512, vocab_size=320, num_layers=2, context_length=128)
VARIANTS = {
    "llama2": BASE,
    "llama3_rope_freqs": dataclasses.replace(BASE, rope_theta=500000.0, llama3_rope=(8.0, 1.0, 4.0, 32)),
    "linear_rope": dataclasses.replace(BASE, rope_scaling_linear=4.0),
    "qwen2": dataclasses.replace(BASE, arch="qwen2", biases=("q", "k", "v"), num_kv_heads=1, rope_theta=1000000.0),
    "mistral_window": dataclasses.replace(BASE, sliding_window=5, output_type="Q6_K"),
    "smollm2_shape": dataclasses.replace(  # another size: 8 heads of 64, 2 KV heads, 3 layers, untied Q8_0 head
        BASE, hidden_size=512, num_heads=8, num_kv_heads=2, intermediate_size=768, num_layers=3, output_type="Q8_0"
    ),
}
# Q4_K_M-like mixes and each type as the projections' type.
TYPES = {
    "q4_k_m": dict(weight_type="Q4_K", down_type="Q6_K", embed_type="Q6_K"),
    "q5_k": dict(weight_type="Q5_K", embed_type="Q5_K"),
    "q4_1_q8_0": dict(weight_type="Q4_1", embed_type="Q8_0"),
    "q4_0_q5_0": dict(weight_type="Q4_0", down_type="Q5_0", embed_type="Q5_1"),
    "f16_bf16": dict(weight_type="F16", down_type="BF16", embed_type="F16"),
    "f32": dict(weight_type="F32", embed_type="F32"),
}
PROMPTS = [[5, 17, 99, 3, 250, 41], [300, 7, 7, 128]]
MAX_NEW = 12
MARGIN = 0.03  # float32 model vs float64 oracle differ by ~1e-4 here; tokens closer than this may flip


def paged_tokens(model: LlamaModel, prompt: list[int], feed: list[int], block_size: int = 4) -> list[int]:
    """Greedy choices of the paged model after ``prompt`` and after each token of ``feed`` (teacher forcing).

    Prefill, then one decode step per fed token, through the paged cache and the Rust block manager.
    """
    mgr = pagedkv_rs.KVCacheManager(64, block_size, enable_prefix_caching=False)
    caches = model.new_kv_caches(64, block_size, "float32")
    mgr.allocate(0, prompt)
    out: list[int] = []
    n = len(prompt)
    for tok in [None, *feed[:-1]]:
        if tok is not None:
            mgr.append_batch([0], [tok])
            n = 1
        out.append(int(model.forward(mgr.prepare_batch([0], [n]), caches)[0].argmax()))
    mgr.free(0)
    return out


def assert_same_greedy(model: LlamaModel, oracle: GGUFOracle, prompt: list[int], max_new: int = MAX_NEW) -> None:
    """The paged model picks the oracle's greedy token at every step whose margin is not a near-tie."""
    toks, margins = oracle.greedy(prompt, max_new)
    got = paged_tokens(model, prompt, toks)
    clear = [i for i, m in enumerate(margins) if m >= MARGIN]
    assert len(clear) >= max_new // 2, f"greedy margins too thin to compare: {margins}"
    assert [got[i] for i in clear] == [toks[i] for i in clear], (got, toks, margins)


def _file(tmp_path_factory, variant: str, types: str) -> str:
    spec = dataclasses.replace(VARIANTS[variant], **TYPES[types])
    return write_synthetic_gguf(
        tmp_path_factory.mktemp(variant) / f"{types}.gguf", spec, seed=zlib.crc32(variant.encode()) % 1000
    )


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_float32_equals_ggufs_own_forward(tmp_path_factory, variant):
    path = _file(tmp_path_factory, variant, "q4_k_m")
    model = LlamaModel(LlamaWeights(load_gguf(path), weights="float32"))
    oracle = GGUFOracle(path)
    for p in PROMPTS:
        assert_same_greedy(model, oracle, p)


@pytest.mark.parametrize("types", list(TYPES))
def test_each_quant_type_float32_equals_ggufs_own_forward(tmp_path_factory, types):
    path = _file(tmp_path_factory, "qwen2" if types == "q5_k" else "llama2", types)
    model = LlamaModel(LlamaWeights(load_gguf(path), weights="float32"))
    assert_same_greedy(model, GGUFOracle(path), PROMPTS[0])


@pytest.mark.parametrize("types", ["q5_k", "q4_1_q8_0", "q4_0_q5_0"])
@pytest.mark.parametrize("variant", ["llama3_rope_freqs", "qwen2"])
def test_int8_weights_equal_ggufs_own_forward_on_exact_types(tmp_path_factory, variant, types):
    """Exact types: QLinear's blocks are gguf's numbers; the oracle quantizes activations as QLinear does."""
    pytest.importorskip("pagedkv_rs._core")
    path = _file(tmp_path_factory, variant, types)
    model = LlamaModel(LlamaWeights(load_gguf(path), weights="int8"))
    assert_same_greedy(model, GGUFOracle(path, int8_acts=True), PROMPTS[1])


def test_the_variants_change_the_model(tmp_path_factory):
    """Each variant's metadata is read: dropping it changes the oracle's and the model's logits."""
    logits = {}
    for v in VARIANTS:
        path = _file(tmp_path_factory, v, "q4_k_m")
        m = LlamaModel(LlamaWeights(load_gguf(path), weights="float32"))
        mgr = pagedkv_rs.KVCacheManager(64, 4, enable_prefix_caching=False)
        prompt = list(range(1, 24))  # longer than the sliding window
        mgr.allocate(0, prompt)
        logits[v] = m.forward(mgr.prepare_batch([0], [len(prompt)]), m.new_kv_caches(64, 4, "float32"))[0]
    cfgs = {v: load_gguf(_file(tmp_path_factory, v, "q4_k_m"), load_tensors=False).config for v in VARIANTS}
    assert cfgs["qwen2"].architecture == "qwen2" and cfgs["qwen2"].attention_bias
    assert cfgs["mistral_window"].sliding_window == 5 and not cfgs["mistral_window"].tie_embeddings
    assert cfgs["llama3_rope_freqs"].rope_freq_factors and cfgs["linear_rope"].rope_scaling_factor == 4.0
    assert cfgs["llama2"].tie_embeddings and cfgs["smollm2_shape"].head_dim == 64
    # same weights (same seed would be needed for identity; here the oracle disagrees with a plain Llama):
    for v in ("llama3_rope_freqs", "linear_rope", "mistral_window"):
        path = _file(tmp_path_factory, v, "q4_k_m")
        o = GGUFOracle(path)
        with_it = o.forward(list(range(1, 24)), [[] for _ in range(o.layers)])
        o.window, o.pos_scale, o.inv_freq = None, 1.0, 10000.0 ** (-np.arange(0, o.d, 2) / o.d)
        without = o.forward(list(range(1, 24)), [[] for _ in range(o.layers)])
        effect, err = np.abs(with_it - without).max(), np.abs(logits[v] - with_it).max()
        assert err < 0.03 and effect > 10 * err, (v, err, effect)  # float32 vs float64 noise << the variant


def test_qwen2_biases_are_one_float32_array_per_layer(tmp_path):
    path = write_synthetic_gguf(tmp_path / "q.gguf", VARIANTS["qwen2"])
    w = LlamaWeights(load_gguf(path), weights="float32")
    r = gguf.GGUFReader(path)
    t = {x.name: np.asarray(x.data) for x in r.tensors}
    for i, layer in enumerate(w.layers):
        want = np.concatenate([t[f"blk.{i}.attn_{n}.bias"] for n in "qkv"])
        assert layer["bqkv"].dtype == np.float32 and layer["bqkv"].shape == (256 + 2 * 64,)
        np.testing.assert_array_equal(layer["bqkv"], want)  # qwen2 rows are not permuted
    plain = LlamaWeights(load_gguf(write_synthetic_gguf(tmp_path / "l.gguf", BASE)), weights="float32")
    assert all("bqkv" not in layer for layer in plain.layers)


def test_qwen2_pre_tokenizer_splits_as_qwen2(tmp_path):
    path = write_synthetic_gguf(tmp_path / "q.gguf", VARIANTS["qwen2"])
    tok = GGUFTokenizer.from_gguf(path)
    pieces = [p for p, _ in tok._tok.pre_tokenizer.pre_tokenize_str("Hello,world 2024 I'M ok!!\n\n x")]
    # Qwen2: a letter run takes one leading non-letter (",world"), digits one by one, "'M" case-insensitive
    assert pieces == ["Hello", ",world", "Ġ", "2", "0", "2", "4", "ĠI", "'M", "Ġok", "!!ĊĊ", "Ġx"]
    llama = GGUFTokenizer.from_gguf(write_synthetic_gguf(tmp_path / "l.gguf", BASE))
    assert [p for p, _ in llama._tok.pre_tokenizer.pre_tokenize_str("Hello,world")] == ["Hello", ",", "world"]
    assert tok.decode(tok.encode("Hello,world 2024")) == "Hello,world 2024"


def _edit_meta(tmp_path, name, spec, **kv):
    """A synthetic file with metadata keys replaced (written again with the extra keys)."""
    path = write_synthetic_gguf(tmp_path / "base.gguf", spec)
    r = gguf.GGUFReader(path)
    w = gguf.GGUFWriter(str(tmp_path / name), r.fields["general.architecture"].contents())
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture" or k in kv:
            continue
        vt = f.types[0]
        sub = f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(k, f.contents(), vt, sub_type=sub)
    for k, (v, vt) in kv.items():
        w.add_key_value(k, v, vt)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(tmp_path / name)


def test_unsupported_variants_are_clear_errors(tmp_path):
    s = gguf.GGUFValueType.STRING
    p = _edit_meta(tmp_path, "yarn.gguf", BASE, **{"llama.rope.scaling.type": ("yarn", s)})
    with pytest.raises(GGUFError, match=r"yarn\.gguf: RoPE scaling 'yarn' is not supported"):
        load_gguf(p)
    p = _edit_meta(tmp_path, "gptj.gguf", BASE, **{"general.architecture": ("gptj", s)})
    with pytest.raises(GGUFError, match=r"gptj\.gguf: unsupported architecture 'gptj'"):
        load_gguf(p)
    p = _edit_meta(tmp_path, "win.gguf", BASE, **{"llama.attention.sliding_window": (0, gguf.GGUFValueType.UINT32)})
    with pytest.raises(GGUFError, match=r"win\.gguf: attention.sliding_window must be >= 1, got 0"):
        load_gguf(p)
    p = _edit_meta(tmp_path, "kl.gguf", BASE, **{"llama.attention.key_length": (48, gguf.GGUFValueType.UINT32)})
    # a query width head_count x key_length other than hidden is allowed (Qwen3, Gemma 3); the Q rows must match it
    with pytest.raises(
        GGUFError, match=r"kl\.gguf: tensor 'blk\.0\.attn_output\.weight' has shape \(256, 256\), expected \(256, 192\)"
    ):
        load_gguf(p)


def test_a_missing_bias_is_no_bias_as_in_llama_cpp(tmp_path):
    """Q/K/V biases are each optional (llama.cpp: TENSOR_NOT_REQUIRED): an absent one adds nothing."""
    path = write_synthetic_gguf(tmp_path / "q.gguf", VARIANTS["qwen2"])
    r = gguf.GGUFReader(path)
    w = gguf.GGUFWriter(str(tmp_path / "nobias.gguf"), "qwen2")
    for k, f in r.fields.items():
        if not k.startswith("GGUF.") and k != "general.architecture":
            vt = f.types[0]
            w.add_key_value(k, f.contents(), vt, sub_type=f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None)
    for t in r.tensors:
        if t.name != "blk.1.attn_v.bias":
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    full = LlamaWeights.load(path, weights="float32")
    cut = LlamaWeights.load(tmp_path / "nobias.gguf", weights="float32")
    nv = full.config.num_kv_heads * full.config.head_dim
    np.testing.assert_array_equal(cut.layers[1]["bqkv"][:-nv], full.layers[1]["bqkv"][:-nv])
    assert not cut.layers[1]["bqkv"][-nv:].any() and full.layers[1]["bqkv"][-nv:].any()
    np.testing.assert_array_equal(cut.layers[0]["bqkv"], full.layers[0]["bqkv"])
