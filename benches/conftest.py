"""Benchmarks measure release builds only (CI runs them once with --benchmark-disable as a smoke test)."""

from __future__ import annotations

import pytest

import pagedkv_rs


def pytest_configure(config):
    disabled = config.getoption("benchmark_disable", default=False)
    if not disabled and "rust" in pagedkv_rs.BACKENDS and pagedkv_rs._core.build_profile() != "release":
        raise pytest.UsageError("benchmarks refuse a debug build: install with `pip install .` (release)")


@pytest.fixture(params=pagedkv_rs.BACKENDS)
def backend(request):
    return pagedkv_rs.backend(request.param)
