"""The tokenizer of a GGUF file, token for token as llama.cpp's (src/llama-vocab.cpp), built on ``tokenizers``.

``vocab.read_vocab`` reads the metadata as llama.cpp does; here it becomes a ``tokenizers.Tokenizer``:

- SentencePiece (``tokenizer.ggml.model == "llama"``): a ``models.BPE`` whose merges are every pair of tokens
  that concatenates to a token, ranked by that token's score (llama.cpp merges the highest-scoring pair first,
  the leftmost on a tie), with byte fallback to ``<0xXX>``; spaces become U+2581 and, with ``add_space_prefix``,
  every text fragment (the text's start and the text after each special token) gets one in front.
- byte-level BPE (``"gpt2"``): the file's merges over GPT-2's byte alphabet, after llama.cpp's split regexes for
  ``tokenizer.ggml.pre`` (``vocab.PRE_TOKENIZERS``).
- Gemma 4 (``"gemma4"``): BPE over raw UTF-8 with U+2581 for spaces, split into newline runs, byte fallback.
- BERT WordPiece (``"bert"``): greedy longest match after llama.cpp's lowercasing / accent stripping split.

Special tokens: control and unknown tokens become their ids only when ``parse_special`` (llama.cpp's flag; our
default, since chat templates write them as text); user-defined tokens always do. ``decode`` is llama.cpp's
detokenizer: each token's piece (control tokens rendered unless skipped, ``<0xXX>`` as that byte, U+2581 as a
space), the first token's leading space dropped for SentencePiece, and llama.cpp's ``clean_spaces`` rules where
the vocabulary asks for them. The chat template is rendered in ``chat_template.py``.
"""

from __future__ import annotations

import functools
import itertools
import re
import threading
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional

from pagedkv_rs.models.chat_template import ChatTemplate, ChatTemplateError, Message
from pagedkv_rs.models.gguf_loader import GGUFError, GGUFFile, PathLike, _parse, bundled_model_path
from pagedkv_rs.models.vocab import GPT2, Attr, Vocab, read_vocab, special_token_ids

__all__ = ["GGUFTokenizer", "IncrementalDecoder"]

SPACE = "\u2581"  # SentencePiece's visible space
_LONG_TEXT = 4096  # characters from which encode goes through encode_batch, which releases the GIL


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the alphabet of byte-level BPE tokens)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_BYTE_OF_CHAR = {c: b for b, c in _byte_alphabet().items()}


def _merge_pairs(merges: Sequence[str]) -> list[tuple[str, ...]]:
    """``"a b"`` rules as pairs, split at the first space after the first character (as llama.cpp does); a rule
    with no such space stays whole (a 1-tuple, which no tokenizer can apply)."""
    words = " ".join(merges).split(" ")
    if len(words) == 2 * len(merges) and all(map(str.__contains__, merges, itertools.repeat(" "))):
        it = iter(words)  # one space in every rule: one split gives every pair at once
        return list(zip(it, it))
    out = []
    for m in merges:
        k = m.find(" ", 1)
        out.append((m[:k], m[k + 1 :]) if k > 0 else (m,))
    return out


def _spm_merges(vocab: Vocab, ids: Mapping[str, int]) -> list[tuple[str, str]]:
    """SentencePiece as BPE: every split of a token into two tokens, best-scored token first, ties by id."""
    scores = vocab.scores
    assert scores is not None
    ranked: list[tuple[float, int, int]] = []
    for t, i in ids.items():
        for k in range(1, len(t)):
            if t[:k] in ids and t[k:] in ids:
                ranked.append((-scores[i], i, k))
    ranked.sort()
    toks = vocab.tokens
    return [(toks[i][:k], toks[i][k:]) for _, i, k in ranked]


