"""Tool calling and the request-field audit, through a real uvicorn server on loopback.

The parsers run on answers written in each family's format (the ones llama.cpp's ``tests/test-chat.cpp``
parses). The server tests script the model's answer (``ScriptedModel``: the tiny engine's model with its logits
replaced by a fixed token sequence after the prompt, SmolLM2's vocabulary), so that a call arrives exactly as a
model writes it; the real ``openai`` client and LangChain's ``ChatOpenAI`` read the answers.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import numpy as np
import pytest
from tool_util import TIME, WEATHER

from pagedkv_rs.serve.protocol import METADATA, UNSUPPORTED
from pagedkv_rs.serve.tools import ToolCall, ToolParser, ToolSet, ToolStream

try:
    import openai
    from langchain_core.tools import tool as lc_tool
    from langchain_openai import ChatOpenAI
except ImportError as e:  # fail, never skip
    raise ImportError(f"{e}: the tool tests need the test extra: pip install '.[test,model,serve]'") from e

TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": TIME}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


# ------------------------------------------------------------------------------------------------ parsers
def parser(family: str, *tools: dict[str, Any], **kw: Any) -> ToolParser:
    return ToolParser(ToolSet(tools or (WEATHER, TIME), **kw), family)


def calls_of(found: tuple[str, list[ToolCall]]) -> list[tuple[str, dict[str, Any]]]:
    return [(c.name, c.arguments) for c in found[1]]


SPECIAL = {"name": "special_function", "parameters": {"type": "object", "properties": {"arg1": {"type": "integer"}}}}
OPT = {"name": "special_function_with_opt", "parameters": {"type": "object"}}
ONE = [("special_function", {"arg1": 1})]


@pytest.mark.parametrize(
    ("family", "text", "content", "calls"),
    [  # the answers llama.cpp's test-chat.cpp parses, per template family
        ("hermes", '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}</tool_call>', "", ONE),
        (
            "hermes",
            'Hello, world!\nWhat\'s up?<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}</tool_call>',
            "Hello, world!\nWhat's up?",
            ONE,
        ),
        ("hermes", '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}\n</tool_call>', "", ONE),
        (
            "mistral",
            '[TOOL_CALLS][{"name": "special_function", "arguments": {"arg1": 1}, "id": "123456789"}]',
            "",
            ONE,
        ),
        ("mistral-args", '[TOOL_CALLS]special_function[CALL_ID]123456789[ARGS]{"arg1": 1}', "", ONE),
        (
            "mistral-args",
            '[TOOL_CALLS]special_function[CALL_ID]000000001[ARGS]{"arg1": 1}'
            '[TOOL_CALLS]special_function_with_opt[CALL_ID]000000002[ARGS]{"arg1": 1, "arg2": 2}',
            "",
            [*ONE, ("special_function_with_opt", {"arg1": 1, "arg2": 2})],
        ),
        (
            "mistral-args",
            'Hello, world!\nWhat\'s up?[TOOL_CALLS]special_function[ARGS]{"arg1": 1}',
            "Hello, world!\nWhat's up?",
            ONE,
        ),
        ("llama3", '{"name": "special_function", "parameters": {"arg1": 1}}', "", ONE),
        ("llama3", '<|python_tag|>{"name": "special_function", "parameters": {"arg1": 1}}', "", ONE),
        ("tool-call", '<|tool_call|>[{"name": "special_function", "arguments": {"arg1": 1}}]', "", ONE),
        ("any", '[TOOL_CALLS][{"name": "special_function", "arguments": "{\\"arg1\\": 1}"}]', "", ONE),
        ("any", '{"name": "special_function", "arguments": {"arg1": 1}}', "", ONE),
    ],
)
def test_parsers_on_known_model_outputs(family, text, content, calls):
    found = parser(family, SPECIAL, OPT).parse(text)
    assert found[0] == content and calls_of(found) == calls
    assert all(c.id.startswith("call_") and len(c.id) > 10 for c in found[1])


@pytest.mark.parametrize(
    ("family", "text"),
    [
        ("hermes", "Hello, world!"),
        ("hermes", '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}'),  # cut off
        ("hermes", '<tool_call>\n{"name": "no_such_tool", "arguments": {}}\n</tool_call>'),
        ("hermes", '<tool_call>\n{"name": "special_function", "arguments": [1]}\n</tool_call>'),
        ("hermes", '<tool_call>{"name": "special_function", "arguments": {}}</tool_call> and then prose'),
        ("llama3", 'Sure: {"name": "special_function", "parameters": {"arg1": 1}}'),  # not at the answer's start
        ("mistral-args", "[TOOL_CALLS]special_function[ARGS]{not json"),
        ("mistral", "[TOOL_CALLS] nothing"),
    ],
)
def test_what_is_not_a_valid_call_stays_content(family, text):
    assert parser(family, SPECIAL).parse(text) == (text, [])


def test_strict_tools_keep_only_calls_their_schema_accepts():
    strict = {**WEATHER, "strict": True}
    p = parser("hermes", strict)
    assert calls_of(p.parse(PARIS)) == [("get_weather", {"city": "Paris"})]
    bad = '<tool_call>{"name": "get_weather", "arguments": {"town": "Paris"}}</tool_call>'
    assert p.parse(bad) == (bad, [])


def test_parallel_false_keeps_the_first_call_and_choice_none_parses_nothing():
    two = PARIS + '\n<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>'
    assert len(parser("hermes").parse(two)[1]) == 2
    assert calls_of(parser("hermes", parallel=False).parse(two)) == [("get_weather", {"city": "Paris"})]
    assert parser("hermes", choice="none").parse(two) == (two, [])


def test_constrained_answers_are_plain_json():
    req = parser("hermes", choice="required")
    assert calls_of(req.parse('[{"name": "get_time", "arguments": {"tz": "UTC"}}]')) == [("get_time", {"tz": "UTC"})]
    assert calls_of(parser("hermes", choice="named", named="get_weather").parse('{"city": "Rome"}')) == [
        ("get_weather", {"city": "Rome"})
    ]
    assert req.parse('[{"name": "get_time"') == ('[{"name": "get_time"', [])  # cut off by max_tokens


def test_forcing_schemas():
    s = ToolSet((WEATHER, TIME), choice="required", parallel=False).constraint()
    assert s is not None and s["type"] == "array" and s["minItems"] == 1 and s["maxItems"] == 1
    assert [o["properties"]["name"]["const"] for o in s["items"]["anyOf"]] == ["get_weather", "get_time"]
    assert s["items"]["anyOf"][0]["properties"]["arguments"] == WEATHER["parameters"]
    assert ToolSet((WEATHER,), choice="named", named="get_weather").constraint() == WEATHER["parameters"]
    assert ToolSet((WEATHER,)).constraint() is None
    odd = {"name": "required", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}
    assert ToolSet((odd, WEATHER), choice="named", named="required").constraint() == odd["parameters"]


def stream_all(p: ToolParser, text: str, step: int = 1) -> tuple[list[str], list[ToolCall]]:
    st, pieces = ToolStream(p), []
    for end in range(step, len(text), step):
        piece, items = st.push(text[:end], False)
        assert not items or p.guarded
        pieces.append(piece)
    piece, _ = st.push(text, True)
    return [*pieces, piece], st.calls


@pytest.mark.parametrize("step", [1, 3, 7])
@pytest.mark.parametrize(
    ("family", "text", "content"),
    [
        ("hermes", "Let me look.\n" + PARIS, "Let me look.\n"),
        ("generic", PARIS, ""),
        ("llama3", '  {"name": "get_weather", "parameters": {"city": "Paris"}}', ""),
        ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', ""),
        ("mistral", 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', "Sure."),
        ("tool-call", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]', ""),
    ],
)
def test_stream_sends_content_until_the_marker_then_the_calls(family, text, content, step):
    pieces, calls = stream_all(parser(family), text, step)
    assert "".join(pieces) == content
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("text", ["Plain <b>text</b> with a < sign", "<tool_call>{broken", "{not a call at all}"])
def test_stream_without_a_valid_call_sends_all_the_text(text):
    for family in ("hermes", "llama3", "any"):
        pieces, calls = stream_all(parser(family), text)
        assert "".join(pieces) == text and calls == []


def test_stream_holds_back_a_marker_that_may_be_arriving():
    st = ToolStream(parser("hermes"))
    assert st.push("Hi <tool_", False) == ("Hi ", [])
    assert st.push("Hi <tool_x", False) == ("<tool_x", [])


# ------------------------------------------------------------------------------------------------ the server
class ScriptedModel:
    """The tiny model's shape, answering ``script`` (token ids) after a prompt of ``prompt_len`` tokens, then EOS."""

    def __init__(self, base: Any) -> None:
        for a in ("num_layers", "num_kv_heads", "head_dim", "vocab_size", "max_model_len", "eos_token_ids"):
            setattr(self, a, getattr(base, a))
        self.prompt_len, self.script = 0, []

    def forward(self, batch: Any, kv_caches: Any, logits_indices: Any = None) -> np.ndarray:
        rows = batch.query_start_loc[1:].astype(np.int64) - 1 if logits_indices is None else logits_indices
        logits = np.zeros((len(rows), self.vocab_size), np.float32)
        for r, pos in enumerate(np.asarray(batch.positions)[rows]):
            i = int(pos) + 1 - self.prompt_len
            logits[r, self.script[i] if 0 <= i < len(self.script) else self.eos_token_ids[0]] = 50.0
        return logits


