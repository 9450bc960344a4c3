"""Scheduler, request objects and sampling, without a model.

A ``FakeRunner`` plays the engine: it applies the step's swap / copy operations to a fake KV cache
that stores (token, position) per slot, writes each scheduled token at its slot, then checks that
every sequence's block table reads back exactly its token history — so paging, prefix hits,
copy-on-write and swaps are verified on every step. Its "model" picks the next token from a hash of
the history, so outputs are comparable between runs with different memory pressure.
"""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv_rs.engine.request import (
    InvalidRequestError,
    RequestOutput,
    RequestStatus,
    SamplingParams,
    UnknownRequestError,
)
from pagedkv_rs.engine.sampling import sample
from pagedkv_rs.engine.scheduler import Scheduler, SchedulerConfig
from pagedkv_rs.errors import PagedKVError

VOCAB = 97
EOS = 3


def next_token(history: list[int]) -> int:
    h = 0
    for t in history[-8:]:
        h = (h * 1000003 + t + 1) % (1 << 31)
    return (h + len(history)) % VOCAB


class FakeRunner:
    """Engine stand-in: fake KV cache of (token, position) codes, checked after each step."""

    def __init__(self, sched: Scheduler) -> None:
        self.s = sched
        kv = sched.kv
        self.bs = kv.block_size
        self.cache = np.full((kv.num_blocks, self.bs), -1, np.int64)
        self.host: dict[str, np.ndarray] = {}
        self.max_tokens_seen = 0
        self.mixed_steps = 0  # steps with a partial prefill next to a decode

    def step(self) -> list:
        so = self.s.schedule()
        if so is None:
            return []
        return self.s.update_from_output(so, self.execute(so))

    def execute(self, so) -> list[int]:
        """Apply the step's memory ops and KV writes, check every history, return the sampled tokens."""
        cfg = self.s.config
        assert so.num_tokens <= cfg.max_num_batched_tokens or (not cfg.enable_chunked_prefill and len(so.requests) == 1)
        assert len(self.s.running) <= cfg.max_num_seqs
        for sw in so.swap_out:
            self.host[sw.request_id] = self.cache[sw.block_ids].copy()
        for sw in so.swap_in:
            buf = self.host.pop(sw.request_id)
            self.cache[sw.block_ids] = buf[sw.first : sw.first + len(sw.block_ids)]
        for src, dst in so.copy_pairs:
            self.cache[dst] = self.cache[src]
        b = so.batch
        assert b.num_seqs == len(so.requests)
        flat = self.cache.reshape(-1)
        flat[b.slot_mapping] = b.input_ids * 4096 + b.positions
        decode = prefill = False
        for i, (req, n) in enumerate(zip(so.requests, so.num_scheduled_tokens)):
            lo, hi = b.query_start_loc[i], b.query_start_loc[i + 1]
            assert hi - lo == n > 0
            seq_len = int(b.seq_lens[i])
            assert seq_len == req.num_computed_tokens
            assert list(b.input_ids[lo:hi]) == req.all_token_ids[seq_len - n : seq_len]
            row = b.block_tables[i]
            pos = np.arange(seq_len)
            got = self.cache[row[pos // self.bs], pos % self.bs]
            want = np.asarray(req.all_token_ids[:seq_len]) * 4096 + pos
            assert np.array_equal(got, want), f"{req}: KV history mismatch"
            decode |= n == 1 and seq_len > req.num_prompt_tokens
            prefill |= seq_len < req.num_kv_tokens
        self.mixed_steps += decode and prefill
        self.max_tokens_seen = max(self.max_tokens_seen, so.num_tokens)
        return [next_token(so.requests[i].all_token_ids) for i in so.sample_rows]

    def run(self, max_steps: int = 100_000) -> int:
        steps = 0
        while self.s.has_unfinished_requests():
            self.step()
            steps += 1
            assert steps < max_steps, "no progress"
        return steps


def reference_output(prompt: list[int], params: SamplingParams, max_model_len: int = 1 << 30) -> list[int]:
    hist, out = list(prompt), []
    while True:
        t = next_token(hist)
        hist.append(t)
        out.append(t)
        if (t == EOS and not params.ignore_eos) or t in params.stop_token_ids:
            return out
        if len(out) >= params.max_tokens or len(hist) >= max_model_len:
            return out


def make(backend, num_blocks=64, block_size=4, caching=True, **cfg) -> Scheduler:
    kv = backend.KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
    return Scheduler(kv, SchedulerConfig(**cfg), eos_token_ids=(EOS,))


def random_prompts(rng, n, lo=1, hi=40, shared=None):
    out = []
    for _ in range(n):
        p = rng.integers(4, VOCAB, size=int(rng.integers(lo, hi))).tolist()
        out.append((shared or []) + p)
    return out


def finish_all(sched: Scheduler, runner: FakeRunner, reqs) -> None:
    runner.run()
    for r in reqs:
        assert r.finished
    sched.kv.check_invariants()
    assert sched.kv.stats()["live_blocks"] == 0
    assert not sched.running and not len(sched.waiting) and not sched.swapped
    assert sched.swap_blocks_used == 0


# ----------------------------------------------------------------- SamplingParams
@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"max_tokens": 0}, ValueError, "max_tokens"),
        ({"max_tokens": 2.5}, TypeError, "max_tokens"),
        ({"temperature": -0.1}, ValueError, "temperature"),
        ({"temperature": float("nan")}, ValueError, "temperature"),
        ({"temperature": "hot"}, TypeError, "temperature"),
        ({"top_k": -2}, ValueError, "top_k"),
        ({"top_p": 0.0}, ValueError, "top_p"),
        ({"top_p": 1.5}, ValueError, "top_p"),
        ({"seed": -1}, ValueError, "seed"),
        ({"stop_token_ids": [1, -1]}, ValueError, "stop_token_ids"),
        ({"stop_token_ids": "ab"}, TypeError, "stop_token_ids"),
        ({"ignore_eos": 1}, TypeError, "ignore_eos"),
        ({"priority": 1.0}, TypeError, "priority"),
    ],
)
def test_sampling_params_rejects_bad_values(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_normalises():
    p = SamplingParams(top_k=-1, stop_token_ids=[5, 6], temperature=0)
    assert p.top_k == 0 and p.stop_token_ids == (5, 6) and p.greedy
    assert not SamplingParams(temperature=0.7).greedy


def test_scheduler_config_rejects_bad_values():
    for kw in (
        {"max_num_seqs": 0},
        {"max_num_batched_tokens": 0},
        {"policy": "lifo"},
        {"preemption_mode": "drop"},
        {"watermark": 1.0},
        {"swap_space_blocks": -1},
    ):
        with pytest.raises(ValueError):
            SchedulerConfig(**kw)


# ------------------------------------------------------------------------ sampling
def test_sample_greedy_is_argmax_first_on_ties():
    logits = np.array([[0.0, 2.0, 2.0, 1.0], [5.0, -1.0, 0.0, 0.0]], np.float32)
    p = SamplingParams(temperature=0)
    assert sample(logits, [p, p], [None, None]).tolist() == [1, 0]


def test_sample_top_k_and_top_p_restrict_support():
    rng = np.random.default_rng(0)
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))
    k2 = SamplingParams(temperature=1.0, top_k=2)
    p075 = SamplingParams(temperature=1.0, top_p=0.75)
    seen_k, seen_p = set(), set()
    for _ in range(400):
        seen_k.add(int(sample(logits, [k2], [rng])[0]))
        seen_p.add(int(sample(logits, [p075], [rng])[0]))
    assert seen_k == {0, 1}
    assert seen_p == {0, 1}  # 0.5 + 0.3 reaches 0.75: the third token is cut
    p_tiny = SamplingParams(temperature=1.0, top_p=1e-9)
    assert {int(sample(logits, [p_tiny], [rng])[0]) for _ in range(50)} == {0}


