"""Plain numpy reference of the paged KV-cache kernels: the executable spec of the Rust ones.

Same names, signatures and semantics as ``pagedkv_rs.new_kv_cache / write_kv / copy_blocks /
write_blocks / paged_attention``; attention is computed in float64 and returned as float32. It gathers, per
sequence, exactly its ``seq_len`` cached tokens through its block table (never a slot beyond),
so a cache whose unused slots hold NaN still gives finite results.

Layout
------
``k_cache`` and ``v_cache``: ``[num_blocks, num_kv_heads, block_size, head_dim]``, C-contiguous.
Slot ``s`` is block ``s // block_size``, offset ``s % block_size``; a block is one contiguous
stretch of memory and each (block, kv_head) a contiguous ``block_size * head_dim`` tile.

Attention
---------
Sequence ``i`` owns q rows ``query_start_loc[i]:query_start_loc[i+1]`` (``q_len`` rows), its last
tokens, at positions ``seq_lens[i] - q_len ... seq_lens[i] - 1``. Row at position ``p`` attends to
key positions ``t`` with ``t <= p`` and, with a ``sliding_window`` ``w``, ``t > p - w``.
Logits are ``scale * q.k`` (default ``scale = 1/sqrt(head_dim)``), then ``soft_cap * tanh(l / soft_cap)``
when ``soft_cap`` is set. Query head ``h`` reads KV head ``h // (num_q_heads // num_kv_heads)``.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Union

import numpy as np

__all__ = [
    "new_kv_cache",
    "write_kv",
    "copy_blocks",
    "write_blocks",
    "paged_attention",
    "cache_dtype",
    "quantize_activations",
    "qlinear",
    "rms_norm",
    "silu_and_mul",
    "gelu_tanh_and_mul",
]

DTypeLike = Union[str, np.dtype, type]


def cache_dtype(dtype: Any) -> np.dtype:
    """Resolve ``"float32" | "float16" | "bfloat16"`` (or such a numpy dtype) to a numpy dtype."""
    if isinstance(dtype, str):
        if dtype == "bfloat16":
            import ml_dtypes

            return np.dtype(ml_dtypes.bfloat16)
        if dtype not in ("float32", "float16"):
            raise ValueError(f"cache dtype must be 'float32', 'float16' or 'bfloat16', got {dtype!r}")
        return np.dtype(dtype)
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise TypeError(f"cache dtype must be a str or numpy dtype, got {dtype!r}") from exc
    if dt.name not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"cache dtype must be float32, float16 or bfloat16, got {dt.name}")
    return dt


def new_kv_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: DTypeLike = "float16"
) -> tuple[np.ndarray, np.ndarray]:
    """Zeroed ``(k_cache, v_cache)``, each ``[num_blocks, num_kv_heads, block_size, head_dim]``."""
    dt = cache_dtype(dtype)
    for name, v in (
        ("num_blocks", num_blocks),
        ("block_size", block_size),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
    ):
        if int(v) < (0 if name == "num_blocks" else 1):
            raise ValueError(f"{name} must be positive, got {v}")
    shape = (int(num_blocks), int(num_kv_heads), int(block_size), int(head_dim))
    return np.zeros(shape, dt), np.zeros(shape, dt)


def _check_caches(k_cache: np.ndarray, v_cache: np.ndarray) -> None:
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"k_cache and v_cache must be 4-d with one shape and dtype, got {k_cache.shape} {k_cache.dtype}"
            f" and {v_cache.shape} {v_cache.dtype}"
        )
    cache_dtype(k_cache.dtype)


def write_kv(
    k_cache: np.ndarray, v_cache: np.ndarray, key: np.ndarray, value: np.ndarray, slot_mapping: np.ndarray
) -> None:
    """Scatter ``key``/``value`` ``[T, num_kv_heads, head_dim]`` into slots ``slot_mapping`` ``[T]`` (-1 = skip)."""
    _check_caches(k_cache, v_cache)
    nb, hkv, bs, d = k_cache.shape
    slots = np.asarray(slot_mapping, dtype=np.int64)
    if key.shape != value.shape or key.shape != (slots.shape[0], hkv, d):
        raise ValueError(f"key/value must be [{slots.shape[0]}, {hkv}, {d}], got {key.shape} and {value.shape}")
    if np.any((slots < -1) | (slots >= nb * bs)):
        raise ValueError(f"slot ids must be -1 or in [0, {nb * bs})")
    keep = slots >= 0
    s = slots[keep]
    # Advanced indices split by a slice: the result is [n, hkv, d], matching key[keep].
    k_cache[s // bs, :, s % bs, :] = key[keep].astype(k_cache.dtype)
    v_cache[s // bs, :, s % bs, :] = value[keep].astype(v_cache.dtype)


def copy_blocks(k_cache: np.ndarray, v_cache: np.ndarray, pairs: Any) -> None:
    """Copy whole blocks ``src -> dst`` for each ``(src, dst)`` in ``pairs`` (``[n, 2]``), in order."""
    _check_caches(k_cache, v_cache)
    p = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    nb = k_cache.shape[0]
    if np.any((p < 0) | (p >= nb)):
        raise ValueError(f"block ids must be in [0, {nb})")
    for src, dst in p:
        k_cache[dst] = k_cache[src]
        v_cache[dst] = v_cache[src]


def write_blocks(
    k_cache: np.ndarray, v_cache: np.ndarray, block_ids: Any, k_blocks: np.ndarray, v_blocks: np.ndarray
) -> None:
    """Write ``k_blocks``/``v_blocks`` ``[n, num_kv_heads, block_size, head_dim]`` (the caches' dtype) into
    blocks ``block_ids`` ``[n]``, in order."""
    _check_caches(k_cache, v_cache)
    if not (k_cache.flags.writeable and v_cache.flags.writeable):
        raise ValueError("k_cache and v_cache must be writeable")
    ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
    nb = k_cache.shape[0]
    want = (len(ids), *k_cache.shape[1:])
    for name, src in (("k_blocks", k_blocks), ("v_blocks", v_blocks)):
        if not isinstance(src, np.ndarray):
            raise TypeError(f"{name} must be a numpy.ndarray, got {type(src).__name__}")
        if src.dtype != k_cache.dtype:
            raise TypeError(f"{name} is {src.dtype} but the caches are {k_cache.dtype}")
        if src.shape != want:
            raise ValueError(f"{name} must be {list(want)} (len(block_ids), num_kv_heads, block_size, head_dim)")
    if np.any((ids < 0) | (ids >= nb)):
        raise ValueError(f"block ids must be in [0, {nb})")
    if any(np.may_share_memory(src, c) for src in (k_blocks, v_blocks) for c in (k_cache, v_cache)):
        raise ValueError("k_blocks and v_blocks must not share memory with the caches")
    for j, b in enumerate(ids):
        k_cache[b] = k_blocks[j]
        v_cache[b] = v_blocks[j]


def _csr_to_padded(csr: tuple, seq_lens: np.ndarray, bs: int) -> np.ndarray:
    """The padded table of a CSR ``(indptr, indices[, last_page_len])`` (checked as the kernel does)."""
    if len(csr) not in (2, 3):
        raise ValueError(f"a CSR block table is (indptr, indices[, last_page_len]), got a tuple of {len(csr)}")
    n_seq = seq_lens.shape[0]
    indptr = np.asarray(csr[0], dtype=np.int64)
    indices = np.asarray(csr[1], dtype=np.int64)
    if indptr.shape != (n_seq + 1,) or indices.ndim != 1:
        raise ValueError(f"need indptr [{n_seq + 1}] and indices [nnz], got {indptr.shape} and {indices.shape}")
    if indptr[0] != 0 or np.any(np.diff(indptr) < 0) or indptr[-1] != indices.shape[0]:
        raise ValueError("indptr must rise from 0 to len(indices)")
    counts = np.diff(indptr)
    need = -(-seq_lens // bs)
    if np.any(counts != need):
        i = int(np.flatnonzero(counts != need)[0])
        raise ValueError(f"sequence {i}: seq_len {seq_lens[i]} needs {need[i]} blocks, indptr gives it {counts[i]}")
    if len(csr) == 3:
        lpl = np.asarray(csr[2], dtype=np.int64)
        implied = np.where(counts > 0, (counts - 1) * bs + lpl, 0)
        valid = np.where(counts > 0, (lpl >= 1) & (lpl <= bs), lpl == 0)
        if lpl.shape != (n_seq,) or np.any(~valid) or np.any(implied != seq_lens):
            raise ValueError("last_page_len must agree with seq_lens and indptr")
    tables = np.full((n_seq, max(1, int(counts.max(initial=0)))), -1, np.int64)
    for i in range(n_seq):
        tables[i, : counts[i]] = indices[indptr[i] : indptr[i + 1]]
    return tables


def paged_attention(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    block_tables: Any,
    seq_lens: np.ndarray,
    query_start_loc: np.ndarray,
    *,
    scale: Optional[float] = None,
    sliding_window: Optional[int] = None,
    soft_cap: Optional[float] = None,
    out: Optional[np.ndarray] = None,
) -> np.ndarray:
    """Causal varlen attention over the paged cache; float64 inside, float32 ``out`` ``[T, Hq, D]``.

    ``block_tables``: the padded ``[B, max_blocks]`` table, or the CSR tuple ``(indptr, indices)`` /
    ``(indptr, indices, last_page_len)`` (sequence ``i``'s blocks ``indices[indptr[i]:indptr[i+1]]``,
    exactly ``ceil(seq_lens[i] / block_size)`` of them; ``last_page_len`` must agree with ``seq_lens``)."""
    _check_caches(k_cache, v_cache)
    nb, hkv, bs, d = k_cache.shape
    if q.ndim != 3 or q.shape[2] != d or q.shape[1] % hkv:
        raise ValueError(f"q must be [T, Hq, {d}] with Hq a multiple of {hkv}, got {q.shape}")
    t_total, hq, _ = q.shape
    group = hq // hkv
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    n_seq = seq_lens.shape[0]
    if isinstance(block_tables, tuple):
        tables = _csr_to_padded(block_tables, seq_lens, bs)
    else:
        tables = np.asarray(block_tables, dtype=np.int64)
    if qsl.shape != (n_seq + 1,) or tables.ndim != 2 or tables.shape[0] != n_seq:
        raise ValueError("need seq_lens [B], query_start_loc [B+1], block_tables [B, max_blocks]")
    if qsl[0] != 0 or qsl[-1] != t_total or np.any(np.diff(qsl) < 0):
        raise ValueError("query_start_loc must rise from 0 to num_tokens")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError("sliding_window must be >= 1")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError("soft_cap must be > 0")
    sc = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if out is None:
        out = np.empty(q.shape, np.float32)
    elif out.shape != q.shape or out.dtype != np.float32:
        raise ValueError(f"out must be float32 {q.shape}")

    for i in range(n_seq):
        lo, hi = int(qsl[i]), int(qsl[i + 1])
        q_len, seq_len = hi - lo, int(seq_lens[i])
        if q_len == 0:
            continue
        if not q_len <= seq_len <= tables.shape[1] * bs:
            raise ValueError(f"sequence {i}: q_len {q_len}, seq_len {seq_len}, table capacity {tables.shape[1] * bs}")
        pos = np.arange(seq_len)
        blocks = tables[i, pos // bs]
        if np.any((blocks < 0) | (blocks >= nb)):
            raise ValueError(f"sequence {i}: block id out of [0, {nb})")
        # Exactly this sequence's seq_len tokens: [L, hkv, d].
        k = k_cache[blocks, :, pos % bs, :].astype(np.float64)
        v = v_cache[blocks, :, pos % bs, :].astype(np.float64)
        qi = q[lo:hi].astype(np.float64).reshape(q_len, hkv, group, d)
        logits = np.einsum("qhgd,khd->hgqk", qi, k) * sc  # [hkv, group, q_len, L]
        if soft_cap is not None:
            logits = soft_cap * np.tanh(logits / soft_cap)
        qpos = np.arange(seq_len - q_len, seq_len)[:, None]
        allowed = pos[None, :] <= qpos
        if sliding_window is not None:
            allowed &= pos[None, :] > qpos - sliding_window
        logits = np.where(allowed, logits, -np.inf)
        logits -= logits.max(axis=-1, keepdims=True)
        p = np.exp(logits)
        p /= p.sum(axis=-1, keepdims=True)
        o = np.einsum("hgqk,khd->qhgd", p, v)
        out[lo:hi] = o.reshape(q_len, hq, d).astype(np.float32)
    return out


# ---- block-quantized linear layer (spec of pagedkv_rs.QLinear) --------------------------------

QBLOCK = 32


BASE_BUDGET = 8.0e6  # R * sum|hi| at most (keeps every R * sum(c * hi) + sum(c * lo) in int32)
BASE_CAP = 32767  # R at most (an int16)


def _codes(v: np.ndarray, inv: np.ndarray) -> np.ndarray:
    """``clip(rint(v * inv), -127, 127)`` per 32-wide block, float32."""
    return np.clip(np.rint(v * inv[..., None]), -127, 127).astype(np.float32)


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """float32 ``x [m, k]`` -> ``(hi, lo int8 [m, k], s float32, base int32, qs float32 [m, k/32])``.

    Two int8 digits per 32-wide block, one number in the block's own integer base ``R``: with
    ``a = max|x|``, ``hi = Q(x * (127/a))``, the rounding error ``e = x - (a/127)*hi``,
    ``R = min(floor(a / max|e|), floor(8e6 / sum|hi|), 32767)``, ``lo = Q(e * (127*R/a))``,
    ``Q(v) = clip(rint(v), -127, 127)``;
    then ``x ~= s * (R*hi + lo)`` with ``s = a / (127*R)``, and ``qs = s * sum(R*hi + lo)``. A block
    holding NaN or infinity gets ``s = qs = NaN``, an all-zero (or subnormal) one ``s = qs = 0``; both
    ``R = 0`` and zero digits. All in float32, in the order the Rust kernel uses, so the digits are
    identical.
    """
    x = np.asarray(x, np.float32)
    m, k = x.shape
    v = x.reshape(m, k // QBLOCK, QBLOCK)
    amax = np.abs(v).max(-1)
    bad = np.isnan(v).any(-1) | np.isinf(amax)
    tiny = ~bad & (amax < np.finfo(np.float32).tiny)
    skip = bad | tiny
    a = np.where(skip, np.float32(1), amax).astype(np.float32)
    hi = _codes(v, np.float32(127) / a)
    with np.errstate(invalid="ignore", divide="ignore"):
        err = (v - (a / np.float32(127))[..., None] * hi).astype(np.float32)
        abs_sum = np.abs(hi).sum(-1, dtype=np.float32)
        base = np.minimum(np.floor(a / np.abs(err).max(-1)), np.floor(np.float32(BASE_BUDGET) / abs_sum))
        base = np.minimum(base, np.float32(BASE_CAP)).astype(np.float32)
    units = np.float32(127) * base
    lo = _codes(err, units / a)
    hi[skip], lo[skip], base[skip] = 0, 0, 0
    s = np.where(bad, np.float32(np.nan), np.where(tiny, np.float32(0), a / np.where(skip, 1, units)))
    s = s.astype(np.float32)
    total = (base[..., None].astype(np.int64) * hi.astype(np.int64) + lo.astype(np.int64)).sum(-1)
    qs = (s * total.astype(np.float32)).astype(np.float32)
    return hi.reshape(m, k).astype(np.int8), lo.reshape(m, k).astype(np.int8), s, base.astype(np.int32), qs


def qlinear(x: np.ndarray, codes: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    """``x @ W.T`` with ``W[n, k] = d[n, k//32] * codes[n, k] + m[n, k//32]`` and x quantized as
    :func:`quantize_activations` does; float64 sums, returned as float32 ``[rows, n]``."""
    hi, lo, s, base, qs = quantize_activations(x)
    rows, k = hi.shape
    n = codes.shape[0]
    nb = k // QBLOCK
    c = codes.astype(np.float64).reshape(n, nb, QBLOCK)
    dot_h = np.einsum("rbj,nbj->rnb", hi.astype(np.float64).reshape(rows, nb, QBLOCK), c)
    dot_l = np.einsum("rbj,nbj->rnb", lo.astype(np.float64).reshape(rows, nb, QBLOCK), c)
    y = (
        d[None].astype(np.float64) * s[:, None].astype(np.float64) * (base[:, None].astype(np.float64) * dot_h + dot_l)
        + m[None].astype(np.float64) * qs[:, None].astype(np.float64)
    ).sum(-1)
    return y.astype(np.float32)


def qlinear_values(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x @ W.T`` with the weights' values ``w[n, k]`` as given (``QLinear.dequantize()``: every
    layout, split Q6_K panels too) and x quantized as :func:`quantize_activations` does; float64
    sums, returned as float32 ``[rows, n]``."""
    hi, lo, s, base, _ = quantize_activations(x)
    rows, k = hi.shape
    nb = k // QBLOCK
    xq = s[..., None].astype(np.float64) * (
        base[..., None].astype(np.float64) * hi.reshape(rows, nb, QBLOCK) + lo.reshape(rows, nb, QBLOCK)
    )
    return (xq.reshape(rows, k) @ np.asarray(w, np.float64).T).astype(np.float32)


# ---- row-wise ops of a Llama layer (spec of pagedkv_rs.rms_norm / silu_and_mul) ----------------


def _out(out: Optional[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
    if out is None:
        return np.zeros(shape, np.float32)
    if out.shape != shape or out.dtype != np.float32:
        raise ValueError(f"out must be float32 {list(shape)}, got {out.dtype} {list(out.shape)}")
    return out


def rms_norm(
    x: np.ndarray,
    weight: np.ndarray,
    eps: float,
    *,
    residual: Optional[np.ndarray] = None,
    out: Optional[np.ndarray] = None,
) -> np.ndarray:
    """``out = s / sqrt(mean(s**2) + eps) * weight`` per row, float64 inside; ``s = x``, or with a
    ``residual``: ``residual += x`` (float32, in place) and ``s = residual``."""
    x = np.asarray(x)
    if x.ndim != 2 or x.dtype != np.float32 or np.shape(weight) != (x.shape[1],):
        raise ValueError(f"rms_norm needs float32 x [T, H] and weight [H], got {x.dtype} {x.shape}, {np.shape(weight)}")
    o = _out(out, x.shape)
    if residual is not None:
        residual += x
        x = residual
    s = x.astype(np.float64)
    inv = 1.0 / np.sqrt((s * s).mean(axis=1, keepdims=True) + eps)
    o[...] = s * inv * np.asarray(weight, np.float64)
    return o


def silu_and_mul(gate_up: np.ndarray, *, out: Optional[np.ndarray] = None) -> np.ndarray:
    """float32 ``gate_up [T, 2F]`` -> ``silu(gate) * up`` ``[T, F]``, float64 inside."""
    g = np.asarray(gate_up)
    if g.ndim != 2 or g.shape[1] % 2 or g.dtype != np.float32:
        raise ValueError(f"silu_and_mul needs float32 gate_up [T, 2F], got {g.dtype} {g.shape}")
    f = g.shape[1] // 2
    o = _out(out, (g.shape[0], f))
    a, u = g[:, :f].astype(np.float64), g[:, f:].astype(np.float64)
    with np.errstate(over="ignore"):
        o[...] = a / (1.0 + np.exp(-a)) * u
    return o


def gelu_tanh_and_mul(gate_up: np.ndarray, *, out: Optional[np.ndarray] = None) -> np.ndarray:
    """float32 ``gate_up [T, 2F]`` -> ``gelu_tanh(gate) * up`` ``[T, F]``, float64 inside (Gemma's GeGLU).

    ``gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))``."""
    g = np.asarray(gate_up)
    if g.ndim != 2 or g.shape[1] % 2 or g.dtype != np.float32:
        raise ValueError(f"gelu_tanh_and_mul needs float32 gate_up [T, 2F], got {g.dtype} {g.shape}")
    f = g.shape[1] // 2
    o = _out(out, (g.shape[0], f))
    a, u = g[:, :f].astype(np.float64), g[:, f:].astype(np.float64)
    o[...] = 0.5 * a * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (a + 0.044715 * a**3))) * u
    return o
