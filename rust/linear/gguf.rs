//! GGUF block formats: decoded to float32 bit for bit as `gguf.quants.dequantize` does, and cut
//! into the 32-wide `w = d·c + m` blocks of `QWeight` (no pyo3).
//!
//! | type | block (elements / bytes) | value                                  | onto 32-wide `d·c + m`            |
//! |------|--------------------------|----------------------------------------|-----------------------------------|
//! | Q4_0 | 32 / 18                  | d·(q - 8)                              | exact: c = q, m = -8d             |
//! | Q4_1 | 32 / 20                  | d·q + m                                | exact                             |
//! | Q5_0 | 32 / 22                  | d·(q - 16)                             | exact: c = q, m = -16d            |
//! | Q5_1 | 32 / 24                  | d·q + m                                | exact                             |
//! | Q8_0 | 32 / 34                  | d·q (q i8)                             | exact: c = q + 128, m = -128d     |
//! | Q4_K | 256 / 144                | (d·sc_j)·q - dmin·mn_j, 8 sub-blocks   | exact: d = d·sc_j, m = -dmin·mn_j |
//! | Q5_K | 256 / 176                | as Q4_K with a 5th bit                 | exact                             |
//! | Q6_K | 256 / 210                | (d·s_i)·(q - 32), 16 sub-blocks of 16  | exact as two halves (split panels:|
//! |      |                          |                                        | `to_split_blocks`); onto one `d`: |
//! |      |                          |                                        | exact when the integers s·(q - 32)|
//! |      |                          |                                        | of the 32 fit one 8-bit grid, else|
//! |      |                          |                                        | 8-bit requantized on d's integer  |
//! |      |                          |                                        | grid: ≤ (max-min)/510 + d/2       |
//! | F32, F16, BF16 | 1 / 4, 2, 2    | the number                             | 8-bit requantized: ≤ (max-min)/510|
//!
//! Q4_K/Q5_K layout (llama.cpp `block_q4_K`): d f16, dmin f16, scales[12] (8 six-bit scale/min
//! pairs), for Q5_K qh[32] (bit j of qh[l] = 5th bit of element l of sub-block j), qs[128]
//! (sub-blocks 2i and 2i+1 are the low and high nibbles of qs[32i..32i+32]). Q6_K: ql[128],
//! qh[64], scales i8[16], d f16; element e of a 128-half h: low 4 bits from nibble e/64 of
//! ql[64h + e%64], high 2 bits from bits 2·(e/32) of qh[32h + e%32].
//!
//! Every 32-wide block of the K-quants is also given as a `GridScale`: `d = d_base·d_mul` and
//! `m = m_base·m_mul`, an f16 per 256-wide super-block times a small integer per 32 (Q4_K/Q5_K:
//! `d·sc`, `(-dmin)·mn`; Q6_K: `d·t`, `d·o`), each product exact in f32, so `QWeight` can keep
//! 3 bytes of integers a block instead of two f32 (`Scales::Grid`) and get the same numbers.
//! Q6_K blocks: with `v = s·(q - 32)` (|v| ≤ 4096) and `o = min v`, exact when every `v - o` is a
//! multiple of one `t` ≤ 255 with `(max v - o)/t` ≤ 255 (`c = (v - o)/t`); otherwise
//! `t = ceil((max v - o)/255)` and `c = round((v - o)/t)`, an error ≤ `d·t/2`.
//!
//! Every product and sum is one f32 rounding in the order numpy evaluates it, so `dequantize`
//! equals the reference exactly (the tests compare bit for bit). "Exact" in the last column
//! means `d·c + m` is the same real number the format stores (the f32 `d` and `m` are exact
//! products of the file's fields). Rows are independent: a row of `k` weights is `k/elements`
//! consecutive blocks.

use half::f16;

use crate::error::{Error, Result};

/// Elements of one 32-wide `QWeight` block.
pub const BLOCK: usize = 32;

/// The types this module reads, as `gguf.GGMLQuantizationType` names them.
pub const TYPES: [&str; 11] = [
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K",
];

/// `(elements, bytes)` of one block of `ggml_type`, if this module decodes it.
pub fn block_shape(ggml_type: &str) -> Option<(usize, usize)> {
    Some(match ggml_type {
        "F32" => (1, 4),
        "F16" | "BF16" => (1, 2),
        "Q4_0" => (32, 18),
        "Q4_1" => (32, 20),
        "Q5_0" => (32, 22),
        "Q5_1" => (32, 24),
        "Q8_0" => (32, 34),
        "Q4_K" => (256, 144),
        "Q5_K" => (256, 176),
        "Q6_K" => (256, 210),
        _ => return None,
    })
}

/// Bytes of one row of `k` weights, after checking the type and that `k` fills whole blocks.
pub fn row_bytes(ggml_type: &str, k: usize) -> Result<usize> {
    let (el, bb) = block_shape(ggml_type).ok_or_else(|| {
        Error::Invalid(format!(
            "ggml_type must be one of {}, got {ggml_type:?}",
            TYPES.join(", ")
        ))
    })?;
    if k == 0 || !k.is_multiple_of(el) {
        return Err(Error::Invalid(format!(
            "k must be a positive multiple of {el} for {ggml_type}, got {k}"
        )));
    }
    Ok(k / el * bb)
}

