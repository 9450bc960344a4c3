"""The allocator backend, chosen once at import by ``PAGEDKV_BACKEND=auto|rust|python``.

``auto`` (the default) is the Rust core when it is built, else the pure-Python ``fallback``.
``BACKEND`` names the choice, ``BlockAllocator`` / ``KVCacheManager`` are its classes, and
``backend(name)`` hands out either backend explicitly. ``_core`` is the compiled module, or
``None`` when it is not built.
"""

from __future__ import annotations

import os
import types

from pagedkv_rs import fallback

try:
    from pagedkv_rs import _core
except ImportError:  # pragma: no cover - only without a compiled core
    _core = None  # type: ignore[assignment]

__all__ = ["BACKEND", "BACKENDS", "BlockAllocator", "KVCacheManager", "backend"]

BACKENDS: tuple[str, ...] = ("rust", "python") if _core is not None else ("python",)


def backend(name: str = "auto") -> types.SimpleNamespace:
    """Return the allocator classes of one backend: ``.BlockAllocator``, ``.KVCacheManager``, ``.name``."""
    if name == "auto":
        name = "rust" if _core is not None else "python"
    mod: types.ModuleType
    if name == "rust":
        if _core is None:
            raise ImportError("PAGEDKV_BACKEND=rust but the compiled core pagedkv_rs._core is not built")
        mod = _core
    elif name == "python":
        mod = fallback
    else:
        raise ValueError(f"unknown backend {name!r}: expected 'auto', 'rust' or 'python'")
    return types.SimpleNamespace(name=name, BlockAllocator=mod.BlockAllocator, KVCacheManager=mod.KVCacheManager)


_selected = backend(os.environ.get("PAGEDKV_BACKEND", "auto").strip().lower() or "auto")
BACKEND: str = _selected.name
BlockAllocator = _selected.BlockAllocator
KVCacheManager = _selected.KVCacheManager