@pytest.fixture
def scripted(serve_tiny, make_tiny_engine, tiny_model, llm):
    """``(url, say)``: a server whose model answers what ``say(text, messages, tools)`` scripts for that prompt."""
    model = ScriptedModel(tiny_model)
    with serve_tiny(engine=make_tiny_engine(model)) as (url, _engine, _srv):

        def say(text: str, messages: list[dict[str, Any]] = ASK, tools: Any = TOOLS) -> None:
            body: dict[str, Any] = {"messages": messages}
            if tools:
                body["tools"] = tools
            r = httpx.post(f"{url}/tokenize", json=body)
            assert r.status_code == 200, r.text
            model.prompt_len = r.json()["count"]
            model.script = llm.tokenizer.encode(text)

        yield url, say


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_auto_call_with_the_openai_client(scripted):
    url, say = scripted
    say("Let me check." + PARIS)
    r = client(url).chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    both = client(url).chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, n=2, temperature=1.0)
    assert [c.message.tool_calls[0].function.name for c in both.choices] == ["get_weather"] * 2
    assert both.choices[0].message.tool_calls[0].id != both.choices[1].message.tool_calls[0].id


def test_streamed_tool_deltas_reassemble(scripted):
    url, say = scripted
    second = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
    say("One moment. " + PARIS + "\n" + second)
    c = client(url)
    content, calls = "", {}
    for chunk in c.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, stream=True):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        assert "<tool_call>" not in (d.content or "")
        content += d.content or ""
        for tc in d.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            slot["id"] = tc.id or slot["id"]
            slot["name"] += (tc.function.name or "") if tc.function else ""
            slot["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = chunk.choices[0].finish_reason
    assert content == "One moment. " and finish == "tool_calls"
    assert [(v["name"], json.loads(v["arguments"])) for _, v in sorted(calls.items())] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"tz": "UTC"}),
    ]
    assert all(v["id"].startswith("call_") for v in calls.values())
    # the openai client's own stream helper assembles the same message
    with c.chat.completions.stream(model="tiny", messages=ASK, tools=TOOLS) as s:
        final = s.get_final_completion()
    assert [t.function.name for t in final.choices[0].message.tool_calls] == ["get_weather", "get_time"]


