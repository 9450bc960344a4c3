"""Random-weight GGUF files of every supported architecture, written with ``gguf.GGUFWriter`` tensor by tensor.

Two kinds of weights:

- random blocks (``SyntheticSpec.vocab is None``): for tests (tiny dims, every quant type and variant) and the
  1B-class benchmark. Quantized tensors are random blocks (codes uniform, f16 scales chosen so weights have std
  ~ 1/sqrt(in)), generated and written one tensor at a time, so a 4 GB model never sits in RAM. The vocabulary is
  byte-level GPT-2 (256 byte tokens, one merge, fillers), enough for ``GGUFTokenizer``.
- realistic (``vocab`` = a vocab-only GGUF, e.g. one of llama.cpp's test vocabularies): every ``tokenizer.*`` key
  is copied from it, and float weights with realistic scales (norms ~1, std 1/sqrt(in) plus a few larger
  directions, embedding rows of varied norms, logits of std ~4 so top-1 margins are clear) are quantized here
  (K-quants by the encoders below). ``write_synthetic_gguf(..., dequantized=True)`` writes the same weights
  dequantized to F32: llama.cpp's own quantized-vs-F32 difference is the tolerance of the agreement tests.

Layout knobs (``fused_qkv``, ``fused_gate_up``, ``qk_norm``, ``post_norms``: None is the architecture's own layout;
``biases``) and deliberate defects (``extra_meta``, ``extra_tensors``, ``shape_override``) make the files the
loader's tests read: each layout it accepts and each file it must refuse. An ``arch`` outside ``ARCHS`` gets
llama's layout (a file of an architecture the loader does not support).

``ARCH_SPECS`` holds one small model per architecture (llama, qwen2, qwen3, phi3, gemma3) with the tensor names,
shapes and metadata llama.cpp's loader expects for it (Q/K norms, fused ``attn_qkv`` and ``ffn_up`` = [gate; up],
post-norms, ``key_length`` different from hidden / heads, sliding window, tied embeddings) and mixed quant types.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from pagedkv_rs.models.tokenizer import _byte_alphabet

__all__ = [
    "ARCH_SPECS",
    "ARCH_VOCABS",
    "SyntheticSpec",
    "TINYLLAMA_1B",
    "quantize",
    "random_blocks",
    "write_synthetic_gguf",
]

ARCHS = ("llama", "qwen2", "qwen3", "phi3", "gemma3")

# type -> (elements per block, bytes per block, f16 scale offsets, weight std per unit of the first scale)
_BLOCKS: dict[str, tuple[int, int, tuple[int, ...], float]] = {
    "Q4_0": (32, 18, (0,), 4.6),
    "Q4_1": (32, 20, (0,), 4.6),
    "Q5_0": (32, 22, (0,), 9.2),
    "Q5_1": (32, 24, (0,), 9.2),
    "Q8_0": (32, 34, (0,), 74.0),
    "Q4_K": (256, 144, (0, 2), 143.0),
    "Q5_K": (256, 176, (0, 2), 290.0),
    "Q6_K": (256, 210, (208,), 1370.0),
}


@dataclass(frozen=True)
class SyntheticSpec:
    """Shape, types and variant of a synthetic model (``output_type=None``: tied embeddings).

    ``head_dim``: ``key_length``/``value_length`` when it differs from hidden / heads (Qwen3, Gemma 3).
    ``vocab``: path of a vocab-only GGUF whose ``tokenizer.*`` keys are copied (its token count is the
    vocabulary size; weights are then realistic floats quantized here, not random blocks).
    ``tensor_types``: ``(name, type)`` overrides, ``name`` a full tensor name or a leaf such as ``ffn_up.weight``.
    ``biases``: any of ``"q"``, ``"k"``, ``"v"`` (Qwen2 has all three), or ``("qkv",)`` for one fused bias.
    ``extra_meta``: key -> ``(value, GGUFValueType)`` added as given; ``extra_tensors``: name -> float32 array
    added as given; ``shape_override``: tensor name or leaf -> a wrong shape, written as float32 zeros.
    """

    arch: str = "llama"
    num_layers: int = 2
    hidden_size: int = 256
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512
    vocab_size: int = 512
    context_length: int = 256
    weight_type: str = "Q4_K"
    embed_type: str = "Q6_K"
    output_type: Optional[str] = None
    down_type: Optional[str] = None  # ffn_down / attn_v type (Q4_K_M uses Q6_K there); None: weight_type
    biases: tuple[str, ...] = ()
    sliding_window: Optional[int] = None
    rope_theta: float = 10000.0
    rope_scaling_linear: Optional[float] = None
    llama3_rope: Optional[tuple[float, float, float, int]] = None  # factor, low, high, original context
    rms_eps: float = 1e-5
    head_dim: Optional[int] = None
    vocab: Optional[str] = None
    tensor_types: tuple[tuple[str, str], ...] = ()
    fused_qkv: Optional[bool] = None  # one attn_qkv (None: phi3 only)
    fused_gate_up: Optional[bool] = None  # ffn_up = [gate; up] (None: phi3 only)
    qk_norm: Optional[bool] = None  # attn_q_norm / attn_k_norm (None: qwen3, gemma3)
    post_norms: Optional[bool] = None  # post_attention_norm / post_ffw_norm (None: gemma3)
    extra_meta: Mapping[str, tuple[Any, Any]] = field(default_factory=dict)
    extra_tensors: Mapping[str, np.ndarray] = field(default_factory=dict)
    shape_override: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    def _layout(self, knob: Optional[bool], *archs: str) -> bool:
        return self.arch in archs if knob is None else knob

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def num_params(self) -> int:
        h, f, hd = self.hidden_size, self.intermediate_size, self.head_size
        layer = h * hd * (2 * self.num_heads + 2 * self.num_kv_heads) + 3 * h * f + 2 * h
        out = 0 if self.output_type is None else self.vocab_size * h
        return self.num_layers * layer + self.vocab_size * h + out + h


# TinyLlama-1.1B's shape: 1.10B parameters with an untied output head.
TINYLLAMA_1B = SyntheticSpec(
    num_layers=22,
    hidden_size=2048,
    num_heads=32,
    num_kv_heads=4,
    intermediate_size=5632,
    vocab_size=32000,
    context_length=2048,
    weight_type="Q4_1",
    embed_type="Q8_0",
    output_type="Q8_0",
)

# One small model per architecture, with llama.cpp's test vocabulary of that family (``ARCH_VOCABS``: the
# ``ggml-vocab-<name>.gguf`` file to pass as ``vocab``). Hidden 256 so every matrix can be a K-quant; the quant
# types are mixed as llama.cpp's Q4_K_M mixes them (Q4_K/Q5_K projections, Q6_K/Q8_0 V and down, Q5_0 K, one
# F16 matrix).
_MIXED = (
    ("attn_k.weight", "Q5_0"),
    ("attn_v.weight", "Q8_0"),
    ("attn_output.weight", "Q5_K"),
    ("ffn_up.weight", "Q5_K"),
    ("blk.1.ffn_gate.weight", "Q5_0"),
    ("blk.1.attn_q.weight", "F16"),
    ("blk.1.attn_qkv.weight", "F16"),
)
ARCH_SPECS: dict[str, SyntheticSpec] = {
    "llama": SyntheticSpec(
        arch="llama",
        num_layers=3,
        embed_type="Q8_0",
        output_type="Q6_K",
        down_type="Q6_K",
        rope_theta=500000.0,
        llama3_rope=(8.0, 1.0, 4.0, 64),
        tensor_types=_MIXED,
    ),
    "qwen2": SyntheticSpec(
        arch="qwen2",
        num_layers=3,
        embed_type="Q6_K",
        output_type="Q8_0",
        down_type="Q6_K",
        biases=("q", "k", "v"),
        rope_theta=1000000.0,
        rms_eps=1e-6,
        tensor_types=_MIXED,
    ),
    "qwen3": SyntheticSpec(
        arch="qwen3",
        num_layers=3,
        head_dim=128,
        embed_type="Q6_K",
        down_type="Q6_K",
        rope_theta=1000000.0,
        rms_eps=1e-6,
        tensor_types=_MIXED,
    ),
    "phi3": SyntheticSpec(
        arch="phi3",
        num_layers=3,
        num_kv_heads=4,
        embed_type="Q6_K",
        output_type="Q6_K",
        down_type="Q6_K",
        sliding_window=24,  # written as Phi-3 files carry it; llama.cpp ignores it for phi3
        tensor_types=_MIXED + (("attn_qkv.weight", "Q5_K"),),
    ),
    "gemma3": SyntheticSpec(
        arch="gemma3",
        num_layers=6,  # layers 0-4 local (sliding window), layer 5 global
        num_kv_heads=1,
        head_dim=128,
        embed_type="Q8_0",
        down_type="Q6_K",
        sliding_window=16,
        rope_theta=1000000.0,
        rms_eps=1e-6,
        tensor_types=_MIXED,
    ),
}
ARCH_VOCABS = {"llama": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2", "phi3": "phi-3", "gemma3": "llama-spm"}


def llama3_freq_factors(d: int, theta: float, factor: float, low: float, high: float, orig: int) -> np.ndarray:
    """Llama 3's per-pair RoPE divisors as Hugging Face computes them (what llama.cpp's converter writes)."""
    inv_freq = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    wavelen = 2 * np.pi / inv_freq
    low_wl, high_wl = orig / low, orig / high
    smooth = (orig / wavelen - low) / (high - low)
    scaled = np.where(wavelen > low_wl, inv_freq / factor, inv_freq)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    scaled = np.where((wavelen >= high_wl) & (wavelen <= low_wl), mid, scaled)
    return (inv_freq / scaled).astype(np.float32)


def random_blocks(rng: np.random.Generator, ggml_type: str, rows: int, cols: int, std: float) -> np.ndarray:
    """uint8 ``[rows, row_bytes]`` of random ``ggml_type`` blocks whose weights have roughly ``std``."""
    el, bb, offs, unit = _BLOCKS[ggml_type]
    raw = rng.integers(0, 256, (rows, cols // el, bb), dtype=np.uint8)
    d = (std / unit * rng.uniform(0.5, 1.5, raw.shape[:2])).astype(np.float16)
    raw[..., offs[0] : offs[0] + 2] = d[..., None].view(np.uint8)
    if ggml_type in ("Q4_1", "Q5_1"):  # m = -(levels/2) d: centred weights
        half = 7.5 if ggml_type == "Q4_1" else 15.5
        raw[..., 2:4] = (-half * d.astype(np.float32)).astype(np.float16)[..., None].view(np.uint8)
    if len(offs) > 1:  # K-quant dmin: a quarter of d
        raw[..., offs[1] : offs[1] + 2] = (d / 4).astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


# ---- quantizers: float32 -> ggml blocks (gguf-py has no K-quant encoder) ----------------------------------------
# Plain round-to-nearest on ggml's grids (llama.cpp's quantize searches scales; the file need only be valid
# ggml data, which gguf-py's dequantizer and llama.cpp read back). Q6_K: 16 sub-blocks of 16, int8 scales;
# Q4_K/Q5_K: 8 sub-blocks of 32, 6-bit scales and mins packed in 12 bytes.


def _f16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(np.float16)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros(np.broadcast(a, b).shape, np.float32), where=b != 0)


def _quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """float32 [n, 256] -> uint8 [n, 210]: ql[128], qh[64], int8 scales[16], f16 d."""
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    peak = np.take_along_axis(sub, np.abs(sub).argmax(-1)[..., None], -1)[..., 0]
    s = peak / -32.0  # the extreme value of each 16 lands on -32, as ggml's make_qx_quants does
    d16 = _f16(np.abs(s).max(-1) / 127.0)
    d = d16.astype(np.float32)
    sc = np.clip(np.rint(_safe_div(s, d[:, None])), -128, 127).astype(np.int8)
    eff = (d[:, None] * sc)[..., None]
    q = (np.clip(np.rint(_safe_div(sub, eff)), -32, 31) + 32).astype(np.uint8).reshape(n, 2, 4, 32)
    ql = (q[:, :, [0, 1]] & 15 | (q[:, :, [2, 3]] & 15) << 4).reshape(n, 2, 64)
    qh = (q[:, :, 0] >> 4) | (q[:, :, 1] >> 4) << 2 | (q[:, :, 2] >> 4) << 4 | (q[:, :, 3] >> 4) << 6
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), d16[:, None].view(np.uint8)], 1)


def _quantize_kx(x: np.ndarray, bits: int) -> np.ndarray:
    """float32 [n, 256] -> Q4_K (bits 4: d, dmin, scales[12], qs[128]) or Q5_K (bits 5: ... qh[32], qs[128])."""
    n, levels = x.shape[0], (1 << bits) - 1
    sub = x.reshape(n, 8, 32)
    lo, hi = np.minimum(sub.min(-1), 0.0), sub.max(-1)
    s = (hi - lo) / levels
    d16, dm16 = _f16(s.max(-1) / 63.0), _f16(-lo.min(-1) / 63.0)
    d, dm = d16.astype(np.float32)[:, None], dm16.astype(np.float32)[:, None]
    sc = np.clip(np.rint(_safe_div(s, d)), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(_safe_div(-lo, dm)), 0, 63).astype(np.uint8)
    q = _safe_div(sub + (dm * mn)[..., None], (d * sc)[..., None])
    q = np.clip(np.rint(q), 0, levels).astype(np.uint8)  # [n, 8, 32]
    packed = np.empty((n, 12), np.uint8)  # sub-blocks 0-3 in the low 6 bits, 4-7 split over the rest
    packed[:, 0:4] = (sc[:, :4] & 63) | (sc[:, 4:] >> 4) << 6
    packed[:, 4:8] = (mn[:, :4] & 63) | (mn[:, 4:] >> 4) << 6
    packed[:, 8:12] = (sc[:, 4:] & 15) | (mn[:, 4:] & 15) << 4
    low = (q & 15).reshape(n, 4, 2, 32)
    parts = [d16[:, None].view(np.uint8), dm16[:, None].view(np.uint8), packed]
    if bits == 5:  # bit j of qh[l]: the fifth bit of element l of sub-block j
        parts.append(np.bitwise_or.reduce((q >> 4 & 1) << np.arange(8, dtype=np.uint8)[None, :, None], axis=1))
    parts.append((low[:, :, 0] | low[:, :, 1] << 4).reshape(n, 128))
    return np.concatenate(parts, 1)


def quantize(x: np.ndarray, ggml_type: str) -> tuple[np.ndarray, Any]:
    """float32 ``[rows, cols]`` -> (the tensor's data as written, raw ggml type or None for F32/F16)."""
    from gguf import GGMLQuantizationType, quants

    x = np.ascontiguousarray(x, np.float32)
    if ggml_type == "F32":
        return x, None
    if ggml_type == "F16":
        return x.astype(np.float16), None
    qt = GGMLQuantizationType[ggml_type]
    if ggml_type in ("Q4_K", "Q5_K", "Q6_K"):
        blocks = x.reshape(-1, 256)
        enc = _quantize_q6_k(blocks) if ggml_type == "Q6_K" else _quantize_kx(blocks, 4 if ggml_type == "Q4_K" else 5)
        return enc.reshape(x.shape[0], -1), qt
    return quants.quantize(x, qt), qt


def _dequantized(arr: np.ndarray, qt: Any) -> np.ndarray:
    from gguf import quants

    if qt is None:
        return arr.astype(np.float32)
    return quants.dequantize(arr, qt).astype(np.float32)


def _tensor(rng: np.random.Generator, ggml_type: str, rows: int, cols: int) -> tuple[np.ndarray, Any]:
    std = 1.0 / np.sqrt(cols)
    if ggml_type in _BLOCKS:
        from gguf import GGMLQuantizationType

        return random_blocks(rng, ggml_type, rows, cols, std), GGMLQuantizationType[ggml_type]
    return quantize(rng.standard_normal((rows, cols), np.float32) * np.float32(std), ggml_type)


_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _byte_vocab(n: int) -> list[str]:
    """GPT-2's byte-to-unicode table (256 tokens) then fillers up to ``n``."""
    alphabet = _byte_alphabet()
    byte_tokens = [alphabet[b] for b in range(256)]
    specials = list(_SPECIALS)
    fill = [f"<|x{i}|>" for i in range(max(0, n - 257 - len(specials)))]
    return (specials + byte_tokens + ["Ġt"] + fill)[:n]


_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def _read_kv(path: str) -> list[tuple[str, int, Any, Optional[int]]]:
    """A GGUF file's metadata as ``(key, value type, value, array item type)``, types kept for writing back.

    (gguf's GGUFReader takes minutes on a 280k-merge vocabulary; this reads it in a second.)
    """
    import struct

    with open(path, "rb") as fh:
        buf = fh.read()
    pos = 0

    def take(fmt: str) -> Any:
        nonlocal pos
        (v,) = struct.unpack_from("<" + fmt, buf, pos)
        pos += struct.calcsize("<" + fmt)
        return v

    def string() -> str:
        nonlocal pos
        n = take("Q")
        pos += n
        return buf[pos - n : pos].decode("utf-8")

    if buf[:4] != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file")
    pos = 8
    take("Q")
    out = []
    for _ in range(take("Q")):
        key, vtype = string(), take("I")
        if vtype == 9:
            itype, count = take("I"), take("Q")
            if itype == 8:
                val: Any = [string() for _ in range(count)]
            else:
                dt = np.dtype("<" + _GGUF_SCALARS[itype])
                val = np.frombuffer(buf, dt, count, pos).tolist()
                pos += count * dt.itemsize
            out.append((key, vtype, val, itype))
        else:
            out.append((key, vtype, string() if vtype == 8 else take(_GGUF_SCALARS[vtype]), None))
    return out


def _copy_tokenizer(w: Any, vocab_path: str) -> int:
    """Copy every ``tokenizer.*`` key of a vocab-only GGUF into writer ``w``; returns its token count."""
    from gguf import GGUFValueType

    n = 0
    for key, vtype, val, itype in _read_kv(vocab_path):
        if key.startswith("tokenizer."):
            sub = None if itype is None else GGUFValueType(itype)
            w.add_key_value(key, val, GGUFValueType(vtype), sub_type=sub)
            n = len(val) if key == "tokenizer.ggml.tokens" else n
    if not n:
        raise ValueError(f"{vocab_path}: no tokenizer.ggml.tokens")
    return n


def _tensor_type(spec: SyntheticSpec, name: str, default: str) -> str:
    leaf = name.split(".", 2)[-1] if name.startswith("blk.") else name
    types = dict(spec.tensor_types)
    return types.get(name, types.get(leaf, default))


# (name, shape in torch order, type, kind); kind picks how the weights are drawn.
_Entry = tuple[str, tuple[int, ...], str, str]


def _plan(spec: SyntheticSpec, vocab_size: int) -> list[_Entry]:
    """Every tensor of ``spec`` in file order, as llama.cpp's loader names and shapes them for ``spec.arch``."""
    h, f, hq, hkv, d = spec.hidden_size, spec.intermediate_size, spec.num_heads, spec.num_kv_heads, spec.head_size
    bias_rows = {"q": hq * d, "k": hkv * d, "v": hkv * d, "qkv": (hq + 2 * hkv) * d}
    if not set(spec.biases) <= set(bias_rows):
        raise ValueError(f"biases must be among 'q', 'k', 'v', 'qkv', got {spec.biases!r}")
    plan: list[_Entry] = [("token_embd.weight", (vocab_size, h), spec.embed_type, "embed")]
    if spec.llama3_rope is not None:
        plan.append(("rope_freqs.weight", (d // 2,), "F32", "rope_freqs"))
    qk_norm = spec._layout(spec.qk_norm, "qwen3", "gemma3")
    post_norms = spec._layout(spec.post_norms, "gemma3")
    fused_qkv = spec._layout(spec.fused_qkv, "phi3")
    fused_gate_up = spec._layout(spec.fused_gate_up, "phi3")
    for i in range(spec.num_layers):
        b = f"blk.{i}."
        wt, dt = spec.weight_type, spec.down_type or spec.weight_type

        def mat(leaf: str, rows: int, cols: int, ty: str, kind: str = "matrix", b: str = b) -> _Entry:
            return (b + leaf, (rows, cols), _tensor_type(spec, b + leaf, ty), kind)

        plan.append((b + "attn_norm.weight", (h,), "F32", "norm"))
        if fused_qkv:
            plan.append(mat("attn_qkv.weight", (hq + 2 * hkv) * d, h, wt, "qkv"))
        else:
            plan += [
                mat("attn_q.weight", hq * d, h, wt, "qk"),
                mat("attn_k.weight", hkv * d, h, wt, "qk"),
                mat("attn_v.weight", hkv * d, h, dt),
            ]
        if qk_norm:
            plan += [
                (b + "attn_q_norm.weight", (d,), "F32", "qk_norm"),
                (b + "attn_k_norm.weight", (d,), "F32", "qk_norm"),
            ]
        plan.append(mat("attn_output.weight", h, hq * d, wt))
        if post_norms:
            plan.append((b + "post_attention_norm.weight", (h,), "F32", "norm"))
        plan.append((b + "ffn_norm.weight", (h,), "F32", "norm"))
        if fused_gate_up:  # ffn_up = [gate; up]
            plan.append(mat("ffn_up.weight", 2 * f, h, wt))
        else:
            plan += [mat("ffn_gate.weight", f, h, wt), mat("ffn_up.weight", f, h, wt)]
        plan.append(mat("ffn_down.weight", h, f, dt))
        if post_norms:
            plan.append((b + "post_ffw_norm.weight", (h,), "F32", "norm"))
        for part in spec.biases:
            plan.append((b + f"attn_{part}.bias", (bias_rows[part],), "F32", "bias"))
    plan.append(("output_norm.weight", (h,), "F32", "output_norm"))
    if spec.output_type is not None:
        plan.append(("output.weight", (vocab_size, h), spec.output_type, "output"))
    plan += [(name, np.shape(arr), "F32", "extra") for name, arr in spec.extra_tensors.items()]
    if spec.shape_override:
        plan = [_overridden(spec, e) for e in plan]
    return plan


def _overridden(spec: SyntheticSpec, entry: _Entry) -> _Entry:
    """``entry`` with the wrong shape ``spec.shape_override`` gives its name or leaf (float32 zeros), if any."""
    name = entry[0]
    leaf = name.split(".", 2)[-1] if name.startswith("blk.") else name
    shape = spec.shape_override.get(name, spec.shape_override.get(leaf))
    return entry if shape is None else (name, tuple(shape), "F32", "zeros")


def _random_block_maker(spec: SyntheticSpec, rng: np.random.Generator) -> Callable[[_Entry], tuple[np.ndarray, Any]]:
    """Weights of the random-block kind (tests of every quant type; the 1B benchmark)."""
    d = spec.head_size

    def make(entry: _Entry) -> tuple[np.ndarray, Any]:
        name, shape, ty, kind = entry
        if kind == "rope_freqs":
            return llama3_freq_factors(d, spec.rope_theta, *spec.llama3_rope), None  # type: ignore[misc]
        if kind == "bias":
            return (0.5 * rng.standard_normal(shape[0])).astype(np.float32), None
        if len(shape) == 1:
            return (1.0 + 0.1 * rng.standard_normal(shape[0])).astype(np.float32), None
        return _tensor(rng, ty, *shape)

    return make


# Realistic scales. The residual stream starts at rms ~1 (Gemma: after its x sqrt(hidden) input scale) and each
# sublayer adds ~0.5-1; Q and K carry a gain so attention is peaked (score std ~2), which makes RoPE and the
# window matter; the logits have std ~LOGIT_STD, so most top-1 margins are clear.
LOGIT_STD = 4.0
_QK_GAIN = 1.5
_QK_NORM_GAIN = 1.25  # Q/K after their RMSNorm: rms 1 per component, so a smaller gain gives the same score spread


def _realistic_maker(spec: SyntheticSpec, rng: np.random.Generator) -> Callable[[_Entry], tuple[np.ndarray, Any]]:
    h, d = spec.hidden_size, spec.head_size
    embed_std = 1.0 / np.sqrt(h) if spec.arch == "gemma3" else 1.0  # Gemma scales embeddings by sqrt(hidden)
    tied = spec.output_type is None

    def matrix(rows: int, cols: int, gain: float) -> np.ndarray:
        w = rng.standard_normal((rows, cols), np.float32)
        w += 0.5 * rng.standard_normal((rows, 4), np.float32) @ rng.standard_normal((4, cols), np.float32)
        return w * np.float32(gain / np.sqrt(cols * 2.0))  # rank-4 directions carry as much as the rest

    def rows_of_varied_norm(rows: int, cols: int, std: float) -> np.ndarray:
        scale = np.exp(0.3 * rng.standard_normal((rows, 1))).astype(np.float32)
        return rng.standard_normal((rows, cols), np.float32) * scale * np.float32(std)

    def vector(n: int, mean: float, rel: float = 0.1) -> np.ndarray:
        return (mean * (1.0 + rel * rng.standard_normal(n))).astype(np.float32)

    def make(entry: _Entry) -> tuple[np.ndarray, Any]:
        name, shape, ty, kind = entry
        if kind == "rope_freqs":
            return llama3_freq_factors(d, spec.rope_theta, *spec.llama3_rope), None  # type: ignore[misc]
        if kind == "embed":
            return quantize(rows_of_varied_norm(*shape, embed_std), ty)
        if kind == "output":
            return quantize(rows_of_varied_norm(*shape, LOGIT_STD / np.sqrt(h)), ty)
        if kind == "output_norm":  # tied: the norm's gain sets the logit scale
            return vector(h, LOGIT_STD / (np.sqrt(h) * embed_std) if tied else 1.0), None
        if kind == "norm":
            return vector(shape[0], 1.0), None
        if kind == "qk_norm":
            return vector(shape[0], _QK_NORM_GAIN), None
        if kind == "bias":
            return (0.3 * rng.standard_normal(shape[0])).astype(np.float32), None
        if kind == "qk" and spec.arch not in ("qwen3", "gemma3"):
            return quantize(matrix(*shape, _QK_GAIN), ty)
        if kind == "qkv":  # phi3: the Q and K rows carry the gain
            w = matrix(*shape, 1.0)
            w[: (spec.num_heads + spec.num_kv_heads) * d] *= np.float32(_QK_GAIN)
            return quantize(w, ty)
        return quantize(matrix(*shape, 1.0), ty)

    return make


def write_synthetic_gguf(
    path: Any, spec: Optional[SyntheticSpec] = None, *, seed: int = 0, dequantized: bool = False
) -> str:
    """Write ``spec`` as a GGUF at ``path`` tensor by tensor (peak memory: one tensor); returns the path.

    ``dequantized``: every quantized or F16 tensor written as F32 holding exactly the values the quantized file
    decodes to (the same model without weight rounding in the matrix products).
    """
    import gguf

    spec = spec or SyntheticSpec()
    path = os.fspath(path)
    rng = np.random.default_rng(seed)
    h, f, hq, hkv, d = spec.hidden_size, spec.intermediate_size, spec.num_heads, spec.num_kv_heads, spec.head_size
    w = gguf.GGUFWriter(path, spec.arch)
    w.add_block_count(spec.num_layers)
    w.add_embedding_length(h)
    w.add_feed_forward_length(f)
    w.add_head_count(hq)
    w.add_head_count_kv(hkv)
    if spec.head_dim is not None:
        w.add_key_length(d)
        w.add_value_length(d)
    w.add_context_length(spec.context_length)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_layer_norm_rms_eps(spec.rms_eps)
    if spec.sliding_window is not None:
        w.add_sliding_window(spec.sliding_window)
    if spec.rope_scaling_linear is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(spec.rope_scaling_linear)
    for key, (value, vtype) in spec.extra_meta.items():
        w.add_key_value(key, value, vtype)
    if spec.vocab is not None:
        vocab_size = _copy_tokenizer(w, spec.vocab)
        make = _realistic_maker(spec, rng)
    else:
        vocab_size = spec.vocab_size
        tokens = _byte_vocab(vocab_size)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2" if spec.arch == "qwen2" else "smollm")
        w.add_token_list(tokens)
        # Control tokens: the three specials only; the fillers are ordinary tokens, as most of a real
        # vocabulary is (31k special fillers cost the tokenizer ~19 MiB and its special-token matcher).
        w.add_token_types([3 if t in _SPECIALS else 1 for t in tokens])
        w.add_token_merges(["Ġ t"])
        w.add_eos_token_id(0)
        w.add_chat_template(
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
        )
        make = _random_block_maker(spec, rng)

    # Tensor infos first (shapes and types from the plan), then the data one tensor at a time.
    plan = _plan(spec, vocab_size)
    nbytes = {name: _nbytes(shape, "F32" if dequantized else ty) for name, shape, ty, _ in plan}
    for name, shape, ty, _ in plan:
        qt = None if dequantized or ty == "F32" else gguf.GGMLQuantizationType[ty]
        w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes[name], raw_dtype=qt)  # element shape
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for entry in plan:
        if entry[3] == "zeros":
            arr, qt = np.zeros(entry[1], np.float32), None
        elif entry[3] == "extra":
            arr, qt = np.asarray(spec.extra_tensors[entry[0]], np.float32), None
        else:
            arr, qt = make(entry)
        if dequantized:
            arr = _dequantized(arr, qt).reshape(entry[1])
        assert arr.nbytes == nbytes[entry[0]], entry[0]
        w.write_tensor_data(arr)
    w.close()
    return path


def _nbytes(shape: tuple[int, ...], ty: str) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    el, bb = GGML_QUANT_SIZES[GGMLQuantizationType[ty]]
    return int(np.prod(shape)) // el * bb
