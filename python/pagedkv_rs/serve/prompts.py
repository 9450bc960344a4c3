"""A request's prompt as token ids: text bounded and encoded, chat messages through the GGUF's template (tools,
calls and results as it shows them), and the constraint a forced tool call puts on the answer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Optional

from pagedkv_rs.engine.input import ContextLengthError, check_text_length
from pagedkv_rs.engine.structured import StructuredOutputsParams, special_token_id
from pagedkv_rs.serve.jobs import State
from pagedkv_rs.serve.protocol import APIError
from pagedkv_rs.serve.tools import RESERVED_TEMPLATE_VARS, ToolParser, ToolSet, caps_of, prepare_messages

__all__ = [
    "RESERVED_TEMPLATE_VARS",
    "chat_ids",
    "check_fits",
    "check_ids",
    "encode_text",
    "force_tool_call",
    "tool_constraint",
    "message_dicts",
]


def check_ids(state: State, ids: Sequence[int], param: str) -> list[int]:
    v = state.vocab_size
    for t in ids:
        if not 0 <= t < v:
            raise APIError(f"token id {t} is out of range for a vocabulary of {v}", param=param)
    return list(ids)


def check_fits(state: State, text: str, param: str) -> None:
    """Refuse a text too long for the context before it is tokenized (``engine.input.check_text_length``)."""
    try:
        check_text_length(state.tokenizer, text, state.max_model_len)
    except ContextLengthError:
        n = state.tokenizer.min_num_tokens(text)
        raise APIError(
            f"this model's maximum context length is {state.max_model_len} tokens; the {param} of {len(text)} "
            f"characters is at least {n} tokens",
            param=param,
            code="context_length_exceeded",
        ) from None


def encode_text(state: State, text: str, add_special_tokens: bool = False, param: str = "prompt") -> list[int]:
    tok = state.tokenizer
    check_fits(state, text, param)
    enc = tok.encode(text, add_special_tokens=True) if add_special_tokens else tok.encode(text)
    return list(getattr(enc, "ids", enc))


def chat_ids(state: State, req: Any, toolset: Optional[ToolSet]) -> tuple[list[int], Optional[ToolParser]]:
    """The chat request's prompt ids through the GGUF's template (tools, calls and results as it shows them, see
    ``tools.prepare_messages``), and the parser of its tool calls (None without tools)."""
    tok = state.tokenizer
    if not hasattr(tok, "apply_chat_template"):
        raise APIError("this server's tokenizer has no chat template; use /v1/completions", param="messages")
    if req.continue_final_message and req.add_generation_prompt:
        raise APIError(
            "continue_final_message and add_generation_prompt cannot both be true (send add_generation_prompt: false)",
            param="continue_final_message",
        )
    kwargs = dict(req.chat_template_kwargs or {})
    clash = sorted(RESERVED_TEMPLATE_VARS & kwargs.keys())
    if clash:
        raise APIError(f"chat_template_kwargs may not set {', '.join(clash)}", param="chat_template_kwargs")
    msgs = message_dicts(req.messages)
    check_fits(state, "".join(m["content"] for m in msgs), "messages")  # the rendered text holds them all
    template = getattr(tok, "chat_template", None)
    uses_tools = toolset is not None or any(m["role"] == "tool" or m.get("tool_calls") for m in msgs)
    tools = None
    parser = None
    if uses_tools and template is not None:
        try:
            caps = caps_of(template)
        except Exception as e:
            raise APIError(f"the chat template rejected the messages: {e}", param="messages") from None
        msgs, tools = prepare_messages(msgs, toolset, caps)
        if toolset is not None:
            parser = ToolParser(toolset, caps.family)
    if tools is not None:
        kwargs["tools"] = tools
    if req.continue_final_message:
        kwargs["continue_final_message"] = True
    try:
        return list(tok.apply_chat_template(msgs, req.add_generation_prompt, **kwargs)), parser
    except Exception as e:
        raise APIError(f"the chat template rejected the messages: {e}", param="messages") from None


def message_dicts(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Request messages as template dicts: text content, calls as ``{"id", "name", "arguments": dict}``; the
    legacy ``function_call`` / ``role: "function"`` pair becomes a call and its result."""
    out: list[dict[str, Any]] = []
    legacy_id = None
    for i, m in enumerate(messages):
        d: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            d["name"] = m.name
        calls = []
        for j, c in enumerate(m.tool_calls or []):
            param = f"messages[{i}].tool_calls[{j}].function"
            calls.append({"id": c.id, "name": c.function.name, "arguments": c.function.argument_dict(param)})
        if m.function_call is not None:
            legacy_id = f"call_legacy{i}"
            args = m.function_call.argument_dict(f"messages[{i}].function_call")
            calls.append({"id": legacy_id, "name": m.function_call.name, "arguments": args})
        if calls:
            if m.role != "assistant":
                raise APIError(f"messages[{i}]: only assistant messages carry tool calls", param="messages")
            d["tool_calls"] = calls
        if m.role == "function":
            d["role"] = "tool"
            if legacy_id is not None:
                d["tool_call_id"] = legacy_id
        elif m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def tool_constraint(state: State, params: Any, parser: ToolParser, req: Any) -> Any:
    """``params`` with the constraint the request's tools put on the answer: the forced call's JSON
    (``force_tool_call``), or for ``tool_choice: "auto"`` the family's lazy grammar (free text until the model
    opens a call, then valid calls: ``ToolSet.auto_grammar``). ``auto`` arms nothing when the request has its
    own output constraint (which then rules the whole answer) or the template's format has no known opener."""
    toolset = parser.toolset
    if parser.constrained:
        return force_tool_call(params, toolset, req)
    if toolset.choice != "auto" or getattr(params, "structured_outputs", None) is not None:
        return params
    grammar = toolset.auto_grammar(parser.family, lambda text: special_token_id(state.tokenizer, text))
    if grammar is None:
        return params
    parser.guarded = True  # the calls are the grammar's: they may stream as they are written
    return replace(params, structured_outputs=StructuredOutputsParams(grammar=grammar))


def force_tool_call(params: Any, toolset: ToolSet, req: Any) -> Any:
    """``params`` constrained to the JSON of the forced call (``tool_choice`` ``required`` or a named tool):
    ``tools.ToolSet.constraint``'s schema, through the engine's structured outputs."""
    param = "function_call" if toolset.legacy else "tool_choice"
    if getattr(params, "structured_outputs", None) is not None:
        what = repr(toolset.named or toolset.choice)
        raise APIError(
            f"{param} {what} forces a tool call: it cannot be combined with another output constraint "
            "(response_format, structured_outputs)",
            param=param,
        )
    try:
        return replace(params, structured_outputs=StructuredOutputsParams(json=toolset.constraint()))
    except (TypeError, ValueError) as e:
        raise APIError(f"the tools' parameters cannot be forced: {e}", param="tools") from None
