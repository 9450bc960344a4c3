"""The fused decoder (``LlamaModel(impl="fused")``, ``_core.LlamaDecoder``) against the numpy path.

Both run the same kernels on the same float32 buffers in the same order, so with int8 weights their
logits and KV caches are equal bit for bit: on random tiny layers (prefill, decode, mixed batches,
prefix-cached sequences, chunked prefill, Qwen2 biases, a Mistral sliding window) under every ISA, and
on the real SmolLM2 (test_llama.py holds the numpy path to the float64 dense oracle and to the
right chat answers). Bad input is a
TypeError/ValueError before any cache is written.
"""

from __future__ import annotations

import dataclasses
import re
import types

import numpy as np
import pytest

import pagedkv_rs
from pagedkv_rs import _core
from pagedkv_rs.models.llama import LlamaModel, fused_unavailable
from pagedkv_rs.models.tiny import tiny_llama_weights


def step_both(models, mgr, caches, seqs, counts):
    """One step of every model over the same batch; their logits [B, V] and the batch."""
    batch = mgr.prepare_batch(seqs, counts)
    return [m.forward(batch, c) for m, c in zip(models, caches)], batch


def run_pair(weights, mgr, prompts, steps, *, chunk=1 << 30, kv_dtype="float16", first_id=0):
    """numpy and fused models side by side through prefill (chunked) + decode; asserts equal every step."""
    models = [LlamaModel(weights, impl="numpy"), LlamaModel(weights, impl="fused")]
    assert [m.impl for m in models] == ["numpy", "fused"]
    caches = [m.new_kv_caches(mgr.num_blocks, mgr.block_size, kv_dtype) for m in models]
    ids = [first_id + i for i in range(len(prompts))]
    hits = [mgr.allocate(s, p) for s, p in zip(ids, prompts)]
    out = {s: [] for s in ids}
    while any(len(out[s]) < steps for s in ids):
        active = [s for s in ids if len(out[s]) < steps]
        counts = [min(chunk, mgr.num_tokens(s) - mgr.num_computed_tokens(s)) for s in active]
        (a, b), _ = step_both(models, mgr, caches, active, counts)
        np.testing.assert_array_equal(a, b)
        grow = []
        for s, row in zip(active, a):
            if mgr.num_computed_tokens(s) == mgr.num_tokens(s):
                out[s].append(int(row.argmax()))
                if len(out[s]) < steps:
                    grow.append(s)
        if grow:
            pairs = mgr.append_batch(grow, [out[s][-1] for s in grow])
            for cs in caches:
                for k, v in cs:
                    if pairs:
                        pagedkv_rs.copy_blocks(k, v, pairs)
    for (k0, v0), (k1, v1) in zip(*caches):
        np.testing.assert_array_equal(k0, k1)
        np.testing.assert_array_equal(v0, v1)
    for s in ids:
        mgr.free(s)
    return [out[s] for s in ids], hits


PROMPTS = [[5, 9, 17, 3, 44, 2, 8], [7, 7, 7], list(range(10, 50)), [100]]


@pytest.mark.parametrize("kv_dtype", ["float16", "float32", "bfloat16"])
def test_fused_equals_numpy_prefill_then_decode(backend, isa, kv_dtype):
    w = tiny_llama_weights(seed=1)
    mgr = backend.KVCacheManager(64, 8, enable_prefix_caching=False)
    run_pair(w, mgr, PROMPTS, 6, kv_dtype=kv_dtype)


def test_fused_equals_numpy_chunked_mixed_batches(backend, isa):
    # chunk 5: long prompts prefill over several steps while short ones already decode (mixed batches)
    w = tiny_llama_weights(seed=2, num_layers=3)
    mgr = backend.KVCacheManager(64, 4, enable_prefix_caching=False)
    run_pair(w, mgr, PROMPTS, 8, chunk=5)


