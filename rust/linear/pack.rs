//! Building a `QWeight`: every constructor, and the packing of rows into panels (layout: weight.rs
//! and the module docs).
//!
//! | constructor       | from                                                                   |
//! |-------------------|------------------------------------------------------------------------|
//! | `from_f32`        | float weights `[n, k]`, quantized per block (`c` in 0..=255, `d`, `m`) |
//! | `from_parts`      | codes `[n, k]` and `d`, `m` `[n, k/32]` as they are                    |
//! | `from_gguf`       | GGUF rows of one tensor (`from_q4_1`, `from_q8_0`: of that type)       |
//! | `from_gguf_parts` | GGUF rows of several tensors stacked (a fused projection, mixed types) |
//! | `from_gguf_named` | the same, with errors naming the tensor                                |
//!
//! A panel takes the fewest bits of 4, 5, 6, 8 that hold every code of its rows (`bits_for`), and
//! from GGUF rows at most its types' own (Q4_x/Q4_K 4, Q5_x/Q5_K 5, others 8); scales are f16 when
//! every one is exactly an f16, the K-quant grid for K-quant rows (k a multiple of 256), else f32
//! (`Scales`).

use super::gguf;
use super::weight::{bits_for, block_codes, Muls, QWeight, Scales, GRID_BLOCKS, LINE};
use super::{PANEL, QBLOCK};
use crate::error::{Error, Result};

impl QWeight {
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

    /// The packed layout of checked parts: each panel in the fewest bits (4, 5, 6 or 8) that hold
    /// every code of its rows (`bits_for`). Panels are packed in parallel (on the caller's rayon pool).
    fn pack(n: usize, k: usize, codes: &[u8], d: &[f32], m: &[f32]) -> Self {
        use rayon::prelude::*;
        let bits: Vec<usize> = (0..n.div_ceil(PANEL))
            .into_par_iter()
            .map(|p| {
                bits_for(
                    codes[p * PANEL * k..((p + 1) * PANEL).min(n) * k]
                        .iter()
                        .copied()
                        .max()
                        .unwrap_or(0),
                )
            })
            .collect();
        Self::pack_layout(n, k, codes, d, m, &bits)
    }

