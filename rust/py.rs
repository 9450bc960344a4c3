//! The Python border: every #[pyclass] / #[pyfunction], numpy extraction and validation.
//!
//! Arguments are checked exactly like `pagedkv_rs.fallback` does, in the same order, so both
//! backends raise the same exception types. Python objects are read before the core's mutex
//! is taken (errors that the fallback raises only after a state check are kept and raised in
//! turn), and results are turned into Python objects after it is released.
use std::sync::{Mutex, MutexGuard};

use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray1, PyArrayMethods, PyUntypedArray};
use pyo3::exceptions::{PyAssertionError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::{MutexExt, PyOnceLock};
use pyo3::types::{PyBool, PyBytes, PyDict, PyInt, PyList, PyString, PyTuple, PyType};
use pyo3::{intern, Borrowed};

use crate::allocator::{self, prefix_hash, Policy, MAX_BLOCK_SIZE, MAX_NUM_BLOCKS, MAX_TOKEN_ID};
use crate::block_table::{self, Batch, MAX_COUNT};
use crate::error::Error;

pyo3::import_exception!(pagedkv_rs.errors, OutOfBlocksError);
pyo3::import_exception!(pagedkv_rs.errors, UnknownSequenceError);
pyo3::import_exception!(pagedkv_rs.errors, DuplicateSequenceError);
pyo3::import_exception!(pagedkv_rs.errors, SequenceTooLongError);
pyo3::import_exception!(pagedkv_rs.errors, DoubleFreeError);

const MAX_SEQ_ID: u128 = u64::MAX as u128;
/// Calls touching at least this many tokens (hashing, batch building) release the GIL.
const DETACH_TOKENS: u64 = 1 << 14;

impl From<Error> for PyErr {
    fn from(e: Error) -> PyErr {
        let msg = e.to_string();
        match e {
            Error::OutOfBlocks { .. } => OutOfBlocksError::new_err(msg),
            Error::UnknownSequence(_) => UnknownSequenceError::new_err(msg),
            Error::DuplicateSequence(_) => DuplicateSequenceError::new_err(msg),
            Error::SequenceTooLong { .. } => SequenceTooLongError::new_err(msg),
            Error::DoubleFree { .. } => DoubleFreeError::new_err(msg),
            Error::Invalid(_) => PyValueError::new_err(msg),
            Error::Type(_) => PyTypeError::new_err(msg),
        }
    }
}

fn lock<'a, T>(m: &'a Mutex<T>, py: Python<'_>) -> PyResult<MutexGuard<'a, T>> {
    m.lock_py_attached(py)
        .map_err(|_| PyRuntimeError::new_err("pagedkv_rs state was poisoned by an earlier panic"))
}

// ------------------------------------------------------------------ argument checks

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map_or_else(|_| "object".to_owned(), |n| n.to_string())
}

/// `obj.__index__()` as an int; TypeError for bool and non-integers (fallback `_check_int`).
fn as_index<'py>(name: &str, obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyInt>> {
    let py = obj.py();
    if obj.is_instance_of::<PyBool>()
        || !(obj.is_instance_of::<PyInt>() || obj.hasattr(intern!(py, "__index__"))?)
    {
        return Err(PyTypeError::new_err(format!(
            "{name} must be an int, got {}",
            type_name(obj)
        )));
    }
    if let Ok(i) = obj.cast::<PyInt>() {
        return Ok(i.clone());
    }
    let r = obj.call_method0(intern!(py, "__index__"))?;
    r.cast_into::<PyInt>()
        .map_err(|_| PyTypeError::new_err(format!("{name}: __index__ returned a non-int")))
}

fn range_error(name: &str, lo: u128, hi: u128, got: &str) -> PyErr {
    PyValueError::new_err(format!("{name} must be in [{lo}, {hi}], got {got}"))
}

/// Fallback `_check_int`: TypeError unless an int (not bool), ValueError outside [lo, hi].
#[inline]
fn check_int(name: &str, obj: &Bound<'_, PyAny>, lo: u128, hi: u128) -> PyResult<u128> {
    match exact_u64(obj) {
        Some(v) if (lo..=hi).contains(&u128::from(v)) => Ok(v.into()),
        _ => check_int_slow(name, obj, lo, hi),
    }
}

/// The value of an exact `int` that fits in u64 (the hot case: token and sequence ids), else None.
#[inline(always)]
fn exact_u64(obj: &Bound<'_, PyAny>) -> Option<u64> {
    if !obj.is_exact_instance_of::<PyInt>() {
        return None;
    }
    // SAFETY: `obj` is a live object of exact type `int` and we are attached to the interpreter.
    let v = unsafe { pyo3::ffi::PyLong_AsUnsignedLongLong(obj.as_ptr()) };
    if v == u64::MAX && PyErr::take(obj.py()).is_some() {
        return None; // negative or too large: the slow path words the error
    }
    Some(v)
}

#[cold]
fn check_int_slow(name: &str, obj: &Bound<'_, PyAny>, lo: u128, hi: u128) -> PyResult<u128> {
    let i = as_index(name, obj)?;
    match i.extract::<u128>() {
        Ok(v) if (lo..=hi).contains(&v) => Ok(v),
        _ => Err(range_error(name, lo, hi, &i.str()?.to_string_lossy())),
    }
}

fn check_u64(name: &str, obj: &Bound<'_, PyAny>, lo: u64, hi: u64) -> PyResult<u64> {
    check_int(name, obj, lo.into(), hi.into()).map(|v| v as u64)
}

/// A 1-D, contiguous, native int64/int32 `numpy.ndarray` (exact type) copied out, else None.
fn int_array(obj: &Bound<'_, PyAny>) -> Option<Vec<i64>> {
    if !obj.is_exact_instance_of::<PyUntypedArray>() {
        return None;
    }
    if let Ok(a) = obj.cast::<PyArray1<i64>>() {
        return a.to_vec().ok();
    }
    if let Ok(a) = obj.cast::<PyArray1<i32>>() {
        return a
            .to_vec()
            .ok()
            .map(|v| v.into_iter().map(i64::from).collect());
    }
    None
}

