"""The OpenAI-compatible FastAPI app over one ``LLMEngine``: ``build_app(llm_or_engine, ...)``.

Each HTTP generation request is a ``_Job``: one engine request per prompt, submitted with
``engine.submit()``; each engine stream hands its outputs to the job on the event loop
(``RequestStream.listen``: one loop wake-up per engine step for all streams), and the job's writer
turns the newest cumulative output of each choice into one SSE write (or, not streaming, waits for
the last). A watchdog ticks over the live jobs: past ``request_timeout`` the job
is aborted (``timeout``); a writer stuck in ``send`` for ``stream_idle_timeout`` (a reader that
stopped reading) is aborted (``lease_expired``); an SSE stream silent for ``keepalive_interval``
gets a comment line, so a dead peer is noticed. A client that disconnects (the ASGI
``http.disconnect`` message, watched while streaming and while waiting) is aborted at once, which
frees its KV blocks before the engine's next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, Callable, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagedkv_rs
from pagedkv_rs.engine.request import InvalidRequestError, RequestOutput
from pagedkv_rs.serve.metrics import CONTENT_TYPE, ServerMetrics
from pagedkv_rs.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
    to_sampling_params,
)

__all__ = ["build_app", "OPEN_PATHS"]

log = logging.getLogger("pagedkv_rs.serve")

OPEN_PATHS = frozenset({"/health", "/metrics"})  # reachable without the API key
LONG_INPUT = 16384  # characters (or token ids) past which a prompt is tokenized off the event loop
MAX_PENDING_OUTPUTS = 4096  # outputs one job may hold unsent before its lease expires
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
_DONE = b"data: [DONE]\n\n"
_PING = b": keep-alive\n\n"
# A text no JSON string value can contain once encoded: json.dumps escapes NUL as \u0000 and every quote
# inside a string as \", so only this very value renders as _MARK_JSON (the quotes around it included).
_MARK = "\x00pagedkv-text\x00"
_MARK_JSON = json.dumps(_MARK).encode()


class _State:
    """What the routes share: the engine, its tokenizer, limits, metrics and the live jobs."""

    def __init__(self, engine: Any, tokenizer: Any, model_name: str, model_path: Optional[str], **limits: Any):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.model_path = model_path
        self.api_key: Optional[bytes] = limits["api_key"]
        self.max_queued: int = limits["max_queued_requests"]
        self.request_timeout: Optional[float] = limits["request_timeout"]
        self.lease: float = limits["stream_idle_timeout"]
        self.keepalive: float = limits["keepalive_interval"]
        self.max_body: int = limits["max_body_bytes"]
        self.shutdown_engine: bool = limits["shutdown_engine"]
        self.max_model_len = int(engine.max_model_len)
        self.vocab_size = int(engine.model.vocab_size)
        self.metrics = ServerMetrics(engine, model_name)
        self.jobs: set[_Job] = set()
        self.draining = False
        self.created = int(time.time())

    def engine_alive(self) -> bool:
        return bool(self.engine.is_running)


class _Job:
    """One HTTP generation request: its engine streams, their newest outputs, and why it ended."""

    def __init__(self, state: _State, streams: list[Any], n: int, streaming: bool) -> None:
        self.state = state
        self.streams = streams
        self.n = n
        self.streaming = streaming
        self.final: list[Optional[RequestOutput]] = [None] * len(streams)
        self.pending: dict[int, RequestOutput] = {}  # stream index -> newest unsent output
        self.num_pending = 0
        self.event = asyncio.Event()
        self.cause: Optional[str] = None  # why the server aborted it
        self.error: Optional[BaseException] = None
        self.deadline = None if state.request_timeout is None else time.monotonic() + state.request_timeout
        self.last_write = time.monotonic()
        self.send_since: Optional[float] = None  # a send() is in progress since
        self.ping = False
        self.writer: Optional[asyncio.Task[Any]] = None
        self.prefilled = [False] * len(streams)
        self.left = len(streams)
        self.closed = False
        for i, st in enumerate(streams):
            st.listen(functools.partial(self._on_output, i))
        state.jobs.add(self)

    @property
    def done(self) -> bool:
        return self.left == 0

    def _on_output(self, i: int, item: Union[RequestOutput, BaseException]) -> None:
        """On the event loop, for each item of engine stream ``i`` (``RequestStream.listen``)."""
        if self.closed:
            return
        if isinstance(item, BaseException):
            self.error = item
            self.left -= 1
            self.abort("error")
            self.event.set()
            return
        m = self.state.metrics
        if not self.prefilled[i] and item.finish_reason != "abort":  # the prompt was prefilled
            m.prompt_tokens.inc(len(item.prompt_token_ids))
            self.prefilled[i] = True
        if item.new_token_ids:
            m.generation_tokens.inc(len(item.new_token_ids))
        if self.streaming:
            self.pending[i] = item
            self.num_pending += 1
            if self.num_pending > MAX_PENDING_OUTPUTS:
                self.abort("lease_expired")
        if item.finished:
            self.final[i] = item
            self.left -= 1
            if item.finish_reason != "abort":  # aborts are counted by cause
                m.finished(item)
        self.event.set()

    def abort(self, cause: str) -> None:
        """Abort every unfinished engine request of the job (frees their blocks now); counts ``cause`` once."""
        if self.cause is None and any(f is None for f in self.final):
            self.cause = cause
            self.state.metrics.aborted(cause)
        for s in self.streams:
            s.cancel()
        if cause == "lease_expired" and self.writer is not None:
            self.writer.cancel()

    async def wait(self) -> None:
        """Until every engine stream has ended."""
        while not self.done:
            self.event.clear()
            await self.event.wait()

    def close(self) -> None:
        self.state.jobs.discard(self)
        if not self.done:
            self.abort("shutdown" if self.cause is None else self.cause)
        self.closed = True

    def failure(self) -> Optional[APIError]:
        """The error the job ended with, if the server (not the model) ended it."""
        if self.error is not None:
            return APIError(f"the engine failed this request: {self.error}", status=500, type="server_error")
        if self.cause == "timeout":
            return APIError(
                f"request exceeded the server's request timeout of {self.state.request_timeout} s",
                status=504,
                type="timeout_error",
                code="request_timeout",
            )
        if self.cause is not None or any(f is not None and f.finish_reason == "abort" for f in self.final):
            return APIError(
                "the request was aborted: the server is shutting down",
                status=503,
                type="service_unavailable_error",
                headers={"Retry-After": "1"},
            )
        return None


def build_app(
    llm_or_engine: Any,
    *,
    api_key: Optional[str] = None,
    max_queued_requests: int = 256,
    request_timeout: Optional[float] = None,
    served_model_name: Optional[str] = None,
    tokenizer: Any = None,
    stream_idle_timeout: float = 30.0,
    keepalive_interval: float = 5.0,
    max_body_bytes: int = 4 << 20,
    shutdown_engine: bool = True,
) -> FastAPI:
    """A FastAPI app serving ``llm_or_engine`` (an ``LLM`` or an ``LLMEngine`` with a tokenizer).

    ``max_queued_requests`` bounds the engine's waiting queue (past it: 503 + Retry-After);
    ``request_timeout`` caps a request's life (seconds); ``stream_idle_timeout`` is the lease of a
    stream whose reader stopped reading; ``shutdown_engine``: stop the engine's loop with the app.
    """
    engine = getattr(llm_or_engine, "engine", llm_or_engine)
    tok = tokenizer or getattr(llm_or_engine, "tokenizer", None) or engine.tokenizer
    if tok is None:
        raise ValueError("the server needs a tokenizer: pass an LLM, or an engine and tokenizer=")
    if max_queued_requests < 0:
        raise ValueError(f"max_queued_requests must be >= 0, got {max_queued_requests}")
    for name, v in (
        ("request_timeout", request_timeout),
        ("stream_idle_timeout", stream_idle_timeout),
        ("keepalive_interval", keepalive_interval),
    ):
        if v is not None and not v > 0:
            raise ValueError(f"{name} must be > 0, got {v}")
    path = getattr(llm_or_engine, "model_path", None)
    name = served_model_name or (os.path.basename(path).removesuffix(".gguf") if path else "pagedkv")
    state = _State(
        engine,
        tok,
        name,
        path,
        api_key=None if api_key is None else api_key.encode(),
        max_queued_requests=max_queued_requests,
        request_timeout=request_timeout,
        stream_idle_timeout=stream_idle_timeout,
        keepalive_interval=keepalive_interval,
        max_body_bytes=max_body_bytes,
        shutdown_engine=shutdown_engine,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        dog = asyncio.ensure_future(_watchdog(state))
        try:
            yield
        finally:
            dog.cancel()
            for job in list(state.jobs):
                job.close()
            if shutdown_engine:
                await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="pagedkv_rs", version=pagedkv_rs.__version__, lifespan=lifespan)
    app.state.pagedkv = state
    _install_errors(app)
    app.add_middleware(_Guard, state=state)

    @app.get("/health")
    async def health() -> Response:
        if state.draining or not state.engine_alive():
            why = "draining" if state.draining else "the engine loop is not running"
            return _error(APIError(why, status=503, type="service_unavailable_error"))
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": pagedkv_rs.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": name,
            "object": "model",
            "created": state.created,
            "owned_by": "pagedkv_rs",
            "root": path or name,
            "max_model_len": state.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        req = await _parse(request, TokenizeRequest, state)
        _check_model(state, req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("pass exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            ids = _chat_ids(state, req.messages, req.add_generation_prompt)
        else:
            ids = _encode(state, req.prompt or "", req.add_special_tokens)
        return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = await _parse(request, DetokenizeRequest, state)
        _check_model(state, req.model)
        _check_ids(state, req.tokens, "tokens")
        return {"prompt": state.tokenizer.decode(req.tokens)}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await _parse(request, CompletionRequest, state)
        _check_model(state, req.model)
        items = req.prompts()

        def encode() -> list[list[int]]:
            return [_encode(state, p) if isinstance(p, str) else list(p) for p in items]

        long = sum(len(p) for p in items) > LONG_INPUT
        prompts = await asyncio.to_thread(encode) if long else encode()  # a long text must not stall the loop
        return await _generate(state, request, req, prompts, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        req = await _parse(request, ChatCompletionRequest, state)
        _check_model(state, req.model)
        long = sum(len(m.text()) for m in req.messages) > LONG_INPUT
        args = (state, req.messages, req.add_generation_prompt)
        ids = await asyncio.to_thread(_chat_ids, *args) if long else _chat_ids(*args)
        return await _generate(state, request, req, [ids], chat=True)

    return app


# ----------------------------------------------------------------------------------------- requests
async def _parse(request: Request, model: type[BaseModel], state: _State) -> Any:
    """The body as ``model``: at most ``max_body`` bytes of JSON, or a 400/413."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > state.max_body):
        raise APIError(f"request body larger than {state.max_body} bytes", status=413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > state.max_body:
            raise APIError(f"request body larger than {state.max_body} bytes", status=413)
        chunks.append(chunk)
    try:
        return model.model_validate_json(b"".join(chunks))
    except ValidationError as e:
        raise _validation_error(e.errors(include_url=False)) from None


def _validation_error(errors: Sequence[Any]) -> APIError:
    first = errors[0] if errors else {}
    loc = ".".join(str(x) for x in first.get("loc", ())[:1])
    msg = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ())) or 'body'}: {e.get('msg')}" for e in errors[:5])
    return APIError(msg or "invalid request body", param=loc or None)


