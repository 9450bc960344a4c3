//! How one product runs: shapes checked, the columns cut into jobs, each job's tiles ordered and
//! handed to the variant's tile (`run_panels`). `linear` (mod.rs) runs the jobs on the rayon pool;
//! `Product` hands them to a caller's own threads (the decoder's step team).
//!
//! | item         | holds                                                                            |
//! |--------------|----------------------------------------------------------------------------------|
//! | `Args`       | one tile call's activations, weight and output pointer                           |
//! | `tile_order` | a job's order: row blocks kept in L2, `PASS_PANELS` panels kept in L1, `MR` rows |
//! | `Product`    | a product quantized once, its jobs run by the caller, in any order               |
//! | `run_job`    | a job's panels to the tile of the variant (runs of one layout for the VNNI tile) |
//!
//! Work is split over output columns only, never over K: each output is computed by one tile,
//! alone, so the bits do not depend on the job size, the order or the thread (tests.rs).

use super::acts::{
    quantize_acts, quantize_chunks, quantize_fast, quantize_one, quantize_tiled, QActs, TILED_MIN_ROWS, TILED_ROWS,
};
use super::scalar::tile_scalar;
use super::weight::QWeight;
#[cfg(target_arch = "x86_64")]
use super::{amx, avx2, x86};
use super::{amx_for, avx_vnni_for, variant, QBLOCK};
use crate::error::{Error, Result};
use crate::runtime::Isa;

/// Arguments of one tile call, shared by the variants.
pub(super) struct Args<'a> {
    pub(super) acts: &'a QActs,
    pub(super) w: &'a QWeight,
    pub(super) out: *mut f32,
    /// Floats between two output rows (`n` for a contiguous `[m, n]` output).
    pub(super) ld: usize,
    /// The AVX-512 build runs the AMX tile (`amx_for`; the digits are then in its layout,
    /// `QActs::amx_rows`).
    pub(super) amx: bool,
    /// The AVX2 build runs its AVX-VNNI form (`runtime::avx_vnni`).
    pub(super) avx_vnni: bool,
}

/// Rows per tile of the SIMD tiles (each row is two digit streams).
pub(super) const MR: usize = 2;
/// Panels per job (columns per job = JOB_PANELS * PANEL).
pub(super) const JOB_PANELS: usize = 2;
/// Panels one pass of tiles keeps in L1 while a row block streams past (<= 18 KiB of codes).
pub(super) const PASS_PANELS: usize = 2;
/// Activation bytes (two digits a value) of a row block: it stays in L2 while the job's panels
/// pass it a pair at a time.
pub(super) const ROW_BLOCK_BYTES: usize = 96 << 10;

/// The tile order of a job over panels `p0..p0+np` and rows `0..m`, `mr` rows a tile: rows in
/// blocks whose activations stay in L2; within a block, panels `PASS_PANELS` at a time (their
/// codes stay in L1) and for each such pass the block's rows. `f(r0, rows, p, panels, first)` runs
/// one pass of tiles; `first` is true for the pass's first rows (the tiles that stream the codes in
/// from memory and prefetch ahead; the block's other rows find them in L1). The order changes no
/// result: every output is computed by one tile, alone.
pub(super) fn tile_order(
    m: usize,
    k: usize,
    p0: usize,
    np: usize,
    mr: usize,
    mut f: impl FnMut(usize, usize, usize, usize, bool),
) {
    // A multiple of mr rows (no short tile inside a block), at least one tile.
    let block = ((ROW_BLOCK_BYTES / (2 * k)) / mr * mr).max(mr);
    let mut rs = 0;
    while rs < m {
        let re = (rs + block).min(m);
        let mut ps = p0;
        while ps < p0 + np {
            let pn = PASS_PANELS.min(p0 + np - ps);
            let mut r0 = rs;
            while r0 < re {
                let rows = mr.min(re - r0);
                f(r0, rows, ps, pn, r0 == rs);
                r0 += rows;
            }
            ps += pn;
        }
        rs = re;
    }
}

#[derive(Clone, Copy)]
pub(super) struct SendPtr(pub(super) *mut f32);
// SAFETY: the pointer is only dereferenced inside `linear`'s jobs, which write disjoint column
// ranges of an output buffer that outlives the parallel loop.
unsafe impl Send for SendPtr {}
// SAFETY: as above; jobs never touch the same element.
unsafe impl Sync for SendPtr {}

impl SendPtr {
    pub(super) fn get(self) -> *mut f32 {
        self.0
    }
}

