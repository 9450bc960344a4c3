"""One decoder spec per architecture: what ``general.architecture`` selects, as data.

Every supported model runs the same decoder (``llama.py``'s numpy spec and ``rust/model/llama.rs``);
an :class:`ArchSpec` says which of its optional parts an architecture uses and what llama.cpp does
that the GGUF metadata does not say (read in its ``src/models/<arch>.cpp``, ``src/llama-model.cpp``
and ``src/llama-hparams.*``, whose outputs are the reference):

- ``llama`` (Llama 2/3, SmolLM2, Mistral, TinyLlama): Q/K rows permuted by the converter (adjacent
  RoPE pairs), optional ``rope_freqs`` (Llama 3). Mistral's ``attention.sliding_window`` applies to
  every layer here (llama.cpp's ``llama`` graph ignores it).
- ``qwen2``: Q/K/V biases; rotate-half (NeoX) row order.
- ``qwen3``: a per-head RMSNorm of Q and K before RoPE; query width ``head_count x key_length`` may
  differ from the hidden size.
- ``phi3``: fused ``attn_qkv`` and a fused ``ffn_up`` of ``[gate; up]`` (2F rows); llama.cpp ignores
  ``phi3.attention.sliding_window``; LongRoPE (``rope_factors_long/short``) is refused.
- ``gemma3``: Q/K norms, post-attention and post-FFN norms, GELU-tanh gate, embeddings times
  ``sqrt(hidden)``, tied embeddings; layers ``il % 6 < 5`` are local (sliding window, RoPE base
  ``rope.freq_base_swa`` or 10000), the others global (``rope.freq_base``); attention scale
  ``1/sqrt(key_length)`` (27B, 62 layers: ``1/sqrt(hidden/heads)``, its query_pre_attn_scalar).
  The converter already folded Gemma's ``1 + w`` into the norm weights.

Any of them may carry a fused ``attn_qkv`` or separate Q/K/V, with optional biases.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["ARCH_SPECS", "ArchSpec"]


@dataclass(frozen=True)
class ArchSpec:
    """The data that makes the one decoder a given architecture."""

    name: str
    # Q/K row order of the file: "adjacent" (llama.cpp's converter permuted the rows) or "half" (NeoX).
    rope_pairs: str = "half"
    qk_norm: bool = False  # attn_q_norm / attn_k_norm [D], RMSNorm per head before RoPE
    post_norms: bool = False  # post_attention_norm / post_ffw_norm [H], on each sublayer's output
    activation: str = "silu"  # the FFN gate: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    embed_scale_sqrt_hidden: bool = False  # token embeddings times sqrt(hidden) (Gemma)
    fused_gate_up: bool = False  # ffn_up holds [gate; up] (2F rows), no ffn_gate (Phi-3)
    # How ``{arch}.attention.sliding_window`` is read: "all" layers, "ignore" it, or "pattern": layer
    # il is local when il % swa_period < swa_period - 1 (``attention.sliding_window_pattern`` overrides).
    sliding_window: str = "all"
    swa_period: int = 0
    swa_rope_base: Optional[float] = None  # local layers' RoPE base when rope.freq_base_swa is absent
    # Layer counts whose attention scale is 1/sqrt(hidden/heads) instead of 1/sqrt(key_length).
    hidden_scale_layer_counts: tuple[int, ...] = ()
    # Tensor names of the optional per-layer norms.
    post_attn_norm: str = "post_attention_norm"
    post_ffn_norm: str = "post_ffw_norm"
    # Activation digits of int8 matrices where one digit (llama.cpp's Q8 activations) was measured to keep the
    # logits within the float32-activation ones (``pagedkv perplexity --kl-divergence``; docs/performance.md):
    # (key, digits) pairs for ``LlamaWeights.set_act_digits``; every other matrix takes two.
    act_digits: tuple[tuple[str, int], ...] = ()


ARCH_SPECS: dict[str, ArchSpec] = {
    "llama": ArchSpec("llama", rope_pairs="adjacent"),
    "qwen2": ArchSpec("qwen2"),
    "qwen3": ArchSpec("qwen3", qk_norm=True),
    "phi3": ArchSpec("phi3", fused_gate_up=True, sliding_window="ignore"),
    "gemma3": ArchSpec(
        "gemma3",
        qk_norm=True,
        post_norms=True,
        activation="gelu_tanh",
        embed_scale_sqrt_hidden=True,
        sliding_window="pattern",
        swa_period=6,
        swa_rope_base=10000.0,
        hidden_scale_layer_counts=(62,),
        # One digit everywhere: the logits' mean KL from float32 activations (2.8e-3 on the Apache-2.0 text at ctx
        # 256, 270M Q4_K_M) stays below llama.cpp's own (6.7e-3: its Q8 activations against the same file
        # dequantized to F32), and batched decode and prefill do half the integer work (docs/models.md).
        act_digits=(("head", 1), ("wqkv", 1), ("wo", 1), ("wgu", 1), ("wdown", 1)),
    ),
}
