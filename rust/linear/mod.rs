//! Block-quantized linear layers: `y[M, N] = x[M, K] · Wᵀ` with W held as 8-bit codes (no pyo3).
//!
//! | variant    | file    | used when (`variant` maps the ISA from `runtime` onto a build)                 |
//! |------------|---------|--------------------------------------------------------------------------------|
//! | scalar     | mod.rs  | ISA `scalar` (`set_isa("scalar")`, `PAGEDKV_ISA=scalar`) or `neon`, or no AVX2 |
//! | avx2       | avx2.rs | `vpmaddubsw` + `vpmaddwd` tile: ISA `avx2`, or `avx512` without VNNI          |
//! | avx512vnni | x86.rs  | ISA `avx512` on a CPU with AVX-512 F + BW + VNNI (`runtime::avx512_vnni`)      |
//!
//! Every variant gives the same bits (cargo tests and tests/kernels/test_qlinear.py compare them);
//! all of them against a float64 sum over the unpacked weights within 1e-5 relative.
//!
//! Weights: each row n of W is cut into K/32 blocks; block b holds 32 unsigned codes `c` and two
//! f32 numbers `d`, `m` with `w = d·c + m`. GGUF blocks map onto this as `gguf.rs` tabulates
//! (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K exactly, e.g. Q8_0 as `c = q + 128`, `m = -128·d`);
//! float weights are quantized asymmetrically per block (`c` in 0..=255).
//!
//! Activations are quantized per row and 32-wide block in two int8 digits of one number in an
//! integer base `R` of the block's own: with `a = max|x|`, `h = Q(x · (127/a))`, the rounding
//! error `e = x - (a/127)·h`, `R = min(⌊a / max|e|⌋, ⌊8·10⁶ / Σ|h|⌋, 32767)` and
//! `l = Q(e · (127·R/a))`, where
//! `Q(v) = round_half_even(v)` clamped to -127..=127; then `x ≈ s·(R·h + l)` with the block's one
//! scale `s = a/(127·R)`. The second digit quantizes the first one's rounding error at (within
//! 1/254 of) the finest scale that holds it, as a second scale of its own `max|e|/127` would, so
//! the activations keep ~15 bits per block, and more where an outlier sets `a` and the other
//! values are small (their errors are then small too; one int8 digit, as llama.cpp's Q8, loses
//! ~0.7 logits on SmolLM2 and flips near-tied greedy choices; two digits stay within ~0.01 of
//! float32). With `qs = s·(R·Σh + Σl)`:
//!
//! ```text
//! y[r, n] = Σ_b (d·s)·(R·Σ_j c·h + Σ_j c·l) + m·qs      (two fused multiply-adds per block)
//! ```
//!
//! The integer dots and their combination are exact in i32 (|R·Σc·h + Σc·l| <= R·255·Σ|h| +
//! 32·255·127 <= 8·10⁶·255 + 32·255·127 < 2^31, which is what the second cap keeps: a block of one
//! outlier (Σ|h| = 127) may take R up to the i16 cap, 32767, a dense block ~2000); `qs`'s integer
//! sum is then below 2^24, exact in f32; the dot's conversion to f32 and the f32 sum over blocks
//! round, in the same order on every path and for every M: a row's result does not depend on the
//! rows beside it, and the scalar and SIMD paths agree bit for bit (cargo tests assert it). One
//! scale a block, with an integer ratio between the digits, is what lets the tiles combine the
//! digits in integers: a multiply, an add and two FMAs a row, panel and block where a scale a
//! digit took a conversion, a product and an FMA each, plus the third FMA.
//!
//! Packed layout (what the SIMD kernel streams): output rows in panels of 16 (the last padded
//! with zero rows); a panel's codes are K/4 groups of 64 bytes = 16 rows × 4 consecutive k, so
//! one 64-byte load feeds one `vpdpbusd` for 16 outputs (or, split in two, two `vpmaddubsw` for 8
//! each); its scales are, per block, 16 `d` then 16 `m`. Work is split over columns only (pairs of
//! panels), never over K. Inside a job (`tile_order`) rows go in blocks whose activations stay in
//! L2 and, per block, panels a pair at a time with the block's rows streaming past their codes in
//! L1 (the decoder's jobs hold up to ~100 panels; rows-outer read a Q8_0 lm_head's codes from L3 once
//! per row).
//!
//! 4-bit layout (per panel): when every code of a panel's rows fits 4 bits (GGUF Q4_0, Q4_1, Q4_K
//! blocks) the panel stores two 4-wide k groups in one 64-byte line, group 2q in the low nibbles and
//! 2q+1 in the high ones, halving the bytes streamed per token (the weights then take about their
//! GGUF file size). Panels choose on their own, so a fused projection of mixed types (a Q4_K_M QKV:
//! Q4_K q and k, Q6_K v) keeps 4-bit codes where its rows allow.
//! Every tile reads it (the AVX2 one unpacks a line with two masks and runs its exact
//! single-`vpmaddubsw` mode, the VNNI one unpacks the same two vectors for `vpdpbusd`); the integer
//! dots and the float sums are the same, so the results are bit for bit those of the 8-bit layout.
//!
//! Scales (`Scales`): f16 when every `d` and `m` of a weight is exactly an f16 (GGUF Q4_0, Q4_1,
//! Q5_0, Q5_1, Q8_0 scales are), widened on load (F16C `vcvtph2ps`), else f32; widening is exact,
//! so the products are the same bit for bit. A Q4_1 weight then takes 20 bytes per 32, as in the file.

#[cfg(target_arch = "x86_64")]
mod avx2;
pub mod gguf;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod x86;