def test_parallel_tool_calls_false_returns_one_call(scripted):
    url, say = scripted
    say(PARIS + PARIS.replace("Paris", "Rome"))
    r = client(url).chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, parallel_tool_calls=False)
    assert [json.loads(t.function.arguments) for t in r.choices[0].message.tool_calls] == [{"city": "Paris"}]


def test_tool_result_round_trip(scripted):
    url, say = scripted
    c = client(url)
    say(PARIS)
    first = c.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS)
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        first.choices[0].message.model_dump(),  # with its null refusal, audio, annotations
        {"role": "tool", "tool_call_id": call.id, "content": "22 C and sunny"},
    ]
    r = httpx.post(f"{url}/tokenize", json={"messages": history, "tools": TOOLS})
    text = _decode(r.json()["tokens"])
    assert PARIS in text and "<|im_start|>tool\n22 C and sunny<|im_end|>" in text
    say("It is 22 C and sunny in Paris.", history)
    answer = c.chat.completions.create(model="tiny", messages=history, tools=TOOLS)
    assert answer.choices[0].message.content == "It is 22 C and sunny in Paris."
    assert answer.choices[0].finish_reason == "stop" and not answer.choices[0].message.tool_calls


def _decode(ids: list[int]) -> str:
    from pagedkv_rs.models.tokenizer import GGUFTokenizer

    return GGUFTokenizer.from_gguf(None).decode(ids)


