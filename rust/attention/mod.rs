//! Paged attention over a block-paged KV cache (no pyo3): types, layout, validation, dispatch.
//!
//! | variant | file          | used when (`runtime::isa()`)                                       |
//! |---------|---------------|--------------------------------------------------------------------|
//! | scalar  | reference.rs  | ISA `scalar` (`set_isa("scalar")`, `PAGEDKV_ISA=scalar`), no AVX2, or head_dim % 8 != 0 |
//! | avx2    | x86/ `attend` | ISA `avx2`: AVX2 + FMA + F16C detected and no AVX-512, or forced; head_dim % 8 == 0 |
//! | neon    | aarch64.rs `attend` | aarch64 (NEON is baseline); tested under qemu (`.ci/aarch64`), not yet benchmarked |
//! | avx512  | x86/ `attend_avx512` | ISA `avx512`: also AVX-512 F + VL + BW detected (or forced); the same code with 32 registers and wider register blocks, zmm kernels when head_dim % 16 == 0 |
//!
//! The ISA setting and the thread pool live in `runtime`; `runtime::available_isas()` is what
//! this CPU runs, and the tests run every one of them against the reference. `plan.rs` splits a
//! batch into work units (`Plan`: one step's split, checked once, for every layer with its window)
//! and merges split ones; `cache.rs` writes, copies and loads cache blocks.
//!
//! Layout: `k_cache`, `v_cache` are each `[num_blocks, num_kv_heads, block_size, head_dim]`,
//! row-major. A block is one contiguous stretch; each (block, kv_head) is a contiguous
//! `block_size * head_dim` tile, so a work item (one sequence, one KV head) streams whole tiles.
//! Slot `s` = block `s / block_size`, offset `s % block_size`. Element: f32, f16 or bf16.
//!
//! Work split: decode-like sequences (few query rows) get one item per sequence covering all
//! KV heads, so an item streams whole blocks (one contiguous stretch of K and of V per block;
//! random 4 KiB tiles stream at about half the rate of whole blocks: small random chunks defeat
//! the hardware prefetchers). Prefill rows get one item per (sequence, KV head, chunk of rows).
//! An item serves all query heads of its GQA groups and all its rows with one pass over its keys.
//! When there are fewer items than `4 * threads`, each item's key range is split on block
//! boundaries and the partial results (unnormalised accumulator, running max, running sum) are
//! merged by log-sum-exp.
//!
//! Tolerance (tests vs the float64 numpy reference): max abs error 2e-5 for f32 caches,
//! 1e-3 for f16, 8e-3 for bf16 (the cache values are exact in both; the difference is the
//! float32 accumulation and the SIMD exp).

#[cfg(target_arch = "aarch64")]
pub mod aarch64;
mod cache;
mod plan;
pub mod reference;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
pub mod x86;

use half::{bf16, f16};

pub use cache::{copy_blocks, write_blocks, write_kv};
use plan::run_planned;
pub use plan::Plan;
pub(crate) use plan::Unit;

use crate::error::{Error, Result};
use crate::runtime::{self, Isa};

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

/// One step's batch as the kernels read it: the arrays of `BatchInputs` (`block_table.rs` builds
/// them, `rust/py` reads them by name), borrowed. `positions` and `slot_mapping` are the decoder's
/// (its checks and `write_kv`); the standalone `paged_attention` reads only the tables and leaves
/// them empty. The query rows are not part of it: each layer brings its own (`Queries`).
///
/// Two table forms: padded (`indptr` None): `block_tables` is `[B, max_blocks]`, -1 padded, each
/// row holding at least `ceil(seq_len / block_size)` ids; CSR (`indptr` `[B + 1]`, as FlashInfer's
/// `kv_indptr` / `kv_indices`): `block_tables` is the flat `indices`, sequence i's blocks are
/// `block_tables[indptr[i]..indptr[i + 1]]`, exactly `ceil(seq_len / block_size)` of them, and
/// `max_blocks` is not read. Both give the same blocks, so the same results bit for bit.
#[derive(Clone, Copy)]
pub struct Batch<'a> {
    /// `[T]` positions of the step's tokens, `[T]` their cache slots (-1 = do not write).
    pub positions: &'a [i64],
    pub slot_mapping: &'a [i64],
    /// `[B, max_blocks]`, -1 padded; or, with `indptr`, the CSR `indices`.
    pub block_tables: &'a [i32],
    pub max_blocks: usize,
    /// `[B + 1]` CSR row offsets into `block_tables` (None: the padded form).
    pub indptr: Option<&'a [i32]>,
    /// `[B]`.
    pub seq_lens: &'a [i32],
    /// `[B + 1]`.
    pub query_start_loc: &'a [i32],
}

