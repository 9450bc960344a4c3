"""The XML tool-call formats (Qwen3-Coder / Qwen3.5 / Nemotron 3 Nano / Step 3.5 ``<function=...>``, GLM 4.6 /
4.7 ``<arg_key>``): found from the real templates (llama.cpp's copies), parsed back from what each template
itself writes for a past call, typed by the tool's schema, and written under the ``auto`` grammar."""

from __future__ import annotations

from typing import Any

import pytest

from llamacpp_data import templates_dir
from pagedkv_rs.engine.structured import GrammarCompiler, StructuredOutputsParams
from pagedkv_rs.models.chat_template import ChatTemplate
from pagedkv_rs.models.tokenizer import GGUFTokenizer
from pagedkv_rs.serve.tools import ToolParser, ToolSet, caps_of, format_calls, prepare_messages

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}},
        "required": ["city"],
    },
}
NOW = {"name": "now", "parameters": {"type": "object", "properties": {}}}
TOOLSET = ToolSet((WEATHER, NOW))
XML = {
    "Qwen3-Coder": "xml",
    "Qwen3.5-4B": "xml",
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": "xml",
    "StepFun3.5-Flash": "xml",
    "GLM-4.6": "glm",
    "GLM-4.7-Flash": "glm",
}
ARGS = {"city": "New York", "days": 3, "metric": True}


def template(name: str) -> str:
    return (templates_dir() / f"{name}.jinja").read_text()


@pytest.mark.parametrize("name", sorted(XML))
def test_each_template_is_its_format_and_its_own_calls_parse_back(name):
    src = template(name)
    caps = caps_of(src)
    assert caps.tools and caps.tool_calls and caps.family == XML[name]
    call = {"id": "call_1", "name": "get_weather", "arguments": ARGS}
    msgs = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    prepared, tools = prepare_messages(msgs, TOOLSET, caps)
    text = ChatTemplate(src).render(prepared, tools=tools, add_generation_prompt=False, bos_token="", eos_token="")
    block = text[text.rindex("<tool_call>") : text.rindex("</tool_call>") + len("</tool_call>")]
    content, calls = ToolParser(TOOLSET, caps.family).parse("Let me check.\n" + block)
    assert content == "Let me check.\n" and [(c.name, c.arguments) for c in calls] == [("get_weather", ARGS)]


@pytest.mark.parametrize("family", ["xml", "glm"])
def test_values_are_typed_by_the_schema_and_bad_blocks_stay_text(family):
    p = ToolParser(TOOLSET, family)
    two = [
        {"id": "a", "name": "get_weather", "arguments": {"city": "42", "days": 2}},
        {"id": "b", "name": "now", "arguments": {}},
    ]
    text = format_calls(family, two)
    assert [(c.name, c.arguments) for c in p.parse(text)[1]] == [("get_weather", two[0]["arguments"]), ("now", {})]
    assert ToolParser(ToolSet((WEATHER, NOW), parallel=False), family).parse(text)[1][0].name == "get_weather"
    for bad in (text.replace("get_weather", "get_time"), text + " trailing words", text[:-5]):
        assert p.parse(bad) == (bad, [])


@pytest.fixture(scope="module")
def smollm2() -> Any:
    tok = GGUFTokenizer.from_gguf(None)
    return tok, GrammarCompiler(tok, tok.vocab_size, [tok.eos_token_id])


def feed(smollm2: Any, family: str, text: str, **kw: Any) -> bool:
    tok, compiler = smollm2
    g = ToolSet((WEATHER, NOW), **kw).auto_grammar(family, lambda t: None)
    m = compiler.compile(StructuredOutputsParams(grammar=g)).new_matcher()
    return all(m.consume_token(t) for t in [*tok.encode(text), tok.eos_token_id])


@pytest.mark.parametrize("family", ["xml", "glm"])
def test_the_auto_grammar_takes_text_and_the_tools_names_and_keys_only(smollm2, family):
    call = format_calls(family, [{"id": "a", "name": "get_weather", "arguments": ARGS}])
    now = format_calls(family, [{"id": "b", "name": "now", "arguments": {}}])
    assert feed(smollm2, family, "Just words, no call.")
    assert feed(smollm2, family, "Let me check.\n" + call)
    assert feed(smollm2, family, call + "\n" + now)
    assert not feed(smollm2, family, call + "\n" + now, parallel=False)
    assert not feed(smollm2, family, call.replace("get_weather", "get_time"))
    assert not feed(smollm2, family, call.replace("days", "weeks"))
    assert not feed(smollm2, family, call[: len(call) // 2])  # EOS inside a call


@pytest.mark.parametrize("name", ["MiniMax-M3", "unsloth-Apriel-1.5", "meetkai-functionary-medium-v3.1"])
def test_other_formats_get_no_json_grammar(name):
    """<tool_call> around MiniMax's <invoke>, Apriel's list, functionary's <function=...>: no family's grammar
    fits them, so auto arms none (their calls are still looked for by every parser in turn)."""
    family = caps_of(template(name)).family
    assert family == "any" and TOOLSET.auto_grammar(family, lambda t: None) is None
