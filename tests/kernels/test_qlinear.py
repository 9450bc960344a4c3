"""pagedkv_rs.QLinear (rust/linear/) against its numpy spec ``reference.qlinear``, on every ISA."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import pagedkv_rs
from kernel_util import gil_released_during
from pagedkv_rs import QLinear
from pagedkv_rs.kernels import reference
from session import forced_isa, scaled

# Every ISA this CPU runs ("scalar", then e.g. "avx2"). QLinear maps them onto its builds: scalar and
# neon onto the scalar tile, avx2 onto the AVX2 tile (its vpdpbusd form "avxvnni" where the CPU has
# AVX-VNNI, else vpmaddubsw), avx512 onto AVX-512 VNNI where the CPU has VNNI and onto the AVX2 tile
# where it does not; so several ISAs can share one build.
ISAS = pagedkv_rs.kernel_info()["isas"]


def _linear_build(isa: str) -> str:
    with forced_isa(isa):
        return pagedkv_rs.kernel_info()["linear_isa"]


BUILDS = {isa: _linear_build(isa) for isa in ISAS}
# One ISA per SIMD build (empty on a CPU without one: the comparisons are then not generated, and reported).
SIMD_BUILDS = {b: isa for isa, b in reversed(BUILDS.items()) if b != "scalar"}


def _weights(rng, n, k, scale=0.1):
    return (rng.standard_normal((n, k)) * scale).astype(np.float32)


def _dequant(q):
    codes, d, m = q.unpack()
    n, k = codes.shape
    return (codes.reshape(n, -1, 32) * d[:, :, None].astype(np.float64) + m[:, :, None]).reshape(n, k)


def test_isa_names():
    info = pagedkv_rs.kernel_info()
    detected = info["detected_linear_isa"]
    # avx2 runs the AVX2 tile, in its AVX-VNNI form where the CPU has that; avx512 the VNNI tile (and
    # the AMX one where the CPU runs it), else the AVX2 tile.
    avx2 = "avxvnni" if info["avx_vnni"] else "avx2"
    avx512 = detected if detected in ("avx512vnni", "avx512amx") else avx2
    want = {"scalar": "scalar", "neon": "scalar", "avx2": avx2, "avx512": avx512}
    assert {isa: want[isa] for isa in ISAS} == BUILDS
    assert info["detected_linear_isa"] == BUILDS[ISAS[-1]]


@pytest.mark.parametrize(
    "m,n,k",
    [(1, 1, 32), (2, 5, 64), (3, 16, 96), (4, 17, 32), (5, 33, 160), (9, 100, 256), (33, 48, 576), (64, 31, 128)],
)
@pytest.mark.parametrize("kind", ["float", "q4"])
def test_matches_reference(isa, m, n, k, kind):
    rng = np.random.default_rng(m * 1000 + n * 10 + k)
    q = QLinear.from_float(_weights(rng, n, k)) if kind == "float" else _q4(rng, n, k)
    x = (rng.standard_normal((m, k)) * 2).astype(np.float32)
    got = q(x)
    assert got.shape == (m, n) and got.dtype == np.float32
    want = reference.qlinear(x, *q.unpack())
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


def _q4(rng, n, k):
    """4-bit codes, as GGUF Q4_1 weights hold them."""
    d = (rng.random((n, k // 32)) * 0.02).astype(np.float32)
    return QLinear.from_parts(rng.integers(0, 16, (n, k), dtype=np.uint8), d, (-8 * d).astype(np.float32))


# 37 rows: four 8-row tiles, a 4-row and a 1-row one (AVX-512 VNNI); 15: 8 + 4 + 2 + 1; 70 columns:
# passes of two panels and a last single one.
@pytest.mark.parametrize("m", [37, 15])
@pytest.mark.parametrize("kind", ["float", "q4"])
@pytest.mark.parametrize("build", list(SIMD_BUILDS))
def test_every_simd_build_gives_the_scalar_bits(build, kind, m):
    rng = np.random.default_rng(3)
    q = QLinear.from_float(_weights(rng, 70, 192)) if kind == "float" else _q4(rng, 70, 192)
    x = rng.standard_normal((m, 192)).astype(np.float32)
    x[4, 10] = 500.0  # an outlier block
    with forced_isa("scalar"):
        want = q(x)
    with forced_isa(SIMD_BUILDS[build]):
        assert pagedkv_rs.kernel_info()["linear_isa"] == build
        got = q(x)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


_AVX2_PLAIN = """
import sys
import numpy as np
import pagedkv_rs
from pagedkv_rs import QLinear
rng = np.random.default_rng(5)
out = {}
for kind in ("float", "q4", "q6"):
    if kind == "float":
        q = QLinear.from_float((rng.standard_normal((70, 192)) * 0.1).astype(np.float32))
    else:
        d = (rng.random((70, 6)) * 0.02).astype(np.float32)
        codes = rng.integers(0, 16 if kind == "q4" else 64, (70, 192), dtype=np.uint8)
        q = QLinear.from_parts(codes, d, (-8 * d).astype(np.float32))
    for name, part in zip(("codes", "d", "m"), q.unpack()):
        out[f"{kind}-{name}"] = part
    for digits in (2, 1):
        q.set_act_digits(digits)
        for m in (1, 2, 3, 4, 7, 37):
            x = rng.standard_normal((m, 192)).astype(np.float32)
            out[f"{kind}-{digits}-{m}-x"], out[f"{kind}-{digits}-{m}-y"] = x, q(x)
