"""Random-weight Llama-family GGUF files written with ``gguf.GGUFWriter``, tensor by tensor.

For tests (tiny dims, every quant type and variant) and for the 1B-class benchmark: quantized
tensors are random blocks (codes uniform, f16 scales chosen so weights have std ~ 1/sqrt(in)),
generated and written one tensor at a time, so a 4 GB model never sits in RAM. The vocabulary is
byte-level GPT-2 (256 byte tokens, one merge, fillers), enough for ``GGUFTokenizer``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

__all__ = ["SyntheticSpec", "TINYLLAMA_1B", "random_blocks", "write_synthetic_gguf"]

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
    """Shape, types and variant of a synthetic model (``output_type=None``: tied embeddings)."""

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
    qkv_bias: bool = False
    sliding_window: Optional[int] = None
    rope_theta: float = 10000.0
    rope_scaling_linear: Optional[float] = None
    llama3_rope: Optional[tuple[float, float, float, int]] = None  # factor, low, high, original context
    rms_eps: float = 1e-5

    @property
    def num_params(self) -> int:
        h, f, hd = self.hidden_size, self.intermediate_size, self.hidden_size // self.num_heads
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


def _float_tensor(x: np.ndarray, ggml_type: str) -> tuple[np.ndarray, Any]:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    if ggml_type == "F32":
        return x.astype(np.float32), None
    if ggml_type == "F16":
        return x.astype(np.float16), None
    qt = GGMLQuantizationType[ggml_type]
    return quantize(x.astype(np.float32), qt), qt


def _tensor(rng: np.random.Generator, ggml_type: str, rows: int, cols: int) -> tuple[np.ndarray, Any]:
    from gguf import GGMLQuantizationType

    std = 1.0 / np.sqrt(cols)
    if ggml_type in _BLOCKS:
        return random_blocks(rng, ggml_type, rows, cols, std), GGMLQuantizationType[ggml_type]
    return _float_tensor(rng.standard_normal((rows, cols), np.float32) * np.float32(std), ggml_type)


_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _byte_vocab(n: int) -> list[str]:
    """GPT-2's byte-to-unicode table (256 tokens) then fillers up to ``n``."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    k = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + k)
            k += 1
    byte_tokens = [chr(c) for _, c in sorted(zip(bs, cs))]
    specials = list(_SPECIALS)
    fill = [f"<|x{i}|>" for i in range(max(0, n - 257 - len(specials)))]
    return (specials + byte_tokens + ["Ġt"] + fill)[:n]


