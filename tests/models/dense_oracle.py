"""The dense oracle of the paged model: the Llama forward in plain float64 numpy, sharing no code with it.

``LlamaModel`` runs the Rust kernels (``rms_norm``, ``silu_and_mul``, ``QLinear``, paged attention) and
``llama.apply_rope``; ``DenseLlama`` in the package reuses all of them but attention. This oracle
re-derives each step from the weights: RMSNorm, SwiGLU, RoPE (its own tables from ``rope_theta``) and
causal softmax attention over a contiguous cache, in float64. The weight multiplies are numpy's
float32 sgemm (numpy's BLAS, no pagedkv code; float64 would read 1 GB per token and make the oracle
40x slower); int8 weights are dequantized here and multiply activations quantized as
``reference.quantize_activations`` specifies (what QLinear computes). What it shares with the model
is only what defines the model's numbers: the weights as loaded and K/V rounded to the cache dtype.

Shapes: T tokens, H hidden, Hq/Hkv heads, D head_dim, S cached positions.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pagedkv_rs.kernels import reference
from pagedkv_rs.models.llama import FloatLinear, Int8Linear, LlamaWeights


def _np_dtype(name: str) -> Any:
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


class DenseOracle:
    """Greedy decoding of one prompt at a time; ``logits(ids)`` of the last position."""

    def __init__(self, weights: LlamaWeights, kv_dtype: str = "float32"):
        if weights.rope_pairs not in ("half", "adjacent"):
            raise ValueError(f"the oracle runs the two correct RoPE conventions, not {weights.rope_pairs!r}")
        self.w = weights
        self.cfg = weights.config
        self.kv_dtype = _np_dtype(kv_dtype)
        d = self.cfg.head_dim
        self.inv_freq = self.cfg.rope_theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)  # [D/2]
        self._dequant: dict[int, tuple[Any, np.ndarray]] = {}  # id -> (the layer, kept alive; W.T float32)

    # ---- row-wise math, float64 ----
    def linear(self, x: np.ndarray, lin: Any) -> np.ndarray:
        """x: [T, in] float64 -> [T, out] float64 (a float32 sgemm)."""
        x32 = np.ascontiguousarray(x, np.float32)
        if isinstance(lin, FloatLinear):
            return (x32 @ lin.w_t).astype(np.float64)
        assert isinstance(lin, Int8Linear), type(lin)
        if id(lin) not in self._dequant:  # W[n, k] = d[n, k/32] * codes + m[n, k/32]
            codes, dq, mq = lin.q.unpack()
            n, k = codes.shape
            w = codes.reshape(n, -1, 32) * dq[..., None].astype(np.float64) + mq[..., None]
            self._dequant[id(lin)] = (lin, np.ascontiguousarray(w.reshape(n, k).T, np.float32))
        w_t = self._dequant[id(lin)][1]
        hi, lo, s_hi, s_lo, _ = reference.quantize_activations(x32)
        t, k = hi.shape
        xq = hi.reshape(t, -1, 32) * s_hi[..., None].astype(np.float64) + lo.reshape(t, -1, 32) * s_lo[..., None]
        return (xq.reshape(t, k).astype(np.float32) @ w_t).astype(np.float64)

    def rms_norm(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.cfg.rms_eps) * weight

    def rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """x: [T, heads, D] rotated at positions pos: [T]."""
        ang = pos[:, None].astype(np.float64) * self.inv_freq  # [T, D/2]
        c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
        if self.w.rope_pairs == "half":
            h = x.shape[-1] // 2
            a, b = x[..., :h], x[..., h:]
            return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = a * c - b * s, b * c + a * s
        return out

    def attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int) -> np.ndarray:
        """q: [T, Hq, D] at positions start.., k/v: [S, Hkv, D] (S = start + T) -> [T, Hq * D]."""
        t, hq, d = q.shape
        g = hq // k.shape[1]
        kk = np.repeat(k, g, axis=1)  # query head h reads KV head h // g
        vv = np.repeat(v, g, axis=1)
        s = np.einsum("thd,shd->hts", q, kk) / np.sqrt(d)  # [Hq, T, S]
        allowed = np.arange(k.shape[0])[None, :] <= (start + np.arange(t))[:, None]
        s = np.where(allowed, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        return np.einsum("hts,shd->thd", p, vv).reshape(t, hq * d)

    # ---- the model ----
    def forward(self, ids: list[int], cache: list[list[np.ndarray]]) -> np.ndarray:
        """Next-token logits [V] (float64) after ``ids``, appending their K/V (rounded to the cache dtype)."""
        cfg, w = self.cfg, self.w
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        start = 0 if not cache[0] else cache[0][0].shape[0]
        pos = np.arange(start, start + len(ids))
        x = w.embed[np.asarray(ids)].astype(np.float64)  # [T, H]
        for layer, kv in zip(w.layers, cache):
            qkv = self.linear(self.rms_norm(x, layer["attn_norm"]), layer["wqkv"])
            q = self.rope(qkv[:, : hq * d].reshape(-1, hq, d), pos)
            k = self.rope(qkv[:, hq * d : (hq + hkv) * d].reshape(-1, hkv, d), pos)
            v = qkv[:, (hq + hkv) * d :].reshape(-1, hkv, d)
            # the cache holds what the model's cache holds: float32 K/V rounded to its dtype
            k = k.astype(np.float32).astype(self.kv_dtype).astype(np.float64)
            v = v.astype(np.float32).astype(self.kv_dtype).astype(np.float64)
            if kv:
                k, v = np.concatenate([kv[0], k]), np.concatenate([kv[1], v])
            kv[:] = [k, v]
            x = x + self.linear(self.attention(q, k, v, start), layer["wo"])
            gate_up = self.linear(self.rms_norm(x, layer["ffn_norm"]), layer["wgu"])
            gate, up = np.split(gate_up, 2, axis=-1)
            x = x + self.linear(gate / (1.0 + np.exp(-gate)) * up, layer["wdown"])
        return self.linear(self.rms_norm(x[-1:], w.final_norm), w.lm_head)[0]

    def new_cache(self) -> list[list[np.ndarray]]:
        return [[] for _ in range(self.cfg.num_layers)]

    def greedy(self, prompt: list[int], max_new: int) -> tuple[list[int], list[float]]:
        """The greedy continuation and, per token, its margin over the runner-up logit."""
        cache = self.new_cache()
        logits = self.forward(list(prompt), cache)
        out, margins = [], []
        for _ in range(max_new):
            top2 = np.partition(logits, -2)[-2:]
            out.append(int(logits.argmax()))
            margins.append(float(top2[1] - top2[0]))
            if len(out) < max_new:
                logits = self.forward([out[-1]], cache)
        return out, margins