def _check_model(state: _State, model: Optional[str]) -> None:
    if model is not None and model != state.model_name:
        raise APIError(
            f"the model {model!r} does not exist; this server serves {state.model_name!r}",
            status=404,
            param="model",
            code="model_not_found",
        )


def _check_ids(state: _State, ids: Sequence[int], param: str) -> list[int]:
    v = state.vocab_size
    for t in ids:
        if not 0 <= t < v:
            raise APIError(f"token id {t} is out of range for a vocabulary of {v}", param=param)
    return list(ids)


def _encode(state: _State, text: str, add_special_tokens: bool = False) -> list[int]:
    tok = state.tokenizer
    enc = tok.encode(text, add_special_tokens=True) if add_special_tokens else tok.encode(text)
    return list(getattr(enc, "ids", enc))


def _chat_ids(state: _State, messages: Sequence[Any], add_generation_prompt: bool) -> list[int]:
    tok = state.tokenizer
    if not hasattr(tok, "apply_chat_template"):
        raise APIError("this server's tokenizer has no chat template; use /v1/completions", param="messages")
    msgs = [{"role": m.role, "content": m.text()} for m in messages]
    try:
        return list(tok.apply_chat_template(msgs, add_generation_prompt))
    except Exception as e:
        raise APIError(f"the chat template rejected the messages: {e}", param="messages") from None