def _build(vocab: Vocab, parse_special: bool) -> Any:
    """The ``tokenizers.Tokenizer`` that encodes as llama.cpp does (one per ``parse_special`` value)."""
    from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers

    ids = {t: i for i, t in enumerate(vocab.tokens)}
    if vocab.model == "llama":
        unk = vocab.tokens[vocab.unk_id] if vocab.unk_id is not None else None
        tok = Tokenizer(
            models.BPE(vocab=ids, merges=_spm_merges(vocab, ids), unk_token=unk, byte_fallback=True, fuse_unk=False)
        )
        steps = [normalizers.Replace(" ", SPACE)]
        if vocab.add_space_prefix:
            steps.insert(0, normalizers.Prepend(SPACE))
        tok.normalizer = normalizers.Sequence(steps)
    elif vocab.model == "bert":
        tok = _wordpiece(vocab)
    else:
        pre = vocab.pre_tokenizer
        assert pre is not None and vocab.merges is not None
        pairs = _merge_pairs(vocab.merges)
        byte_level = vocab.byte_level

        lost = "<|pagedkv:lost-byte|>" if _lost_bytes(vocab, ids) else None
        bpe_vocab = {**ids, lost: len(ids)} if lost else ids

        def bpe(pairs: list[tuple[str, ...]]) -> Any:
            return models.BPE(
                vocab=bpe_vocab,
                merges=pairs,
                byte_fallback=not byte_level,
                fuse_unk=False,
                unk_token=lost,
                ignore_merges=pre.ignore_merges,
            )

        try:
            model = bpe(pairs)
        except Exception:  # a rule whose parts or result are not tokens: llama.cpp never completes it either
            model = bpe([p for p in pairs if len(p) == 2 and p[0] in ids and p[1] in ids and p[0] + p[1] in ids])
        tok = Tokenizer(model)
        regexes = list(pre.regexes)
        last: list[Any] = []
        if byte_level:  # GPT-2's own split is built into ByteLevel (one pass instead of two)
            use_regex = regexes[-1:] == [GPT2]
            last = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)]
            regexes = regexes[:-1] if use_regex else regexes
        splits = [
            pre_tokenizers.Digits(individual_digits=True)  # \p{N} alone, without a regex
            if r == r"\p{N}"
            else pre_tokenizers.Split(Regex(r), behavior="isolated")
            for r in regexes
        ]
        if vocab.escape_whitespaces:
            tok.normalizer = normalizers.Replace(" ", SPACE)
        tok.pre_tokenizer = pre_tokenizers.Sequence(splits + last)
    ctl, user = special_token_ids(vocab)

    def added(i: int, special: bool) -> Any:  # lstrip / rstrip: see _strip_pattern
        return AddedToken(vocab.tokens[i], special=special, normalized=False)

    tok.add_special_tokens([added(i, True) for i in ctl])
    tok.add_tokens([added(i, False) for i in user])
    # special (control / unknown) tokens stay text when parse_special is off; user-defined ones always split
    tok.encode_special_tokens = not parse_special
    return tok


def _wordpiece(vocab: Vocab) -> Any:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    # llama.cpp's BERT vocabulary marks a word's first piece with U+2581 and leaves continuations bare;
    # WordPiece wants the opposite: bare first pieces, "##" continuations.
    wp = {}
    for i, t in enumerate(vocab.tokens):
        if vocab.attrs[i] & (Attr.CONTROL | Attr.UNKNOWN | Attr.USER_DEFINED):
            wp[t] = i
        elif t.startswith(SPACE):
            wp.setdefault(t[1:], i)
        else:
            wp.setdefault("##" + t, i)
    unk = vocab.tokens[vocab.unk_id] if vocab.unk_id is not None else "[UNK]"
    tok = Tokenizer(models.WordPiece(vocab=wp, unk_token=unk, max_input_chars_per_word=1 << 30))
    tok.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=True, lowercase=True
    )
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    return tok


# GPT-2's printable alphabet back to bytes, as str.translate table (then latin-1 gives the bytes)
_UNBYTE = {ord(c): b for c, b in _BYTE_OF_CHAR.items()}


def _unbyte_marked(t: str) -> bytes:
    """llama.cpp's ``llama_decode_text`` for a token with characters outside the byte alphabet: each such
    character becomes ``[UNK_BYTE_0x<its UTF-8 hex><the token's text>]``."""
    out = b""
    for c in t:
        if c in _BYTE_OF_CHAR:
            out += bytes([_BYTE_OF_CHAR[c]])
        else:
            out += b"[UNK_BYTE_0x" + c.encode().hex().encode() + t.encode() + b"]"
    return out


