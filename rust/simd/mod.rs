//! Vector math the kernels share (attention, linear, ops): one `exp` per ISA.
//!
//! | function        | file     | ISA                         | accuracy (relative, vs f64)           |
//! |-----------------|----------|-----------------------------|---------------------------------------|
//! | `exp`           | mod.rs   | any (plain f32, vectorizes) | < 2e-7 on [-87, 88]; used by ops and NEON attention |
//! | `x86::exp256`   | x86.rs   | AVX2 + FMA (8 lanes)        | ~2e-7 (Cephes degree 5); used by x86 attention |
//!
//! The scalar attention spec (`attention/reference.rs`) uses `f32::exp` on purpose: it is the
//! oracle the SIMD paths are tested against.

#[cfg(target_arch = "x86_64")]
pub mod x86;

/// `e^x` in plain f32 arithmetic (vectorizable): `x = n·ln2 + r`, `e^r` by a degree-7 Taylor
/// polynomial on |r| <= ln2/2, `2^n` built in the exponent bits. Saturates to 0 below -87.3 and
/// to +inf above 88.7; NaN propagates.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // 1.5 * 2^23: adding and subtracting it rounds to an integer.
    const MAGIC: f32 = 12_582_912.0;
    // max/min (not clamp): a NaN x gives a finite xc here and is restored at the end.
    #[allow(
        clippy::manual_clamp,
        reason = "clamp would keep a NaN, which the integer step below must not see"
    )]
    let xc = x.max(-87.3).min(88.7);
    let t = xc * LOG2E + MAGIC;
    let n = t - MAGIC;
    // n as an integer from t's low mantissa bits (no float->int conversion: it vectorizes).
    let ni = (t.to_bits() as i32).wrapping_sub(MAGIC.to_bits() as i32);
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    let scale = f32::from_bits((ni.wrapping_add(127) as u32) << 23);
    let y = p * scale;
    if x > 88.7 {
        f32::INFINITY
    } else if x < -87.3 {
        0.0
    } else if x.is_nan() {
        x
    } else {
        y
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_accurate() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let want = (x as f64).exp();
            worst = worst.max(((exp(x) as f64 - want) / want).abs());
            x += 0.0137;
        }
        assert!(worst < 2e-7, "{worst}");
        assert_eq!(exp(-1000.0), 0.0);
        assert_eq!(exp(1000.0), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
    }
}