/// `block_shape` as a `Result` (the callers checked the type already; an error, never a panic, if not).
fn shape_of(ggml_type: &str) -> Result<(usize, usize)> {
    block_shape(ggml_type).ok_or_else(|| Error::Invalid(format!("unsupported GGUF tensor type {ggml_type}")))
}

/// Checks that `raw` is `n` rows of `k` weights of `ggml_type`; returns the bytes of one row.
pub fn check_raw(ggml_type: &str, raw: &[u8], n: usize, k: usize) -> Result<usize> {
    let rb = row_bytes(ggml_type, k)?;
    if n.checked_mul(rb) != Some(raw.len()) {
        return Err(Error::Invalid(format!(
            "need {n} rows of {rb} bytes ({ggml_type}, k={k}), got {} bytes",
            raw.len()
        )));
    }
    Ok(rb)
}

/// Decode `n` rows of `k` weights stored as `ggml_type` (`raw`: `n * row_bytes` bytes) into
/// `out` (`n * k` floats).
pub fn dequantize(ggml_type: &str, raw: &[u8], n: usize, k: usize, out: &mut [f32]) -> Result<()> {
    check_raw(ggml_type, raw, n, k)?;
    if n.checked_mul(k) != Some(out.len()) {
        return Err(Error::Invalid(format!(
            "out must hold {} floats ([{n}, {k}]), got {}",
            n * k,
            out.len()
        )));
    }
    let (el, bb) = shape_of(ggml_type)?;
    let decode: fn(&[u8], &mut [f32]) = match ggml_type {
        "F32" => |b, o| o[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        "F16" => |b, o| o[0] = f16_at(b, 0),
        "BF16" => |b, o| o[0] = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16),
        "Q4_0" => q4_0,
        "Q4_1" => q4_1,
        "Q5_0" => q5_0,
        "Q5_1" => q5_1,
        "Q8_0" => q8_0,
        "Q4_K" => |b, o| k_quant(b, o, false),
        "Q5_K" => |b, o| k_quant(b, o, true),
        _ => q6_k,
    };
    for (blk, o) in raw.chunks_exact(bb).zip(out.chunks_exact_mut(el)) {
        decode(blk, o);
    }
    Ok(())
}

/// Cut `n` rows of `k` weights (`k` a multiple of 32 and of the type's block) into 32-wide
/// blocks: codes `[n, k]`, `d` and `m` `[n, k/32]` with `w = d·c + m` (see the module table).
/// Returns how many blocks were requantized to 8 bits (not exact).
pub fn to_blocks(
    ggml_type: &str,
    raw: &[u8],
    n: usize,
    k: usize,
    codes: &mut [u8],
    d: &mut [f32],
    m: &mut [f32],
) -> Result<usize> {
    to_blocks_with(ggml_type, raw, n, k, codes, d, m, None, false)
}

/// The integer form of a K-quant 32-wide block's scales: `d = d_base·d_mul`, `m = m_base·m_mul`
/// as f32 products, both exact; `d_base`, `m_base` are the same for the 8 blocks of a 256-wide
/// super-block.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GridScale {
    pub d_base: f16,
    pub d_mul: i16,
    pub m_base: f16,
    pub m_mul: i16,
}

impl GridScale {
    pub fn d(&self) -> f32 {
        self.d_base.to_f32() * self.d_mul as f32
    }
    pub fn m(&self) -> f32 {
        self.m_base.to_f32() * self.m_mul as f32
    }
}

/// True for the types whose blocks `to_grid_blocks` gives as `GridScale`s.
pub fn is_k_quant(ggml_type: &str) -> bool {
    matches!(ggml_type, "Q4_K" | "Q5_K" | "Q6_K")
}

/// `to_blocks` for a K-quant type, with each block's `d`, `m` also as a `GridScale`
/// (`grid`: `[n, k/32]`); the same codes, `d` and `m`.
#[allow(clippy::too_many_arguments)]
pub fn to_grid_blocks(
    ggml_type: &str,
    raw: &[u8],
    n: usize,
    k: usize,
    codes: &mut [u8],
    d: &mut [f32],
    m: &mut [f32],
    grid: &mut [GridScale],
) -> Result<usize> {
    if !is_k_quant(ggml_type) {
        return Err(Error::Invalid(format!(
            "integer scales need a K-quant type (Q4_K, Q5_K, Q6_K), got {ggml_type}"
        )));
    }
    if grid.len() != d.len() {
        return Err(Error::Invalid(format!(
            "need {} grid scales, got {}",
            d.len(),
            grid.len()
        )));
    }
    to_blocks_with(ggml_type, raw, n, k, codes, d, m, Some(grid), false)
}

