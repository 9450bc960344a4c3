"""The SSE chunk renderer's fast path; ``pagedkv bench serve``'s SSE parser and its aiohttp client (bare sockets)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from pagedkv_rs.cli.bench.serve import SSEParser, _one
from pagedkv_rs.serve.protocol import ChatCompletionRequest, CompletionRequest
from pagedkv_rs.serve.render import View as _View

TEXTS = [
    "plain",
    "",
    'a "quoted" word',
    "back\\slash \\n not a newline, \\u0000 not a NUL",
    "tab\tnewline\nreturn\r NUL\x00 bell\x07 esc\x1b del\x7f",
    "caf\u00e9 \u4f60\u597d \U0001f600 \ufffd \u2028\u2029",
    "\ud800",  # a lone surrogate (json escapes it)
    "\x00pagedkv-text\x00",  # the template's own mark, as a text
    '"\x00pagedkv-text\x00"',
    "</script>{}[],:",
]


def _view(chat: bool, model_name: str = 'SmolLM2 "q" \\ \x00pagedkv-text\x00') -> _View:
    state = SimpleNamespace(model_name=model_name, tokenizer=None)
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]) if chat else CompletionRequest(prompt="x")
    return _View(state, "cmpl-0123", chat, req)  # type: ignore[arg-type]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("text", TEXTS)
def test_text_chunk_equals_the_dict_rendering(chat, text):
    view = _view(chat)
    for k in (0, 3, 17):
        choice = {"index": k, **({"delta": {"content": text}} if chat else {"text": text})}
        choice.update(logprobs=None, finish_reason=None)
        fast = view.text_chunk(k, text)
        assert fast == view._chunk(choice)
        assert fast.startswith(b"data: ") and fast.endswith(b"\n\n")
        body = json.loads(fast[6:-2])
        assert body["choices"] == [choice]
        assert body["id"] == "cmpl-0123" and body["model"] == view.state.model_name


def test_sse_parser_events_split_anywhere():
    stream = (
        b': keep-alive\n\ndata: {"a": 1}\n\n'
        b'data:{"b": "x\\ny"}\r\n\r\n'
        b"event: note\ndata: line one\ndata:  line two\nid: 7\n\n"
        b"retry: 10\n\n"
        b"data: [DONE]\n\n"
        b"data: cut off"
    )
    want = ['{"a": 1}', '{"b": "x\\ny"}', "line one\n line two", "[DONE]"]
    assert SSEParser().feed(stream) == want
    for size in (1, 2, 3, 7, 16):
        p = SSEParser()
        got = [d for i in range(0, len(stream), size) for d in p.feed(stream[i : i + size])]
        assert got == want, size


def _sse(texts: list[str], usage: int) -> bytes:
    ev = [{"choices": [{"text": t}]} for t in texts] + [{"choices": [], "usage": {"completion_tokens": usage}}]
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in ev) + b"data: [DONE]\n\n"


SSE = _sse(["He", "llo", "", " world"], 3)


def _chunked(body: bytes, sizes: list[int]) -> bytes:
    out, i = b"", 0
    for n in sizes:
        out += b"%x;ext=1\r\n" % n + body[i : i + n] + b"\r\n"
        i += n
    assert i == len(body)
    return out + b"0\r\nX-Trailer: t\r\n\r\n"


def _serve_raw(status: bytes, head: bytes, body: bytes, seen: list[bytes]):
    """A bare-socket HTTP/1.1 server: one canned response whose body bytes arrive 7 at a time."""

    async def handle(reader, writer):
        req = await reader.readuntil(b"\r\n\r\n")
        n = int(next(ln for ln in req.split(b"\r\n") if ln.lower().startswith(b"content-length:")).split(b":")[1])
        seen.append(req + await reader.readexactly(n))
        writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: text/event-stream\r\n" + head + b"\r\n")
        for i in range(0, len(body), 7):
            writer.write(body[i : i + 7])
            await writer.drain()
            await asyncio.sleep(0)
        writer.close()

    return handle


def _bench_one(handle, body: dict, stream: bool = True):
    """``bench serve``'s request function (aiohttp) against ``handle`` on a free loopback port."""
    import aiohttp

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server, aiohttp.ClientSession(headers={"A": "b"}) as session:
            return await _one(session, f"http://127.0.0.1:{port}/v1/completions?x=1", body, stream)

    return asyncio.run(main())


@pytest.mark.parametrize("framing", ["chunked", "content-length", "close"])
def test_bench_client_times_each_text_chunk_in_each_body_framing(framing):
    if framing == "chunked":
        head, body = b"Transfer-Encoding: chunked\r\n", _chunked(SSE, [5, 1, len(SSE) - 6])
    elif framing == "content-length":
        head, body = b"Content-Length: %d\r\n" % len(SSE), SSE
    else:
        head, body = b"Connection: close\r\n", SSE
    seen: list[bytes] = []
    r = _bench_one(_serve_raw(b"200 OK", head, body, seen), {"prompt": [1, 2, 3], "stream": True})
    assert r.ok and not r.error, r.error
    assert r.output_tokens == 3 and r.prompt_len == 3
    assert len(r.itl) == 2  # three chunks with text ("" is not a token's arrival), two gaps
    assert 0 < r.ttft <= r.latency and all(x >= 0 for x in r.itl)
    req = seen[0].decode()
    assert req.startswith("POST /v1/completions?x=1 HTTP/1.1\r\n") and "\r\nA: b\r\n" in req
    assert req.endswith('{"prompt": [1, 2, 3], "stream": true}')


def test_bench_client_reports_errors_and_non_http_replies():
    seen: list[bytes] = []
    r = _bench_one(_serve_raw(b"429 Too Many Requests", b"Content-Length: 9\r\n", b"slow down", seen), {"prompt": [1]})
    assert not r.ok and r.error == "HTTP 429: b'slow down'"
    err = _sse([], 0).replace(b'{"choices": [], "usage": {"completion_tokens": 0}}', b'{"error": {"message": "boom"}}')
    r = _bench_one(_serve_raw(b"200 OK", b"Connection: close\r\n", err, seen), {"prompt": [1]})
    assert not r.ok and "boom" in r.error
    r = _bench_one(_serve_raw(b"200 OK", b"Connection: close\r\n", b"data: [DONE]\n\n", seen), {"prompt": [1]})
    assert not r.ok and r.error == "no tokens streamed"

    async def not_http(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        writer.close()

    r = _bench_one(not_http, {"prompt": [1]})
    assert not r.ok and r.error.startswith(("ClientResponseError", "ServerDisconnectedError", "ClientOSError"))