/// `x` is `[m, k]` and `out` `[m, n]` for the weight `w` `[n, k]`; with `ld` (`Some`), `out` holds
/// `m` rows of `n` values `ld` apart (the columns of a wider matrix, from its first row's start).
pub(super) fn check_shapes(x: &[f32], m: usize, w: &QWeight, out: &[f32], ld: Option<usize>) -> Result<()> {
    let (n, k) = (w.n, w.k);
    if x.len() != m * k {
        return Err(Error::Invalid(format!("x must be [{m}, {k}], got {} values", x.len())));
    }
    match ld {
        None if out.len() != m * n => Err(Error::Invalid(format!(
            "out must be [{m}, {n}], got {} values",
            out.len()
        ))),
        Some(ld) if ld < n => Err(Error::Invalid(format!(
            "out's row stride {ld} is shorter than its {n} columns"
        ))),
        Some(ld) if m > 0 && out.len() < (m - 1) * ld + n => Err(Error::Invalid(format!(
            "out must hold {m} rows of {n} values {ld} apart ({} values), got {}",
            (m - 1) * ld + n,
            out.len()
        ))),
        _ => Ok(()),
    }
}

/// One product `out[m, n] = x[m, k] · Wᵀ` cut into column jobs that the caller schedules on
/// threads of its own (the decoder's step team): the activations quantized once, then each job
/// `0..jobs()` run exactly once, on any thread, in any order. The results are `linear`'s bits
/// (each output column is computed by the same tile code whichever job runs it).
pub struct Product<'a> {
    isa: Isa,
    acts: QActs,
    w: &'a QWeight,
    m: usize,
    out: SendPtr,
    ld: usize,
    amx: bool,
    avx_vnni: bool,
    panels_per_job: usize,
    _out: std::marker::PhantomData<&'a mut [f32]>,
}

/// Rows from which `Product::new` quantizes in parallel chunks.
const TEAM_QUANTIZE_ROWS: usize = 16;

impl<'a> Product<'a> {
    /// Check the shapes and quantize `x` (on this thread, or from `TEAM_QUANTIZE_ROWS` rows on in
    /// chunks that the step team's idle helpers share through rayon); `threads` sizes the jobs
    /// (about 4 a thread, at least `JOB_PANELS` panels each). Each job costs two contended atomic
    /// operations on the team's claim word and counter: 16 jobs a thread slowed a one-sequence
    /// decode by about an eighth and gained nothing at 8 or 32 sequences; 2 a thread lost at 8
    /// sequences (one job a thread leaves the faster thread idle).
    pub fn new(isa: Isa, x: &[f32], m: usize, w: &'a QWeight, out: &'a mut [f32], threads: usize) -> Result<Self> {
        Self::build(isa, x, m, w, out, None, threads, true)
    }

    /// `new` that never runs the extension tiles (AMX, AVX-VNNI): tests compare the tiles.
    #[cfg(test)]
    pub(super) fn without_ext(
        isa: Isa,
        x: &[f32],
        m: usize,
        w: &'a QWeight,
        out: &'a mut [f32],
        threads: usize,
    ) -> Result<Self> {
        Self::build(isa, x, m, w, out, None, threads, false)
    }

    /// `new` with the output rows `ld` floats apart: `out` starts at the first row's first column
    /// of a wider matrix (a vocabulary chunk of the logits), so no scratch copy is needed.
    pub fn strided(
        isa: Isa,
        x: &[f32],
        m: usize,
        w: &'a QWeight,
        out: &'a mut [f32],
        ld: usize,
        threads: usize,
    ) -> Result<Self> {
        Self::build(isa, x, m, w, out, Some(ld), threads, true)
    }

    // The one constructor behind `new`, `strided` and `without_ext`.
    #[allow(clippy::too_many_arguments)]
    fn build(
        isa: Isa,
        x: &[f32],
        m: usize,
        w: &'a QWeight,
        out: &'a mut [f32],
        ld: Option<usize>,
        threads: usize,
        ext: bool,
    ) -> Result<Self> {
        let k = w.k;
        check_shapes(x, m, w, out, ld)?;
        let one = w.act_digits() == 1;
        let amx = ext && amx_for(variant(isa), m, w);
        let avx_vnni = ext && avx_vnni_for(variant(isa));
        let acts = match variant(isa) {
            // The AMX tile reads `hi` / `lo` rows, quantized in chunks as below.
            _ if amx => quantize_chunks(x, m, k, m.div_ceil(threads.max(1)), one, true),
            Isa::Scalar if one => quantize_one(x, m, k, false),
            Isa::Scalar => quantize_acts(x, m, k),
            // Rows in chunks a thread from TEAM_QUANTIZE_ROWS on: the team's idle helpers take
            // the other chunks from rayon (`Team::help`).
            Isa::Avx512 if m >= TEAM_QUANTIZE_ROWS => quantize_tiled(x, m, k, m.div_ceil(threads.max(1)), one),
            Isa::Avx512 if m >= TILED_MIN_ROWS => quantize_tiled(x, m, k, m, one),
            v => quantize_fast(v, x, m, k, one),
        };
        let mut acts = acts;
        acts.prepare(variant(isa), !w.split.is_empty(), m, k);
        let panels_per_job = JOB_PANELS.max(w.panels().div_ceil(4 * threads.max(1)));
        Ok(Product {
            isa,
            acts,
            w,
            m,
            out: SendPtr(out.as_mut_ptr()),
            ld: ld.unwrap_or(w.n),
            amx,
            avx_vnni,
            panels_per_job,
            _out: std::marker::PhantomData,
        })
    }