/// GGUF Q6_K rows as the halves of split panels (`QWeight`'s module docs): codes `[n, k]` the
/// file's 6-bit `q` (`w = d_h·(q - 32)`), `d` and `m` `[n, k/32]` each 32-wide block's two
/// halves' scales `d·s_2j`, `d·s_2j+1` (exact f32 products), and with `grid` (`[n, k/32]`) the same
/// as `GridScale`s (`d_base` = `m_base` = the f16 `d`, the multipliers the i8 sub-block scales).
#[allow(clippy::too_many_arguments)]
pub fn to_split_blocks(
    raw: &[u8],
    n: usize,
    k: usize,
    codes: &mut [u8],
    d: &mut [f32],
    m: &mut [f32],
    grid: Option<&mut [GridScale]>,
) -> Result<()> {
    if grid.as_deref().is_some_and(|g| g.len() != d.len()) {
        return Err(Error::Invalid(format!("need {} grid scales", d.len())));
    }
    to_blocks_with("Q6_K", raw, n, k, codes, d, m, grid, true).map(|_| ())
}

#[allow(clippy::too_many_arguments)]
fn to_blocks_with(
    ggml_type: &str,
    raw: &[u8],
    n: usize,
    k: usize,
    codes: &mut [u8],
    d: &mut [f32],
    m: &mut [f32],
    mut grid: Option<&mut [GridScale]>,
    split: bool,
) -> Result<usize> {
    check_raw(ggml_type, raw, n, k)?;
    if !k.is_multiple_of(BLOCK) {
        return Err(Error::Invalid(format!("k must be a multiple of {BLOCK}, got {k}")));
    }
    let nb = n * (k / BLOCK);
    if codes.len() != n * k || d.len() != nb || m.len() != nb {
        return Err(Error::Invalid(format!(
            "need codes [{n}, {k}], d and m [{n}, {}]",
            k / BLOCK
        )));
    }
    let (el, bb) = shape_of(ggml_type)?;
    // Bytes of the source covering one 32-wide block, when blocks are not bigger than 32.
    let (unit_el, unit_bytes) = if el < BLOCK { (BLOCK, BLOCK * bb) } else { (el, bb) };
    let subs = unit_el / BLOCK;
    let mut inexact = 0;
    let mut vals = [0f32; BLOCK];
    // The type, matched once (not per block).
    #[derive(Clone, Copy, PartialEq)]
    enum Unit {
        Legacy(Legacy),
        K4,
        K5,
        Q6K,
        Float,
    }
    let unit = match ggml_type {
        "Q4_K" => Unit::K4,
        "Q5_K" => Unit::K5,
        "Q6_K" => Unit::Q6K,
        t => Legacy::of(t).map_or(Unit::Float, Unit::Legacy),
    };
    for (u, blk) in raw.chunks_exact(unit_bytes).enumerate() {
        for j in 0..subs {
            let i = u * subs + j;
            let c = &mut codes[i * BLOCK..][..BLOCK];
            let (db, mb) = match unit {
                Unit::Legacy(lg) => {
                    let (dd, ms) = lg.block(blk, c);
                    let dd = dd.to_f32();
                    match ms {
                        MScale::File(mm) => (dd, mm.to_f32()),
                        MScale::NegPow2(e) => (dd, -((1u32 << e) as f32) * dd),
                    }
                }
                Unit::K4 | Unit::K5 | Unit::Q6K => {
                    let (gs, exact) = if unit == Unit::Q6K && split {
                        (q6_k_halves(blk, j, c), true)
                    } else if unit == Unit::Q6K {
                        q6_k_sub(blk, j, c)
                    } else {
                        (k_sub(blk, j, unit == Unit::K5, c), true)
                    };
                    inexact += usize::from(!exact);
                    if let Some(g) = grid.as_deref_mut() {
                        g[i] = gs;
                    }
                    (gs.d(), gs.m())
                }
                Unit::Float => {
                    inexact += 1;
                    dequantize(ggml_type, blk, 1, BLOCK, &mut vals)?;
                    quantize_asym(&vals, c)
                }
            };
            d[i] = db;
            m[i] = mb;
        }
    }
    Ok(inexact)
}

/// The 32-wide types whose `d` is an f16 of the file and whose `m` is one too (Q4_1, Q5_1) or
/// `-2^e·d` (Q4_0: e = 3, Q5_0: 4, Q8_0: 7).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Legacy {
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
}

/// A legacy block's `m`: the file's f16, or `-2^e·d`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MScale {
    File(f16),
    NegPow2(u32),
}

impl Legacy {
    pub fn of(ggml_type: &str) -> Option<Self> {
        Some(match ggml_type {
            "Q4_0" => Legacy::Q4_0,
            "Q4_1" => Legacy::Q4_1,
            "Q5_0" => Legacy::Q5_0,
            "Q5_1" => Legacy::Q5_1,
            "Q8_0" => Legacy::Q8_0,
            _ => return None,
        })
    }

