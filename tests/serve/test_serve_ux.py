"""What a newcomer meets: default sampling, request ids and logs, /v1/models/{id}, JSON /health, process and
Python metrics, and ``bench serve``'s checks of its URL and model, on a real server on 127.0.0.1."""

from __future__ import annotations

import json
import logging
import time

import httpx
import openai
import pytest

from pagedkv_rs.cli import main as cli
from pagedkv_rs.serve.logs import MAX_REQUEST_ID, RequestIdFilter
from pagedkv_rs.serve.protocol import ChatCompletionRequest, CompletionRequest, to_sampling_params

GREEDY_BODY = {"prompt": [5, 9, 14, 3, 27, 8], "max_tokens": 12, "ignore_eos": True}


def test_defaults_fill_only_the_fields_a_request_leaves_unset():
    d = {"temperature": 0.3, "top_p": 0.5, "top_k": 7, "min_p": 0.1, "repetition_penalty": 1.2}
    p = to_sampling_params(CompletionRequest(prompt="x"), max_tokens=4, defaults=d)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0.3, 0.5, 7, 0.1, 1.2)
    explicit = CompletionRequest(prompt="x", temperature=0, top_p=1.0, top_k=0, min_p=0, repetition_penalty=1)
    p = to_sampling_params(explicit, max_tokens=4, defaults=d)  # an explicit value wins, even the "off" one
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0.0, 1.0, 0, 0.0, 1.0)
    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": None, "presence_penalty": 0.5}
    p = to_sampling_params(ChatCompletionRequest.model_validate(body), max_tokens=4, defaults=d)
    assert (p.temperature, p.presence_penalty) == (0.3, 0.5)  # null is unset
    p = to_sampling_params(CompletionRequest(prompt="x"), max_tokens=4)
    assert (p.temperature, p.top_p, p.repetition_penalty) == (1.0, 1.0, 1.0)  # no defaults: OpenAI's


def _texts(c: httpx.Client, **fields) -> str:
    r = c.post("/v1/completions", json={**GREEDY_BODY, **fields})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_a_plain_request_samples_with_the_servers_defaults(serve_tiny):
    # Default top_k=1 is greedy whatever the temperature: a request that leaves top_k unset answers the greedy
    # text every time, one that sets it samples at temperature 1 and differs from it for some seed.
    with serve_tiny(default_sampling={"top_k": 1}) as (url, _, _srv), httpx.Client(base_url=url) as c:
        greedy = _texts(c, temperature=0)
        assert [_texts(c) for _ in range(3)] == [greedy] * 3
        assert _texts(c, temperature=1.0) == greedy
        sampled = {_texts(c, temperature=1.0, top_k=0, seed=s) for s in range(4)}
        assert sampled - {greedy}, "an explicit top_k=0 must sample, not take the server's top_k=1"


