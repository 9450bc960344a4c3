"""vLLM's sampling options: validation, penalties / min_p / min_tokens in numpy, stop strings, logprobs, n."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv_rs.engine import LLMEngine
from pagedkv_rs.engine.request import Logprob, SamplingParams
from pagedkv_rs.engine.sampling import apply_penalties, sample, top_logprobs
from pagedkv_rs.models import TinyModel

MODEL = TinyModel(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, vocab_size=128, max_model_len=128)
SMALL = TinyModel(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, vocab_size=16, max_model_len=64)
PROMPT = [5, 6, 7, 8, 9, 10, 11]


class Tok:
    """Character-level toy tokenizer: one character per token id."""

    def encode(self, text: str) -> list[int]:
        return [2 + ord(c) % 126 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(32 + i % 90) for i in ids)


def engine(backend, model=MODEL, **kw) -> LLMEngine:
    kw.setdefault("num_blocks", 64)
    return LLMEngine(model, block_size=4, backend=backend, **kw)


def assert_clean(e: LLMEngine) -> None:
    assert not e.has_unfinished_requests()
    assert e.kv_manager.num_live_blocks == 0 and e.kv_manager.stats()["num_seqs"] == 0
    e.kv_manager.check_invariants()
    assert e._streams == {} and e.runner.host == {}


def run(e: LLMEngine, prompt, params):
    return e.generate([prompt], params)[0]


# ------------------------------------------------------------------ validation
@pytest.mark.parametrize(
    "kw, exc, match",
    [
        ({"n": 0}, ValueError, "n must be"),
        ({"n": 1.0}, TypeError, "n must be an int"),
        ({"stop": 5}, TypeError, "stop"),
        ({"stop": ["ok", 3]}, TypeError, "stop"),
        ({"stop": [""]}, ValueError, "non-empty"),
        ({"include_stop_str_in_output": "yes"}, TypeError, "include_stop_str_in_output"),
        ({"logprobs": 21}, ValueError, "logprobs"),
        ({"logprobs": -1}, ValueError, "logprobs"),
        ({"prompt_logprobs": "3"}, TypeError, "prompt_logprobs"),
        ({"presence_penalty": 2.5}, ValueError, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, ValueError, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, ValueError, "repetition_penalty"),
        ({"min_p": 1.5}, ValueError, "min_p"),
        ({"min_tokens": -1}, ValueError, "min_tokens"),
        ({"min_tokens": 20, "max_tokens": 10}, ValueError, "min_tokens must be <= max_tokens"),
    ],
)
def test_sampling_params_validate_new_fields(kw, exc, match):
    with pytest.raises(exc, match=match):
        SamplingParams(**kw)


def test_sampling_params_normalise_stop_and_stay_hashable():
    p = SamplingParams(stop="a", n=3, logprobs=0, min_p=0.1)
    assert p.stop == ("a",) and hash(p) == hash(SamplingParams(stop=["a"], n=3, logprobs=0, min_p=0.1))
    assert not SamplingParams().has_penalties and SamplingParams(min_tokens=1).has_penalties


# -------------------------------------------------------------- numpy sampling
def _penalties_reference(logits, params, outs, prompts, stops):
    x = logits.astype(np.float64).copy()
    for i, p in enumerate(params):
        row = x[i]
        for t in set(outs[i]) | set(prompts[i]):
            if p.repetition_penalty != 1.0:
                row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
        for t in set(outs[i]):
            row[t] -= p.frequency_penalty * outs[i].count(t) + p.presence_penalty
        if len(outs[i]) < p.min_tokens:
            for t in stops[i]:
                row[t] = -np.inf
    return x


def test_penalties_match_a_per_row_reference():
    rng = np.random.default_rng(0)
    b, v = 6, 50
    logits = rng.standard_normal((b, v)).astype(np.float32) * 3
    params = [
        SamplingParams(),
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(presence_penalty=0.7, frequency_penalty=-0.4),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=1.5, min_tokens=5),
        SamplingParams(min_tokens=2),
        SamplingParams(presence_penalty=-2.0, repetition_penalty=2.0),
    ]
    outs = [rng.integers(0, v, size=int(rng.integers(0, 8))).tolist() for _ in range(b)]
    outs[4] = [1, 2, 3]  # past min_tokens: nothing masked
    prompts = [rng.integers(0, v, size=5).tolist() for _ in range(b)]
    stops = [{1, 49}, {2}, {3}, {4, 7, 999}, {5}, {6}]  # 999 is outside the vocabulary: ignored
    got = apply_penalties(logits, params, outs, prompts, stops)
    stops[3] = {4, 7}
    np.testing.assert_allclose(got, _penalties_reference(logits, params, outs, prompts, stops))


def test_greedy_fast_path_without_penalties_and_argmax_after_them():
    logits = np.array([[0.0, 5.0, 4.0], [3.0, 1.0, 0.0]], np.float32)
    plain = [SamplingParams(temperature=0)] * 2
    assert sample(logits, plain, [None, None]).tolist() == [1, 0]
    rep = [SamplingParams(temperature=0, repetition_penalty=2.0), SamplingParams(temperature=0)]
    got = sample(logits, rep, [None, None], output_token_ids=[[1], []], prompt_token_ids=[[0], [0]], stop_ids=[(), ()])
    assert got.tolist() == [2, 0]  # 5 / 2 < 4
    with pytest.raises(ValueError, match="output_token_ids"):
        sample(logits, rep, [None, None])


def test_min_p_keeps_only_tokens_near_the_top():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]] * 400))
    p = SamplingParams(temperature=1.0, min_p=0.5)
    got = sample(logits, [p] * 400, [np.random.default_rng(i) for i in range(400)])
    assert set(got.tolist()) == {0, 1}  # 0.15 < 0.5 * 0.5
    p = SamplingParams(temperature=1.0, min_p=0.0)
    got = sample(logits, [p] * 400, [np.random.default_rng(i) for i in range(400)])
    assert set(got.tolist()) == {0, 1, 2, 3}


def test_top_logprobs_against_log_softmax():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 30)).astype(np.float32)
    toks = np.array([0, 5, 29, 11])
    got = top_logprobs(x, toks, [3, 0, 5, 1])
    ref = x.astype(np.float64) - np.log(np.exp(x.astype(np.float64)).sum(axis=1, keepdims=True))
    for i, (ids, lps, ranks) in enumerate(got):
        k = [3, 0, 5, 1][i]
        assert ids[:k] == np.argsort(-ref[i], kind="stable")[:k].tolist() and ranks[:k] == list(range(1, k + 1))
        assert ids[-1] == toks[i] and ranks[-1] == 1 + int((ref[i] > ref[i, toks[i]]).sum())
        np.testing.assert_allclose(lps, ref[i, ids], rtol=1e-12)


# --------------------------------------------------------------------- engine
def test_min_tokens_masks_eos_and_stop_tokens(backend):
    e = engine(backend.name)
    free = run(e, PROMPT, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)).token_ids
    stop = free[1]
    out = run(e, PROMPT, SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop]))
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop and len(out.token_ids) <= 2
    out = run(e, PROMPT, SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop], min_tokens=6))
    assert stop not in out.token_ids[:6] and len(out.token_ids) >= 6
    assert_clean(e)


def test_penalties_change_greedy_output_and_seeded_rows_stay_batch_independent(backend):
    e = engine(backend.name)
    base = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    plain = run(e, PROMPT, base).token_ids
    pen = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, repetition_penalty=1.8, frequency_penalty=1.0)
    out = run(e, PROMPT, pen).token_ids
    assert out != plain and len(set(out)) >= len(set(plain))
    seeded = SamplingParams(max_tokens=12, temperature=0.9, seed=7, presence_penalty=1.0, min_p=0.05)
    alone = run(engine(backend.name), PROMPT, seeded).token_ids
    others = [[20 + i, 21, 22] for i in range(5)]
    outs = e.generate(others + [PROMPT], [SamplingParams(max_tokens=9, temperature=1.0)] * 5 + [seeded])
    assert outs[-1].token_ids == alone
    assert_clean(e)


def test_stop_strings_across_token_boundaries(backend):
    e = engine(backend.name, tokenizer=Tok())
    full = run(e, PROMPT, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    text = full.text
    stop = text[4:7]  # three characters = three tokens
    i = text.find(stop)
    out = run(e, PROMPT, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=["\x7f", stop]))
    c = out.outputs[0]
    assert (c.finish_reason, c.stop_reason, c.text) == ("stop", stop, text[:i])
    assert c.token_ids == full.token_ids[: i + len(stop)]  # the tokens that completed the match stay
    out = run(
        e,
        PROMPT,
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=stop, include_stop_str_in_output=True),
    )
    assert out.text == text[: i + len(stop)] and out.finish_reason == "stop"
    out = run(e, PROMPT, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=stop, min_tokens=12))
    assert len(out.token_ids) >= 12
    assert_clean(e)


def test_streamed_text_holds_back_a_possible_stop_string(backend):
    e = engine(backend.name, tokenizer=Tok())
    full = run(e, PROMPT, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)).text
    stop = full[8:11]
    try:
        seen = [
            o.text for o in e.submit(PROMPT, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=stop))
        ]
    finally:
        e.shutdown()
    cut = full[: full.find(stop)]
    assert seen[-1] == cut and all(stop not in t and cut.startswith(t) for t in seen)
    assert_clean(e)


def _log_softmax(x):
    x = x.astype(np.float64)
    return x - np.log(np.exp(x - x.max()).sum()) - x.max()


class Recording(TinyModel):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.logits: list[np.ndarray] = []

    def forward(self, batch, kv_caches, logits_indices=None):
        out = super().forward(batch, kv_caches, logits_indices)
        self.logits.append(out)
        return out


def test_sample_logprobs_are_the_raw_distributions(backend):
    m = Recording(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, vocab_size=128, max_model_len=128)
    e = LLMEngine(m, num_blocks=64, block_size=4, backend=backend.name, tokenizer=Tok())
    out = run(e, PROMPT, SamplingParams(max_tokens=5, temperature=0.8, seed=1, logprobs=3, ignore_eos=True))
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == len(m.logits) == 5
    for d, tok, logits in zip(c.logprobs, c.token_ids, m.logits):
        ref = _log_softmax(logits[0])
        assert tok in d and 3 <= len(d) <= 4
        top = sorted(d.items(), key=lambda kv: kv[1].rank)[:3]
        assert [t for t, _ in top] == np.argsort(-ref, kind="stable")[:3].tolist()
        for t, lp in d.items():
            assert isinstance(lp, Logprob) and lp.decoded_token == Tok().decode([t])
            assert lp.logprob == pytest.approx(ref[t], abs=1e-9)
        assert d[tok].rank == 1 + int((ref > ref[tok]).sum())
    assert c.cumulative_logprob == pytest.approx(sum(d[t].logprob for d, t in zip(c.logprobs, c.token_ids)))
    assert_clean(e)


@pytest.mark.parametrize("chunk", [64, 3])
def test_prompt_logprobs_cover_every_prompt_token_despite_the_prefix_cache(backend, chunk):
    prompt = [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    e = LLMEngine(SMALL, num_blocks=32, block_size=4, backend=backend.name, max_num_batched_tokens=chunk)
    ref = []  # logprob of prompt[j] given prompt[:j]: the full next-token distribution of that prefix
    for j in range(1, len(prompt)):
        o = run(e, prompt[:j], SamplingParams(max_tokens=1, temperature=0, logprobs=15, ignore_eos=True))
        ref.append(o.outputs[0].logprobs[0][prompt[j]].logprob)
    run(e, prompt, SamplingParams(max_tokens=1, temperature=0))  # now the prompt's blocks are cached
    assert e.kv_manager.num_cached_blocks > 0
    out = run(e, prompt, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2, ignore_eos=True))
    plp = out.prompt_logprobs
    assert len(plp) == len(prompt) and plp[0] is None and out.num_cached_tokens == 0
    for j in range(1, len(prompt)):
        assert prompt[j] in plp[j] and len(plp[j]) <= 3
        assert plp[j][prompt[j]].logprob == pytest.approx(ref[j - 1], abs=1e-6)
    assert_clean(e)


def test_prompt_logprobs_need_a_model_that_takes_logits_indices(backend):
    class LastOnly(TinyModel):
        def forward(self, batch, kv_caches):
            return super().forward(batch, kv_caches)

    e = LLMEngine(LastOnly(vocab_size=64), num_blocks=16, block_size=4, backend=backend.name)
    with pytest.raises(Exception, match="logits_indices"):
        e.add_request("a", [1, 2, 3], SamplingParams(prompt_logprobs=1))
    assert not e.has_unfinished_requests()


# --------------------------------------------------------------------------- n
def test_n_completions_share_the_prompt_blocks(backend):
    e = engine(backend.name, num_blocks=64)
    prompt = list(range(2, 20))  # 18 tokens: 4 full blocks and a partial one
    params = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=11, ignore_eos=True)
    e.add_request("g", prompt, params)
    first = e.step()  # the prefill: the head samples, then two forks of its blocks
    assert first and len(first[0].outputs) == 3
    table = e.kv_manager.block_table(e.scheduler.requests["g"].seq_id)
    assert [e.kv_manager.ref_count(b) for b in table] == [3] * len(table)
    assert e.kv_manager.num_live_blocks == len(table)
    res = None
    while e.has_unfinished_requests():
        for o in e.step():
            res = o
    assert res.finished and [c.index for c in res.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 and c.finish_reason == "length" for c in res.outputs)
    assert len({tuple(c.token_ids) for c in res.outputs}) > 1
    one = run(engine(backend.name), prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=11, ignore_eos=True))
    assert res.outputs[0].token_ids == one.token_ids  # completion 0 draws what the n=1 request draws
    assert e.stats()["generation_tokens"] == 18 and e.stats()["num_finished"] == 1
    assert_clean(e)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_n_under_memory_pressure_keeps_seeded_outputs(backend, mode):
    params = SamplingParams(n=4, max_tokens=14, temperature=1.0, seed=5, ignore_eos=True, logprobs=1)
    prompts = [list(range(3, 15)), list(range(30, 41))]
    ample = engine(backend.name, num_blocks=128).generate(prompts, params)
    tight = engine(backend.name, num_blocks=22, preemption_mode=mode)
    outs = tight.generate(prompts, params)
    assert tight.scheduler.num_preemptions > 0
    for a, b in zip(ample, outs):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        assert all(len(c.logprobs) == 14 for c in b.outputs)
    assert_clean(tight)


def test_n_abort_and_first_token_stop(backend):
    e = engine(backend.name)
    e.add_request("g", PROMPT, SamplingParams(n=3, max_tokens=50, temperature=1.0, seed=3, ignore_eos=True))
    e.step()
    e.step()
    out = e.abort_request("g", reason="client_disconnect")
    assert out.finished and all(c.finish_reason == "abort" for c in out.outputs) and len(out.outputs) == 3
    assert e.stats()["aborted_by_cause"] == {"client_disconnect": 1}
    assert_clean(e)
    e.add_request("w", PROMPT, SamplingParams(n=2, max_tokens=50))
    out = e.abort_request("w")  # still waiting: its completions were never forked
    assert len(out.outputs) == 2 and out.finished
    assert_clean(e)
    out = run(e, PROMPT, SamplingParams(n=3, max_tokens=1, temperature=0))
    assert [c.token_ids for c in out.outputs] == [out.outputs[0].token_ids] * 3
    assert_clean(e)
