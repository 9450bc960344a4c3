"""OpenAI/vLLM request and response models, validated at the door, and the one map to ``SamplingParams``.

A field we do not implement is refused with a 400 (``code: unsupported_parameter``, ``param`` naming it), never
silently ignored: ``check_fields`` refuses every field the models do not define (``UNSUPPORTED`` lists the ones
OpenAI or vLLM define, accepted only at their "off" value; ``METADATA`` the few harmless ones clients send), and
``to_sampling_params`` the defined fields the engine has no equivalent for (``echo``, ``suffix``, ``best_of``,
``logit_bias``). A known field of the wrong type or out of range is a 400. The output-constraint fields
(``response_format``, ``structured_outputs``, ``guided_*``, ``json_schema``, ``grammar``) map to the engine's
constraint in ``serve.constraints``.
"""

from __future__ import annotations

import json
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
    "EmbeddingRequest",
    "ErrorResponse",
    "UsageInfo",
    "to_sampling_params",
    "error_body",
    "check_fields",
    "UNSUPPORTED",
    "METADATA",
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
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)  # extras are refused by check_fields


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


# ------------------------------------------------------------------- chat messages, tools (serve/tools.py)
class ContentPart(_Request):
    type: str
    text: Optional[str] = None


class FunctionCallParam(_Request):
    """A past call's function: ``arguments`` is OpenAI's JSON string (a JSON object is taken as well)."""

    name: str = Field(..., min_length=1, max_length=256)
    arguments: Union[str, dict[str, Any]] = "{}"

    def argument_dict(self, param: str) -> dict[str, Any]:
        args = self.arguments
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise APIError(f"{param}: arguments is not valid JSON", param="messages") from None
        if not isinstance(args, dict):
            raise APIError(f"{param}: arguments must be a JSON object", param="messages")
        return args


class ToolCallParam(_Request):
    id: str = Field(..., min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCallParam]] = Field(None, max_length=128)
    tool_call_id: Optional[str] = Field(None, max_length=256)
    function_call: Optional[FunctionCallParam] = None  # legacy: an assistant's one call

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text or "" for p in self.content)
        return self.content or ""


NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for a function's name


class FunctionDef(_Request):
    name: str = Field(..., pattern=NAME_PATTERN)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ToolParam(_Request):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=4096)
    max_tokens: Optional[int] = Field(None, ge=1, le=MAX_INT)
    max_completion_tokens: Optional[int] = Field(None, ge=1, le=MAX_INT)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Optional[list[ToolParam]] = Field(None, max_length=256)
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None
    functions: Optional[list[FunctionDef]] = Field(None, max_length=256)  # legacy tools
    function_call: Union[Literal["none", "auto"], NamedFunction, None] = None  # legacy tool_choice
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None


class TokenizeRequest(_Request):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = Field(None, min_length=1, max_length=4096)
    tools: Optional[list[ToolParam]] = Field(None, max_length=256)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_special_tokens: bool = True  # vLLM's default: a text prompt gets the vocabulary's BOS/EOS


class DetokenizeRequest(_Request):
    model: Optional[str] = None
    tokens: list[int] = Field(..., max_length=1 << 20)


class EmbeddingRequest(_Request):
    """OpenAI's ``/v1/embeddings`` body, and vLLM's ``normalize``."""

    input: Union[str, list[str], TokenIds, list[TokenIds]]
    model: Optional[str] = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = Field(None, ge=1, le=MAX_INT)
    user: Optional[str] = None
    normalize: bool = True  # vLLM: L2-normalize the pooled vector

    def inputs(self) -> list[Union[str, list[int]]]:
        """The inputs as a list: texts or token-id lists (1 to ``MAX_PROMPTS``, none empty)."""
        p = self.input
        items: list[Any] = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not items or len(items) > MAX_PROMPTS:
            raise APIError(f"input must hold 1 to {MAX_PROMPTS} inputs, got {len(items)}", param="input")
        if any(len(x) == 0 for x in items):
            raise APIError("an input must not be empty", param="input")
        return items


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


