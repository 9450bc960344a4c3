//! Activation quantization: `x [m, k]` into two int8 digits a value (formula: the module docs).
//!
//! | quantizer        | variant       | layout it writes                                        |
//! |------------------|---------------|---------------------------------------------------------|
//! | `quantize_acts`  | scalar (spec) | `hi`, `lo` rows; `pack_tiled` makes the tiled one of it |
//! | `quantize_one`   | every variant | the first digit alone (`lo` 0), rows or tiled           |
//! | `avx2::quantize` | avx2          | `hi`, `lo` rows                                         |
//! | `x86::quantize`  | avx512vnni    | `hi`, `lo` rows, `tiled`, or the AMX layout (`x86::Digits`) |
//!
//! `quantize_fast` picks the one beside the tile that runs, `quantize_par`, `quantize_tiled` and
//! `quantize_chunks` cut the rows into chunks on the rayon pool. Layouts: `QActs::hi` and `lo`
//! row-major `[m, k]`, 64-byte aligned (`Digits64`), or with their first `amx_rows` rows in the AMX
//! tile's groups of 16 (`block_at`); `QActs::tiled` rows in groups of `TILED_ROWS`, a 4-wide k step
//! holding the group's digits side by side (`pack_tiled`). Tolerance: none, every quantizer writes the scalar one's bytes
//! (tests.rs compares them, NaN and infinite blocks included).

use super::weight::SPLIT_ZERO;
use super::QBLOCK;
#[cfg(target_arch = "x86_64")]
use super::{avx2, x86};
use crate::runtime::Isa;

/// Bytes of 64-byte alignment: a digit row's 32-wide block never straddles two cache lines (the AMX
/// tile loads a block of 16 rows in one instruction, several times slower where rows straddle).
#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(C, align(64))]
struct Line([i8; 64]);

/// A digit buffer (`QActs::hi`, `lo`): `len` bytes from a 64-byte aligned start, used as a slice.
#[derive(Clone, Default)]
pub struct Digits64 {
    lines: Vec<Line>,
    len: usize,
}

impl Digits64 {
    /// `len` zero bytes.
    pub fn zeroed(len: usize) -> Self {
        Digits64 {
            lines: vec![Line([0; 64]); len.div_ceil(64)],
            len,
        }
    }

    /// No bytes.
    pub fn new() -> Self {
        Self::default()
    }
}

impl std::ops::Deref for Digits64 {
    type Target = [i8];
    fn deref(&self) -> &[i8] {
        // SAFETY: `lines` holds at least `len` initialized bytes (`Line` is 64 plain i8, no padding),
        // contiguous from its start.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr() as *const i8, self.len) }
    }
}

impl std::ops::DerefMut for Digits64 {
    fn deref_mut(&mut self) -> &mut [i8] {
        // SAFETY: as for `deref`, borrowed mutably through `self`.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr() as *mut i8, self.len) }
    }
}

impl PartialEq for Digits64 {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl std::fmt::Debug for Digits64 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        (**self).fmt(f)
    }
}

/// Activations of `m` rows `[m, k]`, quantized per 32-wide block in two int8 digits.
pub struct QActs {
    /// First digit `h` (row-major, 64-byte aligned).
    pub hi: Digits64,
    /// Second digit `l` (the first one's rounding error).
    pub lo: Digits64,
    /// The scale `s[r, b]` of block b of row r: `x ≈ s·(R·h + l)` (NaN when the block holds a
    /// NaN or infinity, so that output row is NaN; 0 for an all-zero block).
    pub s: Vec<f32>,
    /// The ratio `R[r, b]` of the two digits (0 for a NaN, infinite or all-zero block).
    pub base: Vec<i32>,
    /// `s · (R·Σh + Σl)` over the block.
    pub qs: Vec<f32>,
    /// Both digits in the VNNI tile's order (`pack_tiled`): that tile's activations of at least
    /// `TILED_MIN_ROWS` rows hold only these (`hi` and `lo` then empty); empty otherwise.
    pub tiled: Vec<i8>,
    /// Per row and block, `-SPLIT_ZERO·Σ(R·h + l)` over its first 16 values, then over its last 16
    /// (wrapping i32): what a split panel's half dots start from (weight.rs); filled by
    /// `fill_halves` for weights that have split panels, else empty.
    pub halves: Vec<i32>,
    /// `s`, `qs`, `base` and `halves` again, a group of `TILED_ROWS` rows and a block an entry
    /// (`[m.div_ceil(TILED_ROWS)][k/32]`, `fill_block_scalars`): the VNNI tile finds a block's rows
    /// at fixed offsets from one address, as it finds their digits in `tiled`. Empty until filled.
    pub block_scalars: Vec<BlockScalars>,
    /// Rows `0..amx_rows` (a multiple of 16) of `hi` and `lo` are in the AMX tile's blocks
    /// (`block_at`); 0 when every row is row-major.
    pub amx_rows: usize,
    /// 2, or 1 when only the first digit was taken (`quantize_one`: every `l` 0 and `R` 1, so the
    /// two-digit formula gives the one-digit product exactly and a tile may skip the `l` dots).
    pub digits: usize,
}

