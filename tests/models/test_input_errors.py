"""Error paths at the model layer's doors: tokenizer metadata, token ids, chat messages, memory sizes."""

from __future__ import annotations

import pytest

from pagedkv_rs.llm import parse_memory
from pagedkv_rs.models.gguf_loader import GGUFError
from pagedkv_rs.models.tokenizer import GGUFTokenizer


def _meta(gguf_meta, **changes):
    meta = dict(gguf_meta.metadata)
    for k, v in changes.items():
        key = "tokenizer.ggml." + k
        if v is None:
            meta.pop(key, None)
        else:
            meta[key] = v
    return meta


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(model="llama"), r"m\.gguf: tokenizer\.ggml\.scores is missing \(a SentencePiece vocabulary needs it\)"),
        (dict(model=None), r"m\.gguf: tokenizer\.ggml\.model None is not supported \(supported: llama, gpt2, "),
        (dict(tokens=None), r"m\.gguf: tokenizer\.ggml\.tokens is missing or empty"),
        (dict(merges=None), r"m\.gguf: tokenizer\.ggml\.merges is missing \(a BPE vocabulary needs it\)"),
        (dict(pre="qwen9"), r"m\.gguf: tokenizer\.ggml\.pre 'qwen9' is not a supported pre-tokenizer \(supported: "),
    ],
)
def test_tokenizer_metadata_errors_name_the_file_and_the_problem(gguf_meta, changes, message):
    with pytest.raises(GGUFError, match=message):
        GGUFTokenizer(_meta(gguf_meta, **changes), path="/models/m.gguf")


def test_tokenizer_use_errors(tok):
    with pytest.raises(ValueError, match=rf"token id {tok.vocab_size} is out of range for a vocabulary of "):
        tok.decode([1, tok.vocab_size])
    with pytest.raises(ValueError, match="a chat message needs 'role' and 'content' keys, got {'role': 'user'}"):
        tok.apply_chat_template([{"role": "user"}])


def test_a_gguf_without_chat_template_says_so(gguf_meta):
    meta = _meta(gguf_meta)
    del meta["tokenizer.chat_template"]
    t = GGUFTokenizer(meta)
    with pytest.raises(ValueError, match="<gguf> has no tokenizer.chat_template: a chat request needs one"):
        t.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    "value,n", [(4096, 4096), ("512MiB", 512 << 20), ("1.5G", int(1.5 * (1 << 30))), (" 2 KiB ", 2048)]
)
def test_parse_memory(value, n):
    assert parse_memory(value) == n


@pytest.mark.parametrize("value", ["", "12 parsecs", "MiB", "1e3MiB", "-5MiB", "1..5G"])
def test_parse_memory_rejects_what_is_not_a_size(value):
    with pytest.raises(ValueError, match=r"kv_memory must be bytes or a size like '512MiB' or '2G', got "):
        parse_memory(value)


@pytest.mark.parametrize("value", [0, -1, "0MiB", "0.0001B"])
def test_parse_memory_rejects_nothing(value):
    with pytest.raises(ValueError, match=r"kv_memory must be positive, got "):
        parse_memory(value)
