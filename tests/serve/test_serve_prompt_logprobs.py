"""``prompt_logprobs`` leave the server as vLLM's OpenAI server gives them: on each completion choice."""

from __future__ import annotations

import json

import httpx
import pytest

from pagedkv_rs.engine.request import SamplingParams


@pytest.mark.parametrize("n", [1, 2])
def test_completion_choices_carry_every_prompt_position(serve_tiny, make_tiny_engine, n):
    prompt = list(range(300, 312))
    ref = make_tiny_engine().generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))[0]
    with serve_tiny() as (url, _, _):
        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2, "n": n}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == n
    for c in choices:
        plp = c["prompt_logprobs"]
        assert len(plp) == len(prompt) and plp[0] is None
        for j in range(1, len(prompt)):
            want = ref.prompt_logprobs[j]
            assert set(plp[j]) == {str(t) for t in want} and str(prompt[j]) in plp[j]
            for t, lp in want.items():
                got = plp[j][str(t)]
                assert got["logprob"] == pytest.approx(lp.logprob, abs=1e-5) and got["rank"] == lp.rank
                assert isinstance(got["decoded_token"], str)


def test_no_prompt_logprobs_key_unless_asked(serve_tiny):
    with serve_tiny() as (url, _, _):
        r = httpx.post(f"{url}/v1/completions", json={"prompt": [300, 301], "max_tokens": 1}, timeout=60)
    assert r.status_code == 200 and "prompt_logprobs" not in r.json()["choices"][0]


def test_a_streamed_completion_carries_them_on_each_choice_s_first_chunk(serve_tiny, make_tiny_engine):
    prompt = list(range(300, 312))
    ref = make_tiny_engine().generate([prompt], SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=1))[0]
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "prompt_logprobs": 1, "stream": True}
    with serve_tiny() as (url, _, _), httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    carrying = [e["choices"][0] for e in events if "prompt_logprobs" in e["choices"][0]]
    assert len(carrying) == 1 and carrying[0] is events[0]["choices"][0]
    plp = carrying[0]["prompt_logprobs"]
    assert len(plp) == len(prompt) and plp[0] is None
    for j in range(1, len(prompt)):
        want = ref.prompt_logprobs[j][prompt[j]].logprob
        assert plp[j][str(prompt[j])]["logprob"] == pytest.approx(want, abs=1e-5)
