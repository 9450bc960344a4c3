//! Machine probes the kernel benchmark measures itself against (same run, same threads).
//!
//! | probe              | what                                                                 |
//! |--------------------|----------------------------------------------------------------------|
//! | `memory_bandwidth` | multithreaded read-sum of a buffer (>= 1 GiB by default), best pass  |
//! | `fma_peak`         | 12 independent FMA chains per thread for a fixed time, all threads   |
//!
//! `fma_peak` runs the widest FMAs the kernels use on this CPU (`runtime::detected_isa`): zmm
//! (16 lanes) with AVX-512, ymm (8 lanes) with AVX2, scalar otherwise, so "of FMA peak" means
//! what it says. `memory_bandwidth` reads with AVX2 when detected (it is bound by memory, not
//! width). Both run on their own pool of `threads` threads.

use std::time::Instant;

use rayon::prelude::*;

use crate::error::{Error, Result};

use crate::runtime;
#[cfg(target_arch = "x86_64")]
use crate::runtime::{detected_isa, Isa};

const PASSES: usize = 5;

/// Best-of-`PASSES` read bandwidth in GB/s (1e9 bytes/s) over a `bytes` buffer on `threads` threads.
pub fn memory_bandwidth(bytes: usize, threads: usize) -> Result<f64> {
    if bytes < (1 << 20) {
        return Err(Error::Invalid(format!("bytes must be >= 1 MiB, got {bytes}")));
    }
    let pool = runtime::build_pool(threads)?;
    let n = bytes / 4;
    let chunk = 1 << 16; // 256 KiB per task
    pool.install(|| {
        let mut buf: Vec<f32> = Vec::new();
        buf.try_reserve_exact(n)
            .map_err(|_| Error::Invalid(format!("cannot allocate {bytes} bytes")))?;
        // Touch every page in parallel (first-touch places pages near their reader).
        buf.resize(n, 0.0);
        buf.par_chunks_mut(chunk)
            .enumerate()
            .for_each(|(i, c)| c.fill(i as f32 * 1e-9));
        let mut best = f64::MAX;
        let mut sink = 0.0f32;
        for _ in 0..PASSES {
            let t = Instant::now();
            let s: f32 = buf.par_chunks(chunk).map(sum).sum();
            best = best.min(t.elapsed().as_secs_f64());
            sink += s;
        }
        std::hint::black_box(sink);
        Ok((n * 4) as f64 / best / 1e9)
    })
}

fn sum(x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if detected_isa() != Isa::Scalar {
        // SAFETY: AVX2 detected at runtime (every SIMD Isa includes it).
        return unsafe { sum_avx2(x) };
    }
    x.iter().sum()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn sum_avx2(x: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let mut a = [_mm256_setzero_ps(); 4];
    let mut chunks = x.chunks_exact(32);
    for c in &mut chunks {
        for (i, acc) in a.iter_mut().enumerate() {
            // SAFETY: c has 32 elements; 8 * i + 8 <= 32.
            *acc = _mm256_add_ps(*acc, unsafe { _mm256_loadu_ps(c.as_ptr().add(8 * i)) });
        }
    }
    let mut out = [0.0f32; 8];
    let s = _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]));
    // SAFETY: out holds 8 f32.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), s) };
    out.iter().sum::<f32>() + chunks.remainder().iter().sum::<f32>()
}

/// Peak fp32 FMA throughput in GFLOP/s (2 flops per lane per FMA) over `threads` threads.
pub fn fma_peak(seconds: f64, threads: usize) -> Result<f64> {
    if !(seconds > 0.0 && seconds <= 10.0) {
        return Err(Error::Invalid(format!("seconds must be in (0, 10], got {seconds}")));
    }
    let pool = runtime::build_pool(threads)?;
    let flops: f64 = pool.install(|| {
        (0..threads)
            .into_par_iter()
            .map(|_| {
                let t = Instant::now();
                let mut f = 0.0;
                let mut best = 0.0f64;
                while t.elapsed().as_secs_f64() < seconds {
                    let t1 = Instant::now();
                    let n = fma_burst();
                    let dt = t1.elapsed().as_secs_f64();
                    best = best.max(n / dt);
                    f += n;
                }
                std::hint::black_box(f);
                best
            })
            .sum()
    });
    Ok(flops / 1e9)
}

/// Independent FMA chains per thread: enough to cover FMA latency x throughput (4 x 2).
const CHAINS: usize = 12;

/// Runs a fixed burst of FMAs; returns the flops done.
fn fma_burst() -> f64 {
    const ITERS: usize = 200_000;
    #[cfg(target_arch = "x86_64")]
    match detected_isa() {
        Isa::Avx512 => {
            // SAFETY: AVX-512 F detected at runtime (`Isa::Avx512` includes it).
            unsafe { fma_burst_avx512(ITERS) };
            return (ITERS * CHAINS * 16 * 2) as f64;
        }
        Isa::Avx2 => {
            // SAFETY: AVX2 and FMA detected at runtime (`Isa::Avx2` includes them).
            unsafe { fma_burst_avx2(ITERS) };
            return (ITERS * CHAINS * 8 * 2) as f64;
        }
        _ => {}
    }
    let mut a = [1.0f32; CHAINS];
    for _ in 0..ITERS {
        for x in a.iter_mut() {
            *x = x.mul_add(0.999_999, 1e-7);
        }
    }
    std::hint::black_box(a);
    (ITERS * CHAINS * 2) as f64
}

/// `$name(iters)`: `CHAINS` independent FMA chains of one vector type, `iters` rounds, built
/// with `$features` enabled (one body for the ymm and the zmm burst).
macro_rules! fma_burst_simd {
    ($name:ident, $features:literal, $set1:ident, $fmadd:ident) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        fn $name(iters: usize) {
            use std::arch::x86_64::*;
            let (m, c) = ($set1(0.999_999), $set1(1e-7));
            let mut a = [$set1(1.0); CHAINS];
            for _ in 0..iters {
                for x in a.iter_mut() {
                    *x = $fmadd(*x, m, c);
                }
            }
            std::hint::black_box(a);
        }
    };
}
fma_burst_simd!(fma_burst_avx2, "avx2,fma", _mm256_set1_ps, _mm256_fmadd_ps);
fma_burst_simd!(fma_burst_avx512, "avx512f", _mm512_set1_ps, _mm512_fmadd_ps);
