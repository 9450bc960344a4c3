"""Default sampling settings: what ``pagedkv generate`` samples with, and what ``pagedkv serve`` gives the
fields a request leaves unset.

Precedence for the server, highest first: the request's own value > the operator's settings
(``--default-*`` options, ``--override-generation-config``) > the GGUF file's ``general.sampling.*``
keys > ``GENERATE_DEFAULTS``. With ``--generation-config openai`` the last two are skipped and unset
fields take OpenAI's values (temperature 1, top_p 1, no penalty), as vLLM's ``--generation-config vllm``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

__all__ = ["FIELDS", "GENERATE_DEFAULTS", "GGUF_KEYS", "from_gguf", "parse_override", "resolve"]

log = logging.getLogger("pagedkv_rs.serve")

# The request fields a default can fill, and their type (vLLM's generation-config keys, plus the penalties).
FIELDS: dict[str, type] = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "repetition_penalty": float,
    "presence_penalty": float,
    "frequency_penalty": float,
}

# SmolLM2-Instruct's recommended temperature / top_p, and HF's / llama.cpp's classic repetition penalty,
# which stops a small model's greedy loops ("a fleeting choice, a fleeting choice, ...").
GENERATE_DEFAULTS: dict[str, Any] = {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.1}

# llama.cpp's general.sampling.* keys (gguf-py constants.py, Keys.General) -> our field.
GGUF_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
# The general.sampling.* keys naming a sampler this engine does not have: reported at start-up.
_GGUF_UNSUPPORTED = ("sequence", "xtc_probability", "xtc_threshold", "penalty_last_n", "mirostat")


def _check(name: str, value: Any, source: str) -> Any:
    """``value`` as ``FIELDS[name]``'s type, or ValueError naming the source."""
    if name not in FIELDS:
        raise ValueError(f"{source}: unknown sampling key {name!r}; known: {', '.join(FIELDS)}")
    kind = FIELDS[name]
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok and kind is int:
        ok = float(value).is_integer()
    if not ok:
        raise ValueError(f"{source}: {name} must be a{'n integer' if kind is int else ' number'}, got {value!r}")
    return kind(value)


def from_gguf(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling settings a GGUF file recommends (its ``general.sampling.*`` keys we can honour)."""
    out = {
        field: _check(field, metadata[key], f"GGUF key {key}") for key, field in GGUF_KEYS.items() if key in metadata
    }
    ignored = [k for k in metadata if k.startswith("general.sampling.") and k.split(".")[2] in _GGUF_UNSUPPORTED]
    if ignored:
        log.warning("the model file's %s name samplers this engine does not have; not used", ", ".join(ignored))
    return out


def parse_override(text: str) -> dict[str, Any]:
    """``--override-generation-config``'s JSON object, checked: known keys, numbers of the right type."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"must be a JSON object, got {type(obj).__name__}")
    return {k: _check(k, v, "--override-generation-config") for k, v in obj.items()}


def resolve(operator: Mapping[str, Any], gguf: Mapping[str, Any], *, use_model_defaults: bool = True) -> dict[str, Any]:
    """The server's defaults: ``operator`` over ``gguf`` over ``GENERATE_DEFAULTS`` (the last two only when
    ``use_model_defaults``), checked together as one ``SamplingParams`` (ValueError when out of range)."""
    from pagedkv_rs.engine.request import SamplingParams

    out: dict[str, Any] = {}
    if use_model_defaults:
        out.update(GENERATE_DEFAULTS)
        out.update(gguf)
    out.update(operator)
    SamplingParams(max_tokens=1, **out)  # ranges: temperature >= 0, top_p in (0, 1], ...
    return out
