"""Tool calls in chat templates: tool definitions and past calls into the template, the model's answer back into
calls (the server's ``serve.tools`` and the offline ``LLM.chat`` share it).

Rendering. A template that shows ``tools`` gets them as Hugging Face passes them (``[{"type": "function",
"function": {name, description, parameters}}]``), and the conversation's assistant ``tool_calls`` and ``role:
"tool"`` messages as message dicts (arguments as a dict, or as the JSON string where the template wants that).
What a template shows is probed once per template by rendering sample conversations (as llama.cpp's template
capabilities are); what it cannot show falls back to text: a template without tools gets ``GENERIC_PROMPT`` in
its system message, past calls it cannot render become assistant text in the family's format, and tool results
it cannot render become user messages inside ``<tool_response>`` tags.

Parsing. One parser per format family, chosen from the template's text:

=============  ==========================================================================  ==========================
family         what the model writes                                                       templates
=============  ==========================================================================  ==========================
hermes         ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (repeated)     Qwen2.5/3, Hermes 2/3,
                                                                                           Granite 4, SmolLM3
llama3         ``{"name": ..., "parameters": {...}}`` (after an optional ``<|python_tag|>``)  Llama 3.1/3.2/3.3
mistral        ``[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}]``              Mistral 7B v0.3, Nemo
mistral-args   ``[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}`` (``[CALL_ID]`` optional)         Mistral Small 3.2,
                                                                                           Devstral, Ministral 3
tool-call      ``<|tool_call|>[{"name": ..., "arguments": {...}}]``                        Granite 3.x, Phi-4-mini
xml            ``<tool_call><function=name><parameter=key>value</parameter>...</function>``  Qwen3-Coder, Qwen3.5,
               ``</tool_call>`` (repeated)                                                 Nemotron 3 Nano, Step 3.5
glm            ``<tool_call>name<arg_key>key</arg_key><arg_value>value</arg_value>...``    GLM 4.6 / 4.7
               ``</tool_call>`` (repeated)
generic        the hermes format, taught by ``GENERIC_PROMPT``                             templates without tools
any            every parser above in turn                                                  other tool templates
=============  ==========================================================================  ==========================

In the two XML formats a value is text: it becomes the JSON value it spells (``3``, ``true``, ``{...}``) unless
the tool's schema types that parameter as a string (as the templates write values: strings bare, others as
JSON). A call is returned only when it names one of the request's tools and its arguments are a JSON object (valid
against the tool's schema when the tool is ``strict``); otherwise the whole answer is content. With
``tool_choice`` ``required`` or a named function the engine's JSON-schema constraint writes the call as plain
JSON (``REQUIRED`` below, or the named tool's arguments), which is parsed as such. With ``auto`` the family's
lazy grammar (``ToolSet.auto_grammar``, llama.cpp's lazy grammar in llguidance's Lark) leaves the text free until
the model writes the family's opening marker, then forces each call to name a tool and carry arguments valid for
its schema (one call when ``parallel_tool_calls`` is false); the ``any`` family has no such grammar.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

__all__ = [
    "GENERIC_PROMPT",
    "RESERVED_TEMPLATE_VARS",
    "chat_messages",
    "parse_tool_calls",
    "TemplateCaps",
    "ToolSet",
    "ToolCall",
    "ToolParser",
    "caps_of",
    "family_of",
    "format_calls",
    "prepare_messages",
]

GENERIC_PROMPT = (
    "You can call the following tools. To call a tool, answer with only a JSON object inside "
    "<tool_call></tool_call> tags, one block per call:\n"
    '<tool_call>\n{"name": <tool name>, "arguments": <the arguments as a JSON object>}\n</tool_call>\n'
    "Tools:\n"
)

# Variables the caller itself passes to a chat template: chat_template_kwargs may not set them.
RESERVED_TEMPLATE_VARS = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "bos_token", "eos_token"}
)

# The format families' opening markers: text from the first of them on is a call (streaming buffers it).
MARKERS: dict[str, tuple[str, ...]] = {
    "hermes": ("<tool_call>",),
    "generic": ("<tool_call>",),
    "llama3": ("<|python_tag|>",),
    "mistral": ("[TOOL_CALLS]",),
    "mistral-args": ("[TOOL_CALLS]",),
    "tool-call": ("<|tool_call|>",),
    "xml": ("<tool_call>",),
    "glm": ("<tool_call>",),
    "any": ("<tool_call>", "[TOOL_CALLS]", "<|tool_call|>", "<|python_tag|>"),
}
JSON_START = frozenset({"llama3", "any"})  # families whose call may open with a bare "{" at the answer's start


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    text: Optional[str] = None  # the arguments as the model wrote them (what a stream sends piece by piece)

    @property
    def arguments_text(self) -> str:
        return self.text if self.text is not None else json.dumps(self.arguments, ensure_ascii=False)

    def openai(self, index: Optional[int] = None) -> dict[str, Any]:
        """OpenAI's ``tool_calls`` item (with ``index`` for a stream delta)."""
        out: dict[str, Any] = {} if index is None else {"index": index}
        out.update(id=self.id, type="function", function={"name": self.name, "arguments": self.arguments_text})
        return out


