//! AMX tile of the block-quantized linear layer (formula and layouts: `mod.rs`): products of at
//! least `AMX_MIN_ROWS` rows (batched decode, prefill) with one-digit activations, of weights
//! without split panels, on CPUs whose AMX-INT8 the OS enables (`runtime::amx_int8`).
//!
//! One `tdpbsud` multiplies 16 activation rows by a 16-column panel over a 32-wide block: the A
//! tile is the block's digits of the 16 rows, which the quantizer lays out for it (`QActs`'s AMX
//! layout: a group of 16 rows keeps each block's 16 × 32 bytes together, one contiguous load), and
//! the B tile is the block's 8 code lines as the panels hold them (16 columns × 4 k a line: the
//! layout AMX wants for its second operand). The 16 × 16 int32 sums are the integers `vpdpbusd`
//! adds up (exact: mod.rs); stored to a buffer, they are folded into the 16 rows' f32
//! accumulators with the VNNI tile's operations in its order (`fma(cvt(dot), d·s, acc)` and
//! `fma(m, qs, acc)`), so the results are the scalar tile's bits.
//!
//! Where it does not run: a block's fold costs about what its tile instructions do and the two did
//! not overlap on the Xeon measured, so the gain is what `vpdpbusd` costs beside the fold. With one
//! digit the tile ran 1.1-1.35x the VNNI one on 4- and 8-bit panels from 32 rows on; with two
//! digits (twice the tile stores and a multiply a row in the fold) 0.9-1.1x; split panels (two
//! scales a block) 0.8-0.9x; 16 rows (one tile a panel) 0.8-0.9x. Those stay on the VNNI tile.
//!
//! Codes are copied once a panel and row block into a per-thread, cache-line aligned buffer, those
//! narrower than 8 bits widened (`code_vector!`, as the VNNI tile does each step): a tile row that
//! straddles two cache lines loads several times slower. Rows go in blocks whose digits stay in L2
//! (`ROW_BLOCK_BYTES`), panels one at a time inside a block, 16 rows a tile; the first tile of a
//! panel prefetches the next panel's codes. Rows below a multiple of 16 go to the VNNI tile.

use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::RefCell;

use super::x86::{self, code_vector, muls16, to_bit4};
use super::{Args, Muls, Scales, GRID_BLOCKS, PANEL, QBLOCK};

/// Activation rows of one AMX tile.
const AMX_ROWS: usize = super::acts::AMX_GROUP;

/// Rows from which a product runs on the AMX tile (with 16, one tile a panel, it ran slower than
/// the VNNI tile).
pub(super) const AMX_MIN_ROWS: usize = 32;

/// A row block's size, counted at two bytes a value (its one digit takes half): a block's rows meet
/// every panel of the job while their digits stay in L2.
const ROW_BLOCK_BYTES: usize = 1 << 20;

/// Bytes of a block of one panel widened to 8 bits (8 lines of 64).
const WIDE_BLOCK: usize = QBLOCK * PANEL;

/// 64 code bytes on a cache line of their own (a tile row that straddles two lines loads several
/// times slower).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct CodeLine([u8; 64]);

thread_local! {
    /// A panel's codes in the 8-bit layout, per thread (the jobs of a product run on several).
    static WIDE: RefCell<Vec<CodeLine>> = const { RefCell::new(Vec::new()) };
}

/// The tile configuration (palette 1): tile 0 a block of the activations' digits (16 rows × 32
/// bytes), 2 a block's codes (8 lines of 64 bytes), 4 their sums (16 rows × 16 int32).
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

impl TileConfig {
    fn new() -> Self {
        let mut c = [0u8; 64];
        c[0] = 1;
        let kb = QBLOCK as u8;
        let shapes: [(u8, u8); 5] = [(16, kb), (0, 0), (kb / 4, 64), (0, 0), (16, 64)];
        for (t, &(rows, colsb)) in shapes.iter().enumerate() {
            c[16 + 2 * t] = colsb;
            c[48 + t] = rows;
        }
        TileConfig(c)
    }
}

/// Blocks of 16 × 16 int32 sums as tiles store them.
#[repr(C, align(64))]
struct Sums([i32; 2 * AMX_ROWS * PANEL]);

