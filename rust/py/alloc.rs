//! `BlockAllocator` and `KVCacheManager`: the core's allocator and block tables behind a mutex.

use std::sync::{Mutex, MutexGuard};

use numpy::ndarray::Array2;
use numpy::IntoPyArray;
use pyo3::exceptions::{PyAssertionError, PyRuntimeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::{MutexExt, PyOnceLock};
use pyo3::types::{PyBool, PyDict, PyInt, PyString, PyType};

use super::args::*;
use crate::allocator::{self, prefix_hash, CacheEvent, Policy, MAX_BLOCK_SIZE, MAX_NUM_BLOCKS};
use crate::block_table::{self, BatchInputs, MAX_COUNT};

/// Calls touching at least this many tokens (hashing, batch building) release the GIL.
const DETACH_TOKENS: u64 = 1 << 14;

fn lock<'a, T>(m: &'a Mutex<T>, py: Python<'_>) -> PyResult<MutexGuard<'a, T>> {
    m.lock_py_attached(py)
        .map_err(|_| PyRuntimeError::new_err("pagedkv_rs state was poisoned by an earlier panic"))
}

/// Validated constructor arguments shared by both classes.
#[derive(Clone, Copy)]
struct Config {
    num_blocks: usize,
    block_size: usize,
    caching: bool,
    policy: Policy,
    hash_bits: u32,
}

impl Config {
    fn parse(
        num_blocks: &Bound<'_, PyAny>,
        block_size: &Bound<'_, PyAny>,
        enable_prefix_caching: &Arg<'_, bool>,
        policy: &Arg<'_, &str>,
        hash_bits: &Arg<'_, u32>,
    ) -> PyResult<Config> {
        let num_blocks = check_u64("num_blocks", num_blocks, 1, MAX_NUM_BLOCKS)? as usize;
        let block_size = check_u64("block_size", block_size, 1, MAX_BLOCK_SIZE)? as usize;
        let hash_bits = match hash_bits {
            Arg::Given(h) => check_u64("hash_bits", h, 1, 128)? as u32,
            Arg::Default(h) => *h,
        };
        let policy = match policy {
            Arg::Default(p) => Policy::parse(p).unwrap_or(Policy::Lru),
            Arg::Given(p) => match p.cast::<PyString>() {
                Ok(s) => Policy::parse(&s.to_cow()?),
                Err(_) => None,
            }
            .ok_or_else(|| {
                let r = p
                    .repr()
                    .map_or_else(|_| "?".to_owned(), |r| r.to_string_lossy().into_owned());
                PyValueError::new_err(format!("policy must be one of ('lru', 'mru'), got {r}"))
            })?,
        };
        let caching = match enable_prefix_caching {
            Arg::Given(c) => c.is_truthy()?,
            Arg::Default(c) => *c,
        };
        Ok(Config {
            num_blocks,
            block_size,
            caching,
            policy,
            hash_bits,
        })
    }

    fn mask(&self) -> u128 {
        if self.hash_bits == 128 {
            u128::MAX
        } else {
            (1u128 << self.hash_bits) - 1
        }
    }

    fn block_id(&self, obj: &Bound<'_, PyAny>) -> PyResult<u32> {
        check_u64("block id", obj, 0, self.num_blocks as u64 - 1).map(|b| b as u32)
    }

    fn block_ids(&self, obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        let mut out = Vec::with_capacity(obj.len().unwrap_or(0));
        for_each_item(obj, |x| {
            out.push(self.block_id(x)?);
            Ok(())
        })?;
        Ok(out)
    }
}

fn alloc_stats<'py>(py: Python<'py>, s: &allocator::AllocStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("num_blocks", s.num_blocks)?;
    d.set_item("block_size", s.block_size)?;
    d.set_item("free_blocks", s.free_blocks)?;
    d.set_item("cached_blocks", s.cached_blocks)?;
    d.set_item("live_blocks", s.live_blocks)?;
    d.set_item("usage", s.usage)?;
    d.set_item("evictions", s.evictions)?;
    d.set_item("block_allocations", s.block_allocations)?;
    Ok(d)
}

