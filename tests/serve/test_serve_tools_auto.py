"""``tool_choice: "auto"`` under a lazy grammar: free text until the model opens a call, then valid calls.

The grammar of each format family runs on scripted token sequences (SmolLM2's vocabulary, llguidance's matcher
fed token by token); the bundled SmolLM2 answers through a real server on loopback: a plain answer is the same
bytes as with no grammar, and a call it opens is valid for the tool's schema where, unconstrained, it is not.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import jsonschema
import openai
import pytest
from tool_util import SHOT, WEATHER

from pagedkv_rs.engine.structured import GrammarCompiler, StructuredOutputsParams, special_token_id
from pagedkv_rs.models.tokenizer import GGUFTokenizer
from pagedkv_rs.serve.tools import ToolParser, ToolSet

TIME = {
    "name": "get_time",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]},
}
TOOLS = [{"type": "function", "function": WEATHER}]


@pytest.fixture(scope="module")
def smollm2() -> tuple[GGUFTokenizer, GrammarCompiler]:
    tok = GGUFTokenizer.from_gguf(None)
    return tok, GrammarCompiler(tok, tok.vocab_size, [tok.eos_token_id])


def feed(smollm2: Any, grammar: str, text: str) -> Optional[str]:
    """None when the grammar takes ``text`` token by token and then EOS; else the text up to the refused token."""
    tok, compiler = smollm2
    m = compiler.compile(StructuredOutputsParams(grammar=grammar)).new_matcher()
    ids = tok.encode(text)
    for i, t in enumerate(ids):
        if not m.consume_token(t):
            return tok.decode(ids[: i + 1])
    return None if m.consume_token(tok.eos_token_id) else text + "<EOS>"


def grammar(family: str, special: Any = None, **kw: Any) -> str:
    g = ToolSet((WEATHER, TIME), **kw).auto_grammar(family, special or (lambda text: None))
    assert g is not None
    return g


CALL = '{"name": "get_time", "arguments": {"tz": "UTC"}}'
CASES = {
    "hermes": (
        ["Sure.", "Let me look. <tool_call>\n" + CALL + "\n</tool_call>", "<tool_call>" + CALL + "</tool_call>\n"],
        [
            ("<tool_call>\n" + CALL.replace("get_time", "get_date"), '<tool_call>\n{"name": "get_d'),
            ("<tool_call> hello", "<tool_call> hello"),
            ("<tool_call>\n" + CALL.replace('"UTC"', "3"), '<tool_call>\n{"name": "get_time", "arguments": {"tz": 3'),
            ("<tool_call>\n" + CALL + "\n</tool_call> and then text", None),
            ('<tool_call>\n{"name": "get_time", "arguments": {"tz": "UT', None),  # EOS inside a call
        ],
    ),
    "llama3": (
        [
            "Sure.",
            '{"name": "get_time", "parameters": {"tz": "UTC"}}',
            '{"name": "get_time", "parameters": {"tz": "UTC"}}; {"name": "get_time", "parameters": {"tz": "CET"}}',
        ],
        [
            (' {"x": 1}', ' {"x'),
            ('{"name": "get_time", "parameters": {"tz": "UTC"}}; ', None),
            ('{"name": "get_time", "arguments": {}}', '{"name": "get_time", "arguments'),
        ],
    ),
    "mistral": (
        ["Sure.", '[TOOL_CALLS] [{"name": "get_time", "arguments": {"tz": "UTC"}, "id": "a1b2c3d4e"}]'],
        [("[TOOL_CALLS] hello", "[TOOL_CALLS] hello"), ("[TOOL_CALLS] []", "[TOOL_CALLS] []")],
    ),
    "mistral-args": (
        [
            "Sure.",
            '[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{"tz": "UTC"}[TOOL_CALLS]get_weather[ARGS]{"city": "X"}',
        ],
        [('[TOOL_CALLS]get_time[ARGS]{"city": "X"}', '[TOOL_CALLS]get_time[ARGS]{"city')],
    ),
    "tool-call": (
        ["Sure.", '<|tool_call|>[{"name": "get_time", "arguments": {"tz": "UTC"}}]<|/tool_call|>'],
        [
            (
                '<|tool_call|>[{"name": "get_time", "arguments": {}}]',
                '<|tool_call|>[{"name": "get_time", "arguments": {}',
            )
        ],
    ),
}


@pytest.mark.parametrize("family", sorted(CASES))
def test_auto_grammar_takes_text_and_valid_calls_only(smollm2, family):
    good, bad = CASES[family]
    g = grammar(family)
    for text in good:
        text = text.replace("arguments", "arguments").replace("parameters", "parameters")
        assert feed(smollm2, g, text) is None, text
        if family != "llama3":  # the parser agrees: a call where the grammar took one
            content, calls = ToolParser(ToolSet((WEATHER, TIME)), family).parse(text)
            assert bool(calls) == (text != "Sure."), text
    for text, refused_at in bad:
        text = text.replace("arguments", "arguments")
        got = feed(smollm2, g, text)
        assert got is not None, text
        if refused_at is not None:
            assert got.startswith(refused_at), (text, got)


def test_parallel_false_takes_one_call():
    two = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>\n<tool_call>'
    tok = GGUFTokenizer.from_gguf(None)
    s = (tok, GrammarCompiler(tok, tok.vocab_size, [tok.eos_token_id]))
    assert feed(s, grammar("hermes"), two + '\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>') is None
    assert feed(s, grammar("hermes", parallel=False), two) is not None
    array = '[TOOL_CALLS] [{"name": "get_time", "arguments": {"tz": "UTC"}}, {"name": "get_time", "arguments": {}}]'
    assert feed(s, grammar("mistral", parallel=False), array).endswith('"arguments": {"tz": "UTC"}},')


def test_a_marker_the_vocabulary_holds_as_one_special_token(smollm2):
    tok, _ = smollm2
    # SmolLM2's control tokens <file_sep> / <filename> stand in for a vocabulary's <tool_call> / </tool_call>
    opened, closed = tok.token_to_id("<file_sep>"), tok.token_to_id("<filename>")
    assert special_token_id(tok, "<file_sep>") == opened and special_token_id(tok, "hello") is None
    g = grammar("hermes", {"<tool_call>": opened, "</tool_call>": closed}.get)
    call = '\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n'
    assert feed(smollm2, g, f"Sure. <file_sep>{call}<filename>") is None
    assert feed(smollm2, g, f"Sure. <tool_call>{call}</tool_call>") is None  # spelled as text: the same call
    assert feed(smollm2, g, "Sure. <file_sep> hello") is not None
    assert feed(smollm2, g, "Sure, <filename> in text") is not None  # free text never holds a special token


def test_families_without_a_known_opener_arm_nothing():
    assert ToolSet((WEATHER,)).auto_grammar("any", lambda text: None) is None


# ------------------------------------------------------------------------------------------------ SmolLM2


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_plain_answers_are_the_bytes_of_no_grammar(llm_server):
    c = client(llm_server)
    for text in ("Say hello.", "Write two sentences about the sea.", "List three fruits."):
        msgs = [{"role": "user", "content": text}]
        kw: dict[str, Any] = {"model": "smollm2", "messages": msgs, "tools": TOOLS, "temperature": 0, "max_tokens": 48}
        auto = c.chat.completions.create(tool_choice="auto", **kw).choices[0]
        free = c.chat.completions.create(tool_choice="none", **kw).choices[0]  # the same prompt, no grammar
        assert not auto.message.tool_calls
        assert auto.message.content == free.message.content and auto.finish_reason == free.finish_reason


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_call_smollm2_opens_is_valid(llm_server, temperature):
    c = client(llm_server)
    kw: dict[str, Any] = {"model": "smollm2", "messages": SHOT, "tools": TOOLS, "max_tokens": 80, "seed": 7}
    if temperature == 0.0:  # unconstrained, the model opens a call and writes one no schema accepts
        free = c.chat.completions.create(tool_choice="none", temperature=0, **kw).choices[0]
        assert free.message.content.startswith("<tool_call>")
        assert not ToolParser(ToolSet((WEATHER,)), "generic").parse(free.message.content)[1]
    r = c.chat.completions.create(tool_choice="auto", temperature=temperature, n=4, **kw)
    calls = 0
    for ch in r.choices:
        if ch.finish_reason != "tool_calls":  # at temperature 1 it may answer in words: never a broken call
            assert ch.finish_reason == "stop" and "<tool_call>" not in ch.message.content
            continue
        for call in ch.message.tool_calls:
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), WEATHER["parameters"])
            calls += 1
    assert calls >= (4 if temperature == 0.0 else 1)


def test_auto_with_its_own_output_constraint_keeps_that_constraint(llm_server):
    r = client(llm_server).chat.completions.create(
        model="smollm2",
        messages=SHOT,
        tools=TOOLS,
        temperature=0,
        max_tokens=20,
        response_format={"type": "json_object"},
    )
    assert r.choices[0].message.content.startswith("{") and not r.choices[0].message.tool_calls


def test_tools_with_their_own_defs_compile_side_by_side(smollm2):
    """Pydantic's schemas keep nested models in ``$defs``: nested in one grammar, each tool keeps its own."""
    from pydantic import BaseModel

    class Address(BaseModel):
        city: str

    class Ship(BaseModel):
        to: Address

    class Point(BaseModel):  # another "Address" with another shape
        x: int

    class Move(BaseModel):
        to: Point

    schema = Move.model_json_schema()
    schema["$defs"]["Address"] = schema["$defs"].pop("Point")
    schema["properties"]["to"] = {"$ref": "#/$defs/Address"}
    tools = ({"name": "ship", "parameters": Ship.model_json_schema()}, {"name": "move", "parameters": schema})
    g = ToolSet(tools).auto_grammar("hermes", lambda text: None)
    assert g is not None
    ship = '<tool_call>\n{"name": "ship", "arguments": {"to": {"city": "Oslo"}}}\n</tool_call>'
    assert feed(smollm2, g, ship) is None
    assert feed(smollm2, g, ship.replace('"ship"', '"move"')) is not None  # move's Address has x, not city
    assert feed(smollm2, g, '<tool_call>\n{"name": "move", "arguments": {"to": {"x": 3}}}\n</tool_call>') is None
    required = ToolSet(tools, choice="required").constraint()
    tok, compiler = smollm2
    m = compiler.compile(StructuredOutputsParams(json=required)).new_matcher()
    assert all(m.consume_token(t) for t in tok.encode('[{"name": "move", "arguments": {"to": {"x": 3}}}]'))
