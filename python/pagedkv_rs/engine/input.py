"""The one door: every check a request gets, once, before anything is queued (vLLM v1's input processor).

``check_request(prompt, params, limits=...)`` turns a prompt (text, token ids, or vLLM's prompt dict)
and its ``SamplingParams`` into a ``CheckedRequest``: types, ranges, token ids against the vocabulary,
lengths, the cache salt, the arrival time. It changes nothing; a bad field raises ``TypeError`` or
``InvalidRequestError`` naming it. ``LLMEngine`` (and through it ``LLM``) and the server call it;
the scheduler and the runner trust what it returns.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import numpy as np

from pagedkv_rs.engine.request import MAX_TOKEN_ID, InvalidRequestError, SamplingParams

__all__ = [
    "CheckedRequest",
    "InputLimits",
    "check_request",
    "check_request_id",
    "prompt_list",
    "split_prompt",
    "MAX_REQUEST_ID_LEN",
]

MAX_REQUEST_ID_LEN = 1024
MAX_CACHE_SALT_LEN = 1024
_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt"})


@dataclass(frozen=True)
class InputLimits:
    """What a request is checked against: the vocabulary, the context limit, the tokenizer, model features."""

    vocab_size: int = MAX_TOKEN_ID + 1
    max_model_len: int = 1 << 62
    tokenizer: Any = None  # encodes a text prompt; None: token ids only
    prompt_logprobs: Optional[str] = None  # None: supported; else why not (the model's forward)
    pool: str = ""  # how the context limit came about, for the message
    grammars: Any = None  # structured outputs: a ``structured.GrammarCompiler`` (None: no tokenizer)


@dataclass(frozen=True)
class CheckedRequest:
    """A request that passed ``check_request``: the scheduler queues it as is."""

    request_id: Optional[str]  # None: the engine names it
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: Optional[str] = None  # the text, when the prompt was text
    cache_salt: Union[str, bytes, None] = None
    arrival_time: Optional[float] = None
    grammar: Any = None  # structured outputs: the compiled constraint (``structured.CompiledGrammar``)


def split_prompt(p: Any) -> tuple[Any, Any]:
    """(prompt, cache_salt) of a prompt or of vLLM's prompt dict ``{"prompt" | "prompt_token_ids", "cache_salt"}``."""
    if not isinstance(p, Mapping):
        return p, None
    extra = set(p) - _PROMPT_KEYS
    if extra:
        raise InvalidRequestError(f"prompt dict: unknown keys {sorted(extra)} (expected {sorted(_PROMPT_KEYS)})")
    if ("prompt" in p) == ("prompt_token_ids" in p):
        raise InvalidRequestError('a prompt dict needs exactly one of "prompt" (text) and "prompt_token_ids"')
    if "prompt" in p and not isinstance(p["prompt"], str):
        raise TypeError(f'prompt dict: "prompt" must be a str, got {type(p["prompt"]).__name__}')
    body = p["prompt"] if "prompt" in p else p["prompt_token_ids"]
    if "prompt_token_ids" in p and isinstance(body, str):
        raise TypeError('prompt dict: "prompt_token_ids" must be a list of ints, got str')
    return body, p.get("cache_salt")


def prompt_list(prompts: Any, params: Any) -> list[tuple[Any, Any]]:
    """(prompt, params) pairs of ``generate``'s arguments: one prompt or a list; one ``SamplingParams`` or a list."""
    single = isinstance(prompts, (str, Mapping)) or (len(prompts) > 0 and isinstance(prompts[0], (int, np.integer)))
    items = [prompts] if single else list(prompts)
    plist = list(params) if isinstance(params, Sequence) else [params] * len(items)
    if len(plist) != len(items):
        raise ValueError(f"{len(items)} prompts but {len(plist)} SamplingParams")
    return list(zip(items, plist))


def check_request_id(request_id: Any) -> str:
    """A request id: a str of 1 to ``MAX_REQUEST_ID_LEN`` characters without NUL (completions add ``\\x00i``)."""
    if not isinstance(request_id, str):
        raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
    if not request_id or len(request_id) > MAX_REQUEST_ID_LEN or "\x00" in request_id:
        raise InvalidRequestError(
            f"request_id must be 1 to {MAX_REQUEST_ID_LEN} characters without NUL, got {request_id[:64]!r}"
        )
    return request_id


def _encode_text(tokenizer: Any, text: str) -> Any:
    """A text prompt's ids with the vocabulary's BOS/EOS rules (vLLM's ``add_special_tokens=True``): Gemma and
    Llama add BOS, SmolLM2 adds nothing. A tokenizer without that keyword encodes the text as it is."""
    try:
        return tokenizer.encode(text, add_special_tokens=True)
    except TypeError:
        return tokenizer.encode(text)


