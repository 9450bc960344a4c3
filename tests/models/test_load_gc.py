"""Loading pauses Python's cyclic garbage collector and leaves it as it found it, on success and on error.

``LLM`` (and ``pagedkv generate``, from the GGUF header to its ``gc.freeze()``) loads with the collector
off: the ~100k objects of a load set off dozens of collections that walk them again and again. Whatever
the load does, the collector's state afterwards is the caller's: on if it was on, off if it was off.
Files are small synthetic GGUFs (``pagedkv_rs.models.synthetic``).
"""

from __future__ import annotations

import gc
import pathlib

import gguf
import pytest

from pagedkv_rs.cli.generate import main as generate
from pagedkv_rs.engine.request import SamplingParams
from pagedkv_rs.llm import LLM
from pagedkv_rs.models.gguf_loader import GGUFError
from pagedkv_rs.models.synthetic import SyntheticSpec, write_synthetic_gguf

SPEC = SyntheticSpec(
    hidden_size=64,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=128,
    vocab_size=300,
    weight_type="Q4_1",
    embed_type="Q8_0",
)


@pytest.fixture
def model_file(tmp_path):
    return write_synthetic_gguf(tmp_path / "ok.gguf", SPEC)


@pytest.fixture
def bad_file(model_file, tmp_path):
    """The model with the first block scale of ``blk.0.attn_q.weight`` (Q4_1: f16 ``d`` at byte 0) NaN."""
    data = bytearray(pathlib.Path(model_file).read_bytes())
    (t,) = [t for t in gguf.GGUFReader(model_file).tensors if t.name == "blk.0.attn_q.weight"]
    data[t.data_offset : t.data_offset + 2] = b"\x00\x7e"  # f16 NaN, little-endian
    dst = tmp_path / "nan.gguf"
    dst.write_bytes(bytes(data))
    return str(dst)


@pytest.fixture(params=[True, False], ids=["gc-on", "gc-off"])
def gc_state(request):
    was = gc.isenabled()
    (gc.enable if request.param else gc.disable)()
    yield request.param
    (gc.enable if was else gc.disable)()


def test_llm_leaves_the_collector_as_it_was(model_file, bad_file, gc_state):
    llm = LLM(model_file, weights="int8", num_blocks=8)
    try:
        assert gc.isenabled() is gc_state
        assert llm.generate(["hi"], SamplingParams(max_tokens=2, temperature=0))[0].outputs[0].token_ids
    finally:
        llm.shutdown()
    with pytest.raises(GGUFError, match=r"nan.gguf: tensor .blk.0.attn_q.weight.: row 0, block 0: scale is not finite"):
        LLM(bad_file, weights="int8", num_blocks=8)
    assert gc.isenabled() is gc_state


def test_generate_leaves_the_collector_as_it_was(model_file, bad_file, gc_state, capsys):
    assert generate(["--model", model_file, "--max-tokens", "2", "--temperature", "0", "hi"]) == 0
    assert gc.isenabled() is gc_state
    assert generate(["--model", bad_file, "--max-tokens", "2", "hi"]) == 2
    assert "not finite" in capsys.readouterr().err
    assert gc.isenabled() is gc_state