/// One logged prefix-cache change as Python sees it: (kind, hash, parent, token_ids, salt).
type EventTuple = (&'static str, u128, u128, Vec<u32>, Vec<u8>);

fn event_tuples(events: Vec<CacheEvent>) -> Vec<EventTuple> {
    events
        .into_iter()
        .map(|e| match e {
            CacheEvent::Stored {
                hash,
                parent,
                salt,
                tokens,
            } => ("stored", hash, parent, tokens, salt),
            CacheEvent::Removed { hash } => ("removed", hash, 0, Vec::new(), Vec::new()),
            CacheEvent::Cleared => ("cleared", 0, 0, Vec::new(), Vec::new()),
        })
        .collect()
}

fn invariants(r: Result<(), String>) -> PyResult<()> {
    r.map_err(PyAssertionError::new_err)
}

// ------------------------------------------------------------------ BlockAllocator

/// Physical block pool: ref counts, an O(1) free list, and the prefix-hash index.
#[pyclass(frozen, module = "pagedkv_rs._core")]
pub struct BlockAllocator {
    cfg: Config,
    inner: Mutex<allocator::BlockAllocator>,
}

impl BlockAllocator {
    fn core(&self, py: Python<'_>) -> PyResult<MutexGuard<'_, allocator::BlockAllocator>> {
        lock(&self.inner, py)
    }
}

#[pymethods]
impl BlockAllocator {
    #[new]
    #[pyo3(
        signature = (num_blocks, block_size, *, enable_prefix_caching = Arg::Default(true), policy = Arg::Default("lru"), hash_bits = Arg::Default(128)),
        text_signature = "(num_blocks, block_size, *, enable_prefix_caching=True, policy='lru', hash_bits=128)"
    )]
    fn new(
        num_blocks: &Bound<'_, PyAny>,
        block_size: &Bound<'_, PyAny>,
        enable_prefix_caching: Arg<'_, bool>,
        policy: Arg<'_, &str>,
        hash_bits: Arg<'_, u32>,
    ) -> PyResult<Self> {
        let cfg = Config::parse(num_blocks, block_size, &enable_prefix_caching, &policy, &hash_bits)?;
        let core =
            allocator::BlockAllocator::new(cfg.num_blocks, cfg.block_size, cfg.caching, cfg.policy, cfg.hash_bits)?;
        Ok(BlockAllocator {
            cfg,
            inner: Mutex::new(core),
        })
    }

    #[getter]
    fn num_blocks(&self) -> usize {
        self.cfg.num_blocks
    }
    #[getter]
    fn block_size(&self) -> usize {
        self.cfg.block_size
    }
    #[getter]
    fn enable_prefix_caching(&self) -> bool {
        self.cfg.caching
    }
    #[getter]
    fn policy(&self) -> &'static str {
        self.cfg.policy.as_str()
    }
    #[getter]
    fn hash_bits(&self) -> u32 {
        self.cfg.hash_bits
    }
    /// Blocks with ref count 0 and no prefix hash.
    #[getter]
    fn num_free_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.core(py)?.num_free_blocks())
    }
    /// Blocks with ref count 0 that still hold a prefix hash (reclaimable).
    #[getter]
    fn num_cached_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.core(py)?.num_cached_blocks())
    }
    #[getter]
    fn num_live_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.core(py)?.num_live_blocks())
    }
    #[getter]
    fn num_evictions(&self, py: Python<'_>) -> PyResult<u64> {
        Ok(self.core(py)?.num_evictions())
    }
    /// Fraction of blocks that are live.
    #[getter]
    fn usage(&self, py: Python<'_>) -> PyResult<f64> {
        Ok(self.core(py)?.usage())
    }

    /// Hand out ``num_blocks`` fresh blocks (ref count 1), evicting cached ones as needed.
    fn allocate(&self, py: Python<'_>, num_blocks: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        let k = check_u64("num_blocks", num_blocks, 0, MAX_NUM_BLOCKS)?;
        let out = self.core(py)?.allocate(k as usize)?;
        Ok(out)
    }

    /// Add a reference to each block; a cached block is taken back off the free list.
    fn incref(&self, py: Python<'_>, block_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = self.cfg.block_ids(block_ids)?;
        Ok(self.core(py)?.incref(&ids)?)
    }

    /// Drop one reference per listed block; blocks reaching 0 join the free-list tail in list order.
    fn free(&self, py: Python<'_>, block_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = self.cfg.block_ids(block_ids)?;
        Ok(self.core(py)?.free(&ids)?)
    }

    /// Current reference count of a block.
    fn ref_count(&self, py: Python<'_>, block_id: &Bound<'_, PyAny>) -> PyResult<u32> {
        let b = self.cfg.block_id(block_id)?;
        Ok(self.core(py)?.ref_count(b.into())?)
    }

    /// Blocks with ref count 0, in the order ``allocate`` would hand them out.
    fn free_order(&self, py: Python<'_>) -> PyResult<Vec<u32>> {
        let out = self.core(py)?.free_order();
        Ok(out)
    }

    /// Chained prefix hash of one block's tokens (SHA-256, truncated to ``hash_bits``).
    #[pyo3(signature = (parent_hash, token_ids, cache_salt = None))]
    fn hash_block(
        &self,
        parent_hash: Option<&Bound<'_, PyAny>>,
        token_ids: &Bound<'_, PyAny>,
        cache_salt: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<u128> {
        let toks = tokens(token_ids)?;
        let parent = self::parent_hash(parent_hash, self.cfg.mask())?;
        let salt = salt(cache_salt)?;
        Ok(prefix_hash(parent, &salt, &toks, self.cfg.mask()))
    }

    /// The prefix hash a block is registered under, or None.
    fn block_hash(&self, py: Python<'_>, block_id: &Bound<'_, PyAny>) -> PyResult<Option<u128>> {
        let b = self.cfg.block_id(block_id)?;
        Ok(self.core(py)?.block_hash(b.into())?)
    }

    /// Register a live, full block under its chained hash; returns the hash.
    ///
    /// The first block registered under a hash keeps it; a later block with the same hash stays
    /// unregistered (its hash is still returned so the caller can chain on it).
    #[pyo3(signature = (block_id, parent_hash, token_ids, cache_salt = None))]
    fn cache_block(
        &self,
        py: Python<'_>,
        block_id: &Bound<'_, PyAny>,
        parent_hash: Option<&Bound<'_, PyAny>>,
        token_ids: &Bound<'_, PyAny>,
        cache_salt: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<u128> {
        let b = self.cfg.block_id(block_id)?;
        let toks = tokens(token_ids)?;
        if toks.len() != self.cfg.block_size {
            return Err(PyValueError::new_err(format!(
                "a cached block holds {} tokens, got {}",
                self.cfg.block_size,
                toks.len()
            )));
        }
        // The fallback checks liveness before parent and salt.
        let parent = self::parent_hash(parent_hash, self.cfg.mask());
        let salt = salt(cache_salt);
        let mut core = self.core(py)?;
        core.check_live(b)?;
        Ok(core.cache_block(b.into(), parent?, &salt?, &toks)?)
    }

    /// The block registered for exactly these (parent, salt, tokens), or None. Changes nothing.
    #[pyo3(signature = (parent_hash, token_ids, cache_salt = None))]
    fn lookup(
        &self,
        py: Python<'_>,
        parent_hash: Option<&Bound<'_, PyAny>>,
        token_ids: &Bound<'_, PyAny>,
        cache_salt: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<u32>> {
        let toks = tokens(token_ids)?;
        let parent = self::parent_hash(parent_hash, self.cfg.mask())?;
        let salt = salt(cache_salt)?;
        Ok(self.core(py)?.lookup(parent, &salt, &toks)?)
    }

    /// Forget every prefix hash (cached blocks become plain free blocks); returns how many.
    fn reset_prefix_cache(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.core(py)?.reset_prefix_cache())
    }

    /// Start logging prefix-cache changes for ``take_events`` (off by default: no cost).
    fn enable_events(&self, py: Python<'_>) -> PyResult<()> {
        self.core(py)?.enable_events();
        Ok(())
    }

    /// Changes since the last call, oldest first: ``(kind, hash, parent, token_ids, salt)`` with kind
    /// ``"stored"`` (a full block registered), ``"removed"`` (a cached block evicted) or ``"cleared"``.
    fn take_events(&self, py: Python<'_>) -> PyResult<Vec<EventTuple>> {
        Ok(event_tuples(self.core(py)?.take_events()))
    }

    /// Block counts and eviction count.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.core(py)?.stats();
        alloc_stats(py, &s)
    }

    /// Raise AssertionError naming the first broken invariant (I1, I3, I4).
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        let r = self.core(py)?.check_invariants();
        invariants(r)
    }
}