@dataclass(frozen=True)
class ToolSet:
    """The request's tools: ``tools`` (OpenAI function dicts), ``choice`` (``"none"``, ``"auto"``,
    ``"required"``, or ``"named"`` with the tool's name in ``named``), ``parallel`` (more than one call allowed),
    ``legacy`` (asked with ``functions`` / ``function_call``: the answer carries ``function_call``)."""

    tools: tuple[Mapping[str, Any], ...]
    choice: str = "auto"
    named: Optional[str] = None
    parallel: bool = True
    legacy: bool = False

    def __post_init__(self) -> None:
        if self.choice not in ("none", "auto", "required", "named") or (self.choice == "named") != (
            self.named is not None
        ):
            raise ValueError(f"bad tool choice {self.choice!r} (named={self.named!r})")

    @property
    def names(self) -> dict[str, Mapping[str, Any]]:
        return {t["name"]: t for t in self.tools}

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as Hugging Face's ``apply_chat_template(tools=...)`` passes them (a tool without
        ``parameters`` takes none: an empty object schema, which templates can print)."""
        return [{"type": "function", "function": {**t, "parameters": _params(t)}} for t in self.tools]

    def constraint(self) -> Optional[dict[str, Any]]:
        """The JSON schema that forces ``required`` / a named choice; None for ``auto`` and ``none``."""
        if self.choice == "required":
            params, defs = _hoist_defs([_params(t) for t in self.tools])
            one = [
                {
                    "type": "object",
                    "properties": {"name": {"const": t["name"]}, "arguments": p},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for t, p in zip(self.tools, params)
            ]
            schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": one}}
            if not self.parallel:
                schema["maxItems"] = 1
            if defs:
                schema["$defs"] = defs
            return schema
        if self.named is None:
            return None
        return _params(self.names[self.named])

    def auto_grammar(self, family: str, special: Callable[[str], Optional[int]]) -> Optional[str]:
        """The llguidance Lark grammar of ``tool_choice: "auto"`` for the family's format, or None (``any``).

        llama.cpp's lazy grammar in one grammar: free text until the family's opening marker (a lazy lexeme:
        it ends at the marker's first occurrence, so plain text is never masked), then the calls, each valid
        JSON for one tool's schema; after the last call only whitespace and the end. ``special(marker)``: the
        marker's token id when the vocabulary holds it as one special token (a grammar names it ``<[id]>``).
        """
        g = _Grammar(self, special)
        if family == "llama3":
            return _llama3_grammar(g)
        build = _AUTO.get(family)
        return None if build is None else g.build(build)


# The JSON of a call is written the way templates show it: json.dumps' separators, no other whitespace.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_WS = "/[ \\t\\r\\n]{0,4}/"  # between the pieces of a call: a little whitespace, never unbounded


class _Grammar:
    """Builds one ``auto`` grammar: the family's pieces (markers, call bodies) as Lark rules."""

    def __init__(self, toolset: ToolSet, special: Callable[[str], Optional[int]]) -> None:
        self.toolset, self.special = toolset, special

    def mark(self, marker: str) -> str:
        """A marker as a rule body: its text, or the special token spelled that way."""
        tid = self.special(marker)
        return json.dumps(marker) if tid is None else f"(<[{tid}]> | {json.dumps(marker)})"

    def body(self, args_key: str, array: bool = False, with_id: bool = False) -> str:
        """``%json`` of one call ``{"name": const, args_key: schema}`` (any tool), or of a list of them."""
        one = []
        params, defs = _hoist_defs([_params(t) for t in self.toolset.tools])
        for t, p in zip(self.toolset.tools, params):
            props: dict[str, Any] = {"name": {"const": t["name"]}, args_key: p}
            if with_id:
                props["id"] = {"type": "string"}
            one.append(
                {"type": "object", "properties": props, "required": ["name", args_key], "additionalProperties": False}
            )
        schema: dict[str, Any] = {"anyOf": one} if len(one) > 1 else one[0]
        if array:
            schema = {"type": "array", "items": schema, "minItems": 1}
            if not self.toolset.parallel:
                schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        return "%json " + json.dumps({**schema, "x-guidance": _JSON_STYLE})

    def build(self, family: Callable[[_Grammar], tuple[str, str, list[str]]]) -> str:
        trigger, calls, rules = family(self)
        alts = ["TEXT", "head calls"]
        tid = self.special(trigger)
        if tid is not None:
            alts.append(f"TEXT <[{tid}]> calls")
        lines = [
            "%llguidance {}",
            "start: " + " | ".join(alts),
            "TEXT: /(?s:.*)/",
            f"head[lazy]: /(?s:.*)/ {json.dumps(trigger)}",
            f"calls: {calls}",
            *rules,
        ]
        return "\n".join(lines) + "\n"


def _hermes_grammar(g: _Grammar) -> tuple[str, str, list[str]]:
    more = f" ({_WS} {g.mark('<tool_call>')} call)*" if g.toolset.parallel else ""
    return (
        "<tool_call>",
        f"call{more} {_WS}",
        [f"call: /[ \\t]*\\n?/ body {_WS} {g.mark('</tool_call>')}", f"body: {g.body('arguments')}"],
    )


def _array_grammar(trigger: str, closer: str = "") -> Callable[[_Grammar], tuple[str, str, list[str]]]:
    """One JSON list of calls after the trigger (Mistral v0.3, Granite 3 / Phi-4-mini)."""

    def build(g: _Grammar) -> tuple[str, str, list[str]]:
        close = f" {g.mark(closer)}?" if closer else ""
        return trigger, f"/[ \\t]{{0,2}}/ body{close} {_WS}", [f"body: {g.body('arguments', array=True, with_id=True)}"]

    return build


def _mistral_args_grammar(g: _Grammar) -> tuple[str, str, list[str]]:
    names = " | ".join(
        f"{json.dumps(t['name'])} cid? {g.mark('[ARGS]')} args{i}" for i, t in enumerate(g.toolset.tools)
    )
    more = f" ({_WS} {g.mark('[TOOL_CALLS]')} call)*" if g.toolset.parallel else ""
    rules = [f"call: {names}", f"cid: {g.mark('[CALL_ID]')} /[A-Za-z0-9]{{9}}/"]
    rules += [
        f"args{i}: %json " + json.dumps({**_params(t), "x-guidance": _JSON_STYLE})
        for i, t in enumerate(g.toolset.tools)
    ]
    return "[TOOL_CALLS]", f"call{more} {_WS}", rules


def _llama3_grammar(g: _Grammar) -> str:
    """Llama 3.x: the answer is a call when it opens with ``{`` or ``<|python_tag|>``, text otherwise."""
    sep = "/[ \\t]*[;,]?[ \\t\\r\\n]{0,4}/"
    more = f" ({sep} body)*" if g.toolset.parallel else ""
    tag = g.mark("<|python_tag|>")
    lines = [
        "%llguidance {}",
        f"start: TEXT | {_WS} calls | {tag} {_WS} calls",
        "TEXT: /(?s:[ \\t\\r\\n]*([^{ \\t\\r\\n<].*|<([^|].*)?)?)/",
        f"calls: body{more} {_WS}",
        f"body: {g.body('parameters')}",
    ]
    return "\n".join(lines) + "\n"


def _tagged_grammar(g: _Grammar, head: str, param: str, value_end: str) -> tuple[str, str, list[str]]:
    """The XML formats: ``<tool_call>``, ``head`` with a tool's name, its parameters (``param`` with one of the
    tool's parameter names, then a value: any text up to ``value_end``), ``</tool_call>``. Names and keys are
    the tools'; values are text (the parser types them by the schema)."""
    more = f" ({_WS} {g.mark('<tool_call>')} call)*" if g.toolset.parallel else ""
    rules = [f"value[lazy]: /(?s:.*)/ {json.dumps(value_end)}"]
    fns = []
    for i, t in enumerate(g.toolset.tools):
        keys = list((_params(t).get("properties") or {}).keys())
        params = ""
        if keys:
            rules.append(f"p{i}: {param.format(' | '.join(json.dumps(k) for k in keys))} /\\n?/")
            params = f" p{i}*"
        fns.append(f"fn{i}")
        rules.append(f"fn{i}: {head.format(json.dumps(t['name']))}{params}")
    rules.insert(0, "fn: " + " | ".join(fns))
    return "<tool_call>", f"call{more} {_WS}", rules


def _xml_grammar(g: _Grammar) -> tuple[str, str, list[str]]:
    trigger, calls, rules = _tagged_grammar(
        g, '"<function=" {} ">" /\\n?/', '"<parameter=" ({}) ">" value', "</parameter>"
    )
    close = g.mark("</tool_call>")
    return trigger, calls, [f'call: /[ \\t]*\\n?/ fn "</function>" /[ \\t]*\\n?/ {close}', *rules]


def _glm_grammar(g: _Grammar) -> tuple[str, str, list[str]]:
    trigger, calls, rules = _tagged_grammar(
        g, "{} /\\n?/", '"<arg_key>" ({}) "</arg_key>" /\\n?/ "<arg_value>" value', "</arg_value>"
    )
    return trigger, calls, [f"call: fn {g.mark('</tool_call>')}", *rules]


_AUTO: dict[str, Any] = {
    "xml": _xml_grammar,
    "glm": _glm_grammar,
    "hermes": _hermes_grammar,
    "generic": _hermes_grammar,
    "mistral": _array_grammar("[TOOL_CALLS]"),
    "mistral-args": _mistral_args_grammar,
    "tool-call": _array_grammar("<|tool_call|>", "<|/tool_call|>"),
}


def _hoist_defs(schemas: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Schemas to nest in one schema: each one's ``$defs`` / ``definitions`` moved to the root (as ``t{i}_name``,
    its ``#/$defs/...`` references rewritten), where the references of a nested schema resolve."""
    out, defs = [], {}
    for i, sch in enumerate(schemas):
        local = {**(sch.get("definitions") or {}), **(sch.get("$defs") or {})}
        if not local:
            out.append(sch)
            continue
        names = {f"#/{k}/{n}": f"#/$defs/t{i}_{n}" for k in ("$defs", "definitions") for n in local}

        def fix(v: Any, names: dict[str, str] = names) -> Any:
            if isinstance(v, dict):
                return {k: names.get(x, x) if k == "$ref" and isinstance(x, str) else fix(x) for k, x in v.items()}
            return [fix(x) for x in v] if isinstance(v, list) else v

        out.append(fix({k: v for k, v in sch.items() if k not in ("$defs", "definitions")}))
        defs.update({f"t{i}_{n}": fix(d) for n, d in local.items()})
    return out, defs


def _params(tool: Mapping[str, Any]) -> dict[str, Any]:
    p = tool.get("parameters")
    return dict(p) if p else {"type": "object", "properties": {}}


# ------------------------------------------------------------------------------------------- templates
@dataclass(frozen=True)
class TemplateCaps:
    """What a chat template shows, and its tool-call format family."""

    tools: bool = False  # the tool definitions
    tool_calls: bool = False  # assistant tool_calls
    object_arguments: bool = True  # tool_calls[].function.arguments as a dict (else the JSON string)
    tool_role: bool = False  # role "tool" messages
    nine_char_ids: bool = False  # call ids must be 9 alphanumerics (Mistral)
    system_role: bool = True  # a system message (else the generic prompt opens the first user message)
    family: str = "generic"


_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "pagedkv_probe_fn",
        "description": "probe",
        "parameters": {"type": "object", "properties": {"pagedkv_probe_arg": {"type": "string"}}},
    },
}


