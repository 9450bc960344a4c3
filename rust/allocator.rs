//! Physical block pool: ref counts, an O(1) intrusive free list, and the prefix-hash index.
//!
//! Port of `pagedkv_rs.fallback.BlockAllocator` (the spec: same arithmetic, same order of
//! blocks handed out, same hashes). Invariant tags I1..I4 are those of the fallback docstring.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

/// Block ids are int32 on the kernel side; larger pools are a configuration mistake.
pub const MAX_NUM_BLOCKS: u64 = 1 << 24;
pub const MAX_BLOCK_SIZE: u64 = 1 << 16;
pub const MAX_TOKEN_ID: u64 = u32::MAX as u64;

/// A small multiply-xorshift hasher for integer keys (seq ids, SHA-256 prefixes).
#[derive(Default, Clone, Copy)]
pub struct MixHasher(u64);

impl Hasher for MixHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u64(&mut self, x: u64) {
        self.0 = (self.0.rotate_left(5) ^ x).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
    fn write_u128(&mut self, x: u128) {
        self.write_u64(x as u64);
        self.write_u64((x >> 64) as u64);
    }
    fn finish(&self) -> u64 {
        let mut z = self.0;
        z ^= z >> 33;
        z = z.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
        z ^ (z >> 33)
    }
}

pub type MixMap<K, V> = HashMap<K, V, BuildHasherDefault<MixHasher>>;

/// Which end of the free list `allocate` takes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// The block freed longest ago (evicts cached blocks in LRU order).
    Lru,
    /// The block freed last (warm in CPU caches).
    Mru,
}

impl Policy {
    pub fn parse(s: &str) -> Option<Policy> {
        match s {
            "lru" => Some(Policy::Lru),
            "mru" => Some(Policy::Mru),
            _ => None,
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            Policy::Lru => "lru",
            Policy::Mru => "mru",
        }
    }
}

/// What each registered block was hashed from (a lookup must match all of it: collision
/// check), in fixed-size slots of one vector: `[hash, parent, tokens]` as u32 words, so
/// registering a block allocates nothing once the store has grown. Salts (first blocks
/// only, usually empty) live in a side map.
#[derive(Debug)]
struct KeyStore {
    /// Per block: its slot, or `NONE`.
    slot_of: Vec<u32>,
    words: usize,
    data: Vec<u32>,
    free: Vec<u32>,
    salts: MixMap<u32, Box<[u8]>>,
}

const NONE: u32 = u32::MAX;

fn put_u128(dst: &mut [u32], x: u128) {
    for (i, w) in dst[..4].iter_mut().enumerate() {
        *w = (x >> (32 * i)) as u32;
    }
}

fn get_u128(src: &[u32]) -> u128 {
    src[..4]
        .iter()
        .enumerate()
        .fold(0, |acc, (i, &w)| acc | (u128::from(w) << (32 * i)))
}

impl KeyStore {
    fn new(num_blocks: usize, block_size: usize) -> KeyStore {
        KeyStore {
            slot_of: vec![NONE; num_blocks],
            words: 8 + block_size,
            data: Vec::new(),
            free: Vec::new(),
            salts: MixMap::default(),
        }
    }

    fn has(&self, b: u32) -> bool {
        self.slot_of[b as usize] != NONE
    }

    fn slot(&self, b: u32) -> Option<&[u32]> {
        let s = self.slot_of[b as usize];
        (s != NONE).then(|| &self.data[s as usize * self.words..(s as usize + 1) * self.words])
    }

    fn hash(&self, b: u32) -> Option<u128> {
        self.slot(b).map(get_u128)
    }

    #[cfg(test)]
    fn tokens(&self, b: u32) -> Option<&[u32]> {
        self.slot(b).map(|w| &w[8..])
    }

    fn insert(&mut self, b: u32, hash: u128, parent: u128, salt: &[u8], toks: &[u32]) {
        debug_assert!(toks.len() + 8 == self.words && !self.has(b), "I4 bad key insert");
        let s = match self.free.pop() {
            Some(s) => s,
            None => {
                self.data.resize(self.data.len() + self.words, 0);
                (self.data.len() / self.words - 1) as u32
            }
        };
        let w = &mut self.data[s as usize * self.words..(s as usize + 1) * self.words];
        put_u128(&mut w[..4], hash);
        put_u128(&mut w[4..8], parent);
        w[8..].copy_from_slice(toks);
        if !salt.is_empty() {
            self.salts.insert(s, salt.into());
        }
        self.slot_of[b as usize] = s;
    }