// ------------------------------------------------------------------ KVCacheManager

static BATCH_INPUTS: PyOnceLock<Py<PyType>> = PyOnceLock::new();

fn batch_inputs<'py>(py: Python<'py>, b: BatchInputs) -> PyResult<Bound<'py, PyAny>> {
    let cls = BATCH_INPUTS.import(py, "pagedkv_rs.batch", "BatchInputs")?;
    let rows = b.seq_lens.len();
    let tables = Array2::from_shape_vec((rows, b.width), b.block_tables)
        .map_err(|e| PyRuntimeError::new_err(format!("block table shape: {e}")))?;
    // By field name: the dataclass may reorder or gain fields without this call silently shifting.
    let kw = PyDict::new(py);
    kw.set_item(intern!(py, "input_ids"), b.input_ids.into_pyarray(py))?;
    kw.set_item(intern!(py, "positions"), b.positions.into_pyarray(py))?;
    kw.set_item(intern!(py, "query_start_loc"), b.query_start_loc.into_pyarray(py))?;
    kw.set_item(intern!(py, "seq_lens"), b.seq_lens.into_pyarray(py))?;
    kw.set_item(intern!(py, "block_tables"), tables.into_pyarray(py))?;
    kw.set_item(intern!(py, "indptr"), b.indptr.into_pyarray(py))?;
    kw.set_item(intern!(py, "indices"), b.indices.into_pyarray(py))?;
    kw.set_item(intern!(py, "last_page_len"), b.last_page_len.into_pyarray(py))?;
    kw.set_item(intern!(py, "slot_mapping"), b.slot_mapping.into_pyarray(py))?;
    cls.call((), Some(&kw))
}

