"""The two backends expose the same public names and signatures, and the stub matches the compiled core."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import pagedkv_rs
from pagedkv_rs import fallback

CLASSES = ["BlockAllocator", "KVCacheManager"]


def public(cls) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_")} | ({"__len__", "__contains__"} & set(dir(cls)))


def kind(cls, name: str) -> str:
    attr = inspect.getattr_static(cls, name)
    return "data" if hasattr(attr, "__set__") or isinstance(attr, property) else "method"


def params(fn) -> list[tuple]:
    sig = inspect.signature(fn)
    return [(p.name, p.kind, p.default) for p in sig.parameters.values() if p.name != "self"]


@pytest.mark.parametrize("name", CLASSES)
def test_same_public_members(name):
    rust, py = getattr(pagedkv_rs._core, name), getattr(fallback, name)
    assert public(rust) == public(py)
    for member in public(py):
        assert kind(rust, member) == kind(py, member), member


@pytest.mark.parametrize("name", CLASSES)
def test_same_signatures(name):
    rust, py = getattr(pagedkv_rs._core, name), getattr(fallback, name)
    assert params(rust) == params(py)
    for member in sorted(public(py)):
        if kind(py, member) == "method" and not member.startswith("__"):
            assert params(getattr(rust, member)) == params(getattr(py, member)), member


def test_stub_matches_compiled_module():
    stub = Path(pagedkv_rs.__file__).with_name("_core.pyi")
    assert stub.is_file(), "the hand-written stub _core.pyi is missing"
    r = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "pagedkv_rs._core"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr
