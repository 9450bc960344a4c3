//! Paged attention, KV writes and block copies over a block-paged KV cache (no pyo3).
//!
//! | variant | file          | used when                                                          |
//! |---------|---------------|--------------------------------------------------------------------|
//! | scalar  | reference.rs  | forced (`set_backend("scalar")`, `PAGEDKV_KERNEL=scalar`), no AVX2, or head_dim % 8 != 0 |
//! | avx2    | x86.rs `attend` | AVX2 + FMA + F16C detected and no AVX-512 (or forced: `set_backend("avx2")`); head_dim % 8 == 0 |
//! | neon    | aarch64.rs `attend` | aarch64 (NEON is baseline), any head_dim; tested under qemu (`.ci/aarch64`), not yet benchmarked |
//! | avx512  | x86.rs `attend_avx512` | also AVX-512 F + VL + BW detected (or forced); the same code with 32 registers and wider register blocks, decode `acc += p v` in zmm when head_dim % 16 == 0 |
//!
//! `set_backend` / `PAGEDKV_KERNEL` take `auto`, `scalar`, `avx2`, `avx512`; `available_isas()`
//! is what this CPU runs, and the tests run every one of them against the reference.
//!
//! Layout: `k_cache`, `v_cache` are each `[num_blocks, num_kv_heads, block_size, head_dim]`,
//! row-major. A block is one contiguous stretch; each (block, kv_head) is a contiguous
//! `block_size * head_dim` tile, so a work item (one sequence, one KV head) streams whole tiles.
//! Slot `s` = block `s / block_size`, offset `s % block_size`. Element: f32, f16 or bf16.
//!
//! Work split: decode-like sequences (few query rows) get one item per sequence covering all
//! KV heads, so an item streams whole blocks (one contiguous stretch of K and of V per block;
//! random 4 KiB tiles measured ~2x slower to stream than 32 KiB blocks on this VM). Prefill
//! rows get one item per (sequence, KV head, chunk of rows). An item serves all query heads of
//! its GQA groups and all its rows with one pass over its keys. When there are fewer items than
//! `4 * threads`, each item's key range is split on block boundaries and the partial results
//! (unnormalised accumulator, running max, running sum) are merged by log-sum-exp.
//!
//! Tolerance (tests vs the float64 numpy reference): max abs error 2e-5 for f32 caches,
//! 1e-3 for f16, 8e-3 for bf16 (the cache values are exact in both; the difference is the
//! float32 accumulation and the SIMD exp).

#[cfg(target_arch = "aarch64")]
pub mod aarch64;
pub mod probe;
pub mod reference;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
pub mod x86;

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::error::{Error, Result};

/// Element type of a KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F32,
    F16,
    Bf16,
}

impl DType {
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F16 => "float16",
            DType::Bf16 => "bfloat16",
        }
    }
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::Bf16 => 2,
        }
    }
}

/// A cache element that widens to f32.
pub trait Elem: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
}
impl Elem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
}
impl Elem for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
}
impl Elem for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
}

/// Read-only view of one cache (K or V).
#[derive(Clone, Copy)]
pub enum Kv<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    Bf16(&'a [bf16]),
}

