"""Type stubs of the compiled core ``pagedkv_rs._core`` (checked by ``python -m mypy.stubtest``)."""

from typing import Any, Optional, Sequence, Union

import numpy as np
import numpy.typing as npt

__all__ = [
    "core_version",
    "build_profile",
    "copy_blocks",
    "fma_peak",
    "get_num_threads",
    "kernel_info",
    "memory_bandwidth",
    "new_kv_cache",
    "paged_attention",
    "set_kernel_backend",
    "set_num_threads",
    "write_kv",
]

def core_version() -> str: ...

# ------------------------------------------------------------------------------------------
# Kernel functions (attention, cache writes, threads, probes).

_DType = Union[str, np.dtype[Any], type]
_F32 = npt.NDArray[np.float32]

def new_kv_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: _DType = "float16"
) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]: ...
def write_kv(
    k_cache: npt.NDArray[Any],
    v_cache: npt.NDArray[Any],
    key: _F32,
    value: _F32,
    slot_mapping: npt.NDArray[np.int64],
) -> None: ...
def copy_blocks(
    k_cache: npt.NDArray[Any],
    v_cache: npt.NDArray[Any],
    pairs: Union[npt.NDArray[np.int64], Sequence[tuple[int, int]]],
) -> None: ...
def paged_attention(
    q: _F32,
    k_cache: npt.NDArray[Any],
    v_cache: npt.NDArray[Any],
    block_tables: npt.NDArray[np.int32],
    seq_lens: npt.NDArray[np.int32],
    query_start_loc: npt.NDArray[np.int32],
    *,
    scale: Optional[float] = None,
    sliding_window: Optional[int] = None,
    soft_cap: Optional[float] = None,
    out: Optional[_F32] = None,
) -> _F32: ...
def set_kernel_backend(name: str) -> None: ...
def set_num_threads(n: int) -> None: ...
def get_num_threads() -> int: ...
def kernel_info() -> dict[str, Union[str, int, bool]]: ...
def build_profile() -> str: ...
def memory_bandwidth(bytes: int = 1073741824, threads: Optional[int] = None) -> float: ...
def fma_peak(seconds: float = 0.2, threads: Optional[int] = None) -> float: ...
