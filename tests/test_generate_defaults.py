"""``pagedkv generate`` samples with settings that do not loop by default, and passes the new options on;
``pagedkv serve`` resolves its default sampling from the same defaults, the GGUF file and the operator."""

from __future__ import annotations

import logging

import pytest

from pagedkv_rs.cli import serve as cli_serve
from pagedkv_rs.cli.generate import build_parser
from pagedkv_rs.cli.sampling_defaults import GENERATE_DEFAULTS, GGUF_KEYS, from_gguf, parse_override, resolve


def test_defaults_are_not_greedy_without_a_penalty():
    a = build_parser().parse_args(["hi"])
    assert (a.temperature, a.top_p, a.repetition_penalty, a.min_p, a.stop) == (0.2, 0.9, 1.1, 0.0, None)
    assert (a.temperature, a.top_p, a.repetition_penalty) == tuple(
        GENERATE_DEFAULTS[k] for k in ("temperature", "top_p", "repetition_penalty")
    )


def test_sampling_options_parse():
    a = build_parser().parse_args(
        ["hi", "--temperature", "0", "--repetition-penalty", "1", "--stop", "\n", "--stop", "END", "--min-p", "0.05"]
    )
    assert (a.temperature, a.repetition_penalty, a.stop, a.min_p) == (0.0, 1.0, ["\n", "END"], 0.05)


def test_gguf_keys_are_llama_cpps():
    import gguf

    k = gguf.Keys.General
    assert GGUF_KEYS == {
        k.SAMPLING_TEMP: "temperature",
        k.SAMPLING_TOP_P: "top_p",
        k.SAMPLING_TOP_K: "top_k",
        k.SAMPLING_MIN_P: "min_p",
        k.SAMPLING_PENALTY_REPEAT: "repetition_penalty",
    }


def test_from_gguf_maps_the_keys_and_names_the_samplers_it_cannot_run(caplog):
    meta = {
        "general.name": "x",
        "general.sampling.temp": 0.6,
        "general.sampling.top_k": 20,
        "general.sampling.penalty_repeat": 1.05,
        "general.sampling.xtc_probability": 0.5,
    }
    with caplog.at_level(logging.WARNING, logger="pagedkv_rs"):
        assert from_gguf(meta) == {"temperature": 0.6, "top_k": 20, "repetition_penalty": 1.05}
    assert "general.sampling.xtc_probability" in caplog.text
    assert from_gguf({"general.name": "x"}) == {}
    with pytest.raises(ValueError, match="GGUF key general.sampling.top_k: top_k must be an integer"):
        from_gguf({"general.sampling.top_k": 2.5})


def test_precedence_operator_over_gguf_over_generate_defaults():
    gguf = {"temperature": 0.6, "top_k": 20}
    assert resolve({}, {}) == GENERATE_DEFAULTS
    assert resolve({}, gguf) == {**GENERATE_DEFAULTS, "temperature": 0.6, "top_k": 20}
    assert resolve({"temperature": 0.0}, gguf) == {**GENERATE_DEFAULTS, "temperature": 0.0, "top_k": 20}
    assert resolve({"top_p": 0.5}, gguf, use_model_defaults=False) == {"top_p": 0.5}
    with pytest.raises(ValueError, match="top_p"):
        resolve({"top_p": 0.0}, {})


def test_override_json_is_checked():
    assert parse_override('{"temperature": 0, "top_k": 40, "presence_penalty": 0.5}') == {
        "temperature": 0.0,
        "top_k": 40,
        "presence_penalty": 0.5,
    }
    for text, message in (
        ("{", "not valid JSON"),
        ('"x"', "must be a JSON object"),
        ('{"max_new_tokens": 5}', "unknown sampling key 'max_new_tokens'"),
        ('{"top_p": "0.9"}', "top_p must be a number"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_override(text)


def test_serve_options_merge_into_the_defaults():
    p = cli_serve.build_parser()
    meta = {"general.sampling.temp": 0.8, "general.sampling.min_p": 0.05}
    a = p.parse_args(["--override-generation-config", '{"top_k": 5}', "--default-repetition-penalty", "1.0"])
    assert cli_serve.sampling_defaults(a, meta) == {
        "temperature": 0.8,
        "top_p": 0.9,
        "top_k": 5,
        "min_p": 0.05,
        "repetition_penalty": 1.0,
    }
    a = p.parse_args(["--generation-config", "openai", "--default-top-p", "0.95"])
    assert cli_serve.sampling_defaults(a, meta) == {"top_p": 0.95}
    a = p.parse_args(["--default-top-k", "3", "--override-generation-config", '{"top_k": 4}'])
    with pytest.raises(ValueError, match="top_k is set twice"):
        cli_serve.sampling_defaults(a, meta)