/// Per-sequence block tables on top of a block pool.
#[pyclass(frozen, module = "pagedkv_rs._core")]
pub struct KVCacheManager {
    cfg: Config,
    max_seq_len: u64,
    inner: Mutex<block_table::KVCacheManager>,
}

impl KVCacheManager {
    fn core(&self, py: Python<'_>) -> PyResult<MutexGuard<'_, block_table::KVCacheManager>> {
        lock(&self.inner, py)
    }

    /// Looks up a sequence by its Python id, for read-only queries.
    fn with_seq<R>(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        f: impl FnOnce(&block_table::KVCacheManager, u64) -> crate::error::Result<R>,
    ) -> PyResult<R> {
        let id = self::seq_id(seq_id)?;
        let core = self.core(py)?;
        Ok(f(&core, id)?)
    }
}

#[pymethods]
impl KVCacheManager {
    #[new]
    #[pyo3(
        signature = (num_blocks, block_size, *, enable_prefix_caching = Arg::Default(true), policy = Arg::Default("lru"), hash_bits = Arg::Default(128), max_seq_len = None),
        text_signature = "(num_blocks, block_size, *, enable_prefix_caching=True, policy='lru', hash_bits=128, max_seq_len=None)"
    )]
    fn new(
        num_blocks: &Bound<'_, PyAny>,
        block_size: &Bound<'_, PyAny>,
        enable_prefix_caching: Arg<'_, bool>,
        policy: Arg<'_, &str>,
        hash_bits: Arg<'_, u32>,
        max_seq_len: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let cfg = Config::parse(num_blocks, block_size, &enable_prefix_caching, &policy, &hash_bits)?;
        let max_seq_len = max_seq_len
            .map(|m| check_u64("max_seq_len", m, 1, MAX_COUNT))
            .transpose()?;
        let core = block_table::KVCacheManager::new(
            cfg.num_blocks,
            cfg.block_size,
            cfg.caching,
            cfg.policy,
            cfg.hash_bits,
            max_seq_len,
        )?;
        Ok(KVCacheManager {
            cfg,
            max_seq_len: core.max_seq_len(),
            inner: Mutex::new(core),
        })
    }

    #[getter]
    fn num_blocks(&self) -> usize {
        self.cfg.num_blocks
    }
    #[getter]
    fn block_size(&self) -> usize {
        self.cfg.block_size
    }
    #[getter]
    fn enable_prefix_caching(&self) -> bool {
        self.cfg.caching
    }
    #[getter]
    fn policy(&self) -> &'static str {
        self.cfg.policy.as_str()
    }
    /// Longest sequence accepted: ``max_seq_len`` if given, capped by the whole pool.
    #[getter]
    fn max_seq_len(&self) -> u64 {
        self.max_seq_len
    }
    #[getter]
    fn num_free_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.core(py)?.allocator().num_free_blocks())
    }
    #[getter]
    fn num_cached_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.core(py)?.allocator().num_cached_blocks())
    }
    #[getter]
    fn num_live_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.core(py)?.allocator().num_live_blocks())
    }
    #[getter]
    fn usage(&self, py: Python<'_>) -> PyResult<f64> {
        Ok(self.core(py)?.allocator().usage())
    }

    fn __len__(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.core(py)?.len())
    }

    fn __contains__(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<bool> {
        if seq_id.is_instance_of::<PyBool>()
            || !(seq_id.is_instance_of::<PyInt>() || seq_id.hasattr(intern!(py, "__index__"))?)
        {
            return Ok(false);
        }
        match as_index("seq_id", seq_id)?.extract::<u64>() {
            Ok(id) => Ok(self.core(py)?.contains(id)),
            Err(_) => Ok(false),
        }
    }

    /// Blocks that ``allocate`` of this prompt would take off the free list now.
    #[pyo3(signature = (token_ids, cache_salt = None))]
    fn blocks_needed(
        &self,
        py: Python<'_>,
        token_ids: &Bound<'_, PyAny>,
        cache_salt: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<u64> {
        let toks = tokens(token_ids)?;
        let salt = salt(cache_salt)?;
        Ok(self.core(py)?.blocks_needed(&toks, &salt))
    }

    /// Blocks that appending ``num_new_tokens`` to the sequence would take (copy-on-write included).
    #[pyo3(
        signature = (seq_id, num_new_tokens = Arg::Default(1)),
        text_signature = "($self, seq_id, num_new_tokens=1)"
    )]
    fn blocks_needed_to_append(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        num_new_tokens: Arg<'_, u64>,
    ) -> PyResult<u64> {
        let k = match num_new_tokens {
            Arg::Given(k) => check_u64("num_new_tokens", &k, 0, MAX_COUNT)?,
            Arg::Default(k) => k,
        };
        self.with_seq(py, seq_id, |core, id| core.blocks_needed_to_append(id, k))
    }

    /// Whether ``allocate`` of this prompt would succeed now (length limit included).
    #[pyo3(signature = (token_ids, cache_salt = None))]
    fn can_allocate(
        &self,
        py: Python<'_>,
        token_ids: &Bound<'_, PyAny>,
        cache_salt: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        let toks = tokens(token_ids)?;
        if toks.is_empty() || toks.len() as u64 > self.max_seq_len {
            return Ok(false);
        }
        let salt = salt(cache_salt)?;
        Ok(self.core(py)?.can_allocate(&toks, &salt))
    }

    /// Whether ``append`` of ``num_new_tokens`` tokens would succeed now.
    #[pyo3(
        signature = (seq_id, num_new_tokens = Arg::Default(1)),
        text_signature = "($self, seq_id, num_new_tokens=1)"
    )]
    fn can_append(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>, num_new_tokens: Arg<'_, u64>) -> PyResult<bool> {
        let id = self::seq_id(seq_id)?;
        // The fallback looks the sequence up before it checks the count.
        let k = match num_new_tokens {
            Arg::Given(k) => check_u64("num_new_tokens", &k, 0, MAX_COUNT),
            Arg::Default(k) => Ok(k),
        };
        let core = self.core(py)?;
        core.find(id)?;
        Ok(core.can_append(id, k?)?)
    }

    fn block_table(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        self.with_seq(py, seq_id, |core, id| core.block_table(id).map(<[u32]>::to_vec))
    }

    fn token_ids(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        self.with_seq(py, seq_id, |core, id| core.token_ids(id).map(<[u32]>::to_vec))
    }

    fn num_tokens(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<usize> {
        self.with_seq(py, seq_id, |core, id| core.num_tokens(id))
    }

    fn num_computed_tokens(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<usize> {
        self.with_seq(py, seq_id, |core, id| core.num_computed_tokens(id))
    }

    /// Held sequence ids, sorted.
    fn seq_ids(&self, py: Python<'_>) -> PyResult<Vec<u64>> {
        let ids = self.core(py)?.seq_ids();
        Ok(ids)
    }

    fn ref_count(&self, py: Python<'_>, block_id: &Bound<'_, PyAny>) -> PyResult<u32> {
        let b = self.cfg.block_id(block_id)?;
        Ok(self.core(py)?.allocator().ref_count(b.into())?)
    }

    fn block_hash(&self, py: Python<'_>, block_id: &Bound<'_, PyAny>) -> PyResult<Option<u128>> {
        let b = self.cfg.block_id(block_id)?;
        Ok(self.core(py)?.allocator().block_hash(b.into())?)
    }

    fn free_order(&self, py: Python<'_>) -> PyResult<Vec<u32>> {
        let out = self.core(py)?.allocator().free_order();
        Ok(out)
    }

    /// Block counts, usage, prefix-cache query/hit tokens, evictions, sequences held.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.core(py)?.stats();
        let d = alloc_stats(py, &s.alloc)?;
        d.set_item("num_seqs", s.num_seqs)?;
        d.set_item("prefix_query_tokens", s.prefix_query_tokens)?;
        d.set_item("prefix_hit_tokens", s.prefix_hit_tokens)?;
        Ok(d)
    }

    /// Admit a sequence with its prompt; returns how many prompt tokens were served from the prefix cache.
    #[pyo3(signature = (seq_id, token_ids, cache_salt = None))]
    fn allocate(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
        cache_salt: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        let id = check_int("seq_id", seq_id, 0, MAX_SEQ_ID)? as u64;
        let toks = tokens(token_ids)?;
        let salt = salt(cache_salt)?;
        let mut guard = self.core(py)?;
        if (toks.len() as u64) < DETACH_TOKENS {
            return Ok(guard.allocate(id, toks, &salt)?);
        }
        let core = &mut *guard;
        Ok(py.detach(|| core.allocate(id, toks, &salt))?)
    }

    /// Add tokens to a sequence, growing its table; returns (src, dst) block copies to do first.
    fn append(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<(u32, u32)>> {
        let id = self::seq_id(seq_id)?;
        let toks = tokens(token_ids);
        let mut core = self.core(py)?;
        let p = core.find(id)?;
        Ok(core.append_at(p, &toks?)?)
    }

    /// Append one token to each sequence, all or nothing; returns all (src, dst) block copies.
    fn append_batch(
        &self,
        py: Python<'_>,
        seq_ids: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<(u32, u32)>> {
        let (n_ids, n_toks) = (seq_ids.len()?, token_ids.len()?);
        if n_ids != n_toks {
            return Err(PyValueError::new_err(format!(
                "{n_ids} sequence ids but {n_toks} tokens"
            )));
        }
        let SeqIds { ids, stop } = self::seq_ids(seq_ids)?;
        let toks = tokens(token_ids);
        let mut core = self.core(py)?;
        let pos = core.resolve(&ids)?;
        if let Some(e) = stop {
            return Err(e);
        }
        core.check_distinct(&pos, "append_batch")?;
        Ok(core.append_batch_at(&pos, &toks?)?)
    }

    /// Make ``child_id`` share all of the parent's blocks (copy-on-write on append).
    fn fork(&self, py: Python<'_>, parent_id: &Bound<'_, PyAny>, child_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let parent = self::seq_id(parent_id)?;
        let child = check_int("child_id", child_id, 0, MAX_SEQ_ID);
        let mut core = self.core(py)?;
        core.find(parent)?;
        Ok(core.fork(parent, child? as u64)?)
    }

    /// Release a sequence's blocks, tail first.
    fn free(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let id = self::seq_id(seq_id)?;
        Ok(self.core(py)?.free(id)?)
    }

    /// Shorten a sequence to its first ``num_tokens`` tokens, releasing the blocks past them (rollback).
    fn truncate(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>, num_tokens: &Bound<'_, PyAny>) -> PyResult<()> {
        let id = self::seq_id(seq_id)?;
        let n = check_u64("num_tokens", num_tokens, 0, MAX_COUNT)?;
        Ok(self.core(py)?.truncate(id, n)?)
    }

    /// Forget every prefix hash; returns how many were dropped.
    fn reset_prefix_cache(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.core(py)?.reset_prefix_cache())
    }

    /// Start logging prefix-cache changes for ``take_events`` (off by default: no cost).
    fn enable_events(&self, py: Python<'_>) -> PyResult<()> {
        self.core(py)?.allocator_mut().enable_events();
        Ok(())
    }

    /// Changes since the last call, oldest first: ``(kind, hash, parent, token_ids, salt)`` with kind
    /// ``"stored"`` (a full block registered), ``"removed"`` (a cached block evicted) or ``"cleared"``.
    fn take_events(&self, py: Python<'_>) -> PyResult<Vec<EventTuple>> {
        Ok(event_tuples(self.core(py)?.allocator_mut().take_events()))
    }

    /// Build one step's kernel inputs and mark the scheduled tokens computed.
    ///
    /// Sequence ``seq_ids[i]`` computes its next ``num_new_tokens[i]`` tokens (default 0: just
    /// export the tables). Newly full, computed blocks enter the prefix cache.
    #[pyo3(signature = (seq_ids, num_new_tokens = None))]
    fn prepare_batch<'py>(
        &self,
        py: Python<'py>,
        seq_ids: &Bound<'py, PyAny>,
        num_new_tokens: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let SeqIds { ids, stop } = self::seq_ids(seq_ids)?;
        let counts = num_new_tokens.map(counts);
        let batch = {
            let mut core = self.core(py)?;
            let pos = core.resolve(&ids)?;
            if let Some(e) = stop {
                return Err(e);
            }
            core.check_distinct(&pos, "prepare_batch")?;
            let ns = match counts {
                None => vec![0; pos.len()],
                Some(Counts { len, values }) => {
                    let len = len?;
                    if len != pos.len() {
                        return Err(PyValueError::new_err(format!(
                            "{} sequence ids but {len} token counts",
                            pos.len()
                        )));
                    }
                    values?
                }
            };
            if ns.iter().fold(0u64, |a, &n| a.saturating_add(n)) < DETACH_TOKENS {
                core.prepare_at(&pos, &ns)?
            } else {
                let core = &mut *core;
                py.detach(|| core.prepare_at(&pos, &ns))?
            }
        };
        batch_inputs(py, batch)
    }

    /// Raise AssertionError naming the first broken invariant (I1-I5).
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        let r = self.core(py)?.check_invariants();
        invariants(r)
    }
}
