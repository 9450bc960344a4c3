"""Speculative decoding (n-gram drafts): the proposer, the KV rollback, and outputs equal to plain decoding.

Greedy: every output (tokens, logprobs, finish reasons) equals the one without speculation, with the allocator
invariants checked after every step on both backends, through stop tokens and strings, max_tokens, aborts,
preemptions, n > 1 and prefix caching. Sampling: ``test_speculative_sampling.py``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pagedkv_rs.engine import LLMEngine
from pagedkv_rs.engine.request import RequestMetrics, RequestStatus, SamplingParams
from pagedkv_rs.engine.speculative import SpeculativeConfig, propose_ngram
from pagedkv_rs.models import TinyModel

MODEL = TinyModel(num_layers=2, hidden_size=32, num_heads=2, num_kv_heads=1, vocab_size=64, max_model_len=1024)
SPEC = "ngram:k=4,n=3,adaptive=0"  # every draft on offer taken: the outputs do not depend on timing


def repeating_prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    base = rng.integers(2, 64, 20).tolist()
    return [base * 3, base[:7] * 5, rng.integers(2, 64, 30).tolist(), base[:5] * 2 + base]


# ------------------------------------------------------------------------------------------ proposer
def test_ngram_takes_the_longest_suffix_match_and_its_latest_occurrence():
    t = np.array([1, 2, 3, 9, 9, 2, 3, 7, 8, 5, 2, 3])
    # suffix [2, 3]: at 1-2 (then 9 9 2) and 5-6 (then 7 8 5); the latest wins
    assert propose_ngram(t, 3, 2) == [7, 8, 5]
    # the longer suffix [5, 2, 3] occurs nowhere before: the 2-gram still matches
    assert propose_ngram(t, 2, 3) == [7, 8]
    # drafts stop at the end of the history
    assert propose_ngram(np.array([4, 5, 6, 4, 5]), 4, 2) == [6, 4, 5]
    assert propose_ngram(np.array([4, 5, 6, 7]), 4, 3) == []
    # min_n: a 1-token match is not enough
    assert propose_ngram(np.array([1, 5, 2, 6, 5]), 4, 3, min_n=2) == []
    assert propose_ngram(np.array([1, 5, 2, 6, 5]), 4, 3, min_n=1) == [2, 6, 5]
    assert propose_ngram(np.array([3]), 4, 3) == []


def test_the_default_suffix_tells_apart_a_copied_texts_repeated_phrases():
    """A code copy repeats short phrases (`self.`, `import`): three tokens match the latest of them, five the
    line being copied. The default ``n`` (5) drafts from the line being copied."""
    src = [10, 11, 12, 13, 14, 20, 21, 22]  # e.g. "def push(self, job" -> ": Job)"
    other = [30, 12, 13, 14, 40, 41, 42]  # a later line sharing the 3-token phrase 12 13 14
    history = np.array(src + other + [50] + src[:5])  # the copy has reached the first line's 12 13 14
    assert propose_ngram(history, 3, 3) == [40, 41, 42]  # the latest 3-token match: the wrong line
    cfg = SpeculativeConfig()
    assert propose_ngram(history, 3, cfg.n, cfg.min_n) == [20, 21, 22]


def test_config_parses_the_flag_and_refuses_what_it_does_not_know():
    assert SpeculativeConfig.of("ngram") == SpeculativeConfig()
    assert SpeculativeConfig.of("ngram:k=6,n=2") == SpeculativeConfig(k=6, n=2)
    assert SpeculativeConfig.of("ngram:adaptive=0") == SpeculativeConfig(adaptive=False)
    with pytest.raises(ValueError, match="adaptive must be a bool"):
        SpeculativeConfig.of("ngram:adaptive=2")
    assert SpeculativeConfig.of({"k": 2}) == SpeculativeConfig(k=2)
    assert SpeculativeConfig.of(None) is None
    with pytest.raises(ValueError, match="bad speculative option"):
        SpeculativeConfig.of("ngram:q=3")
    with pytest.raises(ValueError, match="k must be"):
        SpeculativeConfig.of("ngram:k=0")
    with pytest.raises(ValueError, match="min_n"):
        SpeculativeConfig(n=2, min_n=3)
    with pytest.raises(TypeError):
        SpeculativeConfig.of(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="method"):
        LLMEngine(MODEL, num_blocks=8, speculative="medusa")


def test_a_model_without_logits_indices_is_refused():
    class LastOnly:
        def __init__(self) -> None:
            self.__dict__.update({k: getattr(MODEL, k) for k in ("num_layers", "num_kv_heads", "head_dim")})
            self.vocab_size, self.max_model_len, self.eos_token_ids = 64, 256, (1,)

        def forward(self, batch, kv_caches):
            return MODEL.forward(batch, kv_caches)

    with pytest.raises(ValueError, match="logits_indices"):
        LLMEngine(LastOnly(), num_blocks=8, speculative="ngram")
    LLMEngine(LastOnly(), num_blocks=8)


# ------------------------------------------------------------------------------------------ rollback
def test_truncate_frees_the_tail_and_unregisters_partial_blocks(backend):
    m = backend.KVCacheManager(8, 4)
    m.allocate(1, list(range(5)))
    m.prepare_batch([1], [5])
    m.append(1, [50, 51, 52, 53, 54])
    m.prepare_batch([1], [5])
    table = m.block_table(1)
    assert m.block_hash(table[1]) is not None and m.block_hash(table[2]) is None
    with pytest.raises(ValueError, match="cannot truncate"):
        m.truncate(1, 0)
    with pytest.raises(ValueError, match="cannot truncate"):
        m.truncate(1, 11)
    assert m.token_ids(1) == [0, 1, 2, 3, 4, 50, 51, 52, 53, 54]  # refused: nothing changed
    m.truncate(1, 6)
    assert m.token_ids(1) == [0, 1, 2, 3, 4, 50]
    assert m.block_table(1) == table[:2] and m.num_computed_tokens(1) == 6
    assert m.block_hash(table[0]) is not None
    assert m.block_hash(table[1]) is None  # its slots 6.. will be written again
    assert m.num_cached_blocks == 0 and m.num_free_blocks == 6
    m.check_invariants()
    # a block shared with a fork keeps its hash: the sibling's content is unchanged
    m.append(1, [60, 61])
    m.prepare_batch([1], [2])
    m.fork(1, 2)
    m.truncate(1, 5)
    assert m.block_hash(table[1]) is not None and m.ref_count(table[1]) == 2
    assert m.append(1, [70]) == [(table[1], m.block_table(1)[1])]  # copy-on-write, the shared block intact
    m.check_invariants()


# ------------------------------------------------------------------------------------------ greedy
def run(prompts, params, backend, spec, *, check=True, abort_at=None, **kw):
    """Outputs by prompt index (stepping by hand, allocator invariants after every step) and the engine."""
    kw.setdefault("num_blocks", 96)
    kw.setdefault("block_size", 4)
    e = LLMEngine(MODEL, backend=backend, speculative=spec, **kw)
    ps = params if isinstance(params, list) else [params] * len(prompts)
    ids = [e.add_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, ps))]
    final = {}
    steps = 0
    while e.has_unfinished_requests():
        for o in e.step():
            if o.finished:
                final[o.request_id] = o
        steps += 1
        if check:
            e.kv_manager.check_invariants()
            for r in e.scheduler.running:  # KV holds exactly the tokens before the pending one
                assert e.kv_manager.token_ids(r.seq_id) == r.all_token_ids[: r.num_kv_tokens]
        if abort_at is not None and steps == abort_at[0]:
            final[abort_at[1]] = e.abort_request(abort_at[1])
    return [final[i] for i in ids], e


def summary(outs):
    return [
        [(c.token_ids, c.finish_reason, c.stop_reason, c.text if c.text is not None else None) for c in o.outputs]
        for o in outs
    ]


def test_greedy_outputs_equal_plain_decoding_with_drafts_accepted(backend):
    prompts = repeating_prompts()
    sp = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    plain, _ = run(prompts, sp, backend.name, None)
    spec, e = run(prompts, sp, backend.name, SPEC)
    assert summary(spec) == summary(plain)
    s = e.stats()
    assert s["spec_decode_num_accepted_tokens"] > 60  # the repeating prompts are copied
    assert s["num_steps"] < 45  # 60 tokens in fewer steps than plain's 60 decode steps
    assert 1.0 < s["spec_decode_mean_accepted_length"] <= 5.0
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):  # per request, adding up
        assert sum(getattr(o.metrics, key) for o in spec) == s[f"spec_decode_{key}"]
    assert spec[0].metrics.num_accepted_tokens > 0


def test_logprobs_penalties_and_stop_tokens_match(backend):
    prompts = repeating_prompts(1)
    stop = plain_outs = None
    sp = SamplingParams(max_tokens=50, temperature=0, logprobs=3, ignore_eos=True)
    plain_outs, _ = run(prompts, sp, backend.name, None)
    # a stop token the greedy output reaches mid-run
    stop = plain_outs[0].outputs[0].token_ids[17]
    params = [
        sp,
        dataclasses.replace(sp, repetition_penalty=1.3, frequency_penalty=0.2, min_tokens=3),
        dataclasses.replace(sp, stop_token_ids=(stop,)),
        dataclasses.replace(sp, max_tokens=7),
    ]
    prompts = [prompts[1], prompts[0], prompts[0], prompts[3]]
    plain, _ = run(prompts, params, backend.name, None)
    spec, e = run(prompts, params, backend.name, SPEC)
    assert summary(spec) == summary(plain)
    assert spec[2].outputs[0].finish_reason == "stop" and len(spec[2].outputs[0].token_ids) <= 18
    assert len(spec[3].outputs[0].token_ids) == 7
    for a, b in zip(spec, plain):
        la, lb = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert len(la) == len(lb) == len(a.outputs[0].token_ids)
        for x, y in zip(la, lb):
            assert x.keys() == y.keys()
            assert all(x[t].logprob == pytest.approx(y[t].logprob, abs=1e-5) for t in x)
    assert e.stats()["spec_decode_num_accepted_tokens"] > 0


class Chars:
    """A tokenizer of one character per token id (id 0..63 -> chr(48 + id)): stop strings over ids."""

    def decode(self, ids):
        return "".join(chr(48 + i) for i in ids)

    def encode(self, text, add_special_tokens=False):
        return [ord(c) - 48 for c in text]


def test_a_stop_string_inside_an_accepted_run_stops_where_plain_decoding_does(backend):
    prompts = repeating_prompts(2)[:2]
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain, _ = run(prompts, sp, backend.name, None)
    toks = plain[0].outputs[0].token_ids
    stop_text = Chars().decode(toks[21:23])  # two tokens in the middle of the output
    sps = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop_text], logprobs=1)
    res = []
    for spec in (None, SPEC):
        e = LLMEngine(MODEL, num_blocks=96, block_size=4, backend=backend.name, speculative=spec, tokenizer=Chars())
        res.append(e.generate(prompts, sps))
    assert summary(res[1]) == summary(res[0])
    c = res[1][0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop_text and len(c.logprobs) == len(c.token_ids)
    assert e.stats()["spec_decode_num_accepted_tokens"] > 0


def test_abort_mid_run_and_preemption_leave_no_block(backend):
    prompts = repeating_prompts(3)
    sp = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)
    plain, _ = run(prompts, sp, backend.name, None, num_blocks=40, abort_at=(12, "r1"))
    spec, e = run(prompts, sp, backend.name, SPEC, num_blocks=40, abort_at=(12, "r1"))
    assert spec[1].outputs[0].finish_reason == "abort"
    keep = [0, 2, 3]
    assert summary([spec[i] for i in keep]) == summary([plain[i] for i in keep])
    assert e.scheduler.num_preemptions > 0  # the 40-block pool cannot hold all four
    assert e.kv_manager.num_live_blocks == 0
    e.kv_manager.check_invariants()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_modes(backend, mode):
    prompts = repeating_prompts(4)
    sp = SamplingParams(max_tokens=70, temperature=0, ignore_eos=True)
    plain, _ = run(prompts, sp, backend.name, None, num_blocks=36, preemption_mode=mode)
    spec, e = run(prompts, sp, backend.name, SPEC, num_blocks=36, preemption_mode=mode)
    assert summary(spec) == summary(plain)
    assert e.scheduler.num_preemptions > 0


def test_n_greater_than_one_and_prefix_caching(backend):
    prompts = repeating_prompts(5)
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, n=3)
    plain, _ = run(prompts[:2] * 2, sp, backend.name, None)
    spec, e = run(prompts[:2] * 2, sp, backend.name, SPEC)
    assert summary(spec) == summary(plain)
    assert e.stats()["prefix_cache_hits"] > 0
    # the later copies of the prompts hit only prompt blocks: drafts were never registered
    assert e.stats()["spec_decode_num_accepted_tokens"] > 0


def test_seeded_sampling_gives_the_tokens_of_plain_decoding(backend):
    """One uniform per emitted token, drawn as ``sample`` draws it: a seeded request's output does not depend
    on which steps drafted (nor on how many drafts were accepted)."""
    prompts = repeating_prompts(6)
    hot = SamplingParams(max_tokens=40, temperature=0.3, seed=11, ignore_eos=True, top_k=20, top_p=0.9)
    params = [hot, dataclasses.replace(hot, seed=12, presence_penalty=0.5, min_p=0.05)]
    params += [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)] * 2
    plain, _ = run(prompts, params, backend.name, None)
    spec, e = run(prompts, params, backend.name, SPEC)
    assert summary(spec) == summary(plain)
    assert e.stats()["spec_decode_num_accepted_tokens"] > 0
    other, _ = run(prompts, params, backend.name, "ngram:k=2,n=2,window=2,probe=1")  # the governor switches
    assert summary(other) == summary(plain)


def test_each_sequence_takes_the_drafts_its_acceptance_makes_likely():
    """The j-th draft while alpha^j >= MIN_P; a failing sequence probes with one draft, backing off."""
    from pagedkv_rs.engine.speculative import SpecState, Speculator

    sp = Speculator(SpeculativeConfig(k=4))

    class R:
        def __init__(self, hits: float, misses: float) -> None:
            self.spec, self.metrics = SpecState(), RequestMetrics(0.0)
            self.spec.hits, self.spec.misses = hits, misses

    assert sp.MIN_P == 0.25
    assert sp.choose(R(9.0, 1.0), 4) == 4  # alpha 0.9: 0.9^4 = 0.66
    assert sp.choose(R(9.0, 1.0), 2) == 2  # never more than offered
    assert sp.choose(R(7.0, 3.0), 4) == 3  # alpha 0.7: 0.49, 0.34, then 0.24
    assert sp.choose(R(1.0, 1.0), 4) == 2  # the prior, alpha 0.5: 0.5, 0.25
    bad = R(1.0, 9.0)  # alpha 0.1
    assert [sp.choose(bad, 4) for _ in range(8)] == [1, 0, 1, 0, 0, 0, 1, 0]  # probes, backing off
    sp.record(bad, 1, 1)
    assert bad.spec.backoff == 1  # an accepted probe resets the back-off
    assert Speculator(SpeculativeConfig(adaptive=False)).choose(bad, 3) == 3
    # compute-bound batches never draft
    e = LLMEngine(MODEL, num_blocks=200, block_size=4, backend="python", speculative="ngram:max_batch=2,adaptive=0")
    e.generate(repeating_prompts(), SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    assert e.stats()["spec_decode_num_drafts"] == 0


def test_structured_requests_do_not_speculate():
    from pagedkv_rs.engine.speculative import Speculator

    class R:
        matcher = object()
        pooling = None

    assert Speculator(SpeculativeConfig()).propose(R(), 10) == []


def test_aborted_while_in_flight_keeps_invariants(backend):
    """An abort between schedule and update (another thread): the update skips it, its blocks are free."""
    e = LLMEngine(MODEL, num_blocks=96, block_size=4, backend=backend.name, speculative=SPEC)
    sp = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    for i, p in enumerate(repeating_prompts(7)):
        e.add_request(f"r{i}", p, sp)
    victim = None
    while victim is None:  # by hand, until a step with drafts: abort one of its speculating requests mid-step
        so = e.scheduler.schedule()
        e.runner.apply_memory_ops(so)
        result = e.runner.execute(e.runner.prepare(so))
        if so.drafts:
            victim = so.requests[next(iter(so.drafts))]
            e.abort_request(victim.request_id)
        e.scheduler.update_from_output(so, result.tokens.tolist(), result.verified)
        e.kv_manager.check_invariants()
    assert victim.status is RequestStatus.FINISHED_ABORTED
    e.kv_manager.check_invariants()
    while e.has_unfinished_requests():
        e.step()
        e.kv_manager.check_invariants()
    assert e.kv_manager.num_live_blocks == 0


# ------------------------------------------------------------------------------------------ real models
def _synthetic(tmp_path_factory, arch: str):
    from pagedkv_rs.models.synthetic import SyntheticSpec, write_synthetic_gguf

    small = SyntheticSpec(
        num_layers=3, hidden_size=64, intermediate_size=96, vocab_size=300, weight_type="Q8_0", embed_type="Q8_0"
    )
    specs = {
        "qwen3": dataclasses.replace(small, arch="qwen3", head_dim=32),
        "gemma3": dataclasses.replace(
            small, arch="gemma3", num_layers=7, num_heads=2, num_kv_heads=1, head_dim=64, sliding_window=6
        ),
    }
    return str(write_synthetic_gguf(tmp_path_factory.mktemp("spec") / f"{arch}.gguf", specs[arch], seed=3))


@pytest.mark.parametrize("arch", ["smollm2", "qwen3", "gemma3"])
def test_greedy_equality_on_model_files(arch, backend, tmp_path_factory):
    from pagedkv_rs import LLM

    path = None if arch == "smollm2" else _synthetic(tmp_path_factory, arch)
    if arch == "smollm2":
        text = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
        prompts = ["Repeat this code, renaming add to plus:\n" + text + "\nAnswer:\n", "The capital of France is"]
        n = 48
    else:
        rng = np.random.default_rng(0)
        base = rng.integers(3, 300, 12).tolist()
        prompts = [{"prompt_token_ids": base * 4}, {"prompt_token_ids": rng.integers(3, 300, 20).tolist()}]
        n = 40
    sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=2)
    outs, stats = [], []
    for spec in (None, SPEC):
        m = LLM(path, num_blocks=128, backend=backend.name, speculative=spec)
        outs.append(m.generate(prompts, sp, use_tqdm=False))
        stats.append(m.stats())
        m.engine.kv_manager.check_invariants()
    assert summary(outs[1]) == summary(outs[0])
    for a, b in zip(*outs):
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys()
    assert stats[1]["spec_decode_num_accepted_tokens"] > 0
    assert stats[1]["num_steps"] < stats[0]["num_steps"]  # drafts accepted: fewer steps for the same tokens


def test_metrics_expose_the_spec_decode_counters():
    from pagedkv_rs.serve.metrics import ServerMetrics

    e = LLMEngine(MODEL, num_blocks=96, block_size=4, backend="python", speculative=SPEC)
    e.generate(repeating_prompts()[:1], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    text = ServerMetrics(e, "tiny").render().decode()
    s = e.stats()
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        line = f'pagedkv:spec_decode_{key}_total{{model_name="tiny"}} {float(s[f"spec_decode_{key}"])}'
        assert line in text, key
    assert s["spec_decode_num_accepted_tokens"] > 0
    assert "spec_decode" not in ServerMetrics(LLMEngine(MODEL, num_blocks=8), "tiny").render().decode()


def test_kv_tiers_get_the_blocks_accepted_drafts_filled(tmp_path, backend):
    """Write-through stores every full block of accepted tokens (those drafts filled included), never a draft's."""
    tier = [f"disk:{tmp_path}/kv?size=64MiB"]
    prompt = repeating_prompts()[0]
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    e = LLMEngine(MODEL, num_blocks=96, block_size=4, backend=backend.name, speculative=SPEC, kv_tiers=tier)
    (out,) = e.generate([prompt], sp)
    assert e.stats()["spec_decode_num_accepted_tokens"] > 8
    e.shutdown()  # flushes the writers
    full = prompt + out.outputs[0].token_ids  # the last token never had its KV computed
    fresh = LLMEngine(MODEL, num_blocks=96, block_size=4, backend=backend.name, kv_tiers=tier)
    (again,) = fresh.generate([full], SamplingParams(max_tokens=1, temperature=0))
    assert again.num_cached_tokens == (len(full) - 1) // 4 * 4  # every full block, from the tier
    fresh.shutdown()


def test_the_cli_flag_parses_or_names_the_problem(capsys):
    from pagedkv_rs.cli.bench.e2e import build_parser

    args = build_parser().parse_args(["--speculative", "ngram:k=2,n=5"])
    assert args.speculative == SpeculativeConfig(k=2, n=5)
    assert build_parser().parse_args([]).speculative is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--speculative", "ngram:k=x"])
    assert "k must be an int" in capsys.readouterr().err


def test_bench_e2e_drafting_share_counts_governed_steps_or_drafts():
    """`bench e2e`'s drafting share: the governed steps' share in the drafting mode; where no step was governed,
    1 if drafts ran (no governor) and 0 if none did (every batch above max_batch), never 1 for no drafts."""
    from pagedkv_rs.cli.bench.e2e import _spec_delta

    def stats(drafts, on=0, off=0, governed=True):
        s = {"spec_decode_num_drafts": drafts, "spec_decode_num_draft_tokens": 3 * drafts}
        s["spec_decode_num_accepted_tokens"] = drafts
        if governed:
            s["spec_decode_governor"] = [{"steps_on": on, "steps_off": off}]
        return s

    share = "spec_governed_on_share"
    assert _spec_delta(stats(0), stats(5, on=2, off=6))[share] == 0.25
    assert _spec_delta(stats(0), stats(0))[share] == 0.0  # governed, no step at a batch size it governs
    assert _spec_delta(stats(0, governed=False), stats(4, governed=False))[share] == 1.0
    assert _spec_delta(stats(0, governed=False), stats(0, governed=False))[share] == 0.0


