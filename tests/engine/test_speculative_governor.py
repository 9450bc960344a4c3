"""The speculation governor: per batch-size bucket, the mode (drafting or not) with the higher measured output
tokens per second, probing the other now and then.

The controller is driven with scripted step costs (tokens and seconds per mode); the engine with a fake clock
that charges each step by its tokens. Outputs never depend on the governor's choices (speculation is exact).
"""

from __future__ import annotations

import pytest
from test_speculative import MODEL, repeating_prompts, run, summary

from pagedkv_rs.engine import LLMEngine
from pagedkv_rs.engine.request import SamplingParams
from pagedkv_rs.engine.speculative import Governor, SpeculativeConfig


def drive(g: Governor, costs, steps: int, bucket: int = 0) -> list[bool]:
    """Run ``steps`` steps of ``bucket``; ``costs(step, on)`` -> (tokens, seconds). The modes run, in order."""
    modes = []
    for i in range(steps):
        on = g.speculates(bucket)
        modes.append(on)
        g.observe(bucket, on, *costs(i, on))
    return modes


def fast_on(i: int, on: bool) -> tuple[int, float]:
    return (3, 0.012) if on else (1, 0.010)  # drafts: 3 tokens in 12 ms, else 1 in 10 ms


def slow_on(i: int, on: bool) -> tuple[int, float]:
    return (1, 0.014) if on else (1, 0.010)  # drafts rejected: one token, a longer step


def test_buckets_group_batch_sizes():
    assert [Governor.bucket(n) for n in (1, 2, 4, 5, 16, 17, 64)] == [0, 1, 1, 2, 2, 3, 3]
    assert [b["bucket"] for b in Governor().stats()] == ["1", "2-4", "5-16", "17+"]


def test_the_schedule_is_a_probe_of_each_mode_then_windows_of_the_faster():
    g = Governor(window=8, probe=2)
    modes = drive(g, slow_on, 2 + 2 + 8 + 2 + 16 + 2 + 32)
    # warm-up: 2 steps with drafts, 2 without; then the faster (off) for 8, a probe of 2, 16 (the probe
    # confirmed off clearly faster: the window doubles), a probe, 32
    want = [True] * 2 + [False] * 2 + [False] * 8 + [True] * 2 + [False] * 16 + [True] * 2 + [False] * 32
    assert modes == want
    assert drive(Governor(window=8, probe=2), slow_on, len(want)) == want  # deterministic