def check_request(
    prompt: Any,
    params: Any = None,
    *,
    limits: InputLimits,
    request_id: Any = None,
    arrival_time: Any = None,
    cache_salt: Any = None,
    text: Any = None,
) -> CheckedRequest:
    """Check one request completely (no state changes); raises ``TypeError`` / ``InvalidRequestError``.

    ``prompt``: text (needs ``limits.tokenizer``), token ids, or a prompt dict (its ``cache_salt`` is
    used unless one is passed). ``text``: the prompt's text when ``prompt`` holds its ids already.
    ``request_id=None`` leaves the naming to the engine. A ``CheckedRequest`` passes as is (given
    at most a ``request_id`` if it has none).
    """
    if isinstance(prompt, CheckedRequest):
        if params is not None or arrival_time is not None or cache_salt is not None or text is not None:
            raise TypeError("a CheckedRequest carries its params, arrival_time and cache_salt")
        if request_id is None:
            return prompt
        if prompt.request_id is not None:
            raise TypeError(f"the CheckedRequest is already named {prompt.request_id!r}")
        return dataclasses.replace(prompt, request_id=check_request_id(request_id))
    if isinstance(prompt, Mapping):
        prompt, salt = split_prompt(prompt)
        cache_salt = salt if cache_salt is None else cache_salt
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
    if request_id is not None:
        check_request_id(request_id)
    if cache_salt is not None:
        if not isinstance(cache_salt, (str, bytes)):
            raise TypeError(f"cache_salt must be a str, bytes or None, got {type(cache_salt).__name__}")
        if len(cache_salt) > MAX_CACHE_SALT_LEN:
            raise InvalidRequestError(f"cache_salt is longer than {MAX_CACHE_SALT_LEN} characters", param="cache_salt")
        if isinstance(cache_salt, str):
            try:
                cache_salt.encode("utf-8")  # hashed as UTF-8 by every block of the request
            except UnicodeEncodeError as e:
                raise InvalidRequestError(
                    f"cache_salt is not valid UTF-8 text: {e.reason}", param="cache_salt"
                ) from None
    if arrival_time is not None:
        if isinstance(arrival_time, bool) or not isinstance(arrival_time, (int, float)):
            raise TypeError(f"arrival_time must be a float (time.monotonic()), got {type(arrival_time).__name__}")
        if not math.isfinite(arrival_time):
            raise InvalidRequestError(f"arrival_time must be finite, got {arrival_time}")
    if text is not None and not isinstance(text, str):
        raise TypeError(f"prompt text must be a str, got {type(text).__name__}")
    if isinstance(prompt, str):
        if limits.tokenizer is None:
            raise InvalidRequestError(
                "a text prompt needs an engine with a tokenizer; pass token ids instead", param="prompt"
            )
        enc = _encode_text(limits.tokenizer, prompt)
        text, prompt = prompt, list(getattr(enc, "ids", enc))
    elif isinstance(prompt, bytes) or not isinstance(prompt, (Sequence, np.ndarray)):
        raise TypeError(f"prompt must be a str or a sequence of token ids, got {type(prompt).__name__}")
    if params.prompt_logprobs is not None and limits.prompt_logprobs is not None:
        raise InvalidRequestError(f"prompt_logprobs: {limits.prompt_logprobs}", param="prompt_logprobs")
    who = "" if request_id is None else f"request {request_id!r}: "
    toks: list[int] = []
    vocab = limits.vocab_size
    for t in prompt:
        if isinstance(t, bool) or not hasattr(t, "__index__"):
            raise TypeError(f"{who}prompt token ids must be ints, got {type(t).__name__}")
        v = int(t.__index__())
        if not 0 <= v < vocab:
            raise InvalidRequestError(
                f"{who}prompt token id {v} at position {len(toks)} is outside the vocabulary [0, {vocab})",
                param="prompt",
            )
        toks.append(v)
    if not toks:
        raise InvalidRequestError(f"{who}the prompt is empty", param="prompt")
    if len(toks) > limits.max_model_len:
        raise InvalidRequestError(
            f"{who}prompt of {len(toks)} tokens exceeds max_model_len={limits.max_model_len}{limits.pool}",
            param="prompt",
        )
    grammar = None if params.structured_outputs is None else _compile(limits, params.structured_outputs)
    return CheckedRequest(request_id, toks, params, text, cache_salt, arrival_time, grammar)


def _compile(limits: InputLimits, constraint: Any) -> Any:
    """The compiled structured-outputs constraint, or ``InvalidRequestError`` saying why it cannot be had."""
    if limits.grammars is None:
        raise InvalidRequestError("structured outputs need an engine with a tokenizer", param="structured_outputs")
    try:
        return limits.grammars.compile(constraint)
    except (ValueError, TypeError) as e:
        raise InvalidRequestError(str(e), param="structured_outputs") from None