impl Batch<'_> {
    /// Where sequence `seq`'s row of block ids starts in `block_tables`.
    #[inline]
    pub fn row_start(&self, seq: usize) -> usize {
        match self.indptr {
            Some(p) => p[seq] as usize,
            None => seq * self.max_blocks,
        }
    }
}

/// One layer's query rows: `q` `[num_tokens, num_heads, head_dim]` f32.
#[derive(Clone, Copy)]
pub struct Queries<'a> {
    pub q: &'a [f32],
    pub num_heads: usize,
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

/// ISA the next call with this head_dim runs with.
pub fn active_isa(head_dim: usize) -> Result<Isa> {
    let isa = runtime::isa()?;
    Ok(if !head_dim.is_multiple_of(8) && isa != Isa::Neon {
        Isa::Scalar
    } else {
        isa
    })
}

/// Everything a backend reads.
#[derive(Clone, Copy)]
pub(crate) struct Ctx<'a> {
    pub k: Kv<'a>,
    pub v: Kv<'a>,
    pub shape: CacheShape,
    pub batch: Batch<'a>,
    pub q: Queries<'a>,
    pub params: Params,
    pub group: usize,
}

impl Ctx<'_> {
    /// Block id holding key position `t` of sequence `seq` (validated: in range).
    #[inline]
    pub fn block(&self, seq: usize, t: usize) -> usize {
        self.batch.block_tables[self.batch.row_start(seq) + t / self.shape.block_size] as usize
    }
    /// Query vectors of row `row` for the query heads of KV heads `u.h0..u.h1`, `[nh * group, d]`.
    #[inline]
    pub fn q_row(&self, row: usize, u: &Unit) -> &[f32] {
        let d = self.shape.head_dim;
        let base = (row * self.q.num_heads + u.h0 * self.group) * d;
        &self.q.q[base..base + u.per_row(self.group) * d]
    }
    /// Keys row at position `p` may attend within `lo..hi`.
    #[inline]
    pub fn key_range(&self, p: usize, lo: usize, hi: usize) -> (usize, usize) {
        key_range(self.params.sliding_window, p, lo, hi)
    }
}