    /// `pack` with each panel's layout given (`bits[p]`: 4, 5, 6 or 8, at least `bits_for` its codes).
    pub(super) fn pack_layout(n: usize, k: usize, codes: &[u8], d: &[f32], m: &[f32], bits: &[usize]) -> Self {
        use rayon::prelude::*;
        let nb = k / QBLOCK;
        let code_at = panel_offsets(k, bits);
        let mut pc = vec![0u8; code_at[bits.len()]];
        let mut ps = vec![0f32; bits.len() * nb * 2 * PANEL];
        split_panels(&mut pc, &code_at)
            .into_par_iter()
            .zip(ps.par_chunks_mut(nb * 2 * PANEL))
            .enumerate()
            .for_each(|(p, (dst, sc))| {
                for i in 0..PANEL.min(n - p * PANEL) {
                    let row = p * PANEL + i;
                    let r = row * nb..(row + 1) * nb;
                    pack_row(dst, sc, i, &codes[row * k..][..k], &d[r.clone()], &m[r], bits[p]);
                }
            });
        QWeight {
            n,
            k,
            codes: pc,
            code_at,
            scales: Scales::compact(ps),
            split: Vec::new(),
            act_digits: 2.into(),
        }
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
    /// A panel takes the widest layout its rows' types call for (`type_bits`: Q4_0, Q4_1, Q4_K 4
    /// bits, Q5_0, Q5_1, Q5_K 5, others 8), or fewer bits when its codes fit them (as
    /// `from_parts`): in a Q4_K_M QKV (Q4_K q and k, Q6_K v) the q and k panels keep 4-bit codes.
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
        let rows_of = |p: usize| p * PANEL..((p + 1) * PANEL).min(n);
        // Split panels (weight.rs): every row Q6_K, held exactly in 6 bits.
        let split: Vec<bool> = (0..panels)
            .map(|p| rows_of(p).all(|r| parts[part_of(r)].0 == "Q6_K"))
            .collect();
        let bits: Vec<usize> = (0..panels)
            .map(|p| {
                if split[p] {
                    return 6;
                }
                rows_of(p).map(|r| type_bits(parts[part_of(r)].0)).max().unwrap_or(8)
            })
            .collect();
        // The grid's multipliers: i16 where a Q6_K row shares a panel with other types (its
        // requantized step and minimum), else i8 with split panels (their sub-block scales), else u8.
        let q6_mixed = (0..panels).any(|p| !split[p] && rows_of(p).any(|r| parts[part_of(r)].0 == "Q6_K"));
        let muls = if q6_mixed {
            MulKind::I16
        } else if split.iter().any(|&s| s) {
            MulKind::I8
        } else {
            MulKind::U8
        };
        let code_at = panel_offsets(k, &bits);
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
            let mut base = Vec::new();
            let (mut dmul, mut mmul) = (Muls::U8(Vec::new()), Muls::U8(Vec::new()));
            // Each panel's own slices of the scales.
            let chunks: Vec<PanelScales> = if grid {
                base = vec![half::f16::ZERO; panels * nb / GRID_BLOCKS * 2 * PANEL];
                (dmul, mmul) = (muls.zeros(panels * nb * PANEL), muls.zeros(panels * nb * PANEL));
                base.chunks_mut(nb / GRID_BLOCKS * 2 * PANEL)
                    .zip(muls_chunks(&mut dmul, nb * PANEL))
                    .zip(muls_chunks(&mut mmul, nb * PANEL))
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
            // (some panel's codes all fit fewer bits than its types' (then repacked below), every
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
                                    if split[p] {
                                        gguf::to_split_blocks(src, 1, k, c, d, m, grid.then_some(g)).map(|()| 0)
                                    } else if grid {
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
                                            // In range of the kind chosen above (`muls`).
                                            dmul.set(b * PANEL + i, gs.d_mul);
                                            mmul.set(b * PANEL + i, gs.m_mul);
                                            if b % GRID_BLOCKS == 0 {
                                                let at = b / GRID_BLOCKS * 2 * PANEL + i;
                                                base[at] = gs.d_base;
                                                base[at + PANEL] = gs.m_base;
                                            }
                                        }
                                    }
                                }
                                // The widest a type gives (a Q6_K block's codes reach 255 where
                                // its two halves' scales differ) sets the layout below.
                                top = top.max(c.iter().copied().max().unwrap_or(0));
                                if split[p] {
                                    // Split panels keep the 6-bit layout (no other reads halves).
                                    top = top.max(32);
                                }
                                if bits_for(top) > bits[p] {
                                    return Err(Error::Invalid(format!(
                                        "internal: a {ty} row gave code {top}, past its {}-bit layout",
                                        bits[p]
                                    )));
                                }
                                pack_codes(dst, i, c, bits[p]);
                            }
                            Ok((bits_for(top) < bits[p], exact))
                        },
                    )
                    .try_reduce(|| (false, true), |a, b| Ok((a.0 || b.0, a.1 && b.1)))
            })?;
            let scales = if grid {
                Scales::Grid { base, dmul, mmul }
            } else if half {
                Scales::F16(ph).symmetric()
            } else {
                Scales::compact(ps)
            };
            let w = QWeight {
                n,
                k,
                codes: pc,
                code_at: code_at.clone(),
                scales,
                split: if split.iter().any(|&s| s) {
                    split.clone()
                } else {
                    Vec::new()
                },
                act_digits: 2.into(),
            };
            Ok((w, small, exact))
        };
        let (mut w, mut small, exact) = pass(legacy.is_some())?;
        if !exact {
            // some m = -2^e·d is not an f16 number: the f32 values, as `from_parts` holds them
            (w, small, _) = pass(false)?;
        }
        if small {
            // A panel whose codes all fit fewer bits than its types call for (constant blocks, a
            // Q6_K panel whose blocks' halves share their scales): the smaller layout there, as
            // `from_parts` packs it, with the same scales.
            return Ok(pool.install(|| w.repacked()));
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

impl QWeight {
    /// The same weight with each panel that is not split in the fewest bits that hold its codes
    /// (`bits_for`), the scales as they are (on the caller's rayon pool).
    fn repacked(self) -> Self {
        use rayon::prelude::*;
        let (k, nb) = (self.k, self.blocks());
        let bits: Vec<usize> = (0..self.panels())
            .into_par_iter()
            .map(|p| {
                if self.panel_split(p) {
                    return self.panel_bits(p);
                }
                let mut block = [0u8; QBLOCK * PANEL];
                let top = (0..nb).fold(0u8, |t, b| {
                    block_codes(self.panel_codes(p), self.panel_bits(p), b, &mut block);
                    t.max(block.iter().copied().max().unwrap_or(0))
                });
                bits_for(top)
            })
            .collect();
        let code_at = panel_offsets(k, &bits);
        let mut codes = vec![0u8; code_at[bits.len()]];
        split_panels(&mut codes, &code_at)
            .into_par_iter()
            .enumerate()
            .for_each(|(p, dst)| {
                let (src, from) = (self.panel_codes(p), self.panel_bits(p));
                if from == bits[p] {
                    dst.copy_from_slice(src);
                    return;
                }
                // Each row's codes, row-major, through the 8-bit layout of each block.
                let mut block = [0u8; QBLOCK * PANEL];
                let mut rows = vec![0u8; PANEL * k];
                for b in 0..nb {
                    block_codes(src, from, b, &mut block);
                    for i in 0..PANEL {
                        for g in 0..QBLOCK / 4 {
                            rows[i * k + b * QBLOCK + g * 4..][..4].copy_from_slice(&block[g * LINE + i * 4..][..4]);
                        }
                    }
                }
                for i in 0..PANEL {
                    pack_codes(dst, i, &rows[i * k..][..k], bits[p]);
                }
            });
        QWeight { codes, code_at, ..self }
    }
}

/// Where each panel's codes start (and, last, the total): `k * PANEL * bits[p] / 8` bytes a panel.
fn panel_offsets(k: usize, bits: &[usize]) -> Vec<usize> {
    let mut at = Vec::with_capacity(bits.len() + 1);
    at.push(0);
    for &b in bits {
        at.push(at.last().copied().unwrap_or(0) + k * PANEL * b / 8);
    }
    at
}

/// The layout every code of a GGUF type fits outside split panels: 4 bits for Q4_0, Q4_1, Q4_K, 5
/// for Q5_0, Q5_1, Q5_K, 8 for the others. Q6_K too: a Q6_K row in a panel with rows of other
/// types is folded onto one `d` a 32-wide block, whose codes are `q` (6 bits) only where the
/// block's two 16-wide halves share a scale, else up to 255 (`gguf::to_blocks`); panels of the
/// former are repacked in 6 bits.
fn type_bits(ggml_type: &str) -> usize {
    match ggml_type {
        "Q4_0" | "Q4_1" | "Q4_K" => 4,
        "Q5_0" | "Q5_1" | "Q5_K" => 5,
        _ => 8,
    }
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
        dmul: MulsMut<'a>,
        mmul: MulsMut<'a>,
    },
}

