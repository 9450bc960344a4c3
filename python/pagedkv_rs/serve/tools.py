"""Tool calls on the server: the request's ``tools`` / ``tool_choice`` (or legacy ``functions``) as a ``ToolSet``,
and a streamed answer's calls as OpenAI's ``delta.tool_calls``. The formats themselves (rendering, parsing,
the ``auto`` grammar) are ``pagedkv_rs.models.tool_calls``, re-exported here for the server's modules."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Optional

from pagedkv_rs.models.tool_calls import (
    GENERIC_PROMPT,
    RESERVED_TEMPLATE_VARS,
    TemplateCaps,
    ToolCall,
    ToolParser,
    ToolSet,
    caps_of,
    chat_messages,
    format_calls,
    parse_tool_calls,
    prepare_messages,
)

__all__ = [
    "GENERIC_PROMPT",
    "RESERVED_TEMPLATE_VARS",
    "TemplateCaps",
    "ToolCall",
    "ToolParser",
    "ToolSet",
    "ToolStream",
    "caps_of",
    "chat_messages",
    "format_calls",
    "parse_tool_calls",
    "prepare_messages",
    "toolset_from",
]


# ------------------------------------------------------------------------------------------- streaming
class ToolStream:
    """One streamed choice: content streams until a call's opening marker; then, when a grammar writes the
    calls (``ToolParser.guarded``) in a JSON-bodied format, each call streams as OpenAI does (a first delta with
    its index, id, type, name and ``arguments: ""``, then the arguments' text piece by piece as it is written);
    otherwise the calls are sent whole when the answer ends. ``push(text, final)`` returns the content to send
    now and the ``tool_calls`` delta items; ``calls`` holds the answer's calls once ``final``."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.sent = 0  # characters of the text already sent as content
        self.holding = parser.constrained  # a constrained answer is all call
        json_bodied = parser.call_depth is not None or parser.toolset.choice == "named"
        self.incremental = parser.guarded and json_bodied and not parser.toolset.legacy
        self.ids: list[str] = []  # the id of each call whose first delta is sent
        self.args_sent: list[str] = []  # each such call's arguments text sent
        self.calls: list[ToolCall] = []

    def push(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        piece = self._content(text, final)
        if final:
            return piece, self._finish(text)
        return piece, self._deltas(text) if self.holding and self.incremental else []

    def _content(self, text: str, final: bool) -> str:
        p = self.parser
        if final:
            content, calls = p.parse(text)
            if calls or self.ids:
                self.calls = calls
                piece, self.sent = content[self.sent :], max(self.sent, len(content))
                return piece
            piece, self.sent = text[self.sent :], len(text)
            return piece
        if self.holding:
            return ""
        if p.toolset.choice == "none":
            piece, self.sent = text[self.sent :], len(text)
            return piece
        if p.json_start and self.sent == 0:
            head = text.lstrip()
            if head.startswith(("{", "<|python_tag|>")):
                self.holding = True
                return ""
            if not head or "<|python_tag|>".startswith(head):
                return ""  # the answer's start does not tell yet
        hits = [i for i in (text.find(mk, self.sent) for mk in p.markers) if i >= 0]
        if hits:
            cut, self.holding = min(hits), True
        else:
            cut = len(text) - _partial_marker(text[self.sent :], p.markers)
        piece, self.sent = text[self.sent : cut], max(self.sent, cut)
        return piece

    def _deltas(self, text: str) -> list[dict[str, Any]]:
        """The delta items for what the calls gained: new calls' first deltas, then arguments' new text."""
        out: list[dict[str, Any]] = []
        names = self.parser.toolset.names
        for j, sp in enumerate(self.parser.spans(text, self.sent)):
            if sp.name is None or sp.name not in names:
                break  # calls go in order: a call streams once its name is known
            if j == len(self.ids):
                self.ids.append(ToolCall(sp.name, {}).id)
                self.args_sent.append("")
                out.append(_head(j, self.ids[j], sp.name))
            if sp.args is None:
                break
            end = sp.args_end if sp.args_end is not None else len(text)
            new = text[sp.args + len(self.args_sent[j]) : end]
            if new:
                self.args_sent[j] += new
                out.append({"index": j, "function": {"arguments": new}})
            if sp.args_end is None:
                break
        return out

    def _finish(self, text: str) -> list[dict[str, Any]]:
        """The last deltas: the rest of each streamed call's arguments, the calls not streamed yet whole."""
        if not self.incremental:
            return [c.openai(index=j) for j, c in enumerate(self.calls)]
        out = self._deltas(text) if self.calls else []
        calls = []
        for j, c in enumerate(self.calls):
            if j >= len(self.ids):
                calls.append(c)
                out.append(c.openai(index=j))
                continue
            c = replace(c, id=self.ids[j])
            full, sent = c.arguments_text, self.args_sent[j]
            rest = full[len(sent) :] if full.startswith(sent) else ""  # the same text: sent is always its start
            if rest:
                out.append({"index": j, "function": {"arguments": rest}})
            calls.append(c)
        self.calls = calls
        return out


def _head(index: int, call_id: str, name: str) -> dict[str, Any]:
    return {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}


def _partial_marker(text: str, markers: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that begins one of ``markers`` (held back: a marker may be arriving)."""
    best = 0
    for mk in markers:
        for k in range(min(len(mk) - 1, len(text)), best, -1):
            if text.endswith(mk[:k]):
                best = k
                break
    return best


# ------------------------------------------------------------------------------------------ the request
def toolset_from(req: Any) -> Optional[ToolSet]:
    """The chat request's tools (``tools``/``tool_choice`` or the legacy ``functions``/``function_call``) checked
    against each other; None when it has none. Raises ``APIError`` (400) for a contradiction."""
    from pagedkv_rs.serve.protocol import APIError

    legacy = req.functions is not None or req.function_call is not None
    if legacy and (req.tools is not None or req.tool_choice is not None):
        raise APIError("use tools/tool_choice or the legacy functions/function_call, not both", param="functions")
    if legacy:
        defs = list(req.functions or [])
        choice_param, raw = "function_call", req.function_call
        named = raw.name if raw is not None and not isinstance(raw, str) else None
    else:
        defs = [t.function for t in req.tools or []]
        choice_param, raw = "tool_choice", req.tool_choice
        named = raw.function.name if raw is not None and not isinstance(raw, str) else None
    choice = "named" if named is not None else (raw or "auto")
    if not defs:
        if raw is not None and raw != "none":
            raise APIError(f"{choice_param} needs {'functions' if legacy else 'tools'}", param=choice_param)
        return None
    tools = tuple(d.model_dump(exclude_none=True, exclude={"strict"}) | _strict(d) for d in defs)
    names = [t["name"] for t in tools]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise APIError(f"two tools are named {dup!r}", param="functions" if legacy else "tools")
    if named is not None and named not in names:
        raise APIError(f"{choice_param} names {named!r}, which is not among the tools", param=choice_param)
    parallel = False if legacy else req.parallel_tool_calls is not False
    return ToolSet(tools, choice=choice, named=named, parallel=parallel, legacy=legacy)


def _strict(d: Any) -> dict[str, Any]:
    return {"strict": True} if d.strict else {}