/// Keys a row at position `p` may attend within `lo..hi`, under `window`.
#[inline]
pub(crate) fn key_range(window: Option<usize>, p: usize, lo: usize, hi: usize) -> (usize, usize) {
    let lo = match window {
        Some(w) => lo.max((p + 1).saturating_sub(w)),
        None => lo,
    };
    (lo, hi.min(p + 1))
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
pub fn validate(k: &Kv, v: &Kv, shape: &CacheShape, b: &Batch, q: &Queries, out_len: usize) -> Result<()> {
    validate_caches(k, v, shape)?;
    let num_tokens = validate_queries(shape, q, out_len)?;
    validate_batch(shape, b, num_tokens)
}

/// Both caches: one dtype, `shape`'s element count.
pub fn validate_caches(k: &Kv, v: &Kv, shape: &CacheShape) -> Result<()> {
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
    Ok(())
}

/// The query rows against the cache's heads and `out`; returns their token count.
pub(crate) fn validate_queries(shape: &CacheShape, q: &Queries, out_len: usize) -> Result<usize> {
    let inval = |m: String| Err(Error::Invalid(m));
    let (hq, hkv, d) = (q.num_heads, shape.num_kv_heads, shape.head_dim);
    if hq == 0 || hkv == 0 || hq % hkv != 0 {
        return inval(format!(
            "num_q_heads ({hq}) must be a positive multiple of num_kv_heads ({hkv})"
        ));
    }
    let row = hq * d;
    if !q.q.len().is_multiple_of(row) {
        return inval(format!(
            "q holds {} elements, not a multiple of num_q_heads*head_dim = {row}",
            q.q.len()
        ));
    }
    if out_len != q.q.len() {
        return inval(format!("out holds {out_len} elements, q holds {}", q.q.len()));
    }
    Ok(q.q.len() / row)
}

/// The step's tables against the cache geometry and `num_tokens` query rows.
pub fn validate_batch(shape: &CacheShape, b: &Batch, num_tokens: usize) -> Result<()> {
    let inval = |m: String| Err(Error::Invalid(m));
    let nseq = b.seq_lens.len();
    if b.query_start_loc.len() != nseq + 1 {
        return inval(format!(
            "query_start_loc must have {} entries (B+1), got {}",
            nseq + 1,
            b.query_start_loc.len()
        ));
    }
    match b.indptr {
        None if b.block_tables.len() != nseq * b.max_blocks => {
            return inval(format!("block_tables must be [{nseq}, max_blocks]"));
        }
        None => {}
        Some(p) => {
            if p.len() != nseq + 1 {
                return inval(format!("indptr must have {} entries (B+1), got {}", nseq + 1, p.len()));
            }
            if p[0] != 0 {
                return inval(format!("indptr[0] must be 0, got {}", p[0]));
            }
            if let Some(i) = (0..nseq).find(|&i| p[i + 1] < p[i]) {
                return inval(format!(
                    "indptr must not decrease: [{i}]={} > [{}]={}",
                    p[i],
                    i + 1,
                    p[i + 1]
                ));
            }
            if p[nseq] as i64 != b.block_tables.len() as i64 {
                return inval(format!(
                    "indptr[-1] = {} but indices holds {} block ids",
                    p[nseq],
                    b.block_tables.len()
                ));
            }
        }
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
        match b.indptr {
            None if need > b.max_blocks => {
                return inval(format!(
                    "sequence {i}: seq_len {seq_len} needs {need} blocks, block_tables has {} columns",
                    b.max_blocks
                ));
            }
            Some(p) if (p[i + 1] - p[i]) as usize != need => {
                return inval(format!(
                    "sequence {i}: seq_len {seq_len} needs {need} blocks, indptr gives it {} (indptr[{i}..{}] = {}..{})",
                    p[i + 1] - p[i],
                    i + 2,
                    p[i],
                    p[i + 1]
                ));
            }
            _ => {}
        }
        let start = b.row_start(i);
        let row = &b.block_tables[start..start + need];
        if let Some((j, &id)) = row
            .iter()
            .enumerate()
            .find(|(_, &id)| id < 0 || id as usize >= shape.num_blocks)
        {
            let at = match b.indptr {
                None => format!("block_tables[{i}, {j}]"),
                Some(_) => format!("indices[{}]", start + j),
            };
            return inval(format!(
                "{at} = {id} is not a block id in [0, {}) (sequence {i} uses {need} blocks)",
                shape.num_blocks
            ));
        }
    }
    Ok(())
}

/// FlashInfer's `kv_last_page_len` beside a CSR table: sequence i's last block holds
/// `last_page_len[i]` tokens, so `seq_lens[i] = (blocks - 1) * block_size + last_page_len[i]`
/// (0 for a sequence with no blocks). Checked against `seq_lens`, which the kernel reads.
pub fn check_last_page_len(b: &Batch, block_size: usize, last_page_len: &[i32]) -> Result<()> {
    let inval = |m: String| Err(Error::Invalid(m));
    let Some(p) = b.indptr else {
        return inval("last_page_len goes with the CSR table (indptr, indices)".into());
    };
    let nseq = b.seq_lens.len();
    if last_page_len.len() != nseq || p.len() != nseq + 1 {
        return inval(format!(
            "last_page_len must have {nseq} entries (B), got {}",
            last_page_len.len()
        ));
    }
    for i in 0..nseq {
        let (n, l) = (p[i + 1] as i64 - p[i] as i64, last_page_len[i] as i64);
        let ok = match n {
            0 => l == 0,
            _ => (1..=block_size as i64).contains(&l),
        };
        let implied = if n > 0 { (n - 1) * block_size as i64 + l } else { 0 };
        if !ok || implied != b.seq_lens[i] as i64 {
            return inval(format!(
                "sequence {i}: last_page_len {l} with {n} blocks of {block_size} gives {implied} tokens, seq_lens says {}",
                b.seq_lens[i]
            ));
        }
    }
    Ok(())
}

/// Attention of every query row over its sequence's paged keys; writes `out` `[num_tokens, Hq, D]`.
pub fn paged_attention(
    k: Kv,
    v: Kv,
    shape: CacheShape,
    b: Batch,
    q: Queries,
    params: Params,
    out: &mut [f32],
) -> Result<()> {
    let isa = active_isa(shape.head_dim)?;
    let pool = runtime::pool()?;
    let threads = pool.current_num_threads();
    pool.install(|| paged_attention_with(isa, threads, k, v, shape, b, q, params, out))
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
    q: Queries,
    params: Params,
    out: &mut [f32],
) -> Result<()> {
    validate(&k, &v, &shape, &b, &q, out.len())?;
    let plan = Plan::checked(
        b,
        shape,
        q.num_heads / shape.num_kv_heads,
        params.sliding_window,
        threads,
    );
    run_planned(isa, k, v, &plan, q, params, out)
}