async def _generate(
    state: _State,
    request: Request,
    req: Union[CompletionRequest, ChatCompletionRequest],
    prompts: list[list[int]],
    *,
    chat: bool,
) -> Response:
    """Validate lengths and load, submit one engine request per prompt, answer streamed or whole."""
    limit = state.max_model_len
    longest = max(len(p) for p in prompts)
    if isinstance(req, ChatCompletionRequest):
        want = req.max_completion_tokens or req.max_tokens
    else:
        want = req.max_tokens
    max_tokens = want if want is not None else limit - longest
    if longest + max(max_tokens, 1) > limit:
        raise APIError(
            f"this model's maximum context length is {limit} tokens; the request has {longest} prompt tokens "
            f"and asks for {max_tokens} more",
            param="max_tokens" if longest < limit else "prompt",
            code="context_length_exceeded",
        )
    params = to_sampling_params(req, max_tokens=max_tokens)
    try:  # the engine's door: every check, once, before anything is queued
        checked = [state.engine.check_request(ids, params, cache_salt=req.cache_salt) for ids in prompts]
    except (InvalidRequestError, ValueError, TypeError) as e:
        raise APIError(str(e), param=getattr(e, "param", None)) from None
    if req.stop_token_ids:
        _check_ids(state, req.stop_token_ids, "stop_token_ids")
    if state.draining or not state.engine_alive():
        raise APIError(
            "the server is not accepting requests",
            status=503,
            type="service_unavailable_error",
            headers={"Retry-After": "5"},
        )
    if state.engine.queue_depth() + len(prompts) > state.max_queued:
        state.metrics.aborted("rejected")
        raise APIError(
            f"the server is overloaded: {state.max_queued} requests are already waiting",
            status=503,
            type="service_unavailable_error",
            code="queue_full",
            headers={"Retry-After": "1"},
        )
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    streams: list[Any] = []
    try:
        for i, c in enumerate(checked):
            streams.append(state.engine.submit(c, request_id=f"{rid}-{i}"))
    except (InvalidRequestError, ValueError, TypeError) as e:
        for s in streams:
            s.cancel()
        raise APIError(str(e), param=getattr(e, "param", None)) from None
    job = _Job(state, streams, req.n, req.stream)
    view = _View(state, rid, chat, req)
    if req.stream:
        return _SSE(job, view)
    try:
        waiter = asyncio.ensure_future(job.wait())
        gone = asyncio.ensure_future(_disconnected(request.receive))
        await asyncio.wait((waiter, gone), return_when=asyncio.FIRST_COMPLETED)
        if gone.done():
            job.abort("client_disconnect")
            waiter.cancel()
            return Response(status_code=499)
        gone.cancel()
        err = job.failure()
        if err is not None:
            raise err
        return JSONResponse(view.whole([f for f in job.final if f is not None]))
    finally:
        job.close()


