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

    /// `x86::exp256` agrees with `exp` where both are normal and, as it, gives 0 (never a subnormal)
    /// below -87.3, -inf included.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn exp256_is_accurate_and_never_subnormal() {
        use std::arch::x86_64::*;
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")) {
            return;
        }
        let xs = [
            -1000.0,
            f32::NEG_INFINITY,
            -103.0,
            -90.0,
            -87.31,
            -87.29,
            -20.0,
            0.0,
            3.5,
            88.0,
        ];
        for chunk in xs.chunks(2) {
            let mut v = [0f32; 8];
            v[..chunk.len()].copy_from_slice(chunk);
            let mut out = [0f32; 8];
            // SAFETY: AVX2, FMA and F16C detected above; 8 f32 each.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr(), x86::exp256(_mm256_loadu_ps(v.as_ptr()))) };
            for (&x, &y) in chunk.iter().zip(&out) {
                assert!(y == 0.0 || y.is_normal(), "exp256({x}) = {y:e}");
                if x < -87.3 {
                    assert_eq!(y, 0.0, "exp256({x})");
                } else {
                    let want = (x as f64).exp();
                    assert!(
                        ((y as f64 - want) / want).abs() < 4e-7,
                        "exp256({x}) = {y:e}, want {want:e}"
                    );
                }
            }
        }
    }
}
