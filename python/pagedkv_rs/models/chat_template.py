"""A GGUF's Jinja chat template, rendered as ``transformers`` renders it.

As ``transformers``' ``_compile_jinja_template``: a sandboxed environment with ``trim_blocks``/``lstrip_blocks``
and the loop-controls extension, the globals ``raise_exception`` and ``strftime_now``, and a ``tojson`` filter
that keeps non-ASCII text; ``render`` passes ``messages``, ``tools``, ``add_generation_prompt`` and the special
tokens, and cuts the text after the final message for ``continue_final_message`` (an assistant prefill) as
``transformers`` does. A template that fails (bad syntax, ``raise_exception``, an undefined call) raises
``ChatTemplateError``.
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
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """The prompt text; ``continue_final_message``: open-ended after the final message's text (not with
        ``add_generation_prompt``)."""
        from jinja2 import TemplateError

        for m in messages:
            if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
                raise ValueError(f"a chat message needs 'role' and 'content' keys, got {m!r}")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        try:
            text = str(
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
        return _cut_after_final(text, messages[-1]) if continue_final_message and messages else text


def _cut_after_final(text: str, final: Message) -> str:
    """``text`` up to the end of the final message's text, as ``transformers``' ``continue_final_message``."""
    content = final["content"]
    if isinstance(content, (list, tuple)):
        parts = [p["text"] for p in content if isinstance(p, Mapping) and "text" in p]
        if not parts:
            raise ChatTemplateError("continue_final_message: the final message has no text to continue")
        content = parts[-1]
    content = str(content or "")
    core = content.strip()
    if not core or core not in text:
        raise ChatTemplateError(
            "continue_final_message: the final message's text does not appear in the rendered chat (the "
            "template changes or drops it)"
        )
    at = text.rindex(core)
    if text[at : at + len(content.lstrip())] == content.lstrip():  # the template kept its trailing spaces
        return text[: at + len(content.lstrip())]
    return text[: at + len(core)]
