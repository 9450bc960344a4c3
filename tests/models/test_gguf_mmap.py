"""The memory-mapped GGUF loader: views of the file, exact block decoding, per-row embedding, bad files."""

from __future__ import annotations

import mmap
import os
import struct

import numpy as np
import pytest

from pagedkv_rs.models.gguf_loader import GGUFError, bundled_model_path, load_gguf
from pagedkv_rs.models.llama import Embedding, FloatLinear, Int8Linear, LlamaWeights

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402

TYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
K_TYPES = {"Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,))}  # bytes, f16 scale offsets


def random_k_blocks(rng: np.random.Generator, name: str, rows: int, cols: int) -> np.ndarray:
    """uint8 [rows, cols/256 * bytes]: random K-quant blocks, finite f16 super-scales (gguf cannot quantize them)."""
    bb, offs = K_TYPES[name]
    raw = rng.integers(0, 256, (rows, cols // 256, bb), dtype=np.uint8)
    for at in offs:
        raw[..., at : at + 2] = (rng.standard_normal(raw.shape[:2]) * 0.05).astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.fixture(scope="module")
def bundled():
    return load_gguf()


def _base(a: np.ndarray):
    while isinstance(a, np.ndarray) and a.base is not None:
        a = a.base
    return a.obj if isinstance(a, memoryview) else a


def test_tensors_are_read_only_views_of_the_map(bundled):
    for t in bundled.tensors.values():
        assert isinstance(_base(t.data), mmap.mmap), t.name
        assert not t.data.flags.writeable and t.data.dtype == np.uint8
    emb = bundled.tensors["token_embd.weight"]
    assert emb.type == "Q8_0" and emb.data.shape == (49152, 576 // 32 * 34)


def test_bundled_tensors_decode_exactly_as_gguf(bundled):
    reader = gguf.GGUFReader(bundled.path)
    assert {k: f.contents() for k, f in reader.fields.items()} == bundled.metadata
    for t in reader.tensors:
        ours = bundled.tensors[t.name]
        want = np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape(ours.shape)
        assert ours.dequantize().tobytes() == want.tobytes(), t.name


def _synthetic(path, types, rows=6, cols=256, seed=0):
    """A GGUF of one [rows, cols] tensor per type (random values, quantized by gguf itself)."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    for name in types:
        x = rng.standard_normal((rows, cols)).astype(np.float32)
        qt = gguf.GGMLQuantizationType[name]
        if name == "F32":
            w.add_tensor(name, x)
        elif name == "F16":
            w.add_tensor(name, x.astype(np.float16))
        elif name in K_TYPES:
            w.add_tensor(name, random_k_blocks(rng, name, rows, cols), raw_dtype=qt)
        else:
            w.add_tensor(name, quantize(x, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("name", TYPES)
def test_each_type_decodes_exactly_as_gguf(tmp_path, name):
    p = tmp_path / f"{name}.gguf"
    _synthetic(p, [name])
    with pytest.raises(GGUFError, match="metadata key 'llama.embedding_length' is missing"):
        load_gguf(p)  # not a model, but its tensors are readable:
    reader = gguf.GGUFReader(str(p))
    (t,) = reader.tensors
    from pagedkv_rs.models import gguf_loader

    with open(p, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    meta, table, start = gguf_loader._parse(str(p), mm)
    ours = gguf_loader._tensor(str(p), np.frombuffer(mm, np.uint8), start, *table[0])
    want = np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape(ours.shape)
    assert ours.shape == (6, 256) and ours.type == name
    assert ours.dequantize().tobytes() == want.tobytes()
    rows = np.array([4, 1, 4])
    assert ours.dequantize(rows).tobytes() == want[rows].tobytes()


BLOCKS = {"F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22)}
BLOCKS.update({"Q5_1": (32, 24), "Q8_0": (32, 34), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)})


@pytest.mark.parametrize("name", TYPES)
def test_rust_dequantize_rejects_bad_input(name):
    core = pytest.importorskip("pagedkv_rs._core")
    el, bb = BLOCKS[name]
    k = 2 * max(el, 32)
    ok = np.zeros((2, k // el * bb), np.uint8)
    assert core.dequantize_gguf(ok, name, k).shape == (2, k)
    with pytest.raises(ValueError, match="need 2 rows of"):
        core.dequantize_gguf(ok[:, :-1].copy(), name, k)
    if el > 1:
        with pytest.raises(ValueError, match=f"multiple of {el}"):
            core.dequantize_gguf(ok, name, k - 1)
    with pytest.raises(ValueError, match="ggml_type must be one of"):
        core.dequantize_gguf(ok, "Q2_K", k)
    with pytest.raises(TypeError, match="uint8"):
        core.dequantize_gguf(ok.astype(np.int16), name, k)
    with pytest.raises(ValueError, match="out must be"):
        core.dequantize_gguf(ok, name, k, out=np.empty((2, k - 1), np.float32))
    q = core.QLinear.from_gguf(ok, name, k)
    assert (q.n, q.k) == (2, k)
    with pytest.raises(ValueError, match="need 2 rows of"):
        core.QLinear.from_gguf(ok[:, :-1].copy(), name, k)
    with pytest.raises(ValueError, match="part 1: need 1 rows of"):
        core.QLinear.stack_gguf([(ok, name), (ok[:1, 1:].copy(), name)], k)
    with pytest.raises(ValueError, match="tensor 'v': need 1 rows of"):
        core.QLinear.stack_gguf([(ok, name), (ok[:1, 1:].copy(), name)], k, ["q", "v"])
    with pytest.raises(ValueError, match="need one name a part: 2 parts, 1 names"):
        core.QLinear.stack_gguf([(ok, name), (ok, name)], k, ["q"])
    with pytest.raises(TypeError, match=r"parts\[0\] must be a \(data, ggml_type\) pair"):
        core.QLinear.stack_gguf([ok], k)


# Exact: d*c + m of every 32-wide block is gguf's value (rounded once to float32); Q6_K: d_h*(q - 32) of
# each 16-wide half (split panels); F32/F16/BF16: requantized.
EXACT = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"}


@pytest.mark.parametrize("name", TYPES)
def test_qlinear_blocks_are_ggufs_values(name):
    """QLinear.from_gguf's values vs ``gguf.quants.dequantize``: exact, or within (max-min)/510 per 32-block."""
    from pagedkv_rs import _core as core

    rng = np.random.default_rng(3)
    rows, cols = 8, 512
    qt = gguf.GGMLQuantizationType[name]
    if name in K_TYPES:
        raw = random_k_blocks(rng, name, rows, cols)
    else:
        x = rng.standard_normal((rows, cols)).astype(np.float32)
        raw = {"F32": lambda: x.view(np.uint8), "F16": lambda: x.astype(np.float16).view(np.uint8)}.get(
            name, lambda: quantize(x, qt)
        )()
    want = np.asarray(dequantize(raw, qt), np.float32).reshape(rows, cols).astype(np.float64)
    q = core.QLinear.from_gguf(np.ascontiguousarray(raw), name, cols)
    got = q.dequantize()
    err = np.abs(got - want).reshape(rows, -1, 32)
    rounding = np.abs(want).reshape(rows, -1, 32) * 2.0**-24  # the reference's one float32 rounding
    exact = (err <= rounding).all(axis=-1)
    span = np.ptp(want.reshape(rows, -1, 32), axis=-1)
    assert (err.max(axis=-1) <= span / 510 * (1 + 1e-5) + rounding.max(axis=-1) * 4).all()
    if name in K_TYPES:  # integer scales: 2 bytes a 32-block and row, plus 4 per 256
        bits = {"Q4_K": 4, "Q5_K": 5, "Q6_K": 6}[name]
        assert q.nbytes == 16 * cols * bits // 8 + 16 * (cols // 32 * 2 + cols // 256 * 4)
    if name in EXACT:
        assert exact.all()
    # the documented bound is reached, not just respected, where blocks are requantized
    if not exact.all():
        worst = (err.max(axis=-1) / np.maximum(span, 1e-30))[~exact].max()
        assert 0.3 / 510 < worst <= 1 / 510 * (1 + 1e-5)


def test_embedding_rows_are_decoded_per_step(bundled):
    emb = Embedding(bundled.tensors["token_embd.weight"])
    ids = np.array([[5, 49151], [0, 5]])
    want = bundled.tensors["token_embd.weight"].dequantize(ids.reshape(-1)).reshape(2, 2, 576)
    assert emb.shape == (49152, 576)
    np.testing.assert_array_equal(emb[ids], want)
    assert emb[np.array([7])].shape == (1, 576)


@pytest.mark.parametrize("fmt", ["float32", "int8"])
def test_weights_keep_no_float32_embedding(bundled, fmt):
    pytest.importorskip("pagedkv_rs._core")
    w = LlamaWeights(bundled, weights=fmt)
    assert isinstance(w.embed, Embedding)
    kind = FloatLinear if fmt == "float32" else Int8Linear
    assert isinstance(w.lm_head, kind)  # the tied head follows the weight format (int8: the file's Q8_0 blocks)
    assert all(isinstance(layer[k], kind) for layer in w.layers for k in ("wqkv", "wo", "wgu", "wdown"))
    if fmt == "float32":  # exactly the projections' and the head's float32, nothing for the embedding
        floats = sum(layer[k].w_t.nbytes for layer in w.layers for k in ("wqkv", "wo", "wgu", "wdown"))
        assert floats == 4 * 30 * (960 * 576 + 576 * 576 + 3072 * 576 + 576 * 1536)
        assert w.lm_head.w_t.nbytes == 4 * 49152 * 576
    # norms are read from the file (pread), not through the map: equal values, no page of the map touched
    np.testing.assert_array_equal(w.final_norm, bundled.tensors["output_norm.weight"].data.view(np.float32))
    assert _base(w.final_norm) is not _base(bundled.tensors["output_norm.weight"].data)


def _corrupt(tmp_path, name: str, edit) -> str:
    with open(bundled_model_path(), "rb") as f:
        data = bytearray(f.read())
    edit(data)
    p = tmp_path / name
    p.write_bytes(bytes(data))
    return str(p)


def _tensor_info_offset(data: bytes, name: str) -> int:
    """Byte offset of the rank field after tensor ``name``'s name in the tensor table."""
    key = struct.pack("<Q", len(name)) + name.encode()
    return data.index(key) + len(key)


def test_truncated_tensor_data_names_the_tensor(tmp_path):
    size = os.path.getsize(bundled_model_path())
    p = _corrupt(tmp_path, "short.gguf", lambda d: d.__delitem__(slice(size - 1000, size)))
    with pytest.raises(GGUFError, match=r"short\.gguf: corrupt or truncated GGUF file \(tensor '[^']+' needs bytes"):
        load_gguf(p)


def test_unknown_type_names_the_tensor(tmp_path):
    def edit(d):
        at = _tensor_info_offset(d, "blk.3.ffn_up.weight")
        nd = struct.unpack_from("<I", d, at)[0]
        struct.pack_into("<I", d, at + 4 + 8 * nd, 99)

    p = _corrupt(tmp_path, "type.gguf", edit)
    with pytest.raises(GGUFError, match=r"type\.gguf: tensor 'blk\.3\.ffn_up\.weight' has unknown ggml type 99"):
        load_gguf(p)


def test_wrong_shape_names_the_tensor(tmp_path):
    def edit(d):
        at = _tensor_info_offset(d, "blk.0.attn_k.weight")
        struct.pack_into("<Q", d, at + 4 + 8, 96)  # out features 192 -> 96 (bytes stay in range)

    p = _corrupt(tmp_path, "shape.gguf", edit)
    with pytest.raises(GGUFError, match=r"shape\.gguf: tensor 'blk\.0\.attn_k\.weight' has shape \(96, 576\)"):
        load_gguf(p)


def test_unsupported_version(tmp_path):
    p = _corrupt(tmp_path, "v1.gguf", lambda d: struct.pack_into("<I", d, 4, 1))
    with pytest.raises(GGUFError, match=r"v1\.gguf: GGUF version 1 is not supported"):
        load_gguf(p)
