"""Speculative sampling keeps the output distribution: the acceptance rule, and the engine both ways.

The rule (a one-hot draft ``t``: accept with probability ``p(t)``, else draw from ``p`` without ``t``) must make
every emitted position distributed as ``p``. ``verify`` is sampled many times against the exact ``p``
(with the request's temperature, top-k and top-p applied), and the same bound is shown to catch two wrong rules.
Then the engine itself: token histograms with and without speculation agree.
"""

from __future__ import annotations

import numpy as np

from pagedkv_rs.engine import LLMEngine
from pagedkv_rs.engine.request import SamplingParams
from pagedkv_rs.engine.sampling import probabilities
from pagedkv_rs.engine.speculative import verify
from pagedkv_rs.models import TinyModel

N = 20000
BOUND = 0.02  # total variation distance; the sampling noise at N draws over 8 tokens is ~0.005


def tv(counts: np.ndarray, p: np.ndarray) -> float:
    return 0.5 * float(np.abs(counts / counts.sum() - p).sum())


def logits_and_params():
    x = np.log(
        np.array([[0.30, 0.25, 0.15, 0.1, 0.08, 0.06, 0.04, 0.02], [0.05, 0.4, 0.2, 0.15, 0.1, 0.05, 0.03, 0.02]])
    )
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.95)
    return x.astype(np.float32), params


def emitted_histograms(rule, x, params, drafts):
    g = np.random.default_rng(1)
    first = np.zeros(x.shape[1])
    second = np.zeros(x.shape[1])  # the position after an accepted first draft
    for _ in range(N):
        out = rule([x], [drafts], [params], [g])[0]
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    return first, second


def test_verify_keeps_each_position_distributed_as_p():
    x, params = logits_and_params()
    p = probabilities(x, [params, params])
    assert abs(p[0, 6]) < 1e-12 and p[1].sum() == 1.0  # top-k cut token 6, the rows are distributions
    drafts = [1]  # p(1) = 0.25-ish at position 0: accepted about a quarter of the time, then the bonus
    first, second = emitted_histograms(verify, x, params, drafts)
    assert tv(first, p[0]) < BOUND
    assert second.sum() > 0.2 * N and tv(second, p[1]) < BOUND


def test_the_bound_catches_wrong_rules():
    x, params = logits_and_params()
    p = probabilities(x, [params, params])

    def accept_always(logits, drafts, params_, gens):
        return [[drafts[0][0]]]

    def resample_without_removing(logits, drafts, params_, gens):
        q, g, t = p[0], gens[0], drafts[0][0]
        if g.random() < q[t]:
            return [[t]]
        return [[int(np.searchsorted(np.cumsum(q), g.random() * q.sum(), side="right"))]]

    for wrong in (accept_always, resample_without_removing):
        first, _ = emitted_histograms(wrong, x, params, [0])
        assert tv(first, p[0]) > 2 * BOUND, wrong.__name__


def test_greedy_rows_in_verify_take_the_argmax_run():
    x = np.log(np.array([[0.1, 0.6, 0.3], [0.7, 0.2, 0.1], [0.2, 0.2, 0.6]]))
    greedy = SamplingParams(temperature=0)
    assert verify([x], [[1, 0]], [greedy], [None]) == [[1, 0, 2]]  # both accepted, then the bonus
    assert verify([x], [[1, 2]], [greedy], [None]) == [[1, 0]]  # the second rejected: the argmax instead
    assert verify([x], [[2, 0]], [greedy], [None]) == [[1]]


def test_verify_reads_row_blocks_as_their_stack():
    """Rows handed as blocks (views of a step's logits, as the runner hands them) verify as the stacked array:
    greedy, sampled and penalised sequences, several at once; a block count that does not add up is refused."""
    rng = np.random.default_rng(3)
    drafts = [[1, 4, 2], [0], [3, 3]]
    x = [rng.standard_normal((len(d) + 1, 6)).astype(np.float32) for d in drafts]
    x[0][0, 1] = x[0][1, 4] = 9.0  # the greedy sequence accepts its first two drafts
    cases = [
        [SamplingParams(temperature=0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3)],
        [SamplingParams(temperature=0, repetition_penalty=1.3)] * 3,
    ]
    history = ([[1, 2], [5], []], [[0, 1], [2], [3]], [(), (), ()])
    results = []
    for params in cases:
        blocks = [(a[:-1], a[-1:]) for a in x]
        want = verify(x, drafts, params, [np.random.default_rng(9) for _ in drafts], history)
        got = verify(blocks, drafts, params, [np.random.default_rng(9) for _ in drafts], history)
        assert got == want
        results.append(got)
    assert results[0][0][:2] == [1, 4]  # the unpenalised greedy sequence accepted its first two drafts
    with np.testing.assert_raises(ValueError):
        verify([(x[0][:-2], x[0][-1:])], drafts[:1], cases[0][:1], [None])


def engine_histograms(model, spec, vocab, runs=1200, **kw):
    """Per output position, the token counts of ``runs`` temperature-1 samples of one prompt (4 tokens each),
    and the engine's stats. Every prompt goes in one prefill step, then decode-only steps of all the runs: those
    are the steps that draft."""
    prompt = [2, 3, 4, 5, 2, 3, 4, 5, 2, 3, 4, 5, 2, 3]
    params = SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True)
    big = {"max_num_seqs": runs, "max_num_batched_tokens": runs * len(prompt), "num_blocks": 6000}
    e = LLMEngine(model, block_size=4, backend="python", speculative=spec, seed=7, **big, **kw)
    outs = e.generate([prompt] * runs, params, use_tqdm=False)
    toks = np.array([o.outputs[0].token_ids for o in outs])  # [runs, 4]
    return np.stack([np.bincount(toks[:, j], minlength=vocab) for j in range(4)]), e.stats()


def assert_same_distribution(a: np.ndarray, b: np.ndarray, runs: int = 1200) -> None:
    for j in range(4):  # two samples of 1200 over 8-16 tokens: the noise is ~0.04-0.05
        assert 0.5 * np.abs(a[j] / runs - b[j] / runs).sum() < 0.08, j


def test_the_engine_samples_the_same_distribution_with_and_without_speculation():
    model = TinyModel(
        num_layers=1, hidden_size=16, num_heads=2, num_kv_heads=1, vocab_size=8, max_model_len=256, seed=4
    )
    plain, _ = engine_histograms(model, None, 8)
    spec, stats = engine_histograms(model, "ngram:k=3,n=2,max_batch=2000,adaptive=0", 8)
    assert stats["spec_decode_num_accepted_tokens"] > 200
    assert_same_distribution(plain, spec)


def test_the_engine_samples_the_same_distribution_with_a_draft_model(tmp_path):
    """The draft model is the target itself: its argmax is accepted as often as the target draws it."""
    from pagedkv_rs.models.llama import LlamaModel
    from pagedkv_rs.models.synthetic import SyntheticSpec, write_synthetic_gguf

    small = SyntheticSpec(
        num_layers=1,
        hidden_size=32,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
        vocab_size=16,
        weight_type="Q8_0",
        embed_type="Q8_0",
    )
    path = write_synthetic_gguf(tmp_path / "v16.gguf", small, seed=5)
    model = LlamaModel.load(path)
    plain, _ = engine_histograms(model, None, 16)
    spec, stats = engine_histograms(model, f"draft:{path}:k=3,max_batch=2000,adaptive=0", 16)
    assert stats["spec_decode_num_accepted_tokens"] > 200
    assert stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]  # some rejected
    assert stats["spec_decode_draft_kv_live_blocks"] == 0
    assert_same_distribution(plain, spec)
