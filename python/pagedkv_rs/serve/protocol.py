"""OpenAI/vLLM request and response models, validated at the door, and the one map to ``SamplingParams``.

Unknown request fields are ignored (as OpenAI and vLLM do); a known field of the wrong type or out of
range is a 400. ``to_sampling_params`` is the only place a request becomes engine parameters; the few
OpenAI fields the engine has no equivalent for (``echo``, ``suffix``, ``best_of``, ``logit_bias``,
``tools``) answer 400 "not supported" when set, never silently ignored. The output-constraint fields
(``response_format``, ``structured_outputs``, ``guided_*``, ``json_schema``, ``grammar``) map to the engine's
constraint in ``serve.constraints``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from pagedkv_rs.engine.request import SamplingParams
from pagedkv_rs.engine.structured import StructuredOutputsParams

__all__ = [
    "APIError",
    "CompletionRequest",
    "ChatCompletionRequest",
    "TokenizeRequest",
    "DetokenizeRequest",
    "ErrorResponse",
    "UsageInfo",
    "to_sampling_params",
    "error_body",
]

MAX_SEED = (1 << 64) - 1
MAX_INT = (1 << 63) - 1
MAX_PROMPTS = 64  # prompts in one /v1/completions request
MAX_N = 16
MAX_STOP = 16
MAX_LOGPROBS = 20


class APIError(Exception):
    """An error that leaves as ``{"error": {...}}`` with this HTTP status."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: Optional[str] = None,
        code: Optional[str] = None,
        headers: Optional[dict[str, str]] = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = headers or {}


def error_body(message: str, type: str, param: Optional[str] = None, code: Optional[str] = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


Float = Optional[float]
TokenIds = list[int]


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(_Request):
    """Fields completions and chat share (OpenAI's, then vLLM's extras)."""

    model: Optional[str] = None
    temperature: Float = Field(None, ge=0.0)
    top_p: Float = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Union[str, list[str], None] = Field(None)
    seed: Optional[int] = Field(None, ge=0, le=MAX_SEED)
    presence_penalty: Float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: Float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    # vLLM extras
    top_k: Optional[int] = Field(None, ge=-1, le=MAX_INT)
    min_p: Float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: Float = Field(1.0, gt=0.0, le=100.0)
    min_tokens: int = Field(0, ge=0, le=MAX_INT)
    stop_token_ids: Optional[list[int]] = Field(None, max_length=1024)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    cache_salt: Optional[str] = Field(None, max_length=4096)
    priority: int = Field(0, ge=-MAX_INT - 1, le=MAX_INT)
    prompt_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    # output constraints (serve.constraints): OpenAI's, vLLM's (new and legacy), llama.cpp's
    response_format: Optional[dict[str, Any]] = None
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = None
    grammar: Optional[str] = None

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP:
            raise APIError(f"at most {MAX_STOP} stop sequences, got {len(stops)}", param="stop")
        if any(not s for s in stops):
            raise APIError("stop sequences must not be empty", param="stop")
        return stops


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], TokenIds, list[TokenIds]]
    max_tokens: Optional[int] = Field(16, ge=1, le=MAX_INT)
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = Field(None, ge=1, le=MAX_N)
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompts as a list: texts or token-id lists (at least one, none empty)."""
        p = self.prompt
        items: list[Any] = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not items or len(items) > MAX_PROMPTS:
            raise APIError(f"prompt must hold 1 to {MAX_PROMPTS} prompts, got {len(items)}", param="prompt")
        if any(len(x) == 0 for x in items):
            raise APIError("a prompt must not be empty", param="prompt")
        return items


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=4096)
    max_tokens: Optional[int] = Field(None, ge=1, le=MAX_INT)
    max_completion_tokens: Optional[int] = Field(None, ge=1, le=MAX_INT)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    add_generation_prompt: bool = True


class TokenizeRequest(_Request):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = Field(None, min_length=1, max_length=4096)
    add_generation_prompt: bool = True
    add_special_tokens: bool = True  # vLLM's default: a text prompt gets the vocabulary's BOS/EOS


class DetokenizeRequest(_Request):
    model: Optional[str] = None
    tokens: list[int] = Field(..., max_length=1 << 20)


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Optional[dict[str, int]] = None


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def to_sampling_params(
    req: _Sampling,
    *,
    max_tokens: int,
    defaults: Optional[Mapping[str, Any]] = None,
    structured_outputs: Optional[StructuredOutputsParams] = None,
) -> SamplingParams:
    """The request's sampling fields as ``SamplingParams``; 400 for a value the engine cannot honour.

    ``defaults`` (the server's, by field name) fill the fields the request leaves unset or null;
    ``structured_outputs``: the request's constraint (``serve.constraints.constraint_of``).
    """
    fallback = defaults or {}

    def pick(name: str, openai: Any) -> Any:
        v = getattr(req, name)
        if v is not None and name in req.model_fields_set:
            return v
        return fallback.get(name, openai if v is None else v)

    unsupported: list[tuple[str, Any, Any]] = [  # request param, value, the value that means "off"
        ("logit_bias", req.logit_bias or None, None),
        ("skip_special_tokens", req.skip_special_tokens, True),
    ]
    if isinstance(req, CompletionRequest):
        unsupported += [("echo", req.echo, False), ("suffix", req.suffix, None), ("best_of", req.best_of, None)]
        logprobs = req.logprobs
    else:
        assert isinstance(req, ChatCompletionRequest)
        unsupported += [("tools", req.tools or None, None)]
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    for param, value, off in unsupported:
        if value != off:
            raise APIError(f"{param} is not supported by this server", param=param, code="unsupported_parameter")
    kwargs: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": pick("temperature", 1.0),
        "top_p": pick("top_p", 1.0),
        "top_k": pick("top_k", 0) or 0,
        "seed": req.seed,
        "stop_token_ids": tuple(req.stop_token_ids or ()),
        "ignore_eos": req.ignore_eos,
        "priority": req.priority,
        "structured_outputs": structured_outputs,
    }
    optional: dict[str, tuple[Any, Any]] = {  # SamplingParams field: (value, the default that means "off")
        "n": (req.n, 1),
        "stop": (req.stop_strings(), []),
        "include_stop_str_in_output": (req.include_stop_str_in_output, False),
        "logprobs": (logprobs, None),
        "prompt_logprobs": (req.prompt_logprobs, None),
        "presence_penalty": (pick("presence_penalty", 0.0), 0.0),
        "frequency_penalty": (pick("frequency_penalty", 0.0), 0.0),
        "repetition_penalty": (pick("repetition_penalty", 1.0), 1.0),
        "min_p": (pick("min_p", 0.0), 0.0),
        "min_tokens": (req.min_tokens, 0),
    }
    kwargs.update({name: value for name, (value, default) in optional.items() if value != default})
    try:
        return SamplingParams(**kwargs)
    except (TypeError, ValueError) as e:
        raise APIError(str(e)) from None
