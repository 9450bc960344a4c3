//! Per-sequence block tables on a `BlockAllocator`; builds the kernel inputs of a step.
//!
//! Port of `pagedkv_rs.fallback.KVCacheManager`. Every mutating call validates and checks
//! availability first, then changes state (atomic). Invariant tags I2, I5, I6 as in the fallback.

use crate::allocator::{blocks_for, AllocStats, BlockAllocator, MixMap, Policy};
use crate::error::{Error, Result};

/// Upper bound on token counts taken from callers.
pub const MAX_COUNT: u64 = 1 << 40;

/// Block size, with shift/mask arithmetic when it is a power of two (hot loops divide a lot).
#[derive(Debug, Clone, Copy)]
struct Bs {
    size: u64,
    shift: u32,
    pow2: bool,
}

impl Bs {
    fn new(size: usize) -> Bs {
        let size = size as u64;
        Bs {
            size,
            shift: size.trailing_zeros(),
            pow2: size.is_power_of_two(),
        }
    }
    #[inline]
    fn div(self, n: u64) -> u64 {
        if self.pow2 {
            n >> self.shift
        } else {
            n / self.size
        }
    }
    #[inline]
    fn rem(self, n: u64) -> u64 {
        if self.pow2 {
            n & (self.size - 1)
        } else {
            n % self.size
        }
    }
    /// Blocks holding `n` tokens: ceil(n / size).
    #[inline]
    fn blocks(self, n: u64) -> u64 {
        self.div(n + self.size - 1)
    }
}

#[derive(Debug, Clone)]
struct Seq {
    id: u64,
    tokens: Vec<u32>,
    blocks: Vec<u32>,
    /// Chained hashes of the first `hashes.len()` full computed blocks.
    hashes: Vec<u128>,
    computed: usize,
    salt: Box<[u8]>,
}

/// Counters reported by `stats()`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ManagerStats {
    pub alloc: AllocStats,
    pub num_seqs: usize,
    pub prefix_query_tokens: u64,
    pub prefix_hit_tokens: u64,
}

/// One step's kernel inputs as plain vectors: Python's `BatchInputs` field for field (`rust/py/alloc.rs`
/// builds it by name), which the kernels read back, borrowed, as `attention::Batch`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BatchInputs {
    pub input_ids: Vec<i64>,
    pub positions: Vec<i64>,
    pub query_start_loc: Vec<i32>,
    pub seq_lens: Vec<i32>,
    /// Row-major `[num_seqs, width]`, padded with -1.
    pub block_tables: Vec<i32>,
    pub width: usize,
    pub indptr: Vec<i32>,
    pub indices: Vec<i32>,
    pub last_page_len: Vec<i32>,
    pub slot_mapping: Vec<i64>,
}

#[derive(Debug)]
pub struct KVCacheManager {
    alloc: BlockAllocator,
    bs: Bs,
    max_seq_len: u64,
    /// Dense storage; `index` maps a seq id to its position (swap-remove on free).
    seqs: Vec<Seq>,
    index: MixMap<u64, u32>,
    /// Scratch bitset over positions for duplicate checks; all zero between calls.
    seen: Vec<u64>,
    query_tokens: u64,
    hit_tokens: u64,
}

impl KVCacheManager {
    pub fn new(
        num_blocks: usize,
        block_size: usize,
        caching: bool,
        policy: Policy,
        hash_bits: u32,
        max_seq_len: Option<u64>,
    ) -> Result<Self> {
        let alloc = BlockAllocator::new(num_blocks, block_size, caching, policy, hash_bits)?;
        let cap = num_blocks as u64 * block_size as u64;
        let limit = match max_seq_len {
            None => cap,
            Some(m) if (1..=MAX_COUNT).contains(&m) => m.min(cap),
            Some(m) => {
                return Err(Error::Invalid(format!(
                    "max_seq_len must be in [1, {MAX_COUNT}], got {m}"
                )))
            }
        };
        Ok(KVCacheManager {
            bs: Bs::new(alloc.block_size()),
            alloc,
            max_seq_len: limit,
            seqs: Vec::new(),
            index: MixMap::default(),
            seen: Vec::new(),
            query_tokens: 0,
            hit_tokens: 0,
        })
    }