impl QActs {
    pub(super) fn zeroed(m: usize, k: usize) -> Self {
        let nb = k / QBLOCK;
        QActs {
            hi: Digits64::zeroed(m * k),
            lo: Digits64::zeroed(m * k),
            s: vec![0.0; m * nb],
            base: vec![0; m * nb],
            qs: vec![0.0; m * nb],
            tiled: Vec::new(),
            halves: Vec::new(),
            block_scalars: Vec::new(),
            amx_rows: 0,
            digits: 2,
        }
    }

    /// Fill `tiled` from `hi` and `lo` (`m` rows of `k`): rows in groups of `TILED_ROWS` (the last
    /// one of the `m % TILED_ROWS` rows left, if any), a group of `g` rows laid out
    /// `[k/4][g rows][hi, lo][4 bytes]`; `2·m·k` bytes, group `j` from byte `j·2·TILED_ROWS·k`
    /// (`tiled_step` gives a group's bytes a 4-wide k step). A tile of up to 8 rows inside one group
    /// then finds the 4 bytes of each of its rows and digits for a k step at fixed offsets from one
    /// address, and the next step one group step on: no per-row address arithmetic in its inner loop.
    pub(super) fn pack_tiled(&mut self, m: usize, k: usize) {
        let mut t = vec![0i8; 2 * m * k];
        for r in 0..m {
            let (hi, lo) = (&self.hi[r * k..][..k], &self.lo[r * k..][..k]);
            let g0 = r / TILED_ROWS * TILED_ROWS;
            let step = tiled_step(m, g0);
            let at = g0 * 2 * k + (r - g0) * 8;
            for (s, (h, l)) in t[at..].chunks_mut(step).zip(hi.chunks_exact(4).zip(lo.chunks_exact(4))) {
                s[..4].copy_from_slice(h);
                s[4..8].copy_from_slice(l);
            }
        }
        self.tiled = t;
    }
}

impl QActs {
    /// Fill `halves` for `m` rows of `k` from the digits (the `hi` / `lo` rows, else `tiled`), in
    /// chunks of rows on the rayon pool from `HALVES_PAR_ROWS` rows on. Every sum is exact in i32
    /// (|R·Σh| <= `BASE_BUDGET`), the product by `SPLIT_ZERO` wraps as the tiles' sums do.
    pub(super) fn fill_halves(&mut self, m: usize, k: usize) {
        use rayon::prelude::*;
        let nb = k / QBLOCK;
        let mut halves = vec![0i32; m * nb * 2];
        let rows = self.hi.len() == m * k;
        let this = &*self;
        let fill = |r: usize, out: &mut [i32]| {
            for (b, o) in out.chunks_exact_mut(2).enumerate() {
                let base = this.base[r * nb + b];
                for (h, x) in o.iter_mut().enumerate() {
                    let (mut sh, mut sl) = (0i32, 0i32);
                    if rows {
                        let at = block_at(r, b, k, this.amx_rows) + h * QBLOCK / 2;
                        sh = this.hi[at..][..QBLOCK / 2].iter().map(|&v| v as i32).sum();
                        sl = this.lo[at..][..QBLOCK / 2].iter().map(|&v| v as i32).sum();
                    } else {
                        let g0 = r / TILED_ROWS * TILED_ROWS;
                        let step = tiled_step(m, g0);
                        let at = g0 * 2 * k + (r - g0) * 8 + (b * QBLOCK / 4 + h * QBLOCK / 8) * step;
                        for j in 0..QBLOCK / 8 {
                            let q = &this.tiled[at + j * step..][..8];
                            sh += q[..4].iter().map(|&v| v as i32).sum::<i32>();
                            sl += q[4..].iter().map(|&v| v as i32).sum::<i32>();
                        }
                    }
                    *x = base.wrapping_mul(sh).wrapping_add(sl).wrapping_mul(-SPLIT_ZERO);
                }
            }
        };
        if m >= HALVES_PAR_ROWS {
            halves.par_chunks_mut(2 * nb).enumerate().for_each(|(r, o)| fill(r, o));
        } else {
            halves.chunks_mut(2 * nb).enumerate().for_each(|(r, o)| fill(r, o));
        }
        self.halves = halves;
    }
}

