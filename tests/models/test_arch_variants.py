"""Every architecture on the one decoder: qwen3, phi3, gemma3 (and llama/qwen2 layouts) from small GGUF files.

- the loader reads each layout (fused ``attn_qkv``, Phi-3's ``[gate; up]``, Q/K norms, Gemma's post-norms,
  query width != hidden) and what llama.cpp does that the file does not say (Gemma 3's 5-local-1-global
  pattern, its local RoPE base 10000, its sqrt(hidden) embedding scale; Phi-3's ignored window);
- the numpy spec and the fused Rust decoder agree bit for bit on int8 weights, both allocator backends;
- the paged model equals the dense masked forward (``DenseLlama``) where the context outgrows the window,
  and contexts within the window give exactly the logits of the same model without a window;
- bad files are GGUFErrors naming the file, the field and the problem.
"""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
from test_fused import run_pair

from dense_llama import DenseLlama
from pagedkv_rs.models.gguf_loader import GGUFError, load_gguf
from pagedkv_rs.models.llama import LlamaModel, LlamaWeights
from pagedkv_rs.models.synthetic import SyntheticSpec, write_synthetic_gguf

# Small random-weight files in each architecture's own layout (Q8_0 blocks, tied embeddings).
SMALL = SyntheticSpec(
    num_layers=3,
    hidden_size=64,
    intermediate_size=96,
    vocab_size=300,
    weight_type="Q8_0",
    embed_type="Q8_0",
    rms_eps=1e-6,
)
QWEN3 = dataclasses.replace(SMALL, arch="qwen3", head_dim=32)  # query width 4 x 32 = 128 != hidden 64
PHI3 = dataclasses.replace(SMALL, arch="phi3", num_kv_heads=4, sliding_window=8)  # fused attn_qkv, [gate; up]
GEMMA3 = dataclasses.replace(
    SMALL,
    arch="gemma3",
    num_layers=7,  # layers 0-4 local, 5 global, 6 local
    num_heads=2,
    num_kv_heads=1,
    head_dim=64,  # query width 128 != hidden 64
    sliding_window=6,
    rope_theta=1e6,
)
VARIANTS = {
    "qwen3": QWEN3,
    "phi3": PHI3,
    "gemma3": GEMMA3,
    "gemma3_q4k_untied": dataclasses.replace(
        GEMMA3, weight_type="Q4_K", hidden_size=256, head_dim=128, intermediate_size=256, output_type="Q4_K"
    ),
    "llama_fused_qkv_bias": dataclasses.replace(SMALL, fused_qkv=True, biases=("qkv",)),
    "qwen2_partial_bias": dataclasses.replace(SMALL, arch="qwen2", biases=("q", "v")),
    "qwen3_fused_qkv": dataclasses.replace(QWEN3, fused_qkv=True, biases=("q", "k", "v")),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("arch")
    return {
        name: write_synthetic_gguf(d / f"{name}.gguf", spec, seed=i) for i, (name, spec) in enumerate(VARIANTS.items())
    }


def test_configs_say_what_llama_cpp_does(files):
    q3 = load_gguf(files["qwen3"]).config
    assert (q3.num_heads * q3.head_dim, q3.hidden_size) == (128, 64) and q3.spec.qk_norm
    assert q3.layer_windows == () and q3.attention_scale is None
    phi = load_gguf(files["phi3"]).config
    assert phi.sliding_window is None and phi.layer_window(0) is None  # llama.cpp ignores phi3's window
    g = load_gguf(files["gemma3"]).config
    assert g.layer_windows == (6, 6, 6, 6, 6, None, 6)  # il % 6 < 5: local
    assert g.rope_theta == 1e6 and g.rope_theta_local == 10000.0  # no rope.freq_base_swa in the file
    assert [g.layer_rope_theta(i) for i in (0, 5)] == [10000.0, 1e6]
    assert g.embedding_scale == np.float32(np.sqrt(np.float32(64)))
    assert g.attention_scale is None and g.tie_embeddings  # 1/sqrt(key_length)
    assert g.spec.activation == "gelu_tanh" and g.spec.post_norms


def test_gemma3_pattern_and_local_base_from_metadata(tmp_path):
    u32, f32 = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32
    meta = {"gemma3.attention.sliding_window_pattern": (3, u32), "gemma3.rope.freq_base_swa": (5000.0, f32)}
    p = write_synthetic_gguf(tmp_path / "g.gguf", dataclasses.replace(GEMMA3, extra_meta=meta))
    g = load_gguf(p).config
    assert g.layer_windows == (6, 6, None, 6, 6, None, 6) and g.rope_theta_local == 5000.0
    p = write_synthetic_gguf(tmp_path / "nowin.gguf", dataclasses.replace(GEMMA3, sliding_window=None))
    g = load_gguf(p).config
    assert g.layer_windows == () and g.layer_window(0) is None and g.rope_theta_local is None


@pytest.mark.parametrize("name", list(VARIANTS))
def test_fused_equals_numpy(files, name, backend):
    w = LlamaWeights.load(files[name], weights="int8")
    mgr = backend.KVCacheManager(64, 4, enable_prefix_caching=False)
    prompts = [[5, 9, 17, 3, 44, 2, 8, 11, 12, 13, 14], [7, 7, 7], list(range(10, 30))]
    out, _ = run_pair(w, mgr, prompts, 5, chunk=7)
    assert all(len(o) == 5 for o in out)


def test_fused_equals_numpy_under_every_isa(files, isa, backend):
    w = LlamaWeights.load(files["gemma3"], weights="int8")
    mgr = backend.KVCacheManager(64, 4, enable_prefix_caching=False)
    run_pair(w, mgr, [list(range(3, 20)), [9, 8]], 4)


def _paged_logits(model: LlamaModel, ids: list[int], backend) -> np.ndarray:
    """Logits [T, V] of every position of one prompt run through the paged model in one prefill."""
    mgr = backend.KVCacheManager(64, 4, enable_prefix_caching=False)
    caches = model.new_kv_caches(64, 4, "float32")
    mgr.allocate(0, ids)
    batch = mgr.prepare_batch([0], [len(ids)])
    return model.forward(batch, caches, logits_indices=np.arange(len(ids)))


@pytest.mark.parametrize("impl", ["numpy", "fused"])
def test_window_matches_the_dense_masked_forward(files, impl, backend):
    """Past the window (6) the local layers forget the oldest keys exactly as the dense masked forward says;
    within it the model equals the same model without windows, bit for bit."""
    w = LlamaWeights.load(files["gemma3"], weights="int8")
    ids = [int(i) for i in np.random.default_rng(0).integers(0, 300, 20)]
    got = _paged_logits(LlamaModel(w, impl=impl), ids, backend)
    dense = DenseLlama(w).forward(np.array([ids]), 0, DenseLlama(w).new_cache(1, len(ids)), all_positions=True)[0]
    np.testing.assert_allclose(got, dense, rtol=2e-3, atol=2e-3 * np.abs(dense).max())
    # the same weights without windows: the first 6 positions agree to the bit, later ones do not
    unwindowed = LlamaWeights.load(files["gemma3"], weights="int8")
    unwindowed.config = dataclasses.replace(w.config, layer_windows=())
    for layer in unwindowed.layers:
        layer["window"] = None
    full = _paged_logits(LlamaModel(unwindowed, impl=impl), ids, backend)
    np.testing.assert_array_equal(got[:6], full[:6])
    assert np.abs(got[6:] - full[6:]).max(axis=-1).min() > 1e-3 * np.abs(full).max()


def test_dense_matches_paged_for_every_architecture(files, backend):
    for name in VARIANTS:
        w = LlamaWeights.load(files[name], weights="float32")
        ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]
        got = _paged_logits(LlamaModel(w, impl="numpy"), ids, backend)
        dense = DenseLlama(w).forward(np.array([ids]), 0, DenseLlama(w).new_cache(1, len(ids)), all_positions=True)[0]
        np.testing.assert_allclose(got, dense, rtol=1e-3, atol=1e-3 * np.abs(dense).max(), err_msg=name)


