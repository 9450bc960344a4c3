"""The Rust ISA setting: set_isa / get_isa, kernel_info keys, PAGEDKV_ISA (and only it) from the environment."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

import pagedkv_rs._core as core  # the session needs it (tests/conftest.py): no skip


def test_set_isa_get_isa_and_info_keys():
    isas = core.kernel_info()["isas"]
    assert isas[0] == "scalar" and not {"backend", "backends"} & core.kernel_info().keys()
    prev = core.get_isa()
    try:
        for name in isas:
            core.set_isa(name)
            info = core.kernel_info()
            assert core.get_isa() == info["isa"] == name
            assert info["active_isa"] == name
        core.set_isa("auto")
        info = core.kernel_info()
        assert core.get_isa() == info["isa"] == "auto"
        assert info["active_isa"] == info["detected_isa"] == isas[-1]
        with pytest.raises(ValueError, match="'auto', 'scalar', 'avx2' or 'avx512'"):
            core.set_isa("avx9000")
        for name in {"scalar", "avx2", "avx512", "neon"} - set(isas):
            with pytest.raises(ValueError, match=f"not supported by this CPU \\(available: auto, {', '.join(isas)}\\)"):
                core.set_isa(name)
        assert core.get_isa() == "auto"
    finally:
        core.set_isa(prev)


def _isa_in_subprocess(**env: str) -> subprocess.CompletedProcess[str]:
    code = "import pagedkv_rs._core as c; print(c.get_isa(), c.kernel_info()['active_isa'])"
    full = {k: v for k, v in os.environ.items() if k not in ("PAGEDKV_ISA", "PAGEDKV_KERNEL")}
    return subprocess.run([sys.executable, "-c", code], env={**full, **env}, capture_output=True, text=True)


def test_env_pagedkv_isa_sets_the_isa_and_pagedkv_kernel_does_not():
    out = _isa_in_subprocess(PAGEDKV_ISA="scalar", PAGEDKV_KERNEL="auto")
    assert out.returncode == 0 and out.stdout.split() == ["scalar", "scalar"], out.stderr
    out = _isa_in_subprocess(PAGEDKV_KERNEL="reference")  # Python's kernel source: auto for Rust
    assert out.returncode == 0 and out.stdout.split()[0] == "auto", out.stderr
    out = _isa_in_subprocess(PAGEDKV_KERNEL="scalar")  # an ISA name there once forced the ISA: no more
    assert out.returncode == 0 and out.stdout.split()[0] == "auto", out.stderr


def test_env_invalid_pagedkv_isa_is_an_error_at_first_use():
    out = _isa_in_subprocess(PAGEDKV_ISA="avx9000")
    assert out.returncode != 0 and "ValueError: PAGEDKV_ISA: ISA must be" in out.stderr


@pytest.mark.parametrize("name", sorted({"avx2", "avx512", "neon"} - set(core.kernel_info()["isas"])))
def test_env_isa_this_cpu_lacks_is_a_clear_error(name):
    """E.g. PAGEDKV_ISA=avx512 on an AVX2-only CPU: a ValueError naming it, never another ISA run silently."""
    out = _isa_in_subprocess(PAGEDKV_ISA=name)
    assert out.returncode != 0
    assert f'ValueError: PAGEDKV_ISA: ISA "{name}" is not supported by this CPU (available: auto, ' in out.stderr


@pytest.mark.parametrize("threads", [None, 1, 2])
def test_machine_probes_are_positive_and_finite(threads):
    bw = core.memory_bandwidth(1 << 22, threads)
    fma = core.fma_peak(0.01, threads)
    assert math.isfinite(bw) and bw > 0.1  # GB/s: any machine reads 4 MiB faster than 100 MB/s
    assert math.isfinite(fma) and fma > 0.1  # GFLOP/s


def test_machine_probes_reject_bad_arguments():
    with pytest.raises(ValueError, match=r"bytes must be in \[2\*\*20, 2\*\*36\], got 1024"):
        core.memory_bandwidth(1024)
    with pytest.raises(ValueError, match=r"bytes must be in \[2\*\*20, 2\*\*36\], got 137438953473"):
        core.memory_bandwidth((1 << 37) + 1)
    for bad in (0, -1, 1025):
        with pytest.raises(ValueError, match=rf"threads must be in \[1, 1024\], got {bad}"):
            core.memory_bandwidth(1 << 20, bad)
        with pytest.raises(ValueError, match=rf"threads must be in \[1, 1024\], got {bad}"):
            core.fma_peak(0.01, bad)
    for bad in (0.0, -1.0, 11.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"seconds must be in \(0, 10\], got "):
            core.fma_peak(bad)


def test_kernel_threads_flush_subnormals_and_the_interpreter_thread_does_not():
    """Kernels run on the pool's threads, which flush subnormal floats to zero (an operation on one costs a
    microcode assist on x86); numpy on the caller's thread keeps IEEE gradual underflow."""
    import platform

    import numpy as np

    import pagedkv_rs as pk

    flushing = platform.machine().lower() in {"x86_64", "amd64", "aarch64", "arm64"}
    assert core.kernel_info()["flush_subnormals"] is flushing
    # 8-bit weights of ~1e-20 (from_float: d ~1e-22) times activations of ~1e-20 (one digit: s ~1e-22): each
    # block's product d * s is ~1e-44, below f32's normal range; the exact sums are ~1e-38 and smaller
    rng = np.random.default_rng(0)
    n, k = 32, 64
    w = (rng.standard_normal((n, k)) * 1e-20).astype(np.float32)
    x = (rng.standard_normal((4, k)) * 1e-20).astype(np.float32)
    prev = core.get_isa()
    try:
        for isa in core.kernel_info()["isas"]:
            core.set_isa(isa)
            q = pk.QLinear.from_float(w)
            q.set_act_digits(1)
            y = q(x)
            if flushing:
                assert np.all(y == 0.0), isa  # every block's scale product flushed
            # the same product at normal magnitudes: nonzero
            assert np.count_nonzero(pk.QLinear.from_float(w * 1e20)(x * 1e20)) == y.size
    finally:
        core.set_isa(prev)
    tiny = np.float32(1e-38) * np.float32(0.01)  # on this thread: a subnormal, not 0
    assert 0.0 < tiny < np.finfo(np.float32).tiny