use crate::error::{Error, Result};
use crate::runtime::{self, Isa};

/// K values per quantization block.
pub const QBLOCK: usize = 32;

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
/// Output rows per packed panel.
pub const PANEL: usize = 16;

/// The build that runs for `isa` (the kernel ISA setting applies here too): `Avx512` is the VNNI
/// tile when the CPU has AVX-512 VNNI, else the AVX2 tile; `Avx2` that tile when the CPU has AVX2
/// and FMA; `Scalar` and `Neon` the scalar tile.
pub fn variant(isa: Isa) -> Isa {
    match isa {
        Isa::Avx512 if runtime::avx512_vnni() => Isa::Avx512,
        Isa::Avx2 | Isa::Avx512 if Isa::Avx2.available() => Isa::Avx2,
        _ => Isa::Scalar,
    }
}

/// What `kernel_info()` reports for the build `variant(isa)` runs.
pub fn variant_name(isa: Isa) -> &'static str {
    match variant(isa) {
        Isa::Avx512 => "avx512vnni",
        Isa::Avx2 => "avx2",
        _ => "scalar",
    }
}

/// The build the next call runs with.
pub fn active_isa() -> Result<Isa> {
    Ok(variant(runtime::isa()?))
}

/// The best build this CPU runs.
pub fn detected_isa() -> Isa {
    variant(runtime::detected_isa())
}

