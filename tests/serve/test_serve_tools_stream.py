"""Streamed tool calls as OpenAI streams them: a call's first delta carries its index, id, type, name and
``arguments: ""``, then its arguments arrive in pieces as they are written; reassembled, the stream is the
non-streamed answer (the parsers' streaming on every JSON-bodied family, and SmolLM2 through a real server read
by the ``openai`` client and LangChain)."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from tool_util import SHOT, TIME, WEATHER

from pagedkv_rs.serve.tools import ToolParser, ToolSet, ToolStream

try:
    from langchain_core.tools import tool as lc_tool
    from langchain_openai import ChatOpenAI
except ImportError as e:  # fail, never skip
    raise ImportError(f"{e}: the tool tests need the test extra: pip install '.[test,model,serve]'") from e

TOOLS = [{"type": "function", "function": WEATHER}]


def guarded(family: str, **kw: Any) -> ToolParser:
    p = ToolParser(ToolSet((WEATHER, TIME), **kw), family)
    p.guarded = True  # as when the auto grammar is armed
    return p


def reassemble(p: ToolParser, text: str, step: int) -> tuple[str, dict[int, dict[str, Any]], list[dict[str, Any]]]:
    """Stream ``text`` ``step`` characters at a time: (content, calls by index, every delta item in order)."""
    st, content, calls, items = ToolStream(p), "", {}, []
    ends = [*range(step, len(text), step), len(text)]
    for end in ends:
        piece, got = st.push(text[:end], end == len(text))
        content += piece
        items += got
        for d in got:
            slot = calls.setdefault(d["index"], {"id": None, "name": "", "arguments": ""})
            slot["id"] = d.get("id", slot["id"])
            slot["name"] += d["function"].get("name", "")
            slot["arguments"] += d["function"].get("arguments", "")
    return content, calls, items


W, T = '{"name": "get_weather", "arguments": {"city": "Paris"}}', '{"name": "get_time", "arguments": {"tz": "UTC"}}'
ANSWERS = [
    ("hermes", {}, f"Let me look.\n<tool_call>\n{W}\n</tool_call>\n<tool_call>\n{T}\n</tool_call>"),
    ("generic", {}, f"<tool_call>\n{W}\n</tool_call>"),
    ("llama3", {}, W.replace("arguments", "parameters") + "; " + T.replace("arguments", "parameters")),
    ("mistral", {}, f"Sure.[TOOL_CALLS] [{W}, {T}]"),
    ("tool-call", {}, f"<|tool_call|>[{W}, {T}]<|/tool_call|>"),
    ("hermes", {"choice": "required"}, f"[{W}, {T}]"),
    ("hermes", {"choice": "named", "named": "get_weather"}, '{"city": "Paris"}'),
]


@pytest.mark.parametrize("step", [1, 4])
@pytest.mark.parametrize(("family", "kw", "text"), ANSWERS)
def test_arguments_stream_in_pieces_and_reassemble_to_the_whole_answer(family, kw, text, step):
    p = guarded(family, **kw)
    content, calls, items = reassemble(p, text, step)
    whole_content, whole = p.parse(text)
    assert whole and content == whole_content
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c.name, c.openai()["function"]["arguments"]) for c in whole
    ]
    for j in calls:  # the first delta of each call: index, id, type, name, arguments ""
        first = next(d for d in items if d["index"] == j)
        assert first["id"].startswith("call_") and first["type"] == "function"
        assert first["function"] == {"name": calls[j]["name"], "arguments": ""}
        assert sum(1 for d in items if d["index"] == j and d["function"].get("arguments")) > (step == 1)
    assert json.loads(calls[0]["arguments"]) == whole[0].arguments


def test_without_a_grammar_the_calls_come_whole_at_the_end():
    p = ToolParser(ToolSet((WEATHER, TIME)), "hermes")  # not guarded: a call might still prove invalid
    text = f"<tool_call>\n{W}\n</tool_call>"
    _, calls, items = reassemble(p, text, 1)
    assert len(items) == 1 and items[0]["function"]["arguments"] == '{"city": "Paris"}'


# ------------------------------------------------------------------------------------------------ SmolLM2


def test_smollm2_streamed_call_equals_the_whole_answer(llm_server):
    c = openai.OpenAI(base_url=f"{llm_server}/v1", api_key="unused", max_retries=0)
    kw: dict[str, Any] = {"model": "smollm2", "messages": SHOT, "tools": TOOLS, "temperature": 0, "max_tokens": 80}
    whole = c.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls"
    pieces, calls, finish = 0, {}, None
    for chunk in c.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        for tc in chunk.choices[0].delta.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": tc.id, "name": tc.function.name, "arguments": ""})
            slot["arguments"] += tc.function.arguments or ""
            pieces += bool(tc.function.arguments)
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and pieces > 1
    assert [(v["name"], v["arguments"]) for _, v in sorted(calls.items())] == [
        (t.function.name, t.function.arguments) for t in whole.message.tool_calls
    ]
    with c.chat.completions.stream(**kw) as s:  # the client's own assembly
        final = s.get_final_completion().choices[0].message
    assert [(t.function.name, t.function.arguments) for t in final.tool_calls] == [
        (t.function.name, t.function.arguments) for t in whole.message.tool_calls
    ]


def test_langchain_tool_call_chunks(llm_server):
    @lc_tool
    def get_weather(city: str) -> str:
        """The weather in a city"""
        return "sunny"

    llm = ChatOpenAI(base_url=f"{llm_server}/v1", api_key="unused", model="smollm2", max_retries=0, temperature=0)
    bound = llm.bind_tools([get_weather])
    whole = bound.invoke(SHOT, max_tokens=80)
    chunks = list(bound.stream(SHOT, max_tokens=80))
    with_args = [ch for ch in chunks if any(t.get("args") for t in ch.tool_call_chunks)]
    assert len(with_args) > 1  # the arguments arrive in pieces
    total = chunks[0]
    for ch in chunks[1:]:
        total = total + ch
    assert [(t["name"], t["args"]) for t in total.tool_calls] == [(t["name"], t["args"]) for t in whole.tool_calls]
    assert whole.tool_calls and whole.tool_calls[0]["name"] == "get_weather"
