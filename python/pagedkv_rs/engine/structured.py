"""Structured outputs: constrained decoding with llguidance (a schema, a regex, a choice or a grammar).

``StructuredOutputsParams`` has vLLM's shape and is the one engine constraint every route maps to
(``SamplingParams(structured_outputs=...)``; the server's ``response_format``, ``structured_outputs``,
``guided_*``, ``json_schema`` and ``grammar`` fields; tool calls forced by a schema). Set exactly one of:

- ``json``: a JSON schema (a dict or its JSON text), or ``True`` for any JSON object (``json_object=True``
  is the same, vLLM's spelling). The JSON has one space after ``:`` and ``,`` and no other whitespace.
- ``regex``: a regular expression (Rust ``regex`` syntax) the whole output matches.
- ``choice``: a list of strings; the output is exactly one of them.
- ``grammar``: a Lark grammar in llguidance's syntax, or a llama.cpp GBNF grammar (converted by llguidance).

How a request runs: ``GrammarCompiler.compile`` (at the engine's door, ``input.check_request``) builds the
grammar once per constraint (a bounded LRU keyed by a hash of it; llguidance's parser limits bound the
build and each step), so a schema it cannot compile is refused before anything is queued. Each sequence
(each completion of ``n > 1``) gets its own matcher; every step ``fill_masks`` computes the allowed-token
bitmask of all constrained rows at once (in llguidance's threads, off the GIL), sampling sets the other
logits to -inf, and ``advance`` feeds each sampled token to its matcher. A matcher that accepts and allows
nothing more finishes its sequence ("stop"); EOS is allowed only where the grammar accepts. Tokens already
consumed are never fed again (preemption recomputes KV, not tokens). Logprobs stay those of the raw
(unmasked) distribution.

The API other parts build on (stable): ``StructuredOutputsParams(json=schema | True, regex=, choice=,
grammar=)`` with ``.kind``, ``.schema`` and ``.key``; ``SamplingParams(structured_outputs=...)``; a
constraint that cannot be compiled is ``InvalidRequestError(param="structured_outputs")`` at submission.
"""

from __future__ import annotations

import hashlib
import json as _json
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import numpy as np

__all__ = [
    "StructuredOutputsParams",
    "GrammarCompiler",
    "CompiledGrammar",
    "build_lltokenizer",
    "special_token_id",
    "fill_masks",
    "advance",
    "MAX_CONSTRAINT_BYTES",
    "MAX_CHOICES",
    "CACHE_SIZE",
]

MAX_CONSTRAINT_BYTES = 256 * 1024  # the text of a schema, regex, grammar or the choices together
MAX_CHOICES = 4096
CACHE_SIZE = 128  # compiled constraints kept (LRU)
# llguidance's parser limits: what one grammar build and one mask step may cost (its defaults, the
# grammar size lower: a schema over it is refused at the door rather than built for seconds)
INITIAL_LEXER_FUEL = 1_000_000
STEP_LEXER_FUEL = 200_000
STEP_MAX_ITEMS = 50_000
MAX_GRAMMAR_SIZE = 200_000
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_INSTALL = "structured outputs need llguidance: pip install 'llguidance>=1.0,<2' (in the model extra)"