/// One block's scalars of a group of `TILED_ROWS` rows (`QActs::block_scalars`; rows past the
/// activations' last one 0).
#[derive(Clone, Copy, Default)]
#[repr(C)]
pub struct BlockScalars {
    pub s: [f32; TILED_ROWS],
    pub qs: [f32; TILED_ROWS],
    pub base: [i32; TILED_ROWS],
    /// `halves` of the block's first 16 values, then of its last 16 (0 when `halves` is empty).
    pub halves: [[i32; TILED_ROWS]; 2],
}

impl QActs {
    /// What the tiles of variant `v` read beside the digits and scales, for `m` rows of `k`:
    /// `halves` when the weights have split panels, `block_scalars` for the VNNI tile.
    pub(super) fn prepare(&mut self, v: Isa, split: bool, m: usize, k: usize) {
        if split {
            self.fill_halves(m, k);
        }
        if v == Isa::Avx512 {
            self.fill_block_scalars(m, k);
        }
    }

    /// Fill `block_scalars` for `m` rows of `k` from `s`, `qs`, `base` and `halves` (if filled).
    pub(super) fn fill_block_scalars(&mut self, m: usize, k: usize) {
        let nb = k / QBLOCK;
        let mut v = vec![BlockScalars::default(); m.div_ceil(TILED_ROWS) * nb];
        let halves = self.halves.len() == 2 * m * nb;
        for (g, entries) in v.chunks_exact_mut(nb).enumerate() {
            for i in 0..TILED_ROWS.min(m - g * TILED_ROWS) {
                let r = g * TILED_ROWS + i;
                for (b, e) in entries.iter_mut().enumerate() {
                    let rb = r * nb + b;
                    (e.s[i], e.qs[i], e.base[i]) = (self.s[rb], self.qs[rb], self.base[rb]);
                    if halves {
                        (e.halves[0][i], e.halves[1][i]) = (self.halves[2 * rb], self.halves[2 * rb + 1]);
                    }
                }
            }
        }
        self.block_scalars = v;
    }
}

/// Rows of one AMX tile: the AMX layout of `hi` and `lo` keeps groups of this many rows.
pub(super) const AMX_GROUP: usize = 16;

/// Where block `b` of row `r` starts in `hi` and `lo` of rows of `k` whose first `amx_rows` (a
/// multiple of `AMX_GROUP`) are in the AMX tile's layout: each group of 16 rows keeps its `k·16`
/// bytes, block by block, a block's 16 rows of 32 bytes one after another (what one tile load
/// takes, contiguous); the rows after them, row-major.
#[inline(always)]
pub(super) fn block_at(r: usize, b: usize, k: usize, amx_rows: usize) -> usize {
    if r < amx_rows {
        (r / AMX_GROUP * AMX_GROUP) * k + (b * AMX_GROUP + r % AMX_GROUP) * QBLOCK
    } else {
        r * k + b * QBLOCK
    }
}

/// Rows from which `fill_halves` runs in chunks on the rayon pool.
const HALVES_PAR_ROWS: usize = 16;

