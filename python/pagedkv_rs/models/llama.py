"""Llama-architecture forward pass in numpy, over our paged KV cache.

Two consumers of one set of float32 weights (:class:`LlamaWeights`):

- :class:`LlamaModel` implements the engine's ``Model`` protocol: one ``forward`` per step for all
  scheduled tokens of all sequences, one ``write_kv`` and one varlen ``paged_attention`` per layer.
- :class:`DenseLlama` is a plain contiguous-KV forward for tests and baselines; it shares the
  weights and the per-token math (RMSNorm, RoPE, SwiGLU) but none of the cache or attention code.

Shapes: T = tokens this step, H = hidden, Hq/Hkv = query/KV heads, D = head_dim, F = FFN width.
Activations are 2-D ``[T, H]`` so each weight multiply is one BLAS sgemm.

RoPE convention: llama.cpp's converter permutes the rows of ``attn_q``/``attn_k`` so that the
rotated pairs are adjacent (``(x[2i], x[2i+1])``). We undo that permutation at load and rotate
halves (``(x[i], x[i + D/2])``) as Hugging Face does; ``rope_pairs="adjacent"`` keeps the GGUF
order and rotates adjacent pairs instead (numerically the same model; used by the tests), and
``"mismatched"`` deliberately mixes the two to show the tests catch it.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np

from pagedkv_rs.batch import BatchInputs
from pagedkv_rs.models.gguf_loader import GGUFFile, LlamaConfig, load_gguf

__all__ = ["DenseLlama", "LlamaModel", "LlamaWeights", "eos_ids_from_metadata", "kernels", "unpermute_rope_rows"]

ROPE_MODES = ("half", "adjacent", "mismatched")


def kernels() -> types.ModuleType:
    """``pagedkv_rs.kernels``: ``new_kv_cache/write_kv/copy_blocks/paged_attention``, Rust when built."""
    from pagedkv_rs import kernels as k

    return k


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: adjacent-pair order -> rotate-half order. w: [n_heads*D, in]."""
    out_dim = w.shape[0]
    d = out_dim // n_heads
    return np.ascontiguousarray(w.reshape(n_heads, d // 2, 2, -1).swapaxes(1, 2).reshape(w.shape))


class LlamaWeights:
    """Float32 weights in ``x @ W`` layout with fused QKV and gate/up projections, plus RoPE tables."""

    def __init__(self, gguf: GGUFFile, *, rope_pairs: str = "half"):
        if rope_pairs not in ROPE_MODES:
            raise ValueError(f"rope_pairs must be one of {ROPE_MODES}, got {rope_pairs!r}")
        cfg = gguf.config
        t = gguf.tensors
        self.config: LlamaConfig = cfg
        self.path = gguf.path
        self.rope_pairs = rope_pairs
        unpermute = rope_pairs == "half"
        self.embed: np.ndarray = t["token_embd.weight"]  # [V, H]
        self.lm_head_t: np.ndarray = self.embed.T if cfg.tie_embeddings else np.ascontiguousarray(t["output.weight"]).T
        self.final_norm: np.ndarray = t["output_norm.weight"]
        self.layers: list[dict[str, np.ndarray]] = []
        for i in range(cfg.num_layers):
            b = f"blk.{i}."
            wq, wk = t[b + "attn_q.weight"], t[b + "attn_k.weight"]
            if unpermute:
                wq = unpermute_rope_rows(wq, cfg.num_heads)
                wk = unpermute_rope_rows(wk, cfg.num_kv_heads)
            self.layers.append(
                {
                    "attn_norm": t[b + "attn_norm.weight"],
                    "ffn_norm": t[b + "ffn_norm.weight"],
                    # [H, (Hq + 2 Hkv) D]
                    "wqkv": np.ascontiguousarray(np.concatenate([wq, wk, t[b + "attn_v.weight"]], axis=0).T),
                    "wo": np.ascontiguousarray(t[b + "attn_output.weight"].T),  # [Hq D, H]
                    # [H, 2F]: gate columns then up columns
                    "wgu": np.ascontiguousarray(np.concatenate([t[b + "ffn_gate.weight"], t[b + "ffn_up.weight"]]).T),
                    "wdown": np.ascontiguousarray(t[b + "ffn_down.weight"].T),  # [F, H]
                }
            )
        d = cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        ang = np.arange(cfg.max_model_len, dtype=np.float64)[:, None] * inv_freq[None, :]
        self.cos: np.ndarray = np.cos(ang).astype(np.float32)  # [max_len, D/2]
        self.sin: np.ndarray = np.sin(ang).astype(np.float32)

    @classmethod
    def load(cls, path: Any = None, *, rope_pairs: str = "half") -> "LlamaWeights":
        return cls(path if isinstance(path, GGUFFile) else load_gguf(path), rope_pairs=rope_pairs)


# ---- per-token math shared by both forwards -------------------------------------------------


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x: [T, in] @ w: [in, out] -> [T, out]: one sgemm (a named function so profiles can attribute it)."""
    return x @ w


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x: [T, H] -> [T, H]."""
    ms = np.einsum("th,th->t", x, x) / np.float32(x.shape[1])
    return x * (1.0 / np.sqrt(ms + np.float32(eps)))[:, None] * w


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


def swiglu_mlp(h: np.ndarray, layer: dict[str, np.ndarray], f: int) -> np.ndarray:
    """h: [T, H] -> [T, H] via one fused gate/up sgemm."""
    gu = linear(h, layer["wgu"])  # [T, 2F]
    g, u = gu[:, :f], gu[:, f:]
    # silu(g) * u, in place in the gate half
    act = np.negative(g)
    np.exp(act, out=act)
    act += 1.0
    np.divide(g, act, out=act)
    act *= u
    return linear(act, layer["wdown"])


def _rope_mode(w: LlamaWeights) -> str:
    # "mismatched": GGUF row order rotated by halves, wrong on purpose (a test shows it is caught).
    return {"half": "half", "adjacent": "adjacent", "mismatched": "half"}[w.rope_pairs]


# ---- the paged model (engine Model protocol) ------------------------------------------------


class LlamaModel:
    """Llama forward over the paged KV cache; implements the engine's ``Model`` protocol."""

    def __init__(self, weights: LlamaWeights, *, eos_token_ids: Sequence[int] = (), kernel: Any = None):
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

    @classmethod
    def load(cls, path: Any = None, **kw: Any) -> "LlamaModel":
        g = path if isinstance(path, GGUFFile) else load_gguf(path)
        return cls(LlamaWeights(g), eos_token_ids=eos_ids_from_metadata(g.metadata))

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

    def forward(self, batch: BatchInputs, kv_caches: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
        """Float32 logits ``[B, V]`` for each sequence's last scheduled token of this step."""
        hidden = self.forward_hidden(batch, kv_caches)
        qsl = np.asarray(batch.query_start_loc, np.int64)
        if np.any(qsl[1:] <= qsl[:-1]):
            raise ValueError("every sequence in a forward batch needs at least one scheduled token")
        last = hidden[qsl[1:] - 1]  # [B, H]
        w = self.weights
        return linear(rms_norm(last, w.final_norm, self.config.rms_eps), w.lm_head_t)

    def forward_hidden(self, batch: BatchInputs, kv_caches: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
        """Residual stream ``[T, H]`` after the last layer (before the final norm)."""
        cfg, w, kern = self.config, self.weights, self.kernel
        if len(kv_caches) != cfg.num_layers:
            raise ValueError(f"need {cfg.num_layers} (k_cache, v_cache) pairs, got {len(kv_caches)}")
        ids = np.asarray(batch.input_ids, np.int64)
        pos = np.asarray(batch.positions, np.int64)
        n = ids.shape[0]
        if n and (ids.min() < 0 or ids.max() >= cfg.vocab_size):
            raise ValueError(f"token ids must be in [0, {cfg.vocab_size})")
        if n and (pos.min() < 0 or pos.max() >= cfg.max_model_len):
            raise ValueError(f"positions must be in [0, {cfg.max_model_len})")
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        nq, nk = hq * d, hkv * d
        cos, sin = w.cos[pos], w.sin[pos]
        x = w.embed[ids]  # [T, H] (a copy: the residual stream)
        attn = np.empty((n, hq, d), np.float32)
        for layer, (k_cache, v_cache) in zip(w.layers, kv_caches):
            h = rms_norm(x, layer["attn_norm"], cfg.rms_eps)
            qkv = linear(h, layer["wqkv"])  # [T, (Hq + 2 Hkv) D]
            q = apply_rope(qkv[:, :nq].reshape(n, hq, d), cos, sin, self._mode)
            k = apply_rope(qkv[:, nq : nq + nk].reshape(n, hkv, d), cos, sin, self._mode)
            v = np.ascontiguousarray(qkv[:, nq + nk :]).reshape(n, hkv, d)
            kern.write_kv(k_cache, v_cache, k, v, batch.slot_mapping)
            kern.paged_attention(
                q, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc, out=attn
            )
            x += linear(attn.reshape(n, nq), layer["wo"])
            x += swiglu_mlp(rms_norm(x, layer["ffn_norm"], cfg.rms_eps), layer, cfg.intermediate_size)
        return x


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
        cos, sin = w.cos[pos], w.sin[pos]
        mask = np.arange(end)[None, :] <= np.arange(start, end)[:, None]  # [T, S]
        scale = np.float32(1.0 / np.sqrt(d))
        x = w.embed[ids.reshape(-1)]  # [B*T, H]
        for layer, (kc, vc) in zip(w.layers, cache):
            h = rms_norm(x, layer["attn_norm"], cfg.rms_eps)
            qkv = h @ layer["wqkv"]
            q = apply_rope(qkv[:, :nq].reshape(b * t, hq, d), cos, sin, self._mode)
            k = apply_rope(qkv[:, nq : nq + nk].reshape(b * t, hkv, d), cos, sin, self._mode)
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
            o = o.reshape(b, hkv, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b * t, nq)
            x += o @ layer["wo"]
            x += swiglu_mlp(rms_norm(x, layer["ffn_norm"], cfg.rms_eps), layer, cfg.intermediate_size)
        if all_positions:
            return (rms_norm(x, w.final_norm, cfg.rms_eps) @ w.lm_head_t).reshape(b, t, -1)
        last = x.reshape(b, t, -1)[:, -1]
        return rms_norm(last, w.final_norm, cfg.rms_eps) @ w.lm_head_t

    def generate_greedy(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                        eos_token_ids: Sequence[int] = ()) -> list[list[int]]:
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
