"""Tier specs, the block record format and the chained hash: decoding anything is a record or a miss."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedkv_rs.tiers import (
    BlockLayout,
    RecordError,
    chain_hashes,
    decode_record,
    encode_record,
    parse_tier,
    salt_digest,
)
from pagedkv_rs.tiers.disk import DiskTier
from pagedkv_rs.tiers.redis import RedisTier
from session import scaled

LAYOUT = BlockLayout(2, 2, 4, 8, np.dtype(np.float16))
H, P, S, F = (hashlib.sha256(bytes([i])).digest()[:16] for i in range(4))
TOKS = [5, 6, 7, 8]


def record(secret=None, tokens=TOKS):
    payload = np.arange(np.prod(LAYOUT.shape), dtype=np.float16).reshape(LAYOUT.shape)
    return encode_record(H, P, S, F, tokens, payload, secret), payload


def decode(data, secret=None, **kw):
    want = dict(block_hash=H, parent=P, salt=S, fingerprint=F, tokens=TOKS, payload_len=LAYOUT.nbytes)
    want.update(kw)
    return decode_record(data, secret=secret, **want)


def test_record_round_trip_and_every_field_is_checked():
    data, payload = record()
    assert bytes(decode(data)) == payload.tobytes()
    for kw in (
        {"block_hash": P},
        {"parent": H},
        {"salt": F},
        {"fingerprint": S},
        {"tokens": [5, 6, 7, 9]},
        {"payload_len": LAYOUT.nbytes - 2},
    ):
        with pytest.raises(RecordError):
            decode(data, **kw)
    with pytest.raises(RecordError, match="no MAC"):
        decode(data, secret=b"k")


def test_mac_verifies_only_with_the_secret():
    data, payload = record(b"secret")
    assert bytes(decode(data, secret=b"secret")) == payload.tobytes()
    with pytest.raises(RecordError, match="MAC"):
        decode(data, secret=b"other")
    assert bytes(decode(data)) == payload.tobytes()  # a reader without a secret checks the checksum only
    forged = bytearray(data)
    forged[-40] ^= 1  # the payload, re-checksummed by an attacker without the secret, still fails the MAC
    with pytest.raises(RecordError):
        decode(bytes(forged), secret=b"secret")


@scaled(200)
@given(st.data())
def test_any_flip_or_cut_is_a_miss(data):
    raw, _ = record(b"k" if data.draw(st.booleans()) else None)
    buf = bytearray(raw)
    if data.draw(st.booleans()):
        i = data.draw(st.integers(0, len(buf) - 1))
        buf[i] ^= 1 << data.draw(st.integers(0, 7))
    else:
        buf = buf[: data.draw(st.integers(0, len(buf) - 1))]
    with pytest.raises(RecordError):
        decode(bytes(buf), secret=b"k" if raw[6] & 1 else None)


@scaled(300)
@given(st.binary(max_size=600), st.booleans())
def test_random_bytes_decode_to_a_miss_only(blob, with_header):
    if with_header:  # a plausible header in front of random bytes
        blob = record()[0][:56] + blob
    try:
        decode(blob)
    except RecordError:
        pass


def test_chain_hashes_are_the_prefix_cache_hashes(backend):
    alloc = backend.BlockAllocator(8, 4)
    toks = list(range(10, 23))
    for salt in (None, "tenant", b"\x00raw"):
        got = chain_hashes(toks, 4, salt)
        assert len(got) == 3
        parent = None
        for i, h in enumerate(got):
            want = alloc.hash_block(parent, toks[i * 4 : (i + 1) * 4], salt if i == 0 else None)
            assert h == want.to_bytes(16, "little")
            parent = want
    assert salt_digest(None) == bytes(16) and salt_digest("a") == salt_digest(b"a") != salt_digest("b")
    known = chain_hashes(toks[:8], 4, None)
    assert chain_hashes(toks, 4, None, known) == chain_hashes(toks, 4, None) and len(known) == 3


def test_specs_parse(tmp_path):
    d = parse_tier(f"disk:{tmp_path}/a?size=1MiB&fsync=1&secret=x")
    assert isinstance(d, DiskTier) and d.size == 1 << 20 and d.fsync and d.secret == b"x"
    assert d.name == f"disk:{tmp_path}/a"
    assert parse_tier(f"disk:{tmp_path}/b", secret="g").secret == b"g"
    r = parse_tier("redis://:pw@127.0.0.1:6390/2?prefix=p:&ttl=60&secret=s&timeout=0.2")
    assert isinstance(r, RedisTier) and r.prefix == "p:" and r.ttl == 60 and r.secret == b"s"
    assert r.name == "redis://127.0.0.1:6390/2"  # no password, no options
    assert parse_tier("rediss://example.invalid:6380/0").name == "rediss://example.invalid:6380/0"


@pytest.mark.parametrize(
    "spec, match",
    [
        ("disk:", "needs a directory"),
        ("disk:{tmp}?size=lots", "size must be"),
        ("disk:{tmp}?size=0", "size must be"),
        ("disk:{tmp}?colour=red", "unknown option 'colour'"),
        ("disk:{tmp}?fsync=maybe", "fsync must be 0 or 1"),
        ("disk:{tmp}?secret=", "must not be empty"),
        ("redis://", "needs a host"),
        ("redis://h:99999/0", "bad port"),
        ("redis://h:1/zero", "database must be a number"),
        ("redis://h:1/0?ttl=-5", "ttl must be a positive number"),
        ("redis://h:1/0?ttl=1&ttl=2", "given twice"),
        ("redis://:hunter2@h:1/0?nope=1", "unknown option"),
        ("memcached://h", "unknown KV tier"),
    ],
)
def test_bad_specs_say_why(tmp_path, spec, match):
    with pytest.raises(ValueError, match=match) as e:
        parse_tier(spec.format(tmp=tmp_path))
    assert "hunter2" not in str(e.value)


@scaled(200)
@given(st.text(max_size=40))
def test_any_redis_spec_parses_or_is_a_value_error(tail):
    try:
        parse_tier("redis://" + tail)
    except ValueError:
        pass


def test_disk_tier_bound_holds_under_churn(tmp_path):
    size = 50_000
    t = DiskTier(os.fspath(tmp_path / "kv"), size)
    rng = np.random.default_rng(0)
    keys = [f"{i:04x}{'ab' * 8}" for i in range(200)]
    for _ in range(600):  # writes, rewrites and reads of random keys with random sizes
        k = keys[int(rng.integers(len(keys)))]
        if rng.random() < 0.3:
            t.get_many([k], deadline=float("inf"))
        else:
            t.put_many([(k, bytes(int(rng.integers(500, 4000))))])
        assert t.used_bytes <= size
    on_disk = sum(p.stat().st_size for p in (tmp_path / "kv").rglob("*.kvb"))
    assert on_disk == t.used_bytes <= size and t.evictions > 0
    smaller = DiskTier(os.fspath(tmp_path / "kv"), size // 2)  # a restart with a smaller bound evicts at once
    assert sum(p.stat().st_size for p in (tmp_path / "kv").rglob("*.kvb")) == smaller.used_bytes <= size // 2


def test_disk_lru_keeps_recently_read(tmp_path):
    t = DiskTier(os.fspath(tmp_path), 3000)
    for k in ("aa01", "aa02", "aa03"):
        t.put_many([(k, bytes(1000))])
    t.get_many(["aa01"], float("inf"))  # aa02 is now the least recently used
    t.put_many([("aa04", bytes(1000))])
    assert [x is not None for x in t.get_many(["aa01", "aa03", "aa04"], float("inf"))] == [True, True, True]
    assert t.get_many(["aa02"], float("inf")) == [None]