    /// Forget a block's key; returns its hash.
    fn remove(&mut self, b: u32) -> Option<u128> {
        let h = self.hash(b)?;
        let s = std::mem::replace(&mut self.slot_of[b as usize], NONE);
        if !self.salts.is_empty() {
            self.salts.remove(&s);
        }
        self.free.push(s);
        Some(h)
    }

    fn matches(&self, b: u32, parent: u128, salt: &[u8], toks: &[u32]) -> bool {
        let Some(w) = self.slot(b) else { return false };
        let stored_salt = self.salts.get(&self.slot_of[b as usize]).map_or(&[][..], |s| &s[..]);
        get_u128(&w[4..8]) == parent && &w[8..] == toks && stored_salt == salt
    }

    /// Forget every key; `blocks` are all blocks that hold one.
    fn clear(&mut self, blocks: impl Iterator<Item = u32>) {
        for b in blocks {
            self.slot_of[b as usize] = NONE;
        }
        self.data.clear();
        self.free.clear();
        self.salts.clear();
    }

    fn count(&self) -> usize {
        self.data.len() / self.words - self.free.len()
    }
}

/// Counters reported by `stats()`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AllocStats {
    pub num_blocks: usize,
    pub block_size: usize,
    pub free_blocks: usize,
    pub cached_blocks: usize,
    pub live_blocks: usize,
    pub usage: f64,
    pub evictions: u64,
    /// Blocks handed out by `allocate` (and the allocations inside block tables) since creation.
    pub block_allocations: u64,
}

/// `ceil(num_tokens / block_size)`.
pub fn blocks_for(num_tokens: u64, block_size: usize) -> u64 {
    num_tokens.div_ceil(block_size as u64)
}

/// Chained prefix hash: SHA-256 of parent (16 B LE) || len(salt) (u32 LE) || salt ||
/// tokens (u32 LE each), first 16 digest bytes as a little-endian u128, ANDed with `mask`.
pub fn prefix_hash(parent: u128, salt: &[u8], toks: &[u32], mask: u128) -> u128 {
    let mut h = Sha256::new();
    h.update(parent.to_le_bytes());
    h.update((salt.len() as u32).to_le_bytes());
    h.update(salt);
    let mut buf = [0u8; 256];
    for chunk in toks.chunks(64) {
        for (dst, t) in buf.chunks_exact_mut(4).zip(chunk) {
            dst.copy_from_slice(&t.to_le_bytes());
        }
        h.update(&buf[..4 * chunk.len()]);
    }
    let digest = h.finalize();
    let mut lo = [0u8; 16];
    lo.copy_from_slice(&digest[..16]);
    u128::from_le_bytes(lo) & mask
}

/// One change to the prefix-cache index, in the order it happened (the KV-events log).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheEvent {
    /// A full block was registered under `hash` (parent 0 = first block; the salt is the key's).
    Stored {
        hash: u128,
        parent: u128,
        salt: Vec<u8>,
        tokens: Vec<u32>,
    },
    /// A cached block was reused for new data: its hash left the index.
    Removed { hash: u128 },
    /// `reset_prefix_cache` dropped every hash.
    Cleared,
}

#[derive(Debug)]
pub struct BlockAllocator {
    num_blocks: usize,
    block_size: usize,
    caching: bool,
    policy: Policy,
    hash_bits: u32,
    mask: u128,
    refs: Vec<u32>,
    // Free list over nodes 0..n-1 with sentinel n.
    next: Vec<u32>,
    prev: Vec<u32>,
    num_on_list: usize,
    keys: KeyStore,
    index: MixMap<u128, u32>,
    num_cached: usize,
    evictions: u64,
    allocations: u64,
    // None until `enable_events`: the log costs one branch when off.
    events: Option<Vec<CacheEvent>>,
}

