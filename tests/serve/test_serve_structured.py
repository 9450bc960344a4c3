"""Structured outputs over HTTP: OpenAI's ``response_format`` (the real ``openai`` client's ``.parse``), vLLM's
``structured_outputs`` and ``guided_*``, llama.cpp's ``json_schema`` and ``grammar``, against a real uvicorn
server over the bundled SmolLM2; every answer checked by ``jsonschema`` / pydantic."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "rank": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["city", "rank"],
    "additionalProperties": False,
}
MSGS = [{"role": "user", "content": "Name a city and rank it 1-5, as JSON."}]


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)


class Person(BaseModel):
    name: str = Field(max_length=16)
    pets: list[Pet] = Field(max_length=2)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/{path}", json={"model": "smollm2", **body}, timeout=120)


def test_openai_parse_with_a_pydantic_model(llm_server):
    c = _client(llm_server)
    parse = getattr(c.chat.completions, "parse", None) or c.beta.chat.completions.parse
    for temperature in (0.0, 1.0):
        r = parse(
            model="smollm2",
            messages=[{"role": "user", "content": "Describe a person with pets."}],
            response_format=Person,
            max_tokens=120,
            temperature=temperature,
            seed=3,
        )
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(msg.parsed, Person), msg.content
        Person.model_validate_json(msg.content)


def test_response_format_json_object_and_json_schema_on_chat_and_completions(llm_server):
    c = _client(llm_server)
    r = c.chat.completions.create(
        model="smollm2",
        messages=MSGS,
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}},
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    r = c.chat.completions.create(
        model="smollm2", messages=MSGS, max_tokens=60, temperature=0, response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = c.chat.completions.create(
        model="smollm2", messages=MSGS, max_tokens=8, temperature=0, response_format={"type": "text"}
    )
    assert r.choices[0].message.content
    res = _post(
        llm_server,
        "completions",
        {
            "prompt": "A city as JSON:",
            "max_tokens": 60,
            "temperature": 1.0,
            "seed": 1,
            "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}},
        },
    )
    assert res.status_code == 200, res.text
    jsonschema.validate(json.loads(res.json()["choices"][0]["text"]), SCHEMA)


def test_vllm_structured_outputs_and_guided_fields(llm_server):
    c = _client(llm_server)
    cases = [
        ({"structured_outputs": {"json": SCHEMA}}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        ({"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{2}"}}, lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{2}", t)),
        ({"structured_outputs": {"choice": ["alpha", "beta"]}}, lambda t: t in ("alpha", "beta")),
        ({"structured_outputs": {"grammar": 'start: "x" /[a-c]{2}/'}}, lambda t: re.fullmatch(r"x[a-c]{2}", t)),
        ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        ({"guided_regex": r"(yes|no)!"}, lambda t: t in ("yes!", "no!")),
        ({"guided_choice": ["up", "down"]}, lambda t: t in ("up", "down")),
        ({"guided_grammar": 'root ::= "n=" [0-9] [0-9]?'}, lambda t: re.fullmatch(r"n=[0-9]{1,2}", t)),
    ]
    for extra, ok in cases:
        for temperature in (0.0, 1.0):
            r = c.chat.completions.create(
                model="smollm2", messages=MSGS, max_tokens=60, temperature=temperature, seed=5, extra_body=extra
            )
            text = r.choices[0].message.content
            assert r.choices[0].finish_reason == "stop" and ok(text), (extra, text)


def test_llamacpp_json_schema_and_gbnf_grammar(llm_server):
    res = _post(llm_server, "chat/completions", {"messages": MSGS, "max_tokens": 60, "json_schema": SCHEMA})
    assert res.status_code == 200, res.text
    jsonschema.validate(json.loads(res.json()["choices"][0]["message"]["content"]), SCHEMA)
    gbnf = 'root ::= greeting " " name\ngreeting ::= "hi" | "hello"\nname ::= [A-Z] [a-z]+'
    res = _post(llm_server, "completions", {"prompt": "Greet:", "max_tokens": 20, "temperature": 0.7, "grammar": gbnf})
    assert res.status_code == 200, res.text
    choice = res.json()["choices"][0]
    assert re.fullmatch(r"(hi|hello) [A-Z][a-z]+", choice["text"]) or choice["finish_reason"] == "length"


def test_streamed_constrained_answer_reassembles_to_valid_json(llm_server):
    c = _client(llm_server)
    stream = c.chat.completions.create(
        model="smollm2",
        messages=MSGS,
        max_tokens=60,
        temperature=0.8,
        seed=9,
        stream=True,
        extra_body={"json_schema": SCHEMA},
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_n_completions_each_validate(llm_server):
    res = _post(
        llm_server,
        "chat/completions",
        {"messages": MSGS, "max_tokens": 60, "temperature": 1.0, "seed": 2, "n": 3, "guided_json": SCHEMA},
    )
    assert res.status_code == 200, res.text
    for ch in res.json()["choices"]:
        jsonschema.validate(json.loads(ch["message"]["content"]), SCHEMA)


@pytest.mark.parametrize(
    "body,param,words",
    [
        (
            {"guided_json": SCHEMA, "response_format": {"type": "json_object"}},
            "guided_json",
            ["response_format", "guided_json"],
        ),
        ({"json_schema": SCHEMA, "grammar": 'root ::= "a"'}, "grammar", ["json_schema", "grammar"]),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", ["exactly one"]),
        ({"guided_regex": "[a-"}, "structured_outputs", ["regex"]),
        (
            {"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}},
            "structured_outputs",
            ["nope"],
        ),
        ({"response_format": {"type": "xml"}}, "response_format", ["xml"]),
        ({"response_format": {"type": "json_schema"}}, "response_format", ["json_schema"]),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", ["structural_tag"]),
        ({"guided_choice": []}, "guided_choice", ["empty"]),
        ({"grammar": "root ::= (("}, "structured_outputs", ["grammar"]),
    ],
)
def test_bad_or_conflicting_constraints_are_400_naming_them(llm_server, body, param, words):
    res = _post(llm_server, "chat/completions", {"messages": MSGS, "max_tokens": 5, **body})
    assert res.status_code == 400, res.text
    err = res.json()["error"]
    assert err["param"] == param
    for w in words:
        assert w in err["message"], err


def test_pathological_schema_refused_or_compiled_and_the_server_still_answers(llm_server):
    deep: dict = {"type": "string", "maxLength": 3}
    for _ in range(50):  # 100 JSON levels: under the body parser's recursion limit, so llguidance sees it
        deep = {"type": "object", "properties": {"k": deep}, "required": ["k"], "additionalProperties": False}
    huge_enum = {"type": "object", "properties": {"v": {"enum": [f"v{i}" for i in range(15000)]}}, "required": ["v"]}
    for schema in (deep, huge_enum):
        res = _post(llm_server, "chat/completions", {"messages": MSGS, "max_tokens": 8, "guided_json": schema})
        assert res.status_code in (200, 400), res.text
        if res.status_code == 400:
            assert res.json()["error"]["param"] == "structured_outputs"
    res = _post(llm_server, "chat/completions", {"messages": MSGS, "max_tokens": 4, "temperature": 0})
    assert res.status_code == 200 and res.json()["usage"]["completion_tokens"] == 4


def test_metrics_expose_mask_and_compile_times(llm_server):
    _post(llm_server, "chat/completions", {"messages": MSGS, "max_tokens": 30, "guided_choice": ["metric"]})
    text = httpx.get(f"{llm_server}/metrics").text
    m = re.search(r'pagedkv:structured_mask_seconds_count\{model_name="smollm2"\} (\S+)', text)
    assert m and float(m.group(1)) > 0
    for cache in ("cold", "warm"):
        assert f'pagedkv:structured_compile_seconds_count{{cache="{cache}",model_name="smollm2"}}' in text or (
            f'pagedkv:structured_compile_seconds_count{{model_name="smollm2",cache="{cache}"}}' in text
        )


def test_bench_serve_structured_runs_both_workloads_and_reports_validity(llm_server, tmp_path, capsys):
    from pagedkv_rs.cli.bench import serve as bench_serve

    out = tmp_path / "r.json"
    argv = ["--base-url", llm_server, "--structured", "--num-prompts", "4", "--max-concurrency", "2"]
    argv += ["--input-len", "12", "--output-len", "160", "--no-progress", "--json", str(out)]
    assert bench_serve.main(argv) == 0
    table = capsys.readouterr().out
    assert "Output tok/s ratio (structured/plain):" in table and "Mask time per step P99 (ms):" in table
    res = json.loads(out.read_text())
    assert res["valid_answers"] == res["finished_by_stop"] == 8 and res["num_failed"] == 0
    assert res["unconstrained"]["num_requests"] == 8 and res["unconstrained"]["total_output_tokens"] > 8
    assert res["throughput_ratio"] > 0 and len(res["round_ratios"]) == 2
    t = res["server_timings"]
    assert 0 < t["p50_mask_ms"] <= t["p99_mask_ms"] and t["p50_compile_cold_ms"] > 0


def test_bench_histogram_quantile_interpolates_between_scrapes():
    from pagedkv_rs.cli.bench.serve import _histograms, quantile

    text = "\n".join(
        f'pagedkv:structured_compile_seconds_bucket{{model_name="m",cache="{c}",le="{le}"}} {n}'
        for c, le, n in [("cold", "0.001", 1), ("cold", "0.01", 3), ("cold", "+Inf", 4), ("warm", "+Inf", 0)]
    )
    h = _histograms(text, "pagedkv:structured_compile_seconds")
    assert h["cold"] == [(0.001, 1.0), (0.01, 3.0), (float("inf"), 4.0)]
    assert quantile([], h["cold"], 0.5) == pytest.approx(0.001 + 0.009 * 0.5)
    assert quantile([(0.001, 1.0), (0.01, 1.0), (float("inf"), 1.0)], h["cold"], 0.5) == pytest.approx(
        0.001 + 0.009 * 0.75
    )
    assert quantile([], h["cold"], 1.0) == 0.01  # the +Inf bucket: its lower edge
    assert quantile([], h["warm"], 0.5) != quantile([], h["warm"], 0.5)  # no observation: nan
