"""Fixtures of the model tests: the bundled SmolLM2 GGUF's metadata and its tokenizer, loaded once per module."""

from __future__ import annotations

import pytest

from pagedkv_rs.models.gguf_loader import load_gguf
from pagedkv_rs.models.tokenizer import GGUFTokenizer


@pytest.fixture(scope="module")
def gguf_meta():
    return load_gguf(None, load_tensors=False)


@pytest.fixture(scope="module")
def tok(gguf_meta) -> GGUFTokenizer:
    return GGUFTokenizer.from_gguf(gguf_meta)