    /// The `gguf.GGMLQuantizationType` name (`block_shape`'s key).
    pub fn name(self) -> &'static str {
        match self {
            Legacy::Q4_0 => "Q4_0",
            Legacy::Q4_1 => "Q4_1",
            Legacy::Q5_0 => "Q5_0",
            Legacy::Q5_1 => "Q5_1",
            Legacy::Q8_0 => "Q8_0",
        }
    }

    /// The codes of the block `blk` into `c` (32), its `d` and its `m`.
    #[inline(always)]
    fn block(self, blk: &[u8], c: &mut [u8]) -> (f16, MScale) {
        let d = f16_bits(blk, 0);
        match self {
            Legacy::Q4_0 => {
                nibbles_into(&blk[2..18], c);
                (d, MScale::NegPow2(3))
            }
            Legacy::Q4_1 => {
                nibbles_into(&blk[4..20], c);
                (d, MScale::File(f16_bits(blk, 2)))
            }
            Legacy::Q5_0 | Legacy::Q5_1 => {
                let at = if self == Legacy::Q5_0 { 2 } else { 4 };
                let qh = u32::from_le_bytes([blk[at], blk[at + 1], blk[at + 2], blk[at + 3]]);
                nibbles_into(&blk[at + 4..at + 20], c);
                for (e, v) in c[..BLOCK].iter_mut().enumerate() {
                    *v |= (((qh >> e) & 1) as u8) << 4;
                }
                if self == Legacy::Q5_0 {
                    (d, MScale::NegPow2(4))
                } else {
                    (d, MScale::File(f16_bits(blk, 2)))
                }
            }
            Legacy::Q8_0 => {
                for (v, &q) in c.iter_mut().zip(&blk[2..34]) {
                    *v = q ^ 0x80; // q as i8 + 128
                }
                (d, MScale::NegPow2(7))
            }
        }
    }
}

/// `-2^e·d` as an f16 when it is one exactly (the f32 product `to_blocks` gives, rounded to f16
/// with no change), else `None`. Non-finite `d` gives a non-finite result.
#[inline]
fn neg_pow2_f16(d: f16, e: u32) -> Option<f16> {
    let b = d.to_bits();
    let exp = u32::from((b >> 10) & 0x1f);
    if exp == 0x1f || b & 0x7fff == 0 {
        return Some(f16::from_bits(b ^ 0x8000)); // ±inf/NaN or ±0: the sign flips
    }
    if exp == 0 {
        // subnormal: through f32 (rare)
        let v = -((1u32 << e) as f32) * d.to_f32();
        let h = f16::from_f32(v);
        return (h.to_f32().to_bits() == v.to_bits()).then_some(h);
    }
    (exp + e <= 30).then(|| f16::from_bits((b ^ 0x8000) + ((e as u16) << 10)))
}

/// One row of `k` weights of a `Legacy` type cut into 32-wide blocks as `to_blocks` does, with
/// `d` and `m` `[k/32]` as the f16 numbers they are (no float step). `Ok(false)` when some
/// `m = -2^e·d` is not an f16 number (then `to_blocks` gives the f32 values).
pub fn row_blocks_f16(
    lg: Legacy,
    raw: &[u8],
    k: usize,
    codes: &mut [u8],
    d: &mut [f16],
    m: &mut [f16],
) -> Result<bool> {
    // The row's bytes as `to_blocks` checks them (the type's block size from `block_shape`).
    let bb = check_raw(lg.name(), raw, 1, k)? / (k / BLOCK);
    let nb = k / BLOCK;
    if codes.len() != k || d.len() != nb || m.len() != nb {
        return Err(Error::Invalid(format!("need codes [{k}], d and m [{nb}]")));
    }
    let mut exact = true;
    for (((blk, c), dd), mm) in raw
        .chunks_exact(bb)
        .zip(codes.chunks_exact_mut(BLOCK))
        .zip(d.iter_mut())
        .zip(m.iter_mut())
    {
        let (db, ms) = lg.block(blk, c);
        *dd = db;
        *mm = match ms {
            MScale::File(v) => v,
            MScale::NegPow2(e) => neg_pow2_f16(db, e).unwrap_or_else(|| {
                exact = false;
                f16::ZERO
            }),
        };
    }
    Ok(exact)
}

/// Asymmetric 8-bit codes of 32 floats: `d = (max - min)/255`, `m = min`, `c = round((w - m)/d)`;
/// |error| <= d/2 (plus an f32 rounding). Non-finite input gives a non-finite `d` or `m`.
pub fn quantize_asym(blk: &[f32], c: &mut [u8]) -> (f32, f32) {
    let lo = blk.iter().copied().fold(f32::INFINITY, f32::min);
    let hi = blk.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if blk.iter().any(|v| !v.is_finite()) {
        c.fill(0);
        return (f32::NAN, f32::NAN);
    }
    let step = (hi - lo) / 255.0;
    let inv = if step > 0.0 { 1.0 / step } else { 0.0 };
    for (o, &v) in c.iter_mut().zip(blk) {
        *o = ((v - lo) * inv).round_ties_even().clamp(0.0, 255.0) as u8;
    }
    (step, lo)
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16_bits(b, at).to_f32()
}

fn f16_bits(b: &[u8], at: usize) -> f16 {
    f16::from_le_bytes([b[at], b[at + 1]])
}

fn nibbles(qs: &[u8], j: usize) -> (u8, u8) {
    (qs[j] & 0x0f, qs[j] >> 4)
}

/// 32 codes from 16 bytes: low nibbles are elements 0..16, high nibbles 16..32.
#[inline(always)]
fn nibbles_into(qs: &[u8], c: &mut [u8]) {
    let (lo, hi) = c[..BLOCK].split_at_mut(16);
    for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(&qs[..16]) {
        *l = q & 0x0f;
        *h = q >> 4;
    }
}