def test_bench_spec_table_reports_decode_speed_apart_from_prefill(capsys):
    """`bench e2e --spec-table`'s decode column: the pair's median TPOT off over on (prefill, the same both
    ways, left out), 0 where a side decoded one token at most; the table prints it beside tok/s."""
    from pagedkv_rs.cli.bench.e2e import _tpot_ratio, main

    assert _tpot_ratio({"median_tpot_ms": 10.0}, {"median_tpot_ms": 4.0}) == 2.5
    assert _tpot_ratio({"median_tpot_ms": 10.0}, {"median_tpot_ms": 0.0}) == 0.0
    argv = ["--spec-table", "--spec-rows", "random:1", "--speculative", "ngram:k=2"]
    assert main([*argv, "--input-len", "16", "--output-len", "6", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("random 1"))
    assert "decode" in out and float(row.split()[5].rstrip("x")) > 0


def test_pooling_requests_beside_speculating_ones():
    """A step with a pooling row drafts nothing (one forward_hidden serves it); the tokens are unchanged."""
    from pagedkv_rs import PoolingParams
    from pagedkv_rs.llm import LLM

    llm = LLM(num_blocks=128)
    text = "one two three four one two three four one two three four one two three"
    gen = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = llm.generate([text], gen, use_tqdm=False)[0]
    kw = {"num_blocks": 128, "max_num_batched_tokens": 16, "speculative": SPEC}
    eng = LLMEngine(llm.model, tokenizer=llm.engine.tokenizer, **kw)
    pooled, together = eng.generate([text * 3, text], [PoolingParams("mean"), gen], use_tqdm=False)
    assert together.outputs[0].token_ids == alone.outputs[0].token_ids
    assert pooled.outputs.embedding is not None
    assert eng.stats()["spec_decode_num_accepted_tokens"] > 0  # drafts once the pooling request is done
    assert eng.scheduler.stats()["kv_live_blocks"] == 0


def test_a_prefill_step_takes_no_drafts(backend):
    """A prompt-logprobs prefill admitted beside a speculating decode: its step drafts nothing (the prompt goes
    first), the decode steps after it do; tokens and prompt logprobs unchanged."""
    steps: list[tuple[bool, bool]] = []  # (drafts, prompt-logprob positions) per step

    def outputs(spec):
        e = LLMEngine(MODEL, num_blocks=96, block_size=4, backend=backend.name, speculative=spec)
        execute = e.runner.execute
        e.runner.execute = lambda si: (steps.append((bool(si.drafts), si.prompt_indices is not None)), execute(si))[1]
        e.add_request("a", repeating_prompts()[1], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
        for _ in range(6):
            e.step()
        lp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=2)
        e.add_request("b", repeating_prompts(8)[2], lp)
        final = {}
        while e.has_unfinished_requests():
            final.update((o.request_id, o) for o in e.step() if o.finished)
            e.kv_manager.check_invariants()
        return [final["a"], final["b"]]

    plain = outputs(None)
    steps.clear()
    spec = outputs(SPEC)
    prefill = [i for i, (_, p) in enumerate(steps) if p]
    assert prefill and not any(steps[i][0] for i in prefill)
    assert any(d for d, _ in steps[prefill[-1] + 1 :])
    assert summary(spec) == summary(plain)
    a, b = spec[1].prompt_logprobs, plain[1].prompt_logprobs
    assert len(a) == len(b) == 30
    for x, y in zip(a[1:], b[1:]):
        assert x.keys() == y.keys() and all(x[t].logprob == pytest.approx(y[t].logprob, abs=1e-5) for t in x)
