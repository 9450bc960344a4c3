"""The request fields that constrain an answer, mapped to the one engine constraint (``StructuredOutputsParams``).

Accepted on ``/v1/chat/completions`` and ``/v1/completions``, at most one per request (two are a 400
naming both):

- OpenAI ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}`` (any JSON
  object; llama.cpp's ``"schema"`` beside it is honoured), ``{"type": "json_schema", "json_schema":
  {"name", "schema", "strict", "description"}}``.
- vLLM ``structured_outputs``: ``{"json" | "regex" | "choice" | "grammar" | "json_object": ...}``; and the
  older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``.
- llama.cpp ``json_schema`` (a schema) and ``grammar`` (GBNF, or Lark in llguidance's syntax).

Anything else inside these objects (an unknown ``response_format`` type, vLLM's ``structural_tag`` or
whitespace options) is a 400, never ignored. Whether llguidance can compile the constraint is checked at
the engine's door (``check_request``), also a 400.
"""

from __future__ import annotations

from typing import Any, Optional

from pagedkv_rs.engine.structured import StructuredOutputsParams
from pagedkv_rs.serve.protocol import APIError

__all__ = ["constraint_of", "CONSTRAINT_FIELDS"]

CONSTRAINT_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "json_schema",
    "grammar",
)
_SO_KEYS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's other structured_outputs keys: accepted only at the value that changes nothing
_SO_OFF = {"disable_fallback": False, "disable_any_whitespace": False, "disable_additional_properties": False}


def _bad(param: str, message: str) -> APIError:
    return APIError(f"{param}: {message}", param=param)


def _response_format(fmt: Any) -> Optional[dict[str, Any]]:
    """``StructuredOutputsParams`` keywords of OpenAI's ``response_format`` (None for text)."""
    if not isinstance(fmt, dict):
        raise _bad("response_format", f"must be an object, got {type(fmt).__name__}")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        extra = set(fmt) - {"type", "schema"}
        if extra:
            raise _bad("response_format", f"unknown keys {sorted(extra)} for type json_object")
        return {"json": fmt["schema"]} if fmt.get("schema") is not None else {"json": True}
    if kind == "json_schema":
        js = fmt.get("json_schema")
        if not isinstance(js, dict):
            raise _bad("response_format", 'type json_schema needs a "json_schema" object {name, schema, strict}')
        extra = set(js) - {"name", "schema", "strict", "description"}
        if extra:
            raise _bad("response_format", f"unknown json_schema keys {sorted(extra)}")
        schema = js.get("schema")
        return {"json": True if schema is None else schema}
    raise _bad("response_format", f'type must be "text", "json_object" or "json_schema", got {kind!r}')


def _structured_outputs(so: Any) -> dict[str, Any]:
    if not isinstance(so, dict):
        raise _bad("structured_outputs", f"must be an object, got {type(so).__name__}")
    out = {}
    for k, v in so.items():
        if v is None:
            continue
        if k in _SO_KEYS:
            out[k] = v
        elif k in _SO_OFF and v == _SO_OFF[k]:
            continue
        else:
            raise APIError(
                f"structured_outputs.{k} is not supported by this server",
                param="structured_outputs",
                code="unsupported_parameter",
            )
    return out


def constraint_of(req: Any) -> Optional[StructuredOutputsParams]:
    """The request's one constraint, or None; a 400 naming the fields when two are set or one is malformed."""
    given: list[tuple[str, dict[str, Any]]] = []
    for name in CONSTRAINT_FIELDS:
        value = getattr(req, name, None)
        if value is None:
            continue
        if name == "response_format":
            kw = _response_format(value)
        elif name == "structured_outputs":
            kw = _structured_outputs(value)
        elif name in ("guided_json", "json_schema"):
            kw = {"json": value}
        else:
            kw = {name.removeprefix("guided_"): value}
        if kw:
            given.append((name, kw))
    if not given:
        return None
    if len(given) > 1:
        names = " and ".join(n for n, _ in given)
        raise APIError(f"at most one output constraint per request; got {names}", param=given[1][0])
    name, kw = given[0]
    try:
        return StructuredOutputsParams(**kw)
    except (TypeError, ValueError) as e:
        raise _bad(name, str(e)) from None