async def _disconnected(receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _watchdog(state: _State) -> None:
    """Timeouts, expired leases and keep-alive pings of the live jobs."""
    tick = min(0.5, state.keepalive / 2, state.lease / 4, (state.request_timeout or 1.0) / 4)
    while True:
        await asyncio.sleep(tick)
        now = time.monotonic()
        for job in list(state.jobs):
            if job.done:
                continue
            if job.deadline is not None and now > job.deadline:
                job.abort("timeout")
            elif job.send_since is not None and now - job.send_since > state.lease:
                job.abort("lease_expired")
            elif job.streaming and now - job.last_write > state.keepalive:
                job.ping = True
                job.event.set()


# ---------------------------------------------------------------------------------------- responses
class _View:
    """Renders a job's outputs as OpenAI completion / chat objects (whole, or SSE chunks)."""

    def __init__(self, state: _State, rid: str, chat: bool, req: Any) -> None:
        self.state, self.rid, self.chat, self.req = state, rid, chat, req
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
                if self.chat:
                    base["message"] = {"role": "assistant", "content": o.text or ""}
                else:
                    base["text"] = o.text or ""
                base.update(logprobs=lp, finish_reason=o.finish_reason, stop_reason=getattr(o, "stop_reason", None))
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
            text = o.text or ""
            fin = o.finish_reason
            if fin is None and text.endswith("\ufffd"):
                continue  # a multi-byte character is still arriving
            sent = self.sent_text.get(k, 0)
            piece = text[sent:]
            if not piece and fin is None:
                continue
            self.sent_text[k] = len(text)
            lp = self._logprobs(o, self.sent_tokens.get(k, 0))
            self.sent_tokens[k] = len(o.token_ids)
            if lp is None and fin is None:  # the common chunk: only the text changes
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
            parts.append(self._chunk(c))
        return b"".join(parts)

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


class _SSE(Response):
    """The streamed answer: an ASGI response that writes the job's chunks and watches for disconnect."""

    def __init__(self, job: _Job, view: _View) -> None:
        self.job, self.view = job, view
        self.status_code = 200
        self.background = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        job = self.job
        gone = asyncio.ensure_future(_disconnected(receive))
        gone.add_done_callback(lambda t: None if t.cancelled() else job.abort("client_disconnect"))
        job.writer = writer = asyncio.ensure_future(self._write(send))
        try:
            await asyncio.wait((writer, gone), return_when=asyncio.FIRST_COMPLETED)
            if not writer.done():
                writer.cancel()
        finally:
            gone.cancel()
            job.close()

    async def _write(self, send: Any) -> None:
        job, view = self.job, self.view

        async def write(body: bytes) -> None:
            job.send_since = time.monotonic()
            await send({"type": "http.response.body", "body": body, "more_body": True})
            job.last_write = time.monotonic()
            job.send_since = None

        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        body = view.first(len(job.streams) * job.n)
        if body:
            await write(body)
        while True:
            if not job.pending and not job.done and not job.ping:
                job.event.clear()
                await job.event.wait()
            items, job.pending, job.num_pending = job.pending, {}, 0
            body = b"".join(view.delta(i, out) for i, out in sorted(items.items()))
            if job.ping and not body:
                body = _PING
            job.ping = False
            if job.done and not job.pending:
                err = job.failure()
                if err is not None:
                    body += b"data: " + json.dumps(error_body(err.message, err.type, err.param, err.code)).encode()
                    body += b"\n\n"
                elif view.req.include_usage():
                    body += view.final_usage([f for f in job.final if f is not None])
                await write(body + _DONE)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            if body:
                await write(body)


# ------------------------------------------------------------------------------------------- errors
def _error(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status, headers=e.headers)


def _install_errors(app: FastAPI) -> None:
    """Every error leaves as ``{"error": {"message", "type", "param", "code"}}``."""

    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return _error(e)

    async def validation(request: Request, e: RequestValidationError) -> JSONResponse:
        return _error(_validation_error(e.errors()))

    async def bad_value(request: Request, e: Exception) -> JSONResponse:
        return _error(APIError(str(e) or type(e).__name__))

    async def http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = {401: "authentication_error", 404: "not_found_error"}.get(e.status_code, "invalid_request_error")
        out = _error(APIError(str(e.detail), status=e.status_code, type=kind))
        out.headers.update(getattr(e, "headers", None) or {})
        return out

    async def internal(request: Request, e: Exception) -> JSONResponse:
        log.exception("internal error on %s", request.url.path)
        return _error(APIError("internal server error", status=500, type="server_error"))

    app.add_exception_handler(APIError, api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, validation)  # type: ignore[arg-type]
    app.add_exception_handler(json.JSONDecodeError, bad_value)
    for cls in (InvalidRequestError, ValueError, TypeError):
        app.add_exception_handler(cls, bad_value)
    app.add_exception_handler(StarletteHTTPException, http)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, internal)


class _Guard:
    """ASGI middleware: the API key (constant-time compare) on every path but ``OPEN_PATHS``."""

    def __init__(self, app: Any, state: _State) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        key = self.state.api_key
        if key is not None and scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            auth = b""
            for k, v in scope["headers"]:
                if k == b"authorization":
                    auth = v
                    break
            scheme, _, given = auth.partition(b" ")
            if not (scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), key)):
                r = _error(
                    APIError(
                        "invalid or missing API key (Authorization: Bearer KEY)",
                        status=401,
                        type="authentication_error",
                        code="invalid_api_key",
                    )
                )
                r.headers["WWW-Authenticate"] = "Bearer"
                await r(scope, receive, send)
                return
        await self.app(scope, receive, send)
