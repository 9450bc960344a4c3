"""Tools, assistant ``tool_calls`` and ``role: "tool"`` results through real chat templates (llama.cpp's
``models/templates/``), as the server prepares them (``serve.tools.prepare_messages``), compared with the same
conversation passed in Hugging Face's documented tool format (``tool_calls[].function`` with the arguments as
a dict; ``ChatTemplate`` renders as ``transformers`` does, see test_chat_templates.py), and with the text each
model's documented format gives. Templates without tools get the generic format; ``continue_final_message``
cuts as ``transformers`` does.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from llamacpp_data import templates_dir
from pagedkv_rs.models.chat_template import ChatTemplate, ChatTemplateError
from pagedkv_rs.models.tokenizer import GGUFTokenizer
from pagedkv_rs.serve.tools import GENERIC_PROMPT, ToolSet, caps_of, prepare_messages

BOS, EOS = "<s>", "</s>"
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
TOOLSET = ToolSet((WEATHER,))
CALL_ID = "abc123XYZ"  # 9 alphanumerics: valid for every template (Mistral's demand exactly that)


def conversation(call_id: str = CALL_ID) -> list[dict[str, Any]]:
    """The server's message dicts (``prompts.message_dicts``): a call and its result."""
    return [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": call_id, "name": "get_weather", "arguments": {"city": "Paris"}}],
        },
        {"role": "tool", "tool_call_id": call_id, "name": "get_weather", "content": "22 C, sunny"},
    ]


def hf_conversation(call_id: str = CALL_ID, string_args: bool = False) -> list[dict[str, Any]]:
    """The same conversation as Hugging Face documents tool use (``tool_calls[].function``)."""
    args: Any = {"city": "Paris"}
    if string_args:
        args = json.dumps(args)
    call = {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": args}}
    msgs = conversation(call_id)
    msgs[2] = {"role": "assistant", "content": "", "tool_calls": [call]}
    return msgs


def source(name: str) -> str:
    return (templates_dir() / f"{name}.jinja").read_text(encoding="utf-8")


def ours(src: str, msgs: list[dict[str, Any]], toolset: Any = TOOLSET, **kw: Any) -> str:
    prepared, tools = prepare_messages(msgs, toolset, caps_of(src))
    kw.setdefault("add_generation_prompt", True)
    return ChatTemplate(src).render(prepared, tools=tools, bos_token=BOS, eos_token=EOS, **kw)


def hf(src: str, msgs: list[dict[str, Any]], tools: Any = TOOLSET, **kw: Any) -> str:
    """The conversation in Hugging Face's format, straight into the template."""
    kw.setdefault("add_generation_prompt", True)
    hf_tools = None if tools is None else tools.template_tools()
    return ChatTemplate(src).render(msgs, tools=hf_tools, bos_token=BOS, eos_token=EOS, **kw)


TOOL_TEMPLATES = {  # template: the family its model writes calls in
    "meta-llama-Llama-3.1-8B-Instruct": "llama3",
    "meta-llama-Llama-3.2-3B-Instruct": "llama3",
    "meta-llama-Llama-3.3-70B-Instruct": "llama3",
    "Qwen-Qwen2.5-7B-Instruct": "hermes",
    "Qwen-Qwen3-0.6B": "hermes",
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use": "hermes",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": "hermes",
    "ibm-granite-granite-4.0": "hermes",
    "mistralai-Mistral-Nemo-Instruct-2407": "mistral",
    "Mistral-Small-3.2-24B-Instruct-2506": "mistral-args",
    "unsloth-mistral-Devstral-Small-2507": "mistral-args",
}


@pytest.mark.parametrize("name", sorted(TOOL_TEMPLATES))
def test_tool_templates_render_the_documented_format(name):
    src = source(name)
    caps = caps_of(src)
    assert caps.tools and caps.tool_calls and caps.tool_role
    assert caps.family == TOOL_TEMPLATES[name]
    got = ours(src, conversation())
    assert got == hf(src, hf_conversation(string_args=not caps.object_arguments))
    assert "get_weather" in got and "22 C, sunny" in got and "Paris" in got


@pytest.mark.parametrize("name", ["Qwen-Qwen2.5-7B-Instruct", "meta-llama-Llama-3.1-8B-Instruct"])
def test_tools_without_calls_render_the_documented_format(name):
    src = source(name)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    assert ours(src, msgs) == hf(src, msgs)


def test_qwen25_tool_turn_text():
    """The call and its result, written out as Qwen2.5's format has them."""
    got = ours(source("Qwen-Qwen2.5-7B-Instruct"), conversation())
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n22 C, sunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    ) in got
    assert '{"type": "function", "function": {"name": "get_weather"' in got


def test_llama31_call_is_json_with_parameters():
    got = ours(source("meta-llama-Llama-3.1-8B-Instruct"), conversation())
    assert (
        '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": {"city": "Paris"}}'
        '<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n"22 C, sunny"<|eot_id|>'  # tojson, as HF
    ) in got


def test_mistral_ids_become_nine_alphanumerics_consistently():
    """OpenAI's ``call_...`` ids break Mistral's templates: both ends of a call get the same 9-character id."""
    src = source("mistralai-Mistral-Nemo-Instruct-2407")
    got = ours(src, conversation("call_0123456789abcdef"))
    ids = {m for m in __import__("re").findall(r'"(?:id|call_id)": "([^"]+)"', got)}
    assert len(ids) == 1 and len(next(iter(ids))) == 9 and next(iter(ids)).isalnum()
    with pytest.raises(ChatTemplateError, match="length 9"):
        hf(src, hf_conversation("call_0123456789abcdef"))  # what the template does with the raw id


def test_granite33_shows_tools_and_past_calls_in_its_own_format():
    """Granite 3.3's template lists tools but drops assistant tool_calls: the call is kept as the model's text."""
    src = source("ibm-granite-granite-3.3-2B-Instruct")
    caps = caps_of(src)
    assert caps.tools and not caps.tool_calls and caps.family == "tool-call"
    got = ours(src, conversation())
    assert '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]' in got
    assert "<|start_of_role|>available_tools<|end_of_role|>" in got and "22 C, sunny" in got


@pytest.mark.parametrize("name", ["microsoft-Phi-3.5-mini-instruct", "google-gemma-2-2b-it", "smollm2"])
def test_templates_without_tools_get_the_generic_format(name):
    src = GGUFTokenizer.from_gguf(None).chat_template if name == "smollm2" else source(name)
    assert src is not None
    caps = caps_of(src)
    assert not caps.tools and caps.family == "generic"
    msgs = conversation() if caps.system_role else conversation()[1:]
    got = ours(src, msgs)
    assert GENERIC_PROMPT in got and json.dumps(TOOLSET.template_tools()[0]) in got
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in got
    if caps.tool_role:
        assert "22 C, sunny" in got
    else:  # Gemma 2 refuses role "tool": the result comes as a user turn
        assert "<tool_response>\n22 C, sunny\n</tool_response>" in got
    if caps.system_role:  # the generic prompt is the system message's tail
        assert got.index("You are a weather bot.") < got.index(GENERIC_PROMPT) < got.index("Weather in Paris?")
    else:  # Gemma 2 has no system role: the prompt opens the first user turn
        assert "<start_of_turn>user\n" + GENERIC_PROMPT in got and got.index(GENERIC_PROMPT) < got.index("Paris?")


def test_generic_format_adds_a_system_message_when_there_is_none():
    src = GGUFTokenizer.from_gguf(None).chat_template
    assert src is not None
    got = ours(src, [{"role": "user", "content": "Hi"}])
    assert got.startswith("<|im_start|>system\n" + GENERIC_PROMPT)
    assert "You are a helpful AI assistant named SmolLM" not in got  # our system message replaces the default


CONTINUED = {  # the rendered prompt's tail, the final message left open, as transformers cuts it: a template
    # that writes the message as it is keeps its spaces; one that trims it (Llama's | trim) ends at its last word
    "Qwen-Qwen2.5-7B-Instruct": ("<|im_start|>user\nWhat is 6 x 7?<|im_end|>\n<|im_start|>assistant\n", False),
    "meta-llama-Llama-3.1-8B-Instruct": (
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 6 x 7?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        True,
    ),
    "mistralai-Mistral-Nemo-Instruct-2407": ("[INST]What is 6 x 7?[/INST]", False),
}


@pytest.mark.parametrize("name", sorted(CONTINUED))
@pytest.mark.parametrize("prefill", ["The answer is", "The answer is  ", " 42\n"])
def test_continue_final_message_as_transformers(name, prefill):
    src = source(name)
    msgs = [{"role": "user", "content": "What is 6 x 7?"}, {"role": "assistant", "content": prefill}]
    got = ChatTemplate(src).render(
        msgs, add_generation_prompt=False, continue_final_message=True, bos_token=BOS, eos_token=EOS
    )
    whole = ChatTemplate(src).render(msgs, add_generation_prompt=False, bos_token=BOS, eos_token=EOS)
    head, trims = CONTINUED[name]
    assert got.endswith(head + (prefill.strip() if trims else prefill))
    assert whole.startswith(got) and len(whole) > len(got)  # the turn's end is cut off


def test_continue_final_message_errors():
    src = source("Qwen-Qwen2.5-7B-Instruct")
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    with pytest.raises(ValueError, match="cannot both be true"):
        ChatTemplate(src).render(msgs, add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(ChatTemplateError, match="does not appear"):
        ChatTemplate("{{ 'fixed' }}").render(msgs, add_generation_prompt=False, continue_final_message=True)
