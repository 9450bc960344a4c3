//! The packed weight: `QWeight` and its scales (layout: the module docs, "Packed layout" on).
//!
//! | item          | holds                                                                            |
//! |---------------|----------------------------------------------------------------------------------|
//! | `QWeight`     | `[n, k]` codes in panels of `PANEL` rows, each 8-, 6-, 5- or 4-bit (module docs) |
//! | `Scales`      | each block's `d`, `m` as f32, f16, or integers on an f16 grid (`Grid`, K-quants) |
//! | `Muls`        | the grid's `d` and `m` multipliers (u8; i8 or i16 where Q6_K rows are present)   |
//! | `unpack`      | back to row-major codes and `d`, `m` (the inverse of `QWeight::from_parts`)      |
//! | `dequantize`  | the weights' values, split panels included                                      |
//! | `block_codes` | one block of a panel in any layout as the 8-bit layout holds it                  |
//!
//! | layout | a panel's codes when every code of its rows is | bytes a 32-wide block of a panel   |
//! |--------|------------------------------------------------|------------------------------------|
//! | 4-bit  | < 16 (Q4_0, Q4_1, Q4_K)                        | 256: 4 nibble lines                |
//! | 5-bit  | < 32 (Q5_0, Q5_1, Q5_K)                        | 320: 4 nibble lines + 1 bit line   |
//! | 6-bit  | < 64 (GGUF Q6_K: split panels, below)          | 384: 4 nibble lines + 2 bit lines  |
//! | 8-bit  | any                                            | 512: 8 code lines                  |
//!
//! A split panel (`QWeight::split`, GGUF Q6_K rows) holds each 32-wide block as two 16-wide halves
//! with scales of their own, `w = d_h·(c - SPLIT_ZERO)` (h = 0 for k steps 0-3, 1 for 4-7), in the
//! 6-bit layout: its `d` slot holds `d_0` and its `m` slot `d_1`, and the offset is taken from the
//! activations' half sums (`QActs::halves`), so the file's values are held exactly in its 6 bits.
//!
//! Building one: pack.rs. The tiles read the fields and the `Scales` accessors here directly.

use std::sync::atomic::{AtomicU8, Ordering};

use super::{PANEL, QBLOCK};
use crate::error::{Error, Result};

/// A weight matrix `[n, k]` in the packed block-quantized layout.
#[derive(Debug)]
pub struct QWeight {
    pub(super) n: usize,
    pub(super) k: usize,
    /// The panels' codes, one after the other: `k * PANEL * bits / 8` bytes a panel of the
    /// `bits`-bit layout (8, 6, 5 or 4; module docs), so a panel's length names its layout.
    pub(super) codes: Vec<u8>,
    /// Where each panel's codes start in `codes` (`panels + 1` offsets).
    pub(super) code_at: Vec<usize>,
    /// `panels * (k / QBLOCK) * 2 * PANEL` scales.
    pub(super) scales: Scales,
    /// Which panels are split (module docs): one flag a panel, or empty when none is.
    pub(super) split: Vec<bool>,
    /// Activation digits its products quantize `x` into (1 or 2; module docs, "Activations"):
    /// chosen per matrix by the model's measured error, changed in place (`set_act_digits`) by
    /// whoever holds the weight, a decoder included (it shares the `Arc`).
    pub(super) act_digits: AtomicU8,
}

impl Clone for QWeight {
    fn clone(&self) -> Self {
        QWeight {
            n: self.n,
            k: self.k,
            codes: self.codes.clone(),
            code_at: self.code_at.clone(),
            scales: self.scales.clone(),
            split: self.split.clone(),
            act_digits: AtomicU8::new(self.act_digits.load(Ordering::Relaxed)),
        }
    }
}

