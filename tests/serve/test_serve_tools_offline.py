"""``LLM.chat`` with tools, ``continue_final_message`` and ``chat_template_kwargs`` (vLLM's offline shape), and
``parse_tool_calls``: the prompt is the server's for the same request, the output the server's answer text."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from tool_util import SHOT, WEATHER

from pagedkv_rs import SamplingParams
from pagedkv_rs.models.tool_calls import parse_tool_calls

TOOLS = [{"type": "function", "function": WEATHER}]
GREEDY = SamplingParams(max_tokens=40, temperature=0.0)


def server_prompt(url: str, body: dict[str, Any]) -> list[int]:
    r = httpx.post(f"{url}/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_chat_with_tools_renders_the_servers_prompt_and_answers_its_text(llm, llm_server):
    out = llm.chat(SHOT, GREEDY, tools=TOOLS)[0]
    assert out.prompt_token_ids == server_prompt(llm_server, {"messages": SHOT, "tools": TOOLS})
    body = {"messages": SHOT, "tools": TOOLS, "tool_choice": "none", "max_tokens": 40, "temperature": 0}
    r = httpx.post(f"{llm_server}/v1/chat/completions", json=body, timeout=120).json()
    assert out.outputs[0].text == r["choices"][0]["message"]["content"]
    assert "get_weather" in llm.tokenizer.decode(out.prompt_token_ids)  # the tools are in the prompt
    plain = llm.chat(SHOT[-1:], GREEDY)[0]
    assert "get_weather" not in llm.tokenizer.decode(plain.prompt_token_ids)


def test_continue_final_message_and_template_kwargs(llm, llm_server):
    prefill = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "My favourite is"}]
    out = llm.chat(prefill, GREEDY, add_generation_prompt=False, continue_final_message=True)[0]
    body = {"messages": prefill, "add_generation_prompt": False, "continue_final_message": True}
    assert out.prompt_token_ids == server_prompt(llm_server, body)
    assert llm.tokenizer.decode(out.prompt_token_ids).endswith("My favourite is")
    with pytest.raises(ValueError, match="add_generation_prompt"):
        llm.chat(prefill, GREEDY, continue_final_message=True)
    with pytest.raises(ValueError, match="may not set tools"):
        llm.chat(SHOT, GREEDY, chat_template_kwargs={"tools": []})
    kw = llm.chat(SHOT[-1:], GREEDY, chat_template_kwargs={"unused_flag": True})[0]
    assert kw.prompt_token_ids == llm.chat(SHOT[-1:], GREEDY)[0].prompt_token_ids
    with pytest.raises(ValueError, match="OpenAI function tool"):
        llm.chat(SHOT, GREEDY, tools=[{"type": "retrieval"}])


def test_parse_tool_calls_reads_each_templates_format(llm):
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    content, calls = parse_tool_calls(text, TOOLS, llm.tokenizer.chat_template)  # SmolLM2: the generic format
    assert content == "Sure.\n" and [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Paris"})]
    item = calls[0].openai()
    assert item["type"] == "function" and json.loads(item["function"]["arguments"]) == {"city": "Paris"}
    llama = "{% if tools %}<|python_tag|>{{ tools | tojson }}{% endif %}{{ messages[0]['content'] }}"
    got = parse_tool_calls('{"name": "get_weather", "parameters": {"city": "Oslo"}}', [WEATHER], llama)
    assert [(c.name, c.arguments) for c in got[1]] == [("get_weather", {"city": "Oslo"})]
    assert parse_tool_calls("No call here.", TOOLS) == ("No call here.", [])
    two = text + '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    assert len(parse_tool_calls(two, TOOLS)[1]) == 2 and len(parse_tool_calls(two, TOOLS, parallel=False)[1]) == 1
