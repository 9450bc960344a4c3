"""The decoder forward pass in numpy, over our paged KV cache: every architecture of ``architectures.py``.

One decoder, described by data: the config's ``ArchSpec`` says which optional parts a layer has
(Q/K norms, post-sublayer norms, biases, the gate's activation, per-layer windows and RoPE bases);
there is no branch or subclass per model.

Two consumers of one set of weights (:class:`LlamaWeights`: float32 for numpy's BLAS, or int8
blocks for ``pagedkv_rs.QLinear``):

- :class:`LlamaModel` implements the engine's ``Model`` protocol: one ``forward`` per step for all
  scheduled tokens of all sequences, one ``write_kv`` and one varlen ``paged_attention`` per layer.
  ``impl="numpy"`` runs it as the numpy code below (the readable spec); ``impl="fused"`` hands
  the whole decoder stack, the final norm and the lm_head to ``pagedkv_rs._core.LlamaDecoder``:
  one GIL-free Rust call per step from embedded tokens to logits, on the same kernels in the same
  order (int8 weights only; equal to the numpy path bit for bit).

Shapes: T = tokens this step, H = hidden, Hq/Hkv = query/KV heads, D = head_dim, F = FFN width.
Activations are 2-D ``[T, H]`` so each weight multiply is one call (one sgemm, or one QLinear).

RoPE convention: llama.cpp's converter permutes the rows of ``attn_q``/``attn_k`` so that the
rotated pairs are adjacent (``(x[2i], x[2i+1])``). We undo that permutation at load and rotate
halves (``(x[i], x[i + D/2])``) as Hugging Face does; ``rope_pairs="adjacent"`` keeps the GGUF
order and rotates adjacent pairs instead (numerically the same model; used by the tests), and
``"mismatched"`` deliberately mixes the two to show the tests catch it.
"""

from __future__ import annotations

import types
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

import numpy as np

from pagedkv_rs.batch import BatchInputs
from pagedkv_rs.models.architectures import ARCH_SPECS
from pagedkv_rs.models.gguf_loader import (
    RAW_TYPES,
    GGUFError,
    GGUFFile,
    GGUFTensor,
    LlamaConfig,
    layer_tensor_names,
    load_gguf,
)

__all__ = [
    "NATIVE_ROPE_PAIRS",
    "Embedding",
    "FloatLinear",
    "Int8Linear",
    "LlamaModel",
    "LlamaWeights",
    "MODEL_IMPLS",
    "WEIGHT_FORMATS",
    "eos_ids_from_metadata",
    "int8_is_fast",
    "kernels",
    "fused_unavailable",
    "permute_rope_rows",
    "resolve_weight_format",
    "rope_tables",
    "unpermute_rope_rows",
]

ROPE_MODES = ("half", "adjacent", "mismatched")