@pytest.mark.parametrize("impl", ["numpy", "fused"])
def test_a_head_built_in_chunks_gives_the_same_logits(files, impl, backend, monkeypatch):
    """A large int8 head is built row chunk by row chunk (peak memory); its logits are the one matrix's bits."""
    from pagedkv_rs.models import llama

    whole = LlamaWeights.load(files["gemma3"], weights="int8")
    monkeypatch.setattr(llama, "HEAD_CHUNK_BYTES", 64 * 68)  # 64-row chunks of the 300 x 64 Q8_0 table
    chunked = LlamaWeights.load(files["gemma3"], weights="int8")
    assert isinstance(chunked.lm_head, llama.ChunkedLinear) and [p.n for p in chunked.lm_head.parts] == [
        64,
        64,
        64,
        64,
        44,
    ]
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    a = _paged_logits(LlamaModel(whole, impl=impl), ids, backend)
    b = _paged_logits(LlamaModel(chunked, impl=impl), ids, backend)
    np.testing.assert_array_equal(a, b)


def test_gemma3_parts_change_the_output(files, backend):
    """Each Gemma 3 part the spec names is used: dropping one changes the logits."""
    w = LlamaWeights.load(files["gemma3"], weights="float32")
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    base = _paged_logits(LlamaModel(w, impl="numpy"), ids, backend)
    for role in ("q_norm", "k_norm", "post_attn_norm", "post_ffn_norm"):
        saved = [layer.pop(role) for layer in w.layers]
        try:
            other = _paged_logits(LlamaModel(w, impl="numpy"), ids, backend)
        finally:
            for layer, v in zip(w.layers, saved):
                layer[role] = v
        assert np.abs(other - base).max() > 1e-3, role