def _probe_conversation(arguments: Any) -> list[dict[str, Any]]:
    call = {"id": "pagedkv01", "type": "function", "function": {"name": "pagedkv_probe_call", "arguments": arguments}}
    return [
        {"role": "user", "content": "pagedkv probe question"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "pagedkv01", "name": "pagedkv_probe_call", "content": "pagedkv_probe_result"},
    ]


@functools.lru_cache(maxsize=32)
def caps_of(source: str) -> TemplateCaps:
    """Probe what the template ``source`` shows (rendering sample conversations; a failure means "not shown")."""
    from pagedkv_rs.models.chat_template import ChatTemplate, ChatTemplateError

    tmpl = ChatTemplate(source)

    def render(messages: list[dict[str, Any]], tools: Any) -> str:
        try:
            return tmpl.render(messages, add_generation_prompt=False, tools=tools, bos_token="", eos_token="")
        except (ChatTemplateError, ValueError):
            return ""

    shows_tools = "pagedkv_probe_fn" in render([{"role": "user", "content": "q"}], [_PROBE_TOOL])
    as_object = render(_probe_conversation({"pagedkv_probe_arg": "pagedkv_probe_value"}), [_PROBE_TOOL])
    as_string = render(_probe_conversation('{"pagedkv_probe_arg": "pagedkv_probe_value"}'), [_PROBE_TOOL])
    object_arguments = "pagedkv_probe_value" in as_object or "pagedkv_probe_value" not in as_string
    out = as_object if object_arguments else as_string
    shows_calls = "pagedkv_probe_call" in out.replace("pagedkv_probe_result", "")
    tool_role = "pagedkv_probe_result" in out
    if not out:  # the template refuses tool calls: probe the tool role alone
        plain = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
        tool_role = "pagedkv_probe_result" in render([*plain, _probe_conversation({})[2]], None)
    system = [{"role": "system", "content": "pagedkv_probe_system"}, {"role": "user", "content": "q"}]
    family = family_of(source, shows_tools)
    if family == "hermes" and shows_calls and not _HERMES_CALL.search(out):
        family = "any"  # <tool_call> around something else (MiniMax's <invoke>, Apriel's list): no JSON grammar
    return TemplateCaps(
        system_role="pagedkv_probe_system" in render(system, None),
        tools=shows_tools,
        tool_calls=shows_calls,
        object_arguments=object_arguments,
        tool_role=tool_role,
        nine_char_ids="length != 9" in source,
        family=family,
    )