impl BlockAllocator {
    pub fn new(num_blocks: usize, block_size: usize, caching: bool, policy: Policy, hash_bits: u32) -> Result<Self> {
        if !(1..=MAX_NUM_BLOCKS).contains(&(num_blocks as u64)) {
            return Err(Error::Invalid(format!(
                "num_blocks must be in [1, {MAX_NUM_BLOCKS}], got {num_blocks}"
            )));
        }
        if !(1..=MAX_BLOCK_SIZE).contains(&(block_size as u64)) {
            return Err(Error::Invalid(format!(
                "block_size must be in [1, {MAX_BLOCK_SIZE}], got {block_size}"
            )));
        }
        if !(1..=128).contains(&hash_bits) {
            return Err(Error::Invalid(format!(
                "hash_bits must be in [1, 128], got {hash_bits}"
            )));
        }
        let n = num_blocks;
        let s = n as u32;
        let mut next = vec![0u32; n + 1];
        let mut prev = vec![0u32; n + 1];
        // Initial order makes both policies hand out block 0 first.
        let mut last = s;
        let mut link = |b: u32| {
            next[last as usize] = b;
            prev[b as usize] = last;
            last = b;
        };
        match policy {
            Policy::Lru => (0..s).for_each(&mut link),
            Policy::Mru => (0..s).rev().for_each(&mut link),
        }
        next[last as usize] = s;
        prev[n] = last;
        let mask = if hash_bits == 128 {
            u128::MAX
        } else {
            (1u128 << hash_bits) - 1
        };
        Ok(BlockAllocator {
            num_blocks: n,
            block_size,
            caching,
            policy,
            hash_bits,
            mask,
            refs: vec![0; n],
            next,
            prev,
            num_on_list: n,
            keys: KeyStore::new(n, block_size),
            index: MixMap::default(),
            num_cached: 0,
            evictions: 0,
            allocations: 0,
            events: None,
        })
    }