# -------------------------------------------------------------------------------------------- field audit
# Request fields OpenAI's or vLLM's chat / completion APIs define that this server does not implement: refused
# with a 400 unless set to one of the values listed (what the field means when it is absent).
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    # OpenAI
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "service_tier": (None, "auto", "default"),
    "store": (None, False),
    # vLLM
    "use_beam_search": (None, False),
    "length_penalty": (None, 1.0),
    "spaces_between_special_tokens": (None, True),
    "truncate_prompt_tokens": (None,),
    "truncation_side": (None,),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "logprob_token_ids": (None,),
    "watermarking": (None, False),
    "add_special_tokens": (None,),  # chat and completions (/tokenize implements it)
    "documents": (None,),
    "chat_template": (None,),
    "media_io_kwargs": (None,),
    "mm_processor_kwargs": (None,),
    "request_id": (None,),
    "session_id": (None,),
    "return_tokens_as_token_ids": (None, False),
    "return_token_ids": (None, False),
    "return_prompt_text": (None, False),
    "return_token_offsets": (None, False),
    "return_mm_kwargs": (None, True),
    "routed_experts_prompt_start": (None, 0),
    "kv_transfer_params": (None,),
    "ec_transfer_params": (None,),
    "vllm_xargs": (None,),
    "repetition_detection": (None,),
    "stream_interval": (None,),
    "thinking_token_budget": (None,),
    "include_reasoning": (None,),
    "prompt_embeds": (None,),
    "logits_processors": (None,),
    "echo": (None, False),
    "guided_decoding_backend": (None,),
    "guided_whitespace_pattern": (None,),
    "structural_tag": (None,),  # vLLM's chat echo (completions define their own echo field)
    # SGLang: its router (sglang-router) forwards every request with these set to SGLang's defaults
    "no_stop_trim": (None, False),
    "return_hidden_states": (None, False),
    "separate_reasoning": (None, True, False),  # without a reasoning parser (ours has none) both mean the same
    "stream_reasoning": (None, True, False),
}
# Fields clients send as labels for their own bookkeeping: accepted, not used, not stored.
METADATA = frozenset({"metadata", "prompt_cache_key", "safety_identifier"})
# Fields of a message that OpenAI's own response objects carry: accepted when empty.
MESSAGE_ECHOES = frozenset({"refusal", "audio", "annotations", "reasoning", "reasoning_content"})


def _is_off(value: Any, offs: tuple[Any, ...]) -> bool:
    return any(value == o and isinstance(value, bool) == isinstance(o, bool) for o in offs)


def _refuse(param: str, message: str) -> APIError:
    return APIError(message, param=param, code="unsupported_parameter")


def check_fields(req: BaseModel) -> None:
    """400 ``unsupported_parameter`` for the first field ``req`` (a parsed request) holds that no model defines."""
    for name, value in (req.model_extra or {}).items():
        if name in METADATA:
            continue
        if name in UNSUPPORTED:
            if not _is_off(value, UNSUPPORTED[name]):
                raise _refuse(name, f"{name} is not supported by this server")
            continue
        raise _refuse(name, f"unknown field {name!r}: this server does not implement it")
    for field_name in type(req).model_fields:
        _check_nested(getattr(req, field_name), field_name)


def _check_nested(value: Any, path: str) -> None:
    if isinstance(value, list):
        for i, v in enumerate(value):
            _check_nested(v, f"{path}[{i}]")
        return
    if not isinstance(value, BaseModel):
        return
    if isinstance(value, ContentPart) and value.type != "text":
        raise _refuse(path.split("[", 1)[0], f"{path}: content parts of type {value.type!r} are not supported")
    if isinstance(value, ContentPart) and value.text is None:
        raise APIError(f"{path}: a text part needs 'text'", param=path.split("[", 1)[0])
    for name, v in (value.model_extra or {}).items():
        if isinstance(value, ChatMessage) and name in MESSAGE_ECHOES and v in (None, "", []):
            continue
        raise _refuse(path.split("[", 1)[0].split(".", 1)[0], f"unknown field {path}.{name}: not supported")
    for field_name in type(value).model_fields:
        _check_nested(getattr(value, field_name), f"{path}.{field_name}")