@pytest.mark.parametrize("costs, faster", [(fast_on, True), (slow_on, False)])
def test_it_converges_to_the_faster_mode_and_probing_stays_bounded(costs, faster):
    g = Governor(window=16, probe=4)
    modes = drive(g, costs, 4000)
    slower = sum(m != faster for m in modes)
    # every probe confirms: windows double to 16 * 16 steps, so probing takes ~4 steps in 260
    assert slower <= 4 + 4 * (5 + 4000 // 260)
    assert slower / len(modes) < 0.03
    assert all(m == faster for m in modes[-200:]) or modes[-200:].count(not faster) <= 4
    s = g.stats()[0]
    assert s["speculating"] in (True, False) and s["steps_on"] + s["steps_off"] == 4000
    assert (s["tok_s_on"] > s["tok_s_off"]) is faster


def test_it_switches_when_the_costs_change():
    g = Governor(window=16, probe=4)
    drive(g, fast_on, 2000)
    modes = drive(g, slow_on, 2000)
    # the long window of drafting ends once its rate falls below the other mode's estimate: a probe, a switch
    # (the estimates decay by 0.9 a step: drafting's falls from 250 to below 100 tok/s within ~30 steps)
    first_off_window = next(i for i in range(len(modes) - 16) if not any(modes[i : i + 16]))
    assert first_off_window <= 40
    assert sum(modes[first_off_window:]) / len(modes[first_off_window:]) < 0.03
    # and back
    modes = drive(g, fast_on, 2000)
    assert sum(modes[300:]) / len(modes[300:]) > 0.97


def test_close_modes_are_probed_often_but_within_the_share():
    g = Governor(window=16, probe=4)
    modes = drive(g, lambda i, on: (1, 0.0100 if on else 0.0101), 2000)  # 1% apart: never clearly slower
    probes = sum(not m for m in modes[8:])
    assert probes <= (2000 // 20 + 1) * 4  # at most 4 steps in every 20
    assert modes[-1] is True  # the (slightly) faster mode


def test_buckets_learn_apart():
    g = Governor(window=4, probe=2)
    for i in range(400):
        for bucket, costs in ((0, fast_on), (2, slow_on)):
            on = g.speculates(bucket)
            g.observe(bucket, on, *costs(i, on))
    s = g.stats()
    assert s[0]["tok_s_on"] > s[0]["tok_s_off"] and s[2]["tok_s_on"] < s[2]["tok_s_off"]
    assert s[1]["steps_on"] == s[1]["steps_off"] == 0 and s[1]["speculating"] is True


def test_options_parse_and_adaptive_0_has_no_governor():
    assert SpeculativeConfig.of("ngram:window=8,probe=2") == SpeculativeConfig(window=8, probe=2)
    with pytest.raises(ValueError, match="probe must be"):
        SpeculativeConfig.of("ngram:probe=0")
    e = LLMEngine(MODEL, num_blocks=32, speculative="ngram:adaptive=0")
    assert e.scheduler.spec.governor is None and "spec_decode_governor" not in e.stats()
    assert len(LLMEngine(MODEL, num_blocks=32, speculative="ngram").stats()["spec_decode_governor"]) == 4


class Clock:
    """A fake step clock: each forward costs ``a + b * tokens`` seconds."""

    def __init__(self, engine: LLMEngine, a: float, b: float) -> None:
        self.t = 0.0
        execute = engine.runner.execute

        def timed(si):
            self.t += a + b * si.so.num_tokens
            return execute(si)

        engine.runner.execute = timed  # type: ignore[method-assign]
        engine.scheduler.spec.clock = lambda: self.t


def governed_run(prompts, b: float, backend: str):
    e = LLMEngine(MODEL, backend=backend, num_blocks=160, block_size=4, speculative="ngram:k=4,window=4,probe=2")
    Clock(e, 1.0, b)
    sp = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    outs = e.generate(prompts, [sp] * len(prompts))
    e.kv_manager.check_invariants()
    return outs, e


@pytest.mark.parametrize("b, speculating", [(0.01, True), (3.0, False)])
def test_the_engine_runs_the_mode_the_clock_favours_with_plain_outputs(backend, b, speculating):
    """Cheap tokens: drafts pay and the governor keeps them; costly tokens (every extra row costs 3 steps):
    the governor stops drafting. Outputs are plain decoding's either way."""
    prompts = repeating_prompts()
    plain, _ = run(prompts, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True), backend.name, None)
    outs, e = governed_run(prompts, b, backend.name)
    assert summary(outs) == summary(plain)
    s = e.stats()["spec_decode_governor"]
    bucket = s[Governor.bucket(len(prompts))]
    assert bucket["steps_on"] > 0 and bucket["steps_off"] > 0
    assert (bucket["steps_on"] > bucket["steps_off"]) is speculating
    assert (bucket["tok_s_on"] > bucket["tok_s_off"]) is speculating


def test_the_bar_for_a_draft_is_its_measured_cost_in_tokens():
    """``min_p``: a draft row's measured extra seconds times the tokens a second without drafts gives; None
    until both are measured; low where a draft row is almost free, 1 where it costs a sequence's share."""
    g = Governor(window=16, probe=4)
    assert g.min_p(0) is None
    g.observe(0, False, 1, 0.010, False, 1, 0)  # one sequence: 100 tok/s without drafts
    assert g.min_p(0) is None  # no draft row measured yet
    for _ in range(20):  # 4 drafts cost 4 ms over a 10 ms step: 1 ms a draft row, a tenth of a token's time
        g.observe(0, g.speculates(0), 3, 0.014, True, 1, 4)
        g.observe(0, False, 1, 0.010, False, 1, 0)
    assert g.min_p(0) == pytest.approx(0.1)
    for _ in range(20):  # 8 sequences, compute-bound: 8 drafts double a 10 ms step; the bar clamps at 1
        g.observe(2, True, 9, 0.020, True, 8, 8)
        g.observe(2, False, 8, 0.010, False, 8, 0)
    assert g.min_p(2) == 1.0
    g.observe(1, False, 2, 0.010, False, 2, 0)
    g.observe(1, True, 4, 0.009, True, 2, 2)  # a draft row measured as free: the floor
    assert g.min_p(1) == Governor.MIN_P_RANGE[0]


def test_a_drafting_step_without_drafts_times_the_mode_without():
    """A step of the drafting mode in which no sequence took a draft ran as one without: it updates that mode's
    estimate, and the drafting window still counts it (it ends, and is decided, as planned)."""
    g = Governor(window=8, probe=2)
    for _ in range(2):  # the first window (drafting), no sequence drafting
        assert g.speculates(0)
        g.observe(0, True, 1, 0.010, False, 1, 0)
    s = g.stats()[0]
    assert (s["steps_on"], s["steps_off"]) == (0, 2) and not g.speculates(0)  # now the probe without drafts


def test_choose_takes_drafts_down_to_the_governors_bar():
    from pagedkv_rs.engine.speculative import SpecState, Speculator

    class R:
        def __init__(self) -> None:
            self.spec = SpecState()  # alpha 1/2

    sp = Speculator(SpeculativeConfig())
    assert sp.choose(R(), 4) == 2  # against MIN_P 0.25: 0.5, 0.25
    assert sp.choose(R(), 4, 0.1) == 3  # a cheap draft row: 0.5, 0.25, 0.125 (not 0.0625)
    r = R()  # a draft row that costs a token: none, but a probe of one after a doubling back-off
    assert [sp.choose(r, 4, 1.0) for _ in range(7)] == [1, 0, 1, 0, 0, 0, 1]


def idle_every_4th(i: int, on: bool) -> tuple[int, float, bool]:
    """Drafting: 3 tokens in 12 ms, but every 4th step of the drafting mode has no drafts (1 token in 10 ms)."""
    if on and i % 4:
        return 3, 0.012, True
    return 1, 0.010, False


def test_a_drafting_window_with_enough_steps_without_drafts_skips_the_probe():
    """Steps without drafts inside a drafting window time the mode without drafts: once a window had a probe's
    worth of them, it is decided on them, and no probe without drafts runs while drafting stays faster."""
    g = Governor(window=8, probe=2)
    modes = []
    for i in range(400):
        on = g.speculates(0)
        modes.append(on)
        tokens, seconds, drafted = idle_every_4th(i, on)
        g.observe(0, on, tokens, seconds, drafted, 1, 3 if drafted else 0)
    # the warm-up: a drafting window of 2 (whose one idle step is not a probe's worth), the probe without drafts
    assert modes[:4] == [True, True, False, False]
    assert all(modes[4:])  # from then on every window had 2+ idle steps: never a probe
    s = g.stats()[0]
    assert s["speculating"] and s["tok_s_on"] > s["tok_s_off"]


def test_drafting_turns_off_when_its_drafted_steps_fall_below_its_idle_ones():
    """Probes skipped, a change is still followed: when drafts stop paying (rejected, a longer step), the idle steps
    of the drafting windows show the mode without drafts faster and drafting turns off within a few windows."""
    g = Governor(window=8, probe=2)
    modes = []
    for i in range(300):
        on = g.speculates(0)
        modes.append(on)
        tokens, seconds, drafted = idle_every_4th(i, on)
        if i >= 150 and drafted:
            tokens, seconds = 1, 0.014
        g.observe(0, on, tokens, seconds, drafted, 1, 3 if drafted else 0)
    assert all(modes[4:150])
    assert modes[150:].index(False) <= 40 and modes[-40:].count(True) <= 4