/// The digit and scale buffers of some whole rows of a `QActs` (`rows_mut`, `split`): what a
/// quantizer fills, so that chunks of rows can be quantized in parallel in place.
pub(super) struct ActsMut<'a> {
    pub hi: &'a mut [i8],
    pub lo: &'a mut [i8],
    pub s: &'a mut [f32],
    pub base: &'a mut [i32],
    pub qs: &'a mut [f32],
    pub tiled: &'a mut [i8],
}

impl QActs {
    /// Every row's buffers.
    pub(super) fn rows_mut(&mut self) -> ActsMut<'_> {
        ActsMut {
            hi: &mut self.hi,
            lo: &mut self.lo,
            s: &mut self.s,
            base: &mut self.base,
            qs: &mut self.qs,
            tiled: &mut self.tiled,
        }
    }
}

impl<'a> ActsMut<'a> {
    /// The first `rows` rows of `k` and the rest (an empty buffer stays empty on both sides; a
    /// cut of `tiled` is a group boundary when `rows` is a multiple of `TILED_ROWS`).
    pub(super) fn split(self, rows: usize, k: usize) -> (ActsMut<'a>, ActsMut<'a>) {
        fn cut<T>(v: &mut [T], at: usize) -> (&mut [T], &mut [T]) {
            let at = at.min(v.len());
            v.split_at_mut(at)
        }
        let nb = rows * k / QBLOCK;
        let (hi, hi2) = cut(self.hi, rows * k);
        let (lo, lo2) = cut(self.lo, rows * k);
        let (s, s2) = cut(self.s, nb);
        let (base, base2) = cut(self.base, nb);
        let (qs, qs2) = cut(self.qs, nb);
        let (tiled, tiled2) = cut(self.tiled, 2 * rows * k);
        (
            ActsMut {
                hi,
                lo,
                s,
                base,
                qs,
                tiled,
            },
            ActsMut {
                hi: hi2,
                lo: lo2,
                s: s2,
                base: base2,
                qs: qs2,
                tiled: tiled2,
            },
        )
    }
}

/// Bytes of one 4-wide k step of the `QActs::tiled` group of `m` rows that starts at row `g0`.
#[inline(always)]
pub(super) fn tiled_step(m: usize, g0: usize) -> usize {
    8 * TILED_ROWS.min(m - g0)
}

/// Rows from which the VNNI tile takes its activations tiled (`QActs::tiled`); below, as `hi` and
/// `lo` rows. A tile of 3 to 8 rows reads every broadcast at a constant offset from one pointer
/// where row digits take two pointers a row (7 rows: 14, more than the loop leaves free); one and
/// two rows, a one-sequence decode among them, run as fast or faster from row digits.
pub(super) const TILED_MIN_ROWS: usize = 3;

/// Rows of one group of `QActs::tiled` (the VNNI tile's largest row count).
pub(super) const TILED_ROWS: usize = 8;

/// Quantize `x [m, k]` row by row (see the module docs).
pub fn quantize_acts(x: &[f32], m: usize, k: usize) -> QActs {
    let mut a = QActs::zeroed(m, k);
    for (i, blk) in x[..m * k].chunks_exact(QBLOCK).enumerate() {
        let (s, base, qs) = quantize_block(
            blk,
            &mut a.hi[i * QBLOCK..][..QBLOCK],
            &mut a.lo[i * QBLOCK..][..QBLOCK],
        );
        a.s[i] = s;
        a.base[i] = base;
        a.qs[i] = qs;
    }
    a
}

/// Quantize `x [m, k]` into the first digit only: per block `h = Q(x · (127/a))`, `s = a/127`,
/// `R = 1`, `l = 0`, `qs = s·Σh` (llama.cpp's Q8 activations; the first digit is `quantize_acts`'s).
/// In the two-digit layout, so every tile computes it; `tiled` too when `tiled` (the VNNI tile's
/// layout from `TILED_MIN_ROWS` rows). Up to 64 rows on this thread, more in chunks of 64 on the pool.
pub fn quantize_one(x: &[f32], m: usize, k: usize, tiled: bool) -> QActs {
    quantize_one_with(x, m, k, tiled, first_digits)
}

/// The quantizer of a block run's first digits (`first_digits`' arguments).
type FirstDigits = fn(&[f32], &mut [i8], &mut [f32], &mut [i32], &mut [f32]);