/// Calls `f` on each item of a list, tuple or any iterable, stopping at the first error.
fn for_each_item<'py>(
    obj: &Bound<'py, PyAny>,
    mut f: impl FnMut(&Bound<'py, PyAny>) -> PyResult<()>,
) -> PyResult<()> {
    if let Ok(l) = obj.cast::<PyList>() {
        return l.iter().try_for_each(|x| f(&x));
    }
    if let Ok(t) = obj.cast::<PyTuple>() {
        return t.iter().try_for_each(|x| f(&x));
    }
    for x in obj.try_iter()? {
        f(&x?)?;
    }
    Ok(())
}

/// Fallback `_tokens`: a sequence of token ids in [0, 2**32 - 1] (str/bytes refused).
fn tokens(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(PyTypeError::new_err("token_ids must be a sequence of ints"));
    }
    if let Some(v) = int_array(obj) {
        if let Some(&t) = v.iter().find(|&&t| u32::try_from(t).is_err()) {
            return Err(range_error(
                "token id",
                0,
                MAX_TOKEN_ID.into(),
                &t.to_string(),
            ));
        }
        return Ok(v.into_iter().map(|t| t as u32).collect());
    }
    let mut out = Vec::with_capacity(obj.len().unwrap_or(0));
    for_each_item(obj, |x| {
        out.push(check_int("token id", x, 0, MAX_TOKEN_ID.into())? as u32);
        Ok(())
    })?;
    Ok(out)
}

/// Fallback `_salt_bytes`: None, str (UTF-8) or bytes.
fn salt(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<u8>> {
    let Some(obj) = obj else {
        return Ok(Vec::new());
    };
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(s.to_cow()?.as_bytes().to_vec());
    }
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(b.as_bytes().to_vec());
    }
    Err(PyTypeError::new_err(format!(
        "cache_salt must be str, bytes or None, got {}",
        type_name(obj)
    )))
}

/// `parent_hash`: None means 0, else an int in [0, 2**hash_bits - 1].
fn parent_hash(obj: Option<&Bound<'_, PyAny>>, mask: u128) -> PyResult<u128> {
    obj.map_or(Ok(0), |p| check_int("parent_hash", p, 0, mask))
}

fn unknown_sequence(obj: &Bound<'_, PyAny>) -> PyErr {
    let text = obj
        .str()
        .map_or_else(|_| "?".to_owned(), |s| s.to_string_lossy().into_owned());
    Error::UnknownSequence(text).into()
}

/// A sequence id for lookup: TypeError unless an int; an int outside u64 is unknown.
#[inline]
fn seq_id(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    if let Some(v) = exact_u64(obj) {
        return Ok(v);
    }
    seq_id_slow(obj)
}

#[cold]
fn seq_id_slow(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    as_index("seq_id", obj)?
        .extract::<u64>()
        .map_err(|_| unknown_sequence(obj))
}

/// Sequence ids read up to the first bad one; `stop` is what the fallback raises there,
/// after every earlier id was found.
struct SeqIds {
    ids: Vec<u64>,
    stop: Option<PyErr>,
}

fn seq_ids(obj: &Bound<'_, PyAny>) -> PyResult<SeqIds> {
    if let Some(v) = int_array(obj) {
        let valid = v.iter().position(|&t| t < 0).unwrap_or(v.len());
        let stop = v
            .get(valid)
            .map(|t| Error::UnknownSequence(t.to_string()).into());
        let ids = v[..valid].iter().map(|&t| t as u64).collect();
        return Ok(SeqIds { ids, stop });
    }
    if let Ok(a) = obj.cast::<PyArray1<u64>>() {
        if let (true, Ok(ids)) = (obj.is_exact_instance_of::<PyUntypedArray>(), a.to_vec()) {
            return Ok(SeqIds { ids, stop: None });
        }
    }
    let mut ids = Vec::with_capacity(obj.len().unwrap_or(0));
    let iterable = obj.cast::<PyList>().is_ok() || obj.cast::<PyTuple>().is_ok();
    if !iterable {
        obj.try_iter()?; // not iterable: TypeError before anything else
    }
    let stop = for_each_item(obj, |x| {
        ids.push(seq_id(x)?);
        Ok(())
    })
    .err();
    Ok(SeqIds { ids, stop })
}

/// `num_new_tokens` of `prepare_batch`: its len() and its values, each error kept for its turn.
struct Counts {
    len: PyResult<usize>,
    values: PyResult<Vec<u64>>,
}

fn counts(obj: &Bound<'_, PyAny>) -> Counts {
    let len = obj.len();
    let values = match int_array(obj) {
        Some(v) => match v.iter().find(|&&n| !(0..=MAX_COUNT as i64).contains(&n)) {
            Some(n) => Err(range_error(
                "num_new_tokens",
                0,
                MAX_COUNT.into(),
                &n.to_string(),
            )),
            None => Ok(v.into_iter().map(|n| n as u64).collect()),
        },
        None => {
            let mut out = Vec::with_capacity(*len.as_ref().unwrap_or(&0));
            for_each_item(obj, |x| {
                out.push(check_u64("num_new_tokens", x, 0, MAX_COUNT)?);
                Ok(())
            })
            .map(|()| out)
        }
    };
    Counts { len, values }
}

/// An argument with a default, kept raw and checked later in the fallback's order.
enum Arg<'py, D> {
    Given(Bound<'py, PyAny>),
    Default(D),
}

impl<'a, 'py, D> FromPyObject<'a, 'py> for Arg<'py, D> {
    type Error = PyErr;
    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        Ok(Arg::Given(obj.to_owned()))
    }
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
    Ok(d)
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
        let cfg = Config::parse(
            num_blocks,
            block_size,
            &enable_prefix_caching,
            &policy,
            &hash_bits,
        )?;
        let core = allocator::BlockAllocator::new(
            cfg.num_blocks,
            cfg.block_size,
            cfg.caching,
            cfg.policy,
            cfg.hash_bits,
        )?;
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

