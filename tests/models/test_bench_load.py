"""``pagedkv bench load`` and the pool ``pagedkv generate`` sizes: a fresh process's peak RSS within bounds."""

from __future__ import annotations

import json
import os

import pytest

from pagedkv_rs.cli.bench import load
from pagedkv_rs.models.gguf_loader import bundled_model_path

pytest.importorskip("pagedkv_rs._core")

PROMPT = "What is the capital of France?"
# float32 weights the user chose: 30 layers of fused qkv, o, gate/up, down (embedding and lm_head stay Q8_0)
FLOAT32_BYTES = 4 * 30 * (960 * 576 + 576 * 576 + 3072 * 576 + 576 * 1536)


def test_kv_pool_bytes_parses_the_stats_line():
    line = "[1 requests, 32 tokens in 1.0 s: 32 tok/s; kv float16, pool 5 blocks = 1.8 MiB, rust kernels]"
    assert load.kv_pool_bytes(line) == int(1.8 * (1 << 20))
    assert load.kv_pool_bytes("no stats") is None


@pytest.mark.parametrize("fmt", ["int8", "float32"])
def test_generate_fits_file_plus_kv_plus_150mb(capsys, tok, fmt):
    assert load.main(["--runs", "1", "--weights", fmt, "--json", "--prompt", PROMPT]) == 0
    report = json.loads(capsys.readouterr().out)
    (r,) = report["results"]
    assert "32 tokens" in r["stats"], r["stats"]  # --ignore-eos: the whole 32-token answer
    # the pool holds this prompt and its answer (16-token blocks), not the 512 MiB default
    n_prompt = len(tok.apply_chat_template([{"role": "user", "content": PROMPT}]))
    assert f"pool {-(-(n_prompt + 32) // 16)} blocks" in r["stats"], r["stats"]
    if fmt == "float32":  # the float32 the user chose, plus the general bound
        bound = os.path.getsize(bundled_model_path()) + r["kv_pool_bytes"] + load.SLACK + FLOAT32_BYTES
    else:  # the target for the bundled model (QLinear keeps its own 1-byte codes: 160 MiB here)
        bound = 300 * 10**6
    assert r["peak_rss"]["max"] <= bound, (r["peak_rss"], bound)