/// `quantize_one` with `digits` quantizing each run of rows.
fn quantize_one_with(x: &[f32], m: usize, k: usize, tiled: bool, digits: FirstDigits) -> QActs {
    use rayon::prelude::*;
    let mut a = QActs::zeroed(m, k);
    a.digits = 1;
    let nb = k / QBLOCK;
    const ROWS: usize = 64;
    if m <= ROWS {
        // On this thread: a decode step's few rows cost less than handing them to the pool (the step
        // team's products are quantized by the thread that starts them).
        digits(&x[..m * k], &mut a.hi, &mut a.s, &mut a.base, &mut a.qs);
    } else {
        x[..m * k]
            .par_chunks(ROWS * k)
            .zip(a.hi.par_chunks_mut(ROWS * k))
            .zip(a.s.par_chunks_mut(ROWS * nb).zip(a.base.par_chunks_mut(ROWS * nb)))
            .zip(a.qs.par_chunks_mut(ROWS * nb))
            .for_each(|(((xc, hc), (sc, bc)), qc)| digits(xc, hc, sc, bc, qc));
    }
    if tiled {
        a.pack_tiled(m, k);
        a.hi = Digits64::new();
        a.lo = Digits64::new();
    }
    a
}

/// `quantize_block_one` over whole blocks of `x`: digits into `h`, each block's `(s, R, qs)` into `s`, `base`, `qs`.
fn first_digits(x: &[f32], h: &mut [i8], s: &mut [f32], base: &mut [i32], qs: &mut [f32]) {
    for (i, blk) in x.chunks_exact(QBLOCK).enumerate() {
        (s[i], base[i], qs[i]) = quantize_block_one(blk, &mut h[i * QBLOCK..][..QBLOCK]);
    }
}

/// The first digit of one block into `h` (`l` stays 0): `(s, R, qs)` as `quantize_block` gives them
/// with `R = 1` (0 for a NaN, infinite or all-zero block, as there).
fn quantize_block_one(x: &[f32], h: &mut [i8]) -> (f32, i32, f32) {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let bad = x.iter().any(|v| v.is_nan()) || amax.is_infinite();
    if bad || amax < f32::MIN_POSITIVE {
        h.fill(0);
        let s = if bad { f32::NAN } else { 0.0 };
        return (s, 0, s);
    }
    let inv_h = 127.0 / amax;
    let mut sum = 0i32;
    for (&v, oh) in x.iter().zip(h.iter_mut()) {
        let q = round_half_even(v * inv_h).clamp(-127.0, 127.0);
        *oh = q as i8;
        sum += q as i32;
    }
    let s = amax / 127.0;
    (s, 1, s * sum as f32)
}

/// The ratio `R` between a block's two activation digits (module docs): `⌊a / max|e|⌋` capped so
/// that `R·Σ|h| <= 8·10⁶` (every dot `R·Σc·h + Σc·l` fits i32) and `R` fits i16 (the AVX2 tile's
/// `vpmaddwd` weight). The SIMD quantizers compute the same three correctly rounded quotients.
#[inline(always)]
pub(super) fn digit_base(amax: f32, emax: f32, abs_sum: f32) -> f32 {
    (amax / emax).floor().min((BASE_BUDGET / abs_sum).floor()).min(BASE_CAP)
}
/// `R·Σ|h|` at most (exact in f32).
pub(super) const BASE_BUDGET: f32 = 8.0e6;
/// `R` at most: an i16.
pub(super) const BASE_CAP: f32 = 32767.0;

/// `v.round_ties_even()` for |v| < 2^22, in plain f32 arithmetic: adding and subtracting
/// 1.5·2^23 rounds to an integer in the default (nearest-even) mode. The library call that
/// `round_ties_even` becomes without SSE4.1 cost more than the whole matrix product.
#[inline(always)]
fn round_half_even(v: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    (v + MAGIC) - MAGIC
}

/// Both digits of one block into `h` and `l`: `(s, R, qs)`; `s` and `qs` are NaN for a block
/// holding NaN or infinity, 0 for an all-zero (or subnormal) one, `R` 0 for both (digits 0).
fn quantize_block(x: &[f32], h: &mut [i8], l: &mut [i8]) -> (f32, i32, f32) {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let bad = x.iter().any(|v| v.is_nan()) || amax.is_infinite();
    if bad || amax < f32::MIN_POSITIVE {
        h.fill(0);
        l.fill(0);
        let s = if bad { f32::NAN } else { 0.0 };
        return (s, 0, s);
    }
    let (inv_h, s_h) = (127.0 / amax, amax / 127.0);
    let mut err = [0f32; QBLOCK];
    for ((&v, oh), e) in x.iter().zip(h.iter_mut()).zip(err.iter_mut()) {
        let q = round_half_even(v * inv_h).clamp(-127.0, 127.0);
        *oh = q as i8;
        // The product and the difference each rounded (no contraction).
        *e = v - s_h * q;
    }
    let emax = err.iter().fold(0f32, |a, v| a.max(v.abs()));
    let abs_sum = h.iter().map(|&q| q.unsigned_abs() as i32).sum::<i32>() as f32;
    // ⌊a / max|e|⌋ (>= ~254: |e| <= s_h/2), capped; an exact block (e = 0) takes a cap.
    let base = digit_base(amax, emax, abs_sum);
    let units = 127.0 * base; // exact: an integer < 2^22
    let inv_l = units / amax;
    let mut sum = 0i32;
    for ((&e, ol), &qh) in err.iter().zip(l.iter_mut()).zip(h.iter()) {
        let q = round_half_even(e * inv_l).clamp(-127.0, 127.0);
        *ol = q as i8;
        sum += base as i32 * qh as i32 + q as i32;
    }
    let s = amax / units;
    // |sum| <= R·Σ|h| + 32·127 < 2^24: exact in f32.
    (s, base as i32, s * sum as f32)
}

/// `quantize_acts` with the quantizer of the tile build `v` (`variant`): AVX-512 beside the VNNI
/// tile, AVX2 beside the AVX2 tile (so `PAGEDKV_ISA=avx2` runs what a CPU without AVX-512 runs),
/// the scalar one otherwise; identical results. `one`: `quantize_one`'s first digit only.
pub(super) fn quantize_fast(v: Isa, x: &[f32], m: usize, k: usize, one: bool) -> QActs {
    #[cfg(target_arch = "x86_64")]
    if v == Isa::Avx512 && Isa::Avx512.available() {
        let mut a = QActs::zeroed(m, k);
        a.digits = if one { 1 } else { 2 };
        // SAFETY: AVX-512 F/BW detected (`Isa::Avx512` includes them); x[..m*k] and the buffers are sized for m rows.
        unsafe { x86::quantize(&x[..m * k], &mut a.rows_mut(), x86::Digits::Rows, one) };
        return a;
    } else if v == Isa::Avx2 && Isa::Avx2.available() {
        if one {
            // SAFETY: AVX2 and FMA detected (`Isa::Avx2` includes them); each run is whole blocks
            // with its digit and scale slices (`quantize_one_with`).
            let digits: FirstDigits = |x, h, s, b, q| unsafe { avx2::first_digits(x, h, s, b, q) };
            return quantize_one_with(x, m, k, false, digits);
        }
        let mut a = QActs::zeroed(m, k);
        // SAFETY: AVX2 and FMA detected (`Isa::Avx2` includes them); x[..m*k] and the buffers are sized for m rows.
        unsafe { avx2::quantize(&x[..m * k], &mut a) };
        return a;
    }
    if one {
        quantize_one(x, m, k, false)
    } else {
        quantize_acts(x, m, k)
    }
}

/// The VNNI tile's activations: the digits in `tiled` only (`hi` and `lo` empty), straight from
/// the AVX-512 quantizer (the same bytes `pack_tiled` makes of `quantize_acts`; cargo tests), in
/// chunks of `chunk` rows (rounded up to a multiple of `AMX_GROUP`) on the rayon pool when there
/// is more than one, each written in place. `one`: the first digit only (`quantize_one`'s).
pub(super) fn quantize_tiled(x: &[f32], m: usize, k: usize, chunk: usize, one: bool) -> QActs {
    quantize_chunks(x, m, k, chunk, one, false)
}

