//! AVX2 tile of the block-quantized linear layer (layout and formula: `mod.rs`), for x86-64 CPUs
//! without AVX-512 VNNI: `vpmaddubsw` + `vpmaddwd`, as llama.cpp's AVX2 dot products do; or, where
//! the CPU has AVX-VNNI (`runtime::avx_vnni`, `Args::avx_vnni`), its `vpdpbusd` form (`tile_vnni`:
//! every layout's codes whole, i32 sums, the digits combined as the AVX-512 VNNI tile does).
//!
//! | mode   | chosen at `QWeight` build when     | per 4-k group and 8-row code vector, per row and digit         |
//! |--------|------------------------------------|----------------------------------------------------------------|
//! | nibble | every code <= 15 (GGUF Q4_1)       | one `vpmaddubsw`, summed in i16 over the whole 32-block        |
//! | wide   | any code (Q8_0, requantized float) | codes split `c = 16·hi + lo`: two `vpmaddubsw`, each as above  |
//!
//! 5- and 6-bit codes go whole instead (every tile): one `vpmaddubsw`, its i16 sums widened every 4
//! (5-bit) or 2 (6-bit) groups, before they could leave i16.
//!
//! Layout: the packed one as it is (no copy of its own): the 4-bit layout for `nibble` (a 64-byte
//! line holds two groups; masking its low or high nibbles gives one group as the 8-bit layout would
//! hold it); `wide` reads the 8-, 6- and 5-bit layouts, whose split is what they store: `lo` is the
//! nibble line's half (8-bit: the code's low nibble), `hi` the high bits shifted down and masked
//! (`split`). A 64-byte group (16 rows × 4 consecutive k) is two 32-byte vectors of 8 rows; each 32-bit lane holds one row's 4 codes and meets a
//! broadcast of the activation row's 4 digit bytes. `vpmaddubsw` (u8 × i8, adjacent products
//! summed into i16 with signed saturation) is exact while no sum leaves i16: with 4-bit codes a
//! pair is at most 2·15·127 = 3810 in magnitude and the 8 groups of a block sum to at most 30480
//! < 32767, so the i16 sums are kept over the block. An 8-bit code would saturate a single pair
//! (2·255·127 = 64770), hence the split: both halves are 4-bit codes and
//! `Σ c·x = 16·Σ hi·x + Σ lo·x`. Per block `vpmaddwd` with the digit's weight (the block's ratio
//! `R` for the first digit, 1 for the second; times 16 for a code's high half, `16·R` < 2^15) sums
//! a lane's two i16 into i32, and the digits' two (or four) sums add up to the exact `R·Σc·h +
//! Σc·l` of its row; then the same
//! two FMAs as the scalar path in its order: the scalar bits exactly (tests compare them, with codes at 0, 15 and 255
//! and digits at ±127). One-digit activations (`QActs::digits` 1: `R` = 1, `l` = 0) skip the second
//! digit's `vpmaddubsw` and `vpmaddwd` (`ONE`): half the integer work, the same sums. Tiles: `nibble`,
//! R = 2 rows (or 1) × one panel of 16 columns, its 8 i16
//! sums in registers; `wide`, 2 rows × half a panel (8 columns, `wide_half`, 8 i16 sums: low and
//! high halves × 2 digits × 2 rows), or a last single row × the whole panel (`tile::<1, true>`).
//! The wide tile takes half a panel because the whole-panel form at R = 1 read each code vector for
//! one row and spilled its unpacked halves: the half-panel one keeps its sums in registers and is
//! the faster of the two from a few rows on.

use std::arch::x86_64::*;

/// How far ahead of the tile the code stream is prefetched: a single-row product past L3 (a Q8_0
/// lm_head) streams well below the read bandwidth with the hardware prefetcher alone, and at about
/// the full bandwidth with the stream prefetched 4 KiB ahead.
const PREFETCH: usize = 4096;

/// Rows per tile of the AVX-VNNI form (`vnni_rows`).
const VNNI_MR: usize = 4;

use super::weight::LINE;
use super::{tile_order, Args, Muls, Scales, GRID_BLOCKS, MR, PANEL, PASS_PANELS, QBLOCK};

/// All row tiles of panels `p0..p0+np`.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C (part of the AVX2 ISA's detection); `a` describes activations
/// of `m` rows and an output of `m × n` floats; `p0 + np <= panels`.
// Not F16C here: the tiles (which need it) then stay functions of their own rather than inlined
// into one large job, which was slower at 8 rows.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn job(a: &Args, m: usize, p0: usize, np: usize) {
    let nb = a.w.k / QBLOCK;
    // Integer (K-quant) scales are widened once a pass when several row tiles share them: into
    // f32 here, exactly the values `load_scales` gives (`Scales::Grid`).
    let mr = if a.avx_vnni { VNNI_MR } else { MR };
    let hoist = matches!(a.w.scales, Scales::Grid { .. }) && m > mr;
    let mut pass = Scales::F32(if hoist {
        vec![0f32; PASS_PANELS * nb * 2 * PANEL]
    } else {
        Vec::new()
    });
    tile_order(m, a.w.k, p0, np, mr, |r0, rows, ps, pn, first| {
        if hoist && first {
            if let Scales::F32(buf) = &mut pass {
                let from = ps * nb * 2 * PANEL;
                for (i, out) in buf[..pn * nb * 2 * PANEL].chunks_exact_mut(2 * PANEL).enumerate() {
                    for v in 0..2 {
                        // SAFETY: block i of panels ps..ps+pn (pn <= PASS_PANELS) is inside the
                        // weight's scales, half v at offset 8v; `out` holds its 2*PANEL values.
                        unsafe {
                            let (d, mm) = load_scales(&a.w.scales, from + i * 2 * PANEL + v * 8);
                            _mm256_storeu_ps(out.as_mut_ptr().add(v * 8), d);
                            _mm256_storeu_ps(out.as_mut_ptr().add(PANEL + v * 8), mm);
                        }
                    }
                }
            }
        }
        // The scales the tiles read, and panel ps's index in them.
        let (sc, base) = if hoist { (&pass, ps) } else { (&a.w.scales, 0) };
        for p in ps..ps + pn {
            let sp = p - base;
            // SAFETY: forwarded from the caller; `tile_order` gives rows r0..r0+rows inside the
            // activations and panels inside p0..p0+np; panel p's scales are panel sp of `sc`, its
            // codes in the layout `panel_bits` reads off their length.
            unsafe {
                if a.acts.digits == 1 {
                    tiles::<true>(a, sc, sp, r0, rows, p, first);
                } else {
                    tiles::<false>(a, sc, sp, r0, rows, p, first);
                }
            }
        }
    });
}

/// The tile for `rows` (1 or 2) rows from `r0` × panel `p` in its layout; `ONE`: one-digit
/// activations (`QActs::digits`), whose second digit the tiles skip (all zero: the same sums).
///
/// # Safety
/// As for `tile` and `wide_half`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn tiles<const ONE: bool>(a: &Args, sc: &Scales, sp: usize, r0: usize, rows: usize, p: usize, first: bool) {
    if a.avx_vnni {
        // SAFETY: forwarded from the caller; `a.avx_vnni` only where `runtime::avx_vnni` found
        // AVX-VNNI.
        unsafe {
            match (a.w.panel_split(p), a.w.panel_bits(p)) {
                (true, _) => vnni_rows::<6, true, ONE>(a, sc, sp, r0, rows, p, first),
                (_, 4) => vnni_rows::<4, false, ONE>(a, sc, sp, r0, rows, p, first),
                (_, 5) => vnni_rows::<5, false, ONE>(a, sc, sp, r0, rows, p, first),
                (_, 6) => vnni_rows::<6, false, ONE>(a, sc, sp, r0, rows, p, first),
                _ => vnni_rows::<8, false, ONE>(a, sc, sp, r0, rows, p, first),
            }
        }
        return;
    }
    // SAFETY: forwarded from the caller.
    unsafe {
        match (a.w.panel_bits(p), rows) {
            // Split panels (6-bit, weight.rs): the wide mode a half panel at a time.
            (_, 2) if a.w.panel_split(p) => {
                wide_half::<2, 6, true, ONE>(a, sc, sp, r0, p, 0, first);
                wide_half::<2, 6, true, ONE>(a, sc, sp, r0, p, 1, false);
            }
            (_, _) if a.w.panel_split(p) => {
                wide_half::<1, 6, true, ONE>(a, sc, sp, r0, p, 0, first);
                wide_half::<1, 6, true, ONE>(a, sc, sp, r0, p, 1, false);
            }
            (4, 2) => tile::<2, 4, ONE>(a, sc, sp, r0, p, first),
            (4, _) => tile::<1, 4, ONE>(a, sc, sp, r0, p, first),
            (5, 2) => wide_pair::<5, ONE>(a, sc, sp, r0, p, first),
            (5, _) => tile::<1, 5, ONE>(a, sc, sp, r0, p, first),
            (6, 2) => wide_pair::<6, ONE>(a, sc, sp, r0, p, first),
            (6, _) => tile::<1, 6, ONE>(a, sc, sp, r0, p, first),
            (_, 2) => wide_pair::<8, ONE>(a, sc, sp, r0, p, first),
            (_, _) => tile::<1, 8, ONE>(a, sc, sp, r0, p, first),
        }
    }
}

/// Both halves of panel `p` for 2 rows (`wide_half`), the first prefetching when `prefetch`.
///
/// # Safety
/// As for `wide_half`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn wide_pair<const BITS: usize, const ONE: bool>(
    a: &Args,
    sc: &Scales,
    sp: usize,
    r0: usize,
    p: usize,
    prefetch: bool,
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        wide_half::<2, BITS, false, ONE>(a, sc, sp, r0, p, 0, prefetch);
        wide_half::<2, BITS, false, ONE>(a, sc, sp, r0, p, 1, false);
    }
}

/// Step `g` (0..8) of a block of the `BITS`-bit layout, `blk` pointing at the block's first line
/// (or 32 bytes into it, for its second half of 8 rows): 32 codes split as `(lo, hi)` with
/// `c = 16·hi + lo`, each a u8 lane (`hi` 0 for `BITS` = 4).
///
/// # Safety
/// AVX2 is available; `blk` is followed by the block's `BITS` lines of 64 bytes (from its start).
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn split<const BITS: usize>(blk: *const u8, g: usize) -> (__m256i, __m256i) {
    let low4 = _mm256_set1_epi8(0x0f);
    // SAFETY: line < BITS of the block (contract).
    let line = |l: usize| unsafe { _mm256_loadu_si256(blk.add(l * LINE) as *const __m256i) };
    let shr = |v: __m256i, n: usize| _mm256_srl_epi16(v, _mm_cvtsi32_si128(n as i32));
    if BITS == 8 {
        let c = line(g);
        return (
            _mm256_and_si256(c, low4),
            _mm256_and_si256(_mm256_srli_epi16::<4>(c), low4),
        );
    }
    // Nibble line g/2: step g in its low nibbles when g is even, in its high ones when odd.
    let nib = line(g / 2);
    let lo = _mm256_and_si256(
        if g.is_multiple_of(2) {
            nib
        } else {
            _mm256_srli_epi16::<4>(nib)
        },
        low4,
    );
    let hi = match BITS {
        5 => _mm256_and_si256(shr(line(4), g), _mm256_set1_epi8(1)),
        6 => _mm256_and_si256(shr(line(4 + g / 4), 2 * (g % 4)), _mm256_set1_epi8(3)),
        _ => _mm256_setzero_si256(),
    };
    (lo, hi)
}

/// Step `g` of a block of the `BITS`-bit layout (5 or 6) as whole codes `16·hi + lo` (`split`'s
/// halves joined: every code below 64, one u8 lane each).
///
/// # Safety
/// As for `split`.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn whole<const BITS: usize>(blk: *const u8, g: usize) -> __m256i {
    // SAFETY: forwarded from the caller.
    let (lo, hi) = unsafe { split::<BITS>(blk, g) };
    // hi is below 4 in each byte: shifting its 16-bit lanes by 4 moves no bit across a byte.
    _mm256_or_si256(lo, _mm256_slli_epi16::<4>(hi))
}

/// `*acc += vpmaddubsw(codes, broadcast of the 4 bytes at x)` (i16 lanes, wrapping add) for two
/// (codes, acc) pairs, the broadcast made once at its use. Left to itself the compiler may load a
/// block's broadcasts up front and, with 16 vector registers, spill them (a one-row product ran
/// about a fifth slower); in one `asm!` it cannot. In an `unsafe` block: `x` points at 4 readable
/// bytes and AVX2 is enabled.
macro_rules! madd_bcast {
    ($x:expr, ($c0:expr, $a0:expr), ($c1:expr, $a1:expr)) => {
        std::arch::asm!(
            "vpbroadcastd {t}, dword ptr [{x}]",
            "vpmaddubsw {u}, {c0}, {t}",
            "vpaddw {a0}, {a0}, {u}",
            "vpmaddubsw {u}, {c1}, {t}",
            "vpaddw {a1}, {a1}, {u}",
            x = in(reg) $x,
            c0 = in(ymm_reg) $c0,
            c1 = in(ymm_reg) $c1,
            a0 = inout(ymm_reg) *$a0,
            a1 = inout(ymm_reg) *$a1,
            t = out(ymm_reg) _,
            u = out(ymm_reg) _,
            options(pure, readonly, nostack, preserves_flags),
        )
    };
}

/// `madd_bcast!` for one (codes, acc) pair. In an `unsafe` block: `x` points at 4 readable bytes and
/// AVX2 is enabled.
macro_rules! madd_bcast1 {
    ($x:expr, ($c:expr, $a:expr)) => {
        std::arch::asm!(
            "vpbroadcastd {t}, dword ptr [{x}]",
            "vpmaddubsw {t}, {c}, {t}",
            "vpaddw {a}, {a}, {t}",
            x = in(reg) $x,
            c = in(ymm_reg) $c,
            a = inout(ymm_reg) *$a,
            t = out(ymm_reg) _,
            options(pure, readonly, nostack, preserves_flags),
        )
    };
}

/// `*acc += vpdpbusd(codes, broadcast of the 4 bytes at x + OFF)` (i32 lanes: each the sum of its
/// four u8 × i8 products) for two (codes, acc) pairs, the AVX-VNNI (VEX) encoding, `OFF` a constant
/// displacement (no address computed a broadcast); in one `asm!` for the reason `madd_bcast!` is.
/// In an `unsafe` block: `x + OFF` points at 4 readable bytes and the CPU has AVX-VNNI
/// (`runtime::avx_vnni`).
macro_rules! dp_bcast {
    ($x:expr, $off:expr, ($c0:expr, $a0:expr), ($c1:expr, $a1:expr)) => {
        std::arch::asm!(
            "vpbroadcastd {t}, dword ptr [{x} + {off}]",
            "{{vex}} vpdpbusd {a0}, {c0}, {t}",
            "{{vex}} vpdpbusd {a1}, {c1}, {t}",
            x = in(reg) $x,
            off = const $off,
            c0 = in(ymm_reg) $c0,
            c1 = in(ymm_reg) $c1,
            a0 = inout(ymm_reg) *$a0,
            a1 = inout(ymm_reg) *$a1,
            t = out(ymm_reg) _,
            options(pure, readonly, nostack, preserves_flags),
        )
    };
    ($x:expr, $off:expr, ($c:expr, $a:expr)) => {
        std::arch::asm!(
            "vpbroadcastd {t}, dword ptr [{x} + {off}]",
            "{{vex}} vpdpbusd {a}, {c}, {t}",
            x = in(reg) $x,
            off = const $off,
            c = in(ymm_reg) $c,
            a = inout(ymm_reg) *$a,
            t = out(ymm_reg) _,
            options(pure, readonly, nostack, preserves_flags),
        )
    };
}

/// Eight grid multipliers `$m` (`Muls`) from index `$at`, as i32 (in an `unsafe` block: they exist).
/// A macro, not a function: a call left out of line in a tile spills every live ymm register.
macro_rules! muls8 {
    ($m:expr, $at:expr) => {
        match $m {
            Muls::U8(v) => _mm256_cvtepu8_epi32(_mm_loadl_epi64(v.as_ptr().add($at) as *const __m128i)),
            Muls::I8(v) => _mm256_cvtepi8_epi32(_mm_loadl_epi64(v.as_ptr().add($at) as *const __m128i)),
            Muls::I16(v) => _mm256_cvtepi16_epi32(_mm_loadu_si128(v.as_ptr().add($at) as *const __m128i)),
        }
    };
}

/// Eight `d` at scale index `at` and the eight `m` PANEL after them, as f32.
///
/// # Safety
/// AVX2 and F16C are available, `at + PANEL + 8 <= scales.len()` and `at % (2 * PANEL)` is 0 or 8
/// (half a panel of one block).
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn load_scales(scales: &Scales, at: usize) -> (__m256, __m256) {
    debug_assert!(at + PANEL + 8 <= scales.len());
    // SAFETY: the caller's bounds: both 8-wide reads are inside the scales.
    unsafe {
        match scales {
            Scales::F32(v) => {
                let sp = v.as_ptr().add(at);
                (_mm256_loadu_ps(sp), _mm256_loadu_ps(sp.add(PANEL)))
            }
            Scales::F16(v) => {
                let sp = v.as_ptr().add(at);
                (
                    _mm256_cvtph_ps(_mm_loadu_si128(sp as *const __m128i)),
                    _mm256_cvtph_ps(_mm_loadu_si128(sp.add(PANEL) as *const __m128i)),
                )
            }
            Scales::Sym { d, r } => {
                // The block's 8 `d` at block·PANEL + j (j = 0 or 8); `m = r·d` as `Scales::at` computes it.
                let (blk, j) = (at / (2 * PANEL), at % (2 * PANEL));
                debug_assert!(j + 8 <= PANEL && blk * PANEL + j + 8 <= d.len());
                let dv = _mm256_cvtph_ps(_mm_loadu_si128(d.as_ptr().add(blk * PANEL + j) as *const __m128i));
                (dv, _mm256_mul_ps(dv, _mm256_set1_ps(*r)))
            }
            Scales::Grid { base, dmul, mmul } => {
                // The f32 layout's index `at` = block·2·PANEL + j (j = 0 or 8): the block's 8
                // multipliers at block·PANEL + j, its super-block's bases at
                // (block / GRID_BLOCKS)·2·PANEL + j; base·mul as `Scales::at` computes it.
                let (blk, j) = (at / (2 * PANEL), at % (2 * PANEL));
                debug_assert!(j + 8 <= PANEL && blk * PANEL + j + 8 <= dmul.len());
                let bp = base.as_ptr().add(blk / GRID_BLOCKS * 2 * PANEL + j);
                let db = _mm256_cvtph_ps(_mm_loadu_si128(bp as *const __m128i));
                let mb = _mm256_cvtph_ps(_mm_loadu_si128(bp.add(PANEL) as *const __m128i));
                (
                    _mm256_mul_ps(db, _mm256_cvtepi32_ps(muls8!(dmul, blk * PANEL + j))),
                    _mm256_mul_ps(mb, _mm256_cvtepi32_ps(muls8!(mmul, blk * PANEL + j))),
                )
            }
        }
    }
}

/// Software prefetch for block `b` of panel `p`: its scales, and its code lines `PREFETCH` bytes
/// ahead of `codes` (panel p's codes; panels are contiguous, so past this panel's end it fetches the
/// next one's start; a prefetch never faults).
#[target_feature(enable = "avx2")]
#[inline]
fn prefetch_block(a: &Args, codes: *const u8, p: usize, b: usize, block_bytes: usize) {
    a.w.scales.prefetch(p * a.w.blocks() + b);
    for line in (0..block_bytes).step_by(64) {
        let ahead = codes.wrapping_add(b * block_bytes + line + PREFETCH);
        _mm_prefetch::<_MM_HINT_T0>(ahead as *const i8);
    }
}

/// Rows `r0..r0+R` of a tile's sums, `NV` vectors of 8 columns each from column `col`, into the
/// output (the columns before `n` only).
///
/// # Safety
/// Rows `r0..r0+R` are inside the `[m, n]` output and columns `col..col + 8·NV` (those below `n`)
/// are written by this tile alone.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn store_rows<const R: usize, const NV: usize>(a: &Args, acc: &[[__m256; NV]; R], r0: usize, col: usize) {
    let valid = (NV * 8).min(a.w.n.saturating_sub(col));
    for (r, row) in acc.iter().enumerate() {
        let mut buf = [0f32; PANEL];
        for (v, &x) in row.iter().enumerate() {
            // SAFETY: buf holds 16 floats, NV <= 2 unaligned 8-float stores.
            unsafe { _mm256_storeu_ps(buf.as_mut_ptr().add(8 * v), x) };
        }
        // SAFETY: row r0+r < m, columns col..col+valid <= n of the [m, n] output (contract).
        unsafe { std::ptr::copy_nonoverlapping(buf.as_ptr(), a.out.add((r0 + r) * a.ld + col), valid) };
    }
}

/// One tile: rows `r0..r0+R` times panel `p` in the `BITS`-bit layout; 4: the `nibble` mode,
/// else `wide` (8-bit codes split `16·hi + lo`, 5- and 6-bit ones whole).
///
/// # Safety
/// As for `job`; rows `r0..r0+R` are inside the activations, panel `p` exists and holds its
/// codes in the `BITS`-bit layout.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<const R: usize, const BITS: usize, const ONE: bool>(
    a: &Args,
    sc: &Scales,
    sp: usize,
    r0: usize,
    p: usize,
    prefetch: bool,
) {
    let k = a.w.k;
    let nb = k / QBLOCK;
    const { assert!(BITS == 4 || BITS == 5 || BITS == 6 || BITS == 8) };
    let wide = BITS != 4;
    // Panel p's codes: k*PANEL*BITS/8 bytes, BITS lines a block.
    // SAFETY: panel p exists: its code bytes start at this offset (and nb*2*PANEL scales from p*nb*2*PANEL).
    let codes = unsafe { a.w.codes.as_ptr().add(a.w.code_at[p]) };
    let scales = sp * nb * 2 * PANEL;
    let (xh, xl) = (a.acts.hi.as_ptr(), a.acts.lo.as_ptr());
    // `vpmaddwd` weights of the second digit [code half] (a code's high half 16 times its low
    // one); the first digit's are the block's R times these.
    let weight = [_mm256_set1_epi16(1), _mm256_set1_epi16(16)];
    let zero = _mm256_setzero_si256();
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    let block_bytes = BITS * LINE;
    for b in 0..nb {
        if prefetch {
            prefetch_block(a, codes, p, b, block_bytes);
        }
        // i16 pair sums [row][digit][8-row vector]: of the codes (nibble mode) or of their low
        // halves, and of their high halves (8-bit codes); 5- and 6-bit codes: `dots`, below.
        let mut lo = [[[zero; 2]; 2]; R];
        let mut hi = [[[zero; 2]; 2]; R];
        // 5- and 6-bit codes: R·Σc·h + Σc·l [row][8-row vector], exact in i32 (mod.rs).
        let mut dots = [[zero; 2]; R];
        let whole_codes = BITS == 5 || BITS == 6;
        if whole_codes {
            let bases: [__m256i; R] = std::array::from_fn(|r| _mm256_set1_epi16(a.acts.base[(r0 + r) * nb + b] as i16));
            // Whole codes, their i16 sums widened every 4 (5-bit) or 2 (6-bit) groups (`wide_half`).
            let groups = if BITS == 5 { 4 } else { 2 };
            for c0 in (0..QBLOCK / 4).step_by(groups) {
                // i16 pair sums [row][digit][8-row vector].
                let mut sums = [[[zero; 2]; 2]; R];
                for g in c0..c0 + groups {
                    let kk = b * QBLOCK + g * 4;
                    // SAFETY: block b of panel p (BITS lines from b*block_bytes), its half v.
                    let c: [__m256i; 2] =
                        std::array::from_fn(|v| unsafe { whole::<BITS>(codes.add(b * block_bytes + v * 32), g) });
                    for (r, row) in sums.iter_mut().enumerate() {
                        for (digit, xq) in [xh, xl].into_iter().enumerate().take(if ONE { 1 } else { 2 }) {
                            // SAFETY: row r0+r < m and kk + 4 <= k: four activation bytes inside row r0+r.
                            let x = unsafe { xq.add((r0 + r) * k + kk) };
                            let [s0, s1] = &mut row[digit];
                            // SAFETY: `x` is four readable bytes (above); AVX2 is enabled here.
                            unsafe { madd_bcast!(x, (c[0], s0), (c[1], s1)) };
                        }
                    }
                }
                for (r, row) in dots.iter_mut().enumerate() {
                    for (v, dot) in row.iter_mut().enumerate() {
                        *dot = _mm256_add_epi32(*dot, _mm256_madd_epi16(sums[r][0][v], bases[r]));
                        if !ONE {
                            *dot = _mm256_add_epi32(*dot, _mm256_madd_epi16(sums[r][1][v], weight[0]));
                        }
                    }
                }
            }
        } else {
            for g in 0..QBLOCK / 4 {
                let kk = b * QBLOCK + g * 4;
                let mut cl = [zero; 2];
                let mut ch = [zero; 2];
                for v in 0..2 {
                    // SAFETY: block b of panel p (BITS lines from b*block_bytes), its half v.
                    (cl[v], ch[v]) = unsafe { split::<BITS>(codes.add(b * block_bytes + v * 32), g) };
                }
                for r in 0..R {
                    for (digit, xq) in [xh, xl].into_iter().enumerate().take(if ONE { 1 } else { 2 }) {
                        // SAFETY: row r0+r < m and kk + 4 <= k: four activation bytes inside row r0+r.
                        let x = unsafe { xq.add((r0 + r) * k + kk) };
                        let [l0, l1] = &mut lo[r][digit];
                        // SAFETY: `x` is four readable bytes (above); AVX2 is enabled here.
                        unsafe { madd_bcast!(x, (cl[0], l0), (cl[1], l1)) };
                        if wide {
                            let [h0, h1] = &mut hi[r][digit];
                            // SAFETY: as above.
                            unsafe { madd_bcast!(x, (ch[0], h0), (ch[1], h1)) };
                        }
                    }
                }
            }
        }
        for v in 0..2 {
            // SAFETY: block b of panel p: 16 `d` then 16 `m`; vector v is 8 of each (F16C is part of
            // the AVX2 ISA's detection).
            let (dv, mv) = unsafe { load_scales(sc, scales + b * 2 * PANEL + v * 8) };
            for r in 0..R {
                let rb = (r0 + r) * nb + b;
                // R·Σc·h + Σc·l, exact in i32 (mod.rs); R is an i16, 16·R need not be (the
                // high halves' R·Σ is shifted instead). One digit: its sums alone (R = 1, l = 0).
                let dot = if whole_codes {
                    dots[r][v]
                } else {
                    let base = _mm256_set1_epi16(a.acts.base[rb] as i16);
                    let mut dot = _mm256_madd_epi16(lo[r][0][v], base);
                    if !ONE {
                        dot = _mm256_add_epi32(dot, _mm256_madd_epi16(lo[r][1][v], weight[0]));
                    }
                    if wide {
                        let mut h = _mm256_slli_epi32::<4>(_mm256_madd_epi16(hi[r][0][v], base));
                        if !ONE {
                            h = _mm256_add_epi32(h, _mm256_madd_epi16(hi[r][1][v], weight[1]));
                        }
                        dot = _mm256_add_epi32(dot, h);
                    }
                    dot
                };
                let s = _mm256_set1_ps(a.acts.s[rb]);
                let qs = _mm256_set1_ps(a.acts.qs[rb]);
                acc[r][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dv, s), acc[r][v]);
                acc[r][v] = _mm256_fmadd_ps(mv, qs, acc[r][v]);
            }
        }
    }
    // SAFETY: rows r0..r0+R and panel p's columns are this tile's (caller's contract).
    unsafe { store_rows(a, &acc, r0, p * PANEL) };
}

/// The AVX-VNNI tiles for `rows` (1 to `VNNI_MR`) rows from `r0` × panel `p`: 3 or 4 rows half a
/// panel at a time (8 i32 sums of 4 rows × 2 digits in registers), 1 or 2 the whole panel.
///
/// # Safety
/// As for `tile_vnni`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn vnni_rows<const BITS: usize, const SPLIT: bool, const ONE: bool>(
    a: &Args,
    sc: &Scales,
    sp: usize,
    r0: usize,
    rows: usize,
    p: usize,
    first: bool,
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        match rows {
            4 => {
                tile_vnni::<4, 1, BITS, SPLIT, ONE>(a, sc, sp, r0, p, 0, first);
                tile_vnni::<4, 1, BITS, SPLIT, ONE>(a, sc, sp, r0, p, 1, false);
            }
            3 => {
                tile_vnni::<3, 1, BITS, SPLIT, ONE>(a, sc, sp, r0, p, 0, first);
                tile_vnni::<3, 1, BITS, SPLIT, ONE>(a, sc, sp, r0, p, 1, false);
            }
            2 => tile_vnni::<2, 2, BITS, SPLIT, ONE>(a, sc, sp, r0, p, 0, first),
            _ => tile_vnni::<1, 2, BITS, SPLIT, ONE>(a, sc, sp, r0, p, 0, first),
        }
    }
}

/// The AVX-VNNI form of a tile: rows `r0..r0+R` times panel `p` in the `BITS`-bit layout (split
/// panels: `SPLIT`, 6-bit), every layout's codes whole (the 8-bit layout's too: `vpdpbusd` sums
/// u8 × i8 products into i32 lanes, where `vpmaddubsw`'s i16 pairs would saturate). Per 4-k group
/// and 8-row code vector, one `vpdpbusd` a row and digit into the row's i32 sums of the digit; per
/// block (per half for a split panel) `R·Σc·h + Σc·l` in i32 (`vpmulld`, an add), then the two FMAs
/// of `tile` (a split panel's half: its offset, then `d_h·s`): the same integers and the same float
/// steps in the same order, so the scalar tile's bits.
///
/// # Safety
/// As for `tile`, and the CPU has AVX-VNNI; `SPLIT` only for a split panel, with `QActs::halves`
/// filled.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_vnni<const R: usize, const NV: usize, const BITS: usize, const SPLIT: bool, const ONE: bool>(
    a: &Args,
    sc: &Scales,
    sp: usize,
    r0: usize,
    p: usize,
    v0: usize,
    prefetch: bool,
) {
    const { assert!(BITS == 4 || BITS == 5 || BITS == 6 || BITS == 8) };
    const { assert!(NV == 1 || NV == 2) };
    let k = a.w.k;
    let nb = k / QBLOCK;
    // SAFETY: panel p exists: its code bytes start at this offset (and nb*2*PANEL scales from p*nb*2*PANEL).
    let codes = unsafe { a.w.codes.as_ptr().add(a.w.code_at[p]) };
    let scales = sp * nb * 2 * PANEL;
    let (xh, xl) = (a.acts.hi.as_ptr(), a.acts.lo.as_ptr());
    let zero = _mm256_setzero_si256();
    let mut acc = [[_mm256_setzero_ps(); NV]; R];
    let block_bytes = BITS * LINE;
    for b in 0..nb {
        if prefetch {
            prefetch_block(a, codes, p, b, block_bytes);
        }
        // Block b's first code line and each row's digits of the block (group g at 4g bytes).
        let blk = codes.wrapping_add(b * block_bytes);
        let xs: [[*const i8; 2]; R] =
            std::array::from_fn(|r| [xh, xl].map(|xq| xq.wrapping_add((r0 + r) * k + b * QBLOCK)));
        // i32 sums [row][digit][8-row vector] of the codes times the digit.
        let mut sums = [[[zero; NV]; 2]; R];
        // Group $g (a literal: the code lines and the broadcasts' displacements are constants).
        macro_rules! group {
            ($g:literal) => {{
                let c: [__m256i; NV] = std::array::from_fn(|i| {
                    let half = blk.wrapping_add((v0 + i) * 32);
                    // SAFETY: block b of panel p (BITS lines from blk), its half v0 + i.
                    unsafe {
                        match BITS {
                            8 => _mm256_loadu_si256(half.add($g * LINE) as *const __m256i),
                            4 => split::<4>(half, $g).0,
                            _ => whole::<BITS>(half, $g),
                        }
                    }
                });
                for (row, x) in sums.iter_mut().zip(&xs) {
                    for digit in 0..if ONE { 1 } else { 2 } {
                        // SAFETY: row r0+r < m and b*32 + 4g + 4 <= k: four activation bytes of
                        // row r0+r; AVX-VNNI is available (contract).
                        unsafe {
                            if NV == 2 {
                                let (s0, s1) = row[digit].split_at_mut(1);
                                dp_bcast!(x[digit], 4 * $g, (c[0], &mut s0[0]), (c[NV - 1], &mut s1[0]));
                            } else {
                                dp_bcast!(x[digit], 4 * $g, (c[0], &mut row[digit][0]));
                            }
                        }
                    }
                }
            }};
        }
        // Fold the sums of half `$h` of the block (split) or of the whole block into `acc`.
        macro_rules! fold {
            ($h:literal) => {
                for v in 0..NV {
                    // SAFETY: block b of panel p: 16 `d` then 16 `m`; half v0 + v is 8 of each.
                    let (dv, mv) = unsafe { load_scales(sc, scales + b * 2 * PANEL + (v0 + v) * 8) };
                    for r in 0..R {
                        let rb = (r0 + r) * nb + b;
                        // R·Σc·h + Σc·l, exact in i32 (mod.rs); one digit: R·Σc·h (R = 1, l = 0).
                        let mut dot = _mm256_mullo_epi32(sums[r][0][v], _mm256_set1_epi32(a.acts.base[rb]));
                        if !ONE {
                            dot = _mm256_add_epi32(dot, sums[r][1][v]);
                        }
                        let s = _mm256_set1_ps(a.acts.s[rb]);
                        if SPLIT {
                            // The half's offset (`QActs::halves`), then d_h·s with d_0, d_1 in the
                            // `d` and `m` slots.
                            let dot = _mm256_add_epi32(dot, _mm256_set1_epi32(a.acts.halves[rb * 2 + $h]));
                            let d = if $h == 0 { dv } else { mv };
                            acc[r][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, s), acc[r][v]);
                        } else {
                            let qs = _mm256_set1_ps(a.acts.qs[rb]);
                            acc[r][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dv, s), acc[r][v]);
                            acc[r][v] = _mm256_fmadd_ps(mv, qs, acc[r][v]);
                        }
                    }
                }
            };
        }
        group!(0);
        group!(1);
        group!(2);
        group!(3);
        if SPLIT {
            // A split panel's block: k steps 0-3 then 4-7, each folded at its end.
            fold!(0);
            sums = [[[zero; NV]; 2]; R];
        }
        group!(4);
        group!(5);
        group!(6);
        group!(7);
        fold!(1);
    }
    // SAFETY: rows r0..r0+R and halves v0..v0+NV of panel p are this tile's (caller's contract).
    unsafe { store_rows(a, &acc, r0, p * PANEL + v0 * 8) };
}

/// The `wide` mode for rows `r0..r0+R` and the 8 columns of half `v` (0 or 1) of panel `p` (in the
/// `BITS`-bit layout, 5, 6 or 8): the same integer sums and the same two FMAs a block as
/// `tile::<R, BITS>`, in the same order, so
/// the same bits; one 32-byte code vector a group instead of two keeps its 8 i16 sums (R = 2), the
/// unpacked codes and one broadcast in registers (the two-vector form spilled them). `SPLIT`: a
/// split panel (weight.rs), each block's two halves summed and folded in turn as the scalar tile
/// folds them.
///
/// # Safety
/// As for `tile`, and `v < 2`; `SPLIT` only for a split panel, with `QActs::halves` filled.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn wide_half<const R: usize, const BITS: usize, const SPLIT: bool, const ONE: bool>(
    a: &Args,
    sc: &Scales,
    sp: usize,
    r0: usize,
    p: usize,
    v: usize,
    prefetch: bool,
) {
    const { assert!(BITS == 5 || BITS == 6 || BITS == 8) };
    let k = a.w.k;
    let nb = k / QBLOCK;
    let block_bytes = BITS * LINE;
    // SAFETY: panel p exists in the BITS-bit layout: k*PANEL*BITS/8 code bytes from its offset;
    // half v is bytes 32v..32v+32 of each 64-byte line.
    let codes = unsafe { a.w.codes.as_ptr().add(a.w.code_at[p] + v * 32) };
    let scales = sp * nb * 2 * PANEL + v * 8;
    let (xh, xl) = (a.acts.hi.as_ptr(), a.acts.lo.as_ptr());
    let mut acc = [_mm256_setzero_ps(); R];
    for b in 0..nb {
        if prefetch {
            // The whole panel's lines (half 1 then finds them cached): `codes` is half v's start,
            // 32v bytes into each line, which moves no prefetch off its line.
            prefetch_block(a, codes, p, b, block_bytes);
        }
        // SAFETY: block b of panel p: 16 `d` then 16 `m`; half v is 8 of each.
        let (dv, mv) = unsafe { load_scales(sc, scales + b * 2 * PANEL) };
        // The block's k steps in one run, or (split) steps 0-3 then 4-7, each folded at its end.
        let runs = if SPLIT { 2 } else { 1 };
        for h in 0..runs {
            let (g0, g1) = (h * 8 / runs, (h + 1) * 8 / runs);
            // R·Σc·h + Σc·l of each row over the run's groups, exact in i32 (mod.rs).
            let mut dots = [_mm256_setzero_si256(); R];
            let bases: [i16; R] = std::array::from_fn(|r| {
                // SAFETY: (r0+r)·nb + b < m·nb: row r0+r's block b.
                unsafe { *a.acts.base.get_unchecked((r0 + r) * nb + b) as i16 }
            });
            if BITS == 8 {
                // i16 pair sums [row][digit] of the codes' low and high halves.
                let mut lo = [[_mm256_setzero_si256(); 2]; R];
                let mut hi = [[_mm256_setzero_si256(); 2]; R];
                for g in g0..g1 {
                    let kk = b * QBLOCK + g * 4;
                    // SAFETY: block b of panel p (BITS lines from b*block_bytes), its half v.
                    let (cl, ch) = unsafe { split::<BITS>(codes.add(b * block_bytes), g) };
                    for r in 0..R {
                        for (digit, xq) in [xh, xl].into_iter().enumerate().take(if ONE { 1 } else { 2 }) {
                            // SAFETY: row r0+r < m and kk + 4 <= k: four activation bytes inside row r0+r.
                            let x = unsafe { xq.add((r0 + r) * k + kk) };
                            // SAFETY: `x` is four readable bytes (above); AVX2 is enabled here.
                            unsafe { madd_bcast!(x, (cl, &mut lo[r][digit]), (ch, &mut hi[r][digit])) };
                        }
                    }
                }
                for (r, dot) in dots.iter_mut().enumerate() {
                    let base = _mm256_set1_epi16(bases[r]);
                    // As in `tile` (one digit: the first's sums alone).
                    *dot = if ONE {
                        _mm256_add_epi32(
                            _mm256_madd_epi16(lo[r][0], base),
                            _mm256_slli_epi32::<4>(_mm256_madd_epi16(hi[r][0], base)),
                        )
                    } else {
                        _mm256_add_epi32(
                            _mm256_add_epi32(
                                _mm256_madd_epi16(lo[r][0], base),
                                _mm256_madd_epi16(lo[r][1], _mm256_set1_epi16(1)),
                            ),
                            _mm256_add_epi32(
                                _mm256_slli_epi32::<4>(_mm256_madd_epi16(hi[r][0], base)),
                                _mm256_madd_epi16(hi[r][1], _mm256_set1_epi16(16)),
                            ),
                        )
                    };
                }
            } else {
                // 5- and 6-bit codes whole: a pair of them times digits is at most 2·31·127 = 7,874
                // (5 bits) or 2·63·127 = 16,002 (6 bits) in magnitude, so the i16 sums take `GROUPS`
                // groups before `vpmaddwd` widens them: half the `vpmaddubsw` of the split halves.
                let groups = if BITS == 5 { 4 } else { 2 };
                for c0 in (g0..g1).step_by(groups) {
                    let mut sums = [[_mm256_setzero_si256(); 2]; R];
                    for g in c0..c0 + groups {
                        let kk = b * QBLOCK + g * 4;
                        // SAFETY: block b of panel p (BITS lines from b*block_bytes), its half v.
                        let c = unsafe { whole::<BITS>(codes.add(b * block_bytes), g) };
                        for (r, row) in sums.iter_mut().enumerate() {
                            for (digit, xq) in [xh, xl].into_iter().enumerate().take(if ONE { 1 } else { 2 }) {
                                // SAFETY: row r0+r < m and kk + 4 <= k: four activation bytes inside row r0+r.
                                let x = unsafe { xq.add((r0 + r) * k + kk) };
                                // SAFETY: `x` is four readable bytes (above); AVX2 is enabled here.
                                unsafe { madd_bcast1!(x, (c, &mut row[digit])) };
                            }
                        }
                    }
                    for (r, dot) in dots.iter_mut().enumerate() {
                        *dot = _mm256_add_epi32(*dot, _mm256_madd_epi16(sums[r][0], _mm256_set1_epi16(bases[r])));
                        if !ONE {
                            *dot = _mm256_add_epi32(*dot, _mm256_madd_epi16(sums[r][1], _mm256_set1_epi16(1)));
                        }
                    }
                }
            }
            for (r, &dot) in dots.iter().enumerate() {
                let rb = (r0 + r) * nb + b;
                // SAFETY: rb < m * nb: one scale of row r0+r's block b each.
                let (s, qs) = unsafe {
                    (
                        _mm256_set1_ps(*a.acts.s.get_unchecked(rb)),
                        _mm256_set1_ps(*a.acts.qs.get_unchecked(rb)),
                    )
                };
                if SPLIT {
                    // The half's offset (`QActs::halves`, filled for split panels: contract), then
                    // d_h·s with d_0, d_1 in the `d` and `m` slots.
                    let off = _mm256_set1_epi32(a.acts.halves[rb * 2 + h]);
                    let d = if h == 0 { dv } else { mv };
                    let dot = _mm256_add_epi32(dot, off);
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, s), acc[r]);
                } else {
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dv, s), acc[r]);
                    acc[r] = _mm256_fmadd_ps(mv, qs, acc[r]);
                }
            }
        }
    }
    // SAFETY: rows r0..r0+R and half v of panel p are this tile's (caller's contract).
    unsafe { store_rows(a, &acc.map(|x| [x]), r0, p * PANEL + v * 8) };
}

/// `quantize_acts` for whole rows with AVX2 (same operations, same results bit for bit).
///
/// # Safety
/// The CPU has AVX2 and FMA; `x` holds `a.hi.len()` floats, a multiple of 32, and the scale
/// vectors hold one entry per 32.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn quantize(x: &[f32], a: &mut super::QActs) {
    for (i, blk) in x.chunks_exact(QBLOCK).enumerate() {
        // SAFETY: blk has 32 floats.
        let v: [__m256; 4] = std::array::from_fn(|j| unsafe { _mm256_loadu_ps(blk.as_ptr().add(8 * j)) });
        let (s, base, qs, h, l) = digits(v);
        for (dst, q) in [(&mut a.hi, h), (&mut a.lo, l)] {
            // SAFETY: block i has 32 digits in each buffer.
            unsafe { _mm256_storeu_si256(dst.as_mut_ptr().add(i * QBLOCK) as *mut __m256i, pack_i8(q)) };
        }
        a.s[i] = s;
        a.base[i] = base;
        a.qs[i] = qs;
    }
}

/// `acts::first_digits` with AVX2 (the same bytes and scales bit for bit): the first digit of each
/// 32-float block of `x` into `h`, its `(s, R, qs)` into `s`, `base`, `qs`.
///
/// # Safety
/// The CPU has AVX2 and FMA; `x` holds whole blocks, `h` as many bytes, the others one entry a block.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn first_digits(x: &[f32], h: &mut [i8], s: &mut [f32], base: &mut [i32], qs: &mut [f32]) {
    for (i, blk) in x.chunks_exact(QBLOCK).enumerate() {
        // SAFETY: blk has 32 floats.
        let v: [__m256; 4] = std::array::from_fn(|j| unsafe { _mm256_loadu_ps(blk.as_ptr().add(8 * j)) });
        let q;
        (s[i], base[i], qs[i], q) = first_digit(v);
        let out = &mut h[i * QBLOCK..][..QBLOCK];
        // SAFETY: `out` is 32 bytes.
        unsafe { _mm256_storeu_si256(out.as_mut_ptr() as *mut __m256i, pack_i8(q)) };
    }
}

/// The first digit of a 32-float block: `(s, R, qs, h)` as `quantize_block_one` computes them.
#[target_feature(enable = "avx2,fma")]
fn first_digit(v: [__m256; 4]) -> (f32, i32, f32, [__m256i; 4]) {
    let amax = match block_amax(v) {
        Ok(amax) => amax,
        Err((s, base, qs)) => return (s, base, qs, [_mm256_setzero_si256(); 4]),
    };
    let inv = _mm256_set1_ps(127.0 / amax);
    let h = v.map(|a| round_code(a, inv));
    let sum = _mm256_add_epi32(_mm256_add_epi32(h[0], h[1]), _mm256_add_epi32(h[2], h[3]));
    let s = amax / 127.0;
    (s, 1, s * hsum_i32(sum) as f32, h)
}

/// Both digits of a 32-float block: `(s, R, qs, h, l)` as `quantize_block` computes them.
#[target_feature(enable = "avx2,fma")]
fn digits(v: [__m256; 4]) -> (f32, i32, f32, [__m256i; 4], [__m256i; 4]) {
    let amax = match block_amax(v) {
        Ok(amax) => amax,
        Err((s, base, qs)) => return (s, base, qs, [_mm256_setzero_si256(); 4], [_mm256_setzero_si256(); 4]),
    };
    let s_h = _mm256_set1_ps(amax / 127.0);
    let h = v.map(|a| round_code(a, _mm256_set1_ps(127.0 / amax)));
    // e = v - s_h·h, rounded after the product as the scalar path does (no contraction).
    let e: [__m256; 4] = std::array::from_fn(|j| _mm256_sub_ps(v[j], _mm256_mul_ps(s_h, _mm256_cvtepi32_ps(h[j]))));
    let abs_sum = {
        let t = h.map(|q| _mm256_abs_epi32(q));
        let t = _mm256_add_epi32(_mm256_add_epi32(t[0], t[1]), _mm256_add_epi32(t[2], t[3]));
        hsum_i32(t) as f32
    };
    let base = super::digit_base(amax, max_abs(e), abs_sum);
    let units = 127.0 * base;
    let l = e.map(|a| round_code(a, _mm256_set1_ps(units / amax)));
    let sum4 = |q: [__m256i; 4]| _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    let s = _mm256_add_epi32(_mm256_mullo_epi32(sum4(h), _mm256_set1_epi32(base as i32)), sum4(l));
    let scale = amax / units;
    (scale, base as i32, scale * hsum_i32(s) as f32, h, l)
}

/// A block's `max|v|` when it has digits, else the `(s, R, qs)` of its all-zero digits: NaN for a NaN
/// or infinite value, zero below the smallest normal (as the scalar quantizers).
#[target_feature(enable = "avx2,fma")]
#[inline]
fn block_amax(v: [__m256; 4]) -> Result<f32, (f32, i32, f32)> {
    let unord = |a: __m256| _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_UNORD_Q>(a, a));
    if v.iter().any(|&a| unord(a) != 0) {
        return Err((f32::NAN, 0, f32::NAN));
    }
    let amax = max_abs(v);
    if amax.is_infinite() {
        return Err((f32::NAN, 0, f32::NAN));
    }
    if amax < f32::MIN_POSITIVE {
        return Err((0.0, 0, 0.0));
    }
    Ok(amax)
}

/// `Q(a·inv)`: nearest-even rounding, as `round_half_even` in acts.rs (|a·inv| <= ~127 < 2^22), clamped
/// to -127..=127, as i32 lanes.
#[target_feature(enable = "avx2,fma")]
#[inline]
fn round_code(a: __m256, inv: __m256) -> __m256i {
    let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(a, inv));
    _mm256_cvtps_epi32(_mm256_min_ps(
        _mm256_max_ps(r, _mm256_set1_ps(-127.0)),
        _mm256_set1_ps(127.0),
    ))
}

/// 32 digits in i32 lanes (-127..=127) as 32 bytes in order: i32 -> i16 -> i8 with saturation,
/// then the lanes back in order.
#[target_feature(enable = "avx2")]
#[inline]
fn pack_i8(q: [__m256i; 4]) -> __m256i {
    let q16 = [_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])];
    _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(q16[0], q16[1]),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7),
    )
}

/// Sum of the 8 i32 lanes.
#[target_feature(enable = "avx2,fma")]
fn hsum_i32(s: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b0100_1110>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b1011_0001>(s));
    _mm_cvtsi128_si32(s)
}

/// max |v| over 32 floats (no NaN among them).
#[target_feature(enable = "avx2,fma")]
fn max_abs(v: [__m256; 4]) -> f32 {
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    let m = v.map(|a| _mm256_and_ps(a, abs_mask));
    let m = _mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3]));
    let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps::<0b01>(m, m)))
}