# ---- bad files --------------------------------------------------------------------------------


def test_unknown_architecture_names_it_and_the_supported_ones(tmp_path):
    p = write_synthetic_gguf(tmp_path / "falcon.gguf", dataclasses.replace(SMALL, arch="falcon"))
    with pytest.raises(GGUFError, match=r"falcon\.gguf: unsupported architecture 'falcon' \(general\.architecture\)"):
        load_gguf(p)
    with pytest.raises(GGUFError, match=r"'llama', 'qwen2', 'qwen3', 'phi3', 'gemma3'"):
        load_gguf(p)


def test_unsupported_rope_scaling_is_refused(tmp_path):
    s = gguf.GGUFValueType.STRING
    p = write_synthetic_gguf(
        tmp_path / "yarn.gguf", dataclasses.replace(QWEN3, extra_meta={"qwen3.rope.scaling.type": ("yarn", s)})
    )
    with pytest.raises(
        GGUFError, match=r"yarn\.gguf: RoPE scaling 'yarn' is not supported \(qwen3\.rope\.scaling\.type"
    ):
        load_gguf(p)
    long = {"rope_factors_long.weight": np.ones(4, np.float32), "rope_factors_short.weight": np.ones(4, np.float32)}
    p = write_synthetic_gguf(tmp_path / "phi35.gguf", dataclasses.replace(PHI3, extra_tensors=long))
    with pytest.raises(GGUFError, match=r"phi35\.gguf: tensor 'rope_factors_long\.weight': LongRoPE .* not supported"):
        load_gguf(p)
    f32 = gguf.GGUFValueType.FLOAT32
    p = write_synthetic_gguf(
        tmp_path / "cap.gguf", dataclasses.replace(GEMMA3, extra_meta={"gemma3.final_logit_softcapping": (30.0, f32)})
    )
    with pytest.raises(GGUFError, match=r"cap\.gguf: gemma3\.final_logit_softcapping 30\.0: .* not supported"):
        load_gguf(p)


@pytest.mark.parametrize(
    "spec,leaf,shape,want",
    [
        (QWEN3, "attn_q_norm.weight", (16,), r"'blk\.0\.attn_q_norm\.weight' has shape \(16,\), expected \(32,\)"),
        (QWEN3, "attn_q.weight", (64, 64), r"'blk\.0\.attn_q\.weight' has shape \(64, 64\), expected \(128, 64\)"),
        (PHI3, "ffn_up.weight", (96, 64), r"'blk\.0\.ffn_up\.weight' has shape \(96, 64\), expected \(192, 64\)"),
        (PHI3, "attn_qkv.weight", (64, 64), r"'blk\.0\.attn_qkv\.weight' has shape \(64, 64\), expected \(192, 64\)"),
        (GEMMA3, "post_ffw_norm.weight", (32,), r"'blk\.0\.post_ffw_norm\.weight' has shape \(32,\), expected \(64,\)"),
    ],
)
def test_wrong_tensor_shapes_name_the_tensor(tmp_path, spec, leaf, shape, want):
    p = write_synthetic_gguf(tmp_path / "bad.gguf", dataclasses.replace(spec, shape_override={leaf: shape}))
    with pytest.raises(GGUFError, match=r"bad\.gguf: tensor " + want):
        load_gguf(p)


def test_missing_gemma_norm_is_named(tmp_path):
    p = write_synthetic_gguf(tmp_path / "g.gguf", dataclasses.replace(GEMMA3, post_norms=False))
    with pytest.raises(GGUFError, match=r"g\.gguf: tensor 'blk\.0\.post_attention_norm\.weight' is missing"):
        load_gguf(p)


def test_bad_head_sizes_are_refused(tmp_path):
    u32 = gguf.GGUFValueType.UINT32
    p = write_synthetic_gguf(
        tmp_path / "kv.gguf", dataclasses.replace(QWEN3, extra_meta={"qwen3.attention.value_length": (16, u32)})
    )
    with pytest.raises(GGUFError, match=r"kv\.gguf: qwen3\.attention\.key_length 32 / value_length 16"):
        load_gguf(p)
