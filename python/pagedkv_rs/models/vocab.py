"""A GGUF vocabulary as llama.cpp reads it (``llama_vocab::impl::load`` in src/llama-vocab.cpp), as data.

:func:`read_vocab` turns ``tokenizer.ggml.*`` metadata into a :class:`Vocab`: the tokens, their llama.cpp
attributes (the GGUF token types plus llama.cpp's by-name overrides: end-of-generation and FIM tokens become
control tokens, Phi-3's special tokens strip the whitespace after them), the scores or merges, the special ids and
the flags that steer encoding and decoding (``add_bos``, ``add_space_prefix``, ``clean_spaces``, ...). The
pre-tokenizer of each ``tokenizer.ggml.pre`` is llama.cpp's list of split regexes, each applied to the pieces the
previous one left (matches and the text between them both become pieces), written for Oniguruma, the regex
engine of the ``tokenizers`` library. Nothing here tokenizes: ``tokenizer.py`` builds the tokenizer from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

from pagedkv_rs.models.gguf_loader import GGUFError

__all__ = ["PRE_TOKENIZERS", "TOKENIZER_MODELS", "Attr", "PreTokenizer", "Vocab", "read_vocab", "special_token_ids"]


class Attr:
    """llama.cpp's ``llama_token_attr`` bits."""

    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5
    LSTRIP = 1 << 7
    RSTRIP = 1 << 8


# GGUF token type (tokenizer.ggml.token_type) -> attribute; anything else is "undefined" (0).
_TYPE_ATTR = {1: Attr.NORMAL, 2: Attr.UNKNOWN, 3: Attr.CONTROL, 4: Attr.USER_DEFINED, 5: Attr.UNUSED, 6: Attr.BYTE}

# Token texts llama.cpp marks as control whatever the file says: end-of-generation, end-of-turn and FIM tokens.
_CONTROL_BY_NAME = frozenset(
    [
        # end of generation
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
        "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
        "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
        # fill-in-the-middle
        "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>",
        "<|prefix|>", "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
        "<|code_suffix|>", "<|suffix|>", "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
        "▁<MID>", "<|code_middle|>", "<|middle|>", "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]",
        "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>",
    ]
)  # fmt: skip
# The end-of-generation subset: end-of-turn tokens and the FIM pad / repository / file separators.
_EOG_BY_NAME = frozenset(
    [
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
        "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
        "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
        "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]", "<|fim_repo|>", "<|repo_name|>", "<fim-repo>",
        "<REPO>", "<reponame>", "<|file_sep|>",
    ]
)  # fmt: skip

# ---- pre-tokenizers: llama.cpp's regex lists (llm_tokenizer_bpe), in Oniguruma syntax ----

_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
# GPT-2's split; llama.cpp's hand-written matcher behaves as if it ended in |\s+ (as the original does).
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK_LETTERS = (
    r"A-Za-z\x{B5}\x{C0}-\x{D6}\x{D8}-\x{F6}\x{F8}-\x{1BA}\x{1BC}-\x{1BF}\x{1C4}-\x{293}\x{295}-\x{2AF}"
    r"\x{370}-\x{373}\x{376}\x{377}\x{37B}-\x{37D}\x{37F}\x{386}\x{388}-\x{38A}\x{38C}\x{38E}-\x{3A1}"
    r"\x{3A3}-\x{3F5}\x{3F7}-\x{481}\x{48A}-\x{52F}\x{531}-\x{556}\x{10A0}-\x{10C5}\x{13A0}-\x{13F5}"
    r"\x{13F8}-\x{13FD}\x{1C90}-\x{1CBA}\x{1CBD}-\x{1CBF}\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77}"
    r"\x{1D79}-\x{1D9A}\x{1E00}-\x{1F15}\x{1F18}-\x{1F1D}\x{1F20}-\x{1F45}\x{1F48}-\x{1F4D}"
    r"\x{1F50}-\x{1F57}\x{1F59}\x{1F5B}\x{1F5D}\x{1F5F}-\x{1F7D}\x{1F80}-\x{1FB4}\x{1FB6}-\x{1FBC}\x{1FBE}"
    r"\x{1FC2}-\x{1FC4}\x{1FC6}-\x{1FCC}\x{1FD0}-\x{1FD3}\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC}"
    r"\x{1FF2}-\x{1FF4}\x{1FF6}-\x{1FFC}\x{2102}\x{2107}\x{210A}-\x{2113}\x{2115}\x{2119}-\x{211D}\x{2124}"
    r"\x{2126}\x{2128}\x{212A}-\x{212D}\x{212F}-\x{2134}\x{2139}\x{213C}-\x{213F}\x{2145}-\x{2149}\x{214E}"
    r"\x{2183}\x{2184}\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4}\x{2CEB}-\x{2CEE}\x{2CF2}\x{2CF3}\x{A640}-\x{A66D}"
    r"\x{A680}-\x{A69B}\x{A722}-\x{A76F}\x{A771}-\x{A787}\x{A78B}-\x{A78E}\x{AB70}-\x{ABBF}"
    r"\x{FB00}-\x{FB06}\x{FB13}-\x{FB17}\x{FF21}-\x{FF3A}\x{FF41}-\x{FF5A}\x{10400}-\x{1044F}"
    r"\x{104B0}-\x{104D3}\x{104D8}-\x{104FB}\x{10C80}-\x{10CB2}\x{10CC0}-\x{10CF2}\x{118A0}-\x{118DF}"
    r"\x{1E900}-\x{1E943}"
)
# llama.cpp matches a regex without \p{..} on code points with every non-ASCII space turned into \v first, so
# no class of such a regex matches one: "&&[^\s]" says so (U+3000 lies in two of these ranges).
_CJK = r"[\x{4E00}-\x{9FA5}\x{800}-\x{4E00}\x{AC00}-\x{D7FF}&&[^\s]]+"


