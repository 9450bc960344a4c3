//! Row-wise kernels of a decoder layer: RMSNorm (optionally fused with the residual add) and the
//! gated activations `silu(gate) * up` (SwiGLU) and `gelu_tanh(gate) * up` (Gemma's GeGLU) (no pyo3).
//!
//! | variant  | used when                                                                   |
//! |----------|-----------------------------------------------------------------------------|
//! | scalar   | ISA `scalar` or `neon` (`runtime::isa()`), or no AVX2                       |
//! | avx2+fma | ISA `avx2`: the same code compiled with AVX2 + FMA enabled (auto-vectorized), same bits |
//! | avx512   | ISA `avx512`: the same code compiled with AVX-512 F too (16 lanes a vector), same bits |
//!
//! Shapes: `x`, `residual`, `out` are row-major `[T, H]`; `gate_up` is `[T, 2F]` (gate columns,
//! then up columns) and its output `[T, F]`. Sums of squares use 16 interleaved partial sums
//! (a fixed order, so every build gives the same bits). `exp` is `simd::exp`, a branch-free
//! polynomial (relative error < 2e-7 over the range SiLU needs) in plain f32 arithmetic so it
//! vectorizes; `silu(g) = g / (1 + exp(-g))`; `gelu_tanh(g) = 0.5 g (1 + tanh(u))` with
//! `u = sqrt(2/pi) (g + 0.044715 g^3)`, computed as `g / (1 + exp(-2u))` (the same value, and no
//! cancellation in `1 + tanh(u)` for negative `g`).
//! Tolerance (tests vs float64 numpy): 1e-6 relative.

use crate::error::{Error, Result};
use crate::runtime;
use crate::simd::exp;

/// Rows per parallel job.
const ROWS: usize = 32;
const LANES: usize = 16;

/// `out = residual' * rsqrt(mean(residual'^2) + eps) * w`, where `residual' = residual + x`
/// (stored back into `residual`) when a residual is given, else `x`.
pub fn rms_norm(x: &[f32], h: usize, w: &[f32], eps: f32, residual: Option<&mut [f32]>, out: &mut [f32]) -> Result<()> {
    rms_norm_on(x, h, w, eps, residual, out, true)
}

/// `rms_norm` on the calling thread only (rows of a caller's own parallel job); the same bits.
pub fn rms_norm_local(
    x: &[f32],
    h: usize,
    w: &[f32],
    eps: f32,
    residual: Option<&mut [f32]>,
    out: &mut [f32],
) -> Result<()> {
    rms_norm_on(x, h, w, eps, residual, out, false)
}

/// `rms_norm`, in parallel jobs of `ROWS` rows when `parallel` and there are more.
fn rms_norm_on(
    x: &[f32],
    h: usize,
    w: &[f32],
    eps: f32,
    residual: Option<&mut [f32]>,
    out: &mut [f32],
    parallel: bool,
) -> Result<()> {
    if h == 0
        || w.len() != h
        || !x.len().is_multiple_of(h)
        || out.len() != x.len()
        || residual.as_ref().is_some_and(|r| r.len() != x.len())
    {
        return Err(Error::Invalid(format!(
            "rms_norm needs x, out (and residual) of one shape [T, {h}] and weight [{h}]; got {}, {}, {:?} and {} values",
            x.len(),
            out.len(),
            residual.as_ref().map(|r| r.len()),
            w.len()
        )));
    }
    if !(eps >= 0.0 && eps.is_finite()) {
        return Err(Error::Invalid(format!("eps must be finite and >= 0, got {eps}")));
    }
    let rows = x.len() / h;
    #[cfg(target_arch = "x86_64")]
    let isa = runtime::isa()?;
    let run = |x: &[f32], res: Option<&mut [f32]>, out: &mut [f32]| {
        #[cfg(target_arch = "x86_64")]
        match isa {
            // SAFETY: the ISA in use is one the CPU has (`runtime::isa`): AVX-512 F with AVX2
            // and FMA.
            runtime::Isa::Avx512 => return unsafe { rms_rows_avx512(x, h, w, eps, res, out) },
            // SAFETY: as above: AVX2 and FMA.
            runtime::Isa::Avx2 => return unsafe { rms_rows_avx2(x, h, w, eps, res, out) },
            _ => {}
        }
        rms_rows(x, h, w, eps, res, out)
    };
    if rows <= ROWS || !parallel {
        run(x, residual, out);
        return Ok(());
    }
    use rayon::prelude::*;
    runtime::pool()?.install(|| match residual {
        Some(res) => x
            .par_chunks(ROWS * h)
            .zip(res.par_chunks_mut(ROWS * h))
            .zip(out.par_chunks_mut(ROWS * h))
            .for_each(|((x, r), o)| run(x, Some(r), o)),
        None => x
            .par_chunks(ROWS * h)
            .zip(out.par_chunks_mut(ROWS * h))
            .for_each(|(x, o)| run(x, None, o)),
    });
    Ok(())
}