_HERMES_CALL = re.compile(r'<tool_call>\s*\{\s*"name":\s*"pagedkv_probe_call"')


def family_of(source: str, shows_tools: bool) -> str:
    """The tool-call format family a template's model writes (see the module's table)."""
    if not shows_tools:
        return "generic"
    if "[TOOL_CALLS]" in source:
        return "mistral-args" if "[ARGS]" in source else "mistral"
    if "<|tool_call|>" in source:
        return "tool-call"
    if "<tool_call>" in source and "<function=" in source:
        return "xml"
    if "<tool_call>" in source and "<arg_key>" in source:
        return "glm"
    if "<tool_call>" in source:
        return "hermes"
    if "<function=" in source:
        return "any"  # functionary's <function=name>{...}</function>, not Llama's JSON
    if "<|python_tag|>" in source or '"parameters": dictionary' in source:
        return "llama3"
    return "any"


def format_calls(family: str, calls: Sequence[Mapping[str, Any]]) -> str:
    """Past calls (``{"id", "name", "arguments"}``) as the text the family's model writes."""
    if family == "llama3":
        return "; ".join(json.dumps({"name": c["name"], "parameters": c["arguments"]}) for c in calls)
    if family == "mistral":
        items = [{"name": c["name"], "arguments": c["arguments"], "id": c["id"]} for c in calls]
        return "[TOOL_CALLS]" + json.dumps(items)
    if family == "mistral-args":
        return "".join(f"[TOOL_CALLS]{c['name']}[ARGS]{json.dumps(c['arguments'])}" for c in calls)
    if family == "tool-call":
        return "<|tool_call|>" + json.dumps([{"name": c["name"], "arguments": c["arguments"]} for c in calls])
    if family == "xml":
        return "\n".join(
            f"<tool_call>\n<function={c['name']}>\n"
            + "".join(f"<parameter={k}>\n{_xml_value(v)}\n</parameter>\n" for k, v in c["arguments"].items())
            + "</function>\n</tool_call>"
            for c in calls
        )
    if family == "glm":
        return "".join(
            f"<tool_call>{c['name']}\n"
            + "".join(
                f"<arg_key>{k}</arg_key>\n<arg_value>{_xml_value(v)}</arg_value>\n" for k, v in c["arguments"].items()
            )
            + "</tool_call>"
            for c in calls
        )
    return "\n".join(
        "<tool_call>\n" + json.dumps({"name": c["name"], "arguments": c["arguments"]}) + "\n</tool_call>" for c in calls
    )