def test_sample_distribution_matches_softmax():
    rng = np.random.default_rng(1)
    probs = np.array([0.1, 0.2, 0.3, 0.4])
    logits = np.tile(np.log(probs) * 2.0, (4000, 1))  # temperature 2 undoes the scaling
    p = SamplingParams(temperature=2.0)
    got = np.bincount(sample(logits, [p] * 4000, [rng] * 4000), minlength=4) / 4000
    assert np.abs(got - probs).max() < 0.03


def test_sample_seeded_rows_independent_of_batch():
    logits = np.random.default_rng(2).standard_normal((3, 50))
    p = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7)
    g = SamplingParams(temperature=0)
    alone = [int(sample(logits[1:2], [p], [np.random.default_rng(7)])[0]) for _ in range(1)]
    batched = sample(logits, [g, p, g], [None, np.random.default_rng(7), None])
    assert batched[1] == alone[0]
    assert batched[0] == logits[0].argmax() and batched[2] == logits[2].argmax()


def test_sample_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="does not match"):
        sample(np.zeros((2, 4)), [SamplingParams()], [None])


# --------------------------------------------------------------------- bad input
def test_bad_requests_raise_clear_errors(backend):
    s = make(backend, num_blocks=8, block_size=4, max_model_len=20)
    with pytest.raises(InvalidRequestError, match="empty"):
        s.add_request("a", [])
    with pytest.raises(InvalidRequestError, match="exceeds max_model_len=20"):
        s.add_request("b", list(range(21)))
    with pytest.raises(InvalidRequestError, match="token id"):
        s.add_request("c", [1, -5])
    with pytest.raises(TypeError):
        s.add_request("d", "hello")
    with pytest.raises(TypeError, match="SamplingParams"):
        s.add_request("e", [1], {"max_tokens": 3})
    s.add_request("f", [1, 2])
    with pytest.raises(InvalidRequestError, match="already in use"):
        s.add_request("f", [1, 2])
    with pytest.raises(UnknownRequestError, match="'zzz'"):
        s.abort_request("zzz")
    assert isinstance(UnknownRequestError("x"), PagedKVError)