@functools.lru_cache(maxsize=1)
def _nfd_first() -> dict[int, str]:
    """llama.cpp's BERT "NFD": each code point becomes the first code point of its decomposition (so accents and
    Hangul vowels and finals vanish), as a ``str.translate`` table."""
    table = {}
    for cp in range(0x80, 0x110000):
        if 0xD800 <= cp <= 0xDFFF:
            continue
        d = unicodedata.normalize("NFD", chr(cp))
        if d[0] != chr(cp):
            table[cp] = d[0]
    # whitespace to llama.cpp, control characters to transformers' BertNormalizer (which would drop them)
    table.update({0x0B: " ", 0x0C: " ", 0x85: " "})
    return table


def _pieces(vocab: Vocab) -> tuple[list[bytes], list[bytes]]:
    """Each token's text as llama.cpp's ``token_to_piece`` gives it: with control tokens rendered, and without."""
    out = []
    for t, a in zip(vocab.tokens, vocab.attrs):
        if a & (Attr.CONTROL | Attr.UNKNOWN | Attr.USER_DEFINED):
            out.append(t.encode())
        elif a & Attr.NORMAL:
            if vocab.byte_level:
                try:
                    out.append(t.translate(_UNBYTE).encode("latin-1"))
                except UnicodeEncodeError:  # a character outside the byte alphabet
                    out.append(_unbyte_marked(t))
            else:
                out.append(t.replace(SPACE, " ").encode())
        elif a & Attr.BYTE:
            out.append(bytes([int(t[3:5], 16)]) if t.startswith("<0x") and len(t) == 6 else t.encode())
        else:
            out.append(b"")
    plain = list(out)
    for i, a in enumerate(vocab.attrs):
        if a & (Attr.CONTROL | Attr.UNKNOWN):
            plain[i] = b""
    return out, plain


def _strip_pattern(vocab: Vocab, parse_special: bool) -> Optional[re.Pattern[str]]:
    """The whitespace llama.cpp's lstrip / rstrip special tokens swallow (ASCII ``isspace`` only, where
    ``tokenizers`` would take any Unicode space): ``sub(_strip_sub, text)`` drops it before encoding."""
    ctl, user = special_token_ids(vocab)
    ids = (ctl + user) if parse_special else user
    left = sorted((vocab.tokens[i] for i in ids if vocab.attrs[i] & Attr.LSTRIP), key=len, reverse=True)
    right = sorted((vocab.tokens[i] for i in ids if vocab.attrs[i] & Attr.RSTRIP), key=len, reverse=True)
    alts = []
    if left:
        alts.append(rf"[ \t\n\v\f\r]+(?P<l>{'|'.join(map(re.escape, left))})")
    if right:
        alts.append(rf"(?P<r>{'|'.join(map(re.escape, right))})[ \t\n\v\f\r]+")
    return re.compile("|".join(alts)) if alts else None


def _lost_bytes(vocab: Vocab, ids: Mapping[str, int]) -> list[int]:
    """ASCII characters a byte-level vocabulary has no token for. llama.cpp keeps such a character as a symbol
    (nothing merges across it) and drops it at the end; here it becomes a stand-in token id ``len(vocab)``
    (the BPE model's unknown token) that ``encode`` removes."""
    alphabet = _byte_alphabet()
    return [b for b in range(128) if vocab.byte_level and alphabet[b] not in ids]


def _lost_chars(vocab: Vocab) -> str:
    return "".join(map(chr, _lost_bytes(vocab, set(vocab.tokens))))  # type: ignore[arg-type]


def _lost_pattern(vocab: Vocab) -> Optional[re.Pattern[str]]:
    lost = _lost_bytes(vocab, set(vocab.tokens))  # type: ignore[arg-type]
    return re.compile("[" + "".join(f"\\x{b:02x}" for b in lost) + "]") if lost else None