def _nine(call_id: str) -> str:
    """A call id as Mistral's templates demand it (9 alphanumerics), the same for the same id."""
    if re.fullmatch(r"[A-Za-z0-9]{9}", call_id):
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]


def prepare_messages(
    messages: Sequence[Mapping[str, Any]], toolset: Optional[ToolSet], caps: TemplateCaps
) -> tuple[list[dict[str, Any]], Optional[list[dict[str, Any]]]]:
    """The messages and ``tools`` to render: calls, results and tools as the template shows them, or as text.

    ``messages`` are dicts with ``role``, ``content`` (a string), and ``tool_calls`` (``[{"id", "name",
    "arguments": dict}]``), ``tool_call_id``, ``name`` where given.
    """
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        calls = m.get("tool_calls") or []
        if role == "assistant" and calls:
            if caps.tool_calls:
                out.append({"role": "assistant", "content": content, "tool_calls": _template_calls(calls, caps)})
            else:
                text = format_calls(caps.family, calls)
                out.append({"role": "assistant", "content": f"{content}\n{text}" if content else text})
        elif role == "tool":
            if caps.tool_role:
                msg = {"role": "tool", "content": content}
                if m.get("tool_call_id") is not None:
                    cid = m["tool_call_id"]
                    msg["tool_call_id"] = _nine(cid) if caps.nine_char_ids else cid
                if m.get("name") is not None:
                    msg["name"] = m["name"]
                out.append(msg)
            else:
                block = f"<tool_response>\n{content}\n</tool_response>"
                if out and out[-1].get("pagedkv_tool_results"):
                    out[-1]["content"] += "\n" + block
                else:
                    out.append({"role": "user", "content": block, "pagedkv_tool_results": True})
        else:
            msg = {"role": role, "content": content}
            if m.get("name") is not None:
                msg["name"] = m["name"]
            out.append(msg)
    for msg in out:
        msg.pop("pagedkv_tool_results", None)
    if toolset is None or not toolset.tools:
        return out, None
    if caps.tools:
        return out, toolset.template_tools()
    prompt = GENERIC_PROMPT + "\n".join(json.dumps(t, ensure_ascii=False) for t in toolset.template_tools())
    head = out[0] if out else None
    if head is not None and head["role"] in ("system", "developer"):
        out[0] = {**head, "content": f"{head['content']}\n\n{prompt}" if head["content"] else prompt}
    elif caps.system_role or head is None or head["role"] != "user":
        out.insert(0, {"role": "system", "content": prompt})
    else:  # a template without a system role (Gemma): the prompt opens the first user message
        out[0] = {**head, "content": f"{prompt}\n\n{head['content']}"}
    return out, None


def _template_calls(calls: Sequence[Mapping[str, Any]], caps: TemplateCaps) -> list[dict[str, Any]]:
    out = []
    for c in calls:
        cid = _nine(c["id"]) if caps.nine_char_ids else c["id"]
        args = c["arguments"] if caps.object_arguments else json.dumps(c["arguments"], ensure_ascii=False)
        out.append({"id": cid, "type": "function", "function": {"name": c["name"], "arguments": args}})
    return out


