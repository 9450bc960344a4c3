"""Models that implement ``pagedkv_rs.engine.Model``: the tiny random test model (and real ones)."""

from __future__ import annotations

from pagedkv_rs.models.tiny import TinyModel

__all__ = ["TinyModel"]