/// The `d`, `m` of a weight: f16 when every one of them is exactly an f16 (GGUF Q4_0/Q4_1/Q5_x/Q8_0
/// scales are: half the bytes of f32, about a sixth of a 4-bit weight's), else f32. Widening an
/// f16 is exact, so both give the same products bit for bit.
///
/// `Grid` (GGUF K-quants, `gguf::GridScale`): per panel and 256-wide super-block, PANEL f16 `d`
/// bases then PANEL `m` bases; per panel and block, PANEL `d` multipliers and PANEL `m`
/// multipliers (u8 for Q4_K/Q5_K; i8 where Q6_K rows are present, all in split panels: their
/// sub-block scales; i16 where some Q6_K row shares a panel with other types); `d = base·mul` and
/// `m = base·mul` are exact f32 products, so again the same products bit for bit, in 2 bytes a
/// block and column (4 with i16) plus 4 per 256 instead of 8: a Q4_K weight takes 0.58 B/weight
/// (file: 0.5625), not 0.75, a Q6_K one 0.83 (file: 0.82).
///
/// `Sym` (GGUF Q4_0, Q5_0, Q8_0: symmetric codes, `m = r·d` with `r` = -8, -16, -128): only the f16
/// `d`, PANEL a block of a panel, and `m` computed as `r·d` (a power of two: exact, the same f32 as
/// the f16 `m` it replaces): 2 bytes a block and column, a Q8_0 weight 1.0625 B/weight as in the
/// file (not 1.125), a Q4_0 one 0.5625 (not 0.625).
#[derive(Clone, Debug, PartialEq)]
pub enum Scales {
    F32(Vec<f32>),
    F16(Vec<half::f16>),
    Sym {
        d: Vec<half::f16>,
        r: f32,
    },
    Grid {
        base: Vec<half::f16>,
        dmul: Muls,
        mmul: Muls,
    },
}

/// The `d` or `m` multipliers of `Scales::Grid`.
#[derive(Clone, Debug, PartialEq)]
pub enum Muls {
    U8(Vec<u8>),
    I8(Vec<i8>),
    I16(Vec<i16>),
}

impl Muls {
    #[inline]
    fn at(&self, i: usize) -> f32 {
        match self {
            Muls::U8(v) => v[i] as f32,
            Muls::I8(v) => v[i] as f32,
            Muls::I16(v) => v[i] as f32,
        }
    }
    pub(super) fn len(&self) -> usize {
        match self {
            Muls::U8(v) => v.len(),
            Muls::I8(v) => v.len(),
            Muls::I16(v) => v.len(),
        }
    }
    fn nbytes(&self) -> usize {
        match self {
            Muls::I16(v) => 2 * v.len(),
            m => m.len(),
        }
    }
    /// The address of multiplier `i` (only an address: for prefetches), without a branch: every
    /// variant is a `Vec` of 1- or 2-byte integers.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn addr(&self, i: usize) -> *const u8 {
        let (p, width) = match self {
            Muls::U8(v) => (v.as_ptr(), 1),
            Muls::I8(v) => (v.as_ptr() as *const u8, 1),
            Muls::I16(v) => (v.as_ptr() as *const u8, 2),
        };
        p.wrapping_add(i * width)
    }
}

/// Blocks of a `Scales::Grid` super-block (a GGUF K-quant's 256 values).
pub(super) const GRID_BLOCKS: usize = 8;

/// How many blocks (of one panel, then the next panel's) ahead of a tile the scale stream is
/// prefetched (`Scales::prefetch`; f16: 8 KiB). The hardware prefetcher alone leaves a one-row
/// 4-bit product bound by the scale loads at the end of each block; anywhere from 64 to 256 blocks
/// ahead lifts its bandwidth by about half (one thread alone nearly doubles); 8-bit panels, with
/// half the scale bytes a code byte, gain less.
const SCALE_PREFETCH_BLOCKS: usize = 128;