def test_fused_equals_numpy_prefix_cached(backend, isa):
    w = tiny_llama_weights(seed=3)
    mgr = backend.KVCacheManager(64, 4, enable_prefix_caching=True)
    shared = list(range(20, 40))
    run_pair(w, mgr, [shared + [1, 2]], 3)
    _, hits = run_pair(w, mgr, [shared + [3], shared + [4, 5, 6]], 4, first_id=10)
    assert all(h >= 16 for h in hits)  # the second run read the shared prefix from the cache


def test_fused_equals_numpy_bias_and_sliding_window(backend, isa):
    w = tiny_llama_weights(seed=4, qkv_bias=True, sliding_window=6, num_heads=2, num_kv_heads=1, hidden_size=64)
    mgr = backend.KVCacheManager(64, 4, enable_prefix_caching=False)
    run_pair(w, mgr, PROMPTS[:3], 5, chunk=7)
    # The window matters: without it the logits differ.
    nowin = tiny_llama_weights(seed=4, qkv_bias=True, num_heads=2, num_kv_heads=1, hidden_size=64)
    m1, m2 = LlamaModel(w, impl="fused"), LlamaModel(nowin, impl="fused")
    mgr = backend.KVCacheManager(64, 4, enable_prefix_caching=False)
    mgr.allocate(0, PROMPTS[2])
    batch = mgr.prepare_batch([0], [len(PROMPTS[2])])
    a = m1.forward(batch, m1.new_kv_caches(64, 4, "float32"))
    b = m2.forward(batch, m2.new_kv_caches(64, 4, "float32"))
    assert np.abs(a - b).max() > 1e-3


def test_impl_choice():
    w8, w32 = tiny_llama_weights(), tiny_llama_weights(weights="float32")
    assert LlamaModel(w8).impl == "fused" and LlamaModel(w32).impl == "numpy"
    assert fused_unavailable(w8) is None and "int8" in fused_unavailable(w32)
    with pytest.raises(ValueError, match="impl='fused' is not available: .*int8"):
        LlamaModel(w32, impl="fused")
    with pytest.raises(ValueError, match="impl must be one of"):
        LlamaModel(w8, impl="torch")
    ref = types.SimpleNamespace(kernel_source=lambda: "reference")
    assert "kernel source" in fused_unavailable(w8, ref)


@pytest.mark.parametrize("threads", [1, 3])
def test_fused_equals_numpy_any_thread_count(backend, threads):
    # Decode steps of <= TEAM_MAX_TOKENS tokens run their products on the step team, larger ones on
    # rayon: the same bits with one kernel thread, and with more threads than this VM's two cores.
    prev = pagedkv_rs.get_num_threads()
    try:
        pagedkv_rs.set_num_threads(threads)
        w = tiny_llama_weights(seed=6, num_layers=3)
        mgr = backend.KVCacheManager(64, 4, enable_prefix_caching=False)
        run_pair(w, mgr, PROMPTS[:2], 6, chunk=5)
        run_pair(w, mgr, PROMPTS[3:], 6)  # one sequence: one token a step
    finally:
        pagedkv_rs.set_num_threads(prev)