@dataclass(frozen=True)
class PreTokenizer:
    """One llama.cpp pre-tokenizer type: its split regexes and the flags llama.cpp sets with it."""

    regexes: tuple[str, ...]
    clean_spaces: bool = True  # detokenizer drops the space before ?!., and some contractions
    ignore_merges: bool = False  # a whole pre-token that is in the vocabulary is one token
    add_bos: Optional[bool] = None  # llama.cpp's default when the file has no tokenizer.ggml.add_bos_token


_GPT2_PRE = PreTokenizer((GPT2,))
_DIGITS_PRE = PreTokenizer((r"\p{N}", GPT2))
_LLAMA3_PRE = PreTokenizer((LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2_PRE = PreTokenizer((QWEN2,), clean_spaces=False)

# tokenizer.ggml.pre -> pre-tokenizer (llama.cpp's names; its aliases of one type share an entry).
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]")),
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"], _LLAMA3_PRE
    ),
    "dbrx": PreTokenizer((LLAMA3,)),
    "smaug-bpe": PreTokenizer((LLAMA3,)),
    "deepseek-llm": PreTokenizer(
        (
            "[\r\n]",
            rf"\s?[{_DEEPSEEK_LETTERS}&&[^\s]]+",
            r"\s?[!-/:-~\x{FF01}-\x{FF0F}\x{FF1A}-\x{FF5E}\x{2018}-\x{201F}\x{3000}-\x{3002}&&[^\s]]+",
            r"\s+\z",
            _CJK,
            r"\p{N}+",
        ),
        clean_spaces=False,
    ),
    "deepseek-coder": PreTokenizer(("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"), clean_spaces=False),
    "falcon": PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]")),
    **dict.fromkeys(["starcoder", "refact", "codeshell", "exaone", "minerva-7b"], _DIGITS_PRE),
    **dict.fromkeys(["command-r", "smollm"], PreTokenizer((r"\p{N}", GPT2), clean_spaces=False)),
    **dict.fromkeys(["gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4"], _GPT2_PRE),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"], _QWEN2_PRE),
    "qwen35": PreTokenizer((QWEN35,), clean_spaces=False),
    "poro-chat": PreTokenizer((r" ?[^(\s|.,!?…。，、।۔،)]+",), clean_spaces=False),
    "bloom": PreTokenizer((r" ?[^(\s|.,!?…。，、।۔،)]+",)),
    "gpt3-finnish": PreTokenizer((r" ?[^(\s|.,!?…。，、।۔،)]+",)),
    "chatglm-bpe": PreTokenizer((LLAMA3,), clean_spaces=False),
    "viking": PreTokenizer((r" ?[^(\s|.,!?…。，、।۔،)]+", r"\p{N}"), clean_spaces=False),
}
# Gemma 4 ("gemma4" tokenizer model): SentencePiece-style BPE over raw UTF-8 with spaces as U+2581, split only
# into newline runs and the text between them; a newline run that is a token is that token.
GEMMA4_PRE = PreTokenizer((r"[^\n]+|[\n]+",), add_bos=True)

TOKENIZER_MODELS = ("llama", "gpt2", "gemma4", "bert")