/// Mutable view of one cache (K or V).
pub enum KvMut<'a> {
    F32(&'a mut [f32]),
    F16(&'a mut [f16]),
    Bf16(&'a mut [bf16]),
}

impl Kv<'_> {
    pub fn dtype(&self) -> DType {
        match self {
            Kv::F32(_) => DType::F32,
            Kv::F16(_) => DType::F16,
            Kv::Bf16(_) => DType::Bf16,
        }
    }
    pub fn len(&self) -> usize {
        match self {
            Kv::F32(s) => s.len(),
            Kv::F16(s) => s.len(),
            Kv::Bf16(s) => s.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl KvMut<'_> {
    pub fn dtype(&self) -> DType {
        match self {
            KvMut::F32(_) => DType::F32,
            KvMut::F16(_) => DType::F16,
            KvMut::Bf16(_) => DType::Bf16,
        }
    }
    pub fn len(&self) -> usize {
        match self {
            KvMut::F32(s) => s.len(),
            KvMut::F16(s) => s.len(),
            KvMut::Bf16(s) => s.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Cache geometry `[num_blocks, num_kv_heads, block_size, head_dim]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheShape {
    pub num_blocks: usize,
    pub num_kv_heads: usize,
    pub block_size: usize,
    pub head_dim: usize,
}

impl CacheShape {
    /// Number of elements, or an error when it overflows or a dimension other than num_blocks is 0.
    pub fn numel(&self) -> Result<usize> {
        if self.num_kv_heads == 0 || self.block_size == 0 || self.head_dim == 0 {
            return Err(Error::Invalid(format!(
                "cache dimensions must be positive, got num_kv_heads={} block_size={} head_dim={}",
                self.num_kv_heads, self.block_size, self.head_dim
            )));
        }
        [self.num_kv_heads, self.block_size, self.head_dim]
            .iter()
            .try_fold(self.num_blocks, |a, &b| a.checked_mul(b))
            .ok_or_else(|| Error::Invalid("cache size overflows".into()))
    }
    /// Elements in one block (all its KV heads).
    #[inline]
    pub fn block_numel(&self) -> usize {
        self.num_kv_heads * self.block_size * self.head_dim
    }
    /// Offset of the first element of key position `offset` in (block, kv_head)'s tile.
    #[inline]
    pub fn offset(&self, block: usize, kv_head: usize, offset: usize) -> usize {
        ((block * self.num_kv_heads + kv_head) * self.block_size + offset) * self.head_dim
    }
}

/// One varlen batch of queries plus its block tables (the arrays `prepare_batch` returns).
#[derive(Clone, Copy)]
pub struct Batch<'a> {
    /// `[num_tokens, num_q_heads, head_dim]` f32.
    pub q: &'a [f32],
    pub num_q_heads: usize,
    /// `[B, max_blocks]`, -1 padded.
    pub block_tables: &'a [i32],
    pub max_blocks: usize,
    /// `[B]`.
    pub seq_lens: &'a [i32],
    /// `[B + 1]`.
    pub query_start_loc: &'a [i32],
}

/// Scalar attention options.
#[derive(Clone, Copy, Debug)]
pub struct Params {
    pub scale: f32,
    /// Attend only the last `w` positions (including the query's own).
    pub sliding_window: Option<usize>,
    /// `logits = cap * tanh(logits / cap)` after scaling.
    pub soft_cap: Option<f32>,
}

impl Params {
    pub fn new(
        head_dim: usize,
        scale: Option<f64>,
        sliding_window: Option<i64>,
        soft_cap: Option<f64>,
    ) -> Result<Self> {
        let scale = scale.unwrap_or(1.0 / (head_dim as f64).sqrt());
        if !(scale as f32).is_finite() {
            return Err(Error::Invalid(format!("scale must be finite in float32, got {scale}")));
        }
        let sliding_window = match sliding_window {
            None => None,
            Some(w) if w >= 1 => Some(usize::try_from(w).unwrap_or(usize::MAX)),
            Some(w) => return Err(Error::Invalid(format!("sliding_window must be >= 1, got {w}"))),
        };
        let soft_cap = match soft_cap {
            None => None,
            Some(c) if (c as f32).is_finite() && c as f32 > 0.0 => Some(c as f32),
            Some(c) => {
                return Err(Error::Invalid(format!(
                    "soft_cap must be a finite float32 > 0, got {c}"
                )))
            }
        };
        Ok(Params {
            scale: scale as f32,
            sliding_window,
            soft_cap,
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Backend selection: one dispatch point (`attend`), a forced-scalar switch.

/// Instruction set a kernel call runs with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    Scalar,
    Avx2,
    /// The AVX2 kernel compiled with AVX-512 F/VL/BW enabled: 32 registers and wider register
    /// blocks; 256-bit except the decode `acc += p v`, which is 512-bit when head_dim % 16 == 0.
    Avx512,
    /// aarch64 NEON (any head_dim).
    Neon,
}

impl Isa {
    /// What `kernel_info()` reports.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2+fma+f16c",
            Isa::Avx512 => "avx512f+vl+bw",
            Isa::Neon => "neon",
        }
    }
    /// The `set_backend` name that forces this ISA.
    pub fn backend_name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Neon => "neon",
        }
    }
    /// Whether this CPU can run it (runtime detection).
    pub fn available(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 =
                is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c");
            match self {
                Isa::Scalar => true,
                Isa::Avx2 => avx2,
                Isa::Avx512 => {
                    avx2 && is_x86_feature_detected!("avx512f")
                        && is_x86_feature_detected!("avx512vl")
                        && is_x86_feature_detected!("avx512bw")
                }
                Isa::Neon => false,
            }
        }
        #[cfg(target_arch = "aarch64")]
        {
            match self {
                Isa::Scalar => true,
                Isa::Neon => std::arch::is_aarch64_feature_detected!("neon"),
                _ => false,
            }
        }
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
        {
            self == Isa::Scalar
        }
    }
}

const ISAS: [Isa; 4] = [Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Neon];

/// Every ISA this CPU can run, scalar first (what tests iterate over).
pub fn available_isas() -> Vec<Isa> {
    ISAS.into_iter().filter(|i| i.available()).collect()
}

/// Backend state: 0 unset (read `PAGEDKV_KERNEL` on first use), 1 auto, 2 + index in `ISAS` forced.
const BACKEND_UNSET: u8 = 0;
const BACKEND_AUTO: u8 = 1;
static BACKEND: AtomicU8 = AtomicU8::new(BACKEND_UNSET);

fn parse_backend(name: &str) -> Result<u8> {
    if name == "auto" {
        return Ok(BACKEND_AUTO);
    }
    let Some(i) = ISAS.iter().position(|isa| isa.backend_name() == name) else {
        return Err(Error::Invalid(format!(
            "kernel backend must be 'auto', 'scalar', 'avx2' or 'avx512', got {name:?}"
        )));
    };
    if !ISAS[i].available() {
        return Err(Error::Invalid(format!(
            "kernel backend {name:?} is not supported by this CPU"
        )));
    }
    Ok(2 + i as u8)
}

fn backend_state() -> u8 {
    match BACKEND.load(Ordering::Relaxed) {
        BACKEND_UNSET => {
            // An unknown or unsupported value means auto (import must not fail on it).
            let env = std::env::var("PAGEDKV_KERNEL")
                .unwrap_or_default()
                .trim()
                .to_ascii_lowercase();
            let s = parse_backend(&env).unwrap_or(BACKEND_AUTO);
            BACKEND.store(s, Ordering::Relaxed);
            s
        }
        s => s,
    }
}

/// Select the kernel backend: `"auto"` (best detected ISA), `"scalar"` (the reference path), or
/// force `"avx2"` / `"avx512"` (an error when this CPU lacks it).
pub fn set_backend(name: &str) -> Result<()> {
    BACKEND.store(parse_backend(name)?, Ordering::Relaxed);
    Ok(())
}

/// `"auto"`, `"scalar"`, `"avx2"` or `"avx512"`.
pub fn backend() -> &'static str {
    match backend_state() {
        s if s >= 2 => ISAS[(s - 2) as usize].backend_name(),
        _ => "auto",
    }
}

/// Best ISA this CPU supports.
pub fn detected_isa() -> Isa {
    ISAS.into_iter().rev().find(|i| i.available()).unwrap_or(Isa::Scalar)
}

/// ISA the next call with this head_dim runs with.
pub fn active_isa(head_dim: usize) -> Isa {
    let isa = match backend_state() {
        s if s >= 2 => ISAS[(s - 2) as usize],
        _ => detected_isa(),
    };
    if head_dim % 8 != 0 && isa != Isa::Neon {
        Isa::Scalar
    } else {
        isa
    }
}

// ---------------------------------------------------------------------------------------------
// Thread pool.

static POOL: Mutex<Option<Arc<rayon::ThreadPool>>> = Mutex::new(None);

fn build_pool(n: usize) -> Result<Arc<rayon::ThreadPool>> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .thread_name(|i| format!("pagedkv-{i}"))
        .build()
        .map(Arc::new)
        .map_err(|e| Error::Invalid(format!("cannot start {n} threads: {e}")))
}

/// The kernel thread pool (default: one thread per available core).
pub fn pool() -> Result<Arc<rayon::ThreadPool>> {
    let mut g = POOL.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = g.as_ref() {
        return Ok(p.clone());
    }
    let n = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let p = build_pool(n)?;
    *g = Some(p.clone());
    Ok(p)
}

/// Replace the kernel thread pool with one of `n` threads.
pub fn set_num_threads(n: usize) -> Result<()> {
    if n == 0 || n > 1024 {
        return Err(Error::Invalid(format!("num_threads must be in [1, 1024], got {n}")));
    }
    let p = build_pool(n)?;
    *POOL.lock().unwrap_or_else(|e| e.into_inner()) = Some(p);
    Ok(())
}

pub fn num_threads() -> Result<usize> {
    Ok(pool()?.current_num_threads())
}

// ---------------------------------------------------------------------------------------------
// Work items.

/// Query vectors per item when prefill rows are chunked: rows * group <= this.
const ITEM_QUERIES: usize = 64;
/// Split the key range only while a piece keeps at least this many keys.
const MIN_SPLIT_KEYS: usize = 256;

/// One unit of work: query rows `row0..row1` (all of one sequence) times the query heads of KV
/// heads `h0..h1`, over key positions `key_lo..key_hi` of that sequence. Query vector `m` of a
/// unit is row `row0 + m / (nh * group)`, query head `h0 * group + m % (nh * group)`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Unit {
    pub seq: usize,
    pub h0: usize,
    pub h1: usize,
    pub row0: usize,
    pub row1: usize,
    /// Position of row `row0`; row r sits at `pos0 + (r - row0)`.
    pub pos0: usize,
    pub key_lo: usize,
    pub key_hi: usize,
}

impl Unit {
    /// Query vectors per row.
    #[inline]
    pub fn per_row(&self, group: usize) -> usize {
        (self.h1 - self.h0) * group
    }
    #[inline]
    pub fn queries(&self, group: usize) -> usize {
        (self.row1 - self.row0) * self.per_row(group)
    }
}

/// Everything a backend reads.
#[derive(Clone, Copy)]
pub(crate) struct Ctx<'a> {
    pub k: Kv<'a>,
    pub v: Kv<'a>,
    pub shape: CacheShape,
    pub batch: Batch<'a>,
    pub params: Params,
    pub group: usize,
}

impl Ctx<'_> {
    /// Block id holding key position `t` of sequence `seq` (validated: in range).
    #[inline]
    pub fn block(&self, seq: usize, t: usize) -> usize {
        self.batch.block_tables[seq * self.batch.max_blocks + t / self.shape.block_size] as usize
    }
    /// Query vectors of row `row` for the query heads of KV heads `u.h0..u.h1`, `[nh * group, d]`.
    #[inline]
    pub fn q_row(&self, row: usize, u: &Unit) -> &[f32] {
        let d = self.shape.head_dim;
        let base = (row * self.batch.num_q_heads + u.h0 * self.group) * d;
        &self.batch.q[base..base + u.per_row(self.group) * d]
    }
    /// Keys row at position `p` may attend within `lo..hi`.
    #[inline]
    pub fn key_range(&self, p: usize, lo: usize, hi: usize) -> (usize, usize) {
        let lo = match self.params.sliding_window {
            Some(w) => lo.max((p + 1).saturating_sub(w)),
            None => lo,
        };
        (lo, hi.min(p + 1))
    }
}

/// Partial attention of one unit: per query vector m (row-major over rows, then group heads),
/// `acc[m]` = sum of exp(s - max[m]) * v, `sum[m]` = sum of exp(s - max[m]).
pub(crate) struct State {
    pub acc: Vec<f32>,
    pub max: Vec<f32>,
    pub sum: Vec<f32>,
}

impl State {
    pub fn new(queries: usize, head_dim: usize) -> Self {
        State {
            acc: vec![0.0; queries * head_dim],
            max: vec![f32::NEG_INFINITY; queries],
            sum: vec![0.0; queries],
        }
    }
}

/// The one dispatch point.
fn attend(isa: Isa, ctx: &Ctx, u: &Unit, st: &mut State) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            // SAFETY: `paged_attention_with` asserted `isa.available()` (avx2, fma and f16c detected
            // at runtime) and uses a SIMD isa only for head_dim % 8 == 0; ctx was validated there.
            unsafe { x86::attend(ctx, u, st) }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => {
            // SAFETY: as for Avx2; `available()` also detected avx512f, avx512vl and avx512bw.
            unsafe { x86::attend_avx512(ctx, u, st) }
        }
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => {
            // SAFETY: `paged_attention_with` asserted `isa.available()` (NEON detected); ctx was
            // validated there; the NEON unit handles any head_dim.
            unsafe { aarch64::attend(ctx, u, st) }
        }
        _ => reference::attend(ctx, u, st),
    }
}

/// Check every input of `paged_attention`; after this all indexing in the kernels is in range.
pub fn validate(k: &Kv, v: &Kv, shape: &CacheShape, b: &Batch, out_len: usize) -> Result<()> {
    let inval = |m: String| Err(Error::Invalid(m));
    let numel = shape.numel()?;
    if k.dtype() != v.dtype() {
        return inval(format!(
            "k_cache is {} but v_cache is {}",
            k.dtype().name(),
            v.dtype().name()
        ));
    }
    if k.len() != numel || v.len() != numel {
        return inval(format!(
            "k_cache/v_cache hold {}/{} elements, expected {numel}",
            k.len(),
            v.len()
        ));
    }
    let (hq, hkv, d) = (b.num_q_heads, shape.num_kv_heads, shape.head_dim);
    if hq == 0 || hq % hkv != 0 {
        return inval(format!(
            "num_q_heads ({hq}) must be a positive multiple of num_kv_heads ({hkv})"
        ));
    }
    let row = hq * d;
    if b.q.len() % row != 0 {
        return inval(format!(
            "q holds {} elements, not a multiple of num_q_heads*head_dim = {row}",
            b.q.len()
        ));
    }
    let num_tokens = b.q.len() / row;
    if out_len != b.q.len() {
        return inval(format!("out holds {out_len} elements, q holds {}", b.q.len()));
    }
    let nseq = b.seq_lens.len();
    if b.query_start_loc.len() != nseq + 1 {
        return inval(format!(
            "query_start_loc must have {} entries (B+1), got {}",
            nseq + 1,
            b.query_start_loc.len()
        ));
    }
    if b.block_tables.len() != nseq * b.max_blocks {
        return inval(format!("block_tables must be [{nseq}, max_blocks]"));
    }
    if b.query_start_loc[0] != 0 {
        return inval(format!("query_start_loc[0] must be 0, got {}", b.query_start_loc[0]));
    }
    if b.query_start_loc[nseq] as i64 != num_tokens as i64 {
        return inval(format!(
            "query_start_loc[-1] = {} but q has {num_tokens} tokens",
            b.query_start_loc[nseq]
        ));
    }
    for i in 0..nseq {
        let (a, z) = (b.query_start_loc[i], b.query_start_loc[i + 1]);
        if z < a {
            return inval(format!(
                "query_start_loc must not decrease: [{i}]={a} > [{}]={z}",
                i + 1
            ));
        }
        let (q_len, seq_len) = ((z - a) as i64, b.seq_lens[i] as i64);
        if seq_len < 0 {
            return inval(format!("seq_lens[{i}] = {seq_len} is negative"));
        }
        if q_len > seq_len {
            return inval(format!("sequence {i}: q_len {q_len} > seq_len {seq_len}"));
        }
        let need = (seq_len as usize).div_ceil(shape.block_size);
        if need > b.max_blocks {
            return inval(format!(
                "sequence {i}: seq_len {seq_len} needs {need} blocks, block_tables has {} columns",
                b.max_blocks
            ));
        }
        let row = &b.block_tables[i * b.max_blocks..i * b.max_blocks + need];
        if let Some((j, &id)) = row
            .iter()
            .enumerate()
            .find(|(_, &id)| id < 0 || id as usize >= shape.num_blocks)
        {
            return inval(format!(
                "block_tables[{i}, {j}] = {id} is not a block id in [0, {}) (sequence {i} uses {need} blocks)",
                shape.num_blocks
            ));
        }
    }
    Ok(())
}

/// Attention of every query row over its sequence's paged keys; writes `out` `[num_tokens, Hq, D]`.
pub fn paged_attention(k: Kv, v: Kv, shape: CacheShape, b: Batch, params: Params, out: &mut [f32]) -> Result<()> {
    let pool = pool()?;
    let threads = pool.current_num_threads();
    pool.install(|| paged_attention_with(active_isa(shape.head_dim), threads, k, v, shape, b, params, out))
}

/// `paged_attention` with an explicit ISA and the thread count the work split plans for
/// (runs on the current rayon pool).
#[allow(clippy::too_many_arguments)]
pub(crate) fn paged_attention_with(
    isa: Isa,
    threads: usize,
    k: Kv,
    v: Kv,
    shape: CacheShape,
    b: Batch,
    params: Params,
    out: &mut [f32],
) -> Result<()> {
    validate(&k, &v, &shape, &b, out.len())?;
    assert!(isa.available(), "{isa:?} is not supported by this CPU");
    let isa = if shape.head_dim % 8 != 0 { Isa::Scalar } else { isa };
    let ctx = Ctx {
        k,
        v,
        shape,
        batch: b,
        params,
        group: b.num_q_heads / shape.num_kv_heads,
    };
    let units = plan(&ctx, threads);
    run(isa, &ctx, &units, out);
    Ok(())
}

/// Items (then their key-range splits when items are fewer than 4 per thread).
/// Returns units grouped per item: `units[i]` are the pieces of item i.
fn plan(ctx: &Ctx, threads: usize) -> Vec<Vec<Unit>> {
    let b = &ctx.batch;
    let rows_per = (ITEM_QUERIES / ctx.group).max(1);
    let mut items = Vec::new();
    for seq in 0..b.seq_lens.len() {
        let (r0, r1) = (b.query_start_loc[seq] as usize, b.query_start_loc[seq + 1] as usize);
        let seq_len = b.seq_lens[seq] as usize;
        let first_pos = seq_len - (r1 - r0);
        // Few rows (decode): one unit reads whole blocks (all KV heads: one contiguous stretch
        // of K and one of V per block). Many rows (prefill): one unit per KV head and row chunk.
        let hkv = ctx.shape.num_kv_heads;
        let (step, rows_per) = if (r1 - r0) * hkv * ctx.group <= ITEM_QUERIES * 4 {
            (hkv, r1 - r0)
        } else {
            (1, rows_per)
        };
        for h0 in (0..hkv).step_by(step) {
            let mut r = r0;
            while r < r1 {
                let re = (r + rows_per).min(r1);
                let pos0 = first_pos + (r - r0);
                let (key_lo, _) = ctx.key_range(pos0, 0, seq_len);
                let key_hi = pos0 + (re - r);
                items.push(Unit {
                    seq,
                    h0,
                    h1: h0 + step,
                    row0: r,
                    row1: re,
                    pos0,
                    key_lo,
                    key_hi,
                });
                r = re;
            }
        }
    }
    let target = 4 * threads;
    if items.is_empty() || items.len() >= target {
        return items.into_iter().map(|u| vec![u]).collect();
    }
    let want = target.div_ceil(items.len());
    let bs = ctx.shape.block_size;
    items
        .into_iter()
        .map(|u| {
            let n = u.key_hi - u.key_lo;
            let pieces = want.min(n / MIN_SPLIT_KEYS).max(1);
            if pieces == 1 {
                return vec![u];
            }
            // Cut points rounded to block boundaries so no tile straddles two pieces' blocks.
            let mut cuts = vec![u.key_lo];
            for j in 1..pieces {
                let c = (u.key_lo + n * j / pieces) / bs * bs;
                if c > *cuts.last().unwrap_or(&0) && c < u.key_hi {
                    cuts.push(c);
                }
            }
            cuts.push(u.key_hi);
            cuts.windows(2)
                .map(|w| Unit {
                    key_lo: w[0],
                    key_hi: w[1],
                    ..u
                })
                .collect()
        })
        .collect()
}

/// Raw `out` pointer shared by the workers; each unit writes a disjoint set of (row, head) vectors.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: the pointer is only used to write the disjoint regions described in `write_out`.
unsafe impl Send for OutPtr {}
// SAFETY: as above; no two threads write the same element.
unsafe impl Sync for OutPtr {}

/// Write normalised rows of one item into out.
///
/// # Safety
/// `out` points to `num_tokens * num_q_heads * head_dim` f32 and no other thread writes the
/// (row0..row1, heads of h0..h1) vectors of this item concurrently.
unsafe fn write_out(ctx: &Ctx, u: &Unit, acc: &[f32], sum: &[f32], out: OutPtr) {
    let (g, d) = (ctx.group, ctx.shape.head_dim);
    let pr = u.per_row(g);
    for (i, row) in (u.row0..u.row1).enumerate() {
        let base = (row * ctx.batch.num_q_heads + u.h0 * g) * d;
        // SAFETY: base + pr*d <= num_tokens*hq*d since row < num_tokens and h1*g <= hq
        // (validated); exclusivity per the function contract.
        let dst = unsafe { std::slice::from_raw_parts_mut(out.0.add(base), pr * d) };
        for h in 0..pr {
            let m = i * pr + h;
            let inv = if sum[m] > 0.0 { 1.0 / sum[m] } else { 0.0 };
            for (o, a) in dst[h * d..(h + 1) * d].iter_mut().zip(&acc[m * d..(m + 1) * d]) {
                *o = a * inv;
            }
        }
    }
}

fn run(isa: Isa, ctx: &Ctx, units: &[Vec<Unit>], out: &mut [f32]) {
    use rayon::prelude::*;
    let d = ctx.shape.head_dim;
    let optr = OutPtr(out.as_mut_ptr());
    let flat: Vec<(usize, Unit)> = units
        .iter()
        .enumerate()
        .flat_map(|(i, us)| us.iter().map(move |u| (i, *u)))
        .collect();
    let partials: Vec<Option<(usize, State)>> = flat
        .par_iter()
        .with_max_len(1)
        .map(|&(i, u)| {
            let mut st = State::new(u.queries(ctx.group), d);
            attend(isa, ctx, &u, &mut st);
            if units[i].len() == 1 {
                // SAFETY: `out` has the validated length and items cover disjoint (row, head) sets.
                unsafe { write_out(ctx, &u, &st.acc, &st.sum, optr) };
                None
            } else {
                Some((i, st))
            }
        })
        .collect();
    // Log-sum-exp merge of split items (few by construction).
    let mut merged: Vec<Option<State>> = (0..units.len()).map(|_| None).collect();
    for (i, st) in partials.into_iter().flatten() {
        match &mut merged[i] {
            None => merged[i] = Some(st),
            Some(m) => merge(m, &st, d),
        }
    }
    for (i, st) in merged.into_iter().enumerate() {
        if let Some(st) = st {
            // SAFETY: sequential here; same region argument as above.
            unsafe { write_out(ctx, &units[i][0], &st.acc, &st.sum, optr) };
        }
    }
}

/// `a <- a (+) b` in log-sum-exp form.
pub(crate) fn merge(a: &mut State, b: &State, d: usize) {
    for m in 0..a.max.len() {
        let mx = a.max[m].max(b.max[m]);
        if mx == f32::NEG_INFINITY {
            continue;
        }
        let wa = (a.max[m] - mx).exp();
        let wb = (b.max[m] - mx).exp();
        a.sum[m] = a.sum[m] * wa + b.sum[m] * wb;
        for (x, y) in a.acc[m * d..(m + 1) * d].iter_mut().zip(&b.acc[m * d..(m + 1) * d]) {
            *x = *x * wa + *y * wb;
        }
        a.max[m] = mx;
    }
}

// ---------------------------------------------------------------------------------------------
// Cache writes.

fn check_cache_pair(k: &KvMut, v: &KvMut, shape: &CacheShape) -> Result<usize> {
    let numel = shape.numel()?;
    if k.dtype() != v.dtype() {
        return Err(Error::Invalid(format!(
            "k_cache is {} but v_cache is {}",
            k.dtype().name(),
            v.dtype().name()
        )));
    }
    if k.len() != numel || v.len() != numel {
        return Err(Error::Invalid(format!(
            "k_cache/v_cache hold {}/{} elements, expected {numel}",
            k.len(),
            v.len()
        )));
    }
    Ok(numel)
}

/// Scatter `key`/`value` `[T, num_kv_heads, head_dim]` f32 into slots `slots` `[T]` (-1 = skip).
pub fn write_kv<'a>(
    mut k: KvMut<'a>,
    mut v: KvMut<'a>,
    shape: CacheShape,
    key: &[f32],
    value: &[f32],
    slots: &[i64],
) -> Result<()> {
    check_cache_pair(&k, &v, &shape)?;
    let (hkv, bs, d) = (shape.num_kv_heads, shape.block_size, shape.head_dim);
    let tok = hkv * d;
    if key.len() != slots.len() * tok || value.len() != slots.len() * tok {
        return Err(Error::Invalid(format!(
            "key/value must be [{}, {hkv}, {d}] ({} elements), got {} and {}",
            slots.len(),
            slots.len() * tok,
            key.len(),
            value.len()
        )));
    }
    let nslots = shape.num_blocks * bs;
    if let Some((t, &s)) = slots.iter().enumerate().find(|(_, &s)| s < -1 || s >= nslots as i64) {
        return Err(Error::Invalid(format!(
            "slot_mapping[{t}] = {s} is not -1 or a slot in [0, {nslots})"
        )));
    }
    // One head row (head_dim values) at a time; `conv` converts a whole row (half's slice
    // conversion uses F16C when the CPU has it, detected at run time).
    fn scatter<T>(dst: &mut [T], src: &[f32], slots: &[i64], shape: &CacheShape, conv: fn(&mut [T], &[f32])) {
        let (hkv, bs, d) = (shape.num_kv_heads, shape.block_size, shape.head_dim);
        for (t, &s) in slots.iter().enumerate() {
            if s < 0 {
                continue;
            }
            let (blk, off) = (s as usize / bs, s as usize % bs);
            for h in 0..hkv {
                let o = shape.offset(blk, h, off);
                conv(&mut dst[o..o + d], &src[(t * hkv + h) * d..(t * hkv + h + 1) * d]);
            }
        }
    }
    for (cache, src) in [(&mut k, key), (&mut v, value)] {
        match cache {
            KvMut::F32(c) => scatter(c, src, slots, &shape, <[f32]>::copy_from_slice),
            KvMut::F16(c) => scatter(c, src, slots, &shape, HalfFloatSliceExt::convert_from_f32_slice),
            KvMut::Bf16(c) => scatter(c, src, slots, &shape, HalfFloatSliceExt::convert_from_f32_slice),
        }
    }
    Ok(())
}

/// Copy whole blocks, `pairs` = flat `[n, 2]` (src, dst), applied in order.
pub fn copy_blocks<'a>(mut k: KvMut<'a>, mut v: KvMut<'a>, shape: CacheShape, pairs: &[i64]) -> Result<()> {
    check_cache_pair(&k, &v, &shape)?;
    if pairs.len() % 2 != 0 {
        return Err(Error::Invalid("pairs must be [n, 2]".into()));
    }
    let nb = shape.num_blocks as i64;
    if let Some((j, &id)) = pairs.iter().enumerate().find(|(_, &id)| id < 0 || id >= nb) {
        return Err(Error::Invalid(format!(
            "pairs[{}, {}] = {id} is not a block id in [0, {nb})",
            j / 2,
            j % 2
        )));
    }
    let n = shape.block_numel();
    fn copy<T: Copy>(c: &mut [T], pairs: &[i64], n: usize) {
        for p in pairs.chunks_exact(2) {
            let (s, d) = (p[0] as usize, p[1] as usize);
            if s != d {
                c.copy_within(s * n..(s + 1) * n, d * n);
            }
        }
    }
    for cache in [&mut k, &mut v] {
        match cache {
            KvMut::F32(c) => copy(c, pairs, n),
            KvMut::F16(c) => copy(c, pairs, n),
            KvMut::Bf16(c) => copy(c, pairs, n),
        }
    }
    Ok(())
}