def test_prompt_that_could_never_fit_the_pool_is_rejected(backend):
    s = make(backend, num_blocks=4, block_size=4)  # 16 token slots in all
    assert s.max_model_len == 16
    with pytest.raises(InvalidRequestError, match="KV pool of 4 blocks"):
        s.add_request("big", list(range(4, 21)))
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    full = s.add_request("full", list(range(4, 20)), params)  # fills the context: one token, no KV for it
    r = s.add_request("ok", list(range(4, 14)), params)
    finish_all(s, FakeRunner(s), [full, r])
    assert full.finish_reason == "length" and len(full.output_token_ids) == 1
    assert r.finish_reason == "length" and r.num_tokens == 16  # stopped at the pool's limit


# ------------------------------------------------------------------ basic flows
@pytest.mark.parametrize("caching", [True, False])
def test_outputs_match_reference(backend, caching):
    rng = np.random.default_rng(0)
    s = make(backend, caching=caching)
    params = SamplingParams(max_tokens=12, stop_token_ids=[11])
    reqs = [s.add_request(f"r{i}", p, params) for i, p in enumerate(random_prompts(rng, 10))]
    finish_all(s, FakeRunner(s), reqs)
    for r in reqs:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, params)
        assert r.finish_reason == ("stop" if r.output_token_ids[-1] in (11, EOS) else "length")


def test_stop_reasons(backend):
    s = make(backend)
    p = [5, 6, 7]
    ref = reference_output(p, SamplingParams(max_tokens=30, ignore_eos=True))
    stop_at = ref[4]
    r1 = s.add_request("len", p, SamplingParams(max_tokens=3, ignore_eos=True))
    r2 = s.add_request("stop", p, SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=[stop_at]))
    finish_all(s, FakeRunner(s), [r1, r2])
    assert (r1.finish_reason, len(r1.output_token_ids)) == ("length", 3)
    assert r2.finish_reason == "stop" and r2.output_token_ids == ref[: ref.index(stop_at) + 1]


def test_eos_stops_unless_ignored(backend):
    # find a prompt whose continuation hits EOS early
    rng = np.random.default_rng(5)
    for _ in range(10_000):
        p = rng.integers(4, VOCAB, size=3).tolist()
        ref = reference_output(p, SamplingParams(max_tokens=8, ignore_eos=True))
        if EOS in ref[:6]:
            break
    s = make(backend)
    a = s.add_request("eos", p, SamplingParams(max_tokens=8))
    b = s.add_request("ign", p, SamplingParams(max_tokens=8, ignore_eos=True))
    finish_all(s, FakeRunner(s), [a, b])
    assert a.finish_reason == "stop" and a.output_token_ids[-1] == EOS and len(a.output_token_ids) <= 6
    assert b.finish_reason == "length" and b.output_token_ids == ref


def test_chunked_prefill_mixes_with_decodes(backend):
    s = make(backend, num_blocks=128, block_size=4, max_num_batched_tokens=8)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    short = s.add_request("short", [5, 6], params)
    run = FakeRunner(s)
    run.step()
    run.step()
    long = s.add_request("long", list(range(4, 64)), params)
    run.step()
    assert long.num_computed_tokens == 7  # 8-token budget: 1 decode + a 7-token chunk
    finish_all(s, run, [short, long])
    assert run.mixed_steps >= 5 and run.max_tokens_seen == 8
    assert long.output_token_ids == reference_output(long.prompt_token_ids, params)


