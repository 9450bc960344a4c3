"""A GGUF's Jinja chat template, rendered as ``transformers`` renders it.

As ``transformers``' ``_compile_jinja_template``: a sandboxed environment with ``trim_blocks``/``lstrip_blocks``
and the loop-controls extension, the globals ``raise_exception`` and ``strftime_now``, and a ``tojson`` filter
that keeps non-ASCII text; ``render`` passes ``messages``, ``tools``, ``add_generation_prompt`` and the special
tokens. A template that fails (bad syntax, ``raise_exception``, an undefined call) raises ``ChatTemplateError``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Optional

from pagedkv_rs.errors import PagedKVError

__all__ = ["ChatTemplate", "ChatTemplateError", "Message"]

Message = Mapping[str, Any]


class ChatTemplateError(PagedKVError, ValueError):
    """A chat template could not be compiled or rendered for these messages."""


def _tojson(x: Any, ensure_ascii: bool = False, indent: Optional[int] = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """One compiled template; ``render(messages, ...)`` gives the prompt text."""

    def __init__(self, source: str):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except TemplateError as e:
            raise ChatTemplateError(f"the chat template does not compile: {e}") from e

    def render(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        tools: Optional[Sequence[Mapping[str, Any]]] = None,
        **kwargs: Any,
    ) -> str:
        from jinja2 import TemplateError

        for m in messages:
            if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
                raise ValueError(f"a chat message needs 'role' and 'content' keys, got {m!r}")
        try:
            return str(
                self._template.render(
                    messages=[dict(m) for m in messages],
                    tools=None if tools is None else [dict(t) for t in tools],
                    documents=None,
                    add_generation_prompt=add_generation_prompt,
                    **kwargs,
                )
            )
        except TemplateError as e:
            raise ChatTemplateError(f"the chat template failed for these messages: {e}") from e
        except (TypeError, KeyError, AttributeError, IndexError) as e:
            raise ChatTemplateError(f"the chat template failed for these messages: {type(e).__name__}: {e}") from e
