"""pagedkv_rs.rms_norm / silu_and_mul / gelu_tanh_and_mul (rust/ops.rs) against the float64 numpy spec, on every ISA."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import pagedkv_rs
from pagedkv_rs import kernels
from pagedkv_rs.kernels import reference
from session import forced_isa


@pytest.mark.parametrize("t,h", [(1, 1), (3, 7), (32, 576), (33, 100), (200, 64)])
@pytest.mark.parametrize("fused", [False, True])
def test_rms_norm_matches_reference(isa, t, h, fused):
    rng = np.random.default_rng(t * 31 + h)
    x = (rng.standard_normal((t, h)) * 3).astype(np.float32)
    w = rng.standard_normal(h).astype(np.float32)
    res = rng.standard_normal((t, h)).astype(np.float32) if fused else None
    res_ref = None if res is None else res.copy()
    got = pagedkv_rs.rms_norm(x, w, 1e-5, residual=res)
    want = reference.rms_norm(x, w, 1e-5, residual=res_ref)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    if fused:
        np.testing.assert_array_equal(res, res_ref)  # residual += x, the same float32 adds


@pytest.mark.parametrize("t,f", [(1, 1), (5, 17), (32, 1536), (65, 40)])
def test_silu_and_mul_matches_reference(isa, t, f):
    rng = np.random.default_rng(t + f)
    gu = (rng.standard_normal((t, 2 * f)) * 4).astype(np.float32)
    gu[0, 0] = 100.0  # exp(-100) underflows: silu = x
    if f > 1:
        gu[0, 1] = -100.0  # exp(100) large: silu -> -0
    np.testing.assert_allclose(pagedkv_rs.silu_and_mul(gu), reference.silu_and_mul(gu), rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("t,f", [(1, 1), (5, 17), (32, 2048), (65, 40)])
def test_gelu_tanh_and_mul_matches_reference(isa, t, f):
    rng = np.random.default_rng(t + 7 * f)
    gu = (rng.standard_normal((t, 2 * f)) * 4).astype(np.float32)
    gu[0, 0] = 100.0  # tanh saturates: gelu = x
    if f > 1:
        gu[0, 1] = -100.0  # gelu -> -0
    if f > 2:
        gu[0, 2] = -6.0  # the far negative tail, where 1 + tanh(u) cancels if computed that way
    got = pagedkv_rs.gelu_tanh_and_mul(gu)
    want = reference.gelu_tanh_and_mul(gu)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)
    if f > 2:
        assert abs(got[0, 2] / want[0, 2] - 1) < 1e-5  # relative, in the tail
    np.testing.assert_array_equal(kernels.gelu_tanh_and_mul(gu), got)  # the public kernel path


def test_gelu_tanh_reference_is_the_tanh_formula():
    """The spec against the textbook definition (and not erf-GELU: they differ by ~1e-3 near |x| = 2)."""
    import math

    xs = [-3.0, -2.0, -0.5, 0.0, 0.1, 1.0, 2.0, 5.0]
    gu = np.array([xs + [1.0] * len(xs)], np.float32)
    got = reference.gelu_tanh_and_mul(gu)[0]
    for x, g in zip(xs, got):
        x = float(np.float32(x))
        want = 0.5 * x * (1 + math.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
        assert g == pytest.approx(want, rel=1e-6, abs=1e-12)
    assert abs(got[5] - 0.5 * (1 + math.erf(2 / math.sqrt(2))) * 2.0) > 1e-4


@pytest.mark.parametrize("simd", pagedkv_rs.kernel_info()["isas"][1:])  # none on a CPU without SIMD: reported
def test_simd_and_scalar_agree_bit_for_bit(simd):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((70, 96)).astype(np.float32)
    w = rng.standard_normal(96).astype(np.float32)
    gu = rng.standard_normal((70, 192)).astype(np.float32)
    outs = []
    for name in ("scalar", simd):
        with forced_isa(name):
            outs.append(
                (pagedkv_rs.rms_norm(x, w, 1e-6), pagedkv_rs.silu_and_mul(gu), pagedkv_rs.gelu_tanh_and_mul(gu))
            )
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


def test_nan_stays_in_its_row():
    x = np.ones((3, 8), np.float32)
    x[1, 2] = np.nan
    y = pagedkv_rs.rms_norm(x, np.ones(8, np.float32), 1e-6)
    assert np.isnan(y[1]).all() and np.isfinite(y[[0, 2]]).all()
    gu = np.ones((2, 4), np.float32)
    gu[1, 0] = np.nan
    s = pagedkv_rs.silu_and_mul(gu)
    assert np.isnan(s[1, 0]) and np.isfinite(s[0]).all()


def test_out_argument():
    x = np.ones((2, 4), np.float32)
    out = np.empty((2, 4), np.float32)
    assert pagedkv_rs.rms_norm(x, np.ones(4, np.float32), 0.0, out=out) is out
    np.testing.assert_allclose(out, 1.0)
    gu = np.array([[-3.0, 0.5, 2.0, -4.0], [1.0, 20.0, 0.25, -1.0]], np.float32)
    o2 = np.full((2, 2), np.nan, np.float32)
    assert pagedkv_rs.silu_and_mul(gu, out=o2) is o2
    np.testing.assert_allclose(o2, reference.silu_and_mul(gu), rtol=2e-6, atol=1e-7)
    np.testing.assert_array_equal(o2, pagedkv_rs.silu_and_mul(gu))  # out= writes what the result would be


def test_bad_input_is_a_clear_exception():
    x = np.ones((2, 4), np.float32)
    w = np.ones(4, np.float32)
    with pytest.raises(TypeError, match="x must be float32"):
        pagedkv_rs.rms_norm(x.astype(np.float64), w, 1e-5)
    with pytest.raises(ValueError, match=r"weight must be \[4\]"):
        pagedkv_rs.rms_norm(x, np.ones(3, np.float32), 1e-5)
    with pytest.raises(ValueError, match="eps"):
        pagedkv_rs.rms_norm(x, w, -1.0)
    with pytest.raises(ValueError, match="residual must have"):
        pagedkv_rs.rms_norm(x, w, 1e-5, residual=np.ones((3, 4), np.float32))
    with pytest.raises(ValueError, match="residual must not share memory"):
        pagedkv_rs.rms_norm(x, w, 1e-5, residual=x)
    ro = np.ones((2, 4), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="writeable"):
        pagedkv_rs.rms_norm(x, w, 1e-5, residual=ro)
    with pytest.raises(ValueError, match="out must not share memory"):
        pagedkv_rs.rms_norm(x, w, 1e-5, out=x)
    with pytest.raises(ValueError, match="C-contiguous"):
        pagedkv_rs.rms_norm(np.ones((4, 4), np.float32)[:, ::2], np.ones(2, np.float32), 1e-5)
    with pytest.raises(ValueError, match=r"gate_up must be \[T, 2F\]"):
        pagedkv_rs.silu_and_mul(np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"out must be \[2, 2\]"):
        pagedkv_rs.silu_and_mul(x, out=np.empty((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"gate_up must be \[T, 2F\]"):
        pagedkv_rs.gelu_tanh_and_mul(np.ones((2, 3), np.float32))
    with pytest.raises(TypeError, match="gate_up must be float32"):
        pagedkv_rs.gelu_tanh_and_mul(x.astype(np.float64))
    with pytest.raises(ValueError, match="gelu_tanh_and_mul needs float32"):
        reference.gelu_tanh_and_mul(np.ones((2, 3), np.float32))


def test_kernel_source_switches_at_run_time():
    from pagedkv_rs import kernels

    prev = kernels.kernel_source()
    kernels.set_kernel_source("reference")
    try:
        assert kernels.kernel_source() == "reference"
        x = np.ones((2, 4), np.float32)
        np.testing.assert_allclose(kernels.rms_norm(x, np.ones(4, np.float32), 0.0), 1.0)
        kernels.set_kernel_source("auto")
        assert kernels.kernel_source() == "rust"
    finally:
        kernels.set_kernel_source(prev)
    with pytest.raises(ValueError, match="unknown kernel source 'avx2'"):
        kernels.set_kernel_source("avx2")


def _kernel_source_under(value: str) -> subprocess.CompletedProcess:
    code = "import pagedkv_rs.kernels as k; print(k.kernel_source())"
    env = dict(os.environ, PAGEDKV_KERNEL=value)
    return subprocess.run(
        [sys.executable, "-W", "always", "-c", code], env=env, capture_output=True, text=True, check=True
    )


@pytest.mark.parametrize("value,source", [("reference", "reference"), ("rust", "rust"), ("auto", "rust"), ("", "rust")])
def test_kernel_source_is_read_from_the_environment(value, source):
    r = _kernel_source_under(value)
    assert r.stdout.strip() == source and "Warning" not in r.stderr


def test_an_isa_name_is_not_a_kernel_source():
    r = _kernel_source_under("scalar")
    assert r.stdout.strip() == "rust"  # auto
    assert "PAGEDKV_KERNEL='scalar' is not one of auto, rust, reference (an ISA is PAGEDKV_ISA's)" in r.stderr
    assert "DeprecationWarning" not in r.stderr


def test_the_spec_has_one_home():
    """``pagedkv_rs.kernels.reference`` only: the unreleased ``pagedkv_rs.reference`` alias is gone."""
    code = "import pagedkv_rs.kernels.reference, pagedkv_rs.reference"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode != 0 and "No module named 'pagedkv_rs.reference'" in r.stderr