def test_without_chunking_an_oversized_prompt_runs_alone(backend):
    s = make(backend, num_blocks=64, block_size=4, max_num_batched_tokens=8, enable_chunked_prefill=False)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    a = s.add_request("a", [5, 6], params)
    big = s.add_request("big", list(range(4, 24)), params)
    run = FakeRunner(s)
    so = s.schedule()
    assert [r.request_id for r in so.requests] == ["a"]  # big waits for a step of its own
    s.update_from_output(so, run.execute(so))
    so = s.schedule()
    assert [r.request_id for r in so.requests] == ["a"]  # a decodes first, big would exceed the budget
    s.update_from_output(so, run.execute(so))
    finish_all(s, run, [a, big])
    assert big.output_token_ids == reference_output(big.prompt_token_ids, params)


def test_prefix_cache_hits_are_reported(backend):
    s = make(backend, num_blocks=64, block_size=4)
    shared = list(range(10, 30))
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    first = s.add_request("first", shared + [40], params)
    run = FakeRunner(s)
    run.run()
    second = s.add_request("second", shared + [41, 42], params)
    finish_all(s, run, [second])
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 20
    assert s.stats()["prefix_hit_rate"] > 0
    out = RequestOutput.from_request(second)
    assert out.num_cached_tokens == 20 and out.finished and out.finish_reason == "length"


def test_a_prefix_in_flight_is_computed_once(backend):
    """Requests sent together with one long shared prefix: the first computes it, the others wait until it is
    cached (a request with another prefix passes them meanwhile), then take it from the cache."""
    s = make(backend, num_blocks=128, block_size=4, max_num_batched_tokens=64)
    shared = list(range(10, 50))  # 10 full blocks
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    reqs = [s.add_request(f"r{i}", shared + [60 + i, 70 + i], params) for i in range(3)]
    other = s.add_request("other", [90, 91, 92, 93, 94, 95, 96], params)
    run = FakeRunner(s)
    so = s.schedule()
    assert [r.request_id for r in so.requests] == ["r0", "other"]  # r1, r2 wait for r0's prefix
    assert [r.request_id for r in s.waiting] == ["r1", "r2"]
    s.update_from_output(so, run.execute(so))
    finish_all(s, run, [*reqs, other])
    assert [r.num_cached_tokens for r in reqs] == [0, 40, 40] and other.num_cached_tokens == 0
    for r in (*reqs, other):
        assert r.output_token_ids == reference_output(r.prompt_token_ids, params)


def test_a_prefix_in_flight_over_several_chunks(backend):
    """A prefix longer than one step's budget: the waiting request is admitted once all the blocks it shares are
    cached, not after the first chunk."""
    s = make(backend, num_blocks=128, block_size=4, max_num_batched_tokens=16)
    shared = list(range(10, 50))
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    a = s.add_request("a", shared + [60], params)
    b = s.add_request("b", shared + [61, 62], params)
    run = FakeRunner(s)
    steps = 0
    while b.status.value == "waiting":
        run.step()
        steps += 1
    assert steps == 4  # a's 41 tokens in chunks of 16, 16, 9 (all 40 shared tokens cached), then b
    finish_all(s, run, [a, b])
    assert b.num_cached_tokens == 40
    assert b.output_token_ids == reference_output(b.prompt_token_ids, params)


def test_no_prefix_wait_without_caching_or_with_another_salt(backend):
    """Without prefix caching nothing can be shared, and another cache salt shares nothing: no request waits."""
    shared = list(range(10, 50))
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    s = make(backend, num_blocks=128, block_size=4, caching=False, max_num_batched_tokens=128)
    s.add_request("a", shared + [60], params)
    s.add_request("b", shared + [61], params)
    assert [r.request_id for r in s.schedule().requests] == ["a", "b"]
    s = make(backend, num_blocks=128, block_size=4, max_num_batched_tokens=128)
    s.add_request("a", shared + [60], params, cache_salt="x")
    s.add_request("b", shared + [61], params, cache_salt="y")
    assert [r.request_id for r in s.schedule().requests] == ["a", "b"]


def test_fcfs_and_priority_admission_order(backend):
    for policy, expected in (("fcfs", ["a", "b", "c"]), ("priority", ["c", "a", "b"])):
        s = make(backend, max_num_seqs=1, policy=policy)
        s.add_request("a", [5], SamplingParams(max_tokens=1, priority=1))
        s.add_request("b", [6], SamplingParams(max_tokens=1, priority=1))
        s.add_request("c", [7], SamplingParams(max_tokens=1, priority=0))
        order = []
        run = FakeRunner(s)
        while s.has_unfinished_requests():
            order += [r.request_id for r in run.step()]
        assert order == expected, policy