/// The gate's activation in a gated FFN (`act(gate) * up`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `g / (1 + exp(-g))` (SwiGLU: Llama, Qwen, Phi-3).
    Silu,
    /// The tanh approximation of GELU (GeGLU: Gemma).
    GeluTanh,
}

impl Activation {
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "silu" => Ok(Activation::Silu),
            "gelu_tanh" => Ok(Activation::GeluTanh),
            _ => Err(Error::Invalid(format!(
                "activation must be 'silu' or 'gelu_tanh', got {name:?}"
            ))),
        }
    }
}

/// `out[t, j] = silu(gate_up[t, j]) * gate_up[t, F + j]`.
pub fn silu_and_mul(gate_up: &[f32], f: usize, out: &mut [f32]) -> Result<()> {
    act_and_mul(gate_up, f, Activation::Silu, out)
}

/// `out[t, j] = gelu_tanh(gate_up[t, j]) * gate_up[t, F + j]`.
pub fn gelu_tanh_and_mul(gate_up: &[f32], f: usize, out: &mut [f32]) -> Result<()> {
    act_and_mul(gate_up, f, Activation::GeluTanh, out)
}

/// `out[t, j] = act(gate_up[t, j]) * gate_up[t, F + j]`: gate_up `[T, 2F]`, out `[T, F]`.
pub fn act_and_mul(gate_up: &[f32], f: usize, act: Activation, out: &mut [f32]) -> Result<()> {
    if f == 0 || !gate_up.len().is_multiple_of(2 * f) || out.len() * 2 != gate_up.len() {
        return Err(Error::Invalid(format!(
            "{}_and_mul needs gate_up [T, {}] and out [T, {f}]; got {} and {} values",
            match act {
                Activation::Silu => "silu",
                Activation::GeluTanh => "gelu_tanh",
            },
            2 * f,
            gate_up.len(),
            out.len()
        )));
    }
    let rows = out.len() / f;
    #[cfg(target_arch = "x86_64")]
    let isa = runtime::isa()?;
    let run = |g: &[f32], o: &mut [f32]| {
        #[cfg(target_arch = "x86_64")]
        match isa {
            // SAFETY: as in `rms_norm`: AVX-512 F with AVX2 and FMA.
            runtime::Isa::Avx512 => return unsafe { act_rows_avx512(g, f, act, o) },
            // SAFETY: as in `rms_norm`: AVX2 and FMA.
            runtime::Isa::Avx2 => return unsafe { act_rows_avx2(g, f, act, o) },
            _ => {}
        }
        act_rows(g, f, act, o)
    };
    if rows <= ROWS {
        run(gate_up, out);
        return Ok(());
    }
    use rayon::prelude::*;
    runtime::pool()?.install(|| {
        gate_up
            .par_chunks(ROWS * 2 * f)
            .zip(out.par_chunks_mut(ROWS * f))
            .for_each(|(g, o)| run(g, o))
    });
    Ok(())
}

#[inline(always)]
fn rms_rows(x: &[f32], h: usize, w: &[f32], eps: f32, mut res: Option<&mut [f32]>, out: &mut [f32]) {
    for (t, (xr, or)) in x.chunks_exact(h).zip(out.chunks_exact_mut(h)).enumerate() {
        let src: &[f32] = match res.as_deref_mut() {
            Some(r) => {
                let rr = &mut r[t * h..][..h];
                for (a, b) in rr.iter_mut().zip(xr) {
                    *a += *b;
                }
                rr
            }
            None => xr,
        };
        let mut part = [0f32; LANES];
        let mut chunks = src.chunks_exact(LANES);
        for c in &mut chunks {
            for (p, v) in part.iter_mut().zip(c) {
                *p += v * v;
            }
        }
        for (p, v) in part.iter_mut().zip(chunks.remainder()) {
            *p += v * v;
        }
        let ss: f32 = part.iter().sum();
        let inv = 1.0 / (ss / h as f32 + eps).sqrt();
        for ((o, v), g) in or.iter_mut().zip(src).zip(w) {
            *o = v * inv * g;
        }
    }
}

/// `rms_rows` compiled with AVX2 + FMA enabled.
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn rms_rows_avx2(x: &[f32], h: usize, w: &[f32], eps: f32, res: Option<&mut [f32]>, out: &mut [f32]) {
    rms_rows(x, h, w, eps, res, out)
}

/// `rms_rows` compiled with AVX-512 F (and AVX2 + FMA) enabled.
///
/// # Safety
/// The CPU has AVX-512 F, AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn rms_rows_avx512(x: &[f32], h: usize, w: &[f32], eps: f32, res: Option<&mut [f32]>, out: &mut [f32]) {
    rms_rows(x, h, w, eps, res, out)
}

/// `sqrt(2 / pi)` and GELU's cubic coefficient, as the tanh approximation defines them.
const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_COEF_A: f32 = 0.044_715;

