"""prompt_logprobs cover every prompt position (first None, as vLLM), whatever step the request ends in.

Before: the entries computed in the step in which the request finished were dropped, so a 10-token
prompt with ``max_tokens=1`` got one entry (the leading None) and a chunked 690-token prompt 513.
The oracle is one direct forward of the whole prompt on a fresh cache, log-softmaxed.
"""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv_rs.engine import LLMEngine
from pagedkv_rs.engine.request import Logprob, SamplingParams
from pagedkv_rs.models import TinyModel

MODEL = TinyModel(num_layers=2, hidden_size=32, num_heads=2, num_kv_heads=1, vocab_size=96, max_model_len=1024)


def full_prompt_log_softmax(prompt: list[int], backend: str) -> np.ndarray:
    """float64 [len(prompt), vocab]: row j = log-softmax of the logits after ``prompt[: j + 1]``, one forward."""
    e = LLMEngine(MODEL, num_blocks=80, block_size=16, backend=backend, enable_prefix_caching=False)
    e.kv_manager.allocate(0, prompt, None)
    batch = e.kv_manager.prepare_batch([0], [len(prompt)])
    logits = MODEL.forward(batch, e.kv_caches, logits_indices=np.arange(len(prompt))).astype(np.float64)
    m = logits.max(axis=1, keepdims=True)
    return logits - m - np.log(np.exp(logits - m).sum(axis=1, keepdims=True))


def assert_matches(plp, prompt: list[int], ref: np.ndarray, k: int) -> None:
    assert len(plp) == len(prompt) and plp[0] is None
    for j in range(1, len(prompt)):
        d, row = plp[j], ref[j - 1]
        assert prompt[j] in d and len(d) <= k + 1, j
        top = np.argsort(-row, kind="stable")[:k].tolist()
        assert set(top) <= set(d), j
        for t, lp in d.items():
            assert isinstance(lp, Logprob)
            assert lp.logprob == pytest.approx(row[t], abs=1e-5), (j, t)
        assert d[prompt[j]].rank == 1 + int((row > row[prompt[j]] + 1e-9).sum())


def test_a_short_prompt_finishing_in_its_first_step_gets_every_position(backend):
    prompt = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
    e = LLMEngine(MODEL, num_blocks=32, block_size=4, backend=backend.name)
    (out,) = e.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1, ignore_eos=True))
    assert_matches(out.prompt_logprobs, prompt, full_prompt_log_softmax(prompt, backend.name), 1)


def test_a_chunked_long_prompt_gets_every_position(backend):
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, MODEL.vocab_size, 690).tolist()
    e = LLMEngine(MODEL, num_blocks=80, block_size=16, backend=backend.name, max_num_batched_tokens=256)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3, ignore_eos=True)
    (out,) = e.generate([prompt], params)
    assert e.scheduler.num_steps == 3  # 690 prompt tokens in chunks of 256
    assert_matches(out.prompt_logprobs, prompt, full_prompt_log_softmax(prompt, backend.name), 3)


@pytest.mark.parametrize("max_tokens", [1, 4])
def test_n_completions_share_the_prompt_logprobs(backend, max_tokens):
    prompt = [7, 8, 9, 10, 11, 12, 13]
    e = LLMEngine(MODEL, num_blocks=32, block_size=4, backend=backend.name)
    params = SamplingParams(n=3, max_tokens=max_tokens, temperature=1.0, seed=5, prompt_logprobs=2, ignore_eos=True)
    (out,) = e.generate([prompt], params)
    assert len(out.outputs) == 3 and all(len(c.token_ids) == max_tokens for c in out.outputs)
    assert_matches(out.prompt_logprobs, prompt, full_prompt_log_softmax(prompt, backend.name), 2)
    assert e.kv_manager.num_live_blocks == 0


def test_a_streamed_request_reports_them_in_its_final_output(backend):
    prompt = list(range(20, 45))
    e = LLMEngine(MODEL, num_blocks=32, block_size=4, backend=backend.name, max_num_batched_tokens=8)
    try:
        outs = list(e.submit(prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, ignore_eos=True)))
    finally:
        e.shutdown()
    assert_matches(outs[-1].prompt_logprobs, prompt, full_prompt_log_softmax(prompt, backend.name), 0)
