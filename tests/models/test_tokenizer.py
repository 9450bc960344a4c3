"""The GGUF tokenizer: exact round trips, llama.cpp's per-digit split, the chat template, and
Hugging Face's ids for digit-free conversations and texts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedkv_rs.models.tokenizer import GGUFTokenizer, IncrementalDecoder
from session import scaled

SAMPLES = [
    "Hello, world!",
    "The year 2024 had 366 days; pi is 3.14159 and 1,000,000 is a million.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    'for (int i = 0; i < 10; ++i) { printf("%d\\n", i); }',
    "    leading spaces, trailing spaces    ",
    "tabs\t\tand\nnewlines\n\n\n  mixed \t \n whitespace runs",
    "Ünïcödé: naïve café, Straße, 日本語のテキスト, 中文, " "Ελληνικά, русский, עברית, عربى",
    "emoji 🎉🚀👩‍💻 and symbols ∑∫√∞ ≠ ≤ → ©®",
    "mixed1a2b3c 0x1F 1e-9 v2.0.1 #42 @user $3.50 50% 12:30pm",
    "'s 't 're 've 'm 'll 'd — contractions don't won't it's",
    "   ",
    "",
    "a",
    "<|im_start|>user\nliteral special tokens<|im_end|>",
    'JSON: {"key": [1, 2, 3], "nested": {"x": null}}',
    "snake_case_name = __dunder__ + CONSTANT_VALUE",
]


@pytest.fixture(scope="module")
def bpe(tok, gguf_meta):
    """A from-scratch BPE over one pre-token (independent of the tokenizers library): text -> ids."""
    ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(gguf_meta.metadata["tokenizer.ggml.merges"])}

    def run(piece: str) -> list[int]:
        word = [BYTE_CHARS[b] for b in piece.encode("utf-8")]
        while len(word) > 1:
            rank, i = min((ranks.get(pair, len(ranks)), i) for i, pair in enumerate(zip(word, word[1:])))
            if rank == len(ranks):
                break
            word[i : i + 2] = [word[i] + word[i + 1]]
        return [v(tok, w) for w in word]

    return run


def v(tok: GGUFTokenizer, piece: str) -> int:
    """Id of one vocabulary entry (byte-level spelling: 'Ġ' = space, 'Ċ' = newline)."""
    i = tok.token_to_id(piece)
    assert i is not None, piece
    return i


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip_exact(tok, text):
    ids = tok.encode(text)
    assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable-character map (the byte-level alphabet)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


BYTE_CHARS = _byte_chars()


def _representable(tok: GGUFTokenizer, ch: str) -> bool:
    return all(tok.token_to_id(BYTE_CHARS[b]) is not None for b in ch.encode("utf-8"))


@scaled(200)
@given(st.data())
def test_round_trip_any_text(tok, data):
    # 21 rare bytes (C0, C1, F1-FF, a few controls) have no vocabulary entry; like the model's own
    # tokenizer (no unk, no byte fallback) they cannot be encoded. Every other text round-trips.
    text = data.draw(st.text(st.characters(codec="utf-8").filter(lambda c: _representable(tok, c)), max_size=60))
    assert tok.decode(tok.encode(text)) == text


def test_unrepresentable_bytes_are_the_known_few(tok):
    missing = [b for b in range(256) if tok.token_to_id(BYTE_CHARS[b]) is None]
    assert missing == [4, 6, 19, 20, 22, 29, 192, 193, 241, 242, *range(245, 256)]


def test_digits_split_individually(tok):
    for text in SAMPLES:
        for i in tok.encode(text):
            piece = tok.decode([i])
            if any(c.isdigit() for c in piece):
                assert re.fullmatch(r"\d", piece), (text, piece)
    assert tok.encode("2024") == [v(tok, "2"), v(tok, "0"), v(tok, "2"), v(tok, "4")]
    # the space before a number stays its own piece, as in llama.cpp's smollm pre-tokenizer
    assert tok.encode("x 42") == [v(tok, "x"), v(tok, "Ġ"), v(tok, "4"), v(tok, "2")]


def test_known_encodings(tok):
    assert tok.encode("Hello world") == [v(tok, "Hello"), v(tok, "Ġworld")]


@pytest.mark.parametrize("text", [t for t in SAMPLES if "<|" not in t])
def test_matches_reference_bpe(tok, bpe, text):
    # Pre-tokenize as llama.cpp's smollm rule (digits alone, then the GPT-2 regex), BPE each piece.
    # \p{L} ~ [^\W\d_], \p{N} ~ \d, [^\s\p{L}\p{N}] ~ (?:[^\s\w]|_) in Python's re
    gpt2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+"""
    pieces = [
        p
        for chunk in re.split(r"(\d)", text)
        if chunk
        for p in ([chunk] if chunk.isdigit() else re.findall(gpt2, chunk))
    ]
    assert "".join(pieces) == text
    assert tok.encode(text) == [i for p in pieces for i in bpe(p)]
    # GPT-2 regex: \s+(?!\S) takes "\n" (the next char is space), then "\n" alone before "b"
    assert tok.encode("a\n\nb") == [v(tok, "a"), v(tok, "Ċ"), v(tok, "Ċ"), v(tok, "b")]
    assert tok.encode("a\n\n") == [v(tok, "a"), v(tok, "ĊĊ")]


