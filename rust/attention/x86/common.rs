//! What the x86 kernels share: element loads, widening and prefetch of a cache range, and the
//! online-softmax helpers over a row of logits.
//!
//! | item                          | what                                                        |
//! |-------------------------------|-------------------------------------------------------------|
//! | `load8`, `load16`             | 8 (ymm) / 16 (zmm) elements of f32, f16 or bf16 widened to f32 |
//! | `widen`                       | a cache range widened into f32 scratch (prefill tiles)      |
//! | `prefetch`                    | a cache range into L1, line by line                         |
//! | `hsum`                        | the sum of a ymm's 8 lanes                                  |
//! | `vmax`, `scale_in_place`, `exp_sub` | max, rescale, `exp(s - max)` and its sum (ymm, `exp256`) |
//!
//! Widening is exact (f16 and bf16 values are f32 values); `exp_sub`'s exp is `exp256` (rel. error
//! ~2e-7). Tolerance: see `mod.rs`.

use std::arch::x86_64::*;

use super::{BF16, F16, F32};
use crate::attention::Kv;
use crate::simd::x86::exp256;

/// 8 elements at element index `i` of a DT array, widened to f32.
///
/// # Safety
/// `p` points to at least `i + 8` elements of type DT.
#[inline(always)]
pub(super) unsafe fn load8<const DT: u8>(p: *const u8, i: usize) -> __m256 {
    // SAFETY: per the function contract.
    unsafe {
        match DT {
            F32 => _mm256_loadu_ps((p as *const f32).add(i)),
            F16 => _mm256_cvtph_ps(_mm_loadu_si128((p as *const u16).add(i) as *const __m128i)),
            _ => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(
                (p as *const u16).add(i) as *const __m128i,
            )))),
        }
    }
}

/// 16 elements at element index `i` of a DT array, widened to f32 (zmm).
///
/// # Safety
/// `p` points to at least `i + 16` elements of type DT; the CPU supports AVX-512 F.
#[inline(always)]
pub(super) unsafe fn load16<const DT: u8>(p: *const u8, i: usize) -> __m512 {
    // SAFETY: per the function contract.
    unsafe {
        match DT {
            F32 => _mm512_loadu_ps((p as *const f32).add(i)),
            F16 => _mm512_cvtph_ps(_mm256_loadu_si256((p as *const u16).add(i) as *const __m256i)),
            _ => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
                (p as *const u16).add(i) as *const __m256i,
            )))),
        }
    }
}

/// Elements `base..base+len` of a cache, widened to f32 into `dst` (`dst.len() == len`).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn widen(kv: Kv, base: usize, len: usize, dst: &mut [f32]) {
    assert!(dst.len() == len && len.is_multiple_of(8));
    match kv {
        Kv::F32(c) => dst.copy_from_slice(&c[base..base + len]),
        Kv::F16(c) => {
            let src = &c[base..base + len];
            for i in (0..len).step_by(8) {
                // SAFETY: len % 8 == 0, so i + 8 <= len for src and dst.
                unsafe { _mm256_storeu_ps(dst.as_mut_ptr().add(i), load8::<F16>(src.as_ptr() as *const u8, i)) };
            }
        }
        Kv::Bf16(c) => {
            let src = &c[base..base + len];
            for i in (0..len).step_by(8) {
                // SAFETY: as above.
                unsafe { _mm256_storeu_ps(dst.as_mut_ptr().add(i), load8::<BF16>(src.as_ptr() as *const u8, i)) };
            }
        }
    }
}

/// Prefetch `base..base+len` of a cache into L1, one cache line at a time.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn prefetch(kv: Kv, base: usize, len: usize) {
    let (p, bytes) = match kv {
        Kv::F32(c) => (c[base..base + len].as_ptr() as *const i8, len * 4),
        Kv::F16(c) => (c[base..base + len].as_ptr() as *const i8, len * 2),
        Kv::Bf16(c) => (c[base..base + len].as_ptr() as *const i8, len * 2),
    };
    for off in (0..bytes).step_by(64) {
        // SAFETY: off < bytes, the byte length of the in-bounds subslice `p` points to.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.add(off)) };
    }
}

/// Sum of the 8 lanes of `a`.
///
/// # Safety
/// The CPU supports AVX (inlined into the AVX2 / AVX-512 entries, which check it).
#[inline(always)]
pub(super) unsafe fn hsum(a: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<0x55>(s, s)))
}

/// Max of a slice (empty: -inf).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn vmax(x: &[f32]) -> f32 {
    let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut chunks = x.chunks_exact(8);
    for ch in &mut chunks {
        // SAFETY: ch has exactly 8 elements.
        m = _mm256_max_ps(m, unsafe { _mm256_loadu_ps(ch.as_ptr()) });
    }
    let h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
    let h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    let h = _mm_max_ss(h, _mm_shuffle_ps::<0x55>(h, h));
    chunks.remainder().iter().fold(_mm_cvtss_f32(h), |a, &b| a.max(b))
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn scale_in_place(x: &mut [f32], alpha: f32) {
    let w = _mm256_set1_ps(alpha);
    let mut chunks = x.chunks_exact_mut(8);
    for ch in &mut chunks {
        // SAFETY: ch has exactly 8 elements.
        unsafe { _mm256_storeu_ps(ch.as_mut_ptr(), _mm256_mul_ps(w, _mm256_loadu_ps(ch.as_ptr()))) };
    }
    for y in chunks.into_remainder() {
        *y *= alpha;
    }
}

/// `s[j] = exp(s[j] - mx)`, returns the sum.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn exp_sub(s: &mut [f32], mx: f32) -> f32 {
    let m = _mm256_set1_ps(mx);
    let mut sum = _mm256_setzero_ps();
    let mut chunks = s.chunks_exact_mut(8);
    for ch in &mut chunks {
        // SAFETY: ch has exactly 8 elements.
        unsafe {
            let e = exp256(_mm256_sub_ps(_mm256_loadu_ps(ch.as_ptr()), m));
            _mm256_storeu_ps(ch.as_mut_ptr(), e);
            sum = _mm256_add_ps(sum, e);
        }
    }
    let mut tail = 0.0;
    for y in chunks.into_remainder() {
        *y = (*y - mx).exp();
        tail += *y;
    }
    // SAFETY: this function's target features include the AVX the sum uses.
    unsafe { hsum(sum) + tail }
}