    // ------------------------------------------------------------------ properties
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }
    pub fn block_size(&self) -> usize {
        self.block_size
    }
    pub fn enable_prefix_caching(&self) -> bool {
        self.caching
    }
    pub fn policy(&self) -> Policy {
        self.policy
    }
    pub fn hash_bits(&self) -> u32 {
        self.hash_bits
    }
    /// Largest hash value: `2**hash_bits - 1`.
    pub fn mask(&self) -> u128 {
        self.mask
    }
    /// Blocks with ref count 0 and no prefix hash.
    pub fn num_free_blocks(&self) -> usize {
        self.num_on_list - self.num_cached
    }
    /// Blocks with ref count 0 that still hold a prefix hash (reclaimable).
    pub fn num_cached_blocks(&self) -> usize {
        self.num_cached
    }
    pub fn num_live_blocks(&self) -> usize {
        self.num_blocks - self.num_on_list
    }
    /// Free plus cached: what `allocate` can hand out.
    pub fn num_reclaimable(&self) -> usize {
        self.num_on_list
    }
    pub fn num_evictions(&self) -> u64 {
        self.evictions
    }
    /// Fraction of blocks that are live.
    pub fn usage(&self) -> f64 {
        self.num_live_blocks() as f64 / self.num_blocks as f64
    }

    pub fn stats(&self) -> AllocStats {
        AllocStats {
            num_blocks: self.num_blocks,
            block_size: self.block_size,
            free_blocks: self.num_free_blocks(),
            cached_blocks: self.num_cached,
            live_blocks: self.num_live_blocks(),
            usage: self.usage(),
            evictions: self.evictions,
            block_allocations: self.allocations,
        }
    }

    // --------------------------------------------------------------- free list (O(1))
    fn unlink(&mut self, b: u32) {
        let (p, nx) = (self.prev[b as usize], self.next[b as usize]);
        self.next[p as usize] = nx;
        self.prev[nx as usize] = p;
        self.num_on_list -= 1;
    }

    fn push_tail(&mut self, b: u32) {
        let s = self.num_blocks;
        let last = self.prev[s];
        self.next[last as usize] = b;
        self.prev[b as usize] = last;
        self.next[b as usize] = s as u32;
        self.prev[s] = b;
        self.num_on_list += 1;
    }

    fn pop(&mut self) -> u32 {
        let s = self.num_blocks;
        let b = match self.policy {
            Policy::Lru => self.next[s],
            Policy::Mru => self.prev[s],
        };
        debug_assert!((b as usize) < s, "I1 pop from an empty free list");
        self.unlink(b);
        b
    }

    pub(crate) fn drop_hash(&mut self, b: u32) {
        if let Some(h) = self.keys.remove(b) {
            self.index.remove(&h);
            if let Some(log) = &mut self.events {
                log.push(CacheEvent::Removed { hash: h });
            }
        }
    }

    /// Start logging prefix-cache changes (registrations, evictions, resets) for `take_events`.
    pub fn enable_events(&mut self) {
        self.events.get_or_insert_with(Vec::new);
    }

    /// The changes logged since the last call, oldest first (empty when events are off).
    pub fn take_events(&mut self) -> Vec<CacheEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Validate a block id.
    pub fn check_block(&self, b: u64) -> Result<u32> {
        if b < self.num_blocks as u64 {
            Ok(b as u32)
        } else {
            Err(Error::Invalid(format!(
                "block id must be in [0, {}], got {b}",
                self.num_blocks - 1
            )))
        }
    }

    fn check_blocks(&self, ids: &[u32]) -> Result<()> {
        ids.iter().try_for_each(|&b| self.check_block(u64::from(b)).map(drop))
    }

    // ------------------------------------------------------------------ public API
    /// Hand out `k` fresh blocks (ref count 1), evicting cached ones as needed.
    pub fn allocate(&mut self, k: usize) -> Result<Vec<u32>> {
        self.check_available(k as u64)?;
        let mut out = Vec::with_capacity(k);
        self.take(k, &mut out);
        Ok(out)
    }

    pub(crate) fn check_available(&self, need: u64) -> Result<()> {
        if need > self.num_on_list as u64 {
            return Err(Error::OutOfBlocks {
                need,
                free: self.num_on_list as u64,
            });
        }
        Ok(())
    }

    /// Take `k` blocks off the free list into `out`; the caller checked availability.
    pub(crate) fn take(&mut self, k: usize, out: &mut Vec<u32>) {
        debug_assert!(k <= self.num_on_list, "I1 take more than the free list holds");
        self.allocations += k as u64;
        for _ in 0..k {
            let b = self.pop();
            if self.keys.has(b) {
                self.drop_hash(b);
                self.num_cached -= 1;
                self.evictions += 1;
            }
            debug_assert!(self.refs[b as usize] == 0, "I3 a live block was on the free list");
            self.refs[b as usize] = 1;
            out.push(b);
        }
    }

    /// Add a reference to each block; a cached block is taken back off the free list.
    pub fn incref(&mut self, ids: &[u32]) -> Result<()> {
        self.check_blocks(ids)?;
        for &b in ids {
            if self.refs[b as usize] == 0 && !self.keys.has(b) {
                return Err(Error::Invalid(format!(
                    "block {b} is free and holds no prefix hash; allocate it instead"
                )));
            }
        }
        // Overflow is unreachable in practice (4e9 holders of one block) but must not wrap.
        let room = u64::from(u32::MAX) - ids.len() as u64;
        if ids.iter().any(|&b| u64::from(self.refs[b as usize]) > room) {
            for (i, &b) in ids.iter().enumerate() {
                let times = ids[..=i].iter().filter(|&&x| x == b).count() as u64;
                if u64::from(self.refs[b as usize]) + times > u64::from(u32::MAX) {
                    return Err(Error::Invalid(format!("block {b}: ref count overflow")));
                }
            }
        }
        self.incref_unchecked(ids);
        Ok(())
    }

    pub(crate) fn incref_unchecked(&mut self, ids: &[u32]) {
        for &b in ids {
            if self.refs[b as usize] == 0 {
                debug_assert!(self.keys.has(b), "I4 incref of a free unhashed block");
                self.unlink(b);
                self.num_cached -= 1;
            }
            self.refs[b as usize] += 1;
        }
    }

    /// Drop one reference per listed block; blocks reaching 0 join the free-list tail in list order.
    pub fn free(&mut self, ids: &[u32]) -> Result<()> {
        self.check_blocks(ids)?;
        // Dry run on the ref counts themselves: the first drop below zero is the double free.
        let bad = ids.iter().position(|&b| {
            let r = &mut self.refs[b as usize];
            let ok = *r > 0;
            *r = r.wrapping_sub(u32::from(ok));
            !ok
        });
        let done = bad.unwrap_or(ids.len());
        for &b in &ids[..done] {
            self.refs[b as usize] += 1;
        }
        if let Some(i) = bad {
            let b = ids[i];
            return Err(Error::DoubleFree {
                block: b,
                times: self.refs[b as usize] + 1,
                ref_count: self.refs[b as usize],
            });
        }
        self.release(ids.iter().copied());
        Ok(())
    }

    pub(crate) fn release(&mut self, ids: impl Iterator<Item = u32>) {
        for b in ids {
            debug_assert!(self.refs[b as usize] > 0, "I2 release of a block with ref count 0");
            self.refs[b as usize] -= 1;
            if self.refs[b as usize] == 0 {
                self.push_tail(b);
                if self.keys.has(b) {
                    self.num_cached += 1;
                }
            }
        }
    }

    /// Current reference count of a block.
    pub fn ref_count(&self, b: u64) -> Result<u32> {
        Ok(self.refs[self.check_block(b)? as usize])
    }

    /// The tokens a block is registered with (tests check what a prefix hit shares).
    #[cfg(test)]
    pub(crate) fn registered_tokens(&self, b: u32) -> Option<&[u32]> {
        self.keys.tokens(b)
    }

    pub(crate) fn ref_of(&self, b: u32) -> u32 {
        self.refs[b as usize]
    }

    /// Blocks with ref count 0, in the order `allocate` would hand them out.
    pub fn free_order(&self) -> Vec<u32> {
        let s = self.num_blocks as u32;
        let step = match self.policy {
            Policy::Lru => &self.next,
            Policy::Mru => &self.prev,
        };
        let mut out = Vec::with_capacity(self.num_on_list);
        let mut b = step[s as usize];
        while b != s && out.len() <= self.num_blocks {
            out.push(b);
            b = step[b as usize];
        }
        out
    }

    pub fn hash_of(&self, parent: u128, salt: &[u8], toks: &[u32]) -> u128 {
        prefix_hash(parent, salt, toks, self.mask)
    }

    fn check_parent(&self, parent: u128) -> Result<()> {
        if parent > self.mask {
            return Err(Error::Invalid(format!(
                "parent_hash must be in [0, {}], got {parent}",
                self.mask
            )));
        }
        Ok(())
    }

    /// The prefix hash a block is registered under, or None.
    pub fn block_hash(&self, b: u64) -> Result<Option<u128>> {
        let b = self.check_block(b)?;
        Ok(self.keys.hash(b))
    }

    /// Register a live, full block under its chained hash; returns the hash.
    ///
    /// The first block registered under a hash keeps it; a later one stays unregistered.
    pub fn cache_block(&mut self, b: u64, parent: u128, salt: &[u8], toks: &[u32]) -> Result<u128> {
        let b = self.check_block(b)?;
        if toks.len() != self.block_size {
            return Err(Error::Invalid(format!(
                "a cached block holds {} tokens, got {}",
                self.block_size,
                toks.len()
            )));
        }
        self.check_live(b)?;
        self.check_parent(parent)?;
        Ok(self.cache(b, parent, salt, toks))
    }

    pub(crate) fn check_live(&self, b: u32) -> Result<()> {
        if self.refs[b as usize] == 0 {
            return Err(Error::Invalid(format!("block {b} is not live")));
        }
        Ok(())
    }

    pub(crate) fn cache(&mut self, b: u32, parent: u128, salt: &[u8], toks: &[u32]) -> u128 {
        let h = self.hash_of(parent, salt, toks);
        if self.caching && !self.keys.has(b) && !self.index.contains_key(&h) {
            self.index.insert(h, b);
            self.keys.insert(b, h, parent, salt, toks);
            if let Some(log) = &mut self.events {
                log.push(CacheEvent::Stored {
                    hash: h,
                    parent,
                    salt: salt.to_vec(),
                    tokens: toks.to_vec(),
                });
            }
        }
        debug_assert!(self.index.len() <= self.num_blocks, "I4 more hashes than blocks");
        h
    }

    /// The block registered for exactly these (parent, salt, tokens), or None. Changes nothing.
    pub fn lookup(&self, parent: u128, salt: &[u8], toks: &[u32]) -> Result<Option<u32>> {
        self.check_parent(parent)?;
        Ok(self.lookup_hash(parent, salt, toks).0)
    }

    /// Lookup plus the query's hash; a hash hit with different content is a miss.
    pub(crate) fn lookup_hash(&self, parent: u128, salt: &[u8], toks: &[u32]) -> (Option<u32>, u128) {
        let h = self.hash_of(parent, salt, toks);
        let hit = if self.caching {
            self.index.get(&h).copied()
        } else {
            None
        };
        let hit = hit.filter(|&b| self.keys.matches(b, parent, salt, toks));
        (hit, h)
    }

    /// Forget every prefix hash (cached blocks become plain free blocks); returns how many.
    pub fn reset_prefix_cache(&mut self) -> usize {
        let dropped = self.index.len();
        self.keys.clear(self.index.drain().map(|(_, b)| b));
        self.num_cached = 0;
        if let Some(log) = &mut self.events {
            log.push(CacheEvent::Cleared);
        }
        dropped
    }

    /// Err names the first broken invariant (I1, I3, I4).
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let on_list = self.free_order();
        if on_list.len() != self.num_on_list {
            return Err("I3 free list length".into());
        }
        if on_list.iter().any(|&b| self.refs[b as usize] != 0) {
            return Err("I3 free list holds a live block".into());
        }
        if self.refs.iter().filter(|&&r| r == 0).count() != on_list.len() {
            return Err("I3 ref-0 block off the free list".into());
        }
        let cached = on_list.iter().filter(|&&b| self.keys.has(b)).count();
        if cached != self.num_cached {
            return Err("I1 cached count".into());
        }
        let live = self.refs.iter().filter(|&&r| r > 0).count();
        if self.num_free_blocks() + cached + live != self.num_blocks {
            return Err("I1".into());
        }
        let index_ok = self.index.iter().all(|(&h, &b)| self.keys.hash(b) == Some(h));
        if !index_ok {
            return Err("I4 index -> block".into());
        }
        let registered = self.keys.slot_of.iter().filter(|&&s| s != NONE).count();
        if registered != self.index.len() || registered != self.keys.count() {
            return Err("I4 block -> index".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(n: usize, bs: usize, policy: Policy, bits: u32) -> BlockAllocator {
        BlockAllocator::new(n, bs, true, policy, bits).unwrap()
    }

    #[test]
    fn lru_hands_out_block_0_first_and_oldest_freed_next() {
        let mut a = pool(4, 2, Policy::Lru, 128);
        assert_eq!(a.free_order(), vec![0, 1, 2, 3]);
        assert_eq!(a.allocate(3).unwrap(), vec![0, 1, 2]);
        a.free(&[2, 0]).unwrap();
        assert_eq!(a.free_order(), vec![3, 2, 0]);
        assert_eq!(a.allocate(2).unwrap(), vec![3, 2]);
        a.check_invariants().unwrap();
    }

    #[test]
    fn mru_hands_out_block_0_first_and_last_freed_next() {
        let mut a = pool(4, 2, Policy::Mru, 128);
        assert_eq!(a.free_order(), vec![0, 1, 2, 3]);
        assert_eq!(a.allocate(3).unwrap(), vec![0, 1, 2]);
        a.free(&[2, 0]).unwrap();
        assert_eq!(a.free_order(), vec![0, 2, 3]);
        assert_eq!(a.allocate(1).unwrap(), vec![0]);
        a.check_invariants().unwrap();
    }

    #[test]
    fn out_of_blocks_changes_nothing() {
        let mut a = pool(3, 2, Policy::Lru, 128);
        a.allocate(2).unwrap();
        assert_eq!(a.allocate(2), Err(Error::OutOfBlocks { need: 2, free: 1 }));
        assert_eq!(a.free_order(), vec![2]);
        assert_eq!(a.num_live_blocks(), 2);
    }

    #[test]
    fn i2_ref_counts_and_double_free() {
        let mut a = pool(4, 2, Policy::Lru, 128);
        let b = a.allocate(1).unwrap()[0];
        a.incref(&[b]).unwrap();
        assert_eq!(a.ref_count(b.into()).unwrap(), 2);
        // Three drops of a block held twice: refused as a whole.
        assert!(matches!(
            a.free(&[b, b, b]),
            Err(Error::DoubleFree {
                times: 3,
                ref_count: 2,
                ..
            })
        ));
        assert_eq!(a.ref_count(b.into()).unwrap(), 2);
        a.free(&[b, b]).unwrap();
        assert_eq!(a.ref_count(b.into()).unwrap(), 0);
        assert!(matches!(a.free(&[b]), Err(Error::DoubleFree { .. })));
        // A free block without a hash cannot be increfed (it must be allocated).
        assert!(matches!(a.incref(&[b]), Err(Error::Invalid(_))));
        assert!(matches!(a.ref_count(4), Err(Error::Invalid(_))));
        assert!(matches!(a.free(&[9]), Err(Error::Invalid(_))));
        a.check_invariants().unwrap();
    }

    #[test]
    fn hash_matches_the_fallback_spec_vectors() {
        // Values from pagedkv_rs.fallback.BlockAllocator._hash_of (hashlib).
        assert_eq!(
            prefix_hash(0, b"", &[1, 2, 3], u128::MAX),
            0xe41b66e0b25da0f3dda84b19c7f65e98
        );
        assert_eq!(
            prefix_hash(5, b"salt", &[7; 70], u128::MAX),
            0x9af0fff1346a2dd909e898beb5b3b9df
        );
        assert_eq!(prefix_hash(0, b"", &[], u128::MAX), 0xc332e653c3f2b5db00d3b87eb2c947de);
        assert_eq!(pool(2, 3, Policy::Lru, 7).hash_of(0, b"", &[1, 2, 3]), 24);
    }

    #[test]
    fn i4_cached_block_is_reclaimed_then_evicted() {
        let mut a = pool(3, 2, Policy::Lru, 128);
        let b = a.allocate(1).unwrap()[0];
        let h = a.cache_block(b.into(), 0, b"", &[5, 6]).unwrap();
        assert_eq!(a.block_hash(b.into()).unwrap(), Some(h));
        a.free(&[b]).unwrap();
        assert_eq!((a.num_cached_blocks(), a.num_free_blocks()), (1, 2));
        assert_eq!(a.lookup(0, b"", &[5, 6]).unwrap(), Some(b));
        assert_eq!(a.lookup(0, b"x", &[5, 6]).unwrap(), None);
        a.incref(&[b]).unwrap();
        assert_eq!((a.num_cached_blocks(), a.num_live_blocks()), (0, 1));
        a.free(&[b]).unwrap();
        // LRU: two fresh blocks come first, the cached one is evicted last.
        assert_eq!(a.allocate(3).unwrap(), vec![1, 2, 0]);
        assert_eq!(a.num_evictions(), 1);
        assert_eq!(a.block_hash(0).unwrap(), None);
        assert_eq!(a.lookup(0, b"", &[5, 6]).unwrap(), None);
        a.check_invariants().unwrap();
    }

    #[test]
    fn cache_block_refuses_bad_input_and_keeps_first_owner() {
        let mut a = pool(4, 2, Policy::Lru, 128);
        let ids = a.allocate(2).unwrap();
        assert!(matches!(a.cache_block(3, 0, b"", &[1, 2]), Err(Error::Invalid(_)))); // not live
        assert!(matches!(a.cache_block(0, 0, b"", &[1]), Err(Error::Invalid(_)))); // not full
        let h0 = a.cache_block(ids[0].into(), 0, b"", &[1, 2]).unwrap();
        let h1 = a.cache_block(ids[1].into(), 0, b"", &[1, 2]).unwrap();
        assert_eq!(h0, h1);
        assert_eq!(a.block_hash(ids[1].into()).unwrap(), None);
        assert_eq!(a.reset_prefix_cache(), 1);
        assert_eq!(a.block_hash(ids[0].into()).unwrap(), None);
        a.check_invariants().unwrap();
    }

    #[test]
    fn i4_collisions_with_few_hash_bits_are_rejected_by_key_check() {
        for bits in 1..=4u32 {
            let mut a = pool(8, 2, Policy::Lru, bits);
            let b = a.allocate(1).unwrap()[0];
            let h = a.cache_block(b.into(), 0, b"", &[0, 0]).unwrap();
            let mut collisions = 0;
            for x in 0..40u32 {
                let toks = [x / 8, x % 8 + 1]; // never [0, 0]
                if a.hash_of(0, b"", &toks) == h {
                    collisions += 1;
                    assert_eq!(a.lookup(0, b"", &toks).unwrap(), None, "bits {bits}: {toks:?}");
                }
            }
            assert!(collisions > 0, "bits {bits}: no collision to test");
            assert_eq!(a.lookup(0, b"", &[0, 0]).unwrap(), Some(b));
            assert!(matches!(a.lookup(1 << bits, b"", &[0, 0]), Err(Error::Invalid(_))));
        }
    }

    #[test]
    fn i4_key_slots_are_reused_without_stale_salt() {
        let mut a = pool(2, 2, Policy::Lru, 128);
        let b = a.allocate(2).unwrap();
        a.cache_block(b[0].into(), 0, b"salt", &[1, 2]).unwrap();
        assert_eq!(a.lookup(0, b"salt", &[1, 2]).unwrap(), Some(b[0]));
        assert_eq!(a.lookup(0, b"", &[1, 2]).unwrap(), None);
        a.free(&b).unwrap();
        // Evict the salted block, register its slot again without a salt.
        let c = a.allocate(2).unwrap();
        assert_eq!(a.num_evictions(), 1);
        a.cache_block(c[0].into(), 0, b"", &[1, 2]).unwrap();
        assert_eq!(a.lookup(0, b"", &[1, 2]).unwrap(), Some(c[0]));
        assert_eq!(a.lookup(0, b"salt", &[1, 2]).unwrap(), None);
        a.cache_block(c[1].into(), 7, b"pepper", &[3, 4]).unwrap();
        assert_eq!(a.keys.count(), 2);
        assert_eq!(a.reset_prefix_cache(), 2);
        assert_eq!((a.keys.count(), a.keys.salts.len()), (0, 0));
        a.check_invariants().unwrap();
    }

    #[test]
    fn events_log_registrations_evictions_and_resets_in_order() {
        let mut a = pool(2, 2, Policy::Lru, 128);
        let b = a.allocate(1).unwrap()[0];
        a.cache_block(b.into(), 0, b"", &[1, 2]).unwrap();
        assert!(a.take_events().is_empty(), "off until enabled");
        a.enable_events();
        let c = a.allocate(1).unwrap()[0];
        let h = a.cache_block(c.into(), 7, b"s", &[3, 4]).unwrap();
        a.cache_block(c.into(), 7, b"s", &[3, 4]).unwrap(); // already registered: no event
        a.free(&[c]).unwrap();
        a.free(&[b]).unwrap();
        a.allocate(1).unwrap(); // LRU: evicts c
        a.reset_prefix_cache();
        let stored = CacheEvent::Stored {
            hash: h,
            parent: 7,
            salt: b"s".to_vec(),
            tokens: vec![3, 4],
        };
        assert_eq!(
            a.take_events(),
            vec![stored, CacheEvent::Removed { hash: h }, CacheEvent::Cleared]
        );
        assert!(a.take_events().is_empty());
        a.check_invariants().unwrap();
    }

    #[test]
    fn check_invariants_names_the_broken_one() {
        let mut a = pool(4, 2, Policy::Lru, 128);
        a.allocate(2).unwrap();
        a.refs[3] = 1; // live but still on the free list
        assert!(a.check_invariants().unwrap_err().starts_with("I3"));
        a.refs[3] = 0;
        a.num_cached = 1;
        assert!(a.check_invariants().unwrap_err().starts_with("I1"));
        a.num_cached = 0;
        a.index.insert(77, 0);
        assert!(a.check_invariants().unwrap_err().starts_with("I4"));
    }

    #[test]
    fn constructor_bounds() {
        assert!(BlockAllocator::new(0, 1, true, Policy::Lru, 128).is_err());
        assert!(BlockAllocator::new(1 << 24, 1, true, Policy::Lru, 128).is_ok());
        assert!(BlockAllocator::new((1 << 24) + 1, 1, true, Policy::Lru, 128).is_err());
        assert!(BlockAllocator::new(1, (1 << 16) + 1, true, Policy::Lru, 128).is_err());
        assert!(BlockAllocator::new(1, 1, true, Policy::Lru, 0).is_err());
        assert!(BlockAllocator::new(1, 1, true, Policy::Lru, 129).is_err());
        assert_eq!(Policy::parse("mru"), Some(Policy::Mru));
        assert_eq!(Policy::parse("fifo"), None);
    }
}
