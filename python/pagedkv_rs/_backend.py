"""The allocator backend, chosen once at import by ``PAGEDKV_BACKEND=auto|rust|python``.

``auto`` (the default) is the Rust core when it is built, else the pure-Python ``fallback``.
``BACKEND`` names the choice, ``BlockAllocator`` / ``KVCacheManager`` are its classes, and
``backend(name)`` hands out either backend explicitly. ``_core`` is the compiled module, or
``None`` when it is not installed (a pure-Python install; ``CORE_IMPORT_ERROR`` says why). A core
that is installed but fails to load (ABI, missing symbol) raises at import instead of being hidden.
"""

from __future__ import annotations

import importlib
import os
import types

from pagedkv_rs import fallback

CORE_IMPORT_ERROR: str = ""
try:
    _core = importlib.import_module("pagedkv_rs._core")
except ModuleNotFoundError as e:  # a pure-Python install: only the missing module itself is tolerated
    if e.name != "pagedkv_rs._core":
        raise
    _core = None  # type: ignore[assignment]
    CORE_IMPORT_ERROR = f"{type(e).__name__}: {e}"

__all__ = ["BACKEND", "BACKENDS", "BlockAllocator", "KVCacheManager", "backend", "manager_class"]

BACKENDS: tuple[str, ...] = ("rust", "python") if _core is not None else ("python",)


def backend(name: str = "auto") -> types.SimpleNamespace:
    """Return the allocator classes of one backend: ``.BlockAllocator``, ``.KVCacheManager``, ``.name``."""
    if name == "auto":
        name = "rust" if _core is not None else "python"
    mod: types.ModuleType
    if name == "rust":
        if _core is None:
            raise ImportError(
                f"PAGEDKV_BACKEND=rust but the compiled core pagedkv_rs._core is not built ({CORE_IMPORT_ERROR})"
            )
        mod = _core
    elif name == "python":
        mod = fallback
    else:
        raise ValueError(f"unknown backend {name!r}: expected 'auto', 'rust' or 'python'")
    return types.SimpleNamespace(name=name, BlockAllocator=mod.BlockAllocator, KVCacheManager=mod.KVCacheManager)


def manager_class(spec: object) -> type:
    """The ``KVCacheManager`` class of a backend name, of a ``backend()`` namespace, or the class itself."""
    if isinstance(spec, str):
        return backend(spec).KVCacheManager
    return getattr(spec, "KVCacheManager", spec)  # type: ignore[no-any-return]


_selected = backend(os.environ.get("PAGEDKV_BACKEND", "auto").strip().lower() or "auto")
BACKEND: str = _selected.name
BlockAllocator = _selected.BlockAllocator
KVCacheManager = _selected.KVCacheManager
