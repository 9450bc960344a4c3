"""The OpenAI-compatible FastAPI app over one ``LLMEngine``: ``build_app(llm_or_engine, ...)``: the routes.

A route parses its body into a typed request model (``protocol``), checks every prompt at the
engine's door (``engine.check_request``), and hands the engine requests to a ``jobs.Job``; the
answer is rendered by ``render.View``, whole or streamed by ``sse.SSEResponse``. Every error leaves
in one shape (``protocol.error_body``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Optional, Union

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

import pagedkv_rs
from pagedkv_rs.engine.pooling import PoolingParams
from pagedkv_rs.engine.request import InvalidRequestError
from pagedkv_rs.serve.constraints import constraint_of
from pagedkv_rs.serve.jobs import Job, State, disconnected, watchdog
from pagedkv_rs.serve.logs import RequestIdMiddleware, current_request_id
from pagedkv_rs.serve.metrics import CONTENT_TYPE
from pagedkv_rs.serve.prompts import chat_ids, check_ids, encode_text, tool_constraint
from pagedkv_rs.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
    check_fields,
    error_body,
    to_sampling_params,
)
from pagedkv_rs.serve.render import View
from pagedkv_rs.serve.sse import SSEResponse
from pagedkv_rs.serve.tools import ToolParser, ToolSet, caps_of, toolset_from

__all__ = ["build_app", "OPEN_PATHS"]

log = logging.getLogger("pagedkv_rs.serve")

OPEN_PATHS = frozenset({"/health", "/metrics"})  # reachable without the API key
LONG_INPUT = 16384  # characters (or token ids) past which a prompt is tokenized off the event loop


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
    default_sampling: Optional[Mapping[str, Any]] = None,
    access_log: bool = False,
    embedding_pooling: str = "last",
) -> FastAPI:
    """A FastAPI app serving ``llm_or_engine`` (an ``LLM`` or an ``LLMEngine`` with a tokenizer).

    ``max_queued_requests`` bounds the engine's waiting queue (past it: 503 + Retry-After);
    ``request_timeout`` caps a request's life (seconds); ``stream_idle_timeout`` is the lease of a
    stream whose reader stopped reading; ``shutdown_engine``: stop the engine's loop with the app;
    ``default_sampling``: values (by request field name) for the sampling fields a request leaves unset;
    ``access_log``: one log line per request (``pagedkv_rs.serve.access``);
    ``embedding_pooling``: how ``/v1/embeddings`` pools the hidden states, "last" (token) or "mean".
    """
    engine = getattr(llm_or_engine, "engine", llm_or_engine)
    tok = tokenizer or getattr(llm_or_engine, "tokenizer", None) or engine.tokenizer
    if tok is None:
        raise ValueError("the server needs a tokenizer: pass an LLM, or an engine and tokenizer=")
    if max_queued_requests < 0:
        raise ValueError(f"max_queued_requests must be >= 0, got {max_queued_requests}")
    if api_key is not None and not api_key:
        raise ValueError("api_key is empty: an empty key would let 'Authorization: Bearer' through; give one or None")
    for name, v in (
        ("request_timeout", request_timeout),
        ("stream_idle_timeout", stream_idle_timeout),
        ("keepalive_interval", keepalive_interval),
    ):
        if v is not None and not v > 0:
            raise ValueError(f"{name} must be > 0, got {v}")
    path = getattr(llm_or_engine, "model_path", None)
    name = served_model_name or (os.path.basename(path).removesuffix(".gguf") if path else "pagedkv")
    state = State(
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
    state.sampling_defaults = dict(default_sampling or {})
    state.embedding_pooling = PoolingParams(embedding_pooling).pooling  # checked here, not at the first request
    template = getattr(tok, "chat_template", None)
    if isinstance(template, str):  # probe what it shows now, not on the event loop at the first tool request
        with contextlib.suppress(Exception):  # a template that fails is reported by the requests that use it
            caps_of(template)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        dog = asyncio.ensure_future(watchdog(state))
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
    app.add_middleware(RequestIdMiddleware, access_log=access_log)  # outermost: 401s get an id too

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        """200 ``{"status": "ok"}``; 503 ``{"status": "draining"}`` while shutting down, or
        ``{"status": "engine_stopped"}`` when the engine loop is not running."""
        if state.draining or not state.engine_alive():
            why = "draining" if state.draining else "engine_stopped"
            return JSONResponse({"status": why}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": pagedkv_rs.__version__}

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    card = {  # the served name only: never the file's path
        "id": name,
        "object": "model",
        "created": state.created,
        "owned_by": "pagedkv_rs",
        "root": name,
        "max_model_len": state.max_model_len,
    }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card]}

    @app.get("/server_info")
    @app.get("/model_info")
    async def worker_info() -> dict[str, Any]:
        """SGLang's worker description: what sglang-router reads to learn the served model's id."""
        return {
            "served_model_name": name,
            "model_path": name,
            "is_generation": True,
            "max_model_len": card["max_model_len"],
        }

    @app.get("/v1/models/{model_id:path}")
    async def model_card(model_id: str) -> dict[str, Any]:
        _check_model(state, model_id)
        return card

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        req = await _parse(request, TokenizeRequest, state)
        _check_model(state, req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("pass exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            toolset = ToolSet(tuple(t.function.model_dump(exclude_none=True) for t in req.tools)) if req.tools else None
            args: tuple[Any, ...] = (state, req, toolset)
            long = sum(len(m.text()) for m in req.messages) > LONG_INPUT
            ids, _ = await asyncio.to_thread(chat_ids, *args) if long else chat_ids(*args)
        else:
            args = (state, req.prompt or "", req.add_special_tokens)
            ids = await asyncio.to_thread(encode_text, *args) if len(args[1]) > LONG_INPUT else encode_text(*args)
        return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = await _parse(request, DetokenizeRequest, state)
        _check_model(state, req.model)
        check_ids(state, req.tokens, "tokens")
        return {"prompt": state.tokenizer.decode(req.tokens)}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await _parse(request, CompletionRequest, state)
        _check_model(state, req.model)
        items = req.prompts()

        def encode() -> list[list[int]]:
            return [encode_text(state, p, True) if isinstance(p, str) else list(p) for p in items]

        long = sum(len(p) for p in items) > LONG_INPUT
        prompts = await asyncio.to_thread(encode) if long else encode()  # a long text must not stall the loop
        return await _generate(state, request, req, prompts, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        req = await _parse(request, ChatCompletionRequest, state)
        _check_model(state, req.model)
        toolset = toolset_from(req)
        long = sum(len(m.text()) for m in req.messages) > LONG_INPUT
        args = (state, req, toolset)
        ids, parser = await asyncio.to_thread(chat_ids, *args) if long else chat_ids(*args)
        return await _generate(state, request, req, [ids], chat=True, tools=parser)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        req = await _parse(request, EmbeddingRequest, state)
        _check_model(state, req.model)
        return await _embed(state, request, req)

    return app


# ----------------------------------------------------------------------------------------- requests
async def _parse(request: Request, model: type[BaseModel], state: State) -> Any:
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
        req = model.model_validate_json(b"".join(chunks))
    except ValidationError as e:
        raise _validation_error(e.errors(include_url=False)) from None
    check_fields(req)
    return req


def _validation_error(errors: Sequence[Any]) -> APIError:
    first = errors[0] if errors else {}
    loc = ".".join(str(x) for x in first.get("loc", ())[:1])
    msg = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ())) or 'body'}: {e.get('msg')}" for e in errors[:5])
    return APIError(msg or "invalid request body", param=loc or None)


def _check_model(state: State, model: Optional[str]) -> None:
    if model is not None and model != state.model_name:
        raise APIError(
            f"the model {model!r} does not exist; this server serves {state.model_name!r}",
            status=404,
            param="model",
            code="model_not_found",
        )


async def _generate(
    state: State,
    request: Request,
    req: Union[CompletionRequest, ChatCompletionRequest],
    prompts: list[list[int]],
    *,
    chat: bool,
    tools: Optional[ToolParser] = None,
) -> Response:
    """Validate lengths and load, submit one engine request per prompt, answer streamed or whole."""
    limit = state.max_model_len
    longest = max(len(p) for p in prompts)
    if isinstance(req, ChatCompletionRequest):
        want = req.max_completion_tokens or req.max_tokens
    else:
        want = req.max_tokens
    if req.stream_options is not None and not req.stream:
        raise APIError("stream_options is only allowed when stream is true", param="stream_options")
    if req.stream_options is not None and req.stream_options.continuous_usage_stats:
        raise APIError(
            "stream_options.continuous_usage_stats is not supported",
            param="stream_options",
            code="unsupported_parameter",
        )
    max_tokens = want if want is not None else limit - longest
    if longest + max(max_tokens, 1) > limit:
        asks = f"asks for {max_tokens} more" if want is not None else "leaves no room for output"
        raise APIError(
            f"this model's maximum context length is {limit} tokens; the request has {longest} prompt tokens "
            f"and {asks}",
            param="max_tokens" if longest < limit else "prompt",
            code="context_length_exceeded",
        )
    params = to_sampling_params(
        req, max_tokens=max_tokens, defaults=state.sampling_defaults, structured_outputs=constraint_of(req)
    )
    if tools is not None:
        params = tool_constraint(state, params, tools, req)

    def check() -> list[Any]:
        return [state.engine.check_request(ids, params, cache_salt=req.cache_salt) for ids in prompts]

    try:  # the engine's door: every check, once, before anything is queued (a grammar compiles off the loop)
        checked = await asyncio.to_thread(check) if params.structured_outputs is not None else check()
    except (InvalidRequestError, ValueError, TypeError) as e:
        raise APIError(str(e), param=getattr(e, "param", None)) from None
    if req.stop_token_ids:
        check_ids(state, req.stop_token_ids, "stop_token_ids")
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    streams = _submit(state, checked, rid)
    job = Job(state, streams, req.n, req.stream)
    view = View(state, rid, chat, req, tools=tools)
    if req.stream:
        return SSEResponse(job, view)
    try:
        left = await _wait_whole(job, request)
        return left or JSONResponse(view.whole([f for f in job.final if f is not None]))
    finally:
        job.close()


def _submit(state: State, checked: list[Any], rid: str) -> list[Any]:
    """Queue checked engine requests (ids ``rid-i``) on the engine's loop, or a 503 when it takes no more."""
    if state.draining or not state.engine_alive():
        raise APIError(
            "the server is not accepting requests",
            status=503,
            type="service_unavailable_error",
            headers={"Retry-After": "5"},
        )
    if state.engine.queue_depth() + len(checked) > state.max_queued:
        state.metrics.aborted("rejected")
        raise APIError(
            f"the server is overloaded: {state.max_queued} requests are already waiting",
            status=503,
            type="service_unavailable_error",
            code="queue_full",
            headers={"Retry-After": "1"},
        )
    streams: list[Any] = []
    try:
        for i, c in enumerate(checked):
            streams.append(state.engine.submit(c, request_id=f"{rid}-{i}"))
    except (InvalidRequestError, ValueError, TypeError) as e:
        for s in streams:
            s.cancel()
        raise APIError(str(e), param=getattr(e, "param", None)) from None
    return streams