@dataclass(frozen=True)
class Vocab:
    """Everything llama.cpp's vocabulary loader derives from a GGUF's tokenizer metadata."""

    path: str
    model: str  # tokenizer.ggml.model: "llama" (SentencePiece), "gpt2" (byte-level BPE), "gemma4", "bert"
    pre: str  # tokenizer.ggml.pre ("default" when absent)
    tokens: list[str]
    attrs: list[int]
    scores: Optional[list[float]]
    merges: Optional[list[str]]
    pre_tokenizer: Optional[PreTokenizer]  # BPE models only
    bos_id: Optional[int]
    eos_id: Optional[int]
    unk_id: Optional[int]
    sep_id: Optional[int]
    add_bos: bool
    add_eos: bool
    add_sep: bool
    add_space_prefix: bool  # SentencePiece: " " before the text and after each special token
    escape_whitespaces: bool  # spaces are U+2581 in the vocabulary (SentencePiece, Gemma 4)
    clean_spaces: bool
    eog_ids: frozenset[int]

    @property
    def byte_level(self) -> bool:
        """Tokens spell bytes in GPT-2's printable alphabet (``Ġ`` = space)."""
        return self.model == "gpt2"


def _bool(path: str, meta: Mapping[str, Any], key: str, default: bool) -> bool:
    v = meta.get(key)
    if v is None:
        return default
    if not isinstance(v, (bool, int)):
        raise GGUFError(f"{path}: {key} must be a bool, got {type(v).__name__} {v!r}")
    return bool(v)


def _token_id(path: str, meta: Mapping[str, Any], key: str, default: Optional[int], n: int) -> Optional[int]:
    v = meta.get(key)
    if v is None:
        return default if default is not None and 0 <= default < n else None
    if not isinstance(v, int) or isinstance(v, bool):
        raise GGUFError(f"{path}: {key} must be an integer token id, got {v!r}")
    # llama.cpp keeps its default when the file's id is out of range
    return int(v) if 0 <= v < n else (default if default is not None and 0 <= default < n else None)


def _array(path: str, meta: Mapping[str, Any], key: str, n: int, kind: type) -> Optional[list[Any]]:
    v = meta.get(key)
    if v is None:
        return None
    if not isinstance(v, (list, tuple)):
        raise GGUFError(f"{path}: {key} must be an array, got {type(v).__name__}")
    if len(v) < n:
        raise GGUFError(f"{path}: {key} has {len(v)} entries for {n} tokens")
    if v and not isinstance(v[0], kind):
        raise GGUFError(f"{path}: {key} must hold {kind.__name__} values, got {type(v[0]).__name__}")
    return list(v[:n])


