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

from pagedkv_rs.engine.pooling import PoolingParams
from pagedkv_rs.engine.request import MAX_TOKEN_ID, InvalidRequestError, SamplingParams

__all__ = [
    "CheckedRequest",
    "ContextLengthError",
    "check_text_length",
    "encode_text",
    "InputLimits",
    "check_request",
    "check_request_id",
    "prompt_list",
    "split_prompt",
    "MAX_REQUEST_ID_LEN",
    "MAX_LOGPROB_ENTRIES",
]

MAX_REQUEST_ID_LEN = 1024
MAX_CACHE_SALT_LEN = 1024
# what a pooling request runs with: one greedy "token" that is never sampled (no random stream is drawn for it)
POOLING_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0)
# logprob entries (token id, logprob, rank: 16 bytes as arrays) one request may make: n x its most output
# tokens x (logprobs + 1), plus its prompt tokens x (prompt_logprobs + 1); 2^24 entries = 256 MiB
MAX_LOGPROB_ENTRIES = 1 << 24
_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt"})


@dataclass(frozen=True)
class InputLimits:
    """What a request is checked against: the vocabulary, the context limit, the tokenizer, model features."""

    vocab_size: int = MAX_TOKEN_ID + 1
    max_model_len: int = 1 << 62
    tokenizer: Any = None  # encodes a text prompt; None: token ids only
    prompt_logprobs: Optional[str] = None  # None: supported; else why not (the model's forward)
    pool: str = ""  # how the context limit came about, for the message
    max_num_seqs: int = 1 << 62  # seats: an n > 1 request's whole fan-out must fit them
    grammars: Any = None  # structured outputs: a ``structured.GrammarCompiler`` (None: no tokenizer)
    pooling: Optional[str] = None  # None: pooling requests supported; else why not (the model)


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
    pooling: Optional[PoolingParams] = None  # a pooling request (embeddings): prefill only, never sampled


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


class ContextLengthError(InvalidRequestError):
    """A prompt longer than the context limit (the server's ``context_length_exceeded``)."""


def check_text_length(tokenizer: Any, text: str, max_model_len: int, who: str = "", pool: str = "") -> None:
    """Refuse a text that cannot fit ``max_model_len`` tokens, without tokenizing it: the tokenizer's
    ``min_num_tokens(text)`` (its bytes over the most bytes one token stands for) is a lower bound.
    A tokenizer without it is not checked here (its ids are, after encoding)."""
    bound = getattr(tokenizer, "min_num_tokens", None)
    if bound is None or len(text) <= max_model_len:  # a token stands for one character at least
        return
    n = bound(text)
    if n > max_model_len:
        raise ContextLengthError(
            f"{who}prompt of {len(text)} characters is at least {n} tokens, which exceeds "
            f"max_model_len={max_model_len}{pool}",
            param="prompt",
        )


def encode_text(tokenizer: Any, text: str, max_model_len: int, who: str = "", pool: str = "") -> list[int]:
    """A text prompt's ids with the vocabulary's BOS/EOS rules (vLLM's ``add_special_tokens=True``), refused by
    ``check_text_length`` first. Gemma and Llama add BOS, SmolLM2 adds nothing. A tokenizer without that
    keyword encodes the text as it is."""
    check_text_length(tokenizer, text, max_model_len, who, pool)
    try:
        enc = tokenizer.encode(text, add_special_tokens=True)
    except TypeError:
        enc = tokenizer.encode(text)
    return list(getattr(enc, "ids", enc))


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
    pooling = None
    if isinstance(params, PoolingParams):
        if limits.pooling is not None:
            raise InvalidRequestError(f"pooling (embeddings): {limits.pooling}", param="input")
        pooling, params = params, POOLING_SAMPLING
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be SamplingParams or PoolingParams, got {type(params).__name__}")
    if params.n > limits.max_num_seqs:
        raise InvalidRequestError(
            f"n={params.n} completions can never run: the engine runs at most max_num_seqs="
            f"{limits.max_num_seqs} sequences at once",
            param="n",
        )
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
        who = "" if request_id is None else f"request {request_id!r}: "
        text, prompt = prompt, encode_text(limits.tokenizer, prompt, limits.max_model_len, who, limits.pool)
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
        raise ContextLengthError(
            f"{who}prompt of {len(toks)} tokens exceeds max_model_len={limits.max_model_len}{limits.pool}",
            param="prompt",
        )
    _check_logprob_entries(params, len(toks), limits.max_model_len, who)
    grammar = None if params.structured_outputs is None else _compile(limits, params.structured_outputs)
    return CheckedRequest(request_id, toks, params, text, cache_salt, arrival_time, grammar, pooling)


def _check_logprob_entries(params: SamplingParams, prompt_len: int, max_model_len: int, who: str) -> None:
    """Refuse a request whose logprobs could grow past ``MAX_LOGPROB_ENTRIES``."""
    out = min(params.max_tokens, max(max_model_len - prompt_len, 0))
    gen = 0 if params.logprobs is None else params.n * out * (params.logprobs + 1)
    pro = 0 if params.prompt_logprobs is None else prompt_len * (params.prompt_logprobs + 1)
    if gen + pro > MAX_LOGPROB_ENTRIES:
        parts = []
        if gen:
            parts.append(f"n={params.n} x {out} output tokens x {params.logprobs + 1}")  # type: ignore[operator]
        if pro:
            parts.append(f"{prompt_len} prompt tokens x {params.prompt_logprobs + 1}")  # type: ignore[operator]
        raise InvalidRequestError(
            f"{who}the logprobs asked for ({' + '.join(parts)} = {gen + pro} entries) exceed the "
            f"{MAX_LOGPROB_ENTRIES} one request may hold; ask for fewer max_tokens, n or logprobs",
            param="logprobs" if gen else "prompt_logprobs",
        )


def _compile(limits: InputLimits, constraint: Any) -> Any:
    """The compiled structured-outputs constraint, or ``InvalidRequestError`` saying why it cannot be had."""
    if limits.grammars is None:
        raise InvalidRequestError("structured outputs need an engine with a tokenizer", param="structured_outputs")
    try:
        return limits.grammars.compile(constraint)
    except (ValueError, TypeError, ImportError) as e:  # ImportError: llguidance is not installed
        raise InvalidRequestError(str(e), param="structured_outputs") from None
