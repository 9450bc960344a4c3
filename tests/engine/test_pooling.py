"""Pooling requests (embeddings) through the engine: equal to a numpy pooling of ``forward_hidden`` run alone,
batched with generation without changing its tokens, the same across chunked prefill, aborted cleanly."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from pagedkv_rs import InvalidRequestError, LLMEngine, PoolingParams, SamplingParams
from pagedkv_rs._backend import manager_class
from pagedkv_rs.llm import LLM, _TextDecoder
from pagedkv_rs.models.tiny import TinyModel

PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs into the forest to find its friends."


@pytest.fixture(scope="module")
def llm() -> Any:
    m = LLM(num_blocks=128)
    yield m
    m.shutdown()


def engine(llm: LLM, **kwargs: Any) -> LLMEngine:
    kwargs.setdefault("num_blocks", 128)
    return LLMEngine(llm.model, tokenizer=_TextDecoder(llm.tokenizer), kv_cache_dtype="float16", **kwargs)


def reference(llm: LLM, ids: list[int], pooling: str, normalize: bool = True) -> np.ndarray:
    """The prompt alone through ``forward_hidden`` on fresh caches, final-normed, pooled in numpy."""
    model = llm.model
    mgr = manager_class("auto")(64, 16, enable_prefix_caching=False)
    mgr.allocate(0, ids)
    batch = mgr.prepare_batch([0], [len(ids)])
    hidden = model.forward_hidden(batch, model.new_kv_caches(64, 16, "float16"))
    normed = model.final_norm(hidden).astype(np.float64)
    v = normed.mean(axis=0) if pooling == "mean" else normed[-1]
    return v / np.linalg.norm(v) if normalize else v


# Pooled vectors of one prompt run in different chunks: chunks of a few rows attend through the decode kernel, longer
# ones through the prefill tiles (summed in another order), each within the kernels' tolerance of the scalar path.
# The SIMD and scalar paths' vectors differ by up to ~6e-5 on this prompt, so chunkings agree within this.
CHUNKED_ATOL = 1e-4


def ids_of(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.encode(text, add_special_tokens=True)


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("normalize", [True, False])
def test_pooled_vector_equals_numpy_pooling_of_forward_hidden(llm, pooling, normalize):
    out = llm.embed([PROMPT], pooling=pooling, normalize=normalize)[0]
    got = np.asarray(out.outputs.embedding, np.float64)
    want = reference(llm, ids_of(llm, PROMPT), pooling, normalize)
    assert got.shape == (llm.model.hidden_size,)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    assert out.finished and out.finish_reason == "stop" and out.prompt_token_ids == ids_of(llm, PROMPT)
    if normalize:
        assert abs(np.linalg.norm(got) - 1.0) < 1e-5
    assert llm.engine.scheduler.stats()["kv_live_blocks"] == 0  # finished when computed, blocks freed


def test_last_and_mean_differ_and_prompts_differ(llm):
    a, b, c = llm.embed([PROMPT, PROMPT, "Paris is the capital of France."], PoolingParams("mean"))
    last = llm.embed(PROMPT)[0]
    assert a.outputs.embedding == b.outputs.embedding
    assert a.outputs.embedding != c.outputs.embedding
    assert a.outputs.embedding != last.outputs.embedding


def _record_steps(eng: LLMEngine) -> list[tuple[bool, int]]:
    """(the step had pooling rows, how many rows it sampled), per step."""
    seen: list[tuple[bool, int]] = []
    execute = eng.runner.execute

    def spy(si: Any) -> Any:
        seen.append((si.pool is not None, len(si.so.sample_rows)))
        return execute(si)

    eng.runner.execute = spy  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_generation_batched_with_pooling_is_byte_identical(llm, temperature):
    gen = SamplingParams(max_tokens=24, temperature=temperature)  # unseeded: drawn from the engine's seed
    prompts = [PROMPT, PROMPT + " Again.", "Paris is the capital of France, and Berlin of Germany, and so on."]
    alone = engine(llm, max_num_batched_tokens=16).generate([prompts[1]], gen)[0]
    eng = engine(llm, max_num_batched_tokens=16)
    steps = _record_steps(eng)
    params = [PoolingParams("mean"), gen, PoolingParams("last")]
    pooled_a, together, pooled_b = eng.generate(prompts, params)
    assert together.outputs[0].token_ids != []
    assert together.prompt_token_ids == alone.prompt_token_ids
    assert together.outputs[0].token_ids == alone.outputs[0].token_ids
    assert together.outputs[0].text == alone.outputs[0].text
    assert any(pool and n for pool, n in steps), "no step held both pooling and sampled rows"
    for out, text, kind in ((pooled_a, prompts[0], "mean"), (pooled_b, prompts[2], "last")):
        want = reference(llm, ids_of(llm, text), kind)
        np.testing.assert_allclose(out.outputs.embedding, want, rtol=0, atol=CHUNKED_ATOL)
    assert eng.scheduler.stats()["kv_live_blocks"] == 0 and eng.scheduler.num_pooling == 0


def test_steps_without_pooling_rows_take_the_models_forward(llm):
    eng = engine(llm)
    steps = _record_steps(eng)
    eng.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0.0))
    assert steps and not any(pool for pool, _ in steps)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_chunked_prefill_gives_the_same_vector(llm, pooling):
    whole = engine(llm, max_num_batched_tokens=512).generate([PROMPT], PoolingParams(pooling))[0]
    eng = engine(llm, max_num_batched_tokens=5)
    steps = _record_steps(eng)
    chunked = eng.generate([PROMPT], PoolingParams(pooling))[0]
    assert len(steps) >= len(ids_of(llm, PROMPT)) // 5
    np.testing.assert_allclose(chunked.outputs.embedding, whole.outputs.embedding, rtol=0, atol=CHUNKED_ATOL)


def test_mean_pooling_takes_no_prefix_hit_last_pooling_may(llm):
    eng = engine(llm)
    first = eng.generate([PROMPT], PoolingParams("mean"))[0]
    again = eng.generate([PROMPT], PoolingParams("mean"))[0]
    assert again.num_cached_tokens == 0
    assert again.outputs.embedding == first.outputs.embedding
    eng.generate([PROMPT], SamplingParams(max_tokens=1))  # its blocks go to the prefix cache
    last = eng.generate([PROMPT], PoolingParams("last"))[0]
    assert last.num_cached_tokens > 0  # the prefix was reused, the last token computed
    want = reference(llm, ids_of(llm, PROMPT), "last")
    np.testing.assert_allclose(last.outputs.embedding, want, rtol=0, atol=1e-5)


def test_abort_mid_prefill_frees_blocks(llm):
    eng = engine(llm, max_num_batched_tokens=4)
    rid = eng.add_request(None, PROMPT, PoolingParams("mean"))
    eng.step()
    assert eng.scheduler.stats()["kv_live_blocks"] > 0
    out = eng.abort_request(rid)
    assert out.finished and out.finish_reason == "abort" and out.outputs.embedding == []
    assert eng.scheduler.stats()["kv_live_blocks"] == 0 and eng.scheduler.num_pooling == 0
    assert not eng.has_unfinished_requests()
    assert eng.step() == []


def test_stream_and_background_loop(llm):
    eng = engine(llm)
    try:
        s = eng.submit(PROMPT, PoolingParams("last"))
        out = s.result(timeout=60)
        np.testing.assert_allclose(out.outputs.embedding, reference(llm, ids_of(llm, PROMPT), "last"), atol=1e-5)
    finally:
        eng.shutdown()


def test_model_without_forward_hidden_is_refused_at_the_door():
    eng = LLMEngine(TinyModel(vocab_size=64, max_model_len=64), num_blocks=16)
    with pytest.raises(InvalidRequestError, match="forward_hidden") as e:
        eng.add_request(None, [1, 2, 3], PoolingParams())
    assert e.value.param == "input"
    assert not eng.has_unfinished_requests()


def test_pooling_params_are_checked():
    with pytest.raises(ValueError, match="pooling must be one of"):
        PoolingParams("cls")
    with pytest.raises(TypeError, match="normalize"):
        PoolingParams("mean", normalize="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_mean_pooling_survives_preemption(llm, mode):
    """A pooling request preempted mid-prefill (by a generation that needs its blocks) pools every position once."""
    long = " ".join([PROMPT] * 4)
    eng = engine(llm, num_blocks=9, max_num_batched_tokens=4, preemption_mode=mode, watermark=0.0)
    gen = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    want_gen = engine(llm).generate([PROMPT], gen)[0]
    out_gen, out_pool = eng.generate([PROMPT, long], [gen, PoolingParams("mean")])
    assert eng.scheduler.num_preemptions > 0
    assert out_gen.outputs[0].token_ids == want_gen.outputs[0].token_ids
    want = reference(llm, ids_of(llm, long), "mean")
    np.testing.assert_allclose(out_pool.outputs.embedding, want, rtol=0, atol=CHUNKED_ATOL)
