"""Differential smoke test: ``pagedkv_rs._core`` against the ``pagedkv_rs.fallback`` spec.

Seeded random operation streams (prefix-sharing prompts, forks, batched appends, prepare_batch,
bad inputs, collision-heavy ``hash_bits``) run on both backends side by side; every result,
exception (type and message) and the whole observable state must match after every step.
"""

from __future__ import annotations

import random
from dataclasses import fields
from typing import Any, Callable

import numpy as np
import pytest

from pagedkv_rs import _core, fallback
from pagedkv_rs.batch import BatchInputs


def _outcome(fn: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "ok", fn()
    except Exception as e:
        return "err", (type(e), str(e))


def _same(a: Any, b: Any) -> None:
    if isinstance(a, BatchInputs):
        assert isinstance(b, BatchInputs)
        for f in fields(BatchInputs):
            x, y = getattr(a, f.name), getattr(b, f.name)
            assert x.dtype == y.dtype and x.shape == y.shape, f.name
            np.testing.assert_array_equal(x, y, err_msg=f.name)
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), (a, b)
        for x, y in zip(a, b):
            _same(x, y)
    elif isinstance(a, dict):
        assert type(b) is dict and list(a) == list(b), (a, b)
        for k in a:
            _same(a[k], b[k])
    else:
        assert type(a) is type(b) and a == b, (a, b)


def _call(r: Any, p: Any, name: str, *args: Any, **kw: Any) -> Any:
    out_r = _outcome(lambda: getattr(r, name)(*args, **kw))
    out_p = _outcome(lambda: getattr(p, name)(*args, **kw))
    assert out_r[0] == out_p[0], (name, args, kw, out_r, out_p)
    if out_r[0] == "err":
        assert out_r[1] == out_p[1], (name, args, kw)
    else:
        _same(out_r[1], out_p[1])
    return out_p


def _same_state(r: Any, p: Any, manager: bool) -> None:
    r.check_invariants()
    p.check_invariants()
    props = ["num_blocks", "block_size", "enable_prefix_caching", "policy"]
    props += ["num_free_blocks", "num_cached_blocks", "num_live_blocks", "usage"]
    props += ["max_seq_len"] if manager else ["hash_bits", "num_evictions"]
    for name in props:
        _same(getattr(r, name), getattr(p, name))
    _same(r.stats(), p.stats())
    _same(r.free_order(), p.free_order())
    for b in range(p.num_blocks):
        _same(r.ref_count(b), p.ref_count(b))
        _same(r.block_hash(b), p.block_hash(b))
    if manager:
        _same(len(r), len(p))
        _same(r.seq_ids(), p.seq_ids())
        for s in p.seq_ids():
            for name in ("block_table", "token_ids", "num_tokens", "num_computed_tokens"):
                _same(getattr(r, name)(s), getattr(p, name)(s))


def _ids(rng: random.Random, ids: list[int]) -> Any:
    """The same ids as a list, tuple, int64 or int32 array."""
    kind = rng.randrange(4)
    if kind == 0:
        return list(ids)
    if kind == 1:
        return tuple(ids)
    return np.asarray(ids, np.int64 if kind == 2 else np.int32)


def _prompt(rng: random.Random, stems: list[list[int]], alphabet: int) -> list[int]:
    base = list(rng.choice(stems)) if stems and rng.random() < 0.7 else []
    base = base[: rng.randrange(len(base) + 1)]
    return base + [rng.randrange(alphabet) for _ in range(rng.randrange(1, 40))]


