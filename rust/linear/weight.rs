//! The packed weight: `QWeight` and its scales (layout: the module docs, "Packed layout" on).
//!
//! | item          | holds                                                                            |
//! |---------------|----------------------------------------------------------------------------------|
//! | `QWeight`     | `[n, k]` codes in panels of `PANEL` rows (8-bit, or 4-bit where a panel allows)  |
//! | `Scales`      | each block's `d`, `m` as f32, f16, or integers on an f16 grid (`Grid`, K-quants) |
//! | `Muls`        | the grid's `m` multipliers (u8, or i16 where Q6_K rows are present)              |
//! | `unpack`      | back to row-major codes and `d`, `m` (the inverse of `QWeight::from_parts`)      |
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
    /// The panels' codes, one after the other: `k * PANEL` bytes a panel, or `k * PANEL / 2` for a
    /// panel in the 4-bit layout (two codes a byte, module docs).
    pub(super) codes: Vec<u8>,
    /// Where each panel's codes start in `codes` (`panels + 1` offsets).
    pub(super) code_at: Vec<usize>,
    /// `panels * (k / QBLOCK) * 2 * PANEL` scales.
    pub(super) scales: Scales,
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
            act_digits: AtomicU8::new(self.act_digits.load(Ordering::Relaxed)),
        }
    }
}

/// The `d`, `m` of a weight: f16 when every one of them is exactly an f16 (GGUF Q4_0/Q4_1/Q5_x/Q8_0
/// scales are: half the bytes of f32, about a sixth of a 4-bit weight's), else f32. Widening an
/// f16 is exact, so both give the same products bit for bit.
///
/// `Grid` (GGUF K-quants, `gguf::GridScale`): per panel and 256-wide super-block, PANEL f16 `d`
/// bases then PANEL `m` bases; per panel and block, PANEL u8 `d` multipliers and PANEL `m`
/// multipliers (u8 for Q4_K/Q5_K, i16 where Q6_K rows are present); `d = base·mul` and
/// `m = base·mul` are exact f32 products, so again the same products bit for bit, in 2 bytes a
/// block and column (3 with Q6_K) plus 4 per 256 instead of 8: a Q4_K weight takes 0.58 B/weight
/// (file: 0.5625), not 0.75.
#[derive(Clone, Debug, PartialEq)]
pub enum Scales {
    F32(Vec<f32>),
    F16(Vec<half::f16>),
    Grid {
        base: Vec<half::f16>,
        dmul: Vec<u8>,
        mmul: Muls,
    },
}

/// The `m` multipliers of `Scales::Grid`.
#[derive(Clone, Debug, PartialEq)]
pub enum Muls {
    U8(Vec<u8>),
    I16(Vec<i16>),
}

impl Muls {
    #[inline]
    fn at(&self, i: usize) -> f32 {
        match self {
            Muls::U8(v) => v[i] as f32,
            Muls::I16(v) => v[i] as f32,
        }
    }
    fn nbytes(&self) -> usize {
        match self {
            Muls::U8(v) => v.len(),
            Muls::I16(v) => 2 * v.len(),
        }
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
            Scales::F16(h)
        } else {
            Scales::F32(v)
        }
    }
    /// Scales in the f32 layout's indexing (2*PANEL a block of a panel).
    pub(super) fn len(&self) -> usize {
        match self {
            Scales::F32(v) => v.len(),
            Scales::F16(v) => v.len(),
            Scales::Grid { dmul, .. } => 2 * dmul.len(),
        }
    }
    fn nbytes(&self) -> usize {
        match self {
            Scales::F32(v) => 4 * v.len(),
            Scales::F16(v) => 2 * v.len(),
            Scales::Grid { base, dmul, mmul } => 2 * base.len() + dmul.len() + mmul.nbytes(),
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
            // PANEL multipliers of each kind a block (the bases, one pair a super-block, follow).
            Scales::Grid { dmul, mmul, .. } => {
                line(dmul.as_ptr().wrapping_add(ahead * PANEL));
                match mmul {
                    Muls::U8(m) => line(m.as_ptr().wrapping_add(ahead * PANEL)),
                    Muls::I16(m) => line(m.as_ptr().wrapping_add(ahead * PANEL) as *const u8),
                }
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
            Scales::Grid { .. } => {
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
            Scales::Grid { base, dmul, mmul } => {
                let (blk, j) = (i / (2 * PANEL), i % (2 * PANEL));
                let b = base[blk / GRID_BLOCKS * 2 * PANEL + j].to_f32();
                if j < PANEL {
                    b * dmul[blk * PANEL + j] as f32
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
    /// True when the scales are held as f16 (see `Scales`).
    pub fn half_scales(&self) -> bool {
        matches!(self.scales, Scales::F16(_))
    }
    /// How the scales are held: "f32", "f16" or "grid" (see `Scales`).
    pub fn scale_format(&self) -> &'static str {
        match self.scales {
            Scales::F32(_) => "f32",
            Scales::F16(_) => "f16",
            Scales::Grid { .. } => "grid",
        }
    }
    /// True when every panel's codes are held in the 4-bit layout.
    pub fn nibbles(&self) -> bool {
        self.nibble_panels() == self.panels()
    }
    /// How many panels (16 rows each) hold their codes in the 4-bit layout.
    pub fn nibble_panels(&self) -> usize {
        (0..self.panels()).filter(|&p| self.panel_nibbles(p)).count()
    }
    /// Panel `p` holds its codes in the 4-bit layout.
    #[inline]
    pub(super) fn panel_nibbles(&self, p: usize) -> bool {
        self.code_at[p + 1] - self.code_at[p] < self.k * PANEL
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

    /// Row-major codes `[n, k]`, `d` and `m` `[n, k/32]` (the inverse of `from_parts`).
    pub fn unpack(&self) -> (Vec<u8>, Vec<f32>, Vec<f32>) {
        let (n, k, nb) = (self.n, self.k, self.blocks());
        let mut codes = vec![0u8; n * k];
        let (mut d, mut m) = (vec![0f32; n * nb], vec![0f32; n * nb]);
        for row in 0..n {
            let (p, i) = (row / PANEL, row % PANEL);
            let (src, nibbles) = (self.panel_codes(p), self.panel_nibbles(p));
            for g in 0..k / 4 {
                let out = &mut codes[row * k + g * 4..][..4];
                if nibbles {
                    for (o, &b) in out.iter_mut().zip(&src[g / 2 * 4 * PANEL + i * 4..][..4]) {
                        *o = (b >> (4 * (g % 2))) & 0x0f;
                    }
                } else {
                    out.copy_from_slice(&src[g * 4 * PANEL + i * 4..][..4]);
                }
            }
            for b in 0..nb {
                let at = (p * nb + b) * 2 * PANEL;
                d[row * nb + b] = self.scales.at(at + i);
                m[row * nb + b] = self.scales.at(at + PANEL + i);
            }
        }
        (codes, d, m)
    }
}