fn q4_0(b: &[u8], o: &mut [f32]) {
    let d = f16_at(b, 0);
    for j in 0..16 {
        let (lo, hi) = nibbles(&b[2..], j);
        o[j] = d * (lo as f32 - 8.0);
        o[j + 16] = d * (hi as f32 - 8.0);
    }
}

fn q4_1(b: &[u8], o: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    for j in 0..16 {
        let (lo, hi) = nibbles(&b[4..], j);
        o[j] = d * lo as f32 + m;
        o[j + 16] = d * hi as f32 + m;
    }
}

fn q5(qh: u32, qs: &[u8], j: usize) -> (f32, f32) {
    let (lo, hi) = nibbles(qs, j);
    let lo = lo | (((qh >> j) & 1) as u8) << 4;
    let hi = hi | (((qh >> (j + 16)) & 1) as u8) << 4;
    (lo as f32, hi as f32)
}

fn q5_0(b: &[u8], o: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    for j in 0..16 {
        let (lo, hi) = q5(qh, &b[6..], j);
        o[j] = d * (lo - 16.0);
        o[j + 16] = d * (hi - 16.0);
    }
}

fn q5_1(b: &[u8], o: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    for j in 0..16 {
        let (lo, hi) = q5(qh, &b[8..], j);
        o[j] = d * lo + m;
        o[j + 16] = d * hi + m;
    }
}

fn q8_0(b: &[u8], o: &mut [f32]) {
    let d = f16_at(b, 0);
    for j in 0..32 {
        o[j] = d * (b[2 + j] as i8) as f32;
    }
}

/// Six-bit scale and min of sub-block `j` (llama.cpp `get_scale_min_k4`).
fn scale_min_k4(s: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Codes of sub-block `j` of a Q4_K (`five` false) or Q5_K block, and its scales `d·sc`,
/// `(-dmin)·mn` (= `-(dmin·mn)`: a sign flip is exact).
fn k_sub(b: &[u8], j: usize, five: bool, c: &mut [u8]) -> GridScale {
    let (d, dmin) = (f16_bits(b, 0), f16_bits(b, 2));
    let (sc, mn) = scale_min_k4(&b[4..16], j);
    let qs = if five { &b[48..176] } else { &b[16..144] };
    let shift = 4 * (j % 2);
    for (l, v) in c.iter_mut().enumerate() {
        *v = (qs[32 * (j / 2) + l] >> shift) & 0x0f;
        if five {
            *v |= ((b[16 + l] >> j) & 1) << 4;
        }
    }
    // Both products are exact in f32 (11-bit f16 mantissas times 6-bit integers).
    GridScale {
        d_base: d,
        d_mul: sc as i16,
        m_base: -dmin,
        m_mul: mn as i16,
    }
}

fn k_quant(b: &[u8], o: &mut [f32], five: bool) {
    let mut c = [0u8; BLOCK];
    for j in 0..8 {
        let g = k_sub(b, j, five, &mut c);
        let (ds, dm) = (g.d(), -g.m());
        for (v, &q) in o[j * BLOCK..][..BLOCK].iter_mut().zip(&c) {
            *v = ds * q as f32 - dm;
        }
    }
}

/// The 6-bit value (q - 32 in -32..=31) of element `e` (0..256) of a Q6_K block.
fn q6_value(b: &[u8], e: usize) -> i32 {
    let (h, w) = (e / 128, e % 128);
    let lo = (b[64 * h + w % 64] >> (4 * (w / 64))) & 0x0f;
    let hi = (b[128 + 32 * h + w % 32] >> (2 * (w / 32))) & 0x03;
    (lo | (hi << 4)) as i32 - 32
}

fn q6_k(b: &[u8], o: &mut [f32]) {
    let d = f16_at(b, 208);
    for (e, v) in o[..256].iter_mut().enumerate() {
        let ds = d * (b[192 + e / 16] as i8) as f32;
        *v = ds * q6_value(b, e) as f32;
    }
}

/// gcd of two non-negative integers (binary: shifts and subtractions, no division).
fn gcd(a: i32, b: i32) -> i32 {
    let (mut a, mut b) = (a.unsigned_abs(), b.unsigned_abs());
    if a == 0 || b == 0 {
        return (a | b) as i32;
    }
    let shift = (a | b).trailing_zeros();
    a >>= a.trailing_zeros();
    loop {
        b >>= b.trailing_zeros();
        if a > b {
            std::mem::swap(&mut a, &mut b);
        }
        b -= a;
        if b == 0 {
            return (a << shift) as i32;
        }
    }
}

/// Sub-block `j` (32 wide) of a Q6_K block as the two halves of a split panel's block: `c` the
/// 6-bit `q` as stored, the halves' scales `d·s0`, `d·s1` as `GridScale` (`d`, `m`).
fn q6_k_halves(b: &[u8], j: usize, c: &mut [u8]) -> GridScale {
    let d = f16_bits(b, 208);
    for (l, x) in c.iter_mut().enumerate() {
        *x = (q6_value(b, j * BLOCK + l) + 32) as u8;
    }
    GridScale {
        d_base: d,
        d_mul: b[192 + 2 * j] as i8 as i16,
        m_base: d,
        m_mul: b[192 + 2 * j + 1] as i8 as i16,
    }
}

/// Sub-block `j` (32 wide: two 16-wide halves with int8 scales s0, s1) of a Q6_K block as `d·c + m`
/// on the integer grid of the block's f16 `d`: with `v = s·(q - 32)` (|v| <= 4096) and `o = min v`,
/// `m = d·o`; exact (`true`) when every `v - o` is a multiple of one `t <= 255` with
/// `(max v - o)/t <= 255`, then `c = (v - o)/t`; else `t = ceil((max v - o)/255)` and
/// `c = round((v - o)/t)` (error <= d·t/2). `d·t` and `d·o` are exact f32 products.
fn q6_k_sub(b: &[u8], j: usize, c: &mut [u8]) -> (GridScale, bool) {
    let d = f16_bits(b, 208);
    let (s0, s1) = (b[192 + 2 * j] as i8 as i32, b[192 + 2 * j + 1] as i8 as i32);
    let v: [i32; BLOCK] = std::array::from_fn(|l| if l < 16 { s0 } else { s1 } * q6_value(b, j * BLOCK + l));
    let (lo, hi) = (
        v.iter().fold(i32::MAX, |a, &x| a.min(x)),
        v.iter().fold(i32::MIN, |a, &x| a.max(x)),
    );
    let span = hi - lo;
    // The least step that spans the block in 255 codes.
    let least = (span + 254) / 255;
    // gcd of every v - o; it only falls as values come in, so once below `least` the block
    // cannot be exact (most requantized blocks get there within a few values).
    let mut g = 0;
    for &x in &v {
        g = gcd(g, x - lo);
        if g > 0 && g < least {
            break;
        }
    }
    // The largest step <= 255 that divides every v - o and spans the block in 255 codes.
    let exact_t = if g == 0 {
        Some(1)
    } else {
        (least.max(1)..=255.min(g)).rev().find(|t| g % t == 0)
    };
    let (t, exact) = match exact_t {
        Some(t) => (t, true),
        None => (least, false),
    };
    // Nearest, halves up (exact when t divides v - o); at most span/t + 1/2 < 256. The quotient
    // floor((2(v - o) + t) / 2t) by a reciprocal, then corrected to the exact integer one.
    let den = 2 * t;
    let inv = 1.0 / den as f32;
    for (x, &vv) in c.iter_mut().zip(&v) {
        let num = 2 * (vv - lo) + t;
        let mut q = (num as f32 * inv) as i32;
        if q * den > num {
            q -= 1;
        } else if (q + 1) * den <= num {
            q += 1;
        }
        *x = q.min(255) as u8;
    }
    let gs = GridScale {
        d_base: d,
        d_mul: t as i16,
        m_base: d,
        m_mul: lo as i16,
    };
    (gs, exact)
}

/// Why a GGUF string array could not be read (`item` counts from 0).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StringsError {
    /// Item `item` needs `need` bytes at byte offset `at`, past the end of the buffer.
    Truncated { item: usize, at: usize, need: u64 },
    /// Item `item`'s bytes are not UTF-8.
    NotUtf8 { item: usize },
}

