"""KV tiers: load 32 SmolLM2-sized blocks (30 layers x K/V x 3 heads x 16 x 64, f16: 360 KiB) from the disk tier
into the caches, and encode / verify one record.

    pytest benches/test_bench_tiers.py --benchmark-only

``pagedkv bench tiers`` is the end-to-end figure (TTFT with the model).
"""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv_rs import kernels
from pagedkv_rs.tiers import BlockLayout, KVTiers, chain_hashes, decode_record, encode_record, parse_tier

LAYOUT = BlockLayout(30, 3, 16, 64, np.dtype(np.float16))
N = 32


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("kv")
    caches = [kernels.new_kv_cache(2 * N, 16, 3, 64, "float16") for _ in range(30)]
    rng = np.random.default_rng(0)
    for k, v in caches:
        k[...] = rng.standard_normal(k.shape).astype(np.float16)
        v[...] = rng.standard_normal(v.shape).astype(np.float16)
    tiers = KVTiers([parse_tier(f"disk:{d}?size=1GiB")], LAYOUT, bytes(16), deadline=60.0)
    toks = list(range(N * 16))
    hashes = chain_hashes(toks, 16, None)
    tiers.store(
        caches,
        list(range(N)),
        hashes,
        [bytes(16)] + hashes[:-1],
        [toks[i * 16 : (i + 1) * 16] for i in range(N)],
        bytes(16),
    )
    tiers.flush()
    yield tiers, caches, hashes, toks
    tiers.close()


def test_disk_tier_load_32_blocks(benchmark, setup):
    tiers, caches, hashes, toks = setup
    benchmark.group = "KV tier load: 32 SmolLM2 blocks (11.5 MiB)"

    def load():
        got = tiers.lookup(hashes, bytes(16), toks, bytes(16))
        tiers.load_into(caches, list(range(N, 2 * N)), got)
        return len(got)

    assert benchmark(load) == N
    assert caches[7][0][N + 3].tobytes() == caches[7][0][3].tobytes()


def test_record_encode_and_verify(benchmark):
    benchmark.group = "KV tier record: one 360 KiB block"
    payload = np.ones(LAYOUT.shape, np.float16)
    toks = list(range(16))

    def roundtrip():
        rec = encode_record(bytes(16), bytes(16), bytes(16), bytes(16), toks, payload)
        return decode_record(
            rec,
            block_hash=bytes(16),
            parent=bytes(16),
            salt=bytes(16),
            fingerprint=bytes(16),
            tokens=toks,
            payload_len=LAYOUT.nbytes,
        )

    assert len(benchmark(roundtrip)) == LAYOUT.nbytes