fn batch_inputs<'py>(py: Python<'py>, b: Batch) -> PyResult<Bound<'py, PyAny>> {
    let cls = BATCH_INPUTS.import(py, "pagedkv_rs.batch", "BatchInputs")?;
    let rows = b.seq_lens.len();
    let tables = Array2::from_shape_vec((rows, b.width), b.block_tables)
        .map_err(|e| PyRuntimeError::new_err(format!("block table shape: {e}")))?;
    // Field order of the BatchInputs dataclass.
    cls.call1((
        b.input_ids.into_pyarray(py),
        b.positions.into_pyarray(py),
        b.query_start_loc.into_pyarray(py),
        b.seq_lens.into_pyarray(py),
        tables.into_pyarray(py),
        b.indptr.into_pyarray(py),
        b.indices.into_pyarray(py),
        b.last_page_len.into_pyarray(py),
        b.slot_mapping.into_pyarray(py),
    ))
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
        let cfg = Config::parse(
            num_blocks,
            block_size,
            &enable_prefix_caching,
            &policy,
            &hash_bits,
        )?;
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
    fn can_append(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        num_new_tokens: Arg<'_, u64>,
    ) -> PyResult<bool> {
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
        self.with_seq(py, seq_id, |core, id| {
            core.block_table(id).map(<[u32]>::to_vec)
        })
    }

    fn token_ids(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        self.with_seq(py, seq_id, |core, id| {
            core.token_ids(id).map(<[u32]>::to_vec)
        })
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
    fn fork(
        &self,
        py: Python<'_>,
        parent_id: &Bound<'_, PyAny>,
        child_id: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
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

    /// Forget every prefix hash; returns how many were dropped.
    fn reset_prefix_cache(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.core(py)?.reset_prefix_cache())
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

/// Version of the compiled core.
#[pyfunction]
pub fn core_version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

// =============================================================================================
// Kernel functions: new_kv_cache, write_kv, copy_blocks, paged_attention, threads, info, probes.
// Everything from Python is validated here (types, dtypes, contiguity, alignment, ndim,
// aliasing, writability) and in `attention::validate` (shapes, ids, lengths) before any
// unchecked access; failures raise TypeError / ValueError.
// =============================================================================================

mod kernel {
    use half::{bf16, f16};
    use numpy::{
        npyffi, Element, PyArray, PyArrayDescrMethods, PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn,
        PyUntypedArray, PyUntypedArrayMethods,
    };
    use pyo3::exceptions::{PyTypeError, PyValueError};
    use pyo3::prelude::*;
    use pyo3::types::{PyDict, PyTuple};

    use crate::attention::{self as att, Batch, CacheShape, DType, Kv, KvMut, Params};
    use crate::linear as lin;
    use numpy::IntoPyArray;
    use crate::error::Error;

    fn value_err(e: Error) -> PyErr {
        PyValueError::new_err(e.to_string())
    }

    /// A validated, C-contiguous, aligned numpy array: its bytes and shape.
    struct Raw<'py> {
        arr: Bound<'py, PyUntypedArray>,
        ptr: *mut u8,
        nbytes: usize,
        shape: Vec<usize>,
    }

    impl Raw<'_> {
        fn overlaps(&self, other: &Raw) -> bool {
            let (a, b) = (self.ptr as usize, other.ptr as usize);
            self.nbytes > 0 && other.nbytes > 0 && a < b + other.nbytes && b < a + self.nbytes
        }
        fn writeable(&self) -> bool {
            // SAFETY: `arr` is a live numpy array; reading its flags field is always valid.
            let flags = unsafe { (*self.arr.as_array_ptr()).flags };
            flags & npyffi::NPY_ARRAY_WRITEABLE != 0
        }
    }

    /// Cast to ndarray, check ndim, C-contiguity and alignment; the dtype is checked by the caller.
    fn raw<'py>(obj: &Bound<'py, PyAny>, name: &str, ndim: usize) -> PyResult<Raw<'py>> {
        let arr = obj
            .cast::<PyUntypedArray>()
            .map_err(|_| PyTypeError::new_err(format!("{name} must be a numpy.ndarray, got {}", type_name(obj))))?
            .clone();
        if arr.ndim() != ndim {
            return Err(PyValueError::new_err(format!("{name} must be {ndim}-d, got shape {:?}", arr.shape())));
        }
        if !arr.is_c_contiguous() {
            return Err(PyValueError::new_err(format!("{name} must be C-contiguous (use numpy.ascontiguousarray)")));
        }
        let dt = arr.dtype();
        if dt.is_native_byteorder() == Some(false) {
            return Err(PyTypeError::new_err(format!("{name} must be in native byte order")));
        }
        let item = dt.itemsize();
        // SAFETY: `arr` is a live numpy array; `data` is its data pointer.
        let ptr = unsafe { (*arr.as_array_ptr()).data } as *mut u8;
        let shape = arr.shape().to_vec();
        let nbytes = shape.iter().product::<usize>() * item;
        if nbytes > 0 && (ptr as usize) % item.max(1) != 0 {
            return Err(PyValueError::new_err(format!("{name} data is not aligned to its {item}-byte items")));
        }
        Ok(Raw { arr, ptr, nbytes, shape })
    }

    fn type_name(obj: &Bound<'_, PyAny>) -> String {
        obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into())
    }

    fn dtype_name(r: &Raw) -> String {
        r.arr.dtype().getattr("name").and_then(|n| n.extract::<String>()).unwrap_or_else(|_| "?".into())
    }

    /// A typed array (float32 / int32 / int64) of `ndim` dimensions.
    fn typed<'py, T: Element>(obj: &Bound<'py, PyAny>, name: &str, ndim: usize, want: &str) -> PyResult<Raw<'py>> {
        let r = raw(obj, name, ndim)?;
        if !r.arr.dtype().is_equiv_to(&numpy::dtype::<T>(obj.py())) {
            return Err(PyTypeError::new_err(format!("{name} must be {want}, got {}", dtype_name(&r))));
        }
        Ok(r)
    }

    fn readonly<'py, T: Element>(r: &Raw<'py>, name: &str) -> PyResult<PyReadonlyArrayDyn<'py, T>> {
        r.arr
            .cast::<PyArrayDyn<T>>()
            .map_err(|_| PyTypeError::new_err(format!("{name} has the wrong dtype")))?
            .try_readonly()
            .map_err(|e| PyValueError::new_err(format!("{name}: {e}")))
    }

    fn slice_of<'a, T: Element>(a: &'a PyReadonlyArrayDyn<'_, T>, name: &str) -> PyResult<&'a [T]> {
        a.as_slice().map_err(|e| PyValueError::new_err(format!("{name}: {e}")))
    }

    /// A KV cache: 4-d, float32 / float16 / bfloat16.
    fn cache<'py>(obj: &Bound<'py, PyAny>, name: &str) -> PyResult<(Raw<'py>, DType)> {
        let r = raw(obj, name, 4)?;
        let dt = r.arr.dtype();
        let (kind, size) = (dt.kind(), dt.itemsize());
        let d = match (kind, size, dtype_name(&r).as_str()) {
            (b'f', 4, _) => DType::F32,
            (b'f', 2, _) => DType::F16,
            (_, 2, "bfloat16") => DType::Bf16,
            (_, _, n) => {
                return Err(PyTypeError::new_err(format!("{name} must be float32, float16 or bfloat16, got {n}")))
            }
        };
        Ok((r, d))
    }

    /// `cache_pair` for kernels that write the caches.
    fn cache_pair_mut<'py>(k: &Bound<'py, PyAny>, v: &Bound<'py, PyAny>) -> PyResult<(Raw<'py>, Raw<'py>, DType, CacheShape)> {
        let pair = cache_pair(k, v)?;
        if !pair.0.writeable() || !pair.1.writeable() {
            return Err(PyValueError::new_err("k_cache and v_cache must be writeable"));
        }
        Ok(pair)
    }

    fn cache_pair<'py>(k: &Bound<'py, PyAny>, v: &Bound<'py, PyAny>) -> PyResult<(Raw<'py>, Raw<'py>, DType, CacheShape)> {
        let (kr, kd) = cache(k, "k_cache")?;
        let (vr, vd) = cache(v, "v_cache")?;
        if kd != vd || kr.shape != vr.shape {
            return Err(PyValueError::new_err(format!(
                "k_cache and v_cache must match: {:?} {} vs {:?} {}",
                kr.shape,
                kd.name(),
                vr.shape,
                vd.name()
            )));
        }
        if kr.overlaps(&vr) {
            return Err(PyValueError::new_err("k_cache and v_cache must not share memory"));
        }
        let s = &kr.shape;
        let shape = CacheShape { num_blocks: s[0], num_kv_heads: s[1], block_size: s[2], head_dim: s[3] };
        shape.numel().map_err(value_err)?;
        Ok((kr, vr, kd, shape))
    }

    /// Read-only typed view of a validated cache.
    ///
    /// # Safety
    /// `r` passed `cache`/`raw` (C-contiguous, aligned, `numel` items of `dt`) and stays alive
    /// and unmodified by others for `'a`.
    unsafe fn kv<'a>(r: &Raw, dt: DType, numel: usize) -> Kv<'a> {
        // SAFETY: per the function contract; numel * item == r.nbytes. A 0-element array may
        // have a dangling data pointer, so use an empty slice then.
        unsafe {
            match dt {
                _ if numel == 0 => Kv::F32(&[]),
                DType::F32 => Kv::F32(std::slice::from_raw_parts(r.ptr as *const f32, numel)),
                DType::F16 => Kv::F16(std::slice::from_raw_parts(r.ptr as *const f16, numel)),
                DType::Bf16 => Kv::Bf16(std::slice::from_raw_parts(r.ptr as *const bf16, numel)),
            }
        }
    }

    /// Mutable typed view of a validated, writeable cache.
    ///
    /// # Safety
    /// As for `kv`, plus: nothing else reads or writes the array for `'a`.
    unsafe fn kv_mut<'a>(r: &Raw, dt: DType, numel: usize) -> KvMut<'a> {
        // SAFETY: per the function contract.
        unsafe {
            match dt {
                _ if numel == 0 => KvMut::F32(&mut []),
                DType::F32 => KvMut::F32(std::slice::from_raw_parts_mut(r.ptr as *mut f32, numel)),
                DType::F16 => KvMut::F16(std::slice::from_raw_parts_mut(r.ptr as *mut f16, numel)),
                DType::Bf16 => KvMut::Bf16(std::slice::from_raw_parts_mut(r.ptr as *mut bf16, numel)),
            }
        }
    }

    fn dim(name: &str, v: i64, min: i64) -> PyResult<usize> {
        if v < min || v > (1 << 40) {
            return Err(PyValueError::new_err(format!("{name} must be in [{min}, 2**40], got {v}")));
        }
        Ok(v as usize)
    }

    /// Zeroed `(k_cache, v_cache)`, each `[num_blocks, num_kv_heads, block_size, head_dim]`,
    /// every page touched up front.
    #[pyfunction]
    #[pyo3(signature = (num_blocks, block_size, num_kv_heads, head_dim, dtype = None),
           text_signature = "(num_blocks, block_size, num_kv_heads, head_dim, dtype='float16')")]
    pub fn new_kv_cache<'py>(
        py: Python<'py>,
        num_blocks: i64,
        block_size: i64,
        num_kv_heads: i64,
        head_dim: i64,
        dtype: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let shape = (
            dim("num_blocks", num_blocks, 0)?,
            dim("num_kv_heads", num_kv_heads, 1)?,
            dim("block_size", block_size, 1)?,
            dim("head_dim", head_dim, 1)?,
        );
        let np = py.import("numpy")?;
        let dt = match dtype {
            None => np.getattr("dtype")?.call1(("float16",))?,
            Some(d) if d.extract::<String>().is_ok_and(|s| s == "bfloat16") => {
                np.getattr("dtype")?.call1((py.import("ml_dtypes")?.getattr("bfloat16")?,))?
            }
            Some(d) => np
                .getattr("dtype")?
                .call1((d,))
                .map_err(|_| PyTypeError::new_err(format!("dtype must be 'float32', 'float16' or 'bfloat16', got {d}")))?,
        };
        let name: String = dt.getattr("name")?.extract()?;
        if !matches!(name.as_str(), "float32" | "float16" | "bfloat16") {
            return Err(PyValueError::new_err(format!("cache dtype must be float32, float16 or bfloat16, got {name}")));
        }
        // `empty` + an explicit zero fill rather than `zeros`: calloc'd pages would fault in on
        // their first write_kv, mid-serving (on this project's VMs first touch runs ~110 MB/s).
        let empty = np.getattr("empty")?;
        let k = empty.call1((shape, &dt))?;
        let v = empty.call1((shape, &dt))?;
        k.call_method1("fill", (0,))?;
        v.call_method1("fill", (0,))?;
        PyTuple::new(py, [k, v])
    }

    /// Scatter `key`/`value` `[T, num_kv_heads, head_dim]` float32 into `slot_mapping` (-1 = skip).
    #[pyfunction]
    pub fn write_kv(
        py: Python<'_>,
        k_cache: &Bound<'_, PyAny>,
        v_cache: &Bound<'_, PyAny>,
        key: &Bound<'_, PyAny>,
        value: &Bound<'_, PyAny>,
        slot_mapping: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let (kr, vr, dt, shape) = cache_pair_mut(k_cache, v_cache)?;
        let keyr = typed::<f32>(key, "key", 3, "float32")?;
        let valr = typed::<f32>(value, "value", 3, "float32")?;
        let slr = typed::<i64>(slot_mapping, "slot_mapping", 1, "int64")?;
        let want = [slr.shape[0], shape.num_kv_heads, shape.head_dim];
        if keyr.shape != want || valr.shape != want {
            return Err(PyValueError::new_err(format!(
                "key and value must be {want:?} (num_tokens, num_kv_heads, head_dim), got {:?} and {:?}",
                keyr.shape, valr.shape
            )));
        }
        for (r, n) in [(&keyr, "key"), (&valr, "value"), (&slr, "slot_mapping")] {
            if r.overlaps(&kr) || r.overlaps(&vr) {
                return Err(PyValueError::new_err(format!("{n} must not share memory with the caches")));
            }
        }
        let (kg, vg, sg) = (readonly::<f32>(&keyr, "key")?, readonly::<f32>(&valr, "value")?, readonly::<i64>(&slr, "slot_mapping")?);
        let (ks, vs, ss) = (slice_of(&kg, "key")?, slice_of(&vg, "value")?, slice_of(&sg, "slot_mapping")?);
        let numel = shape.numel().map_err(value_err)?;
        // SAFETY: both caches passed `cache_pair` (C-contiguous, aligned, `numel` items, disjoint)
        // and are writeable; key/value/slots are disjoint from them (checked above). The Bound
        // arrays outlive the call. As with any numpy kernel that releases the GIL, the caller
        // must not mutate these arrays from another thread during the call.
        let (km, vm) = unsafe { (kv_mut(&kr, dt, numel), kv_mut(&vr, dt, numel)) };
        py.detach(|| att::write_kv(km, vm, shape, ks, vs, ss)).map_err(value_err)
    }

    /// Copy whole blocks `(src, dst)` in order; `pairs` is int64 `[n, 2]` or a sequence of pairs.
    #[pyfunction]
    pub fn copy_blocks(
        py: Python<'_>,
        k_cache: &Bound<'_, PyAny>,
        v_cache: &Bound<'_, PyAny>,
        pairs: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let (kr, vr, dt, shape) = cache_pair_mut(k_cache, v_cache)?;
        let flat: Vec<i64> = if pairs.cast::<PyUntypedArray>().is_ok() {
            let pr = typed::<i64>(pairs, "pairs", 2, "int64")?;
            if pr.shape[1] != 2 {
                return Err(PyValueError::new_err(format!("pairs must be [n, 2], got {:?}", pr.shape)));
            }
            slice_of(&readonly::<i64>(&pr, "pairs")?, "pairs")?.to_vec()
        } else {
            let items: Vec<(i64, i64)> = pairs.extract().map_err(|_| {
                PyTypeError::new_err("pairs must be an int64 array [n, 2] or a sequence of (src, dst) int pairs")
            })?;
            items.into_iter().flat_map(|(a, b)| [a, b]).collect()
        };
        let numel = shape.numel().map_err(value_err)?;
        // SAFETY: as in `write_kv`; `flat` is owned.
        let (km, vm) = unsafe { (kv_mut(&kr, dt, numel), kv_mut(&vr, dt, numel)) };
        py.detach(|| att::copy_blocks(km, vm, shape, &flat)).map_err(value_err)
    }

    /// Causal varlen paged attention; returns `out` float32 `[num_tokens, num_q_heads, head_dim]`.
    #[pyfunction]
    #[pyo3(signature = (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *, scale = None,
                        sliding_window = None, soft_cap = None, out = None))]
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention<'py>(
        py: Python<'py>,
        q: &Bound<'py, PyAny>,
        k_cache: &Bound<'py, PyAny>,
        v_cache: &Bound<'py, PyAny>,
        block_tables: &Bound<'py, PyAny>,
        seq_lens: &Bound<'py, PyAny>,
        query_start_loc: &Bound<'py, PyAny>,
        scale: Option<f64>,
        sliding_window: Option<i64>,
        soft_cap: Option<f64>,
        out: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let (kr, vr, dt, shape) = cache_pair(k_cache, v_cache)?;
        let qr = typed::<f32>(q, "q", 3, "float32")?;
        let (t, hq, d) = (qr.shape[0], qr.shape[1], qr.shape[2]);
        if d != shape.head_dim {
            return Err(PyValueError::new_err(format!("q head_dim {d} != cache head_dim {}", shape.head_dim)));
        }
        if hq == 0 || hq % shape.num_kv_heads != 0 {
            return Err(PyValueError::new_err(format!(
                "num_q_heads ({hq}) must be a positive multiple of num_kv_heads ({})",
                shape.num_kv_heads
            )));
        }
        let btr = typed::<i32>(block_tables, "block_tables", 2, "int32")?;
        let slr = typed::<i32>(seq_lens, "seq_lens", 1, "int32")?;
        let qslr = typed::<i32>(query_start_loc, "query_start_loc", 1, "int32")?;
        let nseq = slr.shape[0];
        if btr.shape[0] != nseq || qslr.shape[0] != nseq + 1 {
            return Err(PyValueError::new_err(format!(
                "need block_tables [B, max_blocks], seq_lens [B], query_start_loc [B+1]; got {:?}, {:?}, {:?}",
                btr.shape, slr.shape, qslr.shape
            )));
        }
        let params = Params::new(d, scale, sliding_window, soft_cap).map_err(value_err)?;
        let out_obj = match out {
            Some(o) => o.clone(),
            None => PyArray::<f32, _>::zeros(py, [t, hq, d], false).into_any(),
        };
        let outr = typed::<f32>(&out_obj, "out", 3, "float32")?;
        if outr.shape != qr.shape {
            return Err(PyValueError::new_err(format!("out must have q's shape {:?}, got {:?}", qr.shape, outr.shape)));
        }
        for (r, n) in [(&qr, "q"), (&kr, "k_cache"), (&vr, "v_cache"), (&btr, "block_tables"), (&slr, "seq_lens"), (&qslr, "query_start_loc")] {
            if outr.overlaps(r) {
                return Err(PyValueError::new_err(format!("out must not share memory with {n}")));
            }
        }
        let (qg, btg, slg, qslg) = (
            readonly::<f32>(&qr, "q")?,
            readonly::<i32>(&btr, "block_tables")?,
            readonly::<i32>(&slr, "seq_lens")?,
            readonly::<i32>(&qslr, "query_start_loc")?,
        );
        let mut og = outr
            .arr
            .cast::<PyArrayDyn<f32>>()
            .map_err(|_| PyTypeError::new_err("out must be float32"))?
            .try_readwrite()
            .map_err(|e| PyValueError::new_err(format!("out must be writeable and not borrowed elsewhere: {e}")))?;
        let batch = Batch {
            q: slice_of(&qg, "q")?,
            num_q_heads: hq,
            block_tables: slice_of(&btg, "block_tables")?,
            max_blocks: btr.shape[1],
            seq_lens: slice_of(&slg, "seq_lens")?,
            query_start_loc: slice_of(&qslg, "query_start_loc")?,
        };
        let o = og.as_slice_mut().map_err(|e| PyValueError::new_err(format!("out: {e}")))?;
        let numel = shape.numel().map_err(value_err)?;
        // SAFETY: both caches passed `cache_pair` (C-contiguous, aligned, `numel` items) and are
        // only read; `out` is disjoint from them (checked above). The Bound arrays outlive the
        // call. As with any numpy kernel that releases the GIL, the caller must not mutate the
        // caches from another thread during the call.
        let (k, v) = unsafe { (kv(&kr, dt, numel), kv(&vr, dt, numel)) };
        py.detach(|| att::paged_attention(k, v, shape, batch, params, o)).map_err(value_err)?;
        drop(og);
        Ok(out_obj)
    }

    /// A weight matrix `[n, k]` in the block-quantized 8-bit layout of `rust/linear` (codes
    /// `c`, per-32 block `d`, `m`: `w = d*c + m`), applied as `x @ W.T` on the kernel threads.
    #[pyclass(frozen, module = "pagedkv_rs._core")]
    pub struct QLinear {
        w: std::sync::Arc<lin::QWeight>,
    }

    fn u8_2d<'py>(obj: &Bound<'py, PyAny>, name: &str) -> PyResult<(PyReadonlyArrayDyn<'py, u8>, Vec<usize>)> {
        let r = typed::<u8>(obj, name, 2, "uint8")?;
        Ok((readonly::<u8>(&r, name)?, r.shape))
    }

    fn f32_2d<'py>(obj: &Bound<'py, PyAny>, name: &str) -> PyResult<(PyReadonlyArrayDyn<'py, f32>, Vec<usize>)> {
        let r = typed::<f32>(obj, name, 2, "float32")?;
        Ok((readonly::<f32>(&r, name)?, r.shape))
    }

    #[pymethods]
    impl QLinear {
        /// From GGUF rows `data: uint8 [n, row_bytes]` of type `"Q4_1"` or `"Q8_0"` and width `k`.
        #[staticmethod]
        fn from_gguf(py: Python<'_>, data: &Bound<'_, PyAny>, ggml_type: &str, k: i64) -> PyResult<Self> {
            let (g, shape) = u8_2d(data, "data")?;
            let raw = slice_of(&g, "data")?;
            let k = dim("k", k, 1)?;
            let n = shape[0];
            let w = match ggml_type {
                "Q4_1" => py.detach(|| lin::QWeight::from_q4_1(raw, n, k)),
                "Q8_0" => py.detach(|| lin::QWeight::from_q8_0(raw, n, k)),
                _ => return Err(PyValueError::new_err(format!("ggml_type must be 'Q4_1' or 'Q8_0', got {ggml_type:?}"))),
            }
            .map_err(value_err)?;
            Ok(QLinear { w: std::sync::Arc::new(w) })
        }

        /// Quantize float32 weights `[n, k]` (k a multiple of 32) per 32-wide block, asymmetric 8-bit.
        #[staticmethod]
        fn from_float(py: Python<'_>, w: &Bound<'_, PyAny>) -> PyResult<Self> {
            let (g, shape) = f32_2d(w, "w")?;
            let v = slice_of(&g, "w")?;
            let q = py.detach(|| lin::QWeight::from_f32(v, shape[0], shape[1])).map_err(value_err)?;
            Ok(QLinear { w: std::sync::Arc::new(q) })
        }

        /// From `codes: uint8 [n, k]`, `d`, `m`: float32 `[n, k/32]` (the inverse of `unpack`).
        #[staticmethod]
        fn from_parts(codes: &Bound<'_, PyAny>, d: &Bound<'_, PyAny>, m: &Bound<'_, PyAny>) -> PyResult<Self> {
            let (cg, cs) = u8_2d(codes, "codes")?;
            let (dg, ds) = f32_2d(d, "d")?;
            let (mg, ms) = f32_2d(m, "m")?;
            if ds != ms || ds[0] != cs[0] || cs[1] != ds[1] * lin::QBLOCK {
                return Err(PyValueError::new_err(format!(
                    "need codes [n, k], d and m [n, k/{}]; got {cs:?}, {ds:?}, {ms:?}",
                    lin::QBLOCK
                )));
            }
            let q = lin::QWeight::from_parts(cs[0], cs[1], slice_of(&cg, "codes")?, slice_of(&dg, "d")?, slice_of(&mg, "m")?)
                .map_err(value_err)?;
            Ok(QLinear { w: std::sync::Arc::new(q) })
        }

        /// Output features.
        #[getter]
        fn n(&self) -> usize {
            self.w.n()
        }

        /// Input features.
        #[getter]
        fn k(&self) -> usize {
            self.w.k()
        }

        /// Bytes held (codes and scales).
        #[getter]
        fn nbytes(&self) -> usize {
            self.w.nbytes()
        }

        /// `(codes uint8 [n, k], d float32 [n, k/32], m float32 [n, k/32])`.
        fn unpack<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
            let (n, nb) = (self.w.n(), self.w.k() / lin::QBLOCK);
            let (c, d, m) = py.detach(|| self.w.unpack());
            let shaped = |v: Vec<f32>| numpy::ndarray::Array2::from_shape_vec((n, nb), v);
            let c = numpy::ndarray::Array2::from_shape_vec((n, self.w.k()), c)
                .map_err(|e| PyValueError::new_err(e.to_string()))?;
            let d = shaped(d).map_err(|e| PyValueError::new_err(e.to_string()))?;
            let m = shaped(m).map_err(|e| PyValueError::new_err(e.to_string()))?;
            PyTuple::new(py, [c.into_pyarray(py).into_any(), d.into_pyarray(py).into_any(), m.into_pyarray(py).into_any()])
        }

        /// `x @ W.T`: `x` float32 `[m, k]` -> float32 `[m, n]` (into `out` when given).
        #[pyo3(signature = (x, *, out = None))]
        fn __call__<'py>(&self, py: Python<'py>, x: &Bound<'py, PyAny>, out: Option<&Bound<'py, PyAny>>) -> PyResult<Bound<'py, PyAny>> {
            let xr = typed::<f32>(x, "x", 2, "float32")?;
            let (m, k) = (xr.shape[0], xr.shape[1]);
            if k != self.w.k() {
                return Err(PyValueError::new_err(format!("x must be [m, {}], got {:?}", self.w.k(), xr.shape)));
            }
            let n = self.w.n();
            let out_obj = out_f32(py, out, &[m, n], &[(&xr, "x")])?;
            let xg = readonly::<f32>(&xr, "x")?;
            let mut og = readwrite_f32(&out_obj, "out")?;
            let xs = slice_of(&xg, "x")?;
            let o = og.as_slice_mut().map_err(|e| PyValueError::new_err(format!("out: {e}")))?;
            let w = &self.w;
            py.detach(|| lin::linear(xs, m, w, o)).map_err(value_err)?;
            drop(og);
            Ok(out_obj)
        }

        fn __repr__(&self) -> String {
            format!("QLinear(n={}, k={}, isa={:?})", self.w.n(), self.w.k(), lin::active_isa().name())
        }
    }

    /// A writeable float32 output: `out` when given (checked: shape, writeable, disjoint from
    /// `inputs`), else a new zeroed array of `shape`.
    fn out_f32<'py>(py: Python<'py>, out: Option<&Bound<'py, PyAny>>, shape: &[usize], inputs: &[(&Raw, &str)]) -> PyResult<Bound<'py, PyAny>> {
        let obj = match out {
            Some(o) => o.clone(),
            None => PyArray::<f32, _>::zeros(py, shape.to_vec(), false).into_any(),
        };
        let r = typed::<f32>(&obj, "out", shape.len(), "float32")?;
        if r.shape != shape {
            return Err(PyValueError::new_err(format!("out must be {shape:?}, got {:?}", r.shape)));
        }
        for (i, name) in inputs {
            if r.overlaps(i) {
                return Err(PyValueError::new_err(format!("out must not share memory with {name}")));
            }
        }
        Ok(obj)
    }

    fn readwrite_f32<'py>(obj: &Bound<'py, PyAny>, name: &str) -> PyResult<numpy::PyReadwriteArrayDyn<'py, f32>> {
        obj.cast::<PyArrayDyn<f32>>()
            .map_err(|_| PyTypeError::new_err(format!("{name} must be float32")))?
            .try_readwrite()
            .map_err(|e| PyValueError::new_err(format!("{name} must be writeable and not borrowed elsewhere: {e}")))
    }

    /// RMSNorm of float32 `x [T, H]` times `weight [H]`; with `residual` (float32 `[T, H]`), first
    /// `residual += x` in place and normalise that (vLLM's fused_add_rms_norm). Returns `out`.
    #[pyfunction]
    #[pyo3(signature = (x, weight, eps, *, residual = None, out = None))]
    pub fn rms_norm<'py>(
        py: Python<'py>,
        x: &Bound<'py, PyAny>,
        weight: &Bound<'py, PyAny>,
        eps: f64,
        residual: Option<&Bound<'py, PyAny>>,
        out: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let xr = typed::<f32>(x, "x", 2, "float32")?;
        let wr = typed::<f32>(weight, "weight", 1, "float32")?;
        let h = xr.shape[1];
        if wr.shape[0] != h {
            return Err(PyValueError::new_err(format!("weight must be [{h}], got {:?}", wr.shape)));
        }
        let rr = residual.map(|r| typed::<f32>(r, "residual", 2, "float32")).transpose()?;
        let mut inputs = vec![(&xr, "x"), (&wr, "weight")];
        if let Some(r) = &rr {
            if r.shape != xr.shape {
                return Err(PyValueError::new_err(format!("residual must have x's shape {:?}, got {:?}", xr.shape, r.shape)));
            }
            if r.overlaps(&xr) || r.overlaps(&wr) {
                return Err(PyValueError::new_err("residual must not share memory with x or weight"));
            }
            inputs.push((r, "residual"));
        }
        let out_obj = out_f32(py, out, &xr.shape, &inputs)?;
        let (xg, wg) = (readonly::<f32>(&xr, "x")?, readonly::<f32>(&wr, "weight")?);
        let mut rg = residual.map(|r| readwrite_f32(r, "residual")).transpose()?;
        let mut og = readwrite_f32(&out_obj, "out")?;
        let (xs, ws) = (slice_of(&xg, "x")?, slice_of(&wg, "weight")?);
        let rs = match rg.as_mut() {
            Some(g) => Some(g.as_slice_mut().map_err(|e| PyValueError::new_err(format!("residual: {e}")))?),
            None => None,
        };
        let os = og.as_slice_mut().map_err(|e| PyValueError::new_err(format!("out: {e}")))?;
        py.detach(|| crate::ops::rms_norm(xs, h, ws, eps as f32, rs, os)).map_err(value_err)?;
        drop(og);
        Ok(out_obj)
    }

    /// SwiGLU activation: float32 `gate_up [T, 2F]` (gate columns, then up) -> `silu(gate) * up [T, F]`.
    #[pyfunction]
    #[pyo3(signature = (gate_up, *, out = None))]
    pub fn silu_and_mul<'py>(py: Python<'py>, gate_up: &Bound<'py, PyAny>, out: Option<&Bound<'py, PyAny>>) -> PyResult<Bound<'py, PyAny>> {
        let gr = typed::<f32>(gate_up, "gate_up", 2, "float32")?;
        if gr.shape[1] % 2 != 0 || gr.shape[1] == 0 {
            return Err(PyValueError::new_err(format!("gate_up must be [T, 2F], got {:?}", gr.shape)));
        }
        let f = gr.shape[1] / 2;
        let out_obj = out_f32(py, out, &[gr.shape[0], f], &[(&gr, "gate_up")])?;
        let gg = readonly::<f32>(&gr, "gate_up")?;
        let mut og = readwrite_f32(&out_obj, "out")?;
        let gs = slice_of(&gg, "gate_up")?;
        let os = og.as_slice_mut().map_err(|e| PyValueError::new_err(format!("out: {e}")))?;
        py.detach(|| crate::ops::silu_and_mul(gs, f, os)).map_err(value_err)?;
        drop(og);
        Ok(out_obj)
    }

    /// Use `"auto"` (best detected SIMD), `"scalar"` (the reference path), or force `"avx2"` /
    /// `"avx512"` (ValueError when this CPU lacks it; `kernel_info()["backends"]` lists them).
    #[pyfunction]
    pub fn set_kernel_backend(name: &str) -> PyResult<()> {
        att::set_backend(name).map_err(value_err)
    }

    /// Size the kernel thread pool.
    #[pyfunction]
    pub fn set_num_threads(n: i64) -> PyResult<()> {
        att::set_num_threads(usize::try_from(n).unwrap_or(0)).map_err(value_err)
    }

    #[pyfunction]
    pub fn get_num_threads() -> PyResult<usize> {
        att::num_threads().map_err(value_err)
    }

    /// Kernel configuration: backend, ISA detected and in use, threads, cache layout, and the
    /// backends `set_kernel_backend` accepts on this CPU.
    #[pyfunction]
    pub fn kernel_info(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("backend", att::backend())?;
        d.set_item("isa", att::active_isa(8).name())?;
        d.set_item("detected_isa", att::detected_isa().name())?;
        d.set_item("num_threads", att::num_threads().map_err(value_err)?)?;
        d.set_item("layout", "[num_blocks, num_kv_heads, block_size, head_dim]")?;
        d.set_item("linear_isa", crate::linear::active_isa().name())?;
        d.set_item("detected_linear_isa", crate::linear::detected_isa().name())?;
        d.set_item("build_profile", build_profile())?;
        let names: Vec<&str> = att::available_isas().iter().map(|i| i.backend_name()).collect();
        d.set_item("backends", names)?;
        Ok(d)
    }

    /// `"release"` or `"debug"`: benchmarks refuse a debug build.
    #[pyfunction]
    pub fn build_profile() -> &'static str {
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        }
    }

    fn threads_or_pool(threads: Option<i64>) -> PyResult<usize> {
        match threads {
            None => att::num_threads().map_err(value_err),
            Some(n) if (1..=1024).contains(&n) => Ok(n as usize),
            Some(n) => Err(PyValueError::new_err(format!("threads must be in [1, 1024], got {n}"))),
        }
    }

    /// Read bandwidth in GB/s: multithreaded SIMD read-sum over a `bytes` buffer, best of 5.
    #[pyfunction]
    #[pyo3(signature = (bytes = 1 << 30, threads = None), text_signature = "(bytes=1073741824, threads=None)")]
    pub fn memory_bandwidth(py: Python<'_>, bytes: i64, threads: Option<i64>) -> PyResult<f64> {
        let th = threads_or_pool(threads)?;
        if !(1 << 20..=1 << 36).contains(&bytes) {
            return Err(PyValueError::new_err(format!("bytes must be in [2**20, 2**36], got {bytes}")));
        }
        py.detach(|| att::probe::memory_bandwidth(bytes as usize, th)).map_err(value_err)
    }

    /// Peak fp32 FMA GFLOP/s over all threads, measured for `seconds`.
    #[pyfunction]
    #[pyo3(signature = (seconds = 0.2, threads = None))]
    pub fn fma_peak(py: Python<'_>, seconds: f64, threads: Option<i64>) -> PyResult<f64> {
        let th = threads_or_pool(threads)?;
        py.detach(|| att::probe::fma_peak(seconds, th)).map_err(value_err)
    }
}

pub use kernel::{
    QLinear, build_profile, rms_norm, silu_and_mul, copy_blocks, fma_peak, get_num_threads, kernel_info, memory_bandwidth, new_kv_cache, paged_attention,
    set_kernel_backend, set_num_threads, write_kv,
};
