"""Rendering: a job's outputs as OpenAI completion / chat objects, whole or as SSE chunks."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any, Optional

from pagedkv_rs.engine.request import RequestOutput
from pagedkv_rs.serve.tools import ToolCall, ToolParser, ToolStream

__all__ = ["View", "completion_logprobs", "chat_logprobs", "prompt_logprobs"]

# A text no JSON string value can contain once encoded: json.dumps escapes NUL as \u0000 and every quote
# inside a string as \", so only this very value renders as _MARK_JSON (the quotes around it included).
_MARK = "\x00pagedkv-text\x00"
_MARK_JSON = json.dumps(_MARK).encode()


class View:
    """Renders a job's outputs as OpenAI completion / chat objects (whole, or SSE chunks)."""

    def __init__(self, state: Any, rid: str, chat: bool, req: Any, tools: Optional[ToolParser] = None) -> None:
        self.state, self.rid, self.chat, self.req = state, rid, chat, req
        self.tools = tools
        self._tool_streams: dict[int, ToolStream] = {}
        self._vanishing = _vanishing_markers(state.tokenizer, tools) if tools is not None else {}
        self.created = int(time.time())
        self.sent_text: dict[int, int] = {}  # choice index -> characters sent
        self.sent_tokens: dict[int, int] = {}
        self._templates: dict[int, tuple[bytes, bytes]] = {}
        self._head = json.dumps(
            {
                "id": rid,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": self.created,
                "model": state.model_name,
            }
        )[:-1]

    def usage(self, finals: Sequence[RequestOutput]) -> dict[str, Any]:
        p = sum(len(f.prompt_token_ids) for f in finals)
        c = sum(len(o.token_ids) for f in finals for o in f.outputs)
        cached = sum(f.num_cached_tokens for f in finals)
        return {
            "prompt_tokens": p,
            "completion_tokens": c,
            "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def whole(self, finals: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for i, f in enumerate(finals):
            plp = None
            if f.prompt_logprobs is not None and not self.chat:
                plp = prompt_logprobs(f.prompt_logprobs, self.state.tokenizer)
            for o in f.outputs:
                k = i * self.req.n + o.index
                lp = self._logprobs(o, 0)
                base: dict[str, Any] = {"index": k}
                fin = o.finish_reason
                if self.chat and self.tools is not None:
                    base["message"], fin = self._tool_message(o)
                elif self.chat:
                    base["message"] = {"role": "assistant", "content": o.text or ""}
                else:
                    base["text"] = o.text or ""
                base.update(logprobs=lp, finish_reason=fin, stop_reason=getattr(o, "stop_reason", None))
                if plp is not None and not self.chat:  # vLLM: on each completion choice of the prompt
                    base["prompt_logprobs"] = plp
                choices.append(base)
        choices.sort(key=lambda c: c["index"])
        out = {
            "id": self.rid,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.state.model_name,
            "choices": choices,
            "usage": self.usage(finals),
        }
        if self.chat and finals and finals[0].prompt_logprobs is not None:  # vLLM: on the chat response
            out["prompt_logprobs"] = prompt_logprobs(finals[0].prompt_logprobs, self.state.tokenizer)
        return out

    def _chunk(self, choice: dict[str, Any]) -> bytes:
        return b"data: " + (self._head + ',"choices":[' + json.dumps(choice) + "]}").encode() + b"\n\n"

    def _template(self, k: int) -> tuple[bytes, bytes]:
        """The bytes of choice ``k``'s text-only chunk before and after its JSON-encoded text (built once)."""
        t = self._templates.get(k)
        if t is None:
            c: dict[str, Any] = {"index": k}
            if self.chat:
                c["delta"] = {"content": _MARK}
            else:
                c["text"] = _MARK
            c.update(logprobs=None, finish_reason=None)
            pre, post = self._chunk(c).split(_MARK_JSON)  # the mark's JSON cannot occur elsewhere: see _MARK
            t = self._templates[k] = (pre, post)
        return t

    def text_chunk(self, k: int, piece: str) -> bytes:
        """Choice ``k``'s chunk carrying ``piece`` (no logprobs, not finished): ``_chunk`` of that choice, faster."""
        pre, post = self._template(k)
        return pre + json.dumps(piece).encode() + post

    def first(self, num_choices: int) -> bytes:
        """Chat streams open each choice with the assistant role."""
        if not self.chat:
            return b""
        return b"".join(
            self._chunk(
                {"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            )
            for k in range(num_choices)
        )

    def delta(self, i: int, out: RequestOutput) -> bytes:
        """SSE chunks for what ``out`` (stream ``i``'s newest output) adds to each of its choices."""
        parts = []
        for o in out.outputs:
            k = i * self.req.n + o.index
            if self.chat and self.tools is not None:
                parts.append(self._tool_delta(k, o))
                continue
            text = o.text or ""
            fin = o.finish_reason
            if fin is None and text.endswith("\ufffd"):
                continue  # a multi-byte character is still arriving
            sent = self.sent_text.get(k, 0)
            piece = text[sent:]
            if not piece and fin is None:
                continue
            self.sent_text[k] = len(text)
            # completions: a choice's first chunk carries the prompt's logprobs (known once it is prefilled)
            plp = out.prompt_logprobs if k not in self.sent_tokens and not self.chat else None
            lp = self._logprobs(o, self.sent_tokens.get(k, 0))
            self.sent_tokens[k] = len(o.token_ids)
            if lp is None and fin is None and plp is None:  # the common chunk: only the text changes
                parts.append(self.text_chunk(k, piece))
                continue
            c: dict[str, Any] = {"index": k}
            if self.chat:
                c["delta"] = {"content": piece} if piece else {}
            else:
                c["text"] = piece
            c["logprobs"] = lp
            c["finish_reason"] = fin
            if fin is not None:
                c["stop_reason"] = getattr(o, "stop_reason", None)
            if plp is not None:
                c["prompt_logprobs"] = prompt_logprobs(plp, self.state.tokenizer)
            parts.append(self._chunk(c))
        return b"".join(parts)

    # ---------------------------------------------------------------------------------------------- tools
    def _tool_text(self, o: Any) -> str:
        """The answer's text with the call markers that are control tokens (decoded as nothing) put back."""
        text = o.text or ""
        ids = list(o.token_ids)
        hits = [k for k, t in enumerate(ids) if t in self._vanishing]
        if not hits:
            return text
        tok, out, prev = self.state.tokenizer, [], 0
        for k in hits:
            pos = len(tok.decode(ids[:k], skip_special_tokens=True, continuation=True))
            if pos > len(text):  # past a stop string: not part of the answer
                break
            out += [text[prev:pos], self._vanishing[ids[k]]]
            prev = pos
        out.append(text[prev:])
        return "".join(out)

    def _finish(self, calls: list[ToolCall], fin: Optional[str]) -> Optional[str]:
        if not calls:
            return fin
        return "function_call" if self.tools is not None and self.tools.toolset.legacy else "tool_calls"

    def _call_fields(self, calls: list[ToolCall], stream: bool) -> dict[str, Any]:
        assert self.tools is not None
        if not calls:
            return {}
        if self.tools.toolset.legacy:  # the legacy functions API answers with its one call
            return {"function_call": calls[0].openai()["function"]}
        return {"tool_calls": [c.openai(index=j if stream else None) for j, c in enumerate(calls)]}

    def _tool_message(self, o: Any) -> tuple[dict[str, Any], Optional[str]]:
        assert self.tools is not None
        content, calls = self.tools.parse(self._tool_text(o))
        msg: dict[str, Any] = {"role": "assistant", "content": content if content.strip() or not calls else None}
        msg.update(self._call_fields(calls, stream=False))
        return msg, self._finish(calls, o.finish_reason)

    def _tool_delta(self, k: int, o: Any) -> bytes:
        """Choice ``k``'s chunks: content up to a call's opening marker, then the calls' deltas (``ToolStream``)."""
        assert self.tools is not None
        fin = o.finish_reason
        if fin is None and (o.text or "").endswith("\ufffd"):
            return b""  # a multi-byte character is still arriving
        st = self._tool_streams.get(k)
        if st is None:
            st = self._tool_streams[k] = ToolStream(self.tools)
        piece, items = st.push(self._tool_text(o), fin is not None)
        calls = st.calls if fin is not None else []
        if not piece and not items and fin is None:
            return b""  # held: its logprobs go with the next chunk sent
        lp = self._logprobs(o, self.sent_tokens.get(k, 0))
        self.sent_tokens[k] = len(o.token_ids)
        chunks = []
        if piece:
            chunks.append(self._chunk({"index": k, "delta": {"content": piece}, "logprobs": lp, "finish_reason": None}))
            lp = None
        if items:
            delta = self._call_fields(calls, stream=True) if self.tools.toolset.legacy else {"tool_calls": items}
            chunks.append(self._chunk({"index": k, "delta": delta, "logprobs": lp, "finish_reason": None}))
            lp = None
        if fin is not None:
            c = {"index": k, "delta": {}, "logprobs": lp, "finish_reason": self._finish(calls, fin)}
            c["stop_reason"] = getattr(o, "stop_reason", None)
            chunks.append(self._chunk(c))
        return b"".join(chunks)

    def final_usage(self, finals: list[RequestOutput]) -> bytes:
        body = self._head + ',"choices":[],"usage":' + json.dumps(self.usage(finals)) + "}"
        return b"data: " + body.encode() + b"\n\n"

    def _logprobs(self, o: Any, start: int) -> Optional[dict[str, Any]]:
        lps = getattr(o, "logprobs", None)
        if not lps:
            return None
        ids, lps = o.token_ids[start:], lps[start:]
        tok = self.state.tokenizer
        return chat_logprobs(ids, lps, tok) if self.chat else completion_logprobs(ids, lps, tok)


def _vanishing_markers(tok: Any, tools: ToolParser) -> dict[int, str]:
    """The parser's call markers that are single control tokens, which the answer's text drops: id -> marker."""
    out = {}
    for mk in tools.markers:
        tid = tok.token_to_id(mk) if hasattr(tok, "token_to_id") else None
        if tid is not None and tok.decode([tid], skip_special_tokens=True) == "":
            out[tid] = mk
    return out


def _token_text(tok: Any, token_id: int, lp: Any) -> str:
    t = getattr(lp, "decoded_token", None)
    return t if t is not None else tok.decode([token_id])


def completion_logprobs(ids: Sequence[int], lps: Sequence[dict[int, Any]], tok: Any) -> dict[str, Any]:
    """OpenAI's legacy completions ``logprobs`` object from per-token ``{token_id: Logprob}`` dicts."""
    tokens, token_lps, tops = [], [], []
    for t, d in zip(ids, lps):
        tokens.append(_token_text(tok, t, d.get(t)))
        token_lps.append(d[t].logprob if t in d else None)
        tops.append({_token_text(tok, u, x): x.logprob for u, x in d.items()})
    offsets, pos = [], 0
    for s in tokens:
        offsets.append(pos)
        pos += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs(plp: Sequence[Optional[dict[int, Any]]], tok: Any) -> list[Optional[dict[str, Any]]]:
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then ``{token_id: {logprob, rank, ...}}``."""
    return [
        None
        if d is None
        else {
            str(t): {"logprob": x.logprob, "rank": x.rank, "decoded_token": _token_text(tok, t, x)}
            for t, x in d.items()
        }
        for d in plp
    ]


def chat_logprobs(ids: Sequence[int], lps: Sequence[dict[int, Any]], tok: Any) -> dict[str, Any]:
    """Chat's ``logprobs.content`` list from per-token ``{token_id: Logprob}`` dicts."""
    content = []
    for t, d in zip(ids, lps):
        s = _token_text(tok, t, d.get(t))
        tops = [
            {"token": _token_text(tok, u, x), "logprob": x.logprob, "bytes": list(_token_text(tok, u, x).encode())}
            for u, x in d.items()
            if u != t or len(d) > 1
        ]
        content.append(
            {"token": s, "logprob": d[t].logprob if t in d else None, "bytes": list(s.encode()), "top_logprobs": tops}
        )
    return {"content": content}
