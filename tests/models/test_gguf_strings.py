"""GGUF string arrays (the vocabulary and merge rules) read in one Rust call, and the merge-rule split."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest

from pagedkv_rs import _core
from pagedkv_rs.models.gguf_loader import GGUFError, bundled_model_path, load_gguf
from pagedkv_rs.models.tokenizer import _merge_pairs


def _strings(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<Q", len(s)) + s for s in items)


def _by_hand(buf: bytes, pos: int, count: int) -> tuple[list[str], int]:
    out = []
    for _ in range(count):
        (n,) = struct.unpack_from("<Q", buf, pos)
        out.append(buf[pos + 8 : pos + 8 + n].decode("utf-8"))
        pos += 8 + n
    return out, pos


def test_reads_what_a_struct_loop_reads():
    rng = np.random.default_rng(0)
    alphabet = ["a", "Ġ", "é", "日本", "\x00", " ", "<|im_end|>", "🙂", ""]
    items = ["".join(rng.choice(alphabet, size=rng.integers(0, 6))) for _ in range(500)]
    prefix = b"\x01\x02\x03"
    buf = prefix + _strings([s.encode() for s in items]) + b"tail"
    arr = np.frombuffer(buf, np.uint8)
    got, end = _core.gguf_strings(arr, len(prefix), len(items))
    assert (got, end) == _by_hand(buf, len(prefix), len(items))
    assert got == items and end == len(buf) - 4
    assert _core.gguf_strings(arr, 1, 0) == ([], 1)


@pytest.mark.parametrize(
    "buf, offset, count, message",
    [
        (_strings([b"ab", b"c"]), 0, 3, r"^item 2 needs 8 bytes at offset 19, data has 19$"),
        (_strings([b"ab", b"cd"])[:-1], 0, 2, r"^item 1 needs 2 bytes at offset 18, data has 19$"),
        (struct.pack("<Q", 2**64 - 1), 0, 1, r"^item 0 needs 18446744073709551615 bytes at offset 8, data has 8$"),
        (_strings([b"ok", b"\xff\xfe"]), 0, 2, r"^item 1 is not UTF-8$"),
        (_strings([b"ok"]), 11, 1, r"^item 0 needs 8 bytes at offset 11, data has 10$"),
        (_strings([b"ok"]), 0, 2**40, r"^item 1 needs 8 bytes"),
        (_strings([b"ok"]), -1, 1, r"^offset must be in \[0, 2\*\*40\], got -1$"),
        (_strings([b"ok"]), 0, -1, r"^count must be in \[0, 2\*\*40\], got -1$"),
    ],
)
def test_bad_arrays_raise_value_error_naming_the_item(buf, offset, count, message):
    with pytest.raises(ValueError, match=message):
        _core.gguf_strings(np.frombuffer(buf, np.uint8), offset, count)


def test_bad_arguments_are_type_errors():
    with pytest.raises(TypeError, match="data must be uint8"):
        _core.gguf_strings(np.zeros(16, np.int8), 0, 1)
    with pytest.raises((TypeError, ValueError), match="data"):
        _core.gguf_strings(np.zeros((2, 8), np.uint8), 0, 1)
    with pytest.raises(TypeError):
        _core.gguf_strings(b"\x00" * 8, 0, 1)


def _gguf_with_tokens(items: list[bytes], cut: int = 0) -> bytes:
    """A GGUF v3 header with one metadata key: a string array of ``items`` (then ``cut`` bytes dropped)."""
    key = b"tokenizer.ggml.tokens"
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
    body = struct.pack("<IIQ", 9, 8, len(items)) + _strings(items)
    data = head + body
    return data[: len(data) - cut] if cut else data


def test_a_cut_or_non_utf8_vocabulary_is_a_gguf_error(tmp_path):
    p = tmp_path / "cut.gguf"
    p.write_bytes(_gguf_with_tokens([b"a", b"bc", b"def"], cut=2))
    with pytest.raises(
        GGUFError,
        match=r"cut\.gguf: corrupt or truncated GGUF file \(metadata 'tokenizer\.ggml\.tokens': item 2 needs 3 bytes",
    ):
        load_gguf(p, load_tensors=False)
    p = tmp_path / "bad.gguf"
    p.write_bytes(_gguf_with_tokens([b"a", b"\xc3\x28"]))
    with pytest.raises(
        GGUFError, match=r"bad\.gguf: corrupt GGUF file \(metadata 'tokenizer\.ggml\.tokens': item 1 is not UTF-8\)"
    ):
        load_gguf(p, load_tensors=False)


def test_merge_pairs_split_once_or_rule_by_rule():
    rules = ["Ġ t", "h e", "Ġt he", "1 2"]
    assert _merge_pairs(rules) == [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("1", "2")]
    assert _merge_pairs([]) == []
    # spacing the one split cannot pair: each rule split at its first space, as the tokenizer always did
    odd = ["a b c", "d e"]
    assert _merge_pairs(odd) == [("a", "b c"), ("d", "e")]
    # as many spaces as rules, but one rule has none and one has two: not paired across rules
    assert _merge_pairs(["ab", "c d e"]) == [("ab",), ("c", "d e")]


def test_the_bundled_vocabulary_reads_like_gguf_does():
    ours = load_gguf(None, load_tensors=False).metadata
    r = gguf.GGUFReader(bundled_model_path())
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        f = r.fields[key]
        theirs = [bytes(f.parts[i]).decode("utf-8") for i in f.data]
        assert ours[key] == theirs, key