/// Rows `0..m` of one-digit activations and panels `p0..p0+np` (in the `bits`-bit layout, none of
/// them split): the AMX tile for the rows in whole tiles, the VNNI tile for the rest.
///
/// # Safety
/// As for `x86::job`; the CPU runs AMX-TILE and AMX-INT8 with this process's permission
/// (`runtime::amx_int8`); the digits are `hi` and `lo` with their first `m / 16 · 16` rows in the
/// AMX layout (`QActs::amx_rows`, `acts::block_at`).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn job(a: &Args, m: usize, p0: usize, np: usize, bits: usize) {
    let full = m / AMX_ROWS * AMX_ROWS;
    debug_assert_eq!(a.acts.amx_rows, full, "the digits' first rows are in the AMX layout");
    debug_assert_eq!(a.acts.digits, 1, "`amx_for` takes one-digit products only");
    if full > 0 {
        // SAFETY: forwarded from the caller.
        unsafe {
            match bits {
                4 => rows::<4>(a, full, p0, np),
                5 => rows::<5>(a, full, p0, np),
                6 => rows::<6>(a, full, p0, np),
                _ => rows::<8>(a, full, p0, np),
            }
        }
    }
    if full < m {
        // SAFETY: forwarded; rows full..m of `hi` and `lo` are row-major (`block_at`).
        unsafe { x86::job(a, m, full, p0, np, bits, false) };
    }
}

/// Rows `0..m` (a multiple of `AMX_ROWS`) × panels `p0..p0+np` on the AMX tile.
///
/// # Safety
/// As for `job`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn rows<const BITS: usize>(a: &Args, m: usize, p0: usize, np: usize) {
    let k = a.w.k;
    let nb = k / QBLOCK;
    let cfg = TileConfig::new();
    // SAFETY: AMX-TILE is usable (caller); the configuration is 64 valid bytes (palette 1, every
    // used tile within 16 rows × 64 bytes, the others zero).
    unsafe { asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly, preserves_flags)) };
    let block = (ROW_BLOCK_BYTES / (2 * k) / AMX_ROWS * AMX_ROWS).max(AMX_ROWS);
    WIDE.with_borrow_mut(|wide| {
        if wide.len() < nb * WIDE_BLOCK / 64 {
            wide.resize(nb * WIDE_BLOCK / 64, CodeLine([0; 64]));
        }
        let wp = wide.as_mut_ptr() as *mut u8;
        let mut rs = 0;
        while rs < m {
            let re = (rs + block).min(m);
            for p in p0..p0 + np {
                // SAFETY: panel p exists (p < p0 + np <= panels): its nb blocks of BITS lines start at
                // its offset; `wide` holds nb · WIDE_BLOCK bytes.
                let codes = unsafe { a.w.codes.as_ptr().add(a.w.code_at[p]) };
                // SAFETY: as above.
                unsafe { widen::<BITS>(codes, nb, wp) };
                // The next panel's codes (only an address: a prefetch never faults).
                let next = codes.wrapping_add(nb * BITS * 64);
                for r0 in (rs..re).step_by(AMX_ROWS) {
                    // SAFETY: rows r0..r0+16 <= m of the digits; panel p's nb widened blocks at `wp`.
                    unsafe { tile::<BITS>(a, r0, p, wp, (r0 == rs && p + 1 < p0 + np).then_some(next)) };
                }
            }
            rs = re;
        }
    });
    // SAFETY: releases the tile state this function configured.
    unsafe { asm!("tilerelease", options(nostack, nomem, preserves_flags)) };
}

/// The `nb` blocks of `BITS`-bit codes at `src` widened to the 8-bit layout at `dst` (8-bit ones
/// copied: `dst` is aligned, the weight's codes need not be).
///
/// # Safety
/// AVX-512 F/BW; `src` holds `nb · BITS · 64` bytes and `dst` `nb · WIDE_BLOCK`.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn widen<const BITS: usize>(src: *const u8, nb: usize, dst: *mut u8) {
    let low4 = _mm512_set1_epi8(0x0f);
    let high = _mm512_set1_epi8(if BITS == 5 { 0x10 } else { 0x30 });
    for b in 0..nb {
        // SAFETY: block b < nb of `src` and of `dst` (caller).
        unsafe {
            let (wb, out) = (src.add(b * BITS * 64), dst.add(b * WIDE_BLOCK));
            macro_rules! step {
                ($g:literal) => {
                    _mm512_storeu_si512(
                        out.add($g * 64) as *mut _,
                        code_vector!(BITS, wb, $g, low4, high),
                    )
                };
            }
            step!(0);
            step!(1);
            step!(2);
            step!(3);
            step!(4);
            step!(5);
            step!(6);
            step!(7);
        }
    }
}