/// Which integer type a weight's grid multipliers take (`Scales::Grid`).
#[derive(Clone, Copy)]
enum MulKind {
    U8,
    I8,
    I16,
}

impl MulKind {
    fn zeros(self, len: usize) -> Muls {
        match self {
            MulKind::U8 => Muls::U8(vec![0; len]),
            MulKind::I8 => Muls::I8(vec![0; len]),
            MulKind::I16 => Muls::I16(vec![0; len]),
        }
    }
}

/// One panel's part of the `d` or `m` multipliers while it is packed.
enum MulsMut<'a> {
    U8(&'a mut [u8]),
    I8(&'a mut [i8]),
    I16(&'a mut [i16]),
}

impl MulsMut<'_> {
    /// Store `v`, which the kind holds (`MulKind` was chosen from the rows' types).
    fn set(&mut self, i: usize, v: i16) {
        match self {
            MulsMut::U8(s) => s[i] = v as u8,
            MulsMut::I8(s) => s[i] = v as i8,
            MulsMut::I16(s) => s[i] = v,
        }
    }
}

/// `m` cut into panels' parts of `len` multipliers.
fn muls_chunks(m: &mut Muls, len: usize) -> Vec<MulsMut<'_>> {
    match m {
        Muls::U8(v) => v.chunks_mut(len).map(MulsMut::U8).collect(),
        Muls::I8(v) => v.chunks_mut(len).map(MulsMut::I8).collect(),
        Muls::I16(v) => v.chunks_mut(len).map(MulsMut::I16).collect(),
    }
}

/// Row `i` of a panel: its codes into the panel's code line `dst` and its `d`, `m` into the
/// panel's scales `sc` (`pack_codes`, `pack_scales`).
fn pack_row(dst: &mut [u8], sc: &mut [f32], i: usize, codes: &[u8], d: &[f32], m: &[f32], bits: usize) {
    pack_codes(dst, i, codes, bits);
    pack_scales(sc, i, d, m);
}

/// Row `i`'s codes (each < 2^bits) into the panel's codes `dst` in the `bits`-bit layout
/// (`weight::block_codes` reads it back): per 32-wide block, 8-bit: step g's 4 codes at line g,
/// bytes 4i..4i+4; else the nibble lines (line q: step 2q low, 2q+1 high) and the high bits'
/// lines (5 bits: bit 4 of step g at bit g; 6 bits: bits 4-5 of step 4L + f at bits 2f, line L).
fn pack_codes(dst: &mut [u8], i: usize, codes: &[u8], bits: usize) {
    for (b, blk) in codes.chunks_exact(QBLOCK).enumerate() {
        let out = &mut dst[b * bits * LINE..][..bits * LINE];
        if bits == 8 {
            for (g, quad) in blk.chunks_exact(4).enumerate() {
                out[g * LINE + i * 4..][..4].copy_from_slice(quad);
            }
            continue;
        }
        for j in 0..4 {
            let c = |g: usize| blk[g * 4 + j];
            for q in 0..4 {
                out[q * LINE + i * 4 + j] = (c(2 * q) & 0x0f) | (c(2 * q + 1) << 4);
            }
            match bits {
                5 => out[4 * LINE + i * 4 + j] = (0..8).fold(0, |a, g| a | ((c(g) >> 4) & 1) << g),
                6 => {
                    for l in 0..2 {
                        out[(4 + l) * LINE + i * 4 + j] =
                            (0..4).fold(0, |a, f| a | ((c(4 * l + f) >> 4) & 3) << (2 * f));
                    }
                }
                _ => {}
            }
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
