"""Small random-weight GGUF files of every architecture the one decoder runs (llama, qwen2, qwen3, phi3, gemma3).

Written tensor by tensor with ``gguf.GGUFWriter`` in each architecture's own tensor names and layout
(fused ``attn_qkv``, Phi-3's fused ``[gate; up]``, Q/K norms, Gemma's post-norms), quantized blocks
from ``synthetic.random_blocks``. Weights are random: these files test that the numpy spec and the fused
Rust decoder agree and that the loader reads each layout; agreement with llama.cpp is the oracle's
golden files' job.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import gguf
import numpy as np

from pagedkv_rs.models.synthetic import random_blocks


@dataclass(frozen=True)
class ArchFile:
    """Shape and layout of one test file."""

    arch: str
    num_layers: int = 3
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: Optional[int] = None  # None: hidden / heads (no key_length key written)
    intermediate_size: int = 96
    vocab_size: int = 300
    context_length: int = 256
    weight_type: str = "Q8_0"
    embed_type: str = "Q8_0"
    tied: bool = True
    fused_qkv: bool = False
    biases: tuple[str, ...] = ()  # any of "q", "k", "v", or ("qkv",) for a fused bias
    qk_norm: bool = False
    post_norms: bool = False
    fused_gate_up: bool = False
    sliding_window: Optional[int] = None
    rope_theta: float = 10000.0
    extra_meta: dict[str, Any] = field(default_factory=dict)  # key -> (value, GGUFValueType)
    extra_tensors: dict[str, np.ndarray] = field(default_factory=dict)  # float32 tensors added as they are
    shape_override: dict[str, tuple[int, ...]] = field(default_factory=dict)  # leaf name -> wrong shape


QWEN3 = ArchFile("qwen3", head_dim=32, qk_norm=True)  # query width 4 x 32 = 128 != hidden 64
PHI3 = ArchFile("phi3", num_kv_heads=4, fused_qkv=True, fused_gate_up=True, sliding_window=8)
GEMMA3 = ArchFile(
    "gemma3",
    num_layers=7,  # layers 0-4 local, 5 global, 6 local
    num_heads=2,
    num_kv_heads=1,
    head_dim=64,  # query width 128 != hidden 64
    qk_norm=True,
    post_norms=True,
    sliding_window=6,
    rope_theta=1e6,
)


def _weight(rng: np.random.Generator, ty: str, rows: int, cols: int) -> tuple[np.ndarray, Any]:
    std = 1.0 / np.sqrt(cols)
    if ty == "F32":
        return (rng.standard_normal((rows, cols)) * std).astype(np.float32), None
    return random_blocks(rng, ty, rows, cols, std), gguf.GGMLQuantizationType[ty]


def write_arch_gguf(path: Any, spec: ArchFile, *, seed: int = 0) -> str:
    """Write ``spec`` at ``path``; returns the path."""
    rng = np.random.default_rng(seed)
    h, f, hq, hkv = spec.hidden_size, spec.intermediate_size, spec.num_heads, spec.num_kv_heads
    d = spec.head_dim or h // hq
    nq, nkv = hq * d, hkv * d
    path = str(path)
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
    w.add_layer_norm_rms_eps(1e-6)
    if spec.sliding_window is not None:
        w.add_sliding_window(spec.sliding_window)
    for k, (v, vt) in spec.extra_meta.items():
        w.add_key_value(k, v, vt)
    tokens = [f"<t{i}>" for i in range(spec.vocab_size)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges([])
    w.add_eos_token_id(1)

    def norm(n: int) -> tuple[np.ndarray, Any]:
        return (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32), None

    def wrong(name: str, made: tuple[np.ndarray, Any]) -> tuple[np.ndarray, Any]:
        leaf = name.split(".", 2)[-1] if name.startswith("blk.") else name
        if leaf not in spec.shape_override:
            return made
        return np.zeros(spec.shape_override[leaf], np.float32), None

    plan: list[tuple[str, tuple[np.ndarray, Any]]] = [
        ("token_embd.weight", _weight(rng, spec.embed_type, spec.vocab_size, h)),
    ]
    wt = spec.weight_type
    for i in range(spec.num_layers):
        b = f"blk.{i}."
        plan.append((b + "attn_norm.weight", norm(h)))
        if spec.fused_qkv:
            plan.append((b + "attn_qkv.weight", _weight(rng, wt, nq + 2 * nkv, h)))
        else:
            plan += [
                (b + "attn_q.weight", _weight(rng, wt, nq, h)),
                (b + "attn_k.weight", _weight(rng, wt, nkv, h)),
                (b + "attn_v.weight", _weight(rng, wt, nkv, h)),
            ]
        for part in spec.biases:
            n = {"q": nq, "k": nkv, "v": nkv, "qkv": nq + 2 * nkv}[part]
            plan.append((b + f"attn_{part}.bias", ((0.3 * rng.standard_normal(n)).astype(np.float32), None)))
        if spec.qk_norm:
            plan += [(b + "attn_q_norm.weight", norm(d)), (b + "attn_k_norm.weight", norm(d))]
        plan.append((b + "attn_output.weight", _weight(rng, wt, h, nq)))
        if spec.post_norms:
            plan.append((b + "post_attention_norm.weight", norm(h)))
        plan.append((b + "ffn_norm.weight", norm(h)))
        if spec.fused_gate_up:
            plan.append((b + "ffn_up.weight", _weight(rng, wt, 2 * f, h)))
        else:
            plan += [(b + "ffn_gate.weight", _weight(rng, wt, f, h)), (b + "ffn_up.weight", _weight(rng, wt, f, h))]
        plan.append((b + "ffn_down.weight", _weight(rng, wt, h, f)))
        if spec.post_norms:
            plan.append((b + "post_ffw_norm.weight", norm(h)))
    plan.append(("output_norm.weight", norm(h)))
    if not spec.tied:
        plan.append(("output.weight", _weight(rng, wt, spec.vocab_size, h)))
    for name, arr in spec.extra_tensors.items():
        plan.append((name, (np.asarray(arr, np.float32), None)))
    for name, (arr, qt) in plan:
        arr, qt = wrong(name, (arr, qt))
        w.add_tensor(name, arr, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