info = pagedkv_rs.kernel_info()
np.savez(sys.argv[1], linear_isa=info["linear_isa"], avx_vnni=info["avx_vnni"], **out)
"""


@pytest.mark.parametrize("isa", [i for i in ISAS if i == "avx2"])
def test_the_avx2_tile_without_avx_vnni_gives_the_scalar_bits(isa, tmp_path):
    # PAGEDKV_AVX_VNNI=0 (read once a process) runs the vpmaddubsw tile where the CPU has AVX-VNNI:
    # both forms of the AVX2 build give the scalar tile's bits (4-, 6- and 8-bit codes, 1 to 37 rows).
    import os
    import subprocess
    import sys

    got = {}
    for off in ("0", "1"):
        env = {**os.environ, "PAGEDKV_ISA": isa, "PAGEDKV_AVX_VNNI": off}
        path = tmp_path / f"avx2-{off}.npz"
        proc = subprocess.run([sys.executable, "-c", _AVX2_PLAIN, str(path)], env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        got[off] = dict(np.load(path))
    assert str(got["0"]["linear_isa"]) == "avx2" and not bool(got["0"]["avx_vnni"])
    assert str(got["1"]["linear_isa"]) == ("avxvnni" if pagedkv_rs.kernel_info()["avx_vnni"] else "avx2")
    cases = [key[: -len("-x")] for key in got["0"] if key.endswith("-x")]
    assert len(cases) == 36
    with forced_isa("scalar"):
        for case in cases:
            kind, digits, _ = case.split("-")
            q = QLinear.from_parts(*(got["0"][f"{kind}-{name}"] for name in ("codes", "d", "m")))
            q.set_act_digits(int(digits))
            want = q(got["0"][case + "-x"])
            for off in ("0", "1"):
                np.testing.assert_array_equal(got[off][case + "-y"].view(np.uint32), want.view(np.uint32), case)


def _edge_acts(rng, m, k):
    """Digits at the edge: per block one element at the block's max (hi = ±127, lo = 0), the rest
    ±(126 + 1/4) of it (hi = ±126, lo = ±127), signs at random; block scales 1, 1/2, 2."""
    x = rng.choice([-126.25, 126.25], (m, k // 32, 32)) * np.array([1.0, 0.5, 2.0])[np.arange(k // 32) % 3, None]
    x[np.arange(m)[:, None], np.arange(k // 32), rng.integers(0, 32, (m, k // 32))] = (
        127 * np.array([1.0, 0.5, 2.0])[np.arange(k // 32) % 3]
    )
    return x.reshape(m, k).astype(np.float32)


# The AVX2 tile's two exact modes: every code <= 15 (one vpmaddubsw, i16 sums over a block) and
# any code (nibble split); 255 x 127 x 2 overflows i16, so a plain vpmaddubsw would saturate there.
@pytest.mark.parametrize("codes", ["0/15", "15", "0/255", "255", "any"])
@pytest.mark.parametrize("m", [1, 2, 3, 8])
def test_saturation_edges_match_reference_and_scalar(isa, codes, m):
    rng = np.random.default_rng(12 + m)
    n, k = 37, 32 * 5  # a partial last panel (37 = 2 x 16 + 5)
    top = 15 if "15" in codes else 255
    c = {
        "0/15": rng.choice(np.array([0, 15], np.uint8), (n, k)),
        "15": np.full((n, k), 15, np.uint8),
        "0/255": rng.choice(np.array([0, 255], np.uint8), (n, k)),
        "255": np.full((n, k), 255, np.uint8),
        "any": rng.integers(0, 256, (n, k), dtype=np.uint8),
    }[codes]
    d = (0.01 + 0.01 * rng.random((n, k // 32))).astype(np.float32)
    q = QLinear.from_parts(c, d, (-d * top / 2).astype(np.float32))
    x = _edge_acts(rng, m, k)
    hi, lo, *_ = reference.quantize_activations(x)
    assert np.abs(hi).min() >= 126 and (np.abs(lo) == 127).mean() > 0.9
    # Rows before and after the output stay NaN: nothing is written outside [m, n].
    buf = np.full((m + 2, n), np.nan, np.float32)
    got = q(x, out=buf[1 : m + 1])
    assert np.isnan(buf[[0, -1]]).all() and np.isfinite(got).all()
    want = reference.qlinear(x, *q.unpack())
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
    with forced_isa("scalar"):
        scalar = q(x)
    np.testing.assert_array_equal(got.view(np.uint32), scalar.view(np.uint32))


def test_rows_do_not_depend_on_the_batch():
    rng = np.random.default_rng(4)
    q = QLinear.from_float(_weights(rng, 48, 128))
    x = rng.standard_normal((13, 128)).astype(np.float32)
    full = q(x)
    for i in range(13):
        np.testing.assert_array_equal(q(x[i : i + 1]), full[i : i + 1])


def test_two_digit_activations_track_float_with_outliers():
    """Massive activations (one huge value per block) must not wipe out the small ones."""
    rng = np.random.default_rng(5)
    q = QLinear.from_float(_weights(rng, 64, 256))
    x = (rng.standard_normal((8, 256)) * 0.05).astype(np.float32)
    x[:, 3] = 2000.0
    exact = x.astype(np.float64) @ _dequant(q).T
    np.testing.assert_allclose(q(x), exact, rtol=1e-4, atol=1e-5 * float(np.abs(exact).max()))


def test_activation_digits_match_the_spec_on_edge_blocks():
    x = np.zeros((2, 64), np.float32)
    x[0, :32] = np.arange(32, dtype=np.float32) - 16  # exact ties after scaling
    x[0, 32] = 1e-40  # subnormal beside normal values
    x[0, 33:40] = 0.25
    x[1, :32] = 1e-39  # an all-subnormal block
    hi, lo, s, base, qs = reference.quantize_activations(x)
    assert hi.dtype == np.int8 and s.shape == (2, 2) and base.dtype == np.int32
    assert s[1, 0] == 0 and base[1, 0] == 0 and not hi[1, :32].any()
    # the digits' ratio: at least 253 (an error is at most half a step of the first digit); the block
    # of a subnormal beside 0.25 (error ~1e-40) takes a cap: 8e6 / sum|hi| (7 x 127) = 8998
    assert 253 <= base[0, 0] <= 1000 and base[0, 1] == 8998
    # the second digit rounds the first one's error: what is left is within half its step, plus
    # float32's rounding of s (s*R is a/127 within 2^-23, times |hi| <= 127)
    s32, r32 = s.repeat(32, 1).astype(np.float64), base.repeat(32, 1)
    err = np.abs(s32 * (r32 * hi.astype(np.float64) + lo) - x)
    assert np.all(err <= s32 * (0.5 + 127 * r32 * 2.0**-22) + 1e-38)
    total = (base[..., None].astype(np.int64) * hi.reshape(2, 2, 32) + lo.reshape(2, 2, 32)).sum(-1)
    np.testing.assert_array_equal(qs, s * total.astype(np.float32))
    rng = np.random.default_rng(6)
    q = QLinear.from_float(_weights(rng, 20, 64))
    np.testing.assert_allclose(q(x), reference.qlinear(x, *q.unpack()), rtol=1e-5, atol=1e-6)


def test_nan_and_inf_poison_only_their_row(isa):
    rng = np.random.default_rng(7)
    q = QLinear.from_float(_weights(rng, 20, 64))
    x = rng.standard_normal((3, 64)).astype(np.float32)
    x[0, 5] = np.nan
    x[2, 40] = np.inf
    y = q(x)
    assert np.isnan(y[0]).all() and np.isfinite(y[1]).all() and not np.isfinite(y[2]).any()


def test_float_weights_round_trip_within_half_a_step():
    rng = np.random.default_rng(8)
    w = _weights(rng, 9, 96)
    q = QLinear.from_float(w)
    codes, d, _m = q.unpack()
    step = np.repeat(d, 32, axis=1)
    assert np.all(np.abs(_dequant(q) - w) <= 0.5 * step + 1e-7)
    again = QLinear.from_parts(*q.unpack())
    for a, b in zip(again.unpack(), q.unpack()):
        np.testing.assert_array_equal(a, b)
    assert (q.n, q.k) == (9, 96) and q.nbytes == 16 * 96 + 3 * 2 * 16 * 4


@pytest.mark.parametrize("name", ["blk.0.attn_k.weight", "token_embd.weight"])
def test_gguf_blocks_decode_exactly(name):
    import gguf
    from gguf.quants import dequantize

    from pagedkv_rs.models.gguf_loader import bundled_model_path

    t = next(t for t in gguf.GGUFReader(bundled_model_path()).tensors if t.name == name)
    raw = np.asarray(t.data, np.uint8)[:40]  # the first 40 rows
    k = int(t.shape[0])
    q = QLinear.from_gguf(np.ascontiguousarray(raw), t.tensor_type.name, k)
    want = np.asarray(dequantize(raw, t.tensor_type), np.float64).reshape(40, k)
    np.testing.assert_array_equal(_dequant(q), want)


def test_out_argument_and_result_reuse():
    rng = np.random.default_rng(9)
    q = QLinear.from_float(_weights(rng, 16, 32))
    x = rng.standard_normal((4, 32)).astype(np.float32)
    out = np.full((4, 16), np.nan, np.float32)
    assert q(x, out=out) is out
    np.testing.assert_array_equal(out, q(x))
    assert q(np.zeros((0, 32), np.float32)).shape == (0, 16)


def test_bad_input_is_a_clear_exception():
    rng = np.random.default_rng(10)
    q = QLinear.from_float(_weights(rng, 16, 64))
    x = rng.standard_normal((4, 64)).astype(np.float32)
    with pytest.raises(TypeError, match="x must be float32"):
        q(x.astype(np.float64))
    with pytest.raises(TypeError, match="numpy.ndarray"):
        q(x.tolist())
    with pytest.raises(ValueError, match=r"x must be \[m, 64\]"):
        q(x[:, :32].copy())
    with pytest.raises(ValueError, match="C-contiguous"):
        q(np.asfortranarray(x))
    with pytest.raises(ValueError, match="2-d"):
        q(x[0])
    with pytest.raises(ValueError, match=r"out must be \[4, 16\]"):
        q(x, out=np.zeros((4, 15), np.float32))
    ro = np.zeros((4, 16), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="writeable"):
        q(x, out=ro)
    buf = np.zeros(4 * 64, np.float32)
    with pytest.raises(ValueError, match="share memory"):
        q(buf.reshape(4, 64), out=buf[:64].reshape(4, 16))
    with pytest.raises(ValueError, match="multiple of 32"):
        QLinear.from_float(np.zeros((2, 40), np.float32))
    with pytest.raises(ValueError, match="not finite"):
        QLinear.from_float(np.full((2, 32), np.inf, np.float32))
    with pytest.raises(ValueError, match="ggml_type must be one of F32, F16, BF16, Q4_0"):
        QLinear.from_gguf(np.zeros((2, 20), np.uint8), "Q2_K", 32)
    with pytest.raises(ValueError, match="k must be a positive multiple of 256 for Q4_K, got 32"):
        QLinear.from_gguf(np.zeros((2, 20), np.uint8), "Q4_K", 32)
    with pytest.raises(ValueError, match="bytes"):
        QLinear.from_gguf(np.zeros((2, 21), np.uint8), "Q4_1", 32)
    with pytest.raises(TypeError, match="uint8"):
        QLinear.from_gguf(np.zeros((2, 20), np.int8), "Q4_1", 32)
    with pytest.raises(ValueError, match="need codes"):
        QLinear.from_parts(np.zeros((2, 64), np.uint8), np.zeros((2, 1), np.float32), np.zeros((2, 1), np.float32))
    with pytest.raises(ValueError, match="not finite"):
        QLinear.from_parts(
            np.zeros((1, 32), np.uint8), np.full((1, 1), np.nan, np.float32), np.zeros((1, 1), np.float32)
        )


@pytest.mark.parametrize("isa_name", ISAS)
def test_the_gil_is_released_during_a_call(isa_name):
    rng = np.random.default_rng(11)
    q = QLinear.from_float(_weights(rng, 1024, 1024))
    x = rng.standard_normal((128, 1024)).astype(np.float32)
    with forced_isa(isa_name):
        assert gil_released_during(lambda: q(x))


@scaled(40)
@given(
    m=st.integers(1, 12),
    n=st.integers(1, 40),
    kb=st.integers(1, 6),
    seed=st.integers(0, 2**32 - 1),
    scale=st.sampled_from([1e-3, 1.0, 1e3]),
    q4=st.booleans(),
)
def test_fuzz_against_reference(m, n, kb, seed, scale, q4):
    rng = np.random.default_rng(seed)
    k = 32 * kb
    q = _q4(rng, n, k) if q4 else QLinear.from_float(_weights(rng, n, k))
    x = (rng.standard_normal((m, k)) * scale).astype(np.float32)
    want = reference.qlinear(x, *q.unpack())
    np.testing.assert_allclose(q(x), want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()) + 1e-30)


def test_gguf_q4_1_and_q8_0_weights_take_about_their_file_size():
    """Their d and m are f16 numbers: kept as f16, so a Q4_1 weight is 20 bytes per 32, the file's own size;
    Q8_0 keeps only its d (m = -128 d is computed), 34 as in the file; float weights' scales stay f32."""
    rng = np.random.default_rng(3)
    n, k = 32, 128  # two panels of 16 rows, four blocks a row
    for ty, bb, per32 in (("Q4_1", 20, 16 + 4), ("Q8_0", 34, 32 + 2)):
        raw = rng.integers(0, 256, (n, k // 32, bb), dtype=np.uint8)
        raw[..., 0:2] = rng.uniform(-0.1, 0.1, (n, k // 32)).astype(np.float16)[..., None].view(np.uint8)
        if ty == "Q4_1":
            raw[..., 2:4] = rng.uniform(-0.1, 0.1, (n, k // 32)).astype(np.float16)[..., None].view(np.uint8)
        q = QLinear.from_gguf(raw.reshape(n, -1), ty, k)
        assert q.nbytes == n * k // 32 * per32, ty
        _codes, d, m = q.unpack()
        np.testing.assert_array_equal(d, d.astype(np.float16).astype(np.float32))
        np.testing.assert_array_equal(m, m.astype(np.float16).astype(np.float32))
    q = QLinear.from_float(rng.standard_normal((n, k)).astype(np.float32))
    assert q.nbytes == n * k + n * k // 32 * 2 * 4  # 8-bit codes, f32 scales


def _one_digit_spec(x, codes, d, m):
    """y = x @ W.T with x in one int8 digit per 32-wide block (h = Q(x * 127/a), s = a/127), float64."""
    xb = x.reshape(x.shape[0], -1, 32).astype(np.float64)
    a = np.abs(x.reshape(x.shape[0], -1, 32)).max(-1).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        h = np.clip(np.round(xb * (np.float32(127) / a)[..., None].astype(np.float32)), -127, 127)
    h = np.where(a[..., None] > 0, h, 0)
    s = (a / np.float32(127)).astype(np.float64)  # [M, B]
    cb = codes.reshape(codes.shape[0], -1, 32).astype(np.float64)  # [N, B, 32]
    dots = np.einsum("mbj,nbj->mnb", h, cb)
    return (dots * d[None] * s[:, None] + m[None] * (s * h.sum(-1))[:, None]).sum(-1)


# 1 row (row digits), 15 and 37 (tiled: 8-row tiles and the 4/2/1-row remainders), 4- and 8-bit panels.
@pytest.mark.parametrize("m", [1, 15, 37])
@pytest.mark.parametrize("kind", ["float", "q4"])
def test_one_activation_digit_matches_its_spec_on_every_build(kind, m):
    rng = np.random.default_rng(31 + m)
    q = QLinear.from_float(_weights(rng, 70, 192)) if kind == "float" else _q4(rng, 70, 192)
    x = rng.standard_normal((m, 192)).astype(np.float32)
    x[0, 10] = 500.0  # an outlier block
    two = q(x)
    q.set_act_digits(1)
    assert q.act_digits == 1
    with forced_isa("scalar"):
        want = q(x)
    np.testing.assert_allclose(want, _one_digit_spec(x, *q.unpack()), rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
    for isa in ISAS:
        with forced_isa(isa):
            np.testing.assert_array_equal(q(x).view(np.uint32), want.view(np.uint32), err_msg=isa)
    assert not np.array_equal(want, two)  # one digit is a different (coarser) product
    q.set_act_digits(2)
    np.testing.assert_array_equal(q(x), two)


def test_act_digits_are_one_or_two():
    q = QLinear.from_float(_weights(np.random.default_rng(1), 16, 32))
    assert q.act_digits == 2
    for bad in (0, 3, -1):
        with pytest.raises(ValueError, match="act_digits must be 1 or 2"):
            q.set_act_digits(bad)
        assert q.act_digits == 2


# Bytes of a 256-wide K-quant block and where its f16 scales sit (d, dmin / d).
_K_BLOCKS = {"Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,))}


def _gguf_rows(rng, ty, n, k, shared_q6_scales=False):
    """``n`` GGUF rows of ``ty``: gguf-py's own quantizer where it has one (Q5_0, Q5_1), else random
    K-quant blocks with small finite f16 scales; Q6_K with ``shared_q6_scales``: each 32-wide block's
    two 16-wide scales equal (its codes are then the file's 6-bit ``q``)."""
    import gguf
    from gguf.quants import quantize

    if ty not in _K_BLOCKS:
        return quantize(_weights(rng, n, k), gguf.GGMLQuantizationType[ty])
    bb, at = _K_BLOCKS[ty]
    raw = rng.integers(0, 256, (n, k // 256, bb), dtype=np.uint8)
    for o in at:
        raw[..., o : o + 2] = rng.uniform(-0.01, 0.01, raw.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
    if shared_q6_scales:
        raw[..., 193:208:2] = raw[..., 192:208:2]
    return raw.reshape(n, -1)


# (type, shared Q6_K scales, the layout its panels take): Q5_x in 5 bits; Q6_K in split 6-bit panels, its
# 16-wide halves' scales equal or not.
GGUF_LAYOUTS = [("Q5_0", False, 5), ("Q5_1", False, 5), ("Q5_K", False, 5), ("Q6_K", True, 6), ("Q6_K", False, 6)]


@pytest.mark.parametrize("ty,shared,bits", GGUF_LAYOUTS)
def test_gguf_rows_in_their_own_bits_match_the_float64_reference(isa, ty, shared, bits):
    """QLinear.from_gguf of Q5_0 / Q5_1 / Q5_K / Q6_K rows holds the file's values in 5 or 6 bits (Q6_K:
    split panels), and its products match the float64 sum over those values on every ISA."""
    import gguf
    from gguf.quants import dequantize

    rng = np.random.default_rng(bits * 7 + shared)
    n, k = 37, 512
    raw = _gguf_rows(rng, ty, n, k, shared)
    q = QLinear.from_gguf(np.ascontiguousarray(raw), ty, k)
    assert q.code_bits == {b: (3 if b == bits else 0) for b in (4, 5, 6, 8)}
    assert q.split_panels == (3 if ty == "Q6_K" else 0)
    # scale bytes a 32-block: K-quant integer scales 2, Q5_1 f16 d and m 4, Q5_0 its f16 d (m = -16 d) 2
    per_block = 4 if ty == "Q5_1" else 2
    extra = 4 * (k // 256) if ty in _K_BLOCKS else 0
    assert q.nbytes == 48 * k * bits // 8 + 48 * (k // 32 * per_block + extra)
    want = np.asarray(dequantize(raw, gguf.GGMLQuantizationType[ty]), np.float64).reshape(n, k)
    # exact: the file's values (one float32 rounding in gguf-py)
    np.testing.assert_allclose(q.dequantize(), want, rtol=2.0**-23, atol=0)
    x = (rng.standard_normal((9, k)) * 2).astype(np.float32)
    got = q(x)
    ref = reference.qlinear_values(x, q.dequantize())
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * float(np.abs(ref).max()))
    with forced_isa("scalar"):
        np.testing.assert_array_equal(got.view(np.uint32), q(x).view(np.uint32))


def test_a_fused_q4_k_m_projection_keeps_each_parts_bits():
    """A stacked Q4_K q, k + Q6_K v + Q5_K rows: 4-bit panels for q and k, split 6-bit ones for v, 5 for
    the Q5_K rows, 8 where a panel mixes Q6_K with them; every SIMD build gives the scalar bits."""
    rng = np.random.default_rng(34)
    k = 256
    parts = [
        (_gguf_rows(rng, "Q4_K", 32, k), "Q4_K"),
        (_gguf_rows(rng, "Q6_K", 16, k, True), "Q6_K"),
        (_gguf_rows(rng, "Q5_K", 20, k), "Q5_K"),
        (_gguf_rows(rng, "Q6_K", 5, k), "Q6_K"),
    ]
    q = QLinear.stack_gguf([(np.ascontiguousarray(r), t) for r, t in parts], k)
    # panels: 2 of Q4_K, 1 of shared Q6_K, 1 of Q5_K, then Q5_K rows with the other Q6_K rows
    assert (q.code_bits, q.split_panels) == ({4: 2, 5: 1, 6: 1, 8: 1}, 1)
    with pytest.raises(ValueError, match="split panels"):
        q.unpack()
    x = rng.standard_normal((11, k)).astype(np.float32)
    with forced_isa("scalar"):
        want = q(x)
    ref = reference.qlinear_values(x, q.dequantize())
    np.testing.assert_allclose(want, ref, rtol=1e-5, atol=1e-5 * float(np.abs(ref).max()))
    for build, isa in SIMD_BUILDS.items():
        with forced_isa(isa):
            np.testing.assert_array_equal(q(x).view(np.uint32), want.view(np.uint32), err_msg=build)
