"""Pure-Python block allocator and block tables: the executable spec of the Rust core.

Both backends have the same names, signatures, results and exception types; the test suite
(and a Hypothesis state machine driving both side by side) holds them to it.

Model
-----
A pool of ``num_blocks`` blocks of ``block_size`` token slots. A block is *live* (ref count > 0,
held by one or more sequences), *cached* (ref count 0 but holding a prefix hash, so a later
prompt can take it back), or *free* (ref count 0, no hash). Blocks with ref count 0 sit on one
intrusive doubly linked free list; ``allocate`` takes from its head (policy ``"lru"``: the block
freed longest ago, so cached blocks are evicted in LRU order) or its tail (policy ``"mru"``:
the block freed last, warm in CPU caches; evicts the newest cached blocks first). Freeing a
sequence releases its blocks tail first, so a sequence's deepest prefix blocks go first.

Prefix caching: once a full block of a sequence has been computed, it gets the chained hash
``H(parent hash, its token ids, cache_salt if it is the first block)`` where ``H`` is SHA-256
truncated to ``hash_bits`` (128 by default) bits, little-endian. A hit is collision-checked per
block: the stored (parent hash, salt, token ids) of the block must equal the query's. The parent
is known only by its (truncated) hash, so with few ``hash_bits`` two different prefixes whose
hashes collide share their children (a block computed after prefix A can serve prefix B);
``hash_bits < 128`` exists to make collisions testable, not for serving. A hit never covers
the whole prompt: at least one token is left to compute.

Invariants (tags used in assertions, debug_assert! and test names)
------------------------------------------------------------------
I1  free + cached + live == num_blocks
I2  a block's ref count == the number of sequences whose block table holds it
I3  a block is on the free list iff its ref count is 0
I4  a block holds a hash iff the prefix index maps that hash to it
I5  a sequence holds exactly ceil(num_tokens / block_size) blocks; num_computed <= num_tokens
I6  a prefix hit leaves at least one prompt token to compute
"""

from __future__ import annotations

from pagedkv_rs.fallback.allocator import MAX_BLOCK_SIZE, MAX_NUM_BLOCKS, BlockAllocator
from pagedkv_rs.fallback.block_table import KVCacheManager

__all__ = ["BlockAllocator", "KVCacheManager", "MAX_NUM_BLOCKS", "MAX_BLOCK_SIZE"]