def write_synthetic_gguf(path: Any, spec: Optional[SyntheticSpec] = None, *, seed: int = 0) -> str:
    """Write ``spec`` as a GGUF at ``path`` tensor by tensor (peak memory: one tensor); returns the path."""
    import gguf

    spec = spec or SyntheticSpec()
    path = os.fspath(path)
    rng = np.random.default_rng(seed)
    h, f, hq, hkv = spec.hidden_size, spec.intermediate_size, spec.num_heads, spec.num_kv_heads
    d = h // hq
    w = gguf.GGUFWriter(path, spec.arch)
    w.add_block_count(spec.num_layers)
    w.add_embedding_length(h)
    w.add_feed_forward_length(f)
    w.add_head_count(hq)
    w.add_head_count_kv(hkv)
    w.add_context_length(spec.context_length)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_layer_norm_rms_eps(spec.rms_eps)
    if spec.sliding_window is not None:
        w.add_sliding_window(spec.sliding_window)
    if spec.rope_scaling_linear is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(spec.rope_scaling_linear)
    tokens = _byte_vocab(spec.vocab_size)
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

    # (name, make) in file order; make() builds one tensor when it is written.
    plan: list[tuple[str, Any]] = [("token_embd.weight", lambda: _tensor(rng, spec.embed_type, spec.vocab_size, h))]
    if spec.llama3_rope is not None:
        factors = llama3_freq_factors(d, spec.rope_theta, *spec.llama3_rope)
        plan.append(("rope_freqs.weight", lambda: (factors, None)))
    for i in range(spec.num_layers):
        b = f"blk.{i}."
        wt, dt = spec.weight_type, spec.down_type or spec.weight_type

        def norm() -> tuple[np.ndarray, Any]:
            return (1.0 + 0.1 * rng.standard_normal(h)).astype(np.float32), None

        plan += [
            (b + "attn_norm.weight", norm),
            (b + "attn_q.weight", lambda wt=wt: _tensor(rng, wt, hq * d, h)),
            (b + "attn_k.weight", lambda wt=wt: _tensor(rng, wt, hkv * d, h)),
            (b + "attn_v.weight", lambda dt=dt: _tensor(rng, dt, hkv * d, h)),
            (b + "attn_output.weight", lambda wt=wt: _tensor(rng, wt, h, hq * d)),
            (b + "ffn_norm.weight", norm),
            (b + "ffn_gate.weight", lambda wt=wt: _tensor(rng, wt, f, h)),
            (b + "ffn_up.weight", lambda wt=wt: _tensor(rng, wt, f, h)),
            (b + "ffn_down.weight", lambda dt=dt: _tensor(rng, dt, h, f)),
        ]
        if spec.qkv_bias:
            for name, n in (("attn_q.bias", hq * d), ("attn_k.bias", hkv * d), ("attn_v.bias", hkv * d)):
                plan.append((b + name, lambda n=n: ((0.5 * rng.standard_normal(n)).astype(np.float32), None)))
    plan.append(("output_norm.weight", lambda: ((1.0 + 0.1 * rng.standard_normal(h)).astype(np.float32), None)))
    if spec.output_type is not None:
        plan.append(("output.weight", lambda: _tensor(rng, spec.output_type, spec.vocab_size, h)))

    # Tensor infos first (shapes and types from a dry description), then the data one tensor at a time.
    shapes = _shapes(spec, [n for n, _ in plan])
    for name, _ in plan:
        shape, qt, nbytes = shapes[name]
        w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=qt)  # element shape
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, make in plan:
        arr, _ = make()
        assert arr.nbytes == shapes[name][2], name
        w.write_tensor_data(arr)
    w.close()
    return path


def _shapes(spec: SyntheticSpec, names: list[str]) -> dict[str, tuple[tuple[int, ...], Any, int]]:
    """name -> (torch-order shape, raw ggml type or None for F32, bytes)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    h, f, hq, hkv = spec.hidden_size, spec.intermediate_size, spec.num_heads, spec.num_kv_heads
    d = h // hq
    out: dict[str, tuple[tuple[int, ...], Any, int]] = {}
    for name in names:
        leaf = name.split(".", 2)[-1] if name.startswith("blk.") else name
        wt, dt = spec.weight_type, spec.down_type or spec.weight_type
        dims: dict[str, tuple[str, int, int]] = {
            "token_embd.weight": (spec.embed_type, spec.vocab_size, h),
            "output.weight": (spec.output_type or "F32", spec.vocab_size, h),
            "attn_q.weight": (wt, hq * d, h),
            "attn_k.weight": (wt, hkv * d, h),
            "attn_v.weight": (dt, hkv * d, h),
            "attn_output.weight": (wt, h, hq * d),
            "ffn_gate.weight": (wt, f, h),
            "ffn_up.weight": (wt, f, h),
            "ffn_down.weight": (dt, h, f),
        }
        if leaf in dims:
            ty, rows, cols = dims[leaf]
            qt = GGMLQuantizationType[ty]
            el, bb = GGML_QUANT_SIZES[qt]
            # F32/F16 are passed as typed arrays (raw_dtype None for F32 keeps numpy's dtype rules)
            out[name] = ((rows, cols), qt, rows * cols // el * bb)
        else:
            n = {"rope_freqs.weight": d // 2}.get(name)
            if n is None:
                n = (hq * d if "attn_q" in leaf else hkv * d) if leaf.endswith(".bias") else h
            out[name] = ((n,), None, 4 * n)
    return out