def _llg() -> Any:
    try:
        import llguidance
    except ImportError:  # pragma: no cover - llguidance is in the model extra
        raise ImportError(_INSTALL) from None
    return llguidance


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One output constraint (vLLM's ``StructuredOutputsParams``): exactly one of the fields is set.

    ``json``: a JSON schema (dict or JSON text) or ``True`` (any JSON object); ``json_object=True`` is
    ``json=True``; ``regex``; ``choice`` (a list of strings); ``grammar`` (Lark / llguidance syntax, or GBNF).
    Validated on construction (types, sizes); whether llguidance can compile it is checked at submission.
    """

    json: Union[dict, str, bool, None] = None
    regex: Optional[str] = None
    choice: Optional[Sequence[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None

    def __post_init__(self) -> None:
        s = object.__setattr__
        given = [n for n in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, n) is not None]
        if self.json_object is False:
            given.remove("json_object")
        if len(given) != 1:
            raise ValueError(
                "StructuredOutputsParams needs exactly one of json, regex, choice, grammar, json_object; "
                f"got {given or 'none'}"
            )
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise TypeError(
                f"StructuredOutputsParams.json_object must be a bool, got {type(self.json_object).__name__}"
            )
        j = self.json
        if j is not None:
            if j is False:
                raise ValueError("StructuredOutputsParams.json must be a schema or True, got False")
            if isinstance(j, str):
                try:
                    j = _json.loads(j)
                except ValueError as e:
                    raise ValueError(f"StructuredOutputsParams.json is not valid JSON: {e}") from None
                s(self, "json", j)
            if not isinstance(j, (dict, bool)):
                raise TypeError(f"StructuredOutputsParams.json must be a schema (dict) or True, got {type(j).__name__}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise TypeError(f"StructuredOutputsParams.{name} must be a str, got {type(v).__name__}")
            if v is not None and not v.strip():
                raise ValueError(f"StructuredOutputsParams.{name} must not be empty")
        if self.choice is not None:
            c = self.choice
            if isinstance(c, (str, bytes)) or not hasattr(c, "__iter__"):
                raise TypeError(f"StructuredOutputsParams.choice must be a list of str, got {type(c).__name__}")
            c = tuple(c)
            if not c:
                raise ValueError("StructuredOutputsParams.choice must not be empty")
            if len(c) > MAX_CHOICES:
                raise ValueError(f"StructuredOutputsParams.choice has {len(c)} items, at most {MAX_CHOICES}")
            for x in c:
                if not isinstance(x, str):
                    raise TypeError(f"StructuredOutputsParams.choice items must be str, got {type(x).__name__}")
                if not x:
                    raise ValueError("StructuredOutputsParams.choice items must not be empty")
            s(self, "choice", c)
        if len(self.source) > MAX_CONSTRAINT_BYTES:
            raise ValueError(
                f"StructuredOutputsParams.{self.kind} is {len(self.source)} bytes, at most {MAX_CONSTRAINT_BYTES}"
            )

    @property
    def kind(self) -> str:
        """ "json", "regex", "choice" or "grammar" (``json_object`` is "json")."""
        if self.json is not None or self.json_object:
            return "json"
        return "regex" if self.regex is not None else "choice" if self.choice is not None else "grammar"

    @property
    def schema(self) -> Optional[dict]:
        """The JSON schema (``{"type": "object"}`` for any object), or None."""
        if self.kind != "json":
            return None
        return self.json if isinstance(self.json, dict) else {"type": "object"}

    @property
    def source(self) -> str:
        """The constraint as one canonical text (what the compile cache hashes)."""
        k = self.kind
        if k == "json":
            return _json.dumps(self.schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        if k == "choice":
            return _json.dumps(list(self.choice), ensure_ascii=False)  # type: ignore[arg-type]
        return self.regex if k == "regex" else self.grammar  # type: ignore[return-value]

    @property
    def key(self) -> str:
        return hashlib.sha256(f"{self.kind}\x00{self.source}".encode("utf-8", "surrogatepass")).hexdigest()

    def to_grammar(self) -> str:
        """The llguidance grammar of this constraint (raises ``ValueError`` for GBNF it cannot convert)."""
        llg = _llg()
        k = self.kind
        if k == "json":
            return llg.LLMatcher.grammar_from_json_schema(self.schema, overrides=JSON_OPTIONS)
        if k == "regex":
            return llg.LLMatcher.grammar_from_regex(self.regex)
        if k == "choice":
            return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(_json.dumps(c) for c in self.choice))  # type: ignore[union-attr]
        from llguidance.gbnf_to_lark import any_to_lark

        assert self.grammar is not None  # kind "grammar"
        try:
            lark = any_to_lark(self.grammar)  # Lark passes through; GBNF is converted
        except Exception as e:
            raise ValueError(f"the grammar is neither Lark nor GBNF llguidance can convert: {e}") from None
        return llg.LLMatcher.grammar_from_lark(lark)


def build_lltokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> Any:
    """An ``llguidance.LLTokenizer`` from our ``GGUFTokenizer`` (every SentencePiece and BPE vocabulary).

    llguidance gets each id's bytes as llama.cpp's ``token_to_piece`` renders them (byte-level BPE
    unmapped, SentencePiece's U+2581 as a space, ``<0xNN>`` byte tokens as that byte), special tokens
    marked with a leading 0xFF (as llguidance's llama.cpp bridge does), ids past the tokenizer's
    vocabulary (a model's padded rows) as empty tokens, which are never allowed; and the EOS id(s).
    """
    llg = _llg()
    pieces = getattr(tokenizer, "_pieces", None)
    vocab = getattr(tokenizer, "vocab", None)
    if pieces is None or vocab is None:
        raise ValueError(f"structured outputs need a GGUF tokenizer, got {type(tokenizer).__name__}")
    tokens = [b"\xff" + p if _special(p, a) else p for p, a in zip(pieces, vocab.attrs)]
    tokens = tokens[:vocab_size] + [b""] * max(0, vocab_size - len(tokens))
    eos = sorted({int(t) for t in eos_token_ids if 0 <= int(t) < vocab_size})
    if not eos and tokenizer.eos_token_id is not None:
        eos = [tokenizer.eos_token_id]

    class _Wrapper(llg.TokenizerWrapper):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:  # no super().__init__: it probes a callable tokenizer object
            self.eos_token_id = eos[0] if eos else 0
            self.bos_token_id = tokenizer.bos_token_id
            self.tokens = tokens
            self.special_token_ids = [i for i, t in enumerate(tokens) if t[:1] == b"\xff"]
            self.is_tokenizer_wrapper = True

        def __call__(self, text: str) -> list[int]:  # type: ignore[override]
            return tokenizer.encode(text, parse_special=False)

    return llg.LLTokenizer(_Wrapper(), n_vocab=vocab_size, eos_token=eos or None)


def _special(piece: bytes, attr: int) -> bool:
    """llguidance sees the token as special (a grammar names it ``<[id]>``; free text never holds it): control and
    unknown tokens, and user-defined ones that look like markup (Qwen's ``<tool_call>``)."""
    from pagedkv_rs.models.vocab import Attr

    if attr & (Attr.CONTROL | Attr.UNKNOWN):
        return True
    return bool(attr & Attr.USER_DEFINED) and piece.startswith(b"<") and piece.endswith(b">")


def special_token_id(tokenizer: Any, text: str) -> Optional[int]:
    """The id of the one token spelled ``text`` when llguidance sees it as special (see ``build_lltokenizer``),
    else None: a grammar then names it ``<[id]>``, as a string it would never match."""
    tok = getattr(tokenizer, "gguf", tokenizer)
    ids = getattr(tok, "_ids", None)
    tid = ids.get(text) if ids is not None else None
    if tid is None:
        return None
    return tid if _special(tok._pieces[tid], tok.vocab.attrs[tid]) else None


@dataclass(frozen=True)
class CompiledGrammar:
    """A compiled constraint: a fresh matcher to copy for each sequence."""

    params: StructuredOutputsParams
    template: Any  # llguidance.LLMatcher, never advanced
    lock: threading.Lock

    def new_matcher(self) -> Any:
        with self.lock:
            return self.template.deep_copy()


class GrammarCompiler:
    """Compiles constraints against one model's vocabulary; bounded LRU cache keyed by the constraint's hash.

    ``tokenizer`` is our ``GGUFTokenizer`` (``of`` also takes a wrapper exposing it as ``.gguf``); its
    ``LLTokenizer`` is built on first use. ``observe(seconds, cold)``: called with each compile's time
    (``cold``: built now; else a cache hit).
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        *,
        cache_size: int = CACHE_SIZE,
        observe: Optional[Callable[[float, bool], None]] = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = tuple(eos_token_ids)
        self.cache_size = cache_size
        self.observe = observe
        self._lltok: Any = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()

    @property
    def lltokenizer(self) -> Any:
        with self._lock:
            if self._lltok is None:
                self._lltok = build_lltokenizer(self.tokenizer, self.vocab_size, self.eos_token_ids)
            return self._lltok

    @staticmethod
    def limits() -> Any:
        return _llg().LLParserLimits(
            initial_lexer_fuel=INITIAL_LEXER_FUEL,
            step_lexer_fuel=STEP_LEXER_FUEL,
            step_max_items=STEP_MAX_ITEMS,
            max_grammar_size=MAX_GRAMMAR_SIZE,
        )

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled constraint (cached); ``ValueError`` naming the problem if llguidance cannot compile it."""
        t0 = time.perf_counter()
        key = params.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        cold = hit is None
        if hit is None:
            llg = _llg()
            lltok = self.lltokenizer
            grammar = params.to_grammar()
            m = llg.LLMatcher(lltok, grammar, log_level=0, limits=self.limits())  # drops the GIL while it builds
            if m.is_error():
                raise ValueError(f"the {params.kind} constraint cannot be compiled: {_first_lines(m.get_error())}")
            hit = CompiledGrammar(params, m, threading.Lock())
            with self._lock:
                self._cache[key] = hit
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        if self.observe is not None:
            self.observe(time.perf_counter() - t0, cold)
        return hit

    def __len__(self) -> int:
        return len(self._cache)

    @classmethod
    def of(cls, tokenizer: Any, model: Any, observe: Optional[Callable[[float, bool], None]] = None) -> Any:
        """A compiler for ``model``'s vocabulary and EOS ids through ``tokenizer``, or None without a tokenizer."""
        if tokenizer is None:
            return None
        return cls(getattr(tokenizer, "gguf", tokenizer), model.vocab_size, model.eos_token_ids, observe=observe)


def _first_lines(msg: str, n: int = 6) -> str:
    lines = msg.strip().splitlines()
    return "\n".join(lines[:n]) + (" ..." if len(lines) > n else "")


_EXECUTOR: Any = None
_EXECUTOR_LOCK = threading.Lock()


def _executor() -> Any:
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = _llg().LLExecutor()
        return _EXECUTOR


def fill_masks(matchers: Sequence[Any], vocab_size: int) -> np.ndarray:
    """The allowed-token bitmask int32 [R, ceil(V / 32)] of each matcher, computed in parallel off the GIL."""
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par

    mask = allocate_token_bitmask(len(matchers), vocab_size)
    fill_next_token_bitmask_par(_executor(), [(m, i) for i, m in enumerate(matchers)], mask)
    return mask


def advance(requests: Sequence[Any]) -> tuple[list[Any], dict[str, BaseException]]:
    """Feed each request's newest output token to its matcher.

    Returns (running requests the grammar has ended: accepting, nothing more allowed; request id -> the
    error of a matcher that refused its token). A finished request's matcher is dropped.
    """
    ended: list[Any] = []
    failed: dict[str, BaseException] = {}
    for r in requests:
        m = r.matcher
        if m is None:
            continue
        tok = r.output_token_ids[-1]
        if not m.consume_token(tok):
            failed[r.head.request_id] = RuntimeError(
                f"structured outputs: token {tok} does not continue the constraint ({_first_lines(m.get_error(), 2)})"
            )
            r.matcher = None
        elif r.finished:
            r.matcher = None
        elif m.is_stopped():
            ended.append(r)
            r.matcher = None
    return ended, failed
