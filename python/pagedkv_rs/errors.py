"""Exception classes shared by both backends (the Rust core raises these same classes)."""

from __future__ import annotations

__all__ = [
    "PagedKVError",
    "OutOfBlocksError",
    "UnknownSequenceError",
    "DuplicateSequenceError",
    "SequenceTooLongError",
    "DoubleFreeError",
]


class PagedKVError(Exception):
    """Base class of every error pagedkv_rs raises on purpose."""


class OutOfBlocksError(PagedKVError, MemoryError):
    """Not enough free or reclaimable blocks right now; nothing was changed."""


class UnknownSequenceError(PagedKVError, LookupError):
    """The sequence id is not held by this cache manager."""


class DuplicateSequenceError(PagedKVError, ValueError):
    """The sequence id is already held by this cache manager."""


class SequenceTooLongError(PagedKVError, ValueError):
    """The sequence could never fit in the whole block pool (or past a configured limit)."""


class DoubleFreeError(PagedKVError, ValueError):
    """A block was freed whose reference count is already zero."""