# -------------------------------------------------------------------- preemption
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempts_newest_and_outputs_are_unchanged(backend, mode):
    rng = np.random.default_rng(3)
    prompts = random_prompts(rng, 12, 2, 30)
    params = SamplingParams(max_tokens=25, ignore_eos=True)
    s = make(backend, num_blocks=20, block_size=4, preemption_mode=mode, max_num_batched_tokens=32)
    reqs = [s.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    finish_all(s, FakeRunner(s), reqs)
    assert s.num_preemptions > 0
    if mode == "swap":
        assert s.num_swaps > 0
    for r in reqs:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, params)
    assert reqs[0].metrics.num_preemptions == 0  # the oldest is never a victim


def test_recompute_victim_goes_to_front_of_waiting(backend):
    s = make(backend, num_blocks=6, block_size=4, max_num_seqs=2)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    old = s.add_request("old", list(range(4, 12)), params)  # 2 blocks
    new = s.add_request("new", list(range(20, 28)), params)  # 2 blocks
    later = s.add_request("later", [50], params)
    run = FakeRunner(s)
    run.step()  # both prefilled; 2 blocks left, then each decode fills blocks
    while new.status is RequestStatus.RUNNING:
        run.step()
    assert old.status is RequestStatus.RUNNING and new.status is RequestStatus.WAITING
    assert list(s.waiting)[:2] == [new, later]
    assert new.num_computed_tokens == 0 and new.metrics.num_preemptions == 1
    finish_all(s, run, [old, new, later])


def test_priority_policy_preempts_lowest_priority(backend):
    s = make(backend, num_blocks=6, block_size=4, max_num_seqs=2, policy="priority")
    hi = s.add_request("hi", list(range(4, 12)), SamplingParams(max_tokens=30, ignore_eos=True, priority=0))
    lo = s.add_request("lo", list(range(20, 28)), SamplingParams(max_tokens=30, ignore_eos=True, priority=5))
    run = FakeRunner(s)
    while lo.metrics.num_preemptions == 0:
        run.step()
        assert hi.metrics.num_preemptions == 0
    finish_all(s, run, [hi, lo])


