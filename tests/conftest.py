"""Shared fixtures: allocator tests run on every built backend, kernel tests on every ISA; Hypothesis profiles."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

import pagedkv_rs

settings.register_profile(
    "ci", max_examples=400, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "soak", max_examples=5000, stateful_step_count=80, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(params=pagedkv_rs.BACKENDS)
def backend(request):
    """The allocator classes of one backend (``.BlockAllocator``, ``.KVCacheManager``, ``.name``)."""
    return pagedkv_rs.backend(request.param)


@pytest.fixture(params=pagedkv_rs.kernel_info()["backends"] if "rust" in pagedkv_rs.BACKENDS else [])
def isa(request):
    """Force one ISA of the Rust kernels this CPU runs ("scalar", then e.g. "avx2", "avx512"); auto afterwards."""
    pagedkv_rs.set_kernel_backend(request.param)
    yield request.param
    pagedkv_rs.set_kernel_backend("auto")
