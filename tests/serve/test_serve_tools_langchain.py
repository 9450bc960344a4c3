"""LangChain's ``ChatOpenAI`` against a real server on loopback over SmolLM2: ``with_structured_output`` with its
default method (``json_schema`` in langchain-openai 1.x) and ``function_calling``, and
``bind_tools`` + ``invoke`` with a tool message round trip."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from pydantic import BaseModel, Field

try:
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool as lc_tool
    from langchain_openai import ChatOpenAI
except ImportError as e:  # fail, never skip
    raise ImportError(f"{e}: the LangChain tests need the test extra: pip install '.[test,model,serve]'") from e


class Weather(BaseModel):
    """The weather in a city."""

    city: str = Field(max_length=30)
    celsius: int = Field(ge=-60, le=60)


class City(BaseModel):
    city: str = Field(max_length=30, description="The city's name")


@lc_tool(args_schema=City)
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"18 C and sunny in {city}"


def chat(url: str, **kw: Any) -> ChatOpenAI:
    return ChatOpenAI(base_url=f"{url}/v1", api_key="unused", model="smollm2", max_retries=0, temperature=0, **kw)


@pytest.mark.parametrize("method", [None, "json_schema", "function_calling"])
def test_with_structured_output(llm_server, method):
    kw = {} if method is None else {"method": method}
    llm = chat(llm_server, max_tokens=60)
    out = llm.with_structured_output(Weather, include_raw=True, **kw).invoke("The weather in Paris, as JSON.")
    assert out["parsing_error"] is None, out["raw"]
    assert isinstance(out["parsed"], Weather)


def test_default_method_is_json_schema_on_the_wire(llm_server):
    """What LangChain's default sends is honoured (response_format json_schema, strict), not ignored."""
    seen: list[dict[str, Any]] = []

    def record(request: httpx.Request) -> None:
        import json

        seen.append(json.loads(request.content))

    client = httpx.Client(event_hooks={"request": [record]})
    llm = chat(llm_server, max_tokens=60, http_client=client)
    assert isinstance(llm.with_structured_output(Weather).invoke("The weather in Rome."), Weather)
    fmt = seen[-1]["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["name"] == "Weather"


def test_bind_tools_invoke_with_a_tool_message_round_trip(llm_server):
    llm = chat(llm_server, max_tokens=200)
    bound = llm.bind_tools([get_weather], tool_choice="get_weather", strict=True)  # strict: no other keys
    history: list[Any] = [HumanMessage("What is the weather in Paris?")]
    first = bound.invoke(history)
    assert isinstance(first, AIMessage) and [t["name"] for t in first.tool_calls] == ["get_weather"]
    history.append(first)
    for call in first.tool_calls:
        history.append(ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"]))
    answer = llm.bind_tools([get_weather]).invoke(history)
    assert isinstance(answer, AIMessage)
    assert answer.content or answer.tool_calls  # the conversation with the call and its result was accepted
    auto = llm.bind_tools([get_weather]).invoke(history, tool_choice="auto")
    for call in auto.tool_calls:  # a call the model opens under auto is valid for the tool
        assert set(call["args"]) == {"city"} and isinstance(call["args"]["city"], str)