# --------------------------------------------------------------------------------------------- parsing
def _json_values(text: str) -> Optional[list[Any]]:
    """The JSON values ``text`` holds one after another (separated by whitespace, ``,`` or ``;``), or None."""
    dec, i, n = json.JSONDecoder(), 0, len(text)
    out: list[Any] = []
    while True:
        while i < n and text[i] in " \t\r\n,;":
            i += 1
        if i == n:
            return out
        try:
            v, i = dec.raw_decode(text, i)
        except ValueError:
            return None
        out.append(v)


def _call_items(values: Sequence[Any], args_keys: tuple[str, ...] = ("arguments", "parameters")) -> Optional[list]:
    """``(name, arguments, id)`` of each call object among ``values`` (lists are flattened), or None."""
    items: list[Any] = []
    for v in values:
        items.extend(v if isinstance(v, list) else [v])
    out = []
    for it in items:
        if not isinstance(it, dict) or not isinstance(it.get("name"), str):
            return None
        args: Any = next((it[k] for k in args_keys if k in it), {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                return None
        out.append((it["name"], args, it.get("id")))
    return out


def _hermes(text: str) -> Optional[tuple[str, list]]:
    i = text.find("<tool_call>")
    if i < 0:
        return None
    values: list[Any] = []
    for block in text[i:].split("<tool_call>")[1:]:
        body, closed, rest = block.partition("</tool_call>")
        if closed and rest.strip():
            return None
        got = _json_values(body)
        if not got:
            return None
        values.extend(got)
    calls = _call_items(values)
    return None if calls is None else (text[:i], calls)


def _llama3(text: str) -> Optional[tuple[str, list]]:
    body = text.lstrip()
    body = body.removeprefix("<|python_tag|>").lstrip()
    if not body.startswith("{"):
        return None
    values = _json_values(body)
    calls = _call_items(values, ("parameters", "arguments")) if values else None
    return None if calls is None else ("", calls)


def _after_marker(text: str, marker: str, end: str = "") -> Optional[tuple[str, list]]:
    i = text.find(marker)
    if i < 0:
        return None
    values: list[Any] = []
    for part in text[i:].split(marker)[1:]:
        part = part.strip()
        if end:
            part = part.removesuffix(end)
        got = _json_values(part)
        if got is None:
            return None
        values.extend(got)
    calls = _call_items(values)
    return None if calls is None else (text[:i], calls)


_ARGS_CALL = re.compile(r"\s*([A-Za-z0-9_.\-]+)(?:\[CALL_ID\]([A-Za-z0-9]+))?\[ARGS\]", re.S)


def _mistral_args(text: str) -> Optional[tuple[str, list]]:
    i = text.find("[TOOL_CALLS]")
    if i < 0:
        return None
    calls = []
    for part in text[i:].split("[TOOL_CALLS]")[1:]:
        m = _ARGS_CALL.match(part)
        if m is None:
            return None
        got = _json_values(part[m.end() :])
        if not got or len(got) != 1:
            return None
        items = _call_items([{"name": m.group(1), "arguments": got[0], "id": m.group(2)}])
        if items is None:
            return None
        calls.extend(items)
    return text[:i], calls


def _xml_value(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)


_XML_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*$", re.S)
_XML_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)
_GLM_CALL = re.compile(r"\s*([^<\n]+?)\s*((?:<arg_key>.*?</arg_key>\s*<arg_value>.*?</arg_value>\s*)*)$", re.S)
_GLM_PARAM = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def _tagged(text: str, body: Any, pairs: Any) -> Optional[tuple[str, list]]:
    """``<tool_call>...</tool_call>`` blocks whose body ``body`` matches as (name, parameters text), each
    parameter a ``pairs`` match of (key, value text); values stay text (``ToolParser`` types them)."""
    i = text.find("<tool_call>")
    if i < 0:
        return None
    calls = []
    for block in text[i:].split("<tool_call>")[1:]:
        inner, closed, rest = block.partition("</tool_call>")
        if not closed or rest.strip():
            return None
        m = body.match(inner)
        if m is None or pairs.sub("", m.group(2)).strip():
            return None
        args = {k.strip(): _XmlText(v.removeprefix("\n").removesuffix("\n")) for k, v in pairs.findall(m.group(2))}
        calls.append((m.group(1).strip(), args, None))
    return text[:i], calls


class _XmlText(str):
    """A parameter's value as the XML formats write it: text, typed by the tool's schema once the tool is known."""


def _typed(args: dict[str, Any], schema: Mapping[str, Any]) -> dict[str, Any]:
    """XML parameter texts as JSON values: text where the schema says string, else the JSON the text spells."""
    props = schema.get("properties") or {}
    out: dict[str, Any] = {}
    for k, v in args.items():
        if not isinstance(v, _XmlText):
            out[k] = v
            continue
        kind = (props.get(k) or {}).get("type")
        if kind == "string" or (isinstance(kind, list) and "string" in kind):
            out[k] = str(v)
            continue
        if kind == "boolean" and v.strip() in ("True", "False"):  # a template that writes Python's spelling
            out[k] = v.strip() == "True"
            continue
        try:
            out[k] = json.loads(v)
        except ValueError:
            out[k] = str(v)
    return out


PARSERS = {
    "hermes": _hermes,
    "generic": _hermes,
    "llama3": _llama3,
    "mistral": lambda t: _after_marker(t, "[TOOL_CALLS]"),
    "mistral-args": _mistral_args,
    "tool-call": lambda t: _after_marker(t, "<|tool_call|>", "<|/tool_call|>"),
    "xml": lambda t: _tagged(t, _XML_FUNCTION, _XML_PARAM),
    "glm": lambda t: _tagged(t, _GLM_CALL, _GLM_PARAM),
}


class ToolParser:
    """Turns one request's answers into content and ``ToolCall`` lists (see the module's table)."""

    def __init__(self, toolset: ToolSet, family: str) -> None:
        self.toolset, self.family = toolset, family
        self.markers = MARKERS.get(family, MARKERS["any"])
        self.json_start = family in JSON_START
        self.constrained = toolset.constraint() is not None
        self.guarded = self.constrained  # a grammar writes the calls (set when the auto grammar is armed)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """``(content, calls)``: calls empty when ``text`` holds no valid call (then the content is ``text``)."""
        if self.toolset.choice == "none":
            return text, []
        found = self._constrained(text) if self.constrained else self._free(text)
        if found is None:
            return text, []
        content, items = found
        calls = self._check(items)
        if not calls:
            return text, []
        if not self.toolset.parallel:
            calls = calls[:1]
        return content, self._with_text(text, len(content), calls)

    @property
    def call_depth(self) -> Optional[int]:
        """How deep the call objects sit in the JSON after the opening marker (None: not JSON-bodied, or
        ``named``, whose whole answer is the arguments)."""
        if self.toolset.choice == "named":
            return None
        if self.constrained:
            return 1  # REQUIRED: a list of calls
        return {"hermes": 0, "generic": 0, "llama3": 0, "mistral": 1, "tool-call": 1}.get(self.family)

    def spans(self, text: str, start: int) -> list[_Span]:
        """The calls of ``text[start:]`` as far as they are written (``named``: one span, its arguments all)."""
        if self.toolset.choice == "named":
            i = text.find("{", start)
            return [_Span(self.toolset.named, i if i >= 0 else None, _value_end(text, i) if i >= 0 else None)]
        depth = self.call_depth
        return [] if depth is None else _scan_calls(text, start, depth)

    def _with_text(self, text: str, start: int, calls: list[ToolCall]) -> list[ToolCall]:
        """The calls with their arguments' text as written, when the JSON-bodied answer shows it for each."""
        if self.call_depth is None and self.toolset.choice != "named":
            return calls
        spans = self.spans(text, start)
        if len(spans) < len(calls):
            return calls
        out = []
        for c, sp in zip(calls, spans):
            raw = text[sp.args : sp.args_end] if sp.args is not None and sp.args_end is not None else None
            try:
                same = raw is not None and sp.name == c.name and json.loads(raw) == c.arguments
            except ValueError:
                same = False
            out.append(replace(c, text=raw) if same else c)
        return out

    def _constrained(self, text: str) -> Optional[tuple[str, list]]:
        try:
            v = json.loads(text)
        except ValueError:
            return None
        if self.toolset.choice == "required":
            items = _call_items([v]) if isinstance(v, list) else None
            return None if items is None else ("", items)
        return ("", [(self.toolset.named, v, None)]) if isinstance(v, dict) else None

    def _free(self, text: str) -> Optional[tuple[str, list]]:
        if self.family in PARSERS:
            return PARSERS[self.family](text)
        for parse in PARSERS.values():
            found = parse(text)
            if found is not None:
                return found
        return None

    def _check(self, items: Sequence[tuple[str, Any, Optional[str]]]) -> list[ToolCall]:
        """The items as calls; none when one names an unknown tool or has arguments its strict schema rejects."""
        tools = self.toolset.names
        calls = []
        for name, args, _ in items:
            tool = tools.get(name)
            if tool is None or not isinstance(args, dict):
                return []
            args = _typed(args, _params(tool))
            if tool.get("strict") and not _valid(args, _params(tool)):
                return []
            calls.append(ToolCall(name, args))
        return calls


def _valid(args: dict[str, Any], schema: Mapping[str, Any]) -> bool:
    import jsonschema  # type: ignore[import-untyped]

    try:
        jsonschema.validate(args, schema)
    except jsonschema.ValidationError:
        return False
    except jsonschema.SchemaError:
        return False
    return True


# ------------------------------------------------------------------------------------------- scanning
@dataclass
class _Span:
    """One call as far as it is written: its name (once its string is closed), and where its arguments' value
    starts and ends (once closed)."""

    name: Optional[str] = None
    args: Optional[int] = None
    args_end: Optional[int] = None


def _string_end(text: str, i: int) -> Optional[int]:
    """The index after the JSON string opening at ``text[i]`` (a quote), or None while it is still open."""
    j, n = i + 1, len(text)
    while j < n:
        c = text[j]
        if c == "\\":
            j += 2
        elif c == '"':
            return j + 1
        else:
            j += 1
    return None


def _value_end(text: str, i: int) -> Optional[int]:
    """The index after the JSON object or list opening at ``text[i]``, or None while it is still open."""
    depth, j, n = 0, i, len(text)
    while j < n:
        c = text[j]
        if c == '"':
            e = _string_end(text, j)
            if e is None:
                return None
            j = e
            continue
        if c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return None


def _scan_calls(text: str, start: int, call_depth: int) -> list[_Span]:
    """The call objects at ``call_depth`` (brackets counted from ``start``) in ``text[start:]``, written so far:
    each one's ``name`` and the start and end of its ``arguments`` / ``parameters`` value. Text between calls
    (tags, separators) holds no quote or bracket in the families scanned."""
    spans: list[_Span] = []
    depth, i, n = 0, start, len(text)
    key: Optional[str] = None
    expect_key = False
    while i < n:
        c = text[i]
        top = spans and depth == call_depth + 1  # directly inside the current call object
        if c == '"':
            e = _string_end(text, i)
            if e is None:
                break
            if top and expect_key:
                key = json.loads(text[i:e])
            elif top and key == "name":
                name = json.loads(text[i:e])
                spans[-1].name = name if isinstance(name, str) else None
            i = e
            continue
        if top and not expect_key and key in ("arguments", "parameters") and c in "{[":
            spans[-1].args = i
            end = _value_end(text, i)
            if end is None:
                break
            spans[-1].args_end, i, key = end, end, None
            continue
        if c in "{[":
            if c == "{" and depth == call_depth:
                spans.append(_Span())
                expect_key, key = True, None
            depth += 1
        elif c in "}]":
            depth -= 1
        elif top and c == ":":
            expect_key = False
        elif top and c == ",":
            expect_key, key = True, None
        i += 1
    return spans


# ------------------------------------------------------------------------------------- the offline API
def _functions(tools: Sequence[Mapping[str, Any]]) -> ToolSet:
    """OpenAI tools (``{"type": "function", "function": {...}}``) or bare function dicts as a ``ToolSet``."""
    defs = []
    for t in tools:
        f = t.get("function", t) if t.get("type", "function") == "function" else None
        if not isinstance(f, Mapping) or not isinstance(f.get("name"), str):
            raise ValueError(
                f"a tool is an OpenAI function tool {{'type': 'function', 'function': {{'name', ...}}}}, got {t!r}"
            )
        defs.append({k: v for k, v in f.items() if v is not None})
    return ToolSet(tuple(defs))


def chat_messages(
    messages: Sequence[Mapping[str, Any]], tools: Optional[Sequence[Mapping[str, Any]]], template: Optional[str]
) -> tuple[list[dict[str, Any]], Optional[list[dict[str, Any]]]]:
    """OpenAI chat messages (assistant ``tool_calls`` with JSON-string or dict arguments, ``role: "tool"``
    results) and tools as ``template`` shows them: ``(messages, tools)`` to render (``prepare_messages``)."""
    toolset = _functions(tools) if tools else None
    msgs: list[dict[str, Any]] = []
    for m in messages:
        d = {k: v for k, v in m.items() if k != "tool_calls"}
        d["content"] = d.get("content") or ""
        calls = []
        for c in m.get("tool_calls") or []:
            f = c.get("function", c)
            args = f.get("arguments") or {}
            calls.append({"id": c.get("id") or "call_0", "name": f["name"], "arguments": _arguments(args)})
        if calls:
            d["tool_calls"] = calls
        msgs.append(d)
    uses = toolset is not None or any(d["role"] == "tool" or d.get("tool_calls") for d in msgs)
    if not uses or template is None:
        return msgs, toolset.template_tools() if toolset is not None else None
    return prepare_messages(msgs, toolset, caps_of(template))


def _arguments(args: Any) -> dict[str, Any]:
    if isinstance(args, str):
        args = json.loads(args) if args.strip() else {}
    if not isinstance(args, dict):
        raise ValueError(f"a tool call's arguments must be a JSON object, got {args!r}")
    return args


def parse_tool_calls(
    text: str, tools: Sequence[Mapping[str, Any]], chat_template: Optional[str] = None, *, parallel: bool = True
) -> tuple[str, list[ToolCall]]:
    """The tool calls in a model's answer: ``(content, calls)`` as the server parses them (calls empty when
    ``text`` holds no valid call; then the content is ``text``). ``chat_template``: the template the prompt was
    rendered with (it names the format family; None: the generic ``<tool_call>`` format). Each call has
    ``name``, ``arguments`` (a dict), ``id`` and ``openai()`` (OpenAI's ``tool_calls`` item)."""
    family = caps_of(chat_template).family if chat_template is not None else "generic"
    toolset = _functions(tools)
    return ToolParser(replace(toolset, parallel=parallel), family).parse(text)