impl Scales {
    /// f16 when every value round-trips exactly, else the f32 values as they are (converted and
    /// checked 16k at a time on the kernel pool, with F16C where the CPU has it).
    pub(super) fn compact(v: Vec<f32>) -> Self {
        use half::slice::HalfFloatSliceExt;
        use rayon::prelude::*;
        const CHUNK: usize = 1 << 14;
        let mut h = vec![half::f16::ZERO; v.len()];
        let exact = h.par_chunks_mut(CHUNK).zip(v.par_chunks(CHUNK)).all(|(hc, vc)| {
            hc.convert_from_f32_slice(vc);
            let mut back = [0f32; 256];
            hc.chunks(256).zip(vc.chunks(256)).all(|(hh, vv)| {
                let b = &mut back[..hh.len()];
                hh.convert_to_f32_slice(b);
                b.iter().zip(vv).all(|(x, y)| x.to_bits() == y.to_bits())
            })
        });
        if exact {
            Scales::F16(h).symmetric()
        } else {
            Scales::F32(v)
        }
    }
    /// f16 scales whose every `m` is `r·d` for one negative power of two `r` (down to -256) as
    /// `Sym` (their `d` only); any other scales as they are.
    pub(super) fn symmetric(self) -> Self {
        let Scales::F16(h) = self else { return self };
        let pairs = || {
            h.chunks_exact(2 * PANEL).flat_map(|b| {
                b[..PANEL]
                    .iter()
                    .zip(&b[PANEL..])
                    .map(|(d, m)| (d.to_f32(), m.to_f32()))
            })
        };
        // m / d of the first block with d != 0 is exact where m = r·d; -1 where every d is 0.
        let r = pairs().find(|p| p.0 != 0.0).map_or(-1.0, |(d, m)| m / d);
        let pow2 = (-256.0..0.0).contains(&r) && (-r).log2().fract() == 0.0;
        // == on floats: a zero `d` with a +0 `m` gives r·d = -0, the same number.
        if !pow2 || !pairs().all(|(d, m)| m == r * d) {
            return Scales::F16(h);
        }
        let d = h
            .chunks_exact(2 * PANEL)
            .flat_map(|b| b[..PANEL].iter().copied())
            .collect();
        Scales::Sym { d, r }
    }
    /// Scales in the f32 layout's indexing (2*PANEL a block of a panel).
    pub(super) fn len(&self) -> usize {
        match self {
            Scales::F32(v) => v.len(),
            Scales::F16(v) => v.len(),
            Scales::Sym { d, .. } => 2 * d.len(),
            Scales::Grid { dmul, .. } => 2 * dmul.len(),
        }
    }
    fn nbytes(&self) -> usize {
        match self {
            Scales::F32(v) => 4 * v.len(),
            Scales::F16(v) | Scales::Sym { d: v, .. } => 2 * v.len(),
            Scales::Grid { base, dmul, mmul } => 2 * base.len() + dmul.nbytes() + mmul.nbytes(),
        }
    }
    /// Prefetch into L1 the scales of flat block `blk + SCALE_PREFETCH_BLOCKS` (`blk` is
    /// panel·nb + b, nb blocks a panel), for a tile about to read block `blk`'s. Only addresses:
    /// past the end a prefetch fetches nothing of use and never faults.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    pub(super) fn prefetch(&self, blk: usize) {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: SSE is part of the x86-64 baseline; a prefetch only names an address.
        let line = |p: *const u8| unsafe { _mm_prefetch::<_MM_HINT_T0>(p as *const i8) };
        let ahead = blk + SCALE_PREFETCH_BLOCKS;
        match self {
            // 2*PANEL values a block: two lines (f32), one (f16).
            Scales::F32(v) => {
                let p = v.as_ptr().wrapping_add(ahead * 2 * PANEL) as *const u8;
                line(p);
                line(p.wrapping_add(64));
            }
            Scales::F16(v) => line(v.as_ptr().wrapping_add(ahead * 2 * PANEL) as *const u8),
            // PANEL values a block: a line holds two blocks.
            Scales::Sym { d, .. } => line(d.as_ptr().wrapping_add(ahead * PANEL) as *const u8),
            // PANEL multipliers of each kind a block (the bases, one pair a super-block, follow).
            Scales::Grid { dmul, mmul, .. } => {
                line(dmul.addr(ahead * PANEL));
                line(mmul.addr(ahead * PANEL));
            }
        }
    }
    /// The 2*PANEL scales of one block of one panel from index `at`, as f32.
    #[inline]
    pub(super) fn block(&self, at: usize) -> [f32; 2 * PANEL] {
        let mut o = [0f32; 2 * PANEL];
        match self {
            Scales::F32(v) => o.copy_from_slice(&v[at..][..2 * PANEL]),
            Scales::F16(v) => {
                for (x, &h) in o.iter_mut().zip(&v[at..][..2 * PANEL]) {
                    *x = h.to_f32();
                }
            }
            Scales::Sym { .. } | Scales::Grid { .. } => {
                for (j, x) in o.iter_mut().enumerate() {
                    *x = self.at(at + j);
                }
            }
        }
        o
    }
    #[inline]
    pub(super) fn at(&self, i: usize) -> f32 {
        match self {
            Scales::F32(v) => v[i],
            Scales::F16(v) => v[i].to_f32(),
            Scales::Sym { d, r } => {
                let (blk, j) = (i / (2 * PANEL), i % (2 * PANEL));
                if j < PANEL {
                    d[blk * PANEL + j].to_f32()
                } else {
                    r * d[blk * PANEL + j - PANEL].to_f32()
                }
            }
            Scales::Grid { base, dmul, mmul } => {
                let (blk, j) = (i / (2 * PANEL), i % (2 * PANEL));
                let b = base[blk / GRID_BLOCKS * 2 * PANEL + j].to_f32();
                if j < PANEL {
                    b * dmul.at(blk * PANEL + j)
                } else {
                    b * mmul.at(blk * PANEL + j - PANEL)
                }
            }
        }
    }
}