def kernels() -> types.ModuleType:
    """``pagedkv_rs.kernels``: ``new_kv_cache/write_kv/copy_blocks/paged_attention``, Rust when built."""
    from pagedkv_rs import kernels as k

    return k


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: adjacent-pair order -> rotate-half order. w: [n_heads*D, ...]."""
    d = w.shape[0] // n_heads
    return np.ascontiguousarray(w.reshape(n_heads, d // 2, 2, -1).swapaxes(1, 2).reshape(w.shape))


def permute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation: rotate-half order -> adjacent-pair order (inverse of the above)."""
    d = w.shape[0] // n_heads
    return np.ascontiguousarray(w.reshape(n_heads, 2, d // 2, -1).swapaxes(1, 2).reshape(w.shape))


# The Q/K row order each architecture's GGUF stores: llama.cpp permutes Llama's rows so rotated pairs
# are adjacent; the others' converters leave the rows in rotate-half (NeoX) order.
NATIVE_ROPE_PAIRS = {name: spec.rope_pairs for name, spec in ARCH_SPECS.items()}


def rope_tables(
    cfg: LlamaConfig, freq_factors: Optional[np.ndarray] = None, theta: Optional[float] = None
) -> tuple[np.ndarray, np.ndarray]:
    """float32 ``cos, sin [max_len, D/2]``: pair i turns by ``pos / factor * theta^(-2i/D) / freq_factors[i]``.

    ``factor`` is linear RoPE scaling (``rope.scaling.factor``); ``freq_factors`` Llama 3's ``rope_freqs``;
    ``theta`` the base (default ``cfg.rope_theta``; Gemma 3's local layers have their own).
    """
    return rope_rows(np.arange(cfg.max_model_len), rope_inv_freq(cfg, freq_factors, theta), cfg.rope_scaling_factor)


def rope_inv_freq(
    cfg: LlamaConfig, freq_factors: Optional[np.ndarray] = None, theta: Optional[float] = None
) -> np.ndarray:
    """float64 ``[D/2]``: pair i turns by ``theta^(-2i/D) / freq_factors[i]`` a position."""
    d = cfg.head_dim
    base = cfg.rope_theta if theta is None else theta
    inv_freq = 1.0 / (base ** (np.arange(0, d, 2, dtype=np.float64) / d))
    if freq_factors is not None:
        inv_freq = inv_freq / np.asarray(freq_factors, np.float64)
    return inv_freq


def rope_rows(positions: np.ndarray, inv_freq: np.ndarray, factor: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """float32 ``cos, sin [T, D/2]`` at ``positions`` (int ``[T]``): each entry ``pos / factor * inv_freq[i]``
    in float64, then rounded; a row depends only on its position (the table's row, to the bit)."""
    ang = (np.asarray(positions, np.float64) / factor)[:, None] * inv_freq[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


WEIGHT_FORMATS = ("auto", "int8", "float32")
# An int8 output head larger than this is built (and run) in row chunks of about this size (see ``_lm_head``).
HEAD_CHUNK_BYTES = 32 << 20
# Positions whose RoPE rows ``LlamaWeights.rope_rows`` keeps once computed (2 MiB per base at head_dim 256).
ROPE_CACHE_POSITIONS = 2048
LINEAR_PANEL = 64  # rows a chunk is a multiple of (QLinear packs rows in panels of at most this many)
MODEL_IMPLS = ("auto", "fused", "numpy")


# The QLinear builds that beat numpy's float32 sgemm end to end on SmolLM2: AVX-512 VNNI (with AMX or not), and the
# AVX2 vpmaddubsw tile (well ahead at 1 and 8 sequences, ahead at 32, behind sgemm only in long prefill
# chunks). The scalar tile is far slower.
FAST_LINEAR_ISAS = ("avx512amx", "avx512vnni", "avxvnni", "avx2")


def _core_qlinear() -> Any:
    from pagedkv_rs import _core

    return _core


def int8_is_fast() -> bool:
    """True when ``pagedkv_rs.QLinear`` runs a SIMD kernel here (AVX-512 VNNI or AVX2, not forced scalar)."""
    try:
        from pagedkv_rs import _core
    except ImportError:
        return False
    return hasattr(_core, "QLinear") and _core.kernel_info().get("linear_isa") in FAST_LINEAR_ISAS


def resolve_weight_format(fmt: str) -> str:
    """``"auto"`` -> ``"int8"`` where the int8 kernel is fast, else ``"float32"``."""
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {WEIGHT_FORMATS}, got {fmt!r}")
    if fmt == "auto":
        return "int8" if int8_is_fast() else "float32"
    return fmt


class FloatLinear:
    """float32 weights ``W.T`` ``[in, out]``: ``x @ W.T`` is one BLAS sgemm."""

    def __init__(self, w_t: np.ndarray):
        self.w_t = w_t
        self.k, self.n = w_t.shape

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return x @ self.w_t


class Int8Linear:
    """``pagedkv_rs.QLinear``: 8-bit codes per 32-wide block, int8 activations, on the kernel threads."""

    def __init__(self, q: Any):
        self.q = q
        self.k, self.n = q.k, q.n

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.q(np.ascontiguousarray(x, np.float32))


class ChunkedLinear:
    """One ``[out, in]`` int8 layer held as consecutive row chunks (``Int8Linear`` each): ``x -> [T, out]``."""

    def __init__(self, parts: list[Int8Linear]):
        self.parts = parts
        self.k = parts[0].k
        self.n = sum(p.n for p in parts)
        self.q = [p.q for p in parts]  # what the fused decoder's head takes

    def __call__(self, x: np.ndarray) -> np.ndarray:
        out = np.empty((x.shape[0], self.n), np.float32)
        at = 0
        for p in self.parts:
            out[:, at : at + p.n] = p(x)
            at += p.n
        return out


# The int8 matrices whose activation digits are chosen (``LlamaWeights.set_act_digits``): the output head and
# each layer's fused QKV, attention output, fused gate/up and down projections.
ACT_DIGIT_ROLES = ("head", "wqkv", "wo", "wgu", "wdown")


def parse_act_digits(spec: str) -> dict[str, int]:
    """``"head=1,wdown=2"`` -> ``{"head": 1, "wdown": 2}``: keys a role of ``ACT_DIGIT_ROLES`` (every layer's) or
    ``ROLE.I`` (layer I's), values 1 or 2; a bare ``"1"`` or ``"2"``: every role. The keys are checked against a
    model by ``set_act_digits``."""
    if spec.strip() in ("1", "2"):
        return dict.fromkeys(ACT_DIGIT_ROLES, int(spec))
    out: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        key, eq, val = item.partition("=")
        if not eq or val.strip() not in ("1", "2"):
            raise ValueError(f"act_digits: {item!r} is not KEY=1 or KEY=2")
        out[key.strip()] = int(val)
    return out


def act_digits_choice(value: Union[int, str, Mapping[str, int]]) -> dict[str, int]:
    """An ``act_digits`` option as ``set_act_digits`` takes it: 1 or 2 (every matrix), a ``parse_act_digits``
    string, or a mapping of keys to 1 or 2."""
    if isinstance(value, bool):
        raise TypeError("act_digits must be 1, 2, a string like 'head=1,wdown=2' or a dict, got a bool")
    if isinstance(value, int):
        if value not in (1, 2):
            raise ValueError(f"act_digits must be 1 or 2, got {value}")
        return dict.fromkeys(ACT_DIGIT_ROLES, value)
    if isinstance(value, str):
        return parse_act_digits(value)
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"act_digits must be 1, 2, a string like 'head=1,wdown=2' or a dict, got {type(value).__name__}")


class Embedding:
    """The token-embedding table ``[V, H]``, read per step from the file's own (quantized) rows.

    ``embed[ids]`` dequantizes just the rows of ``ids`` (any int array) to float32 ``[*ids.shape, H]``.
    """

    def __init__(self, tensor: GGUFTensor):
        self.tensor = tensor
        self.shape: tuple[int, ...] = tensor.shape

    def __getitem__(self, ids: Any) -> np.ndarray:
        ids = np.asarray(ids, np.int64)
        rows = self.tensor.dequantize(ids.reshape(-1))
        return rows.reshape(ids.shape + self.shape[1:])


class LlamaWeights:
    """Weights of a Llama model with fused QKV and gate/up projections, plus RoPE tables.

    Built tensor by tensor from the memory-mapped file; no whole-model float32 copy exists.
    ``weights="float32"``: every projection is dequantized straight into its fused float32 array
    and run by numpy's BLAS. ``weights="int8"``: ``pagedkv_rs.QLinear`` over the file's own blocks
    (exactly for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K; float tensors requantized to 8 bits per
    32-wide block, and so are Q6_K rows where a fused projection puts them in one 16-row panel
    with rows of another type).
    ``"auto"`` (default) picks int8 where a SIMD kernel runs (AVX-512 VNNI or AVX2), float32 elsewhere. In both
    formats the embedding is read per token from the file's rows; the ``lm_head`` (tied or not) follows
    the weight format.
    """

    def __init__(self, gguf: GGUFFile, *, rope_pairs: str = "half", weights: str = "auto"):
        if rope_pairs not in ROPE_MODES:
            raise ValueError(f"rope_pairs must be one of {ROPE_MODES}, got {rope_pairs!r}")
        cfg = gguf.config
        self.config: LlamaConfig = cfg
        self.path = gguf.path
        self.rope_pairs = rope_pairs
        self.native_rope_pairs = NATIVE_ROPE_PAIRS[cfg.architecture]
        self.weight_format = resolve_weight_format(weights)
        self._gguf = gguf
        t = gguf.tensors
        self.embed = Embedding(t["token_embd.weight"])  # [V, H]
        self.lm_head = self._lm_head()
        self.final_norm: np.ndarray = self._vector("output_norm.weight")
        self.layers: list[dict[str, Any]] = []
        theta_of: dict[float, int] = {}  # RoPE base -> index into self.rope_tables
        for i in range(cfg.num_layers):
            names = layer_tensor_names(cfg, t, i)
            theta = cfg.layer_rope_theta(i)
            layer: dict[str, Any] = {
                "attn_norm": self._vector(names["attn_norm"][0]),
                "ffn_norm": self._vector(names["ffn_norm"][0]),
                # out features: Hq D query, Hkv D key, Hkv D value
                "wqkv": self._linear(names["qkv"]),
                "wo": self._linear(names["wo"]),
                # out features: F gate then F up
                "wgu": self._linear(names["gate_up"]),
                "wdown": self._linear(names["down"]),
                "window": cfg.layer_window(i),
                "rope_table": theta_of.setdefault(theta, len(theta_of)),
            }
            for role in ("q_norm", "k_norm"):  # [D], in the order the Q/K rows are rotated
                if role in names:
                    layer[role] = self._rows(names[role][0], vector=True)
            for role in ("post_attn_norm", "post_ffn_norm"):  # [H]
                if role in names:
                    layer[role] = self._vector(names[role][0])
            if "qkv_bias" in names:  # added after the fused QKV linear: [(Hq + 2 Hkv) D] float32
                layer["bqkv"] = self._qkv_bias(names["qkv_bias"])
            self.layers.append(layer)
            _trim_heap()
        factors = self._vector("rope_freqs.weight") if cfg.rope_freq_factors else None
        del self._gguf
        if self.weight_format == "int8":  # the architecture's measured choice (``ArchSpec.act_digits``)
            self.set_act_digits(dict(cfg.spec.act_digits))
        # One float64 [D/2] frequency vector per distinct RoPE base; ``layer["rope_table"]`` indexes them.
        self._inv_freqs = [rope_inv_freq(cfg, factors, theta) for theta in sorted(theta_of, key=theta_of.__getitem__)]
        self._rope_tables: Optional[list[tuple[np.ndarray, np.ndarray]]] = None
        self._rope_cache: list[tuple[np.ndarray, np.ndarray]] = []  # rows 0.. of each base, grown on demand

    def act_matrices(self) -> dict[str, list[Any]]:
        """The int8 matrices by name (``head``, ``ROLE.I``), each a list of ``QLinear`` (the head: its row chunks);
        empty for float32 weights."""
        if self.weight_format != "int8":
            return {}
        head = self.lm_head
        out: dict[str, list[Any]] = {}
        if isinstance(head, (Int8Linear, ChunkedLinear)):
            out["head"] = head.q if isinstance(head, ChunkedLinear) else [head.q]
        for i, layer in enumerate(self.layers):
            for role in ACT_DIGIT_ROLES[1:]:
                out[f"{role}.{i}"] = [layer[role].q]
        return out

    @property
    def act_digits(self) -> dict[str, int]:
        """Activation digits (1 or 2) of each int8 matrix, by ``act_matrices`` name."""
        return {name: qs[0].act_digits for name, qs in self.act_matrices().items()}

    def act_digits_spec(self) -> str:
        """The matrices of one activation digit, roles where every layer's has one: ``"head,wo"``, or ``"none"``."""
        ones = {name for name, d in self.act_digits.items() if d == 1}
        roles = [
            r for r in ACT_DIGIT_ROLES[1:] if self.layers and all(f"{r}.{i}" in ones for i in range(len(self.layers)))
        ]
        single = sorted(n for n in ones if n != "head" and n.split(".")[0] not in roles)
        return ",".join((["head"] if "head" in ones else []) + roles + single) or "none"

    def set_act_digits(self, choice: dict[str, int]) -> None:
        """Set activation digits: keys ``head``, a role (every layer's) or ``ROLE.I``, values 1 or 2; a role then its
        layers' own keys apply. Shared with a fused decoder built from these weights. Checked whole first: a bad key
        or value is a ValueError and nothing changes."""
        mats = self.act_matrices()
        if choice and not mats:
            raise ValueError(f"act_digits apply to int8 weights, these are {self.weight_format}")
        plan: dict[str, int] = {}
        for key, d in sorted(choice.items(), key=lambda kv: "." in kv[0]):  # roles first, then single layers
            if d not in (1, 2) or isinstance(d, bool):
                raise ValueError(f"act_digits[{key!r}] must be 1 or 2, got {d!r}")
            names = [n for n in mats if n == key or n.split(".")[0] == key] if "." not in key else [key]
            if not names or any(n not in mats for n in names):
                raise ValueError(f"act_digits: no int8 matrix {key!r} (keys: {', '.join(ACT_DIGIT_ROLES)} or ROLE.I)")
            plan.update(dict.fromkeys(names, d))
        for name, d in plan.items():
            for q in mats[name]:
                q.set_act_digits(d)

    @property
    def num_rope_tables(self) -> int:
        """How many RoPE bases the layers use (Gemma 3: local and global)."""
        return len(self._inv_freqs) if self._rope_tables is None else len(self._rope_tables)

    def rope_rows(self, positions: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per RoPE base, float32 ``cos, sin [T, D/2]`` at ``positions``: what a step rotates with.

        Rows of ``rope_tables`` when those were set. Else rows of a cache of each base's first positions (grown
        to cover the step, at most ``ROPE_CACHE_POSITIONS``: a 512-token prefill spent milliseconds on cos and sin
        in float64), or computed from the positions past it (no ``[max_len, D/2]`` table is kept: at Gemma 3's
        32k context its two bases' tables would take 64 MB). A row depends only on its position, so all agree."""
        if self._rope_tables is not None:
            return [(c[positions], s[positions]) for c, s in self._rope_tables]
        pos = np.asarray(positions, np.int64)
        top = int(pos.max()) + 1 if pos.size else 0
        factor = self.config.rope_scaling_factor
        if top > ROPE_CACHE_POSITIONS or (pos.size and pos.min() < 0):
            return [rope_rows(pos, f, factor) for f in self._inv_freqs]
        cache = getattr(self, "_rope_cache", [])
        if not cache or len(cache[0][0]) < top:
            n = min(ROPE_CACHE_POSITIONS, max(top, 2 * len(cache[0][0]) if cache else 0, 1024))
            cache = self._rope_cache = [rope_rows(np.arange(n), f, factor) for f in self._inv_freqs]
        return [(c[pos], s[pos]) for c, s in cache]

    @property
    def rope_tables(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per RoPE base, the whole ``cos, sin [max_len, D/2]`` tables (built when asked, for tests and tools)."""
        if self._rope_tables is not None:
            return self._rope_tables
        return self.rope_rows(np.arange(self.config.max_model_len))

    @property
    def cos(self) -> np.ndarray:
        """The first RoPE table's cosines ``[max_len, D/2]`` (every layer's, unless bases differ per layer)."""
        return self.rope_tables[0][0]

    @property
    def sin(self) -> np.ndarray:
        return self.rope_tables[0][1]

    def _qkv_bias(self, names: list[str]) -> np.ndarray:
        """float32 ``[(Hq + 2 Hkv) D]``: the fused bias, or Q, K, V biases (an absent one is zeros)."""
        if len(names) == 1:
            return self._rows(names[0], vector=True)
        cfg = self.config
        sizes = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim)
        parts = [
            self._rows(n, vector=True) if n in self._gguf.tensors else np.zeros(size, np.float32)
            for n, size in zip(names, sizes)
        ]
        return np.concatenate(parts)

    def _vector(self, name: str) -> np.ndarray:
        """A 1-D float32 tensor (norm weights, biases), read from the file (not through its map: a fault on a
        small tensor between two large ones maps pages around it, tens of MB over a model's norms)."""
        t = self._gguf.tensors[name]
        raw = self._gguf.read(name)
        if t.type == "F32":
            return raw.view(np.float32)
        return GGUFTensor(t.path, t.name, t.type, t.shape, raw).dequantize()

    def _rows(self, name: str, *, vector: bool = False) -> np.ndarray:
        """Stored rows ``uint8 [out, row_bytes]`` of a tensor, Q/K rows in the order ``rope_pairs`` rotates.

        ``vector``: a 1-D tensor (a bias, a Q/K norm) as float32 ``[out]``, its Q/K entries reordered the
        same way. A fused ``attn_qkv`` has its Q and K sections reordered, V left as stored.
        """
        cfg = self.config
        w = self._vector(name)[:, None] if vector else self._gguf.tensors[name].data
        if name.endswith(("attn_qkv.weight", "attn_qkv.bias")):
            nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            if {self.rope_pairs, self.native_rope_pairs} == {"half", "adjacent"}:
                q, k = self._reorder(w[:nq], cfg.num_heads), self._reorder(w[nq : nq + nkv], cfg.num_kv_heads)
                w = np.concatenate([q, k, w[nq + nkv :]])
        elif name.endswith(("attn_q.weight", "attn_k.weight", "attn_q.bias", "attn_k.bias")):
            w = self._reorder(w, cfg.num_heads if ".attn_q." in name else cfg.num_kv_heads)
        elif name.endswith(("attn_q_norm.weight", "attn_k_norm.weight")):
            w = self._reorder(w, 1)  # one head's worth of entries
        return np.ascontiguousarray(w[:, 0], np.float32) if vector else w

    def _reorder(self, w: np.ndarray, heads: int) -> np.ndarray:
        """Q or K rows ``[heads * D, ...]`` from the file's order into the order ``rope_pairs`` rotates."""
        if self.rope_pairs == "half" and self.native_rope_pairs == "adjacent":
            return unpermute_rope_rows(w, heads)
        if self.rope_pairs == "adjacent" and self.native_rope_pairs == "half":
            return permute_rope_rows(w, heads)
        return w

    def _lm_head(self) -> Any:
        """The output projection in the chosen format: an sgemm for float32 weights (an int8 head beside
        float32 layers was slower at 32 sequences and no faster at one)."""
        name = "token_embd.weight" if self.config.tie_embeddings else "output.weight"
        t = self._gguf.tensors[name]
        small = t.data.nbytes <= HEAD_CHUNK_BYTES
        if self.weight_format != "int8" or small or t.type not in RAW_TYPES or t.shape[1] % 32:
            return self._linear([name])
        # A large int8 head (Gemma 3: 262,144 x 640 Q8_0, 178 MB) is built in row chunks, each chunk's file
        # pages dropped before the next is read: the file's copy and the head's never sit in memory whole
        # together (peak RSS). Each chunk's logits are the bits one matrix would give.
        rows = max(LINEAR_PANEL, HEAD_CHUNK_BYTES // t.data.shape[1] // LINEAR_PANEL * LINEAR_PANEL)
        parts = []
        for lo in range(0, t.shape[0], rows):
            parts.append(self._linear([name], rows=(lo, min(lo + rows, t.shape[0]))))
        return ChunkedLinear(parts)

    def _linear(self, names: list[str], *, int8: Optional[bool] = None, rows: Optional[tuple[int, int]] = None) -> Any:
        """One linear layer whose output features are the named ``[out, in]`` tensors' rows, in order.

        ``rows``: just rows ``lo..hi`` of the one named tensor (a chunk of a large head)."""
        g = self._gguf
        ts = [g.tensors[n] for n in names]
        if rows is not None:
            lo, hi = rows
            t = ts[0]
            ts = [GGUFTensor(t.path, t.name, t.type, (hi - lo,) + t.shape[1:], t.data[lo:hi])]
            q = _core_qlinear().QLinear.stack_gguf([(np.ascontiguousarray(ts[0].data), t.type)], t.shape[1], names)
            g.release_rows(names[0], lo, hi)
            return Int8Linear(q)
        shape = (sum(t.shape[0] for t in ts), ts[0].shape[1])
        kinds = {t.type for t in ts}
        if not (self.weight_format == "int8" if int8 is None else int8):
            w = self._dequantize(names, shape)
            g.release(*names)
            return FloatLinear(w.T)  # x @ w.T: one sgemm on the transposed view, no copy
        from pagedkv_rs import _core

        if kinds <= set(RAW_TYPES) and shape[1] % 32 == 0:
            parts = [(np.ascontiguousarray(self._rows(n)), g.tensors[n].type) for n in names]
            try:
                q = _core.QLinear.stack_gguf(parts, shape[1], names)
            except ValueError as e:  # "tensor 'NAME': row r, block b: scale is not finite"
                raise GGUFError(f"{g.path}: {e}") from None
        else:
            q = _core.QLinear.from_float(self._dequantize(names, shape))
        g.release(*names)
        return Int8Linear(q)

    def _dequantize(self, names: list[str], shape: tuple[int, int]) -> np.ndarray:
        """float32 ``[out, in]`` of the named tensors stacked, each decoded straight into its rows."""
        w = np.empty(shape, np.float32)
        at = 0
        for n in names:
            t = self._gguf.tensors[n]
            rows = GGUFTensor(t.path, n, t.type, t.shape, self._rows(n))
            rows.dequantize(out=w[at : at + t.shape[0]])
            at += t.shape[0]
        return w

    @classmethod
    def load(cls, path: Any = None, *, rope_pairs: str = "half", weights: str = "auto") -> LlamaWeights:
        return cls(path if isinstance(path, GGUFFile) else load_gguf(path), rope_pairs=rope_pairs, weights=weights)


_MALLOC_TRIM: Any = None


def _trim_heap() -> None:
    """Hand the heap's free pages back to the OS (glibc ``malloc_trim``) between layers.

    Building a layer frees tens of MB of temporaries; glibc keeps such blocks in its heap once its
    mmap threshold has grown, which on a 1B model left ~55 MB of dead pages in the resident set.
    """
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        _MALLOC_TRIM = False
        try:
            import ctypes

            _MALLOC_TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            pass
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


# ---- per-token math shared by both forwards -------------------------------------------------


def linear(x: np.ndarray, w: Any) -> np.ndarray:
    """x: [T, in] -> [T, out] through a ``FloatLinear``/``Int8Linear`` (a named function for profiles)."""
    return w(x)


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float, residual: Optional[np.ndarray] = None) -> np.ndarray:
    """x: [T, H] -> [T, H]; with ``residual``: ``residual += x`` first and normalise that (one pass)."""
    return kernels().rms_norm(np.ascontiguousarray(x, np.float32), w, eps, residual=residual)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, mode: str) -> np.ndarray:
    """Rotate x: [T, heads, D] by cos/sin: [T, D/2]; returns a new C-contiguous float32 array."""
    c = cos[:, None, :]
    s = sin[:, None, :]
    out = np.empty(x.shape, np.float32)
    if mode == "half":
        h = x.shape[-1] // 2
        x1, x2 = x[..., :h], x[..., h:]
        np.subtract(x1 * c, x2 * s, out=out[..., :h])
        np.add(x2 * c, x1 * s, out=out[..., h:])
    else:  # GGUF row order: rotated pairs are (2i, 2i+1)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        np.subtract(x1 * c, x2 * s, out=out[..., 0::2])
        np.add(x2 * c, x1 * s, out=out[..., 1::2])
    return out


def gated_mlp(h: np.ndarray, layer: dict[str, Any], activation: str = "silu") -> np.ndarray:
    """h: [T, H] -> [T, H]: one fused gate/up projection, ``act(gate) * up``, the down projection.

    ``activation``: "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU)."""
    gu = linear(h, layer["wgu"])  # [T, 2F]
    act = kernels().gelu_tanh_and_mul if activation == "gelu_tanh" else kernels().silu_and_mul
    return linear(act(gu), layer["wdown"])


def swiglu_mlp(h: np.ndarray, layer: dict[str, Any]) -> np.ndarray:
    """h: [T, H] -> [T, H]: ``gated_mlp`` with SiLU."""
    return gated_mlp(h, layer, "silu")


def qk_norm(x: np.ndarray, weight: Optional[np.ndarray], eps: float) -> np.ndarray:
    """x: [T, heads, D] -> each head RMS-normed by ``weight [D]`` (Qwen3, Gemma 3); x itself without one."""
    if weight is None:
        return x
    n, heads, d = x.shape
    return rms_norm(x.reshape(n * heads, d), weight, eps).reshape(n, heads, d)


def layer_window(cfg: LlamaConfig, layer: dict[str, Any], i: int) -> Optional[int]:
    """Layer ``i``'s sliding window: the layer's own entry, else the config's."""
    return layer["window"] if "window" in layer else cfg.layer_window(i)


def _rope_mode(w: LlamaWeights) -> str:
    # "mismatched": the file's row order rotated the other way, wrong on purpose (a test shows it is caught).
    wrong = "adjacent" if w.native_rope_pairs == "half" else "half"
    return {"half": "half", "adjacent": "adjacent", "mismatched": wrong}[w.rope_pairs]


# ---- the paged model (engine Model protocol) ------------------------------------------------


class LlamaModel:
    """Llama forward over the paged KV cache; implements the engine's ``Model`` protocol.

    ``impl``: ``"fused"`` (the decoder stack in one Rust call per step; needs int8 weights and the
    Rust kernels), ``"numpy"`` (one kernel call per operation from Python), or ``"auto"`` (default:
    fused when the weights and kernels allow it). ``self.impl`` is the one chosen.
    """

    def __init__(
        self,
        weights: LlamaWeights,
        *,
        eos_token_ids: Sequence[int] = (),
        kernel: Any = None,
        impl: str = "auto",
    ):
        cfg = weights.config
        self.weights = weights
        self.config = cfg
        self.num_layers = cfg.num_layers
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.hidden_size = cfg.hidden_size
        self.vocab_size = cfg.vocab_size
        self.max_model_len = cfg.max_model_len
        self.eos_token_ids: tuple[int, ...] = tuple(int(e) for e in eos_token_ids)
        self.kernel = kernel if kernel is not None else kernels()
        self._mode = _rope_mode(weights)
        self._fingerprint: Optional[str] = None
        if impl not in MODEL_IMPLS:
            raise ValueError(f"impl must be one of {MODEL_IMPLS}, got {impl!r}")
        why = fused_unavailable(weights, self.kernel)
        if impl == "fused" and why is not None:
            raise ValueError(f"impl='fused' is not available: {why}")
        self.impl: str = "numpy" if impl == "numpy" or why is not None else "fused"
        self._decoder = _fused_decoder(weights, self._mode) if self.impl == "fused" else None
        # The fused call also runs the final norm and lm_head when the head is a QLinear.
        self._fused_head = self._decoder is not None and self._decoder.vocab_size is not None

    def kv_fingerprint(self) -> str:
        """What the K/V depend on (for the KV tiers): SHA-256 of the GGUF file, the config, the weight
        format and the RoPE mode. Hashes the file once (~0.3 s for SmolLM2's 98 MB), only when asked."""
        if self._fingerprint is None:
            import hashlib
            import mmap

            h = hashlib.sha256()
            with open(self.weights.path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                h.update(mm)
            self._fingerprint = (
                f"gguf-sha256={h.hexdigest()};config={self.config!r};weights={self.weights.weight_format};"
                f"rope={self._mode}"
            )
        ones = sorted(name for name, d in self.weights.act_digits.items() if d == 1)
        if ones:  # the K/V of later layers depend on the activation digits
            return f"{self._fingerprint};act1={','.join(ones)}"
        return self._fingerprint

    @classmethod
    def load(cls, path: Any = None, *, weights: str = "auto", impl: str = "auto") -> LlamaModel:
        """Load a GGUF path (``None``: the bundled SmolLM2) with its EOS ids."""
        g = path if isinstance(path, GGUFFile) else load_gguf(path)
        return cls(LlamaWeights(g, weights=weights), eos_token_ids=eos_ids_from_metadata(g.metadata), impl=impl)

    def new_kv_caches(
        self, num_blocks: int, block_size: int, dtype: Any = "float16"
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """One ``(k_cache, v_cache)`` pair per layer, ``[num_blocks, Hkv, block_size, D]`` each."""
        return [
            self.kernel.new_kv_cache(num_blocks, block_size, self.num_kv_heads, self.head_dim, dtype)
            for _ in range(self.num_layers)
        ]

    def kv_bytes_per_block(self, block_size: int, dtype: Any = "float16") -> int:
        """Bytes one block takes across all layers, K and V."""
        itemsize = np.dtype(_np_dtype(dtype)).itemsize
        return 2 * self.num_layers * self.num_kv_heads * block_size * self.head_dim * itemsize

    def forward(
        self,
        batch: BatchInputs,
        kv_caches: list[tuple[np.ndarray, np.ndarray]],
        logits_indices: Optional[np.ndarray] = None,
        out: Optional[np.ndarray] = None,
    ) -> np.ndarray:
        """Float32 logits ``[B, V]`` for each sequence's last scheduled token of this step.

        ``logits_indices`` (int [N], into the step's T tokens): logits ``[N, V]`` of those tokens instead.
        ``out``: a C-contiguous writeable float32 array of that shape to write them into and return (a buffer
        reused step after step), else a new array.
        """
        qsl = np.asarray(batch.query_start_loc, np.int64)
        if np.any(qsl[1:] <= qsl[:-1]):
            raise ValueError("every sequence in a forward batch needs at least one scheduled token")
        rows = qsl[1:] - 1 if logits_indices is None else np.asarray(logits_indices, np.int64)
        if out is not None:  # checked before any K/V is written
            shape = (len(rows), self.vocab_size)
            ok = isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == shape
            if not (ok and out.flags.c_contiguous and out.flags.writeable):
                raise ValueError(
                    f"out must be a C-contiguous writeable float32 array of shape {shape}, got "
                    f"{getattr(out, 'dtype', type(out).__name__)} {getattr(out, 'shape', '')}"
                )
        if self._fused_head:  # layers, final norm and lm_head in one GIL-free call
            x, pos = self._embedded(batch, kv_caches)
            return self._decoder.forward(x, batch, kv_caches, rows, rope=self.weights.rope_rows(pos), out=out)
        hidden = self.forward_hidden(batch, kv_caches)
        logits = self.compute_logits(self.final_norm(hidden[rows]))  # [N, V]
        if out is None:
            return logits
        out[...] = logits
        return out

    def final_norm(self, hidden: np.ndarray) -> np.ndarray:
        """The final RMSNorm of residual-stream rows ``[N, H]`` (the hidden states embeddings pool)."""
        return rms_norm(hidden, self.weights.final_norm, self.config.rms_eps)

    def compute_logits(self, normed: np.ndarray) -> np.ndarray:
        """Logits ``[N, V]`` of final-normed rows ``[N, H]``: the lm_head."""
        return linear(normed, self.weights.lm_head)

    def forward_hidden(self, batch: BatchInputs, kv_caches: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
        """Residual stream ``[T, H]`` after the last layer (before the final norm)."""
        x, pos = self._embedded(batch, kv_caches)
        if self._decoder is not None:
            return self._decoder.forward_hidden(x, batch, kv_caches, rope=self.weights.rope_rows(pos))
        return self._forward_hidden_numpy(x, pos, batch, kv_caches)

    def _embedded(
        self, batch: BatchInputs, kv_caches: list[tuple[np.ndarray, np.ndarray]]
    ) -> tuple[np.ndarray, np.ndarray]:
        """The step's checked ids embedded, float32 ``[T, H]`` (a copy: the residual stream), and int64 positions."""
        cfg, w = self.config, self.weights
        if len(kv_caches) != cfg.num_layers:
            raise ValueError(f"need {cfg.num_layers} (k_cache, v_cache) pairs, got {len(kv_caches)}")
        ids = np.asarray(batch.input_ids, np.int64)
        pos = np.asarray(batch.positions, np.int64)
        n = ids.shape[0]
        if n and (ids.min() < 0 or ids.max() >= cfg.vocab_size):
            raise ValueError(f"token ids must be in [0, {cfg.vocab_size})")
        if n and (pos.min() < 0 or pos.max() >= cfg.max_model_len):
            raise ValueError(f"positions must be in [0, {cfg.max_model_len})")
        x = np.ascontiguousarray(w.embed[ids], np.float32)
        scale = getattr(cfg, "embedding_scale", 1.0)
        if scale != 1.0:  # Gemma: embeddings times sqrt(hidden), in float32 as llama.cpp's ggml_scale
            x *= np.float32(scale)
        return x, pos

    def _forward_hidden_numpy(
        self, x: np.ndarray, pos: np.ndarray, batch: BatchInputs, kv_caches: list[tuple[np.ndarray, np.ndarray]]
    ) -> np.ndarray:
        """The numpy spec of ``forward_hidden``: x [T, H] embedded tokens -> residual stream [T, H]."""
        cfg, w, kern = self.config, self.weights, self.kernel
        n = x.shape[0]
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        nq, nk = hq * d, hkv * d
        act = cfg.spec.activation
        tables = w.rope_rows(pos)  # [T, D/2] cos/sin rows of each RoPE base
        attn = np.empty((n, hq, d), np.float32)
        delta: Optional[np.ndarray] = None  # the last sublayer's output, not yet added to x
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(w.layers, kv_caches)):
            h = (
                rms_norm(x, layer["attn_norm"], cfg.rms_eps)
                if delta is None
                else rms_norm(delta, layer["attn_norm"], cfg.rms_eps, residual=x)
            )
            qkv = linear(h, layer["wqkv"])  # [T, (Hq + 2 Hkv) D]
            if layer.get("bqkv") is not None:  # Qwen2
                qkv += layer["bqkv"]
            cos, sin = tables[layer.get("rope_table", 0)]
            q = qk_norm(qkv[:, :nq].reshape(n, hq, d), layer.get("q_norm"), cfg.rms_eps)
            k = qk_norm(qkv[:, nq : nq + nk].reshape(n, hkv, d), layer.get("k_norm"), cfg.rms_eps)
            q = apply_rope(q, cos, sin, self._mode)
            k = apply_rope(k, cos, sin, self._mode)
            v = np.ascontiguousarray(qkv[:, nq + nk :]).reshape(n, hkv, d)
            kern.write_kv(k_cache, v_cache, k, v, batch.slot_mapping)
            kern.paged_attention(
                q,
                k_cache,
                v_cache,
                batch.block_tables,
                batch.seq_lens,
                batch.query_start_loc,
                scale=cfg.attention_scale,
                sliding_window=layer_window(cfg, layer, i),
                out=attn,
            )
            o = linear(attn.reshape(n, nq), layer["wo"])
            if layer.get("post_attn_norm") is not None:  # Gemma 3
                o = rms_norm(o, layer["post_attn_norm"], cfg.rms_eps)
            h = rms_norm(o, layer["ffn_norm"], cfg.rms_eps, residual=x)
            delta = gated_mlp(h, layer, act)
            if layer.get("post_ffn_norm") is not None:  # Gemma 3
                delta = rms_norm(delta, layer["post_ffn_norm"], cfg.rms_eps)
        if delta is not None:
            x += delta
        return x


def fused_unavailable(weights: LlamaWeights, kernel: Any = None) -> Optional[str]:
    """Why ``impl="fused"`` cannot run these weights (``None`` when it can)."""
    try:
        from pagedkv_rs import _core
    except ImportError:
        return "the Rust core pagedkv_rs._core is not built"
    if not hasattr(_core, "LlamaDecoder"):
        return "this build of pagedkv_rs._core has no LlamaDecoder"
    source = getattr(kernel, "kernel_source", None)
    if source is not None and source() != "rust":
        return f"the kernel source is {source()!r} (the fused decoder runs the Rust kernels)"
    if any(not isinstance(layer[k], Int8Linear) for layer in weights.layers for k in ("wqkv", "wo", "wgu", "wdown")):
        return f"it runs int8 weights (QLinear), these are {weights.weight_format} (load with weights='int8')"
    return None


def _fused_decoder(weights: LlamaWeights, mode: str) -> Any:
    from pagedkv_rs import _core

    cfg = weights.config
    head = weights.lm_head
    int8_head = isinstance(head, (Int8Linear, ChunkedLinear))
    c = np.ascontiguousarray
    layers = []
    for i, layer in enumerate(weights.layers):
        entry: dict[str, Any] = {
            "attn_norm": c(layer["attn_norm"], np.float32),
            "ffn_norm": c(layer["ffn_norm"], np.float32),
            **{k: layer[k].q for k in ("wqkv", "wo", "wgu", "wdown")},
            "rope_table": layer.get("rope_table", 0),
            "sliding_window": layer_window(cfg, layer, i),
        }
        for k in ("bqkv", "q_norm", "k_norm", "post_attn_norm", "post_ffn_norm"):
            if layer.get(k) is not None:
                entry[k] = c(layer[k], np.float32)
        layers.append(entry)
    dec = _core.LlamaDecoder(
        layers,
        head_dim=cfg.head_dim,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        rms_eps=cfg.rms_eps,
        rope_mode=mode,
        final_norm=c(weights.final_norm, np.float32) if int8_head else None,
        lm_head=head.q if int8_head else None,
        rope_tables=weights.num_rope_tables,
        activation=cfg.spec.activation,
        attn_scale=cfg.attention_scale,
    )
    return dec


def eos_ids_from_metadata(meta: dict[str, Any]) -> tuple[int, ...]:
    """The EOS id plus ``<|endoftext|>``-style end tokens the vocabulary marks as control tokens."""
    ids: list[int] = []
    eos = meta.get("tokenizer.ggml.eos_token_id")
    if eos is not None:
        ids.append(int(eos))
    tokens = meta.get("tokenizer.ggml.tokens") or []
    for name in ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "</s>"):
        if name in tokens[:512]:
            i = tokens.index(name)
            if i not in ids:
                ids.append(i)
    return tuple(ids)


def _np_dtype(dtype: Any) -> Any:
    if isinstance(dtype, str) and dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return dtype


# ---- dense reference ------------------------------------------------------------------------