def test_special_tokens(tok):
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tok.encode("<|im_start|><|im_end|><|endoftext|>") == [1, 2, 0]
    assert tok.decode([1, v(tok, "hi"), 2], skip_special_tokens=True) == "hi"
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([tok.vocab_size])


# Chat template: expected text written out from the GGUF's template by hand; expected ids from
# vocabulary pieces (digit-free conversations, as transformers' apply_chat_template would give).


def test_chat_template_with_system_message(tok, bpe):
    msgs = [
        {"role": "system", "content": "You are a brief assistant"},
        {"role": "user", "content": "Say hello"},
    ]
    assert tok.render_chat_template(msgs) == (
        "<|im_start|>system\nYou are a brief assistant<|im_end|>\n"
        "<|im_start|>user\nSay hello<|im_end|>\n<|im_start|>assistant\n"
    )
    nl = v(tok, "Ċ")
    expected = (
        [1, v(tok, "system"), nl, v(tok, "You"), v(tok, "Ġare"), v(tok, "Ġa"), *bpe(" brief"), *bpe(" assistant")]
        + [2, nl, 1, v(tok, "user"), nl, v(tok, "Say"), v(tok, "Ġhello"), 2, nl]
        + [1, *bpe("assistant"), nl]
    )
    assert tok.apply_chat_template(msgs) == expected
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == expected[: -2 - len(bpe("assistant"))]


def test_chat_template_default_system_prompt_multi_turn(tok, bpe):
    msgs = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello there"},
        {"role": "user", "content": "Thanks"},
    ]
    default_sys = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert tok.render_chat_template(msgs) == (
        f"<|im_start|>system\n{default_sys}<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello there<|im_end|>\n"
        "<|im_start|>user\nThanks<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    nl = v(tok, "Ċ")
    expected = (
        [1, *bpe("system"), nl]
        # pre-tokens by the GPT-2 rule: a word keeps its leading space, punctuation splits off
        + [
            t
            for w in [
                "You",
                " are",
                " a",
                " helpful",
                " AI",
                " assistant",
                " named",
                " SmolLM",
                ",",
                " trained",
                " by",
                " Hugging",
                " Face",
            ]
            for t in bpe(w)
        ]
        + [2, nl]
        + [1, v(tok, "user"), nl, v(tok, "Hi"), 2, nl]
        + [1, *bpe("assistant"), nl, *bpe("Hello"), *bpe(" there"), 2, nl]
        + [1, v(tok, "user"), nl, *bpe("Thanks"), 2, nl]
        + [1, *bpe("assistant"), nl]
    )
    assert tok.apply_chat_template(msgs) == expected


def test_chat_template_rejects_bad_messages(tok):
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat_template([{"content": "no role"}])


def test_incremental_decoder_holds_back_partial_utf8(tok):
    text = "naïve 🎉 done"
    ids = tok.encode(text)
    dec = IncrementalDecoder(tok)
    pieces = [dec.push([i]) for i in ids]
    assert "".join(pieces) == text == dec.text
    assert all("\ufffd" not in p for p in pieces)
    assert pieces.count("") >= 2  # the emoji's bytes span several tokens: held back, then emitted whole
    dec2 = IncrementalDecoder(tok)
    assert dec2.push(ids[:3]) + dec2.push(ids[3:]) == text


# ---- against Hugging Face (golden ids from tests/models/data/make_hf_golden.py, transformers 4.46.3) ----

HF_GOLDEN = json.loads((Path(__file__).parent / "data" / "hf_golden.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("case", HF_GOLDEN["chat"], ids=lambda c: c["messages"][-1]["content"][:24])
def test_chat_template_ids_equal_hugging_face(tok, case):
    assert tok.apply_chat_template(case["messages"], add_generation_prompt=True) == case["ids"]


@pytest.mark.parametrize("case", HF_GOLDEN["encode"], ids=lambda c: c["text"][:24])
def test_encode_equals_hugging_face(tok, case):
    assert tok.encode(case["text"]) == case["ids"]
