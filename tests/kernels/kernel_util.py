"""Shared builders for the kernel tests: random paged batches over NaN-poisoned caches."""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass

import numpy as np

from pagedkv_rs.kernels import reference as ref

# Max abs error vs the float64 reference. The reference reads the same (already rounded) cache
# values, so the error is the kernel's float32 accumulation + SIMD exp for every dtype.
TOL = {"float32": 3e-5, "float16": 3e-5, "bfloat16": 3e-5}


@dataclass
class Case:
    q: np.ndarray
    k_cache: np.ndarray
    v_cache: np.ndarray
    block_tables: np.ndarray
    seq_lens: np.ndarray
    query_start_loc: np.ndarray

    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens, self.query_start_loc)


def make_case(
    rng: np.random.Generator,
    *,
    seq_lens,
    q_lens,
    hq: int,
    hkv: int,
    d: int,
    bs: int,
    dtype: str = "float32",
    spare_blocks: int = 3,
    pad_cols: int = 1,
    share: bool = False,
) -> Case:
    """Caches full of NaN except the slots the batch's sequences own; random block ids.

    With ``share``, later sequences reuse earlier sequences' block ids (as prefix sharing or
    a repeated id would); their contents are written by whichever sequence wrote last.
    """
    seq_lens = [int(x) for x in seq_lens]
    q_lens = [int(x) for x in q_lens]
    nblk = [-(-L // bs) for L in seq_lens]
    num_blocks = sum(nblk) + spare_blocks
    perm = rng.permutation(num_blocks)
    width = max(nblk, default=0) + pad_cols
    tables = np.full((len(seq_lens), width), -1, np.int32)
    used = 0
    for i, n in enumerate(nblk):
        ids = perm[used : used + n]
        used += n
        if share and i > 0 and n > 0 and nblk[0] > 0:
            ids = ids.copy()
            ids[0] = tables[0, 0]  # a block id repeated across sequences
        tables[i, :n] = ids
    k, v = ref.new_kv_cache(num_blocks, bs, hkv, d, dtype)
    k[...] = np.nan
    v[...] = np.nan
    for i, L in enumerate(seq_lens):
        pos = np.arange(L)
        slots = tables[i, pos // bs].astype(np.int64) * bs + pos % bs
        ref.write_kv(
            k,
            v,
            rng.standard_normal((L, hkv, d), dtype=np.float32),
            rng.standard_normal((L, hkv, d), dtype=np.float32),
            slots,
        )
    qsl = np.zeros(len(seq_lens) + 1, np.int32)
    qsl[1:] = np.cumsum(q_lens)
    q = rng.standard_normal((int(qsl[-1]), hq, d), dtype=np.float32)
    return Case(q, k, v, tables, np.array(seq_lens, np.int32), qsl)


def max_err(got: np.ndarray, want: np.ndarray) -> float:
    assert got.shape == want.shape and got.dtype == np.float32
    assert np.isfinite(got).all(), "non-finite output: a NaN slot was read"
    return float(np.max(np.abs(got.astype(np.float64) - want), initial=0.0))


def gil_released_during(call, attempts: int = 5) -> bool:
    """Whether ``call()`` lets another Python thread run before it returns, proven without timing.

    With the switch interval at 1e6 s CPython never forces the GIL away from a running thread, so the
    waiting thread can run while ``call`` is in progress only if ``call`` releases the GIL itself
    (``py.detach``). ``Event.set`` wakes the waiter but keeps the GIL. The waiter sees ``finished``
    unset: released. It sees it set: not released, or woken too late (inconclusive), so try again.
    """
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e6)
    try:
        return any(_waiter_ran_during(call) for _ in range(attempts))
    finally:
        sys.setswitchinterval(old)


def _waiter_ran_during(call) -> bool:
    started, finished = threading.Event(), threading.Event()
    seen: list[bool] = []
    waiter = threading.Thread(target=lambda: seen.append(started.wait(60) and finished.is_set()))
    waiter.start()
    time.sleep(0.01)  # let it block in wait() (if it is still running, it gives the GIL up there)
    started.set()
    try:
        call()
    finally:
        finished.set()
        waiter.join(60)
    assert seen, "the waiting thread did not finish"
    return seen[0] is False


def python_busy(seconds: float = 0.05) -> None:
    """Pure-Python work that never gives up the GIL on its own (the control for ``gil_released_during``)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
