"""SmolLM2 over a disk tier: with the pool's prefix cache forgotten, the prefix loads and the tokens match."""

from __future__ import annotations

import pytest

from pagedkv_rs import LLM, SamplingParams


@pytest.fixture(scope="module")
def gguf():
    from pagedkv_rs.models.gguf_loader import load_gguf

    return load_gguf(None)


def test_smollm2_restart_hits_disk_tier_same_tokens(gguf, tmp_path):
    spec = f"disk:{tmp_path}/kv?size=256MiB"
    params = SamplingParams(max_tokens=8, temperature=0.0)
    prompt = {"prompt": "You are a careful assistant. " * 12 + "Name three rivers in Europe.", "cache_salt": "t1"}
    llm = LLM(gguf, weights="int8", num_blocks=64, kv_tiers=[spec])
    first = llm.generate([prompt], params)[0]
    llm.engine.kv_tiers.flush()
    llm.engine.kv_manager.reset_prefix_cache()  # as after a restart: only the disk tier has the prefix
    second = llm.generate([prompt], params)[0]
    llm.shutdown()
    n = len(second.prompt_token_ids)
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == (n - 1) // 16 * 16
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    (st,) = llm.stats()["kv_tiers"].values()
    assert st["hit_blocks"] == (n - 1) // 16 and st["bytes_read"] > st["hit_blocks"] * 368640  # 360 KiB payloads
    # the weight format is part of the fingerprint (int8 and float32 K/V differ)
    fp_int8 = llm.model.kv_fingerprint()
    llm.model.weights.weight_format = "float32"
    llm.model._fingerprint = None
    assert llm.model.kv_fingerprint() != fp_int8 and "weights=float32" in llm.model.kv_fingerprint()