/// `quantize_tiled`, or with `rows` the same chunks written to `hi` and `lo` in the AMX tile's layout
/// (`block_at`; `tiled` empty).
pub(super) fn quantize_chunks(x: &[f32], m: usize, k: usize, chunk: usize, one: bool, rows: bool) -> QActs {
    #[cfg(target_arch = "x86_64")]
    if Isa::Avx512.available() {
        use rayon::prelude::*;
        let nb = k / QBLOCK;
        let row_digits = || Digits64::zeroed(if rows { m * k } else { 0 });
        let a_rows = if rows { m / AMX_GROUP * AMX_GROUP } else { 0 };
        let mut a = QActs {
            hi: row_digits(),
            lo: row_digits(),
            s: vec![0.0; m * nb],
            base: vec![0; m * nb],
            qs: vec![0.0; m * nb],
            tiled: if rows { Vec::new() } else { vec![0; 2 * m * k] },
            halves: Vec::new(),
            block_scalars: Vec::new(),
            amx_rows: a_rows,
            digits: if one { 1 } else { 2 },
        };
        let chunk = chunk.max(1).next_multiple_of(AMX_GROUP);
        let mut parts = Vec::with_capacity(m.div_ceil(chunk));
        let (mut rest, mut r) = (a.rows_mut(), 0);
        while r < m {
            let n = chunk.min(m - r);
            let (head, tail) = rest.split(n, k);
            // Rows: the chunk's rows in whole AMX groups (chunks start at multiples of 16 rows).
            let to = match rows {
                true => x86::Digits::Amx {
                    k,
                    full: a_rows.saturating_sub(r).min(n),
                },
                false => x86::Digits::Tiled { k },
            };
            parts.push((&x[r * k..(r + n) * k], head, to));
            (rest, r) = (tail, r + n);
        }
        let run = |(xc, mut v, to): (&[f32], ActsMut, x86::Digits)| {
            // SAFETY: AVX-512 F/BW detected; xc holds whole rows, and v is those rows' digit
            // (`hi` and `lo`, or `tiled`) and scale buffers (`split` at multiples of TILED_ROWS
            // rows: their own groups).
            unsafe { x86::quantize(xc, &mut v, to, one) }
        };
        if parts.len() > 1 {
            parts.into_par_iter().for_each(run);
        } else {
            parts.into_iter().for_each(run);
        }
        return a;
    }
    let _ = chunk;
    if one {
        return quantize_one(x, m, k, !rows);
    }
    let mut a = quantize_acts(x, m, k);
    if !rows {
        a.pack_tiled(m, k);
    }
    a
}

/// `quantize_fast` for build `v` over chunks of 64 rows in parallel (`quantize_tiled` in such
/// chunks when `tiled`); `one`: the first digit only.
pub(super) fn quantize_par(v: Isa, x: &[f32], m: usize, k: usize, tiled: bool, one: bool) -> QActs {
    use rayon::prelude::*;
    const ROWS: usize = 64;
    if tiled {
        return quantize_tiled(x, m, k, ROWS, one);
    }
    if m <= ROWS {
        return quantize_fast(v, x, m, k, one);
    }
    let parts: Vec<QActs> = x[..m * k]
        .par_chunks(ROWS * k)
        .map(|c| quantize_fast(v, c, c.len() / k, k, one))
        .collect();
    let mut a = QActs {
        hi: Digits64::zeroed(m * k),
        lo: Digits64::zeroed(m * k),
        s: Vec::with_capacity(m * k / QBLOCK),
        base: Vec::with_capacity(m * k / QBLOCK),
        qs: Vec::with_capacity(m * k / QBLOCK),
        tiled: Vec::new(),
        halves: Vec::new(),
        block_scalars: Vec::new(),
        amx_rows: 0,
        digits: if one { 1 } else { 2 },
    };
    for (i, p) in parts.iter().enumerate() {
        let at = i * ROWS * k;
        a.hi[at..at + p.hi.len()].copy_from_slice(&p.hi);
        a.lo[at..at + p.lo.len()].copy_from_slice(&p.lo);
        a.s.extend_from_slice(&p.s);
        a.base.extend_from_slice(&p.base);
        a.qs.extend_from_slice(&p.qs);
    }
    a
}
