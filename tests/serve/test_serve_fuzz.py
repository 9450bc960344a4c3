"""Hypothesis over request bodies: wrong types, huge/negative numbers, deep JSON, bad UTF-8, unknown fields -> 4xx."""

from __future__ import annotations

import json

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

FIELDS = [
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "n",
    "seed",
    "stream",
    "stream_options",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "cache_salt",
    "priority",
    "model",
    "logprobs",
    "min_p",
    "repetition_penalty",
    "echo",
    "tokens",
    "add_generation_prompt",
    "zzz_unknown",
]
PATHS = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]

numbers = st.one_of(
    st.integers(-(10**30), 10**30),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0, -1, 1, 2**63, 2**64, -(2**63) - 1, 1e308]),
)
leaves = st.one_of(st.none(), st.booleans(), numbers, st.text(max_size=20))
values = st.recursive(
    leaves,
    lambda c: st.one_of(st.lists(c, max_size=4), st.dictionaries(st.text(max_size=8), c, max_size=4)),
    max_leaves=12,
)


def _deep(depth: int) -> bytes:
    return b'{"prompt": ' + b"[" * depth + b"1" + b"]" * depth + b"}"


bodies = st.one_of(
    st.dictionaries(st.sampled_from(FIELDS), values, max_size=6).map(lambda d: json.dumps(d).encode()),
    st.binary(max_size=64),
    st.integers(50, 3000).map(_deep),
    st.text(max_size=30).map(lambda t: b'{"prompt": "' + t.encode("utf-8", "surrogatepass") + b'\xff\xfe"}'),
)


def test_no_body_gets_a_5xx(serve_tiny):
    with serve_tiny() as (url, engine, _srv), httpx.Client(base_url=url, timeout=30) as c:

        @settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
        @given(path=st.sampled_from(PATHS), body=bodies)
        def check(path: str, body: bytes) -> None:
            r = c.post(path, content=body, headers={"content-type": "application/json"})
            assert r.status_code < 500, (path, body[:200], r.status_code, r.text[:300])
            if r.status_code >= 400:
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}

        check()
        assert c.get("/health").status_code == 200