    // ------------------------------------------------------------------ properties
    pub fn allocator(&self) -> &BlockAllocator {
        &self.alloc
    }
    /// The pool itself, for its event log (`enable_events` / `take_events`).
    pub fn allocator_mut(&mut self) -> &mut BlockAllocator {
        &mut self.alloc
    }
    pub fn block_size(&self) -> usize {
        self.alloc.block_size()
    }
    /// Longest sequence accepted: `max_seq_len` if given, capped by the whole pool.
    pub fn max_seq_len(&self) -> u64 {
        self.max_seq_len
    }
    pub fn len(&self) -> usize {
        self.seqs.len()
    }
    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }
    pub fn contains(&self, id: u64) -> bool {
        self.index.contains_key(&id)
    }

    // ------------------------------------------------------------------- helpers
    /// Position of a held sequence.
    pub fn find(&self, id: u64) -> Result<usize> {
        match self.index.get(&id) {
            Some(&p) => Ok(p as usize),
            None => Err(Error::UnknownSequence(id.to_string())),
        }
    }

    /// Positions of held sequences, failing at the first unknown id.
    pub fn resolve(&self, ids: &[u64]) -> Result<Vec<u32>> {
        ids.iter().map(|&id| self.find(id).map(|p| p as u32)).collect()
    }

    /// ValueError if a position repeats (`op` names the call).
    pub fn check_distinct(&mut self, pos: &[u32], op: &str) -> Result<()> {
        let words = self.seqs.len().div_ceil(64);
        if self.seen.len() < words {
            self.seen.resize(words, 0);
        }
        let mut dup = false;
        let mut marked = 0;
        for &p in pos {
            let (w, bit) = (p as usize / 64, 1u64 << (p % 64));
            if self.seen[w] & bit != 0 {
                dup = true;
                break;
            }
            self.seen[w] |= bit;
            marked += 1;
        }
        for &p in &pos[..marked] {
            self.seen[p as usize / 64] = 0;
        }
        if dup {
            return Err(Error::Invalid(format!("{op} got a sequence id more than once")));
        }
        Ok(())
    }

    fn check_len(&self, n: u64) -> Result<()> {
        if n > self.max_seq_len {
            return Err(Error::SequenceTooLong {
                len: n,
                limit: self.max_seq_len,
                num_blocks: self.alloc.num_blocks(),
                block_size: self.alloc.block_size(),
            });
        }
        Ok(())
    }

    /// Blocks (and hashes) of the longest cached prefix, leaving >= 1 token to compute (I6).
    fn prefix_hits(&self, toks: &[u32], salt: &[u8]) -> (Vec<u32>, Vec<u128>) {
        let (mut blocks, mut hashes) = (Vec::new(), Vec::new());
        if !self.alloc.enable_prefix_caching() || toks.is_empty() {
            return (blocks, hashes);
        }
        let bs = self.block_size();
        let mut parent = 0;
        for (i, chunk) in toks[..toks.len() - 1].chunks_exact(bs).enumerate() {
            let (hit, h) = self.alloc.lookup_hash(parent, if i == 0 { salt } else { &[] }, chunk);
            let Some(b) = hit else { break };
            blocks.push(b);
            hashes.push(h);
            parent = h;
        }
        debug_assert!(blocks.len() * bs < toks.len(), "I6 prefix hit covers the whole prompt");
        (blocks, hashes)
    }

    /// Blocks a prompt takes off the free list: fresh ones plus cached hits with ref count 0.
    fn prompt_demand(&self, n: usize, hits: &[u32]) -> u64 {
        let fresh = blocks_for(n as u64, self.block_size()) - hits.len() as u64;
        fresh + hits.iter().filter(|&&b| self.alloc.ref_of(b) == 0).count() as u64
    }

    /// Blocks an append of k tokens takes: new blocks plus one copy-on-write block.
    fn append_demand(&self, seq: &Seq, k: u64) -> u64 {
        if k == 0 {
            return 0;
        }
        let n = seq.tokens.len() as u64;
        let cow = self.bs.rem(n) != 0 && self.alloc.ref_of(*seq.blocks.last().unwrap_or(&0)) > 1;
        u64::from(cow) + self.bs.blocks(n + k) - seq.blocks.len() as u64
    }

    fn check_count(k: u64) -> Result<()> {
        if k > MAX_COUNT {
            return Err(Error::Invalid(format!(
                "num_new_tokens must be in [0, {MAX_COUNT}], got {k}"
            )));
        }
        Ok(())
    }

    // ------------------------------------------------------------------ queries
    /// Blocks that `allocate` of this prompt would take off the free list now.
    pub fn blocks_needed(&self, toks: &[u32], salt: &[u8]) -> u64 {
        let (hits, _) = self.prefix_hits(toks, salt);
        self.prompt_demand(toks.len(), &hits)
    }

    /// Blocks that appending `k` tokens would take (copy-on-write included).
    pub fn blocks_needed_to_append(&self, id: u64, k: u64) -> Result<u64> {
        Self::check_count(k)?;
        Ok(self.append_demand(&self.seqs[self.find(id)?], k))
    }

    /// Whether `allocate` of this prompt would succeed now (length limit included).
    pub fn can_allocate(&self, toks: &[u32], salt: &[u8]) -> bool {
        if toks.is_empty() || toks.len() as u64 > self.max_seq_len {
            return false;
        }
        self.blocks_needed(toks, salt) <= self.alloc.num_reclaimable() as u64
    }

    /// Whether `append` of `k` tokens would succeed now.
    pub fn can_append(&self, id: u64, k: u64) -> Result<bool> {
        let seq = &self.seqs[self.find(id)?];
        Self::check_count(k)?;
        if seq.tokens.len() as u64 + k > self.max_seq_len {
            return Ok(false);
        }
        Ok(self.append_demand(seq, k) <= self.alloc.num_reclaimable() as u64)
    }

    pub fn block_table(&self, id: u64) -> Result<&[u32]> {
        Ok(&self.seqs[self.find(id)?].blocks)
    }
    pub fn token_ids(&self, id: u64) -> Result<&[u32]> {
        Ok(&self.seqs[self.find(id)?].tokens)
    }
    pub fn num_tokens(&self, id: u64) -> Result<usize> {
        Ok(self.seqs[self.find(id)?].tokens.len())
    }
    pub fn num_computed_tokens(&self, id: u64) -> Result<usize> {
        Ok(self.seqs[self.find(id)?].computed)
    }
    /// Held sequence ids, sorted.
    pub fn seq_ids(&self) -> Vec<u64> {
        let mut ids: Vec<u64> = self.seqs.iter().map(|s| s.id).collect();
        ids.sort_unstable();
        ids
    }

    pub fn stats(&self) -> ManagerStats {
        ManagerStats {
            alloc: self.alloc.stats(),
            num_seqs: self.seqs.len(),
            prefix_query_tokens: self.query_tokens,
            prefix_hit_tokens: self.hit_tokens,
        }
    }

    // ------------------------------------------------------------------ mutation
    /// Admit a sequence with its prompt; returns how many prompt tokens the prefix cache served.
    pub fn allocate(&mut self, id: u64, toks: Vec<u32>, salt: &[u8]) -> Result<usize> {
        if self.contains(id) {
            return Err(Error::DuplicateSequence(id));
        }
        if toks.is_empty() {
            return Err(Error::Invalid("a sequence needs at least one prompt token".into()));
        }
        self.check_len(toks.len() as u64)?;
        let (hits, hashes) = self.prefix_hits(&toks, salt);
        self.alloc.check_available(self.prompt_demand(toks.len(), &hits))?;
        let bs = self.block_size();
        self.alloc.incref_unchecked(&hits);
        let mut blocks = hits;
        let fresh = blocks_for(toks.len() as u64, bs) as usize - blocks.len();
        let cached = blocks.len() * bs;
        self.alloc.take(fresh, &mut blocks);
        if self.alloc.enable_prefix_caching() {
            self.query_tokens += toks.len() as u64;
            self.hit_tokens += cached as u64;
        }
        self.index.insert(id, self.seqs.len() as u32);
        self.seqs.push(Seq {
            id,
            tokens: toks,
            blocks,
            hashes,
            computed: cached,
            salt: salt.into(),
        });
        debug_assert!(self.seq_ok(self.seqs.len() - 1), "I5 after allocate");
        Ok(cached)
    }

    /// Add tokens to a sequence; returns (src, dst) block copies to do first.
    pub fn append(&mut self, id: u64, toks: &[u32]) -> Result<Vec<(u32, u32)>> {
        let p = self.find(id)?;
        self.append_at(p, toks)
    }

    /// `append` for a sequence already looked up with `find`.
    pub fn append_at(&mut self, p: usize, toks: &[u32]) -> Result<Vec<(u32, u32)>> {
        let seq = &self.seqs[p];
        self.check_len(seq.tokens.len() as u64 + toks.len() as u64)?;
        self.alloc.check_available(self.append_demand(seq, toks.len() as u64))?;
        let mut pairs = Vec::new();
        self.grow(p, toks, &mut pairs);
        Ok(pairs)
    }

    /// Append one token to each sequence, all or nothing; returns all (src, dst) block copies.
    pub fn append_batch(&mut self, ids: &[u64], toks: &[u32]) -> Result<Vec<(u32, u32)>> {
        if ids.len() != toks.len() {
            return Err(Error::Invalid(format!(
                "{} sequence ids but {} tokens",
                ids.len(),
                toks.len()
            )));
        }
        let pos = self.resolve(ids)?;
        self.check_distinct(&pos, "append_batch")?;
        self.append_batch_at(&pos, toks)
    }

    /// `append_batch` for distinct positions from `resolve`.
    pub fn append_batch_at(&mut self, pos: &[u32], toks: &[u32]) -> Result<Vec<(u32, u32)>> {
        if pos.len() != toks.len() {
            return Err(Error::Invalid(format!(
                "{} sequence ids but {} tokens",
                pos.len(),
                toks.len()
            )));
        }
        for &p in pos {
            self.check_len(self.seqs[p as usize].tokens.len() as u64 + 1)?;
        }
        let need = pos.iter().map(|&p| self.append_demand(&self.seqs[p as usize], 1)).sum();
        self.alloc.check_available(need)?;
        let mut pairs = Vec::new();
        for (&p, &t) in pos.iter().zip(toks) {
            self.grow(p as usize, &[t], &mut pairs);
        }
        Ok(pairs)
    }

    /// The mutation of append, availability already checked.
    fn grow(&mut self, p: usize, toks: &[u32], pairs: &mut Vec<(u32, u32)>) {
        let bs = self.bs;
        let seq = &mut self.seqs[p];
        let n = seq.tokens.len();
        if !toks.is_empty() && bs.rem(n as u64) != 0 {
            if let Some(last) = seq.blocks.last_mut() {
                let src = *last;
                if self.alloc.ref_of(src) > 1 {
                    let mut dst = Vec::with_capacity(1);
                    self.alloc.take(1, &mut dst);
                    self.alloc.release(std::iter::once(src));
                    *last = dst[0];
                    pairs.push((src, dst[0]));
                }
            }
        }
        let more = bs.blocks((n + toks.len()) as u64) as usize - seq.blocks.len();
        self.alloc.take(more, &mut seq.blocks);
        seq.tokens.extend_from_slice(toks);
        debug_assert!(self.seq_ok(p), "I5 after append");
    }

    /// Make `child` share all of the parent's blocks (copy-on-write on append).
    pub fn fork(&mut self, parent: u64, child: u64) -> Result<()> {
        let p = self.find(parent)?;
        if self.contains(child) {
            return Err(Error::DuplicateSequence(child));
        }
        let mut seq = self.seqs[p].clone();
        seq.id = child;
        if seq.blocks.iter().any(|&b| self.alloc.ref_of(b) == u32::MAX) {
            return Err(Error::Invalid("block ref count overflow".into()));
        }
        self.alloc.incref_unchecked(&seq.blocks);
        self.index.insert(child, self.seqs.len() as u32);
        self.seqs.push(seq);
        Ok(())
    }

    /// Release a sequence's blocks, tail first.
    pub fn free(&mut self, id: u64) -> Result<()> {
        let p = self.find(id)?;
        self.index.remove(&id);
        let seq = self.seqs.swap_remove(p);
        if let Some(moved) = self.seqs.get(p) {
            self.index.insert(moved.id, p as u32);
        }
        self.alloc.release(seq.blocks.iter().rev().copied());
        Ok(())
    }

    /// Shorten a sequence to its first `n` tokens (speculative decoding's rollback of rejected drafts).
    ///
    /// Blocks past them are released tail first; a block it alone holds that is no longer full keeps no
    /// prefix hash (its slots will be written again), so only full blocks of kept tokens stay registered.
    pub fn truncate(&mut self, id: u64, n: u64) -> Result<()> {
        let p = self.find(id)?;
        let len = self.seqs[p].tokens.len() as u64;
        if n == 0 || n > len {
            return Err(Error::Invalid(format!(
                "sequence {id}: cannot truncate {len} tokens to {n} (need 1 <= n <= {len})"
            )));
        }
        let full = self.bs.div(n) as usize;
        let keep = self.bs.blocks(n) as usize;
        let seq = &mut self.seqs[p];
        for j in full..seq.hashes.len() {
            let b = seq.blocks[j];
            if self.alloc.ref_of(b) == 1 {
                self.alloc.drop_hash(b);
            }
        }
        for &b in &seq.blocks[keep..] {
            if self.alloc.ref_of(b) == 1 {
                self.alloc.drop_hash(b);
            }
        }
        seq.hashes.truncate(full);
        seq.tokens.truncate(n as usize);
        seq.computed = seq.computed.min(n as usize);
        let dropped = seq.blocks.split_off(keep);
        self.alloc.release(dropped.iter().rev().copied());
        debug_assert!(self.seq_ok(p), "I5 after truncate");
        Ok(())
    }

    /// Forget every prefix hash; returns how many were dropped.
    pub fn reset_prefix_cache(&mut self) -> usize {
        self.alloc.reset_prefix_cache()
    }

    /// Build one step's kernel inputs and mark the scheduled tokens computed.
    ///
    /// `ns[i]` new tokens for `ids[i]` (None: 0 each, just export the tables).
    pub fn prepare_batch(&mut self, ids: &[u64], ns: Option<&[u64]>) -> Result<BatchInputs> {
        let pos = self.resolve(ids)?;
        self.check_distinct(&pos, "prepare_batch")?;
        let zeros;
        let ns = match ns {
            Some(ns) => ns,
            None => {
                zeros = vec![0; ids.len()];
                &zeros
            }
        };
        if ns.len() != pos.len() {
            return Err(Error::Invalid(format!(
                "{} sequence ids but {} token counts",
                pos.len(),
                ns.len()
            )));
        }
        ns.iter().try_for_each(|&n| Self::check_count(n))?;
        self.prepare_at(&pos, ns)
    }

    /// `prepare_batch` for distinct positions from `resolve` and counts in range.
    pub fn prepare_at(&mut self, pos: &[u32], ns: &[u64]) -> Result<BatchInputs> {
        if ns.len() != pos.len() {
            return Err(Error::Invalid(format!(
                "{} sequence ids but {} token counts",
                pos.len(),
                ns.len()
            )));
        }
        let bs = self.bs;
        let (mut total, mut width, mut nnz) = (0u64, 0u64, 0u64);
        for (&p, &n) in pos.iter().zip(ns) {
            let s = &self.seqs[p as usize];
            let end = s.computed as u64 + n;
            if end > s.tokens.len() as u64 {
                return Err(Error::Invalid(format!(
                    "sequence {}: {n} new tokens after {} computed exceeds its {} tokens",
                    s.id,
                    s.computed,
                    s.tokens.len()
                )));
            }
            if end > i32::MAX as u64 {
                return Err(Error::Invalid(format!(
                    "sequence {}: {end} tokens overflow int32",
                    s.id
                )));
            }
            total += n;
            width = width.max(bs.blocks(end));
            nnz += bs.blocks(end);
        }
        if total > i32::MAX as u64 || nnz > i32::MAX as u64 {
            return Err(Error::Invalid(format!("{total} tokens in one batch overflow int32")));
        }
        let (b, t_len, width) = (pos.len(), total as usize, width as usize);
        let mut out = BatchInputs {
            input_ids: Vec::with_capacity(t_len),
            positions: Vec::with_capacity(t_len),
            query_start_loc: Vec::with_capacity(b + 1),
            seq_lens: Vec::with_capacity(b),
            block_tables: Vec::with_capacity(b * width),
            width,
            indptr: Vec::with_capacity(b + 1),
            indices: Vec::with_capacity(nnz as usize),
            last_page_len: Vec::with_capacity(b),
            slot_mapping: Vec::with_capacity(t_len),
        };
        out.query_start_loc.push(0);
        out.indptr.push(0);
        let caching = self.alloc.enable_prefix_caching();
        for (&p, &n) in pos.iter().zip(ns) {
            let s = &mut self.seqs[p as usize];
            let (start, end) = (s.computed as u64, s.computed as u64 + n);
            for q in start..end {
                out.input_ids.push(i64::from(s.tokens[q as usize]));
                out.positions.push(q as i64);
                let blk = u64::from(s.blocks[bs.div(q) as usize]);
                out.slot_mapping.push((blk * bs.size + bs.rem(q)) as i64);
            }
            out.query_start_loc.push(out.input_ids.len() as i32);
            out.seq_lens.push(end as i32);
            let nb = bs.blocks(end) as usize;
            let row = &s.blocks[..nb];
            out.block_tables.extend(row.iter().map(|&blk| blk as i32));
            out.block_tables.resize(out.block_tables.len() + width - nb, -1);
            out.indices.extend(row.iter().map(|&blk| blk as i32));
            out.indptr.push(out.indices.len() as i32);
            out.last_page_len.push(if end > 0 {
                (end - (nb as u64 - 1) * bs.size) as i32
            } else {
                0
            });
            s.computed = end as usize;
            if caching {
                register_full_blocks(&mut self.alloc, s, bs);
            }
        }
        Ok(out)
    }

    fn seq_ok(&self, p: usize) -> bool {
        let s = &self.seqs[p];
        s.blocks.len() as u64 == blocks_for(s.tokens.len() as u64, self.block_size()) && s.computed <= s.tokens.len()
    }

    /// Err names the first broken invariant (I1-I5).
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.alloc.check_invariants()?;
        let mut held: MixMap<u32, u64> = MixMap::default();
        for s in &self.seqs {
            if s.blocks.len() as u64 != blocks_for(s.tokens.len() as u64, self.block_size()) {
                return Err("I5 blocks per sequence".into());
            }
            if s.computed > s.tokens.len() {
                return Err("I5 computed <= tokens".into());
            }
            for &b in &s.blocks {
                *held.entry(b).or_insert(0) += 1;
            }
        }
        for b in 0..self.alloc.num_blocks() as u32 {
            if u64::from(self.alloc.ref_of(b)) != held.get(&b).copied().unwrap_or(0) {
                return Err(format!("I2 block {b}"));
            }
        }
        if self.index.len() != self.seqs.len()
            || self
                .index
                .iter()
                .any(|(&id, &p)| self.seqs.get(p as usize).map(|s| s.id) != Some(id))
        {
            return Err("I5 sequence index".into());
        }
        Ok(())
    }
}

