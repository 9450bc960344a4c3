"""``DenseLlama``: a plain contiguous-KV forward of the package's weights, for tests.

It shares the weights and the per-token math (RMSNorm, RoPE, SwiGLU) with ``LlamaModel`` but none of the
paged cache or attention code: a test oracle, so it lives with the tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pagedkv_rs.models.llama import (
    LlamaWeights,
    _np_dtype,
    _rope_mode,
    apply_rope,
    gated_mlp,
    layer_window,
    linear,
    qk_norm,
    rms_norm,
)

__all__ = ["DenseLlama"]


class DenseLlama:
    """Contiguous-KV forward of the same weights, batch of equal-length sequences; for tests and baselines."""

    def __init__(self, weights: LlamaWeights, *, kv_dtype: Any = "float32"):
        self.weights = weights
        self.config = weights.config
        self.kv_dtype = np.dtype(_np_dtype(kv_dtype))
        self._mode = _rope_mode(weights)

    def new_cache(self, batch: int, max_len: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per layer ``(K, V)``, each ``[B, Hkv, max_len, D]`` in the KV dtype."""
        cfg = self.config
        shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        return [(np.zeros(shape, self.kv_dtype), np.zeros(shape, self.kv_dtype)) for _ in range(cfg.num_layers)]

    def forward(
        self, ids: np.ndarray, start: int, cache: list[tuple[np.ndarray, np.ndarray]], *, all_positions: bool = False
    ) -> np.ndarray:
        """ids: [B, T] at positions start..start+T-1 -> logits [B, V] of the last position ([B, T, V] if all)."""
        cfg, w = self.config, self.weights
        ids = np.asarray(ids, np.int64)
        b, t = ids.shape
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        g = hq // hkv
        nq, nk = hq * d, hkv * d
        end = start + t
        pos = np.tile(np.arange(start, end), b)  # rows are batch-major
        tables = w.rope_rows(pos)
        causal = np.arange(end)[None, :] <= np.arange(start, end)[:, None]  # [T, S]
        scale = np.float32(cfg.attention_scale if cfg.attention_scale is not None else 1.0 / np.sqrt(d))
        x = w.embed[ids.reshape(-1)]  # [B*T, H]
        if cfg.embedding_scale != 1.0:
            x = x * np.float32(cfg.embedding_scale)
        for i, (layer, (kc, vc)) in enumerate(zip(w.layers, cache)):
            window = layer_window(cfg, layer, i)
            mask = causal
            if window is not None:
                mask = causal & (np.arange(end)[None, :] > np.arange(start, end)[:, None] - window)
            cos, sin = tables[layer.get("rope_table", 0)]
            h = rms_norm(x, layer["attn_norm"], cfg.rms_eps)
            qkv = linear(h, layer["wqkv"])
            if "bqkv" in layer:
                qkv += layer["bqkv"]
            q = qk_norm(qkv[:, :nq].reshape(b * t, hq, d), layer.get("q_norm"), cfg.rms_eps)
            k = qk_norm(qkv[:, nq : nq + nk].reshape(b * t, hkv, d), layer.get("k_norm"), cfg.rms_eps)
            q = apply_rope(q, cos, sin, self._mode)
            k = apply_rope(k, cos, sin, self._mode)
            v = qkv[:, nq + nk :].reshape(b, t, hkv, d)
            kc[:, :, start:end] = k.reshape(b, t, hkv, d).transpose(0, 2, 1, 3)
            vc[:, :, start:end] = v.transpose(0, 2, 1, 3)
            kk = kc[:, :, :end].astype(np.float32)  # [B, Hkv, S, D]
            vv = vc[:, :, :end].astype(np.float32)
            # [B, Hkv, G*T, D]: query rows grouped under their KV head
            qg = q.reshape(b, t, hkv, g, d).transpose(0, 2, 3, 1, 4).reshape(b, hkv, g * t, d)
            s = (qg @ kk.transpose(0, 1, 3, 2)) * scale  # [B, Hkv, G*T, S]
            s = s.reshape(b, hkv, g, t, end)
            s = np.where(mask, s, -np.inf)
            s -= s.max(axis=-1, keepdims=True)
            p = np.exp(s)
            p /= p.sum(axis=-1, keepdims=True)
            o = p.reshape(b, hkv, g * t, end) @ vv  # [B, Hkv, G*T, D]
            o = linear(o.reshape(b, hkv, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b * t, nq), layer["wo"])
            if layer.get("post_attn_norm") is not None:
                o = rms_norm(o, layer["post_attn_norm"], cfg.rms_eps)
            x += o
            f = gated_mlp(rms_norm(x, layer["ffn_norm"], cfg.rms_eps), layer, cfg.spec.activation)
            if layer.get("post_ffn_norm") is not None:
                f = rms_norm(f, layer["post_ffn_norm"], cfg.rms_eps)
            x += f
        if all_positions:
            return linear(rms_norm(x, w.final_norm, cfg.rms_eps), w.lm_head).reshape(b, t, -1)
        last = x.reshape(b, t, -1)[:, -1]
        return linear(rms_norm(last, w.final_norm, cfg.rms_eps), w.lm_head)

    def generate_greedy(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_token_ids: Sequence[int] = ()
    ) -> list[list[int]]:
        """Greedy continuation of equal-length prompts (all run max_new_tokens steps; cut at EOS after)."""
        arr = np.asarray([list(p) for p in prompts], np.int64)
        if arr.ndim != 2 or arr.shape[1] == 0:
            raise ValueError("generate_greedy needs a non-empty batch of equal-length, non-empty prompts")
        b, t = arr.shape
        cache = self.new_cache(b, t + max_new_tokens)
        logits = self.forward(arr, 0, cache)
        out = np.empty((b, max_new_tokens), np.int64)
        for step in range(max_new_tokens):
            nxt = logits.argmax(axis=-1)
            out[:, step] = nxt
            if step + 1 < max_new_tokens:
                logits = self.forward(nxt[:, None], t + step, cache)
        res = []
        eos = set(int(e) for e in eos_token_ids)
        for row in out.tolist():
            cut = next((i + 1 for i, tok in enumerate(row) if tok in eos), len(row))
            res.append(row[:cut])
        return res
