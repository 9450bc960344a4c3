"""/metrics names and values; ``pagedkv serve`` options; ``pagedkv bench serve`` against a live server."""

from __future__ import annotations

import json

import httpx
import pytest

from pagedkv_rs.cli import main as cli
from pagedkv_rs.cli import serve as cli_serve
from pagedkv_rs.cli.bench import serve as bench_serve
from pagedkv_rs.serve.protocol import CompletionRequest, to_sampling_params
from pagedkv_rs.serve.render import chat_logprobs, completion_logprobs

NAMES = [
    "num_requests_running",
    "num_requests_waiting",
    "num_requests_swapped",
    "kv_cache_usage_perc",
    "kv_cache_blocks",
    "prompt_tokens_total",
    "generation_tokens_total",
    "request_success_total",
    "num_preemptions_total",
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
    "kv_block_evictions_total",
    "kv_block_allocations_total",
    "request_aborted_total",
    "time_to_first_token_seconds_bucket",
    "inter_token_latency_seconds_bucket",
    "e2e_request_latency_seconds_bucket",
    "request_queue_time_seconds_bucket",
    "engine_step_seconds_bucket",
    "request_prompt_tokens_bucket",
    "request_generation_tokens_bucket",
]


def _values(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, v = line.rsplit(" ", 1)
            out[key] = float(v)
    return out


def test_metrics_count_what_was_served(serve_tiny):
    with serve_tiny() as (url, _, _srv), httpx.Client(base_url=url) as c:
        for _ in range(3):
            r = c.post(
                "/v1/completions", json={"prompt": [5] * 40, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
            )
            assert r.status_code == 200
        text = c.get("/metrics").text
        for name in NAMES:
            assert f"pagedkv:{name}" in text, name
        v = _values(text)
        lab = '{model_name="tiny"}'
        assert v[f"pagedkv:generation_tokens_total{lab}"] == 15
        assert v[f"pagedkv:prompt_tokens_total{lab}"] == 120
        assert v['pagedkv:request_success_total{finished_reason="length",model_name="tiny"}'] == 3
        assert v[f"pagedkv:time_to_first_token_seconds_count{lab}"] == 3
        assert v[f"pagedkv:inter_token_latency_seconds_count{lab}"] == 12
        assert v[f"pagedkv:request_generation_tokens_sum{lab}"] == 15
        assert v[f"pagedkv:prefix_cache_hits_total{lab}"] >= 64  # requests 2 and 3 hit the first's two full blocks
        assert v[f"pagedkv:engine_step_seconds_count{lab}"] >= 5
        assert v[f"pagedkv:num_requests_running{lab}"] == 0


def test_serve_cli_options():
    args = cli_serve.build_parser().parse_args(
        [
            "--port",
            "0",
            "--api-key",
            "k",
            "--max-queued-requests",
            "3",
            "--request-timeout",
            "9",
            "--kv-dtype",
            "float32",
            "--policy",
            "priority",
        ]
    )
    assert (args.port, args.api_key, args.max_queued_requests, args.request_timeout) == (0, "k", 3, 9.0)
    assert (args.policy, args.preemption_mode) == ("priority", "recompute")
    assert cli.COMMANDS[("serve",)] == "pagedkv_rs.cli.serve"
    with pytest.raises(SystemExit):
        cli_serve.build_parser().parse_args(["--num-blocks", "4", "--kv-memory", "1G"])


def test_bench_serve_against_a_live_server(serve_tiny, tmp_path, capsys):
    with serve_tiny(api_key="k") as (url, _, _srv):
        out = tmp_path / "r.json"
        argv = [
            "--base-url",
            url,
            "--api-key",
            "k",
            "--num-prompts",
            "6",
            "--input-len",
            "20",
            "--output-len",
            "8",
            "--max-concurrency",
            "3",
            "--token-range",
            "100:1000",
            "--json",
            str(out),
            "--no-progress",
        ]
        assert cli.main(["bench", "serve", *argv]) == 0
        table = capsys.readouterr().out
        assert "Output token throughput (tok/s):" in table and "P99 ITL (ms):" in table
        res = json.loads(out.read_text())
        assert res["num_requests"] == 6 and res["num_failed"] == 0 and res["total_output_tokens"] == 48
        assert res["total_input_tokens"] == 120
        assert (
            bench_serve.main(
                [
                    "--base-url",
                    url,
                    "--num-prompts",
                    "2",
                    "--no-progress",
                    "--model",
                    "tiny",
                    "--request-rate",
                    "50",
                    "--no-stream",
                    "--output-len",
                    "4",
                ]
            )
            == 2
        )  # no key: GET /v1/models answers 401, before any request
        assert "HTTP 401" in capsys.readouterr().err


def test_request_fields_map_onto_sampling_params():
    with pytest.raises(Exception, match="not supported"):
        to_sampling_params(CompletionRequest(prompt="x", echo=True), max_tokens=4)
    p = to_sampling_params(CompletionRequest(prompt="x", min_p=0.5, n=2, stop="z", min_tokens=1), max_tokens=4)
    assert (p.min_p, p.n, p.stop, p.min_tokens) == (0.5, 2, ("z",), 1)
    p = to_sampling_params(CompletionRequest(prompt="x", temperature=0, top_k=-1, seed=3, priority=2), max_tokens=4)
    assert (p.max_tokens, p.temperature, p.top_k, p.seed, p.priority) == (4, 0.0, 0, 3, 2)


class _Tok:
    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)


class _LP:
    def __init__(self, logprob, rank, decoded_token=None):
        self.logprob, self.rank, self.decoded_token = logprob, rank, decoded_token


def test_logprobs_in_openai_shapes():
    lps = [{7: _LP(-0.1, 1, "a"), 9: _LP(-2.5, 2, "b")}, {3: _LP(-0.7, 2), 4: _LP(-0.2, 1)}]
    c = completion_logprobs([7, 3], lps, _Tok())
    assert c == {
        "tokens": ["a", "<3>"],
        "token_logprobs": [-0.1, -0.7],
        "top_logprobs": [{"a": -0.1, "b": -2.5}, {"<3>": -0.7, "<4>": -0.2}],
        "text_offset": [0, 1],
    }
    ch = chat_logprobs([7], lps[:1], _Tok())["content"][0]
    assert ch["token"] == "a" and ch["logprob"] == -0.1 and ch["bytes"] == [97]
    assert [t["token"] for t in ch["top_logprobs"]] == ["a", "b"]
