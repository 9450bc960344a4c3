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
        if id(lin) not in self._dequant:  # W[n, k]: the values the products read
            w = lin.q.dequantize()
            self._dequant[id(lin)] = (lin, np.ascontiguousarray(w.T, np.float32))
        w_t = self._dequant[id(lin)][1]
        hi, lo, s, base, _ = reference.quantize_activations(x32)
        t, k = hi.shape
        xq = s[..., None].astype(np.float64) * (
            base[..., None] * hi.reshape(t, -1, 32).astype(np.float64) + lo.reshape(t, -1, 32)
        )
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


class GGUFOracle:
    """A GGUF file's own forward in float64, from ``gguf.GGUFReader`` and ``gguf.quants.dequantize`` only.

    Nothing of pagedkv_rs is used: the weights are gguf's dequantization, the variants' math is read off
    the metadata here: Q/K/V biases (Qwen2), RoPE on adjacent pairs as llama.cpp runs the ``llama``
    architecture (its converter permutes Q/K rows so) or on halves for ``qwen2`` (NeoX order), Llama 3
    ``rope_freqs`` divisors, linear ``rope.scaling.factor``, ``attention.sliding_window``, tied or untied
    embeddings. ``int8_acts``: the activations entering each projection are first quantized as
    ``reference.quantize_activations`` specifies (what the int8 QLinear computes).
    """

    def __init__(self, path: str, *, int8_acts: bool = False, kv_dtype: str = "float32"):
        import gguf
        from gguf.quants import dequantize

        r = gguf.GGUFReader(path)
        meta = {k: f.contents() for k, f in r.fields.items()}
        arch = meta["general.architecture"]
        p = arch + "."
        self.t: dict[str, np.ndarray] = {}
        for t in r.tensors:
            shape = tuple(int(x) for x in reversed(t.shape.tolist()))
            self.t[t.name] = np.asarray(dequantize(t.data, t.tensor_type), np.float64).reshape(shape)
        self.layers = int(meta[p + "block_count"])
        self.hq = int(meta[p + "attention.head_count"])
        self.hkv = int(meta.get(p + "attention.head_count_kv", self.hq))
        self.d = int(meta[p + "embedding_length"]) // self.hq
        self.eps = float(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-5))
        self.window = meta.get(p + "attention.sliding_window")
        self.neox = arch == "qwen2"
        theta = float(meta.get(p + "rope.freq_base", 10000.0))
        self.inv_freq = theta ** (-np.arange(0, self.d, 2, dtype=np.float64) / self.d)
        if "rope_freqs.weight" in self.t:
            self.inv_freq = self.inv_freq / self.t["rope_freqs.weight"]
        self.pos_scale = 1.0
        if meta.get(p + "rope.scaling.type") == "linear":
            self.pos_scale = 1.0 / float(meta[p + "rope.scaling.factor"])
        self.head = self.t.get("output.weight", self.t["token_embd.weight"])
        self.int8_acts = int8_acts
        self.kv_dtype = _np_dtype(kv_dtype)

    def linear(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        if self.int8_acts:
            hi, lo, s, base, _ = reference.quantize_activations(np.ascontiguousarray(x, np.float32))
            t, k = hi.shape
            x = s[..., None].astype(np.float64) * (
                base[..., None] * hi.reshape(t, -1, 32).astype(np.float64) + lo.reshape(t, -1, 32)
            )
            x = x.reshape(t, k)
        return x @ w.T

    def rms(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + self.eps) * w

    def rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        ang = (pos[:, None] * self.pos_scale) * self.inv_freq
        c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
        out = np.empty_like(x)
        if self.neox:
            h = self.d // 2
            a, b = x[..., :h], x[..., h:]
            out[..., :h], out[..., h:] = a * c - b * s, b * c + a * s
        else:
            a, b = x[..., 0::2], x[..., 1::2]
            out[..., 0::2], out[..., 1::2] = a * c - b * s, b * c + a * s
        return out

    def forward(self, ids: list[int], cache: list[list[np.ndarray]]) -> np.ndarray:
        """Next-token logits [V] after ``ids``, appending their K/V (rounded to the cache dtype)."""
        hq, hkv, d, t = self.hq, self.hkv, self.d, self.t
        start = 0 if not cache[0] else cache[0][0].shape[0]
        pos = np.arange(start, start + len(ids), dtype=np.float64)
        x = t["token_embd.weight"][np.asarray(ids)]
        for i, kv in enumerate(cache):
            b = f"blk.{i}."
            h = self.rms(x, t[b + "attn_norm.weight"])
            q, k, v = (self.linear(h, t[b + f"attn_{n}.weight"]) + t.get(b + f"attn_{n}.bias", 0.0) for n in "qkv")
            q = self.rope(q.reshape(-1, hq, d), pos)
            k = self.rope(k.reshape(-1, hkv, d), pos)
            v = v.reshape(-1, hkv, d)
            k = k.astype(np.float32).astype(self.kv_dtype).astype(np.float64)
            v = v.astype(np.float32).astype(self.kv_dtype).astype(np.float64)
            if kv:
                k, v = np.concatenate([kv[0], k]), np.concatenate([kv[1], v])
            kv[:] = [k, v]
            g = hq // hkv
            kk, vv = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
            s = np.einsum("thd,shd->hts", q, kk) / np.sqrt(d)
            qpos, kpos = start + np.arange(len(ids))[:, None], np.arange(k.shape[0])[None, :]
            allowed = kpos <= qpos
            if self.window is not None:
                allowed &= kpos > qpos - int(self.window)
            s = np.where(allowed, s, -np.inf)
            pr = np.exp(s - s.max(-1, keepdims=True))
            pr /= pr.sum(-1, keepdims=True)
            o = np.einsum("hts,shd->thd", pr, vv).reshape(len(ids), hq * d)
            x = x + self.linear(o, t[b + "attn_output.weight"])
            h = self.rms(x, t[b + "ffn_norm.weight"])
            gate, up = self.linear(h, t[b + "ffn_gate.weight"]), self.linear(h, t[b + "ffn_up.weight"])
            x = x + self.linear(gate / (1.0 + np.exp(-gate)) * up, t[b + "ffn_down.weight"])
        return self.linear(self.rms(x[-1:], t["output_norm.weight"]), self.head)[0]

    def greedy(self, prompt: list[int], max_new: int) -> tuple[list[int], list[float]]:
        """The greedy continuation and, per token, its margin over the runner-up logit."""
        cache: list[list[np.ndarray]] = [[] for _ in range(self.layers)]
        logits = self.forward(list(prompt), cache)
        out, margins = [], []
        for _ in range(max_new):
            top2 = np.partition(logits, -2)[-2:]
            out.append(int(logits.argmax()))
            margins.append(float(top2[1] - top2[0]))
            if len(out) < max_new:
                logits = self.forward([out[-1]], cache)
        return out, margins
