"""The kernel functions the engine and models call: the one public kernel path.

``write_kv``, ``paged_attention``, ``copy_blocks``, ``write_blocks``, ``new_kv_cache``, ``rms_norm``,
``silu_and_mul`` and ``gelu_tanh_and_mul`` come from the compiled core when it is built, else from the
float64 numpy reference (``pagedkv_rs.kernels.reference``), which has the same signatures.

The kernel source is read once at import from ``PAGEDKV_KERNEL=auto|rust|reference`` (``auto``: Rust
when built; parsed here only) and switched at run time with ``set_kernel_source``; ``kernel_source()``
says which is in use. The ISA the Rust kernels run is a separate switch, ``PAGEDKV_ISA`` (parsed by
the Rust core only) or ``pagedkv_rs.set_isa``.
"""

from __future__ import annotations

import os
import types
import warnings
from typing import Any

from pagedkv_rs._backend import _core
from pagedkv_rs.kernels import reference

__all__ = [
    "write_kv",
    "paged_attention",
    "copy_blocks",
    "write_blocks",
    "new_kv_cache",
    "rms_norm",
    "silu_and_mul",
    "gelu_tanh_and_mul",
    "kernel_source",
    "set_kernel_source",
    "KERNEL_SOURCES",
    "reference",
]

KERNEL_SOURCES = ("auto", "rust", "reference")
_impl: types.ModuleType = reference  # the module the kernel functions dispatch to


def set_kernel_source(name: str) -> None:
    """Run the kernels from ``"rust"``, the numpy ``"reference"``, or ``"auto"`` (Rust when built)."""
    global _impl
    if name not in KERNEL_SOURCES:
        raise ValueError(f"unknown kernel source {name!r}: expected 'auto', 'rust' or 'reference'")
    if name == "rust" and _core is None:
        raise ImportError("kernel source 'rust' but the compiled core pagedkv_rs._core is not built")
    _impl = reference if name == "reference" or _core is None else _core


def kernel_source() -> str:
    """``"rust"`` when the compiled kernels are used, else ``"reference"``."""
    return "reference" if _impl is reference else "rust"


def _source_from_env(value: str) -> str:
    value = value.strip().lower() or "auto"
    if value not in KERNEL_SOURCES:
        warnings.warn(
            f"PAGEDKV_KERNEL={value!r} is not one of auto, rust, reference (an ISA is PAGEDKV_ISA's): using auto",
            stacklevel=3,
        )
        return "auto"
    return value


set_kernel_source(_source_from_env(os.environ.get("PAGEDKV_KERNEL", "")))


def write_kv(*args: Any, **kwargs: Any) -> None:
    """Scatter this step's K/V into the caches at ``slot_mapping`` (see ``reference.write_kv``)."""
    return _impl.write_kv(*args, **kwargs)


def paged_attention(*args: Any, **kwargs: Any) -> Any:
    """Causal attention of each sequence's new tokens over its cached blocks."""
    return _impl.paged_attention(*args, **kwargs)


def copy_blocks(*args: Any, **kwargs: Any) -> None:
    """Whole-block (src, dst) copies in both caches."""
    return _impl.copy_blocks(*args, **kwargs)


def write_blocks(*args: Any, **kwargs: Any) -> None:
    """Whole blocks from outside the pool (a KV tier) into both caches (see ``reference.write_blocks``)."""
    return _impl.write_blocks(*args, **kwargs)


def new_kv_cache(*args: Any, **kwargs: Any) -> Any:
    """Allocate one layer's (k_cache, v_cache) ``[num_blocks, num_kv_heads, block_size, head_dim]``."""
    return _impl.new_kv_cache(*args, **kwargs)


def rms_norm(*args: Any, **kwargs: Any) -> Any:
    """RMSNorm per row, optionally fused with the residual add (see ``reference.rms_norm``)."""
    return _impl.rms_norm(*args, **kwargs)


def silu_and_mul(*args: Any, **kwargs: Any) -> Any:
    """SwiGLU activation ``silu(gate) * up`` of a fused ``[T, 2F]`` projection."""
    return _impl.silu_and_mul(*args, **kwargs)


def gelu_tanh_and_mul(*args: Any, **kwargs: Any) -> Any:
    """GeGLU activation ``gelu_tanh(gate) * up`` of a fused ``[T, 2F]`` projection (Gemma)."""
    return _impl.gelu_tanh_and_mul(*args, **kwargs)
