"""KV events in vLLM's wire format: a ZMQ subscriber modelled on vLLM's examples/online_serving/kv_events_subscriber.py
decodes what the engine publishes (BlockStored for served prompts, BlockRemoved under eviction, AllBlocksCleared on a
reset, replay of missed batches), and with --prefix-hash vllm the block hashes equal vLLM's recipe recomputed here."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys
import time
from typing import Any, Optional, Union

import pytest

try:
    import cbor2
    import msgspec
    import zmq
except ImportError as e:  # never a skip: the events extra and the test deps are part of the suite
    raise ImportError(f"{e}: pip install 'pagedkv-rs[events,test]' (pyzmq, msgspec, cbor2)") from None

from pagedkv_rs.engine.kv_events import KVEventPublisher
from pagedkv_rs.engine.sampling import SamplingParams
from pagedkv_rs.tiers import record_sizes

BS = 16


# The subscriber's own copy of vLLM's types (as vLLM's example keeps one): the wire format is the field order.
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: Optional[str]


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


# vLLM's recipe (vllm/v1/core/kv_cache_utils.py: hash_block_tokens with sha256_cbor, init_none_hash), with cbor2.
def sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def vllm_hashes(token_ids: list[int], seed: str, salt: Optional[str] = None) -> list[int]:
    parent = sha256_cbor(seed)  # NONE_HASH with PYTHONHASHSEED set
    out = []
    for i in range(len(token_ids) // BS):
        extra = (salt,) if (i == 0 and salt) else None
        parent = sha256_cbor((parent, tuple(token_ids[i * BS : (i + 1) * BS]), extra))
        out.append(int.from_bytes(parent, "big") & ((1 << 64) - 1))  # vLLM's int block hashes
    return out


class Subscriber:
    def __init__(self, endpoint: str, replay: Optional[str] = None, topic: str = "") -> None:
        self.ctx = zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.connect(endpoint)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.replay_endpoint = replay
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.seqs: list[int] = []
        self.events: list[Any] = []

    def poll(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if self.sub.poll(50):
                topic, seq, payload = self.sub.recv_multipart()
                self.seqs.append(int.from_bytes(seq, "big"))
                self.events += self.decoder.decode(payload).events

    def wait_for(self, pred: Any, seconds: float = 20.0) -> None:
        end = time.monotonic() + seconds
        while not pred() and time.monotonic() < end:
            self.poll(0.2)
        assert pred(), f"events so far: {self.events}"

    def replay(self, start: int) -> list[tuple[int, KVEventBatch]]:
        # a DEALER, not vLLM's example's REQ: a REQ socket takes one reply per request, and a replay is many
        req = self.ctx.socket(zmq.DEALER)
        req.connect(self.replay_endpoint)
        req.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        try:
            while req.poll(5000):
                _, seq, payload = req.recv_multipart()
                if not payload:
                    break
                out.append((int.from_bytes(seq, "big"), self.decoder.decode(payload)))
        finally:
            req.close(linger=0)
        return out

    def close(self) -> None:
        self.sub.close(linger=0)


def stored(events: list[Any]) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored)]


@pytest.fixture
def events_engine(make_tiny_engine: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    made: list[tuple[Any, KVEventPublisher, Subscriber]] = []

    def make(hash_mode: str = "native", num_blocks: int = 256, replay: bool = False, **kw: Any) -> Any:
        monkeypatch.setenv("PYTHONHASHSEED", "7")
        eng = make_tiny_engine(num_blocks=num_blocks, block_size=BS, **kw)
        pub = KVEventPublisher(
            eng.kv_manager,
            endpoint="tcp://127.0.0.1:*",
            replay_endpoint="tcp://127.0.0.1:*" if replay else None,
            hash_mode=hash_mode,
            topic="kv",
            kv_tiers=eng.kv_tiers,
        )
        eng.runner.kv_events = pub
        sub = Subscriber(pub.endpoint, pub.replay_endpoint, topic="kv")
        time.sleep(0.3)  # PUB/SUB: a subscription made after a send misses it (the slow-joiner rule)
        made.append((eng, pub, sub))
        return eng, pub, sub

    yield make
    for eng, pub, sub in made:
        sub.close()
        pub.shutdown()
        eng.shutdown()


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 5000 + 10 for i in range(n)]


GREEDY = SamplingParams(max_tokens=2, temperature=0)


@pytest.mark.parametrize("backend", ["rust", "python"])
def test_served_prompt_is_announced_block_by_block(events_engine, backend):
    eng, pub, sub = events_engine(backend=backend)
    toks = prompt(1, 3 * BS + 5)
    eng.generate({"prompt_token_ids": toks}, GREEDY)
    sub.wait_for(lambda: sum(len(e.block_hashes) for e in stored(sub.events)) >= 3)
    s = stored(sub.events)
    assert s[0].parent_block_hash is None and s[0].block_size == BS and s[0].medium == "CPU"
    assert s[0].lora_id is None
    got = [t for e in s for t in e.token_ids]
    assert got[: 3 * BS] == toks[: 3 * BS]  # the prompt's full blocks, in order
    hashes = [h for e in s for h in e.block_hashes]
    assert all(0 <= h < 1 << 64 for h in hashes) and len(set(hashes)) == len(hashes)
    assert sub.seqs == sorted(sub.seqs) and sub.seqs[0] == 0
    # the same prefix again is a prefix-cache hit: its blocks are not announced twice
    before = len(hashes)
    eng.generate({"prompt_token_ids": toks[: 3 * BS] + [7, 8, 9]}, GREEDY)
    sub.poll(1.0)
    again = [h for e in stored(sub.events) for h in e.block_hashes]
    assert not set(again[before:]) & set(hashes[:3])


@pytest.mark.parametrize("hash_mode", ["native", "vllm"])
def test_eviction_is_announced_and_reset_clears(events_engine, hash_mode):
    eng, pub, sub = events_engine(num_blocks=12, hash_mode=hash_mode)
    first = prompt(2, 4 * BS + 1)
    eng.generate({"prompt_token_ids": first}, GREEDY)
    sub.wait_for(lambda: len(stored(sub.events)) >= 1)
    first_hashes = {h for e in stored(sub.events) for h in e.block_hashes}
    for k in range(3, 6):  # other prompts push the first one's cached blocks out of a 12-block pool
        eng.generate({"prompt_token_ids": prompt(k, 4 * BS + 1)}, GREEDY)
    sub.wait_for(lambda: any(isinstance(e, BlockRemoved) for e in sub.events))
    removed = {h for e in sub.events if isinstance(e, BlockRemoved) for h in e.block_hashes}
    assert removed & first_hashes and removed <= {h for e in stored(sub.events) for h in e.block_hashes}
    assert all(e.medium == "CPU" for e in sub.events if isinstance(e, BlockRemoved))
    assert eng.kv_manager.stats()["evictions"] >= len(removed)
    eng.kv_manager.reset_prefix_cache()
    eng.generate({"prompt_token_ids": prompt(9, BS + 1)}, GREEDY)  # the next step publishes the reset
    sub.wait_for(lambda: any(isinstance(e, AllBlocksCleared) for e in sub.events))
    assert pub.stats["dropped_batches"] == 0 and pub.stats["unmapped_blocks"] == 0


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_vllm_prefix_hash_is_recomputed_from_token_ids(events_engine, salt):
    eng, pub, sub = events_engine(hash_mode="vllm")
    toks = prompt(4, 5 * BS + 3)
    eng.generate({"prompt_token_ids": toks, "cache_salt": salt} if salt else {"prompt_token_ids": toks}, GREEDY)
    sub.wait_for(lambda: sum(len(e.block_hashes) for e in stored(sub.events)) >= 5)
    s = stored(sub.events)
    hashes = [h for e in s for h in e.block_hashes]
    tokens = [t for e in s for t in e.token_ids]
    assert tokens[: 5 * BS] == toks[: 5 * BS]
    assert hashes[:5] == vllm_hashes(toks, seed="7", salt=salt)
    # a parent named in a later BlockStored is the previous block's vLLM hash
    for e in s[1:]:
        if e.parent_block_hash is not None:
            assert e.parent_block_hash in hashes
    # a salt changes every hash of the chain, as in vLLM
    assert vllm_hashes(toks, "7", "x")[4] != vllm_hashes(toks, "7")[4]


def test_replay_returns_missed_batches(events_engine):
    eng, pub, sub = events_engine(replay=True)
    for k in range(3):
        eng.generate({"prompt_token_ids": prompt(20 + k, 2 * BS + 1)}, GREEDY)
    sub.wait_for(lambda: len(sub.seqs) >= 2)
    replayed = sub.replay(0)
    assert [seq for seq, _ in replayed][: len(sub.seqs)] == sub.seqs
    assert [e for _, b in replayed for e in b.events][: len(sub.events)] == sub.events


def medium_hashes(events: list[Any], medium: str, kind: type = BlockStored) -> list[int]:
    return [h for e in events if isinstance(e, kind) and e.medium == medium for h in e.block_hashes]


@pytest.mark.parametrize("hash_mode", ["native", "vllm"])
def test_tier_writes_are_announced_with_the_tier_medium(events_engine, tmp_path, hash_mode):
    eng, pub, sub = events_engine(hash_mode=hash_mode, kv_tiers=[f"disk:{tmp_path}?size=64MiB"])
    toks = prompt(30, 3 * BS + 5)
    eng.generate({"prompt_token_ids": toks}, GREEDY)  # then idle: the thread itself publishes the late writes
    sub.wait_for(lambda: len(medium_hashes(sub.events, "DISK")) >= 3)
    pool, disk = medium_hashes(sub.events, "CPU"), medium_hashes(sub.events, "DISK")
    assert disk == pool[:3]  # the same blocks under the same hashes, now also on disk
    on_disk = [e for e in stored(sub.events) if e.medium == "DISK"]
    assert [t for e in on_disk for t in e.token_ids] == toks[: 3 * BS]
    assert on_disk[0].parent_block_hash is None and on_disk[0].block_size == BS
    if hash_mode == "vllm":
        assert disk == vllm_hashes(toks, seed="7")[:3]
    assert pub.stats["unmapped_blocks"] == 0 and eng.kv_tiers.stats()[f"disk:{tmp_path}"]["stored_blocks"] == 3


def test_disk_evictions_are_announced(events_engine, make_tiny_engine, tmp_path):
    probe = make_tiny_engine(block_size=BS, kv_tiers=[f"disk:{tmp_path / 'probe'}?size=1MiB"])
    size = record_sizes(probe.kv_tiers.layout)[0]
    probe.shutdown()
    # room for three records: the later prompts' writes evict the first ones
    eng, pub, sub = events_engine(kv_tiers=[f"disk:{tmp_path / 'tier'}?size={3 * size}"])
    for k in range(3):
        eng.generate({"prompt_token_ids": prompt(40 + k, 2 * BS + 1)}, GREEDY)
    sub.wait_for(lambda: len(medium_hashes(sub.events, "DISK", BlockRemoved)) >= 3)
    written, evicted = medium_hashes(sub.events, "DISK"), medium_hashes(sub.events, "DISK", BlockRemoved)
    assert len(written) == 6 and evicted == written[:3]  # least recently used first
    assert eng.kv_tiers.tiers[0].evictions == 3
    assert not any(isinstance(e, BlockRemoved) and e.medium == "CPU" for e in sub.events)  # the pool kept them


@pytest.fixture
def redis_url(tmp_path: Any) -> Any:
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed: apt-get install -y redis-server (the README's test command)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(tmp_path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    import redis

    client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=1)
    for _ in range(500):
        try:
            if client.ping():
                break
        except redis.exceptions.ConnectionError:
            time.sleep(0.02)
    yield f"redis://127.0.0.1:{port}/0", client
    proc.kill()
    proc.wait()


@pytest.mark.parametrize("hash_mode", ["native", "vllm"])
def test_redis_writes_loads_and_removals_carry_its_medium(events_engine, redis_url, hash_mode):
    url, client = redis_url
    a, _, sub_a = events_engine(hash_mode=hash_mode, kv_tiers=[url], kv_tier_secret=b"s")
    toks = prompt(50, 4 * BS + 3)
    a.generate({"prompt_token_ids": toks}, GREEDY)
    sub_a.wait_for(lambda: len(medium_hashes(sub_a.events, "REDIS")) >= 4)
    written = medium_hashes(sub_a.events, "REDIS")
    assert written == medium_hashes(sub_a.events, "CPU")[:4]
    if hash_mode == "vllm":
        assert written == vllm_hashes(toks, seed="7")[:4]
    # another replica on the same Redis, its pool empty: the first three blocks load from Redis; the fourth's
    # record is corrupted, fails verification and is deleted (announced), and that block is computed again
    records = {k: client.get(k) for k in client.keys("*")}
    assert len(records) == 4
    fourth = next(k for k, v in records.items() if _record_tokens(v) == toks[3 * BS : 4 * BS])
    client.set(fourth, records[fourth][:-1] + bytes([records[fourth][-1] ^ 1]))
    b, pub_b, sub_b = events_engine(hash_mode=hash_mode, kv_tiers=[url], kv_tier_secret=b"s")
    b.generate({"prompt_token_ids": toks}, GREEDY)
    sub_b.wait_for(lambda: bool(medium_hashes(sub_b.events, "REDIS", BlockRemoved)))
    assert medium_hashes(sub_b.events, "REDIS", BlockRemoved) == written[3:4]
    loaded = next(e for e in stored(sub_b.events) if e.medium == "REDIS" and e.token_ids[:BS] == toks[:BS])
    assert loaded.block_hashes == written[:3]  # the pool's BlockStored of the loaded blocks names Redis
    sub_b.wait_for(lambda: medium_hashes(sub_b.events, "REDIS")[-1:] == written[3:4])  # rewritten by b
    assert pub_b.stats["unmapped_blocks"] == 0 and b.kv_tiers.metrics[0].snapshot()["verify_failures"] == 1


def _record_tokens(rec: bytes) -> list[int]:
    import struct

    (ntok,) = struct.unpack_from("<I", rec, 8)
    head = struct.calcsize("<4sHHIQ16s16s16s16s")
    return list(struct.unpack_from(f"<{ntok}I", rec, head))


def test_bad_endpoint_is_a_clear_error(make_tiny_engine):
    eng = make_tiny_engine(block_size=BS)
    try:
        with pytest.raises(ValueError, match="tcp://"):
            KVEventPublisher(eng.kv_manager, endpoint="localhost:5557")
        with pytest.raises(ValueError, match="cannot open"):
            KVEventPublisher(eng.kv_manager, endpoint="tcp://*:notaport")
        with pytest.raises(ValueError, match="hash_mode"):
            KVEventPublisher(eng.kv_manager, endpoint="tcp://*:0", hash_mode="md5")
        assert eng.kv_manager.take_events() == []  # nothing enabled by the failed attempts
    finally:
        eng.shutdown()


def test_events_log_is_off_until_enabled_and_drains(make_tiny_engine):
    eng = make_tiny_engine(block_size=BS)
    try:
        eng.generate({"prompt_token_ids": prompt(30, 2 * BS + 1)}, GREEDY)
        assert eng.kv_manager.take_events() == []
        eng.kv_manager.enable_events()
        eng.generate({"prompt_token_ids": prompt(31, 2 * BS + 1)}, GREEDY)
        ev = eng.kv_manager.take_events()
        assert [e[0] for e in ev] == ["stored", "stored"] and ev[0][2] == 0 and ev[1][2] == ev[0][1]
        assert ev[0][3] == prompt(31, BS) and ev[0][4] == b""
        assert eng.kv_manager.take_events() == []
    finally:
        eng.shutdown()


def test_pythonhashseed_matches_vllm_none_hash():
    from pagedkv_rs.engine.kv_events import none_hash, vllm_block_hash

    assert none_hash("0") == sha256_cbor("0")
    parent = os.urandom(32)
    toks = list(range(70000, 70016))
    assert vllm_block_hash(parent, toks, ("s",)) == sha256_cbor((parent, tuple(toks), ("s",)))
    assert vllm_block_hash(parent, [0, 23, 24, 255, 256, 65535, 65536], None) == sha256_cbor(
        (parent, (0, 23, 24, 255, 256, 65535, 65536), None)
    )


def test_serve_refuses_event_options_without_an_endpoint():
    # a process of its own: serve's main configures the logging of the process it runs in
    for opts in (["--prefix-hash", "vllm"], ["--kv-events-replay-endpoint", "tcp://*:5558"]):
        cmd = [sys.executable, "-m", "pagedkv_rs.cli.main", "serve", *opts]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "--kv-events-endpoint" in r.stderr, r.stderr  # before the model loads
