"""Byte-level BPE tokenizer and chat template, built from a GGUF file's own metadata.

The ``tokenizers`` library does the BPE; the pre-tokenizer follows ``tokenizer.ggml.pre``.
For ``"qwen2"`` it is Qwen2's own split regex (as its ``tokenizer.json``); for ``"smollm"`` (and the
other llama.cpp pre-tokenizers that split numbers per digit)
digits are split one by one *before* the GPT-2 byte-level regex, as llama.cpp and the
model's original ``tokenizer.json`` do (Hugging Face's GGUF conversion drops that rule).
The chat template is rendered the way ``transformers`` does: a sandboxed jinja2
environment with ``trim_blocks``/``lstrip_blocks`` and a ``raise_exception`` global.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional

from pagedkv_rs.models.gguf_loader import GGUFError, GGUFFile, load_gguf

__all__ = ["GGUFTokenizer", "IncrementalDecoder"]

# llama.cpp pre-tokenizer names whose regex splits digits individually (\p{N} alone) before
# the GPT-2 rules. Everything else byte-level uses the plain GPT-2 split.
_DIGIT_PRE = {"smollm", "starcoder", "refact", "command-r", "deepseek-coder", "codeshell"}
# Qwen2's own split (llama.cpp LLAMA_VOCAB_PRE_TYPE_QWEN2, the model's tokenizer.json): case-insensitive
# contractions, a letter run with at most one leading non-letter, single digits, punctuation runs.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_PRE = {"gpt2", "default", "gpt-2", "olmo", "jais", "stablelm2", "mpt", "phi-2", "poro-chat"}
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

Message = Mapping[str, Any]


def _merge_pairs(merges: Sequence[str]) -> list[tuple[str, ...]]:
    """``"a b"`` merge rules as ``(a, b)`` pairs. Byte-level tokens hold no space, so when every rule has
    exactly one (n rules, n spaces inside them, none without), one split of the joined rules gives every
    pair at once; rules spaced otherwise are split one by one at their first space, as before."""
    words = " ".join(merges).split(" ")
    if len(words) == 2 * len(merges) and all(map(str.__contains__, merges, itertools.repeat(" "))):
        it = iter(words)
        return list(zip(it, it))
    return [tuple(m.split(" ", 1)) for m in merges]


class GGUFTokenizer:
    """``encode(text) -> list[int]``, ``decode(ids) -> str`` and ``apply_chat_template(messages)``."""

    def __init__(self, metadata: Mapping[str, Any], *, path: str = "<gguf>"):
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

        kind = metadata.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise GGUFError(f"{path}: tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')")
        tokens = metadata.get("tokenizer.ggml.tokens")
        merges = metadata.get("tokenizer.ggml.merges")
        if not tokens or merges is None:
            raise GGUFError(f"{path}: tokenizer tokens or merges are missing from the metadata")
        pre = str(metadata.get("tokenizer.ggml.pre", "default"))
        if pre not in _DIGIT_PRE and pre not in _GPT2_PRE and pre != "qwen2":
            raise GGUFError(f"{path}: pre-tokenizer {pre!r} is not supported")
        types = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        self._tokens: list[str] = list(tokens)
        vocab = {t: i for i, t in enumerate(self._tokens)}
        pairs = _merge_pairs(merges)
        tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre == "qwen2":
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        elif pre in _DIGIT_PRE:
            tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        else:
            tok.pre_tokenizer = byte_level
        tok.decoder = decoders.ByteLevel()
        specials = [i for i, t in enumerate(types) if t in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)]
        tok.add_special_tokens([AddedToken(self._tokens[i], special=True, normalized=False) for i in specials])
        self._tok = tok
        self.special_ids: frozenset[int] = frozenset(specials)
        self.vocab_size = len(self._tokens)
        self.bos_token_id: Optional[int] = _opt_int(metadata.get("tokenizer.ggml.bos_token_id"))
        self.eos_token_id: Optional[int] = _opt_int(metadata.get("tokenizer.ggml.eos_token_id"))
        self.add_bos_token = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
        self.chat_template: Optional[str] = metadata.get("tokenizer.chat_template")
        self._template: Any = None

    @classmethod
    def from_gguf(cls, gguf: Any = None) -> GGUFTokenizer:
        """Build from a ``GGUFFile``, a path, or ``None`` (the bundled SmolLM2)."""
        g = gguf if isinstance(gguf, GGUFFile) else load_gguf(gguf, load_tensors=False)
        return cls(g.metadata, path=g.path)

    @property
    def bos_token(self) -> str:
        return self._tokens[self.bos_token_id] if self.bos_token_id is not None else ""

    @property
    def eos_token(self) -> str:
        return self._tokens[self.eos_token_id] if self.eos_token_id is not None else ""

    def token_to_id(self, token: str) -> Optional[int]:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        return self._tokens[token_id]

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special-token strings in it become their ids."""
        ids = list(self._tok.encode(text, add_special_tokens=False).ids)
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(e.ids) for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; bytes that do not form whole UTF-8 characters decode as U+FFFD."""
        out = [int(i) for i in ids]
        for i in out:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is out of range for a vocabulary of {self.vocab_size}")
        return self._tok.decode(out, skip_special_tokens=skip_special_tokens)

    def render_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        """The chat template rendered as text (what ``apply_chat_template(..., tokenize=False)`` gives)."""
        if self.chat_template is None:
            raise ValueError("this GGUF has no tokenizer.chat_template; pass token ids or raw prompts instead")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        for m in messages:
            if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
                raise ValueError(f"a chat message needs 'role' and 'content' keys, got {m!r}")
        return str(
            self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        )

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered chat template (special tokens come from the template text)."""
        return self.encode(self.render_chat_template(messages, add_generation_prompt))


def _opt_int(v: Any) -> Optional[int]:
    return None if v is None else int(v)


def _compile_template(source: str) -> Any:
    # As transformers' _compile_jinja_template does.
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas, holding back incomplete UTF-8.

    Each push decodes only the tokens since the last character boundary (plus that window's
    start), so streaming costs O(new tokens), not O(all tokens).
    """

    def __init__(self, tokenizer: GGUFTokenizer, *, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens whose text has been emitted
        self.text = ""

    def push(self, token_ids: Iterable[int]) -> str:
        """Add new tokens; return the text that is now final."""
        self._ids.extend(int(t) for t in token_ids)
        done = self._tok.decode(self._ids[self._prefix : self._read], skip_special_tokens=self._skip)
        full = self._tok.decode(self._ids[self._prefix :], skip_special_tokens=self._skip)
        if full.endswith("\ufffd"):  # a multi-byte character is still arriving
            return ""
        delta = full[len(done) :]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta
