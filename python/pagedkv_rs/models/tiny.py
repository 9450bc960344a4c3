"""A tiny deterministic transformer with random weights, for testing the engine without model files.

Llama shape: token embedding, ``num_layers`` x (RMSNorm, GQA attention with RoPE through the paged
KV cache, RMSNorm, SwiGLU MLP), final RMSNorm, LM head. The dense math runs in float64 so a
token's result does not depend on how many rows share its matmul (prefill chunks, decode batches,
recompute after preemption all give the same greedy tokens); q/k/v enter the kernels as float32.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from pagedkv_rs import kernels
from pagedkv_rs.batch import BatchInputs

__all__ = ["TinyModel", "tiny_llama_weights"]


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


class TinyModel:
    """Random-weight Llama-style model implementing the engine's ``Model`` protocol."""

    def __init__(
        self,
        *,
        num_layers: int = 2,
        hidden_size: int = 64,
        num_heads: int = 4,
        num_kv_heads: int = 2,
        vocab_size: int = 128,
        intermediate_size: int = 128,
        max_model_len: int = 512,
        eos_token_ids: tuple[int, ...] = (1,),
        rope_theta: float = 10000.0,
        seed: int = 0,
    ) -> None:
        if hidden_size % num_heads or num_heads % num_kv_heads:
            raise ValueError("hidden_size must divide by num_heads, and num_heads by num_kv_heads")
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = hidden_size // num_heads
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = tuple(eos_token_ids)
        self._config = (
            f"tiny:layers={num_layers};hidden={hidden_size};heads={num_heads};kv_heads={num_kv_heads};"
            f"vocab={vocab_size};ffn={intermediate_size};rope_theta={rope_theta!r};seed={seed}"
        )
        rng = np.random.default_rng(seed)
        h, d, f = hidden_size, self.head_dim, intermediate_size

        def w(*shape: int) -> np.ndarray:
            return rng.standard_normal(shape) / np.sqrt(shape[0])

        self.embed = rng.standard_normal((vocab_size, h))
        self.layers = [
            {
                "attn_norm": 1.0 + 0.1 * rng.standard_normal(h),
                "wq": w(h, num_heads * d),
                "wk": w(h, num_kv_heads * d),
                "wv": w(h, num_kv_heads * d),
                "wo": w(num_heads * d, h),
                "mlp_norm": 1.0 + 0.1 * rng.standard_normal(h),
                "w_gate": w(h, f),
                "w_up": w(h, f),
                "w_down": w(f, h),
            }
            for _ in range(num_layers)
        ]
        self.final_norm = 1.0 + 0.1 * rng.standard_normal(h)
        self.lm_head = w(h, vocab_size)
        self.inv_freq = rope_theta ** (-np.arange(0, d, 2) / d)  # [d/2]

    def kv_fingerprint(self) -> str:
        """What the K/V depend on: the config and the seed of the random weights (for the KV tiers)."""
        return self._config

    def _rope(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        # x [T, heads, d]: rotate-half RoPE at each row's position
        ang = positions[:, None].astype(np.float64) * self.inv_freq[None, :]  # [T, d/2]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        x1, x2 = x[..., : self.head_dim // 2], x[..., self.head_dim // 2 :]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def forward(
        self,
        batch: BatchInputs,
        kv_caches: list[tuple[np.ndarray, np.ndarray]],
        logits_indices: Optional[np.ndarray] = None,
    ) -> np.ndarray:
        """Logits float32 [num_seqs, vocab] of each sequence's last scheduled token (or of ``logits_indices``)."""
        t = batch.num_tokens
        x = self.embed[batch.input_ids]  # [T, H]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            hn = _rms_norm(x, layer["attn_norm"])
            q = self._rope((hn @ layer["wq"]).reshape(t, self.num_heads, self.head_dim), batch.positions)
            k = self._rope((hn @ layer["wk"]).reshape(t, self.num_kv_heads, self.head_dim), batch.positions)
            v = (hn @ layer["wv"]).reshape(t, self.num_kv_heads, self.head_dim)
            kernels.write_kv(
                k_cache,
                v_cache,
                np.ascontiguousarray(k, np.float32),
                np.ascontiguousarray(v, np.float32),
                batch.slot_mapping,
            )
            o = kernels.paged_attention(
                np.ascontiguousarray(q, np.float32),
                k_cache,
                v_cache,
                batch.block_tables,
                batch.seq_lens,
                batch.query_start_loc,
            )
            x = x + o.reshape(t, -1).astype(np.float64) @ layer["wo"]
            hn = _rms_norm(x, layer["mlp_norm"])
            g = hn @ layer["w_gate"]
            x = x + (g / (1.0 + np.exp(-g)) * (hn @ layer["w_up"])) @ layer["w_down"]
        last = batch.query_start_loc[1:].astype(np.int64) - 1 if logits_indices is None else logits_indices  # [B]
        logits = _rms_norm(x[last], self.final_norm) @ self.lm_head
        return logits.astype(np.float32)