async def _wait_whole(job: Job, request: Request) -> Optional[Response]:
    """Until the job ends (None; its error raised) or the client leaves (a 499, the job aborted)."""
    waiter = asyncio.ensure_future(job.wait())
    gone = asyncio.ensure_future(disconnected(request.receive))
    await asyncio.wait((waiter, gone), return_when=asyncio.FIRST_COMPLETED)
    if gone.done():
        job.abort("client_disconnect")
        waiter.cancel()
        return Response(status_code=499)
    gone.cancel()
    err = job.failure()
    if err is not None:
        raise err
    return None


async def _embed(state: State, request: Request, req: EmbeddingRequest) -> Response:
    """``/v1/embeddings``: one pooling request per input through the engine (batched with generation)."""
    hidden = getattr(state.engine.model, "hidden_size", None)
    if req.dimensions is not None and req.dimensions != hidden:
        raise APIError(
            f"dimensions={req.dimensions} is not supported: this model's embeddings have {hidden} dimensions "
            "(they are not truncated)",
            param="dimensions",
            code="unsupported_parameter",
        )
    items = req.inputs()
    limit = state.max_model_len

    def encode() -> list[list[int]]:
        return [encode_text(state, p, True, "input") if isinstance(p, str) else list(p) for p in items]

    long = sum(len(p) for p in items) > LONG_INPUT
    prompts = await asyncio.to_thread(encode) if long else encode()
    for ids in prompts:
        if len(ids) > limit:
            raise APIError(
                f"this model's maximum context length is {limit} tokens; an input has {len(ids)} tokens",
                param="input",
                code="context_length_exceeded",
            )
    params = PoolingParams(state.embedding_pooling, req.normalize)
    try:
        checked = [state.engine.check_request(ids, params) for ids in prompts]
    except (InvalidRequestError, ValueError, TypeError) as e:
        param = getattr(e, "param", None)
        raise APIError(str(e), param="input" if param in (None, "prompt") else param) from None
    rid = f"embd-{uuid.uuid4().hex}"
    job = Job(state, _submit(state, checked, rid), 1, False)
    try:
        left = await _wait_whole(job, request)
        if left is not None:
            return left
        data = []
        for i, out in enumerate(job.final):
            assert out is not None
            vec: Any = out.outputs.embedding  # type: ignore[attr-defined]  # an EmbeddingRequestOutput
            if req.encoding_format == "base64":  # OpenAI's: the little-endian float32 bytes
                vec = base64.b64encode(np.asarray(vec, "<f4").tobytes()).decode("ascii")
            data.append({"object": "embedding", "index": i, "embedding": vec})
        n = sum(len(ids) for ids in prompts)
        return JSONResponse(
            {
                "id": rid,
                "object": "list",
                "created": int(time.time()),
                "model": state.model_name,
                "data": data,
                "usage": {"prompt_tokens": n, "total_tokens": n},
            }
        )
    finally:
        job.close()


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

    async def client_left(request: Request, e: ClientDisconnect) -> Response:
        # a client's choice, not a server fault: one line, no traceback; nobody reads the answer
        log.info("client left before sending the whole request body (%s %s)", request.method, request.url.path)
        return Response(status_code=499)

    async def internal(request: Request, e: Exception) -> JSONResponse:
        log.exception("internal error on %s", request.url.path)
        rid = {"X-Request-Id": current_request_id()}  # answered outside RequestIdMiddleware: add its header here
        return _error(APIError("internal server error", status=500, type="server_error", headers=rid))

    app.add_exception_handler(APIError, api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, validation)  # type: ignore[arg-type]
    app.add_exception_handler(json.JSONDecodeError, bad_value)
    for cls in (InvalidRequestError, ValueError, TypeError):
        app.add_exception_handler(cls, bad_value)
    app.add_exception_handler(StarletteHTTPException, http)  # type: ignore[arg-type]
    app.add_exception_handler(ClientDisconnect, client_left)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, internal)


class _Guard:
    """ASGI middleware: the API key (constant-time compare) on every path but ``OPEN_PATHS``."""

    def __init__(self, app: Any, state: State) -> None:
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
