"""Byte sizes from strings like ``"512MiB"``, ``"1.5G"``, ``"300MB"`` (KV pool sizes, disk tier bounds)."""

from __future__ import annotations

import re
from typing import Union

__all__ = ["parse_memory"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 10**3,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 10**6,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 10**9,
    "gib": 1 << 30,
}


def parse_memory(value: Union[int, str], name: str = "kv_memory") -> int:
    """Bytes from an int or a string like ``"512MiB"``, ``"1.5G"``, ``"300MB"``; errors name the option ``name``."""
    if isinstance(value, int):
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{name} must be bytes or a size like '512MiB' or '2G', got {value!r}")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return n