def tiny_llama_weights(
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 96,
    vocab_size: int = 128,
    max_model_len: int = 256,
    rope_theta: float = 10000.0,
    rms_eps: float = 1e-5,
    qkv_bias: bool = False,
    sliding_window: Optional[int] = None,
    weights: str = "int8",
    seed: int = 0,
) -> Any:
    """Random ``LlamaWeights`` (no file): the paged ``LlamaModel``'s layers at a tiny size.

    ``weights="int8"``: every projection a ``QLinear`` quantized from the random float32 matrix;
    ``"float32"``: numpy ``FloatLinear``. ``qkv_bias`` adds a Qwen2-style ``layer["bqkv"]``;
    ``sliding_window`` sets ``config.sliding_window`` (Mistral). Sizes that reach a ``QLinear`` as
    its input width (hidden, heads*head_dim, intermediate) must be multiples of 32.
    """
    from pagedkv_rs import _core
    from pagedkv_rs.models.llama import FloatLinear, Int8Linear, LlamaWeights

    if weights not in ("int8", "float32"):
        raise ValueError(f"weights must be 'int8' or 'float32', got {weights!r}")
    rng = np.random.default_rng(seed)
    h, f = hidden_size, intermediate_size
    d = h // num_heads
    nqkv = (num_heads + 2 * num_kv_heads) * d

    def lin(out: int, inp: int) -> Any:
        w = (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)
        return Int8Linear(_core.QLinear.from_float(w)) if weights == "int8" else FloatLinear(w.T)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(h)).astype(np.float32)

    w = object.__new__(LlamaWeights)  # the loader's object, filled without a GGUF file
    from pagedkv_rs.models.gguf_loader import LlamaConfig

    w.config = LlamaConfig(
        num_layers=num_layers,
        hidden_size=h,
        intermediate_size=f,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=d,
        vocab_size=vocab_size,
        max_model_len=max_model_len,
        rope_theta=rope_theta,
        rms_eps=rms_eps,
        tie_embeddings=False,
        attention_bias=qkv_bias,
        sliding_window=sliding_window,
    )
    w.path = None
    w.rope_pairs = "half"
    w.native_rope_pairs = "half"  # the tables below rotate halves; no file rows to un-permute
    w.weight_format = weights
    w.embed = rng.standard_normal((vocab_size, h)).astype(np.float32)
    w.layers = []
    for _ in range(num_layers):
        layer = {"attn_norm": norm(), "ffn_norm": norm(), "wqkv": lin(nqkv, h), "wo": lin(h, num_heads * d)}
        layer.update(wgu=lin(2 * f, h), wdown=lin(h, f))
        if qkv_bias:
            layer["bqkv"] = (0.5 * rng.standard_normal(nqkv)).astype(np.float32)
        w.layers.append(layer)
    w.final_norm = norm()
    w.lm_head = lin(vocab_size, h)
    inv_freq = 1.0 / (rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    ang = np.arange(max_model_len, dtype=np.float64)[:, None] * inv_freq[None, :]
    w._rope_tables = [(np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32))]
    return w
