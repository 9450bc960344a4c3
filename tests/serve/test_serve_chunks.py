"""The SSE chunk renderer's fast path and ``pagedkv bench serve``'s SSE parser, without a server."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from pagedkv_rs.cli.bench.serve import SSEParser
from pagedkv_rs.serve.app import _View
from pagedkv_rs.serve.protocol import ChatCompletionRequest, CompletionRequest

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
