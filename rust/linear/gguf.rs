//! GGUF block formats decoded to float32, bit for bit as `gguf.quants.dequantize` does (no pyo3).
//!
//! | type | block (elements / bytes) | layout                                   | value          |
//! |------|--------------------------|------------------------------------------|----------------|
//! | Q4_0 | 32 / 18                  | d f16, qs[16] (low nibbles 0..16, high 16..32) | d·(q - 8)      |
//! | Q4_1 | 32 / 20                  | d f16, m f16, qs[16]                     | d·q + m        |
//! | Q5_0 | 32 / 22                  | d f16, qh u32 (bit j = 5th bit of j), qs[16] | d·(q - 16)     |
//! | Q5_1 | 32 / 24                  | d f16, m f16, qh u32, qs[16]             | d·q + m        |
//! | Q8_0 | 32 / 34                  | d f16, qs i8[32]                         | d·q            |
//!
//! Every product and sum is one f32 rounding in the order numpy evaluates `d * q + m`, so the
//! result equals the reference exactly (the tests compare bit for bit). Rows are independent:
//! a row of `k` weights is `k/32` consecutive blocks.

use half::f16;

use crate::error::{Error, Result};

/// Elements per block of the formats above.
pub const BLOCK: usize = 32;

/// Bytes of one 32-element block of `ggml_type`, if this module decodes it.
pub fn block_bytes(ggml_type: &str) -> Option<usize> {
    Some(match ggml_type {
        "Q4_0" => 18,
        "Q4_1" => 20,
        "Q5_0" => 22,
        "Q5_1" => 24,
        "Q8_0" => 34,
        _ => return None,
    })
}

/// Decode `n` rows of `k` weights stored as `ggml_type` blocks (`raw`: `n * k/32 * block_bytes`
/// bytes) into `out` (`n * k` floats).
pub fn dequantize(ggml_type: &str, raw: &[u8], n: usize, k: usize, out: &mut [f32]) -> Result<()> {
    let bb = block_bytes(ggml_type).ok_or_else(|| {
        Error::Invalid(format!(
            "ggml_type must be one of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, got {ggml_type:?}"
        ))
    })?;
    if k == 0 || !k.is_multiple_of(BLOCK) {
        return Err(Error::Invalid(format!(
            "k must be a positive multiple of {BLOCK}, got {k}"
        )));
    }
    let blocks = n * (k / BLOCK);
    if raw.len() != blocks * bb {
        return Err(Error::Invalid(format!(
            "need {n} rows of {} bytes ({} blocks of {bb}), got {} bytes",
            k / BLOCK * bb,
            k / BLOCK,
            raw.len()
        )));
    }
    if out.len() != n * k {
        return Err(Error::Invalid(format!(
            "out must hold {} floats ([{n}, {k}]), got {}",
            n * k,
            out.len()
        )));
    }
    let decode: fn(&[u8], &mut [f32]) = match ggml_type {
        "Q4_0" => q4_0,
        "Q4_1" => q4_1,
        "Q5_0" => q5_0,
        "Q5_1" => q5_1,
        _ => q8_0,
    };
    for (blk, o) in raw.chunks_exact(bb).zip(out.chunks_exact_mut(BLOCK)) {
        decode(blk, o);
    }
    Ok(())
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

fn nibbles(qs: &[u8], j: usize) -> (u8, u8) {
    (qs[j] & 0x0f, qs[j] >> 4)
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

#[cfg(test)]
mod tests {
    use super::*;

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
        let mut o = vec![0f32; 32];
        assert!(dequantize("Q4_1", &[0u8; 19], 1, 32, &mut o).is_err());
        assert!(dequantize("Q4_1", &[0u8; 20], 1, 31, &mut o).is_err());
        assert!(dequantize("Q4_K", &[0u8; 20], 1, 32, &mut o).is_err());
        assert!(dequantize("Q4_1", &[0u8; 20], 1, 32, &mut o[..16]).is_err());
    }
}