def _encode(text: str) -> list[int]:
    from pagedkv_rs.models.tokenizer import GGUFTokenizer

    return GGUFTokenizer.from_gguf(None).encode(text)


def test_invalid_call_and_choice_none_answer_text(scripted):
    url, say = scripted
    c = client(url)
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    say(broken)  # the auto grammar does not let EOS end a call: max_tokens cuts it, and it stays text
    n = len(_encode(broken))
    r = c.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=n)
    assert r.choices[0].message.content == broken and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "length"
    say(PARIS)
    r = c.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.content == PARIS and r.choices[0].finish_reason == "stop"


def test_legacy_functions_answer_with_function_call(scripted):
    url, say = scripted
    say(PARIS)
    body = {"messages": ASK, "functions": [WEATHER, TIME], "function_call": "auto"}
    r = httpx.post(f"{url}/v1/chat/completions", json=body).json()
    msg = r["choices"][0]["message"]
    assert r["choices"][0]["finish_reason"] == "function_call" and "tool_calls" not in msg
    assert msg["function_call"]["name"] == "get_weather" and json.loads(msg["function_call"]["arguments"]) == {
        "city": "Paris"
    }
    history = [*ASK, {"role": "assistant", "content": None, "function_call": msg["function_call"]}]
    history.append({"role": "function", "name": "get_weather", "content": "22 C"})
    r2 = httpx.post(f"{url}/tokenize", json={"messages": history})
    assert r2.status_code == 200 and PARIS in _decode(r2.json()["tokens"])


def test_langchain_bind_tools(scripted):
    url, say = scripted

    @lc_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    say(PARIS, tools=[{"type": "function", "function": _lc_schema(get_weather)}])
    llm = ChatOpenAI(base_url=f"{url}/v1", api_key="unused", model="tiny", max_retries=0, temperature=0)
    msg = llm.bind_tools([get_weather]).invoke(ASK[0]["content"])
    assert [(t["name"], t["args"]) for t in msg.tool_calls] == [("get_weather", {"city": "Paris"})]
    chunks = list(llm.bind_tools([get_weather]).stream(ASK[0]["content"]))
    total = chunks[0]
    for ch in chunks[1:]:
        total = total + ch
    assert [(t["name"], t["args"]) for t in total.tool_calls] == [("get_weather", {"city": "Paris"})]


def _lc_schema(t: Any) -> dict[str, Any]:
    from langchain_core.utils.function_calling import convert_to_openai_tool

    return convert_to_openai_tool(t)["function"]