impl QWeight {
    pub fn n(&self) -> usize {
        self.n
    }
    pub fn k(&self) -> usize {
        self.k
    }
    pub fn nbytes(&self) -> usize {
        self.codes.len() + self.scales.nbytes()
    }
    /// Activation digits of this weight's products: 2 (the default) or 1.
    pub fn act_digits(&self) -> usize {
        self.act_digits.load(Ordering::Relaxed) as usize
    }
    /// Set the activation digits (1 or 2) of the products that start from now on.
    pub fn set_act_digits(&self, digits: usize) -> Result<()> {
        if !(1..=2).contains(&digits) {
            return Err(Error::Invalid(format!("act_digits must be 1 or 2, got {digits}")));
        }
        self.act_digits.store(digits as u8, Ordering::Relaxed);
        Ok(())
    }
    /// True when the scales are held as f16 (`F16`, or `Sym`'s `d`; see `Scales`).
    pub fn half_scales(&self) -> bool {
        matches!(self.scales, Scales::F16(_) | Scales::Sym { .. })
    }
    /// How the scales are held: "f32", "f16", "sym" or "grid" (see `Scales`).
    pub fn scale_format(&self) -> &'static str {
        match self.scales {
            Scales::F32(_) => "f32",
            Scales::F16(_) => "f16",
            Scales::Sym { .. } => "sym",
            Scales::Grid { .. } => "grid",
        }
    }
    /// True when every panel's codes are held in the 4-bit layout.
    pub fn nibbles(&self) -> bool {
        self.nibble_panels() == self.panels()
    }
    /// How many panels (16 rows each) hold their codes in the 4-bit layout.
    pub fn nibble_panels(&self) -> usize {
        self.bits_panels(4)
    }
    /// How many panels hold their codes in the `bits`-bit layout (4, 5, 6 or 8; else 0).
    pub fn bits_panels(&self, bits: usize) -> usize {
        (0..self.panels()).filter(|&p| self.panel_bits(p) == bits).count()
    }
    /// The layout of panel `p`'s codes: 4, 5, 6 or 8 bits a code (read off its byte length).
    #[inline]
    pub(super) fn panel_bits(&self, p: usize) -> usize {
        (self.code_at[p + 1] - self.code_at[p]) * 8 / (self.k * PANEL)
    }
    /// Panel `p`'s codes.
    #[inline]
    pub(super) fn panel_codes(&self, p: usize) -> &[u8] {
        &self.codes[self.code_at[p]..self.code_at[p + 1]]
    }
    pub(super) fn blocks(&self) -> usize {
        self.k / QBLOCK
    }
    pub(super) fn panels(&self) -> usize {
        self.n.div_ceil(PANEL)
    }

    /// True when panel `p` is split (module docs).
    #[inline]
    pub(super) fn panel_split(&self, p: usize) -> bool {
        self.split.get(p).copied().unwrap_or(false)
    }
    /// How many panels are split (GGUF Q6_K rows held exactly; module docs).
    pub fn split_panels(&self) -> usize {
        self.split.iter().filter(|&&s| s).count()
    }

    /// The weights' values `[n, k]`, row-major: `d·c + m` for each block, `d_h·(c - SPLIT_ZERO)`
    /// for each half of a split panel's (exact in f64, as every product reads them).
    pub fn dequantize(&self) -> Vec<f64> {
        let (n, k, nb) = (self.n, self.k, self.blocks());
        let (codes, d, m) = self.unpack();
        let mut w = vec![0f64; n * k];
        for row in 0..n {
            let split = self.panel_split(row / PANEL);
            for (j, v) in w[row * k..][..k].iter_mut().enumerate() {
                let (b, c) = (row * nb + j / QBLOCK, codes[row * k + j] as f64);
                *v = match (split, j % QBLOCK < QBLOCK / 2) {
                    (true, true) => d[b] as f64 * (c - SPLIT_ZERO as f64),
                    (true, false) => m[b] as f64 * (c - SPLIT_ZERO as f64),
                    (false, _) => d[b] as f64 * c + m[b] as f64,
                };
            }
        }
        w
    }

    /// Row-major codes `[n, k]`, `d` and `m` `[n, k/32]` (the inverse of `from_parts`); for the rows
    /// of a split panel, `d` and `m` are the halves' scales `d_0`, `d_1` (module docs).
    pub fn unpack(&self) -> (Vec<u8>, Vec<f32>, Vec<f32>) {
        let (n, k, nb) = (self.n, self.k, self.blocks());
        let mut codes = vec![0u8; n * k];
        let (mut d, mut m) = (vec![0f32; n * nb], vec![0f32; n * nb]);
        let mut block = [0u8; QBLOCK * PANEL];
        for p in 0..self.panels() {
            let (src, bits) = (self.panel_codes(p), self.panel_bits(p));
            let rows = p * PANEL..((p + 1) * PANEL).min(n);
            for b in 0..nb {
                block_codes(src, bits, b, &mut block);
                for row in rows.clone() {
                    let i = row % PANEL;
                    for g in 0..QBLOCK / 4 {
                        codes[row * k + b * QBLOCK + g * 4..][..4].copy_from_slice(&block[g * LINE + i * 4..][..4]);
                    }
                }
            }
            for row in rows {
                let i = row % PANEL;
                for b in 0..nb {
                    let at = (p * nb + b) * 2 * PANEL;
                    d[row * nb + b] = self.scales.at(at + i);
                    m[row * nb + b] = self.scales.at(at + PANEL + i);
                }
            }
        }
        (codes, d, m)
    }
}