CONFIGS = [
    dict(num_blocks=24, block_size=4, policy="lru", hash_bits=128),
    dict(num_blocks=24, block_size=4, policy="mru", hash_bits=128),
    dict(num_blocks=16, block_size=4, policy="lru", hash_bits=2),
    dict(num_blocks=16, block_size=2, policy="mru", hash_bits=1),
    dict(num_blocks=40, block_size=1, policy="lru", hash_bits=3),
    dict(num_blocks=12, block_size=16, policy="lru", hash_bits=128, max_seq_len=50),
    dict(num_blocks=24, block_size=4, policy="lru", hash_bits=128, enable_prefix_caching=False),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("seed", range(3))
def test_manager_random_ops_match_fallback(cfg: dict, seed: int) -> None:
    rng = random.Random(seed)
    r, p = _core.KVCacheManager(**cfg), fallback.KVCacheManager(**cfg)
    alphabet = 3 if cfg["hash_bits"] < 8 else 50
    stems: list[list[int]] = []
    next_id = 0
    for _ in range(300):
        held = p.seq_ids()
        some = held + [next_id + 5]  # include an unknown id now and then
        op = rng.randrange(12)
        if op <= 2:
            toks = _prompt(rng, stems, alphabet)
            stems.append(toks)
            salt = rng.choice([None, None, "a", b"b"])
            sid = next_id if rng.random() < 0.9 else rng.choice(some)
            next_id += 1
            _call(r, p, "allocate", sid, toks, salt)
        elif op == 3 and held:
            sid = rng.choice(some)
            _call(r, p, "append", sid, [rng.randrange(alphabet) for _ in range(rng.randrange(0, 9))])
        elif op in (4, 5) and held:
            batch = rng.sample(held, rng.randrange(len(held) + 1))
            if batch and rng.random() < 0.1:
                batch.append(rng.choice(batch + [next_id + 7]))
            toks = [rng.randrange(alphabet) for _ in batch]
            _call(r, p, "append_batch", _ids(rng, batch), toks)
        elif op == 6 and held:
            child = next_id if rng.random() < 0.9 else rng.choice(held)
            next_id += 1
            _call(r, p, "fork", rng.choice(some), child)
        elif op == 7 and held:
            _call(r, p, "free", rng.choice(some))
        elif op in (8, 9):
            batch = rng.sample(held, rng.randrange(len(held) + 1))
            if batch and rng.random() < 0.05:
                batch.append(batch[0])
            ns = None
            if rng.random() < 0.8:
                ns = [
                    rng.randrange(p.num_tokens(s) - p.num_computed_tokens(s) + 1 + (rng.random() < 0.03))
                    if s in p
                    else 0
                    for s in batch
                ]
                ns = _ids(rng, ns)
            _call(r, p, "prepare_batch", _ids(rng, batch), ns)
        elif op == 10:
            toks = _prompt(rng, stems, alphabet)
            _call(r, p, "blocks_needed", toks)
            _call(r, p, "can_allocate", toks, rng.choice([None, "a"]))
            if held:
                sid, k = rng.choice(some), rng.randrange(0, 30)
                _call(r, p, "can_append", sid, k)
                _call(r, p, "blocks_needed_to_append", sid, k)
        elif op == 11 and rng.random() < 0.2:
            _call(r, p, "reset_prefix_cache")
        _same_state(r, p, manager=True)


@pytest.mark.parametrize("cfg", CONFIGS[:5], ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_allocator_random_ops_match_fallback(cfg: dict) -> None:
    rng = random.Random(7)
    r, p = _core.BlockAllocator(**cfg), fallback.BlockAllocator(**cfg)
    bs, n = cfg["block_size"], cfg["num_blocks"]
    live: list[int] = []
    hashes: list[int] = [0]
    for _ in range(400):
        op = rng.randrange(8)
        if op == 0:
            kind, out = _call(r, p, "allocate", rng.randrange(4))
            if kind == "ok":
                live += out
        elif op == 1 and live:
            ids = rng.sample(live, rng.randrange(1, min(3, len(live)) + 1))
            kind, _ = _call(r, p, "free", ids)
            if kind == "ok":
                for b in ids:
                    live.remove(b)
        elif op == 2:
            ids = [rng.randrange(n) for _ in range(rng.randrange(3))]
            kind, _ = _call(r, p, "incref", ids)
            if kind == "ok":
                live += ids
        elif op == 3:
            b = rng.choice(live) if live and rng.random() < 0.9 else rng.randrange(n)
            toks = [rng.randrange(3) for _ in range(bs + (rng.random() < 0.05))]
            kind, h = _call(r, p, "cache_block", b, rng.choice(hashes), toks, rng.choice([None, "s"]))
            if kind == "ok":
                hashes.append(h)
        elif op == 4:
            toks = [rng.randrange(3) for _ in range(bs)]
            _call(r, p, "lookup", rng.choice(hashes), toks, rng.choice([None, "s"]))
            _call(r, p, "hash_block", rng.choice(hashes + [None]), toks)
        elif op == 5 and rng.random() < 0.1:
            _call(r, p, "reset_prefix_cache")
        elif op == 6:
            _call(r, p, "free", [rng.randrange(n)] * 2)
        _same_state(r, p, manager=False)


class _Index:
    """Not an int, but has ``__index__``."""

    def __init__(self, v: int) -> None:
        self.v = v

    def __index__(self) -> int:
        return self.v


def _loaded(cls: Any) -> Any:
    m = cls(8, 4, hash_bits=4)
    m.allocate(1, [1, 2, 3, 4, 5])
    m.allocate(2, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    m.prepare_batch([2], [9])
    m.fork(1, 3)
    return m


BAD_CALLS: list[tuple[str, tuple, dict]] = [
    ("allocate", (True, [1]), {}),
    ("allocate", (-1, [1]), {}),
    ("allocate", (2**64, [1]), {}),
    ("allocate", (1.0, [1]), {}),
    ("allocate", (1, [1]), {}),
    ("allocate", (9, []), {}),
    ("allocate", (9, "ab"), {}),
    ("allocate", (9, b"ab"), {}),
    ("allocate", (9, [1, -1]), {}),
    ("allocate", (9, [-1, "x"]), {}),
    ("allocate", (9, ["x", -1]), {}),
    ("allocate", (9, [2**32]), {}),
    ("allocate", (9, np.array([1, 2**32])), {}),
    ("allocate", (9, np.array([1.0, 2.0])), {}),
    ("allocate", (9, [np.True_]), {}),
    ("allocate", (9, [1], 5), {}),
    ("allocate", (1, [1], 5), {}),
    ("allocate", (9, list(range(33))), {}),
    ("allocate", (9, [1] * 20), {}),
    ("allocate", (np.int64(9), (_Index(3), np.int32(4))), {"cache_salt": "x"}),
    ("append", (9, [1]), {}),
    ("append", ("1", [1]), {}),
    ("append", (-1, [1]), {}),
    ("append", (2**70, [1]), {}),
    ("append", (9, ["x"]), {}),
    ("append", (1, ["x"]), {}),
    ("append", (1, [1] * 40), {}),
    ("append", (1, [1] * 20), {}),
    ("append", (_Index(3), [7, 7]), {}),
    ("append_batch", ([1, 2], [1]), {}),
    ("append_batch", ([1, 1], [1, 2]), {}),
    ("append_batch", ([1, 9], [1, "x"]), {}),
    ("append_batch", ([9, "x"], [1, 2]), {}),
    ("append_batch", (["x", 9], [1, 2]), {}),
    ("append_batch", ([1, -1], [1, 2]), {}),
    ("append_batch", (np.array([1, -1]), [1, 2]), {}),
    ("append_batch", ([1, 1], [1, "x"]), {}),
    ("append_batch", ([1, 2], [1, "x"]), {}),
    ("append_batch", (5, [1]), {}),
    ("append_batch", (np.array([1, 3], np.uint64), np.array([5, 6])), {}),
    ("fork", (9, 10), {}),
    ("fork", (9, "x"), {}),
    ("fork", (1, "x"), {}),
    ("fork", (1, -1), {}),
    ("fork", (1, 2), {}),
    ("fork", (1, 1), {}),
    ("free", (9,), {}),
    ("free", (True,), {}),
    ("free", (_Index(2),), {}),
    ("prepare_batch", ([1, 9],), {}),
    ("prepare_batch", ([1, 1],), {}),
    ("prepare_batch", ([1, "x"],), {}),
    ("prepare_batch", ([9, "x"],), {}),
    ("prepare_batch", ([1, 2], [1]), {}),
    ("prepare_batch", ([1, 1], [1]), {}),
    ("prepare_batch", ([1, 2], [1, -1]), {}),
    ("prepare_batch", ([1, 2], [6, 0]), {}),
    ("prepare_batch", ([1, 2], 5), {}),
    ("prepare_batch", ([1, 2], [1, "x"]), {}),
    ("prepare_batch", ([1, 2], [1, 2**41]), {}),
    ("prepare_batch", (5,), {}),
    ("prepare_batch", (iter([1, 3]), iter([1, 1])), {}),
    ("prepare_batch", ((s for s in [1, 3]), [5, 1]), {}),
    ("prepare_batch", ((s for s in [1, 3]), [6, 1]), {}),  # one-pass ids: the checks still apply
    ("prepare_batch", (np.array([], np.int64),), {}),
    ("can_append", (9, "x"), {}),
    ("can_append", ("x", -1), {}),
    ("can_append", (1, -1), {}),
    ("can_append", (1, 2**41), {}),
    ("can_append", (1, 100), {}),
    ("blocks_needed_to_append", (9, "x"), {}),
    ("blocks_needed_to_append", (9, -1), {}),
    ("blocks_needed_to_append", ("x", 1), {}),
    ("blocks_needed_to_append", (3, 5), {}),
    ("can_allocate", ([], 5), {}),
    ("can_allocate", ([1], 5), {}),
    ("can_allocate", ([1] * 40, 5), {}),
    ("blocks_needed", ([], 5), {}),
    ("blocks_needed", ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10],), {}),
    ("block_table", (2**64,), {}),
    ("token_ids", (None,), {}),
    ("ref_count", (8,), {}),
    ("ref_count", (-1,), {}),
    ("block_hash", (1.5,), {}),
    ("__contains__", ("x",), {}),
    ("__contains__", (True,), {}),
    ("__contains__", (-5,), {}),
    ("__contains__", (2**80,), {}),
    ("__contains__", (np.uint64(3),), {}),
]


@pytest.mark.parametrize(("name", "args", "kw"), BAD_CALLS)
def test_manager_edge_inputs_match_fallback(name: str, args: tuple, kw: dict) -> None:
    r, p = _loaded(_core.KVCacheManager), _loaded(fallback.KVCacheManager)
    # Iterators are consumed by a call: give each backend its own.
    vals = [list(a) if hasattr(a, "__next__") else None for a in args]
    args_r = tuple(a if v is None else iter(v) for a, v in zip(args, vals))
    args_p = tuple(a if v is None else iter(v) for a, v in zip(args, vals))
    out_r = _outcome(lambda: getattr(r, name)(*args_r, **kw))
    out_p = _outcome(lambda: getattr(p, name)(*args_p, **kw))
    assert out_r[0] == out_p[0], (out_r, out_p)
    if out_r[0] == "err":
        assert out_r[1] == out_p[1]
    else:
        _same(out_r[1], out_p[1])
    _same_state(r, p, manager=True)


@pytest.mark.parametrize(
    "kw",
    [
        dict(num_blocks=0, block_size=4),
        dict(num_blocks=2**24 + 1, block_size=4),
        dict(num_blocks=True, block_size=4),
        dict(num_blocks=4, block_size=2**16 + 1),
        dict(num_blocks=4, block_size="4"),
        dict(num_blocks=4, block_size=4, hash_bits=0),
        dict(num_blocks=4, block_size=4, hash_bits=129),
        dict(num_blocks=4, block_size=4, policy="fifo"),
        dict(num_blocks=4, block_size=4, policy=3),
        dict(num_blocks=4, block_size=-4, policy=3),
        dict(num_blocks=4, block_size=4, hash_bits=0, policy=3),
        dict(num_blocks=4, block_size=4, enable_prefix_caching=0),
        dict(num_blocks=4, block_size=4, enable_prefix_caching=np.array([1, 2])),
        dict(num_blocks=4, block_size=4, max_seq_len=0),
        dict(num_blocks=4, block_size=4, max_seq_len=7),
        dict(num_blocks=4, block_size=4, max_seq_len=2**40),
        dict(num_blocks=4, block_size=4, max_seq_len=2**40 + 1),
        dict(num_blocks=np.int32(4), block_size=_Index(4), policy="mru", max_seq_len=np.int64(9)),
    ],
)
def test_constructor_inputs_match_fallback(kw: dict) -> None:
    out_r = _outcome(lambda: _core.KVCacheManager(**kw))
    out_p = _outcome(lambda: fallback.KVCacheManager(**kw))
    assert out_r[0] == out_p[0], (out_r, out_p)
    if out_r[0] == "err":
        assert out_r[1][0] is out_p[1][0]
    else:
        _same_state(out_r[1], out_p[1], manager=True)


def test_hash_block_matches_fallback_spec() -> None:
    for bits in (1, 2, 7, 64, 127, 128):
        r = _core.BlockAllocator(4, 3, hash_bits=bits)
        p = fallback.BlockAllocator(4, 3, hash_bits=bits)
        parent = 0
        for salt in (None, "", "é", b"\x00\xff"):
            for toks in ([], [0], [1, 2, 3], [2**32 - 1] * 70, np.arange(200, dtype=np.int64)):
                h = _call(r, p, "hash_block", parent, toks, salt)[1]
                parent = h
        _call(r, p, "hash_block", r.hash_bits and (1 << bits), [1])  # parent above the mask
        _call(r, p, "hash_block", -1, [1])
        _call(r, p, "hash_block", None, [1], 3)


def test_rust_manager_is_safe_under_threads() -> None:
    """Many threads drive one manager (frozen pyclass + Mutex): no errors, consistent end state."""
    import threading

    m = _core.KVCacheManager(4096, 16)
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def worker(t: int) -> None:
        try:
            barrier.wait()
            for i in range(40):
                ids = [t * 1000 + i * 4 + k for k in range(4)]
                for s in ids:
                    m.allocate(s, [t, i, 1, 2, 3] * 7)
                m.prepare_batch(ids, [35] * 4)
                for _ in range(5):
                    m.append_batch(ids, [9] * 4)
                    m.prepare_batch(np.asarray(ids), np.ones(4, np.int64))
                m.fork(ids[0], t * 1000 + 999)
                m.free(t * 1000 + 999)
                for s in ids:
                    m.free(s)
                m.check_invariants()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert len(m) == 0 and m.num_live_blocks == 0
    m.check_invariants()


def test_rust_large_calls_release_the_gil_and_stay_consistent() -> None:
    """Prompts/batches past the GIL-release threshold, with other threads reading meanwhile."""
    import threading

    n = 40_000
    r, p = _core.KVCacheManager(6000, 16), fallback.KVCacheManager(6000, 16)
    prompt = np.random.default_rng(1).integers(0, 32000, n)
    stop = threading.Event()
    seen: list[int] = []

    def reader() -> None:
        while not stop.is_set():
            seen.append(r.num_live_blocks + len(r.stats()))

    th = threading.Thread(target=reader)
    th.start()
    try:
        for m in (r, p):
            m.allocate(1, prompt)
            m.allocate(2, prompt[: n // 2])
        _call(r, p, "prepare_batch", [2, 1], [n // 2, n])
        _call(r, p, "allocate", 3, prompt[: n - 5])
    finally:
        stop.set()
        th.join()
    assert seen
    _same_state(r, p, manager=True)