# --------------------------------------------------------------------------------------------- refusals
def _refused(r: httpx.Response, param: str, code: Any = "unsupported_parameter") -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == code, err
    return err["message"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_every_known_but_unimplemented_field_is_refused(llm_server, path):
    base: dict[str, Any] = {"max_tokens": 1}
    base.update({"messages": ASK} if "chat" in path else {"prompt": "Hi"})
    with httpx.Client(base_url=llm_server, timeout=60) as c:
        for name, offs in UNSUPPORTED.items():
            if name == "echo" and "chat" not in path:
                continue  # completions implement echo as a field of their own (refused when true)
            on = {"x": 1} if None in offs and len(offs) == 1 else "flex" if name == "service_tier" else 7
            assert "is not supported" in _refused(c.post(path, json={**base, name: on}), name)
            for off in offs:  # the "off" values pass
                assert c.post(path, json={**base, name: off}).status_code == 200, (name, off)
        for name in METADATA:
            assert c.post(path, json={**base, name: {"k": "v"} if name == "metadata" else "id-1"}).status_code == 200
        assert "unknown field" in _refused(c.post(path, json={**base, "temprature": 0.5}), "temprature")


def test_chat_request_errors(llm_server):
    def post(**body: Any) -> httpx.Response:
        return httpx.post(f"{llm_server}/v1/chat/completions", json={"messages": ASK, "max_tokens": 1, **body})

    named = {"type": "function", "function": {"name": "get_weather"}}
    assert "needs tools" in _refused(post(tool_choice="auto"), "tool_choice", None)
    assert post(tool_choice="none").status_code == 200
    assert "not among the tools" in _refused(post(tools=TOOLS[1:], tool_choice=named), "tool_choice", None)
    assert "not both" in _refused(post(tools=TOOLS, functions=[WEATHER]), "functions", None)
    assert "two tools" in _refused(post(tools=[TOOLS[0], TOOLS[0]]), "tools", None)
    assert post(tools=[{"type": "code_interpreter"}]).status_code == 400
    assert post(tools=[{"type": "function", "function": {"name": "bad name!"}}]).status_code == 400
    assert _refused(post(tools=[{"type": "function", "function": {**WEATHER, "x_extra": 1}}]), "tools")
    bad_args = [
        *ASK,
        {
            "role": "assistant",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{x"}}],
        },
    ]
    assert "not valid JSON" in _refused(post(messages=bad_args), "messages", None)
    both = post(messages=[*ASK, {"role": "assistant", "content": "It"}], continue_final_message=True)
    assert "cannot both be true" in _refused(both, "continue_final_message", None)
    assert "may not set" in _refused(post(chat_template_kwargs={"messages": []}), "chat_template_kwargs", None)
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    assert "image_url" in _refused(post(messages=image), "messages")
    assert "x_secret" in _refused(post(messages=[{**ASK[0], "x_secret": 1}]), "messages")
    echoed = [*ASK, {"role": "assistant", "content": "Hi", "refusal": None, "annotations": []}, ASK[0]]
    assert post(messages=echoed).status_code == 200  # what OpenAI's response objects carry back


# ------------------------------------------------------------------------ forced calls (constrained decoding)
UNIT = {
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
CLOCK = {
    "name": "get_time",
    "parameters": {
        "type": "object",
        "properties": {"tz": {"type": "string", "pattern": "^[A-Z]{3}$"}, "hour24": {"type": "boolean"}},
        "required": ["tz", "hour24"],
        "additionalProperties": False,
    },
}
FORCED = [{"type": "function", "function": UNIT}, {"type": "function", "function": CLOCK}]


def _validate(call: Any) -> None:
    import jsonschema

    schema = {"get_weather": UNIT, "get_time": CLOCK}[call.function.name]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_and_named_choices_force_valid_calls(llm_server, temperature):
    """Even the 135M model answers ``required`` / a named tool with a call whose arguments match the schema."""
    c = client(llm_server)
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice, parallel in (("required", None), ("required", False), (named, None)):
        extra = {} if parallel is None else {"parallel_tool_calls": parallel}
        r = c.chat.completions.create(
            model="smollm2", messages=ASK, tools=FORCED, tool_choice=choice, max_tokens=200, temperature=temperature,
            seed=7, **extra,
        )  # fmt: skip
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", ch
        assert ch.message.content is None and ch.message.tool_calls
        for call in ch.message.tool_calls:
            _validate(call)
        if parallel is False:
            assert len(ch.message.tool_calls) == 1
        if choice is named:
            assert [t.function.name for t in ch.message.tool_calls] == ["get_time"]


def test_forced_call_streams_and_legacy_named_function(llm_server):
    c = client(llm_server)
    with c.chat.completions.stream(
        model="smollm2", messages=ASK, tools=FORCED, tool_choice="required", max_tokens=200, temperature=0
    ) as s:
        final = s.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls"
    for call in final.choices[0].message.tool_calls:
        _validate(call)
    body = {"messages": ASK, "functions": [UNIT, CLOCK], "function_call": {"name": "get_weather"}, "max_tokens": 200}
    r = httpx.post(f"{llm_server}/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
    assert r["finish_reason"] == "function_call" and r["message"]["function_call"]["name"] == "get_weather"
    import jsonschema

    jsonschema.validate(json.loads(r["message"]["function_call"]["arguments"]), UNIT["parameters"])


def test_openai_strict_pydantic_tool(llm_server):
    """``openai.pydantic_function_tool`` (a strict tool) forced by name, read back with the client's ``.parse``."""
    from pydantic import BaseModel

    class Lookup(BaseModel):
        city: str
        days: int

    c = client(llm_server)
    r = c.chat.completions.parse(
        model="smollm2",
        messages=ASK,
        tools=[openai.pydantic_function_tool(Lookup)],
        tool_choice={"type": "function", "function": {"name": "Lookup"}},
        max_tokens=100,
        temperature=0,
    )
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "Lookup" and isinstance(call.function.parsed_arguments, Lookup)


def test_langchain_forced_tools_and_structured_output_by_function_calling(llm_server):
    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        """The weather report for a city."""

        city: str = Field(max_length=40)
        celsius: int

    llm = ChatOpenAI(base_url=f"{llm_server}/v1", api_key="unused", model="smollm2", max_retries=0, temperature=0)
    out = llm.with_structured_output(Weather, method="function_calling").invoke(ASK[0]["content"], max_tokens=100)
    assert isinstance(out, Weather)
    # strict: additionalProperties false, or the 135M model keeps adding keys until max_tokens
    msg = llm.bind_tools([Weather], tool_choice="any", strict=True).invoke(ASK[0]["content"], max_tokens=100)
    assert [t["name"] for t in msg.tool_calls] == ["Weather"]
    Weather.model_validate(msg.tool_calls[0]["args"])


def test_prefill_and_template_kwargs(llm_server):
    c = client(llm_server)
    msgs = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hello! My name is"}]
    r = httpx.post(
        f"{llm_server}/tokenize",
        json={"messages": msgs, "add_generation_prompt": False, "continue_final_message": True},
    )
    assert _decode(r.json()["tokens"]).endswith("<|im_start|>assistant\nHello! My name is")
    out = c.chat.completions.create(
        model="smollm2",
        messages=msgs,
        max_tokens=4,
        temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True},
    )
    assert out.choices[0].message.content  # the continuation of "Hello! My name is"
    assert out.usage.prompt_tokens == r.json()["count"]
    # chat_template_kwargs reach the template as variables (this template ignores unknown ones)
    kw = httpx.post(
        f"{llm_server}/tokenize", json={"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}
    )
    assert (
        kw.status_code == 200
        and kw.json()["tokens"] == httpx.post(f"{llm_server}/tokenize", json={"messages": ASK}).json()["tokens"]
    )


def test_control_token_markers_are_put_back_into_the_answer():
    """``<|python_tag|>`` is a control token: the answer's text drops it, the parser gets it back where it was."""
    from types import SimpleNamespace

    from llamacpp_data import vocab_files
    from pagedkv_rs.models.tokenizer import GGUFTokenizer, _read_metadata
    from pagedkv_rs.serve.render import View

    # Llama 3's vocabulary with control token 128010 under its Llama 3.1 name, as a Llama 3.1 GGUF has it
    path, meta = _read_metadata(next(p for p in vocab_files() if p.name == "ggml-vocab-llama-bpe.gguf"))
    tokens = list(meta["tokenizer.ggml.tokens"])
    assert tokens[128010] == "<|reserved_special_token_5|>"
    tokens[128010] = "<|python_tag|>"
    tok = GGUFTokenizer({**meta, "tokenizer.ggml.tokens": tokens}, path=path)
    said = 'Sure.<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'
    ids = tok.encode(said)
    assert tok.token_to_id("<|python_tag|>") in ids
    text = tok.decode(ids, skip_special_tokens=True, continuation=True)
    assert "<|python_tag|>" not in text
    view = View(SimpleNamespace(tokenizer=tok, model_name="m"), "id", True, SimpleNamespace(n=1), tools=parser("any"))
    out = SimpleNamespace(text=text, token_ids=ids, finish_reason="stop", logprobs=None)
    assert view._tool_text(out) == said
    cut = SimpleNamespace(text=text[:3], token_ids=ids, finish_reason="stop", logprobs=None)  # a stop string hit
    assert view._tool_text(cut) == text[:3]


def test_a_tool_without_parameters_takes_none(scripted):
    url, say = scripted
    bare = [{"type": "function", "function": {"name": "ping"}}]
    say('<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>', tools=bare)
    r = client(url).chat.completions.create(model="tiny", messages=ASK, tools=bare)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "ping" and json.loads(call.function.arguments) == {}