def _strip_sub(m: re.Match[str]) -> str:
    g = m.groupdict()
    return g.get("l") or g.get("r") or ""


# llama.cpp's clean_spaces passes, in order: " ?" " !" " ." " ," lose the space; " ' " becomes "'";
# " 's" " 'm" " 're" " 've" lose the space.
_CLEAN = (
    (re.compile(rb" (?=[?!.,])"), b""),
    (re.compile(rb" ' "), b"'"),
    (re.compile(rb" '(?=[sm]|re|ve)"), b"'"),
)
# Text ending like this may still change when more text follows (the start of a clean_spaces pattern).
_CLEAN_OPEN = (b" ", b" '", b" 'r", b" 'v")


def _clean_spaces(b: bytes) -> bytes:
    for rx, rep in _CLEAN:
        b = rx.sub(rep, b)
    return b


def _read_metadata(path: Optional[PathLike]) -> tuple[str, dict[str, Any]]:
    """A GGUF file's metadata only: enough for a vocabulary-only file (no tensors, no architecture)."""
    import mmap
    import os

    spath = bundled_model_path() if path is None else os.fspath(path)
    if not os.path.isfile(spath):
        raise GGUFError(f"{spath}: no such GGUF file")
    with open(spath, "rb") as fh:
        if fh.read(4) != b"GGUF":
            raise GGUFError(f"{spath}: not a GGUF file")
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            meta, _, _ = _parse(spath, mm)
    return spath, meta