/// A weight matrix `[n, k]` in the packed block-quantized layout.
#[derive(Clone, Debug)]
pub struct QWeight {
    n: usize,
    k: usize,
    /// The panels' codes, one after the other: `k * PANEL` bytes a panel, or `k * PANEL / 2` for a
    /// panel in the 4-bit layout (two codes a byte, module docs).
    codes: Vec<u8>,
    /// Where each panel's codes start in `codes` (`panels + 1` offsets).
    code_at: Vec<usize>,
    /// `panels * (k / QBLOCK) * 2 * PANEL` scales.
    scales: Scales,
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
const GRID_BLOCKS: usize = 8;

/// How many blocks (of one panel, then the next panel's) ahead of a tile the scale stream is
/// prefetched (`Scales::prefetch`; f16: 8 KiB). The hardware prefetcher alone left a one-row
/// 4-bit product bound by the scale loads at the end of each block: 44 MB of SmolLM2-shaped 4-bit
/// panels (k = 576, f16 scales) at one row, in one process, 15 alternating calls, medians on the
/// AVX-512 VNNI VM: one thread 21-22 -> 36-43 GB/s with 64-256 blocks ahead, two threads 39-40
/// -> 55-61 (8-bit panels, half the scale bytes a code byte: 20-23 -> 23-26, 37-42 -> 38-47).
const SCALE_PREFETCH_BLOCKS: usize = 128;

impl Scales {
    /// f16 when every value round-trips exactly, else the f32 values as they are (converted and
    /// checked 16k at a time on the kernel pool, with F16C where the CPU has it).
    fn compact(v: Vec<f32>) -> Self {
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
    fn len(&self) -> usize {
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
    fn prefetch(&self, blk: usize) {
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
    fn block(&self, at: usize) -> [f32; 2 * PANEL] {
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
    fn at(&self, i: usize) -> f32 {
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
    fn panel_nibbles(&self, p: usize) -> bool {
        self.code_at[p + 1] - self.code_at[p] < self.k * PANEL
    }
    /// Panel `p`'s codes.
    #[inline]
    fn panel_codes(&self, p: usize) -> &[u8] {
        &self.codes[self.code_at[p]..self.code_at[p + 1]]
    }
    fn blocks(&self) -> usize {
        self.k / QBLOCK
    }
    fn panels(&self) -> usize {
        self.n.div_ceil(PANEL)
    }

    /// Pack row-major codes `[n, k]` and per-block `d`, `m` `[n, k/32]`.
    pub fn from_parts(n: usize, k: usize, codes: &[u8], d: &[f32], m: &[f32]) -> Result<Self> {
        use rayon::prelude::*;
        check_dims(n, k)?;
        let nb = k / QBLOCK;
        if codes.len() != n * k || d.len() != n * nb || m.len() != n * nb {
            return Err(Error::Invalid(format!(
                "need codes [{n}, {k}], d and m [{n}, {nb}]; got {}, {} and {} values",
                codes.len(),
                d.len(),
                m.len()
            )));
        }
        let pool = crate::runtime::pool()?;
        let bad = pool.install(|| d.par_iter().chain(m.par_iter()).position_first(|v| !v.is_finite()));
        if let Some(i) = bad {
            return Err(Error::Invalid(format!("scale {i} is not finite")));
        }
        Ok(pool.install(|| Self::pack(n, k, codes, d, m)))
    }

    /// The packed layout of checked parts: each panel in the 4-bit layout when every code of its
    /// rows is < 16, else the 8-bit one. Panels are packed in parallel (on the caller's rayon pool).
    fn pack(n: usize, k: usize, codes: &[u8], d: &[f32], m: &[f32]) -> Self {
        use rayon::prelude::*;
        let four: Vec<bool> = (0..n.div_ceil(PANEL))
            .into_par_iter()
            .map(|p| {
                codes[p * PANEL * k..((p + 1) * PANEL).min(n) * k]
                    .iter()
                    .all(|&x| x < 16)
            })
            .collect();
        Self::pack_layout(n, k, codes, d, m, &four)
    }

    /// `pack` with each panel's layout given (`four[p]`: 4-bit; only where its codes are < 16).
    fn pack_layout(n: usize, k: usize, codes: &[u8], d: &[f32], m: &[f32], four: &[bool]) -> Self {
        use rayon::prelude::*;
        let nb = k / QBLOCK;
        let code_at = panel_offsets(k, four);
        let mut pc = vec![0u8; code_at[four.len()]];
        let mut ps = vec![0f32; four.len() * nb * 2 * PANEL];
        split_panels(&mut pc, &code_at)
            .into_par_iter()
            .zip(ps.par_chunks_mut(nb * 2 * PANEL))
            .enumerate()
            .for_each(|(p, (dst, sc))| {
                for i in 0..PANEL.min(n - p * PANEL) {
                    let row = p * PANEL + i;
                    let r = row * nb..(row + 1) * nb;
                    pack_row(dst, sc, i, &codes[row * k..][..k], &d[r.clone()], &m[r], four[p]);
                }
            });
        QWeight {
            n,
            k,
            codes: pc,
            code_at,
            scales: Scales::compact(ps),
        }
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

    /// From GGUF rows `raw: [n, row_bytes]` of `ggml_type` (any of `gguf::TYPES`), `k` a
    /// multiple of 32: the file's blocks folded onto 32-wide blocks as `gguf::to_blocks` does
    /// (exact for Q4_0..Q8_0, Q4_K, Q5_K; see its table for Q6_K and float types).
    pub fn from_gguf(ggml_type: &str, raw: &[u8], n: usize, k: usize) -> Result<Self> {
        Self::from_gguf_parts(&[(ggml_type, raw, n)], k)
    }

    /// Rows of several GGUF tensors `(ggml_type, raw, rows)` of width `k`, stacked in order (a
    /// fused projection whose parts may have different types, as in Q4_K_M files).
    ///
    /// Decoded and packed panel by panel on the kernel threads, with no row-major copy in between:
    /// each thread decodes one row at a time into a row of scratch and packs it into its panel.
    /// A panel whose rows all come from tensors of 4-bit types (Q4_0, Q4_1, Q4_K) is packed as
    /// nibbles, others too when every code they give is < 16 (as `from_parts`): in a Q4_K_M QKV
    /// (Q4_K q and k, Q6_K v) the q and k panels keep 4-bit codes.
    pub fn from_gguf_parts(parts: &[(&str, &[u8], usize)], k: usize) -> Result<Self> {
        Self::from_gguf_named(parts, None, k)
    }

    /// `from_gguf_parts` whose errors name the part they are about: `tensor 'NAME': ...` with
    /// `names` (one a part), else `part i: ...` when there is more than one part.
    pub fn from_gguf_named(parts: &[(&str, &[u8], usize)], names: Option<&[&str]>, k: usize) -> Result<Self> {
        use rayon::prelude::*;
        if let Some(ns) = names {
            if ns.len() != parts.len() {
                return Err(Error::Invalid(format!(
                    "need one name a part: {} parts, {} names",
                    parts.len(),
                    ns.len()
                )));
            }
        }
        let n = parts.iter().try_fold(0usize, |a, p| a.checked_add(p.2));
        let n = n.ok_or_else(|| Error::Invalid("too many rows".into()))?;
        check_dims(n, k)?;
        let named = |i: usize, e: Error| {
            Error::Invalid(match names {
                Some(ns) => format!("tensor '{}': {e}", ns[i]),
                None if parts.len() > 1 => format!("part {i}: {e}"),
                None => e.to_string(),
            })
        };
        // (first row, row bytes) of each part, every part checked before any work.
        let mut starts = Vec::with_capacity(parts.len());
        let mut at = 0;
        for (i, &(ty, raw, rows)) in parts.iter().enumerate() {
            starts.push((at, gguf::check_raw(ty, raw, rows, k).map_err(|e| named(i, e))?));
            at += rows;
        }
        // K-quants only (k a multiple of 256): integer scales on the f16 super-block grid.
        let grid = parts.iter().all(|p| gguf::is_k_quant(p.0)) && k.is_multiple_of(GRID_BLOCKS * QBLOCK);
        let nb = k / QBLOCK;
        let panels = n.div_ceil(PANEL);
        let part_of = |row: usize| starts.partition_point(|s| s.0 <= row) - 1;
        let four: Vec<bool> = (0..panels)
            .map(|p| {
                (p * PANEL..((p + 1) * PANEL).min(n)).all(|r| matches!(parts[part_of(r)].0, "Q4_0" | "Q4_1" | "Q4_K"))
            })
            .collect();
        let code_at = panel_offsets(k, &four);
        // Legacy types only (Q4_0..Q8_0): f16 scales straight from the file's bits.
        let legacy: Option<Vec<gguf::Legacy>> = if grid {
            None
        } else {
            parts.iter().map(|p| gguf::Legacy::of(p.0)).collect()
        };
        let pool = crate::runtime::pool()?;
        let pass = |half: bool| -> Result<(QWeight, bool, bool)> {
            let mut pc = vec![0u8; code_at[panels]];
            let (mut ps, mut ph) = (Vec::new(), Vec::new());
            // The m multipliers: mn (6-bit) for Q4_K/Q5_K, min v (|v| <= 4096) for Q6_K.
            let wide_m = parts.iter().any(|p| p.0 == "Q6_K");
            let (mut base, mut dmul, mut m8, mut m16) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            // Each panel's own slices of the scales.
            let chunks: Vec<PanelScales> = if grid {
                base = vec![half::f16::ZERO; panels * nb / GRID_BLOCKS * 2 * PANEL];
                dmul = vec![0u8; panels * nb * PANEL];
                let mchunks: Vec<MulsMut> = if wide_m {
                    m16 = vec![0i16; panels * nb * PANEL];
                    m16.chunks_mut(nb * PANEL).map(MulsMut::I16).collect()
                } else {
                    m8 = vec![0u8; panels * nb * PANEL];
                    m8.chunks_mut(nb * PANEL).map(MulsMut::U8).collect()
                };
                base.chunks_mut(nb / GRID_BLOCKS * 2 * PANEL)
                    .zip(dmul.chunks_mut(nb * PANEL))
                    .zip(mchunks)
                    .map(|((base, dmul), mmul)| PanelScales::Grid { base, dmul, mmul })
                    .collect()
            } else if half {
                ph = vec![half::f16::ZERO; panels * nb * 2 * PANEL];
                ph.chunks_mut(nb * 2 * PANEL).map(PanelScales::F16).collect()
            } else {
                ps = vec![0f32; panels * nb * 2 * PANEL];
                ps.chunks_mut(nb * 2 * PANEL).map(PanelScales::F32).collect()
            };
            let not_finite = |j: usize, row: usize, b: usize| {
                named(
                    j,
                    Error::Invalid(format!(
                        "row {}, block {}: scale is not finite",
                        row - starts[j].0,
                        b % nb
                    )),
                )
            };
            // (some 8-bit panel's codes all fit 4 bits after all (then repacked below), every
            // scale an f16 number where `half`)
            let (small, exact) = pool.install(|| {
                split_panels(&mut pc, &code_at)
                    .into_par_iter()
                    .zip(chunks.into_par_iter())
                    .enumerate()
                    .map_init(
                        || {
                            let g = vec![gguf::GridScale::default(); if grid { nb } else { 0 }];
                            let h = vec![half::f16::ZERO; if half { 2 * nb } else { 0 }];
                            (vec![0u8; k], vec![0f32; nb], vec![0f32; nb], g, h)
                        },
                        |(c, d, m, g, h), (p, (dst, mut sc))| -> Result<(bool, bool)> {
                            let (mut top, mut exact) = (0u8, true);
                            for i in 0..PANEL.min(n - p * PANEL) {
                                let row = p * PANEL + i;
                                let j = part_of(row);
                                let ((ty, raw, _), (first, rb)) = (parts[j], starts[j]);
                                let src = &raw[(row - first) * rb..][..rb];
                                // The row's codes into `c`; its d, m into `d`, `m` (checked finite).
                                let mut decode = |g: &mut [gguf::GridScale]| -> Result<()> {
                                    if grid {
                                        gguf::to_grid_blocks(ty, src, 1, k, c, d, m, g)
                                    } else {
                                        gguf::to_blocks(ty, src, 1, k, c, d, m)
                                    }
                                    .map_err(|e| named(j, e))?;
                                    match d.iter().chain(m.iter()).position(|v| !v.is_finite()) {
                                        Some(b) => Err(not_finite(j, row, b)),
                                        None => Ok(()),
                                    }
                                };
                                match &mut sc {
                                    PanelScales::F16(sc) => {
                                        let lg = legacy
                                            .as_deref()
                                            .map(|l| l[j])
                                            .ok_or_else(|| Error::Invalid("f16 scales need Q4_0..Q8_0 parts".into()))?;
                                        let (dh, mh) = h.split_at_mut(nb);
                                        exact &=
                                            gguf::row_blocks_f16(lg, src, k, c, dh, mh).map_err(|e| named(j, e))?;
                                        // f16 non-finite: exponent all ones
                                        if let Some(b) = h.iter().position(|v| v.to_bits() & 0x7c00 == 0x7c00) {
                                            return Err(not_finite(j, row, b));
                                        }
                                        let (dh, mh) = h.split_at(nb);
                                        for (b, (&db, &mb)) in dh.iter().zip(mh).enumerate() {
                                            sc[b * 2 * PANEL + i] = db;
                                            sc[b * 2 * PANEL + PANEL + i] = mb;
                                        }
                                    }
                                    PanelScales::F32(sc) => {
                                        decode(g)?;
                                        pack_scales(sc, i, d, m);
                                    }
                                    PanelScales::Grid { base, dmul, mmul } => {
                                        decode(g)?;
                                        for (b, gs) in g.iter().enumerate() {
                                            dmul[b * PANEL + i] = gs.d_mul;
                                            match mmul {
                                                MulsMut::I16(v) => v[b * PANEL + i] = gs.m_mul,
                                                // Q4_K/Q5_K: mn is a 6-bit integer.
                                                MulsMut::U8(v) => v[b * PANEL + i] = gs.m_mul as u8,
                                            }
                                            if b % GRID_BLOCKS == 0 {
                                                let at = b / GRID_BLOCKS * 2 * PANEL + i;
                                                base[at] = gs.d_base;
                                                base[at + PANEL] = gs.m_base;
                                            }
                                        }
                                    }
                                }
                                if !four[p] {
                                    top = top.max(c.iter().copied().max().unwrap_or(0));
                                }
                                pack_codes(dst, i, c, four[p]);
                            }
                            Ok((!four[p] && top < 16, exact))
                        },
                    )
                    .try_reduce(|| (false, true), |a, b| Ok((a.0 || b.0, a.1 && b.1)))
            })?;
            let scales = if grid {
                let mmul = if wide_m { Muls::I16(m16) } else { Muls::U8(m8) };
                Scales::Grid { base, dmul, mmul }
            } else if half {
                Scales::F16(ph)
            } else {
                Scales::compact(ps)
            };
            let w = QWeight {
                n,
                k,
                codes: pc,
                code_at: code_at.clone(),
                scales,
            };
            Ok((w, small, exact))
        };
        let (mut w, mut small, exact) = pass(legacy.is_some())?;
        if !exact {
            // some m = -2^e·d is not an f16 number: the f32 values, as `from_parts` holds them
            (w, small, _) = pass(false)?;
        }
        if small {
            // A panel of an 8-bit type whose codes all fit in 4 bits (e.g. constant blocks): the
            // half-size layout there, as `from_parts` packs it, with the same scales.
            let (c, d, m) = w.unpack();
            let mut w4 = pool.install(|| Self::pack(n, k, &c, &d, &m));
            w4.scales = w.scales;
            return Ok(w4);
        }
        Ok(w)
    }

    /// From GGUF Q4_1 rows (`gguf::to_blocks`). `raw` is `[n, k/32 * 20]` bytes.
    pub fn from_q4_1(raw: &[u8], n: usize, k: usize) -> Result<Self> {
        Self::from_gguf("Q4_1", raw, n, k)
    }

    /// From GGUF Q8_0 rows (`c = q + 128`, `m = -128·d`). `raw` is `[n, k/32 * 34]` bytes.
    pub fn from_q8_0(raw: &[u8], n: usize, k: usize) -> Result<Self> {
        Self::from_gguf("Q8_0", raw, n, k)
    }

    /// Quantize float weights `[n, k]`: per block `d = (max - min)/255`, `m = min`,
    /// `c = round((w - m)/d)`.
    pub fn from_f32(w: &[f32], n: usize, k: usize) -> Result<Self> {
        check_dims(n, k)?;
        if w.len() != n * k {
            return Err(Error::Invalid(format!(
                "need {} weights for [{n}, {k}], got {}",
                n * k,
                w.len()
            )));
        }
        if let Some(i) = w.iter().position(|v| !v.is_finite()) {
            return Err(Error::Invalid(format!(
                "weight {i} (row {}, column {}) is not finite",
                i / k,
                i % k
            )));
        }
        let nb = k / QBLOCK;
        let mut codes = vec![0u8; n * k];
        let (mut d, mut m) = (vec![0f32; n * nb], vec![0f32; n * nb]);
        for (i, blk) in w.chunks_exact(QBLOCK).enumerate() {
            (d[i], m[i]) = gguf::quantize_asym(blk, &mut codes[i * QBLOCK..][..QBLOCK]);
        }
        Self::from_parts(n, k, &codes, &d, &m)
    }
}

/// Where each panel's codes start (and, last, the total): `k * PANEL` bytes a panel, half that
/// for a panel in the 4-bit layout (`four[p]`).
fn panel_offsets(k: usize, four: &[bool]) -> Vec<usize> {
    let mut at = Vec::with_capacity(four.len() + 1);
    at.push(0);
    for &f in four {
        at.push(at.last().copied().unwrap_or(0) + if f { k * PANEL / 2 } else { k * PANEL });
    }
    at
}

/// `codes` cut at the offsets `code_at` into one slice a panel.
fn split_panels<'a>(mut codes: &'a mut [u8], code_at: &[usize]) -> Vec<&'a mut [u8]> {
    let mut out = Vec::with_capacity(code_at.len().saturating_sub(1));
    for w in code_at.windows(2) {
        let (head, rest) = std::mem::take(&mut codes).split_at_mut(w[1] - w[0]);
        out.push(head);
        codes = rest;
    }
    out
}

/// One panel's part of the scales while it is packed.
enum PanelScales<'a> {
    F32(&'a mut [f32]),
    F16(&'a mut [half::f16]),
    Grid {
        base: &'a mut [half::f16],
        dmul: &'a mut [u8],
        mmul: MulsMut<'a>,
    },
}

/// One panel's part of the `m` multipliers while it is packed.
enum MulsMut<'a> {
    U8(&'a mut [u8]),
    I16(&'a mut [i16]),
}

/// Row `i` of a panel: its codes into the panel's code line `dst` and its `d`, `m` into the
/// panel's scales `sc` (`pack_codes`, `pack_scales`).
fn pack_row(dst: &mut [u8], sc: &mut [f32], i: usize, codes: &[u8], d: &[f32], m: &[f32], nibbles: bool) {
    pack_codes(dst, i, codes, nibbles);
    pack_scales(sc, i, d, m);
}

/// Row `i`'s codes into the panel's code line `dst` (4-byte groups of PANEL rows; as nibbles,
/// byte b of group pair h holds code 8h+b low and 8h+4+b high).
fn pack_codes(dst: &mut [u8], i: usize, codes: &[u8], nibbles: bool) {
    if nibbles {
        for (h, oct) in codes.chunks_exact(8).enumerate() {
            let at = &mut dst[h * 4 * PANEL + i * 4..][..4];
            for b in 0..4 {
                at[b] = oct[b] | (oct[4 + b] << 4);
            }
        }
    } else {
        for (g, quad) in codes.chunks_exact(4).enumerate() {
            dst[g * 4 * PANEL + i * 4..][..4].copy_from_slice(quad);
        }
    }
}

/// Row `i`'s `d`, `m` into the panel's scales `sc` (per block: PANEL `d`, then PANEL `m`).
fn pack_scales(sc: &mut [f32], i: usize, d: &[f32], m: &[f32]) {
    for (b, (&db, &mb)) in d.iter().zip(m).enumerate() {
        let s = &mut sc[b * 2 * PANEL..][..2 * PANEL];
        s[i] = db;
        s[PANEL + i] = mb;
    }
}

fn check_dims(n: usize, k: usize) -> Result<()> {
    if n == 0 || k == 0 || !k.is_multiple_of(QBLOCK) {
        return Err(Error::Invalid(format!(
            "weights need n >= 1 and k a positive multiple of {QBLOCK}, got n={n}, k={k}"
        )));
    }
    if n.checked_mul(k).is_none_or(|v| v > 1 << 34) {
        return Err(Error::Invalid(format!("weight matrix [{n}, {k}] is too large")));
    }
    Ok(())
}

/// Activations of `m` rows `[m, k]`, quantized per 32-wide block in two int8 digits.
pub struct QActs {
    /// First digit `h`.
    pub hi: Vec<i8>,
    /// Second digit `l` (the first one's rounding error).
    pub lo: Vec<i8>,
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
}

impl QActs {
    fn zeroed(m: usize, k: usize) -> Self {
        let nb = k / QBLOCK;
        QActs {
            hi: vec![0; m * k],
            lo: vec![0; m * k],
            s: vec![0.0; m * nb],
            base: vec![0; m * nb],
            qs: vec![0.0; m * nb],
            tiled: Vec::new(),
        }
    }

    /// Fill `tiled` from `hi` and `lo` (`m` rows of `k`): rows in groups of `TILED_ROWS` (the last
    /// one of the `m % TILED_ROWS` rows left, if any), a group of `g` rows laid out
    /// `[k/4][g rows][hi, lo][4 bytes]`; `2·m·k` bytes, group `j` from byte `j·2·TILED_ROWS·k`
    /// (`tiled_step` gives a group's bytes a 4-wide k step). A tile of up to 8 rows inside one group
    /// then finds the 4 bytes of each of its rows and digits for a k step at fixed offsets from one
    /// address, and the next step one group step on: no per-row address arithmetic in its inner loop.
    fn pack_tiled(&mut self, m: usize, k: usize) {
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
/// `lo` rows (no 8-row tile runs there, and the tiled layout pays from 8 rows on: x86.rs). One
/// sequence, `LLM.generate` on one thread, 128 tokens, 4 alternated rounds on the Zen 5 VM: 5.8-6.6
/// ms a token with row digits (the tile before the tiled layout) against 6.2-6.7 (tiled, the group
/// step a constant) and 6.5-7.1 (tiled, a run-time step); with rows below 8 rows, the same samples
/// in the tiles as the row-digit build under `perf record` (22128 vs 22538).
pub(super) const TILED_MIN_ROWS: usize = 8;

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

/// Arguments of one tile call, shared by the variants.
struct Args<'a> {
    acts: &'a QActs,
    w: &'a QWeight,
    out: *mut f32,
}

/// Portable tile: rows `r0..r0+mr`, panel `p` (the same float operations in the same order as
/// the SIMD tiles; `mul_add` is a correctly rounded libm `fmaf` here).
fn tile_scalar(a: &Args, r0: usize, mr: usize, p: usize) {
    let (k, nb, n) = (a.w.k, a.w.blocks(), a.w.n);
    let (codes, nibbles) = (a.w.panel_codes(p), a.w.panel_nibbles(p));
    let scales = p * nb * 2 * PANEL; // this panel's first scale
    for r in r0..r0 + mr {
        let (hi, lo) = (&a.acts.hi[r * k..][..k], &a.acts.lo[r * k..][..k]);
        let mut acc = [0f32; PANEL];
        for b in 0..nb {
            // Integer dots of the panel's 16 rows with both digits, 4 k at a time as the layout
            // stores them (the loop over 64 contiguous code bytes vectorizes).
            let (mut dh, mut dl) = ([0i32; PANEL], [0i32; PANEL]);
            if nibbles {
                // One 64-byte line holds groups 2q (low nibbles) and 2q+1 (high nibbles).
                for q in b * QBLOCK / 8..(b + 1) * QBLOCK / 8 {
                    let c = &codes[q * 4 * PANEL..][..4 * PANEL];
                    let (xh, xl) = (&hi[q * 8..][..8], &lo[q * 8..][..8]);
                    for i in 0..PANEL {
                        for j in 0..4 {
                            let (c0, c1) = ((c[i * 4 + j] & 0x0f) as i32, (c[i * 4 + j] >> 4) as i32);
                            dh[i] += c0 * xh[j] as i32 + c1 * xh[4 + j] as i32;
                            dl[i] += c0 * xl[j] as i32 + c1 * xl[4 + j] as i32;
                        }
                    }
                }
            } else {
                for g in b * QBLOCK / 4..(b + 1) * QBLOCK / 4 {
                    let c = &codes[g * 4 * PANEL..][..4 * PANEL];
                    let (xh, xl) = (&hi[g * 4..][..4], &lo[g * 4..][..4]);
                    for i in 0..PANEL {
                        for j in 0..4 {
                            dh[i] += c[i * 4 + j] as i32 * xh[j] as i32;
                            dl[i] += c[i * 4 + j] as i32 * xl[j] as i32;
                        }
                    }
                }
            }
            let sc = a.w.scales.block(scales + b * 2 * PANEL);
            let rb = r * nb + b;
            let (s, base, qs) = (a.acts.s[rb], a.acts.base[rb], a.acts.qs[rb]);
            for i in 0..PANEL {
                let (d, m) = (sc[i], sc[PANEL + i]);
                acc[i] = ((base * dh[i] + dl[i]) as f32).mul_add(d * s, acc[i]);
                acc[i] = m.mul_add(qs, acc[i]);
            }
        }
        for (i, v) in acc.iter().enumerate().take(PANEL.min(n - p * PANEL)) {
            // SAFETY: r < m rows and column p*PANEL + i < n of the [m, n] output the caller
            // sized; jobs write disjoint column ranges.
            unsafe { *a.out.add(r * n + p * PANEL + i) = *v };
        }
    }
}

/// Rows per tile of the SIMD tiles (each row is two digit streams).
const MR: usize = 2;
/// Panels per job (columns per job = JOB_PANELS * PANEL).
const JOB_PANELS: usize = 2;
/// Panels one pass of tiles keeps in L1 while a row block streams past (<= 18 KiB of codes).
const PASS_PANELS: usize = 2;
/// Activation bytes (two digits a value) of a row block: it stays in L2 while the job's panels
/// pass it a pair at a time.
const ROW_BLOCK_BYTES: usize = 96 << 10;

/// The tile order of a job over panels `p0..p0+np` and rows `0..m`, `mr` rows a tile: rows in
/// blocks whose activations stay in L2; within a block, panels `PASS_PANELS` at a time (their
/// codes stay in L1) and for each such pass the block's rows. `f(r0, rows, p, panels, first)` runs
/// one pass of tiles; `first` is true for the pass's first rows (the tiles that stream the codes in
/// from memory and prefetch ahead; the block's other rows find them in L1). The order changes no
/// result: every output is computed by one tile, alone.
fn tile_order(
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
struct SendPtr(*mut f32);
// SAFETY: the pointer is only dereferenced inside `linear`'s jobs, which write disjoint column
// ranges of an output buffer that outlives the parallel loop.
unsafe impl Send for SendPtr {}
// SAFETY: as above; jobs never touch the same element.
unsafe impl Sync for SendPtr {}

impl SendPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// `out[m, n] = x[m, k] · Wᵀ` on the kernel thread pool.
pub fn linear(x: &[f32], m: usize, w: &QWeight, out: &mut [f32]) -> Result<()> {
    linear_with(active_isa()?, x, m, w, out)
}

/// `x` is `[m, k]` and `out` `[m, n]` for the weight `w` `[n, k]`.
fn check_shapes(x: &[f32], m: usize, w: &QWeight, out: &[f32]) -> Result<()> {
    let (n, k) = (w.n, w.k);
    if x.len() != m * k {
        return Err(Error::Invalid(format!("x must be [{m}, {k}], got {} values", x.len())));
    }
    if out.len() != m * n {
        return Err(Error::Invalid(format!(
            "out must be [{m}, {n}], got {} values",
            out.len()
        )));
    }
    Ok(())
}

/// `linear` with an explicit variant (tests compare them).
pub fn linear_with(isa: Isa, x: &[f32], m: usize, w: &QWeight, out: &mut [f32]) -> Result<()> {
    use rayon::prelude::*;
    let k = w.k;
    check_shapes(x, m, w, out)?;
    if m == 0 {
        return Ok(());
    }
    let pool = runtime::pool()?;
    let out_ptr = SendPtr(out.as_mut_ptr());
    pool.install(|| {
        let acts = match variant(isa) {
            Isa::Scalar => quantize_acts(x, m, k),
            v => quantize_par(v, x, m, k, v == Isa::Avx512 && m >= TILED_MIN_ROWS),
        };
        let jobs = w.panels().div_ceil(JOB_PANELS);
        (0..jobs).into_par_iter().for_each(|j| {
            let a = Args {
                acts: &acts,
                w,
                out: out_ptr.get(),
            };
            let p0 = j * JOB_PANELS;
            let np = JOB_PANELS.min(w.panels() - p0);
            run_job(isa, &a, m, p0, np);
        });
    });
    Ok(())
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
    panels_per_job: usize,
    _out: std::marker::PhantomData<&'a mut [f32]>,
}

/// Rows from which `Product::new` quantizes in parallel chunks.
const TEAM_QUANTIZE_ROWS: usize = 16;

impl<'a> Product<'a> {
    /// Check the shapes and quantize `x` (on this thread, or from `TEAM_QUANTIZE_ROWS` rows on in
    /// chunks that the step team's idle helpers share through rayon); `threads` sizes the jobs
    /// (about 4 a thread, at least `JOB_PANELS` panels each). Each job is two contended atomic operations on
    /// the team's claim word and counter: with 16 jobs a thread, 8 alternated rounds of
    /// `LLM.generate` on the AVX-512 VNNI VM gave 1 sequence a median ~131 tok/s against ~150 with 4
    /// (faster in 7 of 8 rounds), 8 and 32 sequences the same or better; 2 a thread lost at 8
    /// sequences (one job a thread leaves the faster thread idle).
    pub fn new(isa: Isa, x: &[f32], m: usize, w: &'a QWeight, out: &'a mut [f32], threads: usize) -> Result<Self> {
        let k = w.k;
        check_shapes(x, m, w, out)?;
        let acts = match variant(isa) {
            Isa::Scalar => quantize_acts(x, m, k),
            // Rows in chunks a thread from TEAM_QUANTIZE_ROWS on: the team's idle helpers take
            // the other chunks from rayon (`Team::help`).
            Isa::Avx512 if m >= TEAM_QUANTIZE_ROWS => quantize_tiled(x, m, k, m.div_ceil(threads.max(1))),
            Isa::Avx512 if m >= TILED_MIN_ROWS => quantize_tiled(x, m, k, m),
            v => quantize_fast(v, x, m, k),
        };
        let panels_per_job = JOB_PANELS.max(w.panels().div_ceil(4 * threads.max(1)));
        Ok(Product {
            isa,
            acts,
            w,
            m,
            out: SendPtr(out.as_mut_ptr()),
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
        };
        let p0 = j * self.panels_per_job;
        run_job(self.isa, &a, self.m, p0, self.panels_per_job.min(self.w.panels() - p0));
    }
}

/// `quantize_acts` with the quantizer of the tile build `v` (`variant`): AVX-512 beside the VNNI
/// tile, AVX2 beside the AVX2 tile (so `PAGEDKV_ISA=avx2` runs what a CPU without AVX-512 runs),
/// the scalar one otherwise; identical results.
fn quantize_fast(v: Isa, x: &[f32], m: usize, k: usize) -> QActs {
    #[cfg(target_arch = "x86_64")]
    if v == Isa::Avx512 && Isa::Avx512.available() {
        let mut a = QActs::zeroed(m, k);
        // SAFETY: AVX-512 F/BW detected (`Isa::Avx512` includes them); x[..m*k] and the buffers are sized for m rows.
        unsafe { x86::quantize(&x[..m * k], &mut a.rows_mut(), x86::Digits::Rows) };
        return a;
    } else if v == Isa::Avx2 && Isa::Avx2.available() {
        let mut a = QActs::zeroed(m, k);
        // SAFETY: AVX2 and FMA detected (`Isa::Avx2` includes them); x[..m*k] and the buffers are sized for m rows.
        unsafe { avx2::quantize(&x[..m * k], &mut a) };
        return a;
    }
    quantize_acts(x, m, k)
}

/// The VNNI tile's activations: the digits in `tiled` only (`hi` and `lo` empty), straight from
/// the AVX-512 quantizer (the same bytes `pack_tiled` makes of `quantize_acts`; cargo tests), in
/// chunks of `chunk` rows (rounded up to a multiple of `TILED_ROWS`) on the rayon pool when there
/// is more than one, each written in place.
fn quantize_tiled(x: &[f32], m: usize, k: usize, chunk: usize) -> QActs {
    #[cfg(target_arch = "x86_64")]
    if Isa::Avx512.available() {
        use rayon::prelude::*;
        let nb = k / QBLOCK;
        let mut a = QActs {
            hi: Vec::new(),
            lo: Vec::new(),
            s: vec![0.0; m * nb],
            base: vec![0; m * nb],
            qs: vec![0.0; m * nb],
            tiled: vec![0; 2 * m * k],
        };
        let chunk = chunk.max(1).next_multiple_of(TILED_ROWS);
        let mut parts = Vec::with_capacity(m.div_ceil(chunk));
        let (mut rest, mut r) = (a.rows_mut(), 0);
        while r < m {
            let n = chunk.min(m - r);
            let (head, tail) = rest.split(n, k);
            parts.push((&x[r * k..(r + n) * k], head));
            (rest, r) = (tail, r + n);
        }
        let run = |(xc, mut v): (&[f32], ActsMut)| {
            // SAFETY: AVX-512 F/BW detected; xc holds whole rows, and v is those rows' `tiled` and
            // scale buffers (`split` at multiples of TILED_ROWS rows: their own groups).
            unsafe { x86::quantize(xc, &mut v, x86::Digits::Tiled { k }) }
        };
        if parts.len() > 1 {
            parts.into_par_iter().for_each(run);
        } else {
            parts.into_iter().for_each(run);
        }
        return a;
    }
    let _ = chunk;
    let mut a = quantize_acts(x, m, k);
    a.pack_tiled(m, k);
    a
}

/// `quantize_fast` for build `v` over chunks of 64 rows in parallel (`quantize_tiled` in such
/// chunks when `tiled`).
fn quantize_par(v: Isa, x: &[f32], m: usize, k: usize, tiled: bool) -> QActs {
    use rayon::prelude::*;
    const ROWS: usize = 64;
    if tiled {
        return quantize_tiled(x, m, k, ROWS);
    }
    if m <= ROWS {
        return quantize_fast(v, x, m, k);
    }
    let parts: Vec<QActs> = x[..m * k]
        .par_chunks(ROWS * k)
        .map(|c| quantize_fast(v, c, c.len() / k, k))
        .collect();
    let mut a = QActs {
        hi: Vec::with_capacity(m * k),
        lo: Vec::with_capacity(m * k),
        s: Vec::new(),
        base: Vec::new(),
        qs: Vec::new(),
        tiled: Vec::new(),
    };
    for p in parts {
        a.hi.extend_from_slice(&p.hi);
        a.lo.extend_from_slice(&p.lo);
        a.s.extend_from_slice(&p.s);
        a.base.extend_from_slice(&p.base);
        a.qs.extend_from_slice(&p.qs);
    }
    a
}

fn run_job(isa: Isa, a: &Args, m: usize, p0: usize, np: usize) {
    let mut v = variant(isa);
    let (tiled, rows) = (a.acts.tiled.len() == 2 * m * a.w.k, a.acts.hi.len() == m * a.w.k);
    if v == Isa::Avx512 && !tiled && !rows {
        // Neither layout in full (this module's callers always make one): the scalar tile.
        v = Isa::Scalar;
    }
    if v != Isa::Avx512 {
        return run_panels(v, a, m, p0, np, false);
    }
    // The VNNI tile takes one layout a call: runs of panels of one layout (a fused projection of
    // mixed types mixes them). Every column is computed by one tile whichever run holds it.
    let mut s = p0;
    while s < p0 + np {
        let four = a.w.panel_nibbles(s);
        let e = (s + 1..p0 + np)
            .find(|&q| a.w.panel_nibbles(q) != four)
            .unwrap_or(p0 + np);
        run_panels(v, a, m, s, e - s, four);
        s = e;
    }
}

/// Panels `p0..p0+np` on the tile of build `v`; for the Avx512 one, all of them 4-bit exactly
/// when `nib` (the other tiles read each panel's layout themselves).
fn run_panels(v: Isa, a: &Args, m: usize, p0: usize, np: usize, nib: bool) {
    match v {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => {
            // SAFETY: `variant` gives Avx512 only when AVX-512 F/BW/VNNI are detected, and
            // `run_job` hands it runs of panels of the layout `nib`; the tile bounds are within
            // the activations, weights and output sized by `linear_with`.
            unsafe { x86::job(a, m, p0, np, nib) }
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