#[inline(always)]
fn act_rows(gate_up: &[f32], f: usize, act: Activation, out: &mut [f32]) {
    for (g, o) in gate_up.chunks_exact(2 * f).zip(out.chunks_exact_mut(f)) {
        let (gate, up) = g.split_at(f);
        match act {
            Activation::Silu => {
                for ((o, &a), &b) in o.iter_mut().zip(gate).zip(up) {
                    *o = a / (1.0 + exp(-a)) * b;
                }
            }
            Activation::GeluTanh => {
                for ((o, &a), &b) in o.iter_mut().zip(gate).zip(up) {
                    let u = SQRT_2_OVER_PI * (a + GELU_COEF_A * a * a * a);
                    *o = a / (1.0 + exp(-2.0 * u)) * b;
                }
            }
        }
    }
}

/// `act_rows` compiled with AVX2 + FMA enabled.
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn act_rows_avx2(gate_up: &[f32], f: usize, act: Activation, out: &mut [f32]) {
    act_rows(gate_up, f, act, out)
}

/// `act_rows` compiled with AVX-512 F (and AVX2 + FMA) enabled.
///
/// # Safety
/// The CPU has AVX-512 F, AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn act_rows_avx512(gate_up: &[f32], f: usize, act: Activation, out: &mut [f32]) {
    act_rows(gate_up, f, act, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 2000) as f32 / 250.0 - 4.0)
            .collect()
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn every_simd_build_gives_the_scalar_bits() {
        let (t, h, f) = (70, 100, 48);
        let x = data(t * h, 1);
        let w = data(h, 2);
        let gu = data(t * 2 * f, 3);
        let (mut a, mut sa, mut ra) = (vec![0f32; t * h], vec![0f32; t * f], data(t * h, 4));
        let mut ga = vec![0f32; t * f];
        rms_rows(&x, h, &w, 1e-5, Some(&mut ra), &mut a);
        act_rows(&gu, f, Activation::Silu, &mut sa);
        act_rows(&gu, f, Activation::GeluTanh, &mut ga);
        for isa in [runtime::Isa::Avx2, runtime::Isa::Avx512] {
            if !isa.available() {
                continue;
            }
            let (mut b, mut sb, mut rb) = (vec![0f32; t * h], vec![0f32; t * f], data(t * h, 4));
            let mut gb = vec![0f32; t * f];
            // SAFETY: the ISA is available (checked above): AVX2 + FMA, and AVX-512 F for Avx512.
            unsafe {
                if isa == runtime::Isa::Avx512 {
                    rms_rows_avx512(&x, h, &w, 1e-5, Some(&mut rb), &mut b);
                    act_rows_avx512(&gu, f, Activation::Silu, &mut sb);
                    act_rows_avx512(&gu, f, Activation::GeluTanh, &mut gb);
                } else {
                    rms_rows_avx2(&x, h, &w, 1e-5, Some(&mut rb), &mut b);
                    act_rows_avx2(&gu, f, Activation::Silu, &mut sb);
                    act_rows_avx2(&gu, f, Activation::GeluTanh, &mut gb);
                }
            }
            assert_eq!((&a, &ra, &sa, &ga), (&b, &rb, &sb, &gb), "{isa:?}");
        }
    }

    #[test]
    fn avx2_build_gives_the_same_bits() {
        let (t, h, f) = (70, 100, 48);
        let x = data(t * h, 1);
        let w = data(h, 2);
        let gu = data(t * 2 * f, 3);
        let (mut a, mut b) = (vec![0f32; t * h], vec![0f32; t * h]);
        let (mut ra, mut rb) = (data(t * h, 4), data(t * h, 4));
        rms_rows(&x, h, &w, 1e-5, Some(&mut ra), &mut a);
        rms_norm(&x, h, &w, 1e-5, Some(&mut rb), &mut b).unwrap();
        assert_eq!(a, b);
        assert_eq!(ra, rb);
        let (mut sa, mut sb) = (vec![0f32; t * f], vec![0f32; t * f]);
        act_rows(&gu, f, Activation::Silu, &mut sa);
        silu_and_mul(&gu, f, &mut sb).unwrap();
        assert_eq!(sa, sb);
        act_rows(&gu, f, Activation::GeluTanh, &mut sa);
        gelu_tanh_and_mul(&gu, f, &mut sb).unwrap();
        assert_eq!(sa, sb);
    }

    #[test]
    fn bad_shapes_are_errors() {
        let mut out = vec![0f32; 4];
        assert!(rms_norm(&[1.0; 4], 2, &[1.0; 3], 1e-5, None, &mut out).is_err());
        assert!(rms_norm(&[1.0; 4], 2, &[1.0; 2], -1.0, None, &mut out).is_err());
        assert!(silu_and_mul(&[1.0; 6], 2, &mut out).is_err());
        assert!(gelu_tanh_and_mul(&[1.0; 6], 2, &mut out).is_err());
        assert!(Activation::parse("relu").is_err());
    }
}