@pytest.mark.parametrize("tokens", [1, 3, 30, 40])  # 40 > TEAM_MAX_TOKENS: the rayon path
def test_fused_head_equals_numpy_head(isa, tokens):
    """``LlamaDecoder.forward``: layers, final norm and lm_head in one call; the numpy head's bits."""
    w = tiny_llama_weights(seed=7, vocab_size=300)
    models = [LlamaModel(w, impl="numpy"), LlamaModel(w, impl="fused")]
    assert models[1]._decoder.vocab_size == 300
    mgr = pagedkv_rs.fallback.KVCacheManager(16, 4, enable_prefix_caching=False)
    mgr.allocate(0, list(range(1, tokens + 1)))
    batch = mgr.prepare_batch([0], [tokens])
    for idx in (None, np.array([tokens - 1, 0, 0]), np.array([], np.int64), [tokens // 2]):
        caches = [m.new_kv_caches(16, 4, "float32") for m in models]
        a, b = (m.forward(batch, c, logits_indices=idx) for m, c in zip(models, caches))
        assert b.dtype == np.float32 and b.shape == (1 if idx is None else len(idx), 300)
        np.testing.assert_array_equal(a, b)
        x = np.ascontiguousarray(w.embed[batch.input_ids], np.float32)
        caches = models[1].new_kv_caches(16, 4, "float32")
        direct = models[1]._decoder.forward(x, batch, caches, idx, rope=w.rope_rows(batch.positions))
        np.testing.assert_array_equal(direct, b)


# ---- bad input: clear errors, never a panic, caches untouched --------------------------------


@pytest.fixture
def tiny():
    w = tiny_llama_weights(seed=5)
    model = LlamaModel(w, impl="fused")
    mgr = pagedkv_rs.fallback.KVCacheManager(8, 4, enable_prefix_caching=False)
    mgr.allocate(0, [1, 2, 3, 4, 5])
    batch = mgr.prepare_batch([0], [5])
    caches = model.new_kv_caches(8, 4, "float32")
    x = np.ascontiguousarray(w.embed[batch.input_ids], np.float32)
    rope = w.rope_rows(batch.positions)  # each RoPE base's cos/sin rows at the step's positions
    return types.SimpleNamespace(w=w, model=model, dec=model._decoder, batch=batch, rope=rope, caches=caches, x=x)


def _layers(w, **over):
    out = []
    for layer in w.layers:
        d = {k: layer[k] for k in ("attn_norm", "ffn_norm")}
        d.update({k: layer[k].q for k in ("wqkv", "wo", "wgu", "wdown")})
        d.update(over)
        out.append(d)
    return out


def test_decoder_constructor_rejects_bad_weights(tiny):
    w = tiny.w
    kw = dict(head_dim=16, num_heads=4, num_kv_heads=2, rms_eps=1e-5)
    dec = _core.LlamaDecoder(_layers(w), **kw)
    assert (dec.num_layers, dec.hidden_size, dec.head_dim, dec.intermediate_size) == (2, 64, 16, 96)
    with pytest.raises(TypeError, match=r"layers\[0\]\['wo'\] must be a QLinear"):
        _core.LlamaDecoder(_layers(w, wo=np.zeros((64, 64), np.float32)), **kw)
    with pytest.raises(ValueError, match=r"layers\[0\] has no 'wgu'"):
        _core.LlamaDecoder([{k: v for k, v in layer.items() if k != "wgu"} for layer in _layers(w)], **kw)
    with pytest.raises(TypeError, match=r"attn_norm.* must be float32"):
        _core.LlamaDecoder(_layers(w, attn_norm=np.ones(64)), **kw)
    with pytest.raises(ValueError, match="layer 0: attn_norm is"):
        _core.LlamaDecoder(_layers(w, attn_norm=np.ones(32, np.float32)), **kw)
    with pytest.raises(ValueError, match="layer 0: wqkv is"):
        _core.LlamaDecoder(_layers(w), head_dim=16, num_heads=4, num_kv_heads=1, rms_eps=1e-5)
    with pytest.raises(ValueError, match="bqkv has 3 values"):
        _core.LlamaDecoder(_layers(w, bqkv=np.ones(3, np.float32)), **kw)
    with pytest.raises(ValueError, match="positive multiple"):
        _core.LlamaDecoder(_layers(w), head_dim=16, num_heads=3, num_kv_heads=2, rms_eps=1e-5)
    with pytest.raises(ValueError, match="head_dim must be even"):
        _core.LlamaDecoder(_layers(w), **{**kw, "head_dim": 15})
    with pytest.raises(ValueError, match="layer 0: wqkv is"):
        _core.LlamaDecoder(_layers(w), **{**kw, "head_dim": 8})
    with pytest.raises(ValueError, match="rope_table 1 is not one of the 1 tables"):
        _core.LlamaDecoder(_layers(w, rope_table=1), **kw)
    with pytest.raises(ValueError, match=r"layer 0: q_norm has 8 values, expected 16"):
        _core.LlamaDecoder(_layers(w, q_norm=np.ones(8, np.float32)), **kw)
    with pytest.raises(ValueError, match=r"layer 0: post_ffn_norm has 8 values, expected 64"):
        _core.LlamaDecoder(_layers(w, post_ffn_norm=np.ones(8, np.float32)), **kw)
    with pytest.raises(ValueError, match="activation must be 'silu' or 'gelu_tanh'"):
        _core.LlamaDecoder(_layers(w), activation="relu", **kw)
    with pytest.raises(ValueError, match="attn_scale must be finite and > 0"):
        _core.LlamaDecoder(_layers(w), attn_scale=float("inf"), **kw)
    with pytest.raises(TypeError, match=r"layers\[0\]\['sliding_window'\] must be an int"):
        _core.LlamaDecoder(_layers(w, sliding_window="8"), **kw)
    with pytest.raises(ValueError, match="rope_mode"):
        _core.LlamaDecoder(_layers(w), rope_mode="spiral", **kw)
    with pytest.raises(ValueError, match="rms_eps"):
        _core.LlamaDecoder(_layers(w), head_dim=16, num_heads=4, num_kv_heads=2, rms_eps=float("nan"))
    with pytest.raises(ValueError, match="sliding_window"):
        _core.LlamaDecoder(_layers(w), sliding_window=0, **kw)
    with pytest.raises(ValueError, match="at least one layer"):
        _core.LlamaDecoder([], **kw)
    with pytest.raises(TypeError, match="sequence of dicts"):
        _core.LlamaDecoder(3, **kw)


def _with(batch, **over):
    return dataclasses.replace(batch, **over)


def _without(batch, name):
    return types.SimpleNamespace(**{k: v for k, v in vars(batch).items() if k != name})


def test_forward_hidden_rejects_bad_input(tiny):
    dec, b, caches, x = tiny.dec, tiny.batch, tiny.caches, tiny.x
    before = [(k.copy(), v.copy()) for k, v in caches]

    def bad(exc, match, x=x, batch=b, kv=caches, rope=tiny.rope):
        with pytest.raises(exc, match=match):
            dec.forward_hidden(x.copy() if x is tiny.x else x, batch, kv, rope=rope)

    bad(TypeError, "x must be float32", x=x.astype(np.float64))
    bad(ValueError, r"x must be \[T, 64\]", x=np.zeros((5, 32), np.float32))
    bad(ValueError, "x has 4 rows", x=x[:4].copy())
    bad(ValueError, "C-contiguous", x=np.zeros((5, 128), np.float32)[:, ::2])
    bad(TypeError, "batch has no 'positions'", batch=object())
    bad(TypeError, "batch.positions must be int64", batch=_with(b, positions=b.positions.astype(np.int32)))
    bad(ValueError, r"positions\[1\] = -3 is negative", batch=_with(b, positions=np.array([0, -3, 2, 3, 4])))
    cos, sin = tiny.rope[0]
    with pytest.raises(TypeError, match="missing 1 required keyword argument: 'rope'"):
        dec.forward_hidden(x.copy(), b, caches)
    bad(ValueError, r"the step needs 1 RoPE \(cos, sin\) row pairs, got 2", rope=[(cos, sin)] * 2)
    bad(ValueError, r"rope\[0\]: cos and sin must be \[5, 8\]", rope=[(cos[:4], sin[:4])])
    bad(TypeError, r"rope\[0\] cos must be float32", rope=[(cos.astype(np.float64), sin)])
    bad(TypeError, r"rope\[0\] must be a \(cos, sin\) pair", rope=[cos])
    bad(ValueError, "slot_mapping", batch=_with(b, slot_mapping=np.array([0, 1, 2, 3, 10**6])))
    ix = b.indices.copy()
    ix[0] = 99
    bad(ValueError, r"indices\[0\] = 99", batch=_with(b, indices=ix))
    bad(ValueError, "query_start_loc", batch=_with(b, query_start_loc=np.array([0, 4], np.int32)))
    # the block table is the batch's CSR form (indptr, indices), as FlashInfer takes it
    ip, ix = b.indptr, b.indices
    bad(TypeError, "batch has no 'indices'", batch=_without(b, "indices"))
    bad(TypeError, "indptr must be int32", batch=_with(b, indptr=ip.astype(np.int64)))
    bad(ValueError, "indptr must have 2 entries", batch=_with(b, indptr=np.array([0], np.int32)))
    bad(ValueError, "indptr\\[0\\] must be 0", batch=_with(b, indptr=ip + 1))
    bad(ValueError, "needs 2 blocks", batch=_with(b, indptr=np.array([0, 1], np.int32), indices=ix[:1]))
    xx = x.copy()
    alias = xx.view(np.int32).reshape(-1)[:2]  # indptr inside x's memory
    alias[:] = ip
    bad(ValueError, "x must not share memory with batch.indptr", batch=_with(b, indptr=alias), x=xx)
    bad(ValueError, r"need 2 \(k_cache, v_cache\) pairs", kv=caches[:1])
    bad(TypeError, "list of", kv=None)
    bad(TypeError, r"kv_caches\[1\] must be a \(k_cache, v_cache\) pair", kv=[caches[0], 5])
    bad(ValueError, "must not share memory with each other", kv=[caches[0], caches[0]])
    other = tiny.model.new_kv_caches(8, 4, "float16")
    bad(ValueError, "every layer's caches must match", kv=[caches[0], other[1]])
    small = [pagedkv_rs.new_kv_cache(8, 4, 1, 16, "float32") for _ in range(2)]
    bad(ValueError, r"caches must be \[num_blocks, 2, block_size, 16\]", kv=small)
    ro = [(k.copy(), v.copy()) for k, v in caches]
    ro[1][0].flags.writeable = False
    bad(ValueError, "writeable", kv=ro)
    for (k0, v0), (k1, v1) in zip(before, caches):  # nothing was written by a refused call
        np.testing.assert_array_equal(k0, k1)
        np.testing.assert_array_equal(v0, v1)
    out = dec.forward_hidden(x, b, caches, rope=tiny.rope)
    assert out is x and np.isfinite(x).all()


def test_decoder_head_rejects_bad_weights(tiny):
    w = tiny.w
    kw = dict(head_dim=16, num_heads=4, num_kv_heads=2, rms_eps=1e-5)
    head = dict(final_norm=np.ascontiguousarray(w.final_norm, np.float32), lm_head=w.lm_head.q)
    dec = _core.LlamaDecoder(_layers(w), **kw, **head)
    assert dec.vocab_size == w.lm_head.q.n
    assert _core.LlamaDecoder(_layers(w), **kw).vocab_size is None
    with pytest.raises(ValueError, match="both or neither"):
        _core.LlamaDecoder(_layers(w), **kw, lm_head=w.lm_head.q)
    with pytest.raises(ValueError, match="both or neither"):
        _core.LlamaDecoder(_layers(w), **kw, final_norm=head["final_norm"])
    with pytest.raises(TypeError, match=r"lm_head\[0\] must be a QLinear, got ndarray"):
        _core.LlamaDecoder(_layers(w), **kw, final_norm=head["final_norm"], lm_head=np.zeros((9, 64)))
    with pytest.raises(TypeError, match="final_norm must be float32"):
        _core.LlamaDecoder(_layers(w), **kw, final_norm=np.ones(64), lm_head=w.lm_head.q)
    with pytest.raises(ValueError, match=r"final_norm \[64\] and lm_head \[V, 64\], got final_norm \[32\]"):
        _core.LlamaDecoder(_layers(w), **kw, final_norm=np.ones(32, np.float32), lm_head=w.lm_head.q)
    narrow = _core.QLinear.from_float(np.ones((10, 32), np.float32))
    with pytest.raises(ValueError, match=r"lm_head \[10, 32\]"):
        _core.LlamaDecoder(_layers(w), **kw, final_norm=head["final_norm"], lm_head=narrow)


def test_forward_logits_rejects_bad_input(tiny):
    dec, b, caches, x = tiny.dec, tiny.batch, tiny.caches, tiny.x
    before = [(k.copy(), v.copy()) for k, v in caches]

    def bad(exc, match, idx=None, batch=b, d=dec):
        with pytest.raises(exc, match=match):
            d.forward(x.copy(), batch, caches, idx, rope=tiny.rope)

    bad(ValueError, r"logits row 1 is token 5, not in \[0, 5\)", idx=[0, 5])
    bad(ValueError, r"logits_indices\[0\] = -1 is negative", idx=np.array([-1]))
    bad(TypeError, "logits_indices must be a sequence of ints", idx="ab")
    bad(TypeError, "logits_indices must be a sequence of ints", idx=[0.5])
    bad(ValueError, "sequence 0 has no token", batch=_with(b, query_start_loc=np.array([0, 0], np.int32)))
    bad(TypeError, "batch has no 'query_start_loc'", batch=object())
    bad(TypeError, "batch.query_start_loc must be int32", batch=_with(b, query_start_loc=np.array([0, 5])))
    bad(ValueError, r"positions\[1\] = -1 is negative", batch=_with(b, positions=np.array([0, -1, 2, 3, 4])))
    w = tiny.w
    headless = _core.LlamaDecoder(_layers(w), head_dim=16, num_heads=4, num_kv_heads=2, rms_eps=1e-5)
    bad(ValueError, "has no head", d=headless)
    for (k0, v0), (k1, v1) in zip(before, caches):  # nothing was written by a refused call
        np.testing.assert_array_equal(k0, k1)
        np.testing.assert_array_equal(v0, v1)
    logits = dec.forward(x.copy(), b, caches, rope=tiny.rope)
    assert logits.shape == (1, w.lm_head.q.n) and np.isfinite(logits).all()


def test_logits_into_a_callers_buffer(tiny):
    """``forward(out=...)`` writes the logits into the caller's rows (the runner's buffer, reused step after step)
    and returns it, the same bits as a new array, in the fused decoder and in ``LlamaModel`` both ways; a bad
    buffer is a ValueError/TypeError before any K/V is written."""
    dec, b, x = tiny.dec, tiny.batch, tiny.x
    v = tiny.w.lm_head.q.n
    want = dec.forward(x.copy(), b, tiny.model.new_kv_caches(8, 4, "float32"), [4, 1], rope=tiny.rope)
    wide = np.full((3, v), np.nan, np.float32)  # rows 0-1 are the output, row 2 must stay untouched
    got = dec.forward(x.copy(), b, tiny.model.new_kv_caches(8, 4, "float32"), [4, 1], rope=tiny.rope, out=wide[:2])
    assert np.shares_memory(got, wide) and np.isnan(wide[2]).all()
    np.testing.assert_array_equal(got, want)
    for impl in ("fused", "numpy"):
        model = LlamaModel(tiny.w, impl=impl)
        ref = model.forward(b, model.new_kv_caches(8, 4, "float32"))
        buf = np.full((1, v), np.nan, np.float32)
        assert model.forward(b, model.new_kv_caches(8, 4, "float32"), out=buf) is buf
        np.testing.assert_array_equal(buf, ref)
        caches = model.new_kv_caches(8, 4, "float32")
        before = [(k.copy(), val.copy()) for k, val in caches]
        for bad in (
            np.zeros((2, v), np.float32),
            np.zeros((1, v), np.float64),
            np.zeros((1, 2 * v), np.float32)[:, ::2],
            np.zeros((1, v), np.float32)[:, ::-1],
        ):
            with pytest.raises(ValueError, match="out must"):
                model.forward(b, caches, out=bad)
        ro = np.zeros((1, v), np.float32)
        ro.flags.writeable = False
        with pytest.raises(ValueError, match="out must"):
            model.forward(b, caches, out=ro)
        for (k0, v0), (k1, v1) in zip(before, caches):
            np.testing.assert_array_equal(k0, k1)
            np.testing.assert_array_equal(v0, v1)
    caches = tiny.model.new_kv_caches(8, 4, "float32")
    for bad, exc in ((np.zeros((1, v), np.float64), TypeError), (np.zeros((2, v), np.float32), ValueError)):
        with pytest.raises(exc, match="out must"):
            dec.forward(x.copy(), b, caches, rope=tiny.rope, out=bad)
    mem = np.zeros(max(x.size, v), np.float32)  # x and out in one buffer: the logits would overwrite x
    xs = mem[: x.size].reshape(x.shape)
    xs[...] = x
    with pytest.raises(ValueError, match="out must not share memory with x"):
        dec.forward(xs, b, caches, rope=tiny.rope, out=mem[:v].reshape(1, v))


def test_forward_hidden_releases_the_gil():
    from kernels.kernel_util import gil_released_during  # tests/kernels (tests/ is on the path)

    big = tiny_llama_weights(num_layers=8, hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512)
    model = LlamaModel(big, impl="fused")
    mgr = pagedkv_rs.fallback.KVCacheManager(64, 16, enable_prefix_caching=False)
    mgr.allocate(0, list(range(1, 120)))
    batch = mgr.prepare_batch([0], [119])
    caches = model.new_kv_caches(64, 16, "float32")
    x = np.ascontiguousarray(big.embed[batch.input_ids], np.float32)
    rope = big.rope_rows(batch.positions)
    assert gil_released_during(lambda: model._decoder.forward_hidden(x.copy(), batch, caches, rope=rope))


# ---- the real SmolLM2 (int8 weights): fused == numpy bit for bit, so the same greedy tokens ----


@pytest.fixture(scope="module")
def smol_int8():
    from pagedkv_rs.models.gguf_loader import load_gguf
    from pagedkv_rs.models.llama import LlamaWeights

    return LlamaWeights(load_gguf(), weights="int8")


@pytest.fixture(scope="module")
def chat_prompts(tok):
    chats = ["What is the capital of France?", "Write one sentence about the ocean.", "Name three colors."]
    return [tok.apply_chat_template([{"role": "user", "content": c}]) for c in chats]


def test_smollm2_fused_equals_numpy(smol_int8, chat_prompts):
    mgr = pagedkv_rs.KVCacheManager(64, 16, enable_prefix_caching=True)
    run_pair(smol_int8, mgr, chat_prompts[:2], 3, chunk=13)
    _, hits = run_pair(smol_int8, mgr, chat_prompts[2:], 2, first_id=10)
    assert hits[0] >= 16  # the shared system prompt came from the prefix cache


def test_smollm2_fused_through_the_engine(smol_int8, chat_prompts, tok):
    """Continuous batching with chunked prefill, prefix caching and preemption: the same greedy tokens."""
    from pagedkv_rs.engine import LLMEngine
    from pagedkv_rs.engine.request import SamplingParams

    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    got = {}
    for impl in ("numpy", "fused"):
        engine = LLMEngine(
            LlamaModel(smol_int8, eos_token_ids=(2, 0), impl=impl),
            block_size=4,
            kv_cache_dtype="float16",
            enable_prefix_caching=True,
            enable_chunked_prefill=True,
            max_num_batched_tokens=24,
            num_blocks=14,
        )
        outs = engine.generate(chat_prompts[:2], params) + engine.generate(chat_prompts[2:], params)
        assert engine.stats()["num_preemptions"] > 0 and outs[2].num_cached_tokens > 0
        engine.kv_manager.check_invariants()
        got[impl] = [o.token_ids for o in outs]
    assert got["fused"] == got["numpy"]
    assert tok.decode(got["fused"][0], skip_special_tokens=True).startswith("The capital of France is")


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_spinning_workers_give_the_same_bits(tiny, threads):
    prev = pagedkv_rs.get_num_threads()
    try:
        pagedkv_rs.set_num_threads(threads)
        outs = []
        for spin in (False, True):
            caches = tiny.model.new_kv_caches(8, 4, "float32")
            y = tiny.dec.forward_hidden(tiny.x.copy(), tiny.batch, caches, rope=tiny.rope, spin=spin)
            outs.append((y, caches))
        np.testing.assert_array_equal(outs[0][0], outs[1][0])
        for (k0, v0), (k1, v1) in zip(outs[0][1], outs[1][1]):
            np.testing.assert_array_equal(k0, k1)
            np.testing.assert_array_equal(v0, v1)
    finally:
        pagedkv_rs.set_num_threads(prev)


def test_bench_e2e_table_smoke(capsys):
    from pagedkv_rs.cli.bench.e2e import main

    argv = ["--table", "--table-seqs", "1,2", "--prefill-len", "8", "--input-len", "4", "--output-len", "2"]
    argv += ["--range-ratio", "0", "--kv-memory", "8MiB", "--table-impls", "numpy:int8,fused"]
    assert main([*argv, "--bandwidth-probe", "64MiB"]) == 0
    out = capsys.readouterr().out
    assert "numpy/int8" in out and "fused/int8" in out and "fused/int8 / numpy/int8" in out
    # SmolLM2's int8 matrices (~100 MB): their rate at one sequence, against the bandwidth probed in the run
    m = re.search(r"fused/int8: (\d+) MB of weights a decode step; 1 seq reads them at [\d.]+ GB/s, [\d.]+ of the", out)
    assert m and 80 <= int(m.group(1)) <= 120
    assert main([*argv, "--table-impls", "numpy:float32", "--bandwidth-probe", "0"]) == 0
    out = capsys.readouterr().out
    assert "numpy/float32" in out and "MB of weights" not in out  # no int8 matrices to count
    for row in ("1 seq ", "2 seqs", "prefill 8"):
        assert row in out
    with pytest.raises(SystemExit, match="IMPL"):
        main(["--table", "--table-impls", "torch"])
    with pytest.raises(SystemExit):
        main(["--table", "--bandwidth-probe", "lots"])
    assert "--bandwidth-probe must be bytes or a size like" in capsys.readouterr().err


def test_generate_cli_model_impl(capsys):
    from pagedkv_rs.cli.generate import main
    from pagedkv_rs.llm import LLM

    argv = ["What is the capital of France?", "--max-tokens", "8", "--kv-memory", "8MiB", "--temperature", "0"]
    assert main(argv + ["--model-impl", "fused", "--repetition-penalty", "1"]) == 0
    assert "Paris" in capsys.readouterr().out
    llm = LLM(model_impl="fused", kv_memory="4MiB")  # weights="auto" with fused: int8
    assert (llm.model.impl, llm.weight_format) == ("fused", "int8")
    with pytest.raises(ValueError, match="impl='fused' is not available"):
        LLM(model_impl="fused", weights="float32", kv_memory="4MiB")


def test_forward_hidden_reads_the_csr_table_with_the_padded_ones_bits(tiny):
    """The decoder reads the batch's CSR table (indptr, indices); the numpy spec attends over its
    padded [B, max_blocks] table: the same bits and the same cache writes, here over two sequences
    of unequal length."""
    mgr = pagedkv_rs.fallback.KVCacheManager(8, 4, enable_prefix_caching=False)
    mgr.allocate(0, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    mgr.allocate(1, [4, 5])
    b = mgr.prepare_batch([0, 1], [9, 2])
    assert b.block_tables.shape == (2, 3) and b.block_tables[1, 1] == -1  # padded
    x = np.ascontiguousarray(tiny.w.embed[b.input_ids], np.float32)
    caches = [tiny.model.new_kv_caches(8, 4, "float32") for _ in range(2)]
    y0 = LlamaModel(tiny.w, impl="numpy").forward_hidden(b, caches[0])
    y1 = tiny.dec.forward_hidden(x, b, caches[1], rope=tiny.w.rope_rows(b.positions))
    assert np.isfinite(y0).all()
    np.testing.assert_array_equal(y0.view(np.uint32), y1.view(np.uint32))
    for (k0, v0), (k1, v1) in zip(*caches):
        np.testing.assert_array_equal(k0, k1)
        np.testing.assert_array_equal(v0, v1)