/// Hash newly full computed blocks of `s` into the prefix cache (chained on the previous one).
fn register_full_blocks(alloc: &mut BlockAllocator, s: &mut Seq, bs: Bs) {
    let full = bs.div(s.computed as u64) as usize;
    if s.hashes.len() >= full {
        return;
    }
    let bs = bs.size as usize;
    for j in s.hashes.len()..full {
        let parent = s.hashes.last().copied().unwrap_or(0);
        let salt: &[u8] = if j == 0 { &s.salt } else { &[] };
        let h = alloc.cache(s.blocks[j], parent, salt, &s.tokens[j * bs..(j + 1) * bs]);
        s.hashes.push(h);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mgr(n: usize, bs: usize, bits: u32) -> KVCacheManager {
        KVCacheManager::new(n, bs, true, Policy::Lru, bits, None).unwrap()
    }

    type Snapshot = (Vec<u32>, Vec<(u64, Vec<u32>, Vec<u32>, usize)>, ManagerStats);

    /// Everything observable, to show a refused call changed nothing.
    fn snapshot(m: &KVCacheManager) -> Snapshot {
        let seqs = m
            .seq_ids()
            .into_iter()
            .map(|s| {
                let (b, t) = (m.block_table(s).unwrap().to_vec(), m.token_ids(s).unwrap().to_vec());
                (s, b, t, m.num_computed_tokens(s).unwrap())
            })
            .collect();
        (m.allocator().free_order(), seqs, m.stats())
    }

    #[test]
    fn prepare_batch_builds_tables_csr_and_slots() {
        let mut m = mgr(8, 4, 128);
        assert_eq!(m.allocate(7, (10..16).collect(), b"").unwrap(), 0);
        assert_eq!(m.allocate(3, vec![1, 2], b"").unwrap(), 0);
        let b = m.prepare_batch(&[7, 3], Some(&[6, 1])).unwrap();
        assert_eq!(b.input_ids, vec![10, 11, 12, 13, 14, 15, 1]);
        assert_eq!(b.positions, vec![0, 1, 2, 3, 4, 5, 0]);
        assert_eq!(b.query_start_loc, vec![0, 6, 7]);
        assert_eq!(b.seq_lens, vec![6, 1]);
        assert_eq!((b.width, b.block_tables.clone()), (2, vec![0, 1, 2, -1]));
        assert_eq!(b.indptr, vec![0, 2, 3]);
        assert_eq!(b.indices, vec![0, 1, 2]);
        assert_eq!(b.last_page_len, vec![2, 1]);
        assert_eq!(b.slot_mapping, vec![0, 1, 2, 3, 4, 5, 8]);
        // The full computed block of seq 7 entered the prefix cache.
        assert!(m.allocator().block_hash(0).unwrap().is_some());
        assert_eq!(m.allocator().block_hash(1).unwrap(), None);
        let empty = m.prepare_batch(&[], None).unwrap();
        assert_eq!(
            (empty.width, empty.query_start_loc.clone(), empty.indptr.clone()),
            (0, vec![0], vec![0])
        );
        let again = m.prepare_batch(&[3], None).unwrap();
        assert_eq!(
            (again.seq_lens.clone(), again.last_page_len.clone()),
            (vec![1], vec![1])
        );
        m.check_invariants().unwrap();
    }

    #[test]
    fn truncate_releases_blocks_and_unregisters_rejected_tokens() {
        let mut m = mgr(8, 4, 128);
        m.allocate(1, (0..5).collect(), b"").unwrap();
        m.prepare_batch(&[1], Some(&[5])).unwrap();
        m.append(1, &[50, 51, 52, 53, 54]).unwrap(); // 10 tokens, 3 blocks
        m.prepare_batch(&[1], Some(&[5])).unwrap();
        let table = m.block_table(1).unwrap().to_vec();
        assert!(m.allocator().block_hash(table[1].into()).unwrap().is_some());
        let before = snapshot(&m);
        assert!(m.truncate(1, 0).is_err());
        assert!(m.truncate(1, 11).is_err());
        assert!(m.truncate(9, 3).is_err());
        assert_eq!(snapshot(&m), before);
        m.truncate(1, 6).unwrap();
        assert_eq!(m.token_ids(1).unwrap(), &[0, 1, 2, 3, 4, 50]);
        assert_eq!(m.block_table(1).unwrap(), &table[..2]);
        assert_eq!(m.num_computed_tokens(1).unwrap(), 6);
        // Block 0 stays registered; block 1 (now partial) and the released block 2 hold no hash.
        assert!(m.allocator().block_hash(table[0].into()).unwrap().is_some());
        assert_eq!(m.allocator().block_hash(table[1].into()).unwrap(), None);
        assert_eq!(m.allocator().block_hash(table[2].into()).unwrap(), None);
        assert_eq!(m.allocator().num_cached_blocks(), 0);
        assert_eq!(m.allocator().num_free_blocks(), 6);
        m.check_invariants().unwrap();
        // A forked sibling keeps the shared block's hash.
        m.append(1, &[60, 61]).unwrap();
        m.prepare_batch(&[1], Some(&[2])).unwrap();
        m.fork(1, 2).unwrap();
        m.truncate(1, 5).unwrap();
        assert!(m.allocator().block_hash(table[1].into()).unwrap().is_some());
        m.check_invariants().unwrap();
    }

    #[test]
    fn i6_prefix_hit_shares_blocks_and_leaves_a_token() {
        let mut m = mgr(16, 4, 128);
        let prompt: Vec<u32> = (0..9).collect();
        m.allocate(1, prompt.clone(), b"").unwrap();
        m.prepare_batch(&[1], Some(&[9])).unwrap();
        // Same 8 leading tokens: two full blocks hit.
        let mut p2 = prompt[..8].to_vec();
        p2.push(99);
        assert_eq!(m.blocks_needed(&p2, b""), 1);
        assert_eq!(m.allocate(2, p2, b"").unwrap(), 8);
        assert_eq!(m.block_table(2).unwrap()[..2], m.block_table(1).unwrap()[..2]);
        assert_eq!(m.allocator().ref_count(0).unwrap(), 2);
        assert_eq!(m.num_computed_tokens(2).unwrap(), 8);
        // Exactly the 8 cached tokens: only one block may hit (I6).
        assert_eq!(m.allocate(3, prompt[..8].to_vec(), b"").unwrap(), 4);
        // Another salt misses.
        assert_eq!(m.allocate(4, prompt.clone(), b"s").unwrap(), 0);
        let s = m.stats();
        assert_eq!((s.prefix_query_tokens, s.prefix_hit_tokens), (9 + 9 + 8 + 9, 12));
        m.check_invariants().unwrap();
    }

    #[test]
    fn fork_then_append_copies_the_shared_partial_block() {
        let mut m = mgr(8, 4, 128);
        m.allocate(1, vec![1, 2, 3, 4, 5], b"").unwrap();
        m.fork(1, 2).unwrap();
        assert_eq!(m.allocator().ref_count(1).unwrap(), 2);
        assert_eq!(m.blocks_needed_to_append(2, 1).unwrap(), 1);
        let pairs = m.append(2, &[6]).unwrap();
        assert_eq!(pairs, vec![(1, 2)]);
        assert_eq!(m.block_table(2).unwrap(), &[0, 2]);
        assert_eq!(m.allocator().ref_count(1).unwrap(), 1);
        // The parent's last block is now its own: no copy.
        assert_eq!(m.append(1, &[6]).unwrap(), vec![]);
        assert!(matches!(m.fork(1, 2), Err(Error::DuplicateSequence(2))));
        assert!(matches!(m.fork(9, 3), Err(Error::UnknownSequence(_))));
        m.check_invariants().unwrap();
        m.free(1).unwrap();
        m.free(2).unwrap();
        assert_eq!(m.allocator().num_live_blocks(), 0);
        m.check_invariants().unwrap();
    }

    #[test]
    fn free_releases_tail_first() {
        let mut m = mgr(4, 2, 128);
        m.allocate(1, vec![1, 2, 3, 4, 5], b"").unwrap();
        m.free(1).unwrap();
        assert_eq!(m.allocator().free_order(), vec![3, 2, 1, 0]);
        assert!(matches!(m.free(1), Err(Error::UnknownSequence(_))));
    }

    #[test]
    fn refused_calls_change_nothing() {
        let mut m = KVCacheManager::new(6, 2, true, Policy::Lru, 128, Some(9)).unwrap();
        m.allocate(1, vec![1, 2, 3, 4, 5], b"").unwrap();
        m.allocate(2, vec![4, 5], b"").unwrap();
        m.fork(2, 3).unwrap();
        let before = snapshot(&m);
        // 4 blocks live, 2 free.
        assert!(matches!(
            m.allocate(4, vec![9; 5], b""),
            Err(Error::OutOfBlocks { need: 3, free: 2 })
        ));
        assert!(matches!(m.append_batch(&[1, 1], &[0, 0]), Err(Error::Invalid(_))));
        assert!(matches!(
            m.append_batch(&[1, 7], &[0, 0]),
            Err(Error::UnknownSequence(_))
        ));
        assert!(matches!(
            m.append(1, &[0; 5]),
            Err(Error::SequenceTooLong { len: 10, limit: 9, .. })
        ));
        assert!(matches!(
            m.append(2, &[0; 5]),
            Err(Error::OutOfBlocks { need: 3, free: 2 })
        ));
        assert!(matches!(m.allocate(2, vec![1], b""), Err(Error::DuplicateSequence(2))));
        assert!(matches!(m.allocate(5, vec![], b""), Err(Error::Invalid(_))));
        assert!(matches!(m.prepare_batch(&[1], Some(&[6])), Err(Error::Invalid(_))));
        assert!(matches!(m.prepare_batch(&[1, 1], None), Err(Error::Invalid(_))));
        assert_eq!(snapshot(&m), before);
        // Exactly enough: seqs 2 and 3 each open a block, seq 1 fills its last one.
        assert_eq!(m.append_batch(&[1, 2, 3], &[7, 7, 7]).unwrap(), vec![]);
        assert_eq!(m.allocator().num_reclaimable(), 0);
        assert!(!m.can_allocate(&[1], b""));
        assert!(!m.can_append(1, 1).unwrap() && m.can_append(1, 0).unwrap());
        m.check_invariants().unwrap();
    }

    #[test]
    fn i6_few_hash_bits_never_share_blocks_with_other_content() {
        // With 1-4 hash bits almost every lookup collides; key verification must keep every
        // shared block's registered tokens equal to the prompt's tokens at that position.
        for bits in 1..=4u32 {
            let mut m = mgr(400, 2, bits);
            let mut x: u32 = 12345;
            let mut next = || {
                x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
                (x >> 16) % 3
            };
            for id in 0..60u64 {
                let len = 2 + (next() * 3 + next()) as usize;
                let toks: Vec<u32> = (0..len).map(|_| next()).collect();
                let hit = m.allocate(id, toks.clone(), b"").unwrap();
                let table = m.block_table(id).unwrap().to_vec();
                for (j, &b) in table[..hit / 2].iter().enumerate() {
                    let key = m.alloc.registered_tokens(b).expect("a hit block is registered");
                    assert_eq!(key, &toks[2 * j..2 * j + 2], "bits {bits} seq {id} block {j}");
                }
                m.prepare_batch(&[id], Some(&[(len - hit) as u64])).unwrap();
                if id % 3 == 0 {
                    m.free(id).unwrap();
                }
            }
            m.check_invariants().unwrap();
        }
    }

    #[test]
    fn check_invariants_names_i2_and_i5() {
        let mut m = mgr(4, 2, 128);
        m.allocate(1, vec![1, 2, 3], b"").unwrap();
        m.seqs[0].computed = 9;
        assert!(m.check_invariants().unwrap_err().starts_with("I5"));
        m.seqs[0].computed = 0;
        m.seqs[0].blocks.swap(0, 1);
        m.check_invariants().unwrap();
        m.seqs[0].blocks[1] = 3;
        assert!(m.check_invariants().unwrap_err().starts_with("I2"));
    }

    #[test]
    fn non_power_of_two_block_size() {
        let mut m = mgr(10, 3, 128);
        m.allocate(1, (0..7).collect(), b"").unwrap();
        let b = m.prepare_batch(&[1], Some(&[7])).unwrap();
        assert_eq!(b.slot_mapping, vec![0, 1, 2, 3, 4, 5, 6]);
        assert_eq!((b.width, b.last_page_len.clone()), (3, vec![1]));
        assert_eq!(m.blocks_needed_to_append(1, 3).unwrap(), 1);
        assert_eq!(m.blocks_needed_to_append(1, 2).unwrap(), 0);
        m.check_invariants().unwrap();
    }
}
