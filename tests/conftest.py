"""Shared fixtures: allocator tests run on every backend, kernel tests on every ISA; the session's ISA and threads.

``--isa NAME`` / ``--threads N`` (or ``PAGEDKV_ISA``) run the whole session with one ISA forced or a kernel pool of
N threads; fixtures and tests that change either restore exactly what was set before them. The compiled core is
required: without it the session stops at once with the import error and the install command.
"""

from __future__ import annotations

import pytest

import pagedkv_rs
import session
from pagedkv_rs import _backend
from session import forced_isa

if _backend._core is None:
    raise pytest.UsageError(
        "the compiled core pagedkv_rs._core is not importable, so the Rust half of the suite cannot run "
        f"({_backend.CORE_IMPORT_ERROR}). Build it into this environment: "
        "`pip install maturin && maturin develop --release` (or `pip install .`)."
    )
try:  # an invalid or unsupported PAGEDKV_ISA (e.g. avx512 on an AVX2-only CPU) is reported here, once
    ISAS = pagedkv_rs.kernel_info()["isas"]
except ValueError as e:
    raise pytest.UsageError(f"cannot set up the kernel session: {e}") from e


def pytest_addoption(parser):
    group = parser.getgroup("pagedkv")
    group.addoption("--isa", default=None, help="force one ISA for the session (scalar, avx2, avx512, neon)")
    group.addoption("--threads", type=int, default=None, help="kernel thread-pool size for the session")


def pytest_configure(config):
    isa, threads = config.getoption("--isa"), config.getoption("--threads")
    try:
        if isa is not None:
            pagedkv_rs.set_isa(isa)
        if threads is not None:
            pagedkv_rs.set_num_threads(threads)
    except ValueError as e:
        raise pytest.UsageError(f"cannot set up the kernel session: {e}") from e


def pytest_report_header(config):
    info = pagedkv_rs.kernel_info()
    return (
        f"pagedkv: isa={info['isa']} (attention runs {info['active_isa']}, linear {info['linear_isa']}), "
        f"isas={','.join(info['isas'])}, threads={info['num_threads']}, hypothesis profile={session.PROFILE}"
    )


@pytest.fixture(params=pagedkv_rs.BACKENDS)
def backend(request):
    """The allocator classes of one backend (``.BlockAllocator``, ``.KVCacheManager``, ``.name``)."""
    return pagedkv_rs.backend(request.param)


@pytest.fixture(params=ISAS)
def isa(request):
    """Force one ISA this CPU runs ("scalar", then e.g. "avx2"); afterwards the setting before it comes back."""
    with forced_isa(request.param):
        yield request.param