/// Rows `r0..r0+16` × panel `p`, its codes in the 8-bit layout at `w`; `next`: the next panel's
/// codes, prefetched block by block. Software-pipelined: block `b - 1`'s sums, stored the step
/// before, are folded while block `b`'s are computed.
///
/// # Safety
/// As for `job`; the tile configuration of `rows` is loaded; rows `r0..r0+16` are inside the
/// digits (in the AMX layout) and `w` holds the panel's `k / 32` blocks of 8 lines, 64-byte aligned.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn tile<const BITS: usize>(a: &Args, r0: usize, p: usize, w: *const u8, next: Option<*const u8>) {
    let (k, n) = (a.w.k, a.w.n);
    let nb = k / QBLOCK;
    // The sums of two blocks (by parity), 16 × 16 int32 each, 1 KiB apart.
    let mut sums = Sums([0; 2 * AMX_ROWS * PANEL]);
    let sp = sums.0.as_mut_ptr();
    let at = |parity: usize| sp.wrapping_add(parity * AMX_ROWS * PANEL);
    // Group r0's digits in the AMX layout (`acts::block_at`: block b's 16 rows of 32 bytes from byte
    // b·512 of the group) and its rows' block scalars. Only addresses; each read below is in
    // bounds: rows r0..r0+16 of m, `m·k` digit bytes and `m·nb` scalars.
    let xh = a.acts.hi.as_ptr().wrapping_add(r0 * k);
    let (ss, qss) = (
        a.acts.s.as_ptr().wrapping_add(r0 * nb),
        a.acts.qs.as_ptr().wrapping_add(r0 * nb),
    );
    let mut acc = [_mm512_setzero_ps(); AMX_ROWS];
    for b in 0..=nb {
        if b > 0 {
            // Block pb's sums folded as the VNNI tile folds them (before block b's tile
            // instructions, whose stores younger loads would wait for).
            let pb = b - 1;
            // SAFETY: block pb of panel p: 2·PANEL scales inside the scales.
            let (dv, mv) = unsafe { x86::block_scales!(&a.w.scales, p, nb, pb) };
            for (r, acc) in acc.iter_mut().enumerate() {
                // SAFETY: rows r0..r0+16 of the scalars, and row r of block pb's stored sums.
                unsafe {
                    let rb = r * nb + pb;
                    let (s, qs) = (_mm512_set1_ps(*ss.add(rb)), _mm512_set1_ps(*qss.add(rb)));
                    // One digit: the block's dot is Σc·h (R = 1, l = 0; mod.rs).
                    let dot = _mm512_load_si512(at(pb % 2).add(r * PANEL) as *const _);
                    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dv, s), *acc);
                    *acc = _mm512_fmadd_ps(mv, qs, *acc);
                }
            }
        }
        if b == nb {
            break;
        }
        if let Some(nx) = next {
            for line in 0..BITS {
                _mm_prefetch::<_MM_HINT_T0>(nx.wrapping_add((b * BITS + line) * 64) as *const i8);
            }
        }
        let (xb, wb) = (b * AMX_ROWS * QBLOCK, w.wrapping_add(b * WIDE_BLOCK));
        // SAFETY: tiles 0, 2 and 4 are configured (`rows`); tile 0 reads block b's 16 rows of 32
        // bytes, 32 apart, of the group's `hi`, tile 2 its 8 lines of 64 code bytes from `wb`; the
        // sums go to 16 × 64 bytes at `at(b % 2)` inside `sums`.
        unsafe {
            asm!(
                "tileloadd tmm0, [{xh} + {row}*1]",
                "tileloadd tmm2, [{w} + {line}*1]",
                "tilezero tmm4",
                "tdpbsud tmm4, tmm0, tmm2",
                "tilestored [{sh} + {line}*1], tmm4",
                xh = in(reg) xh.wrapping_add(xb),
                w = in(reg) wb,
                row = in(reg) QBLOCK,
                line = in(reg) 64usize,
                sh = in(reg) at(b % 2),
                options(nostack, preserves_flags),
            );
        }
    }
    let col = p * PANEL;
    let valid = PANEL.min(n - col);
    let mask: __mmask16 = if valid == PANEL { 0xffff } else { (1u16 << valid) - 1 };
    for (r, row) in acc.iter().enumerate() {
        // SAFETY: row r0+r < m, columns col..col+valid < n of the output (rows `a.ld` apart); this
        // job alone writes these columns.
        unsafe { _mm512_mask_storeu_ps(a.out.add((r0 + r) * a.ld + col), mask, *row) };
    }
}