def read_vocab(metadata: Mapping[str, Any], path: str = "<gguf>") -> Vocab:
    """The vocabulary of a GGUF's metadata as llama.cpp loads it; a GGUFError names the field and the problem."""
    model = metadata.get("tokenizer.ggml.model")
    if model not in TOKENIZER_MODELS:
        raise GGUFError(
            f"{path}: tokenizer.ggml.model {model!r} is not supported (supported: {', '.join(TOKENIZER_MODELS)})"
        )
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, (list, tuple)) or not tokens:
        raise GGUFError(f"{path}: tokenizer.ggml.tokens is missing or empty")
    if not all(isinstance(t, str) for t in tokens):
        raise GGUFError(f"{path}: tokenizer.ggml.tokens must be an array of strings")
    n = len(tokens)
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]  # as llama.cpp names empty tokens
    if len(set(tokens)) != n:
        raise GGUFError(f"{path}: tokenizer.ggml.tokens holds duplicate tokens")
    types = _array(path, metadata, "tokenizer.ggml.token_type", n, int)
    attrs = [Attr.NORMAL] * n if types is None else [_TYPE_ATTR.get(t, 0) for t in types]
    scores = _array(path, metadata, "tokenizer.ggml.scores", n, (float, int))  # type: ignore[arg-type]
    merges = metadata.get("tokenizer.ggml.merges")
    pre = str(metadata.get("tokenizer.ggml.pre") or "default")

    pre_tok: Optional[PreTokenizer] = None
    escape = clean = False
    add_space_prefix = add_bos = add_eos = add_sep = False
    bos: Optional[int]
    eos: Optional[int]
    unk: Optional[int]
    sep: Optional[int] = None
    if model == "llama":
        if scores is None:
            raise GGUFError(f"{path}: tokenizer.ggml.scores is missing (a SentencePiece vocabulary needs it)")
        bos, eos, unk = 1, 2, 0
        add_space_prefix, escape, add_bos = True, True, True
    elif model == "bert":
        bos, eos, unk, sep = 101, None, 100, 102
        clean, add_bos, add_sep = True, True, True
    else:
        if not isinstance(merges, (list, tuple)) or not merges:
            raise GGUFError(f"{path}: tokenizer.ggml.merges is missing (a BPE vocabulary needs it)")
        if not all(isinstance(m, str) for m in merges[:1]):
            raise GGUFError(f"{path}: tokenizer.ggml.merges must be an array of strings")
        if model == "gemma4":
            bos = eos = unk = None
            pre, pre_tok, escape = "gemma4", GEMMA4_PRE, True
        else:
            bos = eos = 11
            unk = None
            if pre not in PRE_TOKENIZERS:
                raise GGUFError(
                    f"{path}: tokenizer.ggml.pre {pre!r} is not a supported pre-tokenizer "
                    f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})"
                )
            pre_tok = PRE_TOKENIZERS[pre]
        clean = pre_tok.clean_spaces
        add_bos = bool(pre_tok.add_bos)
    add_space_prefix = _bool(path, metadata, "tokenizer.ggml.add_space_prefix", add_space_prefix)
    bos = _token_id(path, metadata, "tokenizer.ggml.bos_token_id", bos, n)
    eos = _token_id(path, metadata, "tokenizer.ggml.eos_token_id", eos, n)
    unk = _token_id(path, metadata, "tokenizer.ggml.unknown_token_id", unk, n)
    sep = _token_id(path, metadata, "tokenizer.ggml.seperator_token_id", sep, n)
    add_bos = _bool(path, metadata, "tokenizer.ggml.add_bos_token", add_bos)
    add_eos = _bool(path, metadata, "tokenizer.ggml.add_eos_token", add_eos)
    add_sep = _bool(path, metadata, "tokenizer.ggml.add_sep_token", add_sep)
    if model == "gemma4":
        add_bos = True  # llama.cpp overrides it for Gemma 4
    if add_bos and bos is None:
        raise GGUFError(f"{path}: tokenizer.ggml.add_bos_token is set but the vocabulary has no BOS token")

    eog: set[int] = set()
    for i, t in enumerate(tokens):
        if t in _CONTROL_BY_NAME:
            attrs[i] |= Attr.CONTROL
            if t in _EOG_BY_NAME:
                eog.add(i)
    for e in (eos,):
        if e is not None:
            eog.add(e)
    ids = {t: i for i, t in enumerate(tokens) if t in ("</s>", "<|tool_response>", "<|plamo:eos|>")}
    if ids.get("</s>") in eog and (ids.get("<|tool_response>") in eog or ids.get("<|plamo:eos|>") in eog):
        eog.discard(ids["</s>"])  # Gemma 4 and PLaMo: </s> is a normal token
        attrs[ids["</s>"]] = Attr.NORMAL
    name = str(metadata.get("general.name", "")).lower()
    if "phi-3" in name or "phi3" in name:
        # llama.cpp: Phi-3's special tokens swallow the whitespace after them, except <unk>, <s>, <|endoftext|>
        for i, a in enumerate(attrs):
            if a & (Attr.CONTROL | Attr.USER_DEFINED | Attr.UNKNOWN) or tokens[i] == "</s>":
                attrs[i] |= Attr.RSTRIP
            if tokens[i] in ("<unk>", "<s>", "<|endoftext|>"):
                attrs[i] &= ~Attr.RSTRIP
    return Vocab(
        path=path,
        model=str(model),
        pre=pre,
        tokens=tokens,
        attrs=attrs,
        scores=None if scores is None else [float(s) for s in scores],
        merges=None if merges is None else list(merges),
        pre_tokenizer=pre_tok,
        bos_id=bos,
        eos_id=eos,
        unk_id=unk,
        sep_id=sep,
        add_bos=add_bos,
        add_eos=add_eos,
        add_sep=add_sep,
        add_space_prefix=add_space_prefix,
        escape_whitespaces=escape,
        clean_spaces=clean,
        eog_ids=frozenset(eog),
    )


def special_token_ids(vocab: Vocab) -> tuple[list[int], list[int]]:
    """``(parsed only with parse_special, always parsed)``: control/unknown ids, user-defined ids."""
    ctl = [i for i, a in enumerate(vocab.attrs) if a & (Attr.CONTROL | Attr.UNKNOWN)]
    user = [i for i, a in enumerate(vocab.attrs) if a & Attr.USER_DEFINED and not a & (Attr.CONTROL | Attr.UNKNOWN)]
    return ctl, user
