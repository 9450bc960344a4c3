//! Block-quantized linear layers: `y[M, N] = x[M, K] · Wᵀ` with W held as 4- to 8-bit codes (no pyo3).
//!
//! | variant    | file      | used when (`variant` maps the ISA from `runtime` onto a build)                 |
//! |------------|-----------|--------------------------------------------------------------------------------|
//! | scalar     | scalar.rs | ISA `scalar` (`set_isa("scalar")`, `PAGEDKV_ISA=scalar`) or `neon`, or no AVX2 |
//! | avx2       | avx2.rs   | `vpmaddubsw` + `vpmaddwd` tile: ISA `avx2`, or `avx512` without VNNI          |
//! | avxvnni    | avx2.rs   | its `vpdpbusd` form (ymm, VEX) where the CPU has AVX-VNNI (`runtime::avx_vnni`) |
//! | avx512vnni | x86.rs    | ISA `avx512` on a CPU with AVX-512 F + BW + VNNI (`runtime::avx512_vnni`)      |
//! | avx512amx  | amx.rs    | also AMX-INT8 (`runtime::amx_int8`): one-digit products of 32+ rows (`amx_for`) |
//!
//! | file       | holds                                                                              |
//! |------------|------------------------------------------------------------------------------------|
//! | mod.rs     | this page (formula, layouts), `QBLOCK`, `PANEL`, the ISA -> variant map, `linear`  |
//! | weight.rs  | `QWeight` (codes in panels) and its `Scales` (f32, f16, K-quant grid); `unpack`    |
//! | pack.rs    | building a `QWeight`: from floats, from codes and scales, from GGUF rows           |
//! | gguf.rs    | GGUF block types decoded onto 32-wide blocks; `dequantize`; GGUF string arrays     |
//! | acts.rs    | `QActs` (two int8 digits a value, rows or tiled) and the quantizer of each variant |
//! | product.rs | one product: shape checks, column jobs, tile order, the tile call; `Product`       |
//! | scalar.rs  | the portable tile (the spec the SIMD tiles match bit for bit)                      |
//! | avx2.rs    | the AVX2 tile and quantizer                                                        |
//! | x86.rs     | the AVX-512 VNNI tile and quantizer                                                |
//! | amx.rs     | the AMX tile (one-digit products of 32+ rows where the OS enables AMX-INT8)         |
//! | tests.rs   | every variant against the scalar one (bit for bit) and a float64 sum               |
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
//! One digit (`QWeight::set_act_digits(1)`, chosen per matrix by the KL divergence it costs the
//! model): `quantize_one` keeps `h` alone, with `R = 1`, `l = 0` and `s = a/127` (llama.cpp's Q8
//! activations). The formula above then gives the one-digit product exactly, so every tile computes
//! it bit for bit alike; the VNNI tile skips the `l` dots (half its `vpdpbusd`), which halves a
//! compute-bound product such as a batched decode step's 262,144-row output head.
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
//! Code layouts (per panel, the fewest bits that hold every code of its rows; weight.rs tabulates
//! them): a 32-wide block of a panel is 8 code lines of 64 bytes in the 8-bit layout; in the
//! others it is 4 nibble lines, line q holding step 2q in its low nibbles and 2q+1 in its high ones
//! (byte for byte where the 8-bit lines hold those codes), then the codes' high bits in lines of
//! the same byte order: none for 4 bits (< 16: GGUF Q4_0, Q4_1, Q4_K), one for 5 (< 32: Q5_0,
//! Q5_1, Q5_K; bit 4 of step g at bit g), two for 6 (< 64; bits 4-5 of step 4L + f at bits 2f..2f+1
//! of line L). A block is then 256, 320, 384 or 512 bytes, so a panel's byte length names its layout,
//! and the weights take about their GGUF file size. Panels choose on their own, so a fused projection
//! of mixed types (a Q4_K_M QKV: Q4_K q and k, Q6_K v) keeps 4-bit codes where its rows allow. Q6_K
//! rows take split panels (weight.rs): the file's 6-bit `q`, each 16-wide half of a block with its
//! own scale, `w = d_h·(q - 32)`; a tile sums each half from the half's offset
//! `-32·Σ(R·h + l)` (`QActs::halves`, from the activations alone) and folds the two in turn,
//! `cvt(dot_0)·(d_0·s)` then `cvt(dot_1)·(d_1·s)` (no `m·qs` term). A Q6_K row that shares a panel
//! with rows of another type is folded onto one scale a block instead (gguf.rs: exact only where
//! the halves' scales allow, else requantized to 8 bits).
//! Every tile reads every layout (the AVX2 one runs its exact single-`vpmaddubsw` mode on 4-bit
//! panels and its `16·hi + lo` split, with the stored nibbles and high bits as the halves, on the
//! others; the VNNI one rebuilds each step's 8-bit code vector: a mask, and for 5 and 6 bits a shift
//! of the bit line and one `vpternlogd`); the integer dots and the float sums are the same, so the
//! results are bit for bit those of the 8-bit layout.
//!
//! Scales (`Scales`): f16 when every `d` and `m` of a weight is exactly an f16 (GGUF Q4_0, Q4_1,
//! Q5_0, Q5_1, Q8_0 scales are), widened on load (F16C `vcvtph2ps`), else f32; widening is exact,
//! so the products are the same bit for bit. A Q4_1 weight then takes 20 bytes per 32, as in the file.
//! The symmetric types (Q4_0, Q5_0, Q8_0), whose `m` is `-2^e·d`, keep only `d` (`Scales::Sym`; the
//! tiles compute `m`, exactly): 34 bytes per 32 for Q8_0, as in the file.

mod acts;
#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod avx2;
pub mod gguf;
mod pack;
mod product;
mod scalar;
#[cfg(test)]
mod tests;
mod weight;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use acts::{quantize_acts, quantize_one, QActs};
pub use product::Product;
pub use weight::{Muls, QWeight, Scales};

use acts::{quantize_chunks, quantize_par, TILED_MIN_ROWS};
use product::{check_shapes, run_job, Args, SendPtr, JOB_PANELS};

use crate::error::Result;
use crate::runtime::{self, Isa};

// What x86.rs and avx2.rs take from `super`, and tests.rs from `super::*`.
#[cfg(target_arch = "x86_64")]
use acts::{digit_base, tiled_step, ActsMut, BASE_BUDGET, BASE_CAP, TILED_ROWS};
#[cfg(test)]
use acts::{quantize_fast, quantize_tiled};
#[cfg(any(test, target_arch = "x86_64"))]
use product::MR;
#[cfg(test)]
use product::ROW_BLOCK_BYTES;
#[cfg(target_arch = "x86_64")]
use product::{tile_order, PASS_PANELS};
#[cfg(target_arch = "x86_64")]
use weight::GRID_BLOCKS;

/// K values per quantization block.
pub const QBLOCK: usize = 32;

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

/// Whether a product of `m` rows of `w` on build `v` runs the AMX tile: the AVX-512 build, at least
/// `AMX_MIN_ROWS` rows, one-digit activations, no split panel in `w`, AMX-INT8 usable
/// (`runtime::amx_int8`). Elsewhere the VNNI tile was as fast or faster (amx.rs).
fn amx_for(v: Isa, m: usize, w: &QWeight) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        v == Isa::Avx512
            && m >= amx::AMX_MIN_ROWS
            && w.act_digits() == 1
            && !w.split.iter().any(|&s| s)
            && runtime::amx_int8()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (v, m, w);
        false
    }
}

/// Whether build `v` runs in its AVX-VNNI form: the AVX2 build where `runtime::avx_vnni` says so.
fn avx_vnni_for(v: Isa) -> bool {
    v == Isa::Avx2 && runtime::avx_vnni()
}

/// What `kernel_info()` reports for the build `variant(isa)` runs (`avx512amx`: the VNNI tile, and
/// the AMX one where `amx_for` takes it; `avxvnni`: the AVX2 build in its AVX-VNNI form).
pub fn variant_name(isa: Isa) -> &'static str {
    match variant(isa) {
        Isa::Avx512 if runtime::amx_int8() => "avx512amx",
        Isa::Avx512 => "avx512vnni",
        v if avx_vnni_for(v) => "avxvnni",
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

/// `out[m, n] = x[m, k] · Wᵀ` on the kernel thread pool.
pub fn linear(x: &[f32], m: usize, w: &QWeight, out: &mut [f32]) -> Result<()> {
    linear_with(active_isa()?, x, m, w, out)
}

/// `linear` with an explicit variant (tests compare them).
pub fn linear_with(isa: Isa, x: &[f32], m: usize, w: &QWeight, out: &mut [f32]) -> Result<()> {
    linear_ld(isa, x, m, w, out, None, true)
}

/// `linear_with` that never runs the extension tiles (AMX, the AVX2 build's AVX-VNNI form): tests
/// compare the tiles.
#[cfg(test)]
fn linear_without_ext(isa: Isa, x: &[f32], m: usize, w: &QWeight, out: &mut [f32]) -> Result<()> {
    linear_ld(isa, x, m, w, out, None, false)
}

/// `linear` into rows `ld` floats apart: `out` starts at the first row's first column of a wider
/// matrix (see `Product::strided`).
pub fn linear_strided(x: &[f32], m: usize, w: &QWeight, out: &mut [f32], ld: usize) -> Result<()> {
    linear_ld(active_isa()?, x, m, w, out, Some(ld), true)
}

fn linear_ld(isa: Isa, x: &[f32], m: usize, w: &QWeight, out: &mut [f32], ld: Option<usize>, ext: bool) -> Result<()> {
    use rayon::prelude::*;
    let k = w.k;
    check_shapes(x, m, w, out, ld)?;
    let ld = ld.unwrap_or(w.n);
    if m == 0 {
        return Ok(());
    }
    let pool = runtime::pool()?;
    let out_ptr = SendPtr(out.as_mut_ptr());
    pool.install(|| {
        let one = w.act_digits() == 1;
        let amx = ext && amx_for(variant(isa), m, w);
        let avx_vnni = ext && avx_vnni_for(variant(isa));
        let mut acts = match variant(isa) {
            Isa::Scalar if one => quantize_one(x, m, k, false),
            Isa::Scalar => quantize_acts(x, m, k),
            // The AMX tile's layout (in chunks of 64 rows on the pool), else the VNNI tile's tiled
            // digits from `TILED_MIN_ROWS` rows on.
            _ if amx => quantize_chunks(x, m, k, 64, one, true),
            v => quantize_par(v, x, m, k, v == Isa::Avx512 && m >= TILED_MIN_ROWS, one),
        };
        acts.prepare(variant(isa), !w.split.is_empty(), m, k);
        let jobs = w.panels().div_ceil(JOB_PANELS);
        (0..jobs).into_par_iter().for_each(|j| {
            let a = Args {
                acts: &acts,
                w,
                out: out_ptr.get(),
                ld,
                amx,
                avx_vnni,
            };
            let p0 = j * JOB_PANELS;
            let np = JOB_PANELS.min(w.panels() - p0);
            run_job(isa, &a, m, p0, np);
        });
    });
    Ok(())
}