def wait_for(find, seconds: float = 10.0):
    """``find()`` once it is non-empty (the server thread writes after answering), or its last value."""
    deadline = time.monotonic() + seconds
    while not (found := find()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return found


def test_request_ids_are_kept_when_sane_and_made_otherwise(serve_tiny, llm, monkeypatch):
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.addFilter(RequestIdFilter())
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("pagedkv_rs")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        with serve_tiny(access_log=True) as (url, _, _srv), httpx.Client(base_url=url) as c:
            r = c.post("/v1/completions", json=GREEDY_BODY, headers={"X-Request-Id": "job-7.a:b_c"})
            assert r.status_code == 200 and r.headers["x-request-id"] == "job-7.a:b_c"
            # The access line is written once the response has gone out: the client may read it first.
            access = wait_for(lambda: [x for x in records if x.name == "pagedkv_rs.serve.access"])
            assert len(access) == 1 and access[0].request_id == "job-7.a:b_c"
            assert '"POST /v1/completions HTTP/1.1" 200' in access[0].getMessage()
            made = set()
            for bad in ("a b", "x" * (MAX_REQUEST_ID + 1), "evil\u00e9", ""):
                r = c.get("/v1/models", headers={"X-Request-Id": bad.encode("utf-8")})
                rid = r.headers["x-request-id"]
                assert rid != bad and len(rid) == 32 and int(rid, 16) >= 0
                made.add(rid)
            assert len(made) == 4
            assert c.get("/v1/models", headers={"X-Request-Id": "x" * MAX_REQUEST_ID}).headers["x-request-id"] == (
                "x" * MAX_REQUEST_ID
            )
            assert len(c.get("/nope").headers["x-request-id"]) == 32  # errors carry an id too
            body = {**GREEDY_BODY, "stream": True}
            with c.stream("POST", "/v1/completions", json=body, headers={"X-Request-Id": "sse-1"}) as r:
                assert r.headers["x-request-id"] == "sse-1" and r.read().endswith(b"data: [DONE]\n\n")
            # a log line written while serving a request carries its id (here the internal-error line)
            records.clear()

            def broken(*args, **kwargs):
                raise RuntimeError("tokenizer broke")

            monkeypatch.setattr(llm.tokenizer, "encode", broken)
            r = c.post("/v1/completions", json={"prompt": "hi"}, headers={"X-Request-Id": "req-500"})
            assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
            assert r.headers["x-request-id"] == "req-500"
            errors = [x for x in records if x.name == "pagedkv_rs.serve" and x.levelno == logging.ERROR]
            assert errors and {x.request_id for x in errors} == {"req-500"}
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def test_no_access_log_by_default(serve_tiny, caplog):
    with caplog.at_level(logging.INFO, logger="pagedkv_rs"), serve_tiny() as (url, _, _srv):
        assert httpx.get(f"{url}/v1/models").status_code == 200
    assert not [r for r in caplog.records if r.name == "pagedkv_rs.serve.access"]


def test_models_by_id_and_served_name(serve_tiny):
    with serve_tiny(served_model_name="tiny") as (url, _, _srv), httpx.Client(base_url=url) as c:
        listed = c.get("/v1/models").json()["data"]
        assert [m["id"] for m in listed] == ["tiny"] and listed[0]["root"] == "tiny"
        assert not any("/" in str(v) for v in listed[0].values())
        assert c.get("/v1/models/tiny").json() == listed[0]
        r = c.get("/v1/models/gpt-4")
        assert r.status_code == 404
        assert r.json()["error"]["code"] == "model_not_found" and set(r.json()["error"]) == {
            "message",
            "type",
            "param",
            "code",
        }
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        assert client.models.retrieve("tiny").id == "tiny"
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("gpt-4")


def test_models_never_show_the_files_path(llm_server, llm):
    data = httpx.get(f"{llm_server}/v1/models").json()["data"][0]
    assert llm.model_path.startswith("/") and llm.model_path not in json.dumps(data)


def test_health_answers_json(serve_tiny):
    with serve_tiny() as (url, engine, srv), httpx.Client(base_url=url) as c:
        r = c.get("/health")
        assert (r.status_code, r.json()) == (200, {"status": "ok"})
        engine.shutdown()
        r = c.get("/health")
        assert (r.status_code, r.json()) == (503, {"status": "engine_stopped"})
        engine.start()
        srv.app.state.pagedkv.draining = True
        r = c.get("/health")
        assert (r.status_code, r.json()) == (503, {"status": "draining"})


def test_metrics_include_process_and_python_collectors(serve_tiny):
    with serve_tiny() as (url, _, _srv):
        text = httpx.get(f"{url}/metrics").text
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    for name in ("process_resident_memory_bytes", "process_cpu_seconds_total", "python_info"):
        assert name in names, name
    assert "python_gc_objects_collected_total" in names
    assert any(n.startswith("pagedkv:") for n in names)


def test_bench_serve_takes_a_v1_url_and_checks_the_model_first(serve_tiny, capsys):
    with serve_tiny() as (url, _, _srv):
        argv = ["bench", "serve", "--num-prompts", "2", "--input-len", "8", "--output-len", "3", "--no-progress"]
        assert cli.main([*argv, "--base-url", f"{url}/v1/"]) == 0
        assert "Successful requests:                    2" in capsys.readouterr().out
        assert cli.main([*argv, "--base-url", f"{url}/v1", "--model", "gpt-4"]) == 2
        out, err = capsys.readouterr()
        assert "Serving Benchmark Result" not in out
        assert "--model 'gpt-4' is not served" in err and "'tiny'" in err
