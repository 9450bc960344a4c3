"""Hypothesis drives the Rust and the Python KVCacheManager side by side and demands identical results.

Every rule runs on each backend; the returned values (or raised exception types), block tables, free
orders, ref counts and statistics must agree, the invariants I1-I5 must hold after every step, and
I6 (a prefix hit leaves at least one prompt token to compute) on every allocate.
A small pool, a tiny vocabulary (so prefixes repeat) and 2-bit hashes (so collisions happen) keep
memory pressure, prefix hits and collision checks frequent. Soak: HYPOTHESIS_PROFILE=soak.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import pagedkv_rs

SEQ_IDS = st.integers(0, 7)
TOKENS = st.lists(st.integers(0, 3), min_size=0, max_size=14)
SALTS = st.sampled_from([None, "a", b"b"])


def outcome(fn):
    """A comparable result: the value (arrays as lists) or the exception type."""
    try:
        value = fn()
    except Exception as e:
        return ("raised", type(e).__name__)
    if hasattr(value, "slot_mapping"):  # BatchInputs
        return tuple((f, getattr(value, f).dtype.str, getattr(value, f).tolist()) for f in value.__dataclass_fields__)
    return ("ok", value)


class BothBackends(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(1, 12),
        block_size=st.integers(1, 4),
        caching=st.booleans(),
        policy=st.sampled_from(["lru", "mru"]),
        hash_bits=st.sampled_from([128, 2]),
        max_seq_len=st.sampled_from([None, 9, 40]),
    )
    def setup(self, num_blocks, block_size, caching, policy, hash_bits, max_seq_len):
        kw = dict(enable_prefix_caching=caching, policy=policy, hash_bits=hash_bits, max_seq_len=max_seq_len)
        self.managers = [
            pagedkv_rs.backend(b).KVCacheManager(num_blocks, block_size, **kw) for b in pagedkv_rs.BACKENDS
        ]

    def both(self, call):
        results = [outcome(lambda m=m: call(m)) for m in self.managers]
        assert all(r == results[0] for r in results), results
        return results[0]

    @rule(sid=SEQ_IDS, toks=TOKENS, salt=SALTS)
    def allocate(self, sid, toks, salt):
        r = self.both(lambda m: m.allocate(sid, toks, cache_salt=salt))
        if r[0] == "ok" and toks:
            assert 0 <= r[1] < len(toks), f"I6 a hit of {r[1]} tokens covers the {len(toks)}-token prompt"

    @rule(sid=SEQ_IDS, toks=TOKENS)
    def append(self, sid, toks):
        self.both(lambda m: m.append(sid, toks))

    @rule(sids=st.lists(SEQ_IDS, max_size=4), tok=st.integers(0, 3))
    def append_batch(self, sids, tok):
        self.both(lambda m: m.append_batch(sids, [tok] * len(sids)))

    @rule(parent=SEQ_IDS, child=SEQ_IDS)
    def fork(self, parent, child):
        self.both(lambda m: m.fork(parent, child))

    @rule(sid=SEQ_IDS)
    def free(self, sid):
        self.both(lambda m: m.free(sid))

    @rule(data=st.data())
    def prepare_batch(self, data):
        held = self.managers[0].seq_ids()
        sids = data.draw(st.lists(st.sampled_from(held), unique=True, max_size=4) if held else st.just([]))
        m0 = self.managers[0]
        ns = [data.draw(st.integers(0, m0.num_tokens(s) - m0.num_computed_tokens(s) + 1)) for s in sids]
        self.both(lambda m: m.prepare_batch(sids, ns))

    @rule(toks=TOKENS, salt=SALTS)
    def queries(self, toks, salt):
        self.both(lambda m: (m.can_allocate(toks, salt), m.blocks_needed(toks, salt)))

    @rule(sid=SEQ_IDS, k=st.integers(0, 9))
    def append_queries(self, sid, k):
        self.both(lambda m: (m.can_append(sid, k), m.blocks_needed_to_append(sid, k)))

    @rule()
    def reset(self):
        self.both(lambda m: m.reset_prefix_cache())

    @invariant()
    def agree_and_hold(self):
        for m in self.managers:
            m.check_invariants()  # I1-I5
        self.both(
            lambda m: (
                m.seq_ids(),
                [(m.block_table(s), m.token_ids(s), m.num_computed_tokens(s)) for s in m.seq_ids()],
                m.free_order(),
                [(m.ref_count(b), m.block_hash(b)) for b in range(m.num_blocks)],
                m.stats(),
            )
        )
        m0 = self.managers[0]
        held: dict[int, int] = {}
        for s in m0.seq_ids():  # I2 from the outside
            for b in m0.block_table(s):
                held[b] = held.get(b, 0) + 1
        assert all(m0.ref_count(b) == held.get(b, 0) for b in range(m0.num_blocks)), "I2"
        st_ = m0.stats()
        assert st_["free_blocks"] + st_["cached_blocks"] + st_["live_blocks"] == st_["num_blocks"], "I1"

    def teardown(self):
        if not hasattr(self, "managers"):
            return
        for s in self.managers[0].seq_ids():
            self.both(lambda m, s=s: m.free(s))
        for m in self.managers:  # no leak once every sequence is freed
            assert m.num_live_blocks == 0
            assert m.num_free_blocks + m.num_cached_blocks == m.num_blocks
            assert all(m.ref_count(b) == 0 for b in range(m.num_blocks))


TestBothBackends = BothBackends.TestCase


def test_batch_arrays_identical_on_a_large_random_workload():
    """One long seeded workload beyond Hypothesis' small pools: every prepare_batch output equal."""
    names = pagedkv_rs.BACKENDS if len(pagedkv_rs.BACKENDS) == 2 else ("python", "python")
    rng = np.random.default_rng(7)
    ms = [pagedkv_rs.backend(b).KVCacheManager(512, 16) for b in names]
    live: list[int] = []
    for step in range(300):
        op = rng.integers(0, 4)
        if op == 0 or not live:
            sid = step
            toks = rng.integers(0, 50, int(rng.integers(1, 300))).tolist()
            rs = [outcome(lambda m=m: m.allocate(sid, toks)) for m in ms]
            assert rs[0] == rs[1]
            if rs[0][0] == "ok":
                live.append(sid)
        elif op == 1:
            batch = live[:64]
            assert outcome(lambda: ms[0].append_batch(batch, [1] * len(batch))) == outcome(
                lambda: ms[1].append_batch(batch, [1] * len(batch))
            )
        elif op == 2:
            ns = [ms[0].num_tokens(s) - ms[0].num_computed_tokens(s) for s in live]
            assert outcome(lambda: ms[0].prepare_batch(live, ns)) == outcome(lambda: ms[1].prepare_batch(live, ns))
        else:
            sid = live.pop(int(rng.integers(0, len(live))))
            for m in ms:
                m.free(sid)
    assert ms[0].stats() == ms[1].stats()
