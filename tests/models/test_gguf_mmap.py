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

TYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]


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


def _synthetic(path, types, rows=6, cols=64, seed=0):
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
    assert ours.shape == (6, 64) and ours.type == name
    assert ours.dequantize().tobytes() == want.tobytes()
    rows = np.array([4, 1, 4])
    assert ours.dequantize(rows).tobytes() == want[rows].tobytes()


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_rust_dequantize_rejects_bad_input(name):
    core = pytest.importorskip("pagedkv_rs._core")
    bb = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}[name]
    ok = np.zeros((2, 2 * bb), np.uint8)
    assert core.dequantize_gguf(ok, name, 64).shape == (2, 64)
    with pytest.raises(ValueError, match="need 2 rows of"):
        core.dequantize_gguf(ok[:, :-1].copy(), name, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        core.dequantize_gguf(ok, name, 63)
    with pytest.raises(ValueError, match="ggml_type must be one of"):
        core.dequantize_gguf(ok, "Q4_K", 64)
    with pytest.raises(TypeError, match="uint8"):
        core.dequantize_gguf(ok.astype(np.int16), name, 64)
    with pytest.raises(ValueError, match="out must be"):
        core.dequantize_gguf(ok, name, 64, out=np.empty((2, 63), np.float32))


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
    assert isinstance(w.lm_head, Int8Linear)  # tied Q8_0 rows: a QLinear over the file's blocks
    kind = FloatLinear if fmt == "float32" else Int8Linear
    assert all(isinstance(layer[k], kind) for layer in w.layers for k in ("wqkv", "wo", "wgu", "wdown"))
    if fmt == "float32":  # exactly the projections' float32, nothing for embedding or lm_head
        floats = sum(layer[k].w_t.nbytes for layer in w.layers for k in ("wqkv", "wo", "wgu", "wdown"))
        assert floats == 4 * 30 * (960 * 576 + 576 * 576 + 3072 * 576 + 576 * 1536)
    assert _base(w.final_norm) is _base(bundled.tensors["output_norm.weight"].data)  # an F32 view, no copy


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