/// A split panel's code of the weight 0 (GGUF Q6_K's `q - 32`).
pub(super) const SPLIT_ZERO: i32 = 32;

/// Bytes of one code line: a 4-wide k step of a panel's 16 rows (byte `4i + j` = row i, k offset j).
pub(super) const LINE: usize = 4 * PANEL;

/// Block `b` of a panel's codes `src` held in the `bits`-bit layout, into `out` as the 8-bit layout
/// holds it (k step g's line at `g * LINE`). A block of the `bits`-bit layout is `bits` lines:
/// four nibble lines (line q: step 2q in the low nibbles, 2q+1 in the high ones; the 4-bit
/// layout), then for 5 bits one line with bit 4 of step g's codes at bit g, for 6 bits two lines,
/// line L with bits 4-5 of step 4L + f's codes at bits 2f..2f+1; each byte where the code line
/// has that code.
pub(super) fn block_codes(src: &[u8], bits: usize, b: usize, out: &mut [u8; QBLOCK * PANEL]) {
    let blk = &src[b * bits * LINE..][..bits * LINE];
    if bits == 8 {
        out.copy_from_slice(blk);
        return;
    }
    for g in 0..QBLOCK / 4 {
        let o = &mut out[g * LINE..][..LINE];
        for (x, &c) in o.iter_mut().zip(&blk[g / 2 * LINE..][..LINE]) {
            *x = (c >> (4 * (g % 2))) & 0x0f;
        }
        match bits {
            5 => {
                for (x, &h) in o.iter_mut().zip(&blk[4 * LINE..][..LINE]) {
                    *x |= ((h >> g) & 1) << 4;
                }
            }
            6 => {
                for (x, &h) in o.iter_mut().zip(&blk[(4 + g / 4) * LINE..][..LINE]) {
                    *x |= ((h >> (2 * (g % 4))) & 3) << 4;
                }
            }
            _ => debug_assert_eq!(bits, 4),
        }
    }
}

/// The layout a panel whose largest code is `top` takes: the fewest bits of 4, 5, 6, 8 that hold it.
pub(super) fn bits_for(top: u8) -> usize {
    match top {
        0..16 => 4,
        16..32 => 5,
        32..64 => 6,
        _ => 8,
    }
}
