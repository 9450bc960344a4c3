"""Small findings of the attack run against ``pagedkv serve`` (issue 32), each with the real server."""

from __future__ import annotations

import httpx
import pytest


@pytest.mark.parametrize("path", ["/metrics", "/health"])
def test_head_is_answered_like_get(llm_server, path):
    get, head = httpx.get(llm_server + path), httpx.head(llm_server + path)
    assert head.status_code == get.status_code == 200 and head.content == b""
    assert head.headers["content-type"] == get.headers["content-type"]


def test_stream_options_without_stream_is_refused(llm_server):
    body = {"prompt": "Hi", "max_tokens": 2, "stream_options": {"include_usage": True}}
    r = httpx.post(llm_server + "/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


def test_continuous_usage_stats_is_refused_not_ignored(llm_server):
    body = {"prompt": "Hi", "max_tokens": 2, "stream": True, "stream_options": {"continuous_usage_stats": True}}
    r = httpx.post(llm_server + "/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_parameter"


def test_a_prompt_over_the_context_is_told_so_without_a_negative_count(llm_server):
    limit = httpx.get(llm_server + "/v1/models").json()["data"][0]["max_model_len"]
    chat = {"messages": [{"role": "user", "content": "hello " * (limit + 41)}]}  # no max_tokens: the rest
    r = httpx.post(llm_server + "/v1/chat/completions", json=chat)
    err = r.json()["error"]
    assert r.status_code == 400 and "leaves no room for output" in err["message"] and "-41" not in err["message"]
