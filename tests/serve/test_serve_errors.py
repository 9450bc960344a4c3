"""Every error code, in OpenAI's shape, from a real server over the tiny model."""

from __future__ import annotations

import httpx
import openai
import pytest

BAD_BODIES = [
    (b'{"prompt": 5}', "prompt"),
    (b'{"prompt": "x", "max_tokens": "many"}', "max_tokens"),
    (b'{"prompt": "x", "max_tokens": -1}', "max_tokens"),
    (b'{"prompt": "x", "temperature": -0.5}', "temperature"),
    (b'{"prompt": "x", "top_p": 0}', "top_p"),
    (b'{"prompt": "x", "seed": 36893488147419103232}', "seed"),
    (b'{"prompt": "x", "stream": "yes please"}', "stream"),
    (b'{"prompt": []}', "prompt"),
    (b'{"prompt": ""}', "prompt"),
    (b'{"prompt": [-1]}', "prompt"),
    (b'{"prompt": [49152]}', "prompt"),
    (b'{"prompt": "x", "stop_token_ids": [1000000]}', "stop_token_ids"),
    (b'{"prompt": "x", "cache_salt": 5}', "cache_salt"),
    (b'{"prompt": "x", "max_tokens": 2000}', "max_tokens"),
    (b'{"prompt": "x", "echo": true}', "echo"),
    (b'{"prompt": "x", "logit_bias": {"5": 1.0}}', "logit_bias"),
    (b"not json", None),
    (b'{"prompt": "\xff"}', None),
    (b"[" * 5000 + b"]" * 5000, None),
    (b'{"prompt": "x"', None),
]

# vLLM's sampling fields with values SamplingParams refuses: 400 naming the field, never 500
BAD_SAMPLING = [
    ("n", 0),
    ("n", 1000),
    ("stop", 5),
    ("logprobs", 50),
    ("presence_penalty", 5.0),
    ("frequency_penalty", -3.0),
    ("repetition_penalty", 0.0),
    ("min_p", 2.0),
    ("min_tokens", -1),
]


def _is_error(r: httpx.Response, status: int, param=None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def test_400_for_every_invalid_field(serve_tiny):
    with serve_tiny() as (url, engine, _), httpx.Client(base_url=url) as c:
        for body, param in BAD_BODIES:
            _is_error(c.post("/v1/completions", content=body, headers={"content-type": "application/json"}), 400, param)
        for field, value in BAD_SAMPLING:
            _is_error(c.post("/v1/completions", json={"prompt": "x", field: value}), 400, field)
        _is_error(c.post("/v1/chat/completions", json={"messages": []}), 400, "messages")
        _is_error(
            c.post("/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]}), 400, "messages"
        )
        _is_error(
            c.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
            ),
            400,
            "max_completion_tokens",
        )
        _is_error(c.post("/tokenize", json={}), 400, "prompt")
        _is_error(c.post("/detokenize", json={"tokens": [10**9]}), 400, "tokens")
        long = c.post("/v1/completions", json={"prompt": list(range(3, 1100)), "max_tokens": 1})
        assert _is_error(long, 400)["code"] == "context_length_exceeded"
        for path, body in (
            ("/v1/completions", {"prompt": "word " * 5000}),  # tokenized off the event loop
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 5000}]}),
        ):
            assert _is_error(c.post(path, json=body), 400)["code"] == "context_length_exceeded"
        unknown = c.post("/v1/completions", json={"prompt": "x", "unknown_field": {"a": 1}, "max_tokens": 2})
        assert _is_error(unknown, 400, "unknown_field")["code"] == "unsupported_parameter"
        assert engine.scheduler.stats()["num_running"] == 0


def test_404_unknown_model_and_route_413_body(serve_tiny):
    with serve_tiny(max_body_bytes=1000) as (url, _, _srv), httpx.Client(base_url=url) as c:
        err = _is_error(c.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404, "model")
        assert err["code"] == "model_not_found"
        _is_error(c.get("/v2/nothing"), 404)
        _is_error(c.get("/v1/completions"), 405)
        _is_error(c.post("/v1/completions", json={"prompt": "x" * 2000}), 413)


def test_401_without_the_api_key(serve_tiny):
    with serve_tiny(api_key="sekret") as (url, _, _srv), httpx.Client(base_url=url) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            err = _is_error(c.post("/v1/completions", json={"prompt": "x"}, headers=headers), 401)
            assert err["code"] == "invalid_api_key"
            _is_error(c.get("/v1/models", headers=headers), 401)
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200
        ok = openai.OpenAI(base_url=f"{url}/v1", api_key="sekret", max_retries=0)
        assert ok.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()


def test_503_queue_full_and_dead_engine(serve_tiny):
    with serve_tiny(max_queued_requests=0) as (url, engine, _srv), httpx.Client(base_url=url) as c:
        r = c.post("/v1/completions", json={"prompt": "x"})
        assert _is_error(r, 503)["code"] == "queue_full" and r.headers["retry-after"] == "1"
        assert "pagedkv:request_aborted_total" in c.get("/metrics").text
        engine.shutdown()  # the loop is gone: health and new requests say so
        assert c.get("/health").status_code == 503
        assert _is_error(c.post("/v1/completions", json={"prompt": "x"}), 503)
        engine.start()
        assert c.get("/health").status_code == 200


def test_504_past_the_request_timeout(serve_tiny, wait_idle):
    with serve_tiny(request_timeout=0.3) as (url, engine, _srv), httpx.Client(base_url=url) as c:
        body = {"prompt": "x", "max_tokens": 1000, "ignore_eos": True, "temperature": 0}
        r = c.post("/v1/completions", json=body)  # 1000 tiny-model steps take well over 0.3 s
        assert _is_error(r, 504)["code"] == "request_timeout"
        lines = [ln for ln in c.post("/v1/completions", json={**body, "stream": True}).text.splitlines() if ln]
        assert '"request_timeout"' in lines[-2] and lines[-1] == "data: [DONE]"
        wait_idle(engine)


def test_vllm_sampling_fields_reach_the_engine(serve_tiny):
    """n, stop, logprobs and the penalties are honoured, not ignored."""
    with serve_tiny() as (url, engine, _), httpx.Client(base_url=url) as c:
        body = {"prompt": "x", "max_tokens": 6, "temperature": 0, "n": 2, "logprobs": 3, "repetition_penalty": 1.3}
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert [ch["index"] for ch in choices] == [0, 1]
        lp = choices[0]["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 6
        assert all(1 <= len(t) <= 4 for t in lp["top_logprobs"])
        first = choices[0]["text"]
        stop = first[2:4]
        r = c.post(
            "/v1/completions",
            json={"prompt": "x", "max_tokens": 6, "temperature": 0, "stop": [stop], "repetition_penalty": 1.3},
        )
        ch = r.json()["choices"][0]
        assert r.status_code == 200 and ch["finish_reason"] == "stop" and ch["stop_reason"] == stop
        assert ch["text"] == first[: first.index(stop)]