def test_swap_space_limit_falls_back_to_recompute(backend):
    rng = np.random.default_rng(4)
    params = SamplingParams(max_tokens=25, ignore_eos=True)
    s = make(backend, num_blocks=16, block_size=4, preemption_mode="swap", swap_space_blocks=3)
    reqs = [s.add_request(f"r{i}", p, params) for i, p in enumerate(random_prompts(rng, 8, 8, 14))]
    run = FakeRunner(s)
    steps = 0
    while s.has_unfinished_requests():
        run.step()
        assert s.swap_blocks_used <= 3
        steps += 1
    assert s.num_preemptions > s.num_swaps
    finish_all(s, run, reqs)
    for r in reqs:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, params)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_workload_five_times_capacity_completes(backend, mode):
    rng = np.random.default_rng(6)
    s = make(backend, num_blocks=32, block_size=4, preemption_mode=mode, max_num_seqs=16)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = random_prompts(rng, 40, 4, 24)
    demand = sum(-(-(len(p) + 24) // 4) for p in prompts)
    assert demand >= 5 * 32
    reqs = [s.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    finish_all(s, FakeRunner(s), reqs)
    assert all(len(r.output_token_ids) == 24 for r in reqs)


def test_single_request_as_large_as_the_pool_progresses(backend):
    # alone it fits exactly; with others around it must still finish (no self-preemption livelock)
    s = make(backend, num_blocks=8, block_size=4)
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    big = s.add_request("big", list(range(4, 20)), params)
    small = [s.add_request(f"s{i}", [5 + i, 6], SamplingParams(max_tokens=10, ignore_eos=True)) for i in range(3)]
    finish_all(s, FakeRunner(s), [big, *small])
    assert big.num_tokens == 32 and big.finish_reason == "length"


# ------------------------------------------------------------------------- aborts
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_abort_at_every_status_leaks_nothing(backend, mode):
    rng = np.random.default_rng(7)
    s = make(backend, num_blocks=20, block_size=4, preemption_mode=mode, max_num_batched_tokens=8, max_num_seqs=6)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    run = FakeRunner(s)
    seen: set[str] = set()
    n = 0
    for step in range(400):
        if step % 3 == 0 and n < 60:
            s.add_request(f"r{n}", random_prompts(rng, 1, 1, 20)[0], params)
            n += 1
        live = list(s.requests.values())
        if live and rng.random() < 0.3:
            r = live[int(rng.integers(len(live)))]
            partial = r.status is RequestStatus.RUNNING and r.num_computed_tokens < r.num_kv_tokens
            kind = "prefill" if partial else r.status.value
            if r.status is RequestStatus.WAITING and r.metrics.num_preemptions:
                kind = "preempted"
            seen.add(kind)
            s.abort_request(r.request_id)
            assert r.finish_reason == "abort" and r.request_id not in s.requests
            with pytest.raises(UnknownRequestError):
                s.abort_request(r.request_id)
            s.kv.check_invariants()
        run.step()
        if not s.has_unfinished_requests() and n >= 60:
            break
    run.run()
    finish_all(s, run, [])
    expected = {"waiting", "running", "prefill", "swapped" if mode == "swap" else "preempted"}
    assert expected <= seen
    assert s.kv.stats()["live_blocks"] == 0


def test_abort_between_schedule_and_update_drops_the_result(backend):
    s = make(backend)
    a = s.add_request("a", [5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True))
    b = s.add_request("b", [8, 9], SamplingParams(max_tokens=5, ignore_eos=True))
    run = FakeRunner(s)
    so = s.schedule()
    toks = run.execute(so)
    s.abort_request("a")
    changed = s.update_from_output(so, toks)
    assert changed == [b] and a.output_token_ids == [] and b.output_token_ids == toks[1:]
    assert s.kv.num_live_blocks == 1  # only b's block
    finish_all(s, run, [a, b])


@pytest.mark.parametrize("seed", range(6))
def test_random_arrivals_match_reference(backend, seed):
    rng = np.random.default_rng(100 + seed)
    mode = ("recompute", "swap")[seed % 2]
    s = make(
        backend,
        num_blocks=int(rng.integers(12, 40)),
        block_size=int(rng.choice([1, 2, 4, 8])),
        preemption_mode=mode,
        max_num_batched_tokens=int(rng.integers(4, 40)),
        max_num_seqs=int(rng.integers(1, 10)),
        policy=("fcfs", "priority")[seed % 3 == 0],
    )
    shared = rng.integers(4, VOCAB, size=9).tolist()
    run = FakeRunner(s)
    reqs = []
    for i in range(25):
        p = random_prompts(rng, 1, 1, 12, shared if rng.random() < 0.5 else None)[0]
        params = SamplingParams(max_tokens=int(rng.integers(1, 20)), priority=int(rng.integers(0, 3)))
        reqs.append(s.add_request(f"r{i}", p[: s.max_model_len], params))
        for _ in range(int(rng.integers(0, 4))):
            run.step()
    finish_all(s, run, reqs)
    for r in reqs:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, r.params, s.max_model_len)


# ---------------------------------------------------------------------- simulate
def test_simulate_paged_beats_contiguous_reservation(backend):
    from pagedkv_rs.cli.simulate import make_trace, simulate

    trace = make_trace(80, 50.0, prompt_median=64, output_median=48, max_model_len=512, seed=1)
    rows = simulate(trace, kv_tokens=4096, block_sizes=(8, 64), max_model_len=512, backend=backend)
    contiguous, paged8, paged64 = rows
    assert contiguous.layout == "contiguous" and contiguous.num_blocks == 8
    assert contiguous.max_concurrent <= 8 and contiguous.preemptions == 0
    assert paged8.max_concurrent > 2 * contiguous.max_concurrent
    assert contiguous.kv_waste > 0.5 and paged8.kv_waste < 0.05 and paged8.kv_waste < paged64.kv_waste
    assert paged8.makespan_s < contiguous.makespan_s


def test_simulate_cli(capsys):
    from pagedkv_rs.cli.simulate import main

    assert main(["--num-requests", "20", "--kv-tokens", "4096", "--max-model-len", "512", "--block-sizes", "16"]) == 0
    out = capsys.readouterr().out
    assert "contiguous" in out and "paged" in out and "KV waste" in out
    assert main(["--num-requests", "5", "--kv-gib", "0.01", "--max-model-len", "256", "--json"]) == 0
    assert '"layout": "paged"' in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--kv-tokens", "100", "--max-model-len", "512"])
