"""End-to-end engine tests with the tiny random transformer on the real kernel API and caches.

The yardstick: each request run alone in an engine with ample memory. Every other configuration
(memory pressure with recompute or swap preemption, chunked prefill, prefix caching, random
arrival interleavings, background threads) must give the same greedy tokens.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time

import numpy as np
import pytest

from pagedkv_rs import kernels
from pagedkv_rs.engine import LLMEngine, Model, RequestStream
from pagedkv_rs.engine.request import InvalidRequestError, SamplingParams, UnknownRequestError
from pagedkv_rs.models import TinyModel

MODEL = TinyModel(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, vocab_size=128, max_model_len=128)
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
_alone_cache: dict[tuple, list[int]] = {}
_engines: list[LLMEngine] = []  # every engine a test made: shut down after it, pass or fail


@pytest.fixture(autouse=True)
def _shutdown_engines():
    yield
    try:
        while _engines:
            _engines.pop().shutdown()
    finally:
        _engines.clear()


def tracked(e: LLMEngine) -> LLMEngine:
    """Register ``e`` so its background loop is stopped when the test ends, even when it fails."""
    _engines.append(e)
    return e


def engine(backend, num_blocks=128, block_size=4, **kw) -> LLMEngine:
    return tracked(LLMEngine(MODEL, num_blocks=num_blocks, block_size=block_size, backend=backend, **kw))


class Thread(threading.Thread):
    """A thread whose exception ``join`` raises again (``threading`` only prints it), and that must end."""

    error: BaseException | None = None

    def run(self) -> None:
        try:
            super().run()
        except BaseException as e:
            self.error = e

    def join(self, timeout: float | None = 60) -> None:
        super().join(timeout)
        assert not self.is_alive(), f"thread {self.name} still running after {timeout} s"
        if self.error is not None:
            raise self.error


def alone(prompt: list[int], params: SamplingParams = GREEDY, dtype: str = "float32") -> list[int]:
    """Output of the request run by itself with ample memory (python allocator, no prefix reuse)."""
    key = (tuple(prompt), params, dtype)
    if key not in _alone_cache:
        e = LLMEngine(
            MODEL, num_blocks=64, block_size=16, backend="python", enable_prefix_caching=False, kv_cache_dtype=dtype
        )
        _alone_cache[key] = e.generate([prompt], params)[0].token_ids
    return _alone_cache[key]


def prompts(seed: int, n: int, lo: int = 1, hi: int = 40, shared: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prefix = rng.integers(2, 128, size=shared).tolist()
    return [prefix + rng.integers(2, 128, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def assert_clean(e: LLMEngine) -> None:
    assert not e.has_unfinished_requests()
    st = e.kv_manager.stats()
    assert st["live_blocks"] == 0 and st["num_seqs"] == 0
    e.kv_manager.check_invariants()
    assert e.runner.host == {} and e._streams == {}


def test_tiny_model_implements_the_protocol():
    assert isinstance(MODEL, Model)
    assert kernels.kernel_source() in ("rust", "reference")


def test_greedy_outputs_are_deterministic_and_nontrivial(backend):
    ps = prompts(0, 4)
    outs = engine(backend).generate(ps, GREEDY)
    assert [o.token_ids for o in outs] == [alone(p) for p in ps]
    assert len({tuple(o.token_ids) for o in outs}) == 4  # different prompts, different continuations
    assert all(len(set(o.token_ids)) > 2 for o in outs)


def test_outputs_depend_on_the_cached_kv(backend):
    """Sensitivity check for the equality tests: corrupting one cached block changes the tokens."""
    p = prompts(14, 1, 30, 31)[0]
    e = engine(backend, num_blocks=32, block_size=4)
    e.add_request("x", p, GREEDY)
    e.step()  # prefill
    block = e.kv_manager.block_table(e.scheduler.requests["x"].seq_id)[2]
    for k, v in e.kv_caches:
        k[block] = 0
        v[block] = 0
    out = []
    while e.has_unfinished_requests():
        out = [o.token_ids for o in e.step()] or out
    assert out[0][1:] != alone(p)[1:]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_memory_pressure_preemption_keeps_outputs(backend, mode):
    ps = prompts(1, 10, 2, 30)
    e = engine(backend, num_blocks=24, block_size=4, preemption_mode=mode, max_num_batched_tokens=24)
    outs = e.generate(ps, GREEDY)
    st = e.stats()
    assert st["num_preemptions"] >= 3
    if mode == "swap":
        assert st["num_swaps"] >= 3
    assert [o.token_ids for o in outs] == [alone(p) for p in ps]
    assert_clean(e)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_cache_under_pressure(backend, dtype):
    ps = prompts(15, 8, 2, 30)
    e = engine(backend, num_blocks=20, block_size=4, kv_cache_dtype=dtype, preemption_mode="swap")
    outs = e.generate(ps, GREEDY)
    assert e.stats()["num_swaps"] > 0
    assert [o.token_ids for o in outs] == [alone(p, dtype=dtype) for p in ps]
    assert e.kv_caches[0][0].dtype.name == dtype
    assert_clean(e)


def test_chunked_prefill_keeps_outputs(backend):
    ps = prompts(2, 6, 30, 60)
    e = engine(backend, num_blocks=128, block_size=4, max_num_batched_tokens=7)
    outs = e.generate(ps, GREEDY)
    assert [o.token_ids for o in outs] == [alone(p) for p in ps]
    assert_clean(e)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_prefix_caching_keeps_outputs_and_hits(backend, block_size):
    ps = prompts(3, 6, 1, 10, shared=20)
    e = engine(backend, num_blocks=160 // block_size + 8, block_size=block_size)
    first = e.generate(ps[:1], GREEDY)
    rest = e.generate(ps[1:], GREEDY)
    assert [o.token_ids for o in first + rest] == [alone(p) for p in ps]
    assert all(o.num_cached_tokens >= 20 - block_size + 1 for o in rest)
    assert e.stats()["prefix_hit_rate"] > 0.3
    assert_clean(e)


@pytest.mark.parametrize("seed", range(3))
def test_random_arrivals_and_configs_keep_outputs(backend, seed):
    rng = np.random.default_rng(50 + seed)
    ps = prompts(60 + seed, 12, 1, 30, shared=int(rng.integers(0, 12)))
    e = engine(
        backend,
        num_blocks=int(rng.integers(14, 40)),
        block_size=int(rng.choice([2, 4, 8])),
        preemption_mode=("recompute", "swap")[seed % 2],
        max_num_batched_tokens=int(rng.integers(8, 48)),
        max_num_seqs=int(rng.integers(2, 8)),
    )
    ids: list[str] = []
    pending = list(ps)
    final = {}
    while pending or e.has_unfinished_requests():
        for _ in range(int(rng.integers(0, 3))):
            if pending:
                ids.append(e.add_request(None, pending.pop(0), GREEDY))
        for o in e.step():
            if o.finished:
                final[o.request_id] = o.token_ids
    assert_clean(e)
    assert [final[i] for i in ids] == [alone(p) for p in ps]


def test_step_outputs_stream_tokens_in_order(backend):
    e = engine(backend)
    p = prompts(4, 1, 10, 11)[0]
    rid = e.add_request("x", p, GREEDY)
    got, last = [], None
    while e.has_unfinished_requests():
        for o in e.step():
            assert o.request_id == rid
            got += o.new_token_ids
            last = o
    assert got == alone(p) == last.token_ids
    assert last.finished and last.finish_reason == "length" and last.metrics.first_token_time is not None


def test_seeded_sampling_is_reproducible_under_pressure(backend):
    ps = prompts(5, 6, 2, 20)
    params = SamplingParams(max_tokens=12, temperature=0.9, top_k=40, top_p=0.95, seed=1234, ignore_eos=True)
    roomy = engine(backend, num_blocks=128).generate(ps, params)
    tight = engine(backend, num_blocks=16, preemption_mode="recompute", max_num_batched_tokens=10).generate(ps, params)
    assert [o.token_ids for o in roomy] == [o.token_ids for o in tight]
    greedy = engine(backend).generate(ps, GREEDY)
    assert [o.token_ids for o in roomy] != [o.token_ids for o in greedy]


def test_stop_conditions(backend):
    p = prompts(6, 1, 5, 6)[0]
    ref = alone(p, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    stop = ref[5]
    e = engine(backend)
    out = e.generate([p], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop], ignore_eos=True))[0]
    assert out.finish_reason == "stop" and out.token_ids == ref[: ref.index(stop) + 1]
    eos_model = TinyModel(num_layers=2, hidden_size=64, vocab_size=128, max_model_len=128, eos_token_ids=(stop,))
    e2 = tracked(LLMEngine(eos_model, num_blocks=64, block_size=4, backend=backend))
    out = e2.generate([p], SamplingParams(max_tokens=20, temperature=0))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == stop
    short = TinyModel(num_layers=2, hidden_size=64, vocab_size=128, max_model_len=len(p) + 3)
    out = LLMEngine(short, num_blocks=64, block_size=4, backend=backend).generate([p], GREEDY)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3  # model context limit


def test_bad_input_raises_clear_errors(backend):
    e = engine(backend, num_blocks=16, block_size=4)
    with pytest.raises(InvalidRequestError, match="empty"):
        e.add_request(None, [])
    with pytest.raises(InvalidRequestError, match="exceeds max_model_len=64"):
        e.add_request(None, [5] * 65)
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        e.add_request(None, "hello")
    with pytest.raises(ValueError, match="top_p"):
        e.add_request(None, [5], SamplingParams(top_p=2.0))
    with pytest.raises(UnknownRequestError, match="nope"):
        e.abort_request("nope")
    with pytest.raises(TypeError, match="Model protocol"):
        LLMEngine(object(), num_blocks=4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="policy"):
        engine(backend, policy="random")
    assert_clean(e)


class FailingModel(TinyModel):
    def __init__(self, fail_on: set[int]) -> None:
        super().__init__(num_layers=2, hidden_size=64, vocab_size=128, max_model_len=128)
        self.fail_on, self.calls = fail_on, 0

    def forward(self, batch, kv_caches):
        self.calls += 1
        if self.calls in self.fail_on:
            raise RuntimeError("boom")
        return super().forward(batch, kv_caches)


def test_model_error_aborts_the_step_and_leaks_nothing(backend):
    e = tracked(LLMEngine(FailingModel({1}), num_blocks=32, block_size=4, backend=backend))
    s = e.submit([5, 6, 7, 8, 9], GREEDY)
    with pytest.raises(RuntimeError, match="boom"):
        s.result(timeout=10)
    e.shutdown()
    assert_clean(e)
    assert e.kv_manager.num_cached_blocks == 0  # hashes of possibly unwritten KV are forgotten
    # synchronous: only the failing step's requests end; the others go on
    e = tracked(LLMEngine(FailingModel({2}), num_blocks=32, block_size=4, backend=backend, max_num_seqs=1))
    a = e.add_request("a", [5, 6, 7], GREEDY)
    b = e.add_request("b", [8, 9], GREEDY)
    e.step()
    with pytest.raises(RuntimeError, match="boom"):
        e.step()
    assert a not in e.scheduler.requests and b in e.scheduler.requests
    res = {}
    while e.has_unfinished_requests():
        res.update({o.request_id: o for o in e.step()})
    assert res["b"].token_ids == alone([8, 9])
    assert_clean(e)


class Tok:
    """Character-level toy tokenizer (ids 2..127)."""

    def encode(self, text: str) -> list[int]:
        return [2 + ord(c) % 126 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(32 + i % 90) for i in ids)


def test_text_prompts_with_a_tokenizer(backend):
    e = engine(backend, tokenizer=Tok())
    out = e.generate("hello world", GREEDY)[0]
    assert out.prompt == "hello world" and out.prompt_token_ids == Tok().encode("hello world")
    assert out.token_ids == alone(Tok().encode("hello world"))
    assert out.text == Tok().decode(out.token_ids)


# -------------------------------------------------------------------------- aborts
class GatedModel(TinyModel):
    """Blocks inside forward until released, to act on the engine mid-step."""

    def __init__(self) -> None:
        super().__init__(num_layers=2, hidden_size=64, vocab_size=128, max_model_len=128)
        self.entered = threading.Event()
        self.release = threading.Event()
        self.gate = False

    def forward(self, batch, kv_caches):
        if self.gate:
            self.entered.set()
            assert self.release.wait(10)
        return super().forward(batch, kv_caches)


def test_abort_from_another_thread_mid_step(backend):
    m = GatedModel()
    e = tracked(LLMEngine(m, num_blocks=64, block_size=4, backend=backend))
    ps = prompts(7, 3, 5, 15)
    ids = [e.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(ps)]
    e.step()
    m.gate = True
    stepper = Thread(target=e.step)
    stepper.start()
    try:
        assert m.entered.wait(10)
        live_before = e.kv_manager.num_live_blocks
        out = e.abort_request("r1")  # while the forward runs
        assert out.finished and out.finish_reason == "abort"
        assert e.kv_manager.num_live_blocks < live_before  # freed at once
    finally:
        m.release.set()
        stepper.join(10)  # raises what the step raised
    m.gate = False
    res = {}
    while e.has_unfinished_requests():
        for o in e.step():
            res[o.request_id] = o
    assert res["r0"].token_ids == alone(ps[0]) and res["r2"].token_ids == alone(ps[2])
    assert "r1" not in res
    assert_clean(e)
    assert ids == ["r0", "r1", "r2"]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_engine_abort_at_every_status(backend, mode):
    rng = np.random.default_rng(8)
    e = engine(backend, num_blocks=20, block_size=4, preemption_mode=mode, max_num_batched_tokens=8)
    seen = set()
    for i, p in enumerate(prompts(9, 40, 1, 25)):
        e.add_request(f"r{i}", p, GREEDY)
        e.step()
        live = list(e.scheduler.requests.values())
        if rng.random() < 0.5 and live:
            r = live[int(rng.integers(len(live)))]
            seen.add(r.status.value)
            e.abort_request(r.request_id)
    while e.has_unfinished_requests():
        e.step()
    assert {"waiting", "running"} <= seen
    assert_clean(e)


# ----------------------------------------------------------------- background loop
def test_five_times_capacity_completes_in_background(backend):
    e = engine(backend, num_blocks=16, block_size=4, max_num_seqs=8)
    ps = prompts(10, 24, 4, 20)
    assert sum(len(p) + 16 for p in ps) >= 5 * 16 * 4
    streams = [e.submit(p, GREEDY) for p in ps]
    outs = [s.result(timeout=60) for s in streams]
    e.shutdown()
    assert [o.token_ids for o in outs] == [alone(p) for p in ps]
    assert e.stats()["num_preemptions"] > 0
    assert_clean(e)


def test_many_threads_submit_and_abort(backend):
    e = engine(backend, num_blocks=40, block_size=4, max_num_seqs=6, preemption_mode="swap")
    ps = prompts(11, 48, 1, 20)
    finals: dict[str, list] = {}
    lock = threading.Lock()
    errors = []

    def worker(k: int) -> None:
        try:
            for j in range(6):
                i = k * 6 + j
                s = e.submit(ps[i], GREEDY, request_id=f"t{i}")
                got = []
                for o in s:
                    got.append(o)
                    if i % 3 == 0 and len(got) == 2:
                        break  # consumer stops listening: the generator's close aborts the request
                if i % 3 == 1:
                    e._abort(f"t{i}")  # may race with the request finishing
                with lock:
                    finals[f"t{i}"] = got
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    deadline = time.monotonic() + 10
    while e.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.01)
    e.shutdown()
    assert len(finals) == 48
    for rid, got in finals.items():
        i = int(rid[1:])
        n_finished = sum(o.finished for o in got)
        if i % 3 == 0 and len(got) == 2 and not got[-1].finished:
            continue  # aborted by leaving the loop
        assert n_finished == 1 and got[-1].finished, rid
        if got[-1].finish_reason == "length":
            assert got[-1].token_ids == alone(ps[i])
            assert [t for o in got for t in o.new_token_ids] == got[-1].token_ids
    assert_clean(e)


def test_async_streams_and_cancellation(backend):
    e = engine(backend, num_blocks=48, block_size=4)
    ps = prompts(12, 6, 2, 12)

    async def consume(p):
        toks = []
        async for o in e.submit(p, GREEDY):
            toks += o.new_token_ids
        return toks

    async def cancel_one(p):
        s = e.submit(p, SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
        async for o in s:
            if len(o.token_ids) >= 2:
                raise asyncio.CancelledError

    async def main():
        task = asyncio.create_task(cancel_one(ps[0]))
        res = await asyncio.gather(*(consume(p) for p in ps[1:]))
        with pytest.raises(asyncio.CancelledError):
            await task
        return res

    res = asyncio.run(main())
    assert res == [alone(p) for p in ps[1:]]
    deadline = time.monotonic() + 10
    while e.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.01)
    e.shutdown()
    assert_clean(e)


def test_listeners_get_every_output_in_order_with_one_wakeup_per_step(backend):
    e = engine(backend, num_blocks=48, block_size=4)
    ps = prompts(8, 6, 2, 12)
    errors: list[dict] = []

    async def main():
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
        wakeups = 0
        real = loop.call_soon_threadsafe

        def counting(cb, *args, **kw):
            nonlocal wakeups
            wakeups += 1
            return real(cb, *args, **kw)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        got: dict[int, list] = {i: [] for i in range(len(ps))}
        done = asyncio.Event()
        left = len(ps)

        def on(i, item):
            nonlocal left
            got[i].append(item)
            if isinstance(item, BaseException) or item.finished:
                left -= 1
                if left == 0:
                    done.set()
            if i == 0:
                raise RuntimeError("a broken listener")  # must not starve the other streams

        streams = [e.submit(p, GREEDY) for p in ps]  # outputs may arrive before listen(): delivered too
        for i, s in enumerate(streams):
            s.listen(functools.partial(on, i))
        with pytest.raises(RuntimeError, match="already has"):
            streams[0].listen(print)
        with pytest.raises(RuntimeError, match="already has"):
            await streams[1].__aiter__().__anext__()
        await asyncio.wait_for(done.wait(), 60)  # a hang guard, not a timing assertion
        return got, wakeups

    got, wakeups = asyncio.run(main())
    for i, p in enumerate(ps):
        items = got[i]
        assert all(not o.finished for o in items[:-1]) and items[-1].finished
        assert [t for o in items for t in o.new_token_ids] == items[-1].token_ids == alone(p)
    assert len(errors) == len(got[0]) and all("broken listener" in str(c["exception"]) for c in errors)
    assert wakeups <= e.scheduler.num_steps  # one call_soon_threadsafe per step, not one per stream
    e.shutdown()
    assert_clean(e)


def test_stream_cancel_and_shutdown(backend):
    e = engine(backend)
    s = e.submit([5, 6, 7], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    assert isinstance(s, RequestStream)
    s.cancel()
    final = s.result(timeout=10)
    assert final.finished and final.finish_reason == "abort"
    s2 = e.submit([8, 9], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    e.shutdown()  # aborts what is left
    assert s2.result(timeout=10).finish_reason == "abort"
    assert_clean(e)


def test_stats_report_latencies(backend):
    e = engine(backend, num_blocks=24)
    e.generate(prompts(13, 4, 2, 8), GREEDY)
    st = e.stats()
    assert st["num_finished"] == 4 and st["mean_ttft_s"] > 0 and st["mean_itl_s"] > 0
    assert st["num_running"] == st["num_waiting"] == 0 and st["kv_live_blocks"] == 0
    assert st["kv_cached_blocks"] + st["kv_free_blocks"] == 24


def test_generate_alongside_background_loop_with_progress_bar(backend, capsys):
    e = engine(backend, num_blocks=48)
    ps = prompts(16, 6, 2, 20)
    s = e.submit(ps[0], GREEDY)
    outs = e.generate(ps[1:], GREEDY, use_tqdm=True)
    assert s.result(timeout=30).token_ids == alone(ps[0])
    assert [o.token_ids for o in outs] == [alone(p) for p in ps[1:]]
    assert "generate" in capsys.readouterr().err
    e.shutdown()
    assert_clean(e)
    with pytest.raises(ValueError, match="2 prompts but 3"):
        e.generate(ps[:2], [GREEDY] * 3)


# ----------------------------------------------------------------- lifecycle and guard rails
def test_shutdown_without_abort_keeps_the_requests(backend):
    e = engine(backend)
    e.add_request("a", [5, 6, 7], GREEDY)  # synchronous: the loop is not running
    e.start()
    e.shutdown(abort=False)
    assert e._thread is None
    left = e.has_unfinished_requests()
    res = {}
    while e.has_unfinished_requests():  # what the loop left is still there, in any state
        res.update({o.request_id: o for o in e.step()})
    if left:
        assert res["a"].finish_reason == "length"
    assert_clean(e)
    e.add_request("b", [8, 9], GREEDY)
    e.shutdown(abort=False)
    assert e.has_unfinished_requests()  # not aborted
    e.shutdown()  # the default aborts it
    assert_clean(e)


def test_context_manager_shuts_the_loop_down_and_aborts(backend):
    long = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    with engine(backend) as e:
        s = e.submit([5, 6, 7], long)
        assert e.is_running
    assert not e.is_running
    assert s.result(timeout=10).finish_reason == "abort"
    assert_clean(e)


def test_stream_result_times_out_while_the_step_is_stuck(backend):
    m = GatedModel()
    m.gate = True
    e = tracked(LLMEngine(m, num_blocks=64, block_size=4, backend=backend))
    s = e.submit([5, 6, 7], GREEDY)
    try:
        assert m.entered.wait(10)
        with pytest.raises(TimeoutError, match=r"request 'req-0': not finished within 0.05 s"):
            s.result(timeout=0.05)
    finally:
        m.gate = False
        m.release.set()
    assert s.result(timeout=30).token_ids == alone([5, 6, 7])


def test_a_scheduler_that_makes_no_progress_is_an_error(backend):
    e = engine(backend)
    e.add_request("a", [5, 6, 7], GREEDY)
    e.scheduler.schedule = lambda **_: None  # a scheduler bug: work left, nothing scheduled
    assert e.step() == []  # one idle step is allowed
    with pytest.raises(RuntimeError, match="scheduler made no progress: "):
        e.step()


class WrongShapeModel(TinyModel):
    def __init__(self, shape) -> None:
        super().__init__(num_layers=2, hidden_size=64, vocab_size=128, max_model_len=128)
        self.shape = shape

    def forward(self, batch, kv_caches, logits_indices=None):
        return np.zeros(self.shape, np.float32)


@pytest.mark.parametrize("shape", [(1, 127), (2, 128), (128,)])
def test_bad_logits_shape_fails_the_step_and_leaks_nothing(backend, shape):
    e = tracked(LLMEngine(WrongShapeModel(shape), num_blocks=32, block_size=4, backend=backend))
    e.add_request("a", [5, 6, 7], GREEDY)
    with pytest.raises(ValueError, match=r"model.forward returned \(.*\), expected \(1, 128\)"):
        e.step()
    assert_clean(e)


def test_engine_end_to_end_on_the_numpy_reference_kernels(backend):
    """The same greedy tokens with every kernel from kernels.reference (the pure-Python install's path)."""
    ps = prompts(21, 3, 3, 12)
    want = [alone(p) for p in ps]  # Rust kernels
    prev = kernels.kernel_source()
    kernels.set_kernel_source("reference")
    try:
        assert kernels.kernel_source() == "reference"
        got = engine(backend, num_blocks=24, block_size=4).generate(ps, GREEDY)
    finally:
        kernels.set_kernel_source(prev)
    assert [o.token_ids for o in got] == want