    /// Number of jobs (0 when `m` is 0).
    pub fn jobs(&self) -> usize {
        if self.m == 0 {
            0
        } else {
            self.w.panels().div_ceil(self.panels_per_job)
        }
    }

    /// Run job `j`.
    ///
    /// # Safety
    /// `j < jobs()`, and no other thread runs job `j` of this product at the same time (jobs
    /// write disjoint column ranges of `out`, which this product borrows mutably).
    pub unsafe fn run(&self, j: usize) {
        let a = Args {
            acts: &self.acts,
            w: self.w,
            out: self.out.get(),
            ld: self.ld,
            amx: self.amx,
            avx_vnni: self.avx_vnni,
        };
        let p0 = j * self.panels_per_job;
        run_job(self.isa, &a, self.m, p0, self.panels_per_job.min(self.w.panels() - p0));
    }
}

pub(super) fn run_job(isa: Isa, a: &Args, m: usize, p0: usize, np: usize) {
    let mut v = variant(isa);
    let (tiled, rows) = (a.acts.tiled.len() == 2 * m * a.w.k, a.acts.hi.len() == m * a.w.k);
    let scalars = a.acts.block_scalars.len() == m.div_ceil(TILED_ROWS) * (a.w.k / QBLOCK);
    if v == Isa::Avx512 && (!scalars || !tiled && !rows) {
        // Neither layout in full, or no `block_scalars` (this module's callers always make them):
        // the scalar tile.
        v = Isa::Scalar;
    }
    if v != Isa::Avx512 {
        return run_panels(v, a, m, p0, np, (8, false));
    }
    // The VNNI tile takes one layout a call: runs of panels of one layout, split or not (a fused
    // projection of mixed types mixes them). Every column is computed by one tile whichever run
    // holds it.
    let kind = |p: usize| (a.w.panel_bits(p), a.w.panel_split(p));
    let mut s = p0;
    while s < p0 + np {
        let (bits, split) = kind(s);
        let e = (s + 1..p0 + np).find(|&q| kind(q) != (bits, split)).unwrap_or(p0 + np);
        run_panels(v, a, m, s, e - s, (bits, split));
        s = e;
    }
}

/// Panels `p0..p0+np` on the tile of build `v`; for the Avx512 one, all of them in the `bits`-bit
/// layout and split as `split` says (the other tiles read each panel's layout themselves).
fn run_panels(v: Isa, a: &Args, m: usize, p0: usize, np: usize, (bits, split): (usize, bool)) {
    match v {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => {
            // SAFETY: `variant` gives Avx512 only when AVX-512 F/BW/VNNI are detected, and
            // `run_job` hands it runs of panels of the layout `bits`, split or not as `split` says
            // (with `halves` filled where a panel is split); the tile bounds are within the
            // activations, weights and output sized by `linear_with`. `a.amx` only where
            // `amx_for` found AMX-INT8 usable, and then the digits are `hi` / `lo` rows.
            unsafe {
                if a.amx {
                    debug_assert!(!split, "`amx_for` keeps weights with split panels off the AMX tile");
                    amx::job(a, m, p0, np, bits)
                } else {
                    x86::job(a, m, 0, p0, np, bits, split)
                }
            }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            // SAFETY: `variant` gives Avx2 only when AVX2 and FMA are detected (and `run_job`
            // checks it); the tile bounds are within the activations, weights and output sized by
            // `linear_with`; a panel's layout was chosen from its own codes.
            unsafe { avx2::job(a, m, p0, np) }
        }
        _ => tile_order(m, a.w.k, p0, np, MR, |r0, rows, ps, pn, _| {
            for p in ps..ps + pn {
                tile_scalar(a, r0, rows, p);
            }
        }),
    }
}
