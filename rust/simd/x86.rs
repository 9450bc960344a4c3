//! x86-64 vector math (AVX2 + FMA), shared by the x86 kernels.

use std::arch::x86_64::*;

/// e^x for 8 lanes (Cephes expf: range reduction by ln 2, degree-5 polynomial); x above 88.3
/// clamped there, x below -87.3 gives 0, so every result is normal or 0.
///
/// # Safety
/// The CPU has AVX2 and FMA (a caller not compiled with them needs `unsafe` and that check).
#[target_feature(enable = "avx2,fma,f16c")]
pub fn exp256(x: __m256) -> __m256 {
    // Below -87.3 (about ln of the smallest normal f32) the result is 0, not the clamp's ~1.2e-38:
    // a softmax sums such values and rescales by them, and the subnormal numbers that follow cost
    // Intel cores a microcode assist in every FMA that reads them (a prefill's attention ran 15
    // times slower in the layers whose logits span more than 87).
    let tiny = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(-87.3));
    let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3)), _mm256_set1_ps(88.3));
    let fx = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693_359_4), x);
    let r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.121_944_4e-4), r);
    let mut y = _mm256_set1_ps(1.987_569_1e-4);
    for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5] {
        y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c));
    }
    let r2 = _mm256_mul_ps(r, r);
    let y = _mm256_add_ps(_mm256_fmadd_ps(y, r2, r), _mm256_set1_ps(1.0));
    let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)));
    _mm256_andnot_ps(tiny, _mm256_mul_ps(y, _mm256_castsi256_ps(e)))
}