/// `count` GGUF strings (a u64 little-endian byte length, then that many UTF-8 bytes) read from
/// `buf` at byte offset `pos`: the strings (borrowed from `buf`) and the offset after the last one.
pub fn string_array(buf: &[u8], pos: usize, count: usize) -> std::result::Result<(Vec<&str>, usize), StringsError> {
    // At least 8 bytes an item: a count the buffer cannot hold fails before anything is allocated.
    let room = buf.len().saturating_sub(pos) / 8;
    let mut out = Vec::with_capacity(count.min(room));
    let mut at = pos;
    for item in 0..count {
        let len = match buf.get(at..).and_then(|b| b.get(..8)) {
            Some(b) => u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]),
            None => return Err(StringsError::Truncated { item, at, need: 8 }),
        };
        let body = at + 8;
        let bytes = usize::try_from(len)
            .ok()
            .and_then(|n| buf.get(body..)?.get(..n))
            .ok_or(StringsError::Truncated {
                item,
                at: body,
                need: len,
            })?;
        out.push(std::str::from_utf8(bytes).map_err(|_| StringsError::NotUtf8 { item })?);
        at = body + bytes.len();
    }
    Ok((out, at))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Rng;

    fn gguf_strings(items: &[&[u8]]) -> Vec<u8> {
        let mut b = vec![0xAA, 0xBB]; // two bytes before the array: a non-zero start offset
        for it in items {
            b.extend((it.len() as u64).to_le_bytes());
            b.extend(*it);
        }
        b
    }

    #[test]
    fn string_arrays_read_and_fail_cleanly() {
        let b = gguf_strings(&[b"hello", b"", "\u{0120}caf\u{e9}".as_bytes(), b"a b"]);
        let (v, end) = string_array(&b, 2, 4).unwrap();
        assert_eq!(v, vec!["hello", "", "\u{0120}caf\u{e9}", "a b"]);
        assert_eq!(end, b.len());
        assert_eq!(string_array(&b, 2, 0).unwrap(), (vec![], 2));
        // one item more than there is: the length itself is missing
        assert_eq!(
            string_array(&b, 2, 5),
            Err(StringsError::Truncated {
                item: 4,
                at: b.len(),
                need: 8
            })
        );
        // a body cut short, and a length no buffer holds
        let cut = &b[..b.len() - 1];
        assert_eq!(
            string_array(cut, 2, 4),
            Err(StringsError::Truncated {
                item: 3,
                at: cut.len() - 2,
                need: 3
            })
        );
        let mut huge = gguf_strings(&[]);
        huge.extend(u64::MAX.to_le_bytes());
        assert_eq!(
            string_array(&huge, 2, usize::MAX),
            Err(StringsError::Truncated {
                item: 0,
                at: 10,
                need: u64::MAX
            })
        );
        assert_eq!(
            string_array(&b, b.len() + 5, 1),
            Err(StringsError::Truncated {
                item: 0,
                at: b.len() + 5,
                need: 8
            })
        );
        let bad = gguf_strings(&[b"ok", &[0xff, 0xfe]]);
        assert_eq!(string_array(&bad, 2, 2), Err(StringsError::NotUtf8 { item: 1 }));
    }

    #[test]
    fn q8_0_and_q4_1_by_hand() {
        let one = f16::from_f32(0.5).to_le_bytes();
        let mut b = vec![one[0], one[1]];
        b.extend((0..32).map(|j| (j as i8 - 16) as u8));
        let mut o = vec![0f32; 32];
        dequantize("Q8_0", &b, 1, 32, &mut o).unwrap();
        assert_eq!(o[0], -8.0);
        assert_eq!(o[31], 7.5);
        let m = f16::from_f32(-1.0).to_le_bytes();
        let mut b = vec![one[0], one[1], m[0], m[1]];
        b.extend((0..16).map(|j| (j as u8) | ((15 - j as u8) << 4)));
        dequantize("Q4_1", &b, 1, 32, &mut o).unwrap();
        assert_eq!((o[1], o[16], o[31]), (-0.5, 6.5, -1.0));
    }

    #[test]
    fn rejects_bad_sizes_and_types() {
        let mut o = vec![0f32; 256];
        assert!(dequantize("Q4_1", &[0u8; 19], 1, 32, &mut o[..32]).is_err());
        assert!(dequantize("Q4_1", &[0u8; 20], 1, 31, &mut o[..31]).is_err());
        assert!(dequantize("Q4_K", &[0u8; 144], 1, 128, &mut o[..128]).is_err());
        assert!(dequantize("Q4_K", &[0u8; 143], 1, 256, &mut o).is_err());
        assert!(dequantize("Q2_K", &[0u8; 84], 1, 256, &mut o).is_err());
        assert!(dequantize("Q4_1", &[0u8; 20], 1, 32, &mut o[..16]).is_err());
        let (mut c, mut d, mut m) = (vec![0u8; 256], vec![0f32; 8], vec![0f32; 8]);
        assert!(to_blocks("Q6_K", &[0u8; 209], 1, 256, &mut c, &mut d, &mut m).is_err());
        assert!(to_blocks("F16", &[0u8; 48], 1, 24, &mut c[..24], &mut d[..1], &mut m[..1]).is_err());
        assert!(to_blocks("Q4_K", &[0u8; 144], 1, 256, &mut c[..255], &mut d, &mut m).is_err());
        assert!(to_blocks("Q4_K", &[0u8; 144], 2, 256, &mut c, &mut d, &mut m).is_err());
    }

    fn random_block(r: &mut Rng, ty: &str) -> Vec<u8> {
        let (_, bb) = block_shape(ty).unwrap();
        let mut b: Vec<u8> = (0..bb).map(|_| r.below(256) as u8).collect();
        // Finite scales: d (and dmin) random in [-1, 1).
        let mut put = |at: usize, r: &mut Rng| b[at..at + 2].copy_from_slice(&f16::from_f32(r.uniform()).to_le_bytes());
        match ty {
            "Q4_K" | "Q5_K" => {
                put(0, r);
                put(2, r);
            }
            "Q6_K" => put(208, r),
            _ => {}
        }
        b
    }

    /// Every 32-wide block of `to_blocks` is the same real number as the float64 value of the
    /// format: exactly for Q4_K/Q5_K (and exact Q6_K blocks), within (max-min)/510 + d/2
    /// otherwise; `to_grid_blocks` gives the same codes and scales, as exact integer multiples.
    #[test]
    fn k_quants_fold_onto_32_wide_blocks() {
        let mut r = Rng(0xfeed_5eed);
        for ty in ["Q4_K", "Q5_K", "Q6_K"] {
            let (mut exact_q6, mut total_q6) = (0, 0);
            for _ in 0..200 {
                let mut blk = random_block(&mut r, ty);
                if ty == "Q6_K" && r.below(2) == 0 {
                    // equal scales in pairs: must be exact
                    for j in 0..8 {
                        blk[192 + 2 * j + 1] = blk[192 + 2 * j];
                    }
                }
                let mut want = vec![0f32; 256];
                dequantize(ty, &blk, 1, 256, &mut want).unwrap();
                let (mut c, mut d, mut m) = (vec![0u8; 256], vec![0f32; 8], vec![0f32; 8]);
                let inexact = to_blocks(ty, &blk, 1, 256, &mut c, &mut d, &mut m).unwrap();
                let (mut c2, mut d2, mut m2) = (vec![0u8; 256], vec![0f32; 8], vec![0f32; 8]);
                let mut g = vec![GridScale::default(); 8];
                assert_eq!(
                    to_grid_blocks(ty, &blk, 1, 256, &mut c2, &mut d2, &mut m2, &mut g).unwrap(),
                    inexact
                );
                assert_eq!((&c2, &d2, &m2), (&c, &d, &m));
                for (b, gs) in g.iter().enumerate() {
                    assert_eq!((gs.d().to_bits(), gs.m().to_bits()), (d[b].to_bits(), m[b].to_bits()));
                    // the integer parts are exact multiples: the same number in f64
                    assert_eq!(gs.d_base.to_f64() * gs.d_mul as f64, d[b] as f64);
                    assert_eq!(gs.m_base.to_f64() * gs.m_mul as f64, m[b] as f64);
                    assert_eq!((gs.d_base, gs.m_base), (g[b / 8 * 8].d_base, g[b / 8 * 8].m_base));
                }
                for (e, &w) in want.iter().enumerate() {
                    let got = d[e / 32] as f64 * c[e] as f64 + m[e / 32] as f64;
                    // exact: the f32 reference is that real number rounded once
                    let exact = (got as f32) == w || (got - w as f64).abs() <= (w as f64).abs() * 6e-8;
                    let sub = &want[e / 32 * 32..][..32];
                    let span = sub.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v))
                        - sub.iter().fold(f32::INFINITY, |a, &v| a.min(v));
                    // Q6_K requantizes on the integer grid of its f16 d: half a grid step more.
                    let d6 = if ty == "Q6_K" {
                        f16_at(&blk, 208).abs() as f64
                    } else {
                        0.0
                    };
                    let bound = span as f64 / 510.0 * (1.0 + 1e-5) + d6 / 2.0 + (w as f64).abs() * 1e-6;
                    assert!(
                        exact || (ty == "Q6_K" && (got - w as f64).abs() <= bound),
                        "{ty} e={e}: {got} vs {w}"
                    );
                }
                if ty != "Q6_K" {
                    assert_eq!(inexact, 0, "{ty}");
                } else {
                    total_q6 += 8;
                    exact_q6 += 8 - inexact;
                }
            }
            if ty == "Q6_K" {
                // Half the blocks have equal scale pairs (800 of 1600 sub-blocks exact at least).
                assert!(exact_q6 >= 800 && exact_q6 < total_q6, "{exact_q6} of {total_q6}");
            }
        }
    }

    #[test]
    fn gcd_and_q6_k_codes_are_exact_integers() {
        for a in 0..300 {
            for b in 0..300 {
                let (mut x, mut y) = (a, b);
                while y != 0 {
                    (x, y) = (y, x % y);
                }
                assert_eq!(gcd(a, b), x, "gcd({a}, {b})");
            }
        }
        // Every code of every (v, t) a Q6_K block can hold is the exact rounded quotient.
        let mut r = Rng(0x6c0d);
        for _ in 0..2000 {
            let mut blk = random_block(&mut r, "Q6_K");
            if r.below(2) == 0 {
                blk[192..208].fill(r.below(256) as u8); // one scale: exact blocks
            }
            for j in 0..8 {
                let mut c = [0u8; BLOCK];
                let (gs, _) = q6_k_sub(&blk, j, &mut c);
                let t = gs.d_mul as i32;
                for (l, &cc) in c.iter().enumerate() {
                    let s = blk[192 + (j * BLOCK + l) / 16] as i8 as i32;
                    let x = s * q6_value(&blk, j * BLOCK + l) - gs.m_mul as i32;
                    assert_eq!(cc as i32, ((2 * x + t) / (2 * t)).min(255), "x={x} t={t}");
                }
            }
        }
    }

    #[test]
    fn float_types_requantize_within_half_a_step() {
        let mut r = Rng(7);
        let w: Vec<f32> = (0..64).map(|_| r.uniform() * 3.0).collect();
        let f16s: Vec<u8> = w.iter().flat_map(|&v| f16::from_f32(v).to_le_bytes()).collect();
        let bf16s: Vec<u8> = w
            .iter()
            .flat_map(|&v| ((v.to_bits() >> 16) as u16).to_le_bytes())
            .collect();
        let f32s: Vec<u8> = w.iter().flat_map(|&v| v.to_le_bytes()).collect();
        for (ty, raw) in [("F16", f16s), ("BF16", bf16s), ("F32", f32s)] {
            let mut want = vec![0f32; 64];
            dequantize(ty, &raw, 2, 32, &mut want).unwrap();
            let (mut c, mut d, mut m) = (vec![0u8; 64], vec![0f32; 2], vec![0f32; 2]);
            assert_eq!(to_blocks(ty, &raw, 2, 32, &mut c, &mut d, &mut m).unwrap(), 2);
            for e in 0..64 {
                let got = d[e / 32] * c[e] as f32 + m[e / 32];
                assert!((got - want[e]).abs() <= d[e / 32] * 0.5001 + 1e-6, "{ty} {e}");
            }
        }
    }
}