class GGUFTokenizer:
    """``encode(text) -> list[int]``, ``decode(ids) -> str`` and ``apply_chat_template(messages)``."""

    def __init__(self, metadata: Mapping[str, Any], *, path: str = "<gguf>"):
        self.vocab: Vocab = read_vocab(metadata, path)
        v = self.vocab
        self._tokens = v.tokens
        self._ids = {t: i for i, t in enumerate(v.tokens)}
        try:
            self._tok = _build(v, parse_special=True)
        except Exception as e:  # tokenizers raises plain Exceptions for a bad regex or merge table
            raise GGUFError(f"{path}: the tokenizer cannot be built from this vocabulary ({e})") from e
        self._tok_plain: Any = None  # parse_special=False twin, built on first use
        self._prenorm = _nfd_first() if v.model == "bert" else None
        self._strip = {p: _strip_pattern(v, p) for p in (False, True)}
        self._lost = _lost_pattern(v)
        self._lock = threading.Lock()
        self._pieces, self._pieces_plain = _pieces(v)
        # the most text bytes one token can stand for (a piece, or an unknown character): 0 for WordPiece,
        # whose [UNK] takes a whole word; characters that make no token (lost) or that a special token's
        # lstrip / rstrip swallows (ASCII whitespace) are not counted
        self._max_piece_bytes = 0 if v.model == "bert" else max(4, max(map(len, self._pieces), default=0))
        free = set(_lost_chars(v)) | (set(" \t\n\v\f\r") if any(self._strip.values()) else set())
        self._free_chars = "".join(sorted(free))
        ctl, user = special_token_ids(v)
        self.special_ids: frozenset[int] = frozenset(ctl + user)
        self.eog_token_ids: frozenset[int] = v.eog_ids
        self.vocab_size = len(v.tokens)
        self.bos_token_id: Optional[int] = v.bos_id
        self.eos_token_id: Optional[int] = v.eos_id
        self.add_bos_token = v.add_bos
        self.add_eos_token = v.add_eos
        self.chat_template: Optional[str] = metadata.get("tokenizer.chat_template")
        self._template: Optional[ChatTemplate] = None
        self.path = path

    @classmethod
    def from_gguf(cls, gguf: Any = None) -> GGUFTokenizer:
        """Build from a ``GGUFFile``, a path (a vocabulary-only GGUF will do), or ``None`` (the bundled SmolLM2)."""
        if isinstance(gguf, GGUFFile):
            return cls(gguf.metadata, path=gguf.path)
        path, meta = _read_metadata(gguf)
        return cls(meta, path=path)

    @property
    def bos_token(self) -> str:
        return self._tokens[self.bos_token_id] if self.bos_token_id is not None else ""

    @property
    def eos_token(self) -> str:
        return self._tokens[self.eos_token_id] if self.eos_token_id is not None else ""

    def token_to_id(self, token: str) -> Optional[int]:
        return self._ids.get(token)

    def id_to_token(self, token_id: int) -> str:
        return self._tokens[token_id]

    def _encoder(self, parse_special: bool) -> Any:
        if parse_special:
            return self._tok
        if self._tok_plain is None:
            with self._lock:
                if self._tok_plain is None:
                    self._tok_plain = _build(self.vocab, parse_special=False)
        return self._tok_plain

    def _prepare(self, text: str, parse_special: bool) -> str:
        """What llama.cpp does to the text that ``tokenizers`` cannot: BERT's per-code-point NFD, and the
        whitespace lstrip / rstrip special tokens swallow."""
        if self._prenorm is not None:
            text = text.translate(self._prenorm)
        rx = self._strip[parse_special]
        return text if rx is None else rx.sub(_strip_sub, text)

    def _specials(self, ids: list[int], add_special_tokens: bool) -> list[int]:
        v = self.vocab
        if add_special_tokens:
            if v.add_bos and v.bos_id is not None:
                ids.insert(0, v.bos_id)
            if v.add_eos and v.eos_id is not None:
                ids.append(v.eos_id)
            if v.add_sep and v.sep_id is not None:
                ids.append(v.sep_id)
        return ids

    def min_num_tokens(self, text: str) -> int:
        """A lower bound of ``len(encode(text))`` that costs no encoding: the text's bytes over the most bytes one
        token stands for (0 when the vocabulary has no such bound). Bounds a prompt before it is tokenized."""
        if not self._max_piece_bytes:
            return 0
        n = len(text.encode("utf-8", "surrogatepass")) - sum(map(text.count, self._free_chars))
        return max(0, -(-n // self._max_piece_bytes))

    def encode(self, text: str, *, add_special_tokens: bool = False, parse_special: bool = True) -> list[int]:
        """Token ids of ``text`` (llama.cpp's ``llama_tokenize(text, add_special, parse_special)``).

        ``add_special_tokens``: BOS / EOS as the vocabulary asks (``tokenizer.ggml.add_bos_token`` ...);
        ``parse_special``: control-token strings in the text become their ids (user-defined ones always do).
        """
        text = self._prepare(text, parse_special)
        if self._lost is not None and self._lost.search(text):
            return self._specials(self._encode_around_lost(text, parse_special), add_special_tokens)
        ids = list(self._ids_of(text, parse_special))
        return self._specials(ids, add_special_tokens)

    def _ids_of(self, text: str, parse_special: bool) -> Any:
        """``tokenizers``' ids of a prepared text. ``Tokenizer.encode`` holds the GIL for the whole text (seconds
        for megabytes: every other thread, the server's event loop too, stops); ``encode_batch`` releases it."""
        enc = self._encoder(parse_special)
        if len(text) < _LONG_TEXT:
            return enc.encode(text).ids
        return enc.encode_batch([text], add_special_tokens=False)[0].ids

    def _encode_around_lost(self, text: str, parse_special: bool) -> list[int]:
        ids = self._ids_of(text, parse_special)
        return [i for i in ids if i != self.vocab_size]  # the lost characters' stand-in

    def encode_batch(
        self, texts: Sequence[str], *, add_special_tokens: bool = False, parse_special: bool = True
    ) -> list[list[int]]:
        """``encode`` of each text, in parallel inside ``tokenizers``."""
        batch = [self._prepare(t, parse_special) for t in texts]
        encs = self._encoder(parse_special).encode_batch(batch, add_special_tokens=False)
        out = [list(e.ids) for e in encs]
        if self._lost is not None:
            for k, t in enumerate(batch):
                if self._lost.search(t):
                    out[k] = self._encode_around_lost(t, parse_special)
        return [self._specials(ids, add_special_tokens) for ids in out]

    def _detokenize(self, ids: list[int], skip_special_tokens: bool, first: bool) -> bytes:
        """llama.cpp's detokenizer before UTF-8 decoding (``first``: ids start the text)."""
        n = self.vocab_size
        if ids and (min(ids) < 0 or max(ids) >= n):
            bad = next(i for i in ids if not 0 <= i < n)
            raise ValueError(f"token id {bad} is out of range for a vocabulary of {n}")
        table = self._pieces_plain if skip_special_tokens else self._pieces
        out = b"".join(map(table.__getitem__, ids))
        if first and ids and self.vocab.add_space_prefix and table[ids[0]].startswith(b" "):
            out = out[1:]  # llama.cpp's remove_space: the first token's leading space
        if self.vocab.clean_spaces:
            out = _clean_spaces(out)
        return out

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False, continuation: bool = False) -> str:
        """Text of ``ids`` (llama.cpp's ``llama_detokenize``); bytes that do not form UTF-8 decode as U+FFFD.

        ``continuation``: the ids continue a text (a generation after its prompt), so a SentencePiece
        vocabulary's first token keeps its leading space, as llama.cpp's ``token_to_piece`` stream does.
        """
        ids = [int(i) for i in ids]
        return self._detokenize(ids, skip_special_tokens, not continuation).decode("utf-8", "replace")

    def render_chat_template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        *,
        tools: Optional[Sequence[Mapping[str, Any]]] = None,
        **kwargs: Any,
    ) -> str:
        """The chat template rendered as text (what ``apply_chat_template(..., tokenize=False)`` gives).

        ``kwargs`` reach the template as variables (e.g. ``date_string``, ``enable_thinking``).
        """
        if self.chat_template is None:
            raise ChatTemplateError(
                f"{self.path} has no tokenizer.chat_template: a chat request needs one; send a raw prompt "
                "(completion) or token ids instead"
            )
        if self._template is None:
            self._template = ChatTemplate(self.chat_template)
        return self._template.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **kwargs,
        )

    def apply_chat_template(
        self, messages: Sequence[Message], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """Token ids of the rendered chat template, as llama.cpp's chat path makes them: special tokens come from
        the template text, and BOS / EOS as the vocabulary adds them (a BOS the template writes is not doubled)."""
        text = self.render_chat_template(messages, add_generation_prompt, **kwargs)
        v = self.vocab
        if v.add_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token) :]
        if v.add_eos and self.eos_token and text.endswith(self.eos_token):
            text = text[: -len(self.eos_token)]
        return self.encode(text, add_special_tokens=True)


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas whose concatenation is ``decode(ids, continuation=...)``.

    Each push decodes only the tokens since the last emitted boundary (plus that window's start), so streaming
    costs O(new tokens), not O(all tokens). Text is held back while it ends inside a multi-byte character or,
    for vocabularies with llama.cpp's ``clean_spaces``, in a space that later text may remove; ``flush()``
    returns what is held at the end of a stream.
    """

    def __init__(self, tokenizer: GGUFTokenizer, *, skip_special_tokens: bool = True, continuation: bool = False):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._continuation = continuation  # as decode(..., continuation=True): keep the first leading space
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens whose text has been emitted
        self.text = ""

    def _window(self, stop: Optional[int]) -> bytes:
        ids = self._ids[self._prefix : stop]
        return self._tok._detokenize(ids, self._skip, self._prefix == 0 and not self._continuation)

    def push(self, token_ids: Iterable[int]) -> str:
        """Add new tokens; return the text that is now final."""
        self._ids.extend(int(t) for t in token_ids)
        full_b = self._window(None)
        if self._tok.vocab.clean_spaces and full_b.endswith(_CLEAN_OPEN):
            return ""  # the next token may still remove this space
        full = full_b.decode("utf-8", "replace")
        if full.endswith("\ufffd"):  # a multi-byte character is still arriving
            return ""
        done = self._window(self._read).decode("utf-8", "replace")
        delta = full[len(done) :]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """The text still held back (call once the stream has ended)."""
        full = self._window(None).decode("utf-8", "replace")
        delta = full[len(self._window(self._read).decode("utf-8", "replace")) :]
        self._prefix = self._read = len(self._ids)
        self.text += delta
        return delta
