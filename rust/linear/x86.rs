//! AVX-512 VNNI tile of the block-quantized linear layer (layout and formula: `mod.rs`).
//!
//! One tile = R rows × NP panels (16 columns each); each row is two activation digit streams.
//! Per 4-wide k step: NP 64-byte code vectors, 2R broadcasts of 4 activation bytes, 2R·NP
//! `vpdpbusd` (u8 codes × i8 activations, 64 MACs each) into int32 accumulators. Per 32-wide
//! block: the two digits' int32 sums are combined in integers (`R·Σc·h + Σc·l`, one `vpmulld`
//! and one add), converted and folded into the row's f32 accumulator with two FMAs (`d·s`,
//! `m·qs`) in the scalar path's order.
//!
//! | tile (R x NP)   | rows of a pass it takes | registers (two digits)                        |
//! |-----------------|-------------------------|-----------------------------------------------|
//! | 5..=8 x 1       | 5 to 8 (a tile a panel) | 2R int32 + R f32 accumulators, 1 code vector  |
//! | 3 x 2, 4 x 2    | 3, 4                    | 4R int32 + 2R f32, 2 code vectors             |
//! | 2 x 2, 1 x 2    | 2, 1                    | 8 int32 + 4 f32 (1 row: 2 x 8, even/odd groups) |
//!
//! All fit the 32 zmm with the block's scales (`TILE_ROWS` says why 8 rows). A pass's rows go to
//! one tile: each extra tile decodes the code vectors and folds the blocks again (a 7-row pass cut
//! 4 + 2 + 1 cost about what 12 rows do).
//!
//! One-digit activations (`QActs::digits` 1, every `l` 0 and `R` 1): the same tiles without the `l`
//! broadcasts and `vpdpbusd`, and the block's sum taken as `Σc·h` (`ONE`): the same integers.
//!
//! The tile reads the activations from `QActs::tiled` (`pack_tiled` in acts.rs): rows in groups of
//! 8, each 4-wide k step of a group holding its 8 rows' two digits side by side (64 bytes), so every
//! broadcast of a block sits at a constant offset from one pointer. Reading `hi` and `lo` row by
//! row took 16 row pointers for the 8-row tile, more than the general registers hold beside the
//! loop's own; tiled from 3 rows on (`TILED_MIN_ROWS`), the same bits either way. `quantize`
//! writes that layout itself for the VNNI tile (`Digits::Tiled`; no `hi` / `lo` rows, no copy).
//! The rows' scalars of a block (`s`, `qs`, `R`, split offsets) come the same way, from one entry of
//! `QActs::block_scalars` a group and block: read from the row-major vectors, each row took a
//! pointer of its own (spilled beside the loop's) and a bounds check a block.
//!
//! `quantize` (the activations' two digits) takes 16 blocks at a time: their max |x| and digit sums
//! reduced together by one shuffle tree (`reduce16`), the divisions and scale stores as vectors,
//! the codes packed and stored both digits at once (as `hi` and `lo` rows, or as the tiled steps);
//! a remainder of < 16 blocks goes block by block. The 16-block form is throughput-bound where the
//! block-by-block one was latency-bound (two horizontal reductions a block), so it gains most on a
//! core it does not share.
//!
//! Every code layout (`BITS`, weight.rs): an 8-bit panel gives one code vector a 64-byte load; a
//! 4-bit panel two a 64-byte line (its low nibbles hold k group 2q, its high ones 2q+1: an AND, or
//! a 16-bit shift and an AND, make the vector the 8-bit layout holds for that group); a 5- or 6-bit
//! panel takes the same nibbles and ORs in the step's high bits from its bit line, shifted to bit 4
//! (a shift where they are elsewhere, an AND, and one `vpternlogd` for `(nibbles & 0x0f) | high`).
//! The codes are the same u8 numbers in every layout, so the int32 dots, and with them the results,
//! are the same bits; a panel streams `BITS / 8` of the 8-bit bytes. The first row tiles of a pass
//! prefetch the code stream `PREFETCH_BLOCKS` blocks ahead (as the AVX2 tile does, 4 KiB there).

use std::arch::x86_64::*;

use super::{
    tile_order, tiled_step, Args, Muls, Scales, BASE_BUDGET, BASE_CAP, GRID_BLOCKS, PANEL, QBLOCK, TILED_ROWS,
};

/// How far ahead of the tile the code stream is prefetched, in blocks of the panel's own layout:
/// the same time ahead for every layout. For 4-bit panels (8 KiB) with the 8-row tiles, this served
/// batched decode better than the AVX2 tile's 4 KiB and than 2 KiB; one sequence was the same at
/// every distance, and 16 KiB gained nothing more. 8-bit panels (16 KiB): a one-row Q8_0 lm_head
/// on two threads streams about half again as fast as at 8 KiB (32 KiB adds little, one thread
/// gains nothing), which shortens a one-sequence decode step; batched decode is unchanged.
const PREFETCH_BLOCKS: usize = 32;

/// `v` shifted in its 16-bit lanes so that bit `from` (0..8, a constant) of each byte lands at bit 4
/// (the bits shifted in from a neighbour byte are masked off by the caller).
macro_rules! to_bit4 {
    ($v:expr, $from:expr) => {
        match $from {
            0 => _mm512_slli_epi16::<4>($v),
            1 => _mm512_slli_epi16::<3>($v),
            2 => _mm512_slli_epi16::<2>($v),
            3 => _mm512_slli_epi16::<1>($v),
            4 => $v,
            5 => _mm512_srli_epi16::<1>($v),
            6 => _mm512_srli_epi16::<2>($v),
            _ => _mm512_srli_epi16::<3>($v),
        }
    };
}

/// Step `$g` (a literal) of the block of `$bits`-bit codes at `$wb` as the 8-bit layout holds it
/// (64 bytes: 16 rows × 4 k); `$low4` = 0x0f and `$high` = the high bits' mask (0x10 for 5 bits,
/// 0x30 for 6) in every byte (in an `unsafe` block: AVX-512 F/BW and the block's `$bits` lines of
/// 64 bytes at `$wb`).
macro_rules! code_vector {
    ($bits:expr, $wb:expr, $g:literal, $low4:expr, $high:expr) => {{
        let line = |l: usize| _mm512_loadu_si512($wb.add(l * 64) as *const _);
        if $bits == 8 {
            line($g)
        } else {
            // Nibble line g/2: step g in its low nibbles when g is even, its high ones when odd.
            let nib = if $g % 2 == 0 {
                line($g / 2)
            } else {
                _mm512_srli_epi16::<4>(line($g / 2))
            };
            if $bits == 4 {
                _mm512_and_si512(nib, $low4)
            } else {
                // The high bits: 5-bit, bit g of line 4; 6-bit, bits 2(g%4).. of line 4 + g/4.
                let (hl, at) = if $bits == 5 {
                    (line(4), $g)
                } else {
                    (line(4 + $g / 4), 2 * ($g % 4))
                };
                let hi = _mm512_and_si512(to_bit4!(hl, at), $high);
                // (nib & 0x0f) | hi: A = nib, B = hi, C = low4 -> (0xf0 & 0xaa) | 0xcc.
                _mm512_ternarylogic_epi32::<0xec>(nib, hi, $low4)
            }
        }
    }};
}
pub(super) use code_vector;
pub(super) use to_bit4;

/// Sixteen grid multipliers `$m` (`Muls`) from index `$at`, as i32 (in an `unsafe` block: they exist).
macro_rules! muls16 {
    ($m:expr, $at:expr) => {
        match $m {
            Muls::U8(v) => _mm512_cvtepu8_epi32(_mm_loadu_si128(v.as_ptr().add($at) as *const __m128i)),
            Muls::I8(v) => _mm512_cvtepi8_epi32(_mm_loadu_si128(v.as_ptr().add($at) as *const __m128i)),
            Muls::I16(v) => _mm512_cvtepi16_epi32(_mm256_loadu_si256(v.as_ptr().add($at) as *const __m256i)),
        }
    };
}

/// Block `$b` (of `$nb` a panel) of panel `$p`'s scales `$scales` as f32: its 16 `d`, then its 16
/// `m` (split panels: `d_0`, `d_1`); integer scales as `Scales::at` computes them. A macro, not a
/// function: a call the compiler leaves out of line inside a tile makes every live zmm register
/// spill around it (all of them are caller-saved).
///
/// Safety (of the caller's `unsafe` block): AVX-512 F; panel `$p` and block `$b` are inside the scales.
macro_rules! block_scales {
    ($scales:expr, $p:expr, $nb:expr, $b:expr) => {{
        let blk = $p * $nb + $b;
        let at = blk * 2 * PANEL;
        match $scales {
            Scales::F32(v) => (
                _mm512_loadu_ps(v.as_ptr().add(at)),
                _mm512_loadu_ps(v.as_ptr().add(at + PANEL)),
            ),
            Scales::F16(v) => (
                _mm512_cvtph_ps(_mm256_loadu_si256(v.as_ptr().add(at) as *const __m256i)),
                _mm512_cvtph_ps(_mm256_loadu_si256(v.as_ptr().add(at + PANEL) as *const __m256i)),
            ),
            Scales::Sym { d, r } => {
                // `m = r·d` as `Scales::at` computes it.
                let dv = _mm512_cvtph_ps(_mm256_loadu_si256(d.as_ptr().add(blk * PANEL) as *const __m256i));
                (dv, _mm512_mul_ps(dv, _mm512_set1_ps(*r)))
            }
            Scales::Grid { base, dmul, mmul } => {
                // As the AVX2 `load_scales`: base·mul, the block's 16 multipliers of each kind and
                // its super-block's 16 + 16 bases.
                let bp = base.as_ptr().add(blk / GRID_BLOCKS * 2 * PANEL);
                let db = _mm512_cvtph_ps(_mm256_loadu_si256(bp as *const __m256i));
                let mb = _mm512_cvtph_ps(_mm256_loadu_si256(bp.add(PANEL) as *const __m256i));
                (
                    _mm512_mul_ps(db, _mm512_cvtepi32_ps(muls16!(dmul, blk * PANEL))),
                    _mm512_mul_ps(mb, _mm512_cvtepi32_ps(muls16!(mmul, blk * PANEL))),
                )
            }
        }
    }};
}
pub(super) use block_scales;
pub(super) use muls16;

/// Rows of the largest tile (one panel: 16 int32 sums + 8 f32 accumulators + 1 code vector). Each
/// code vector meets 16 `vpdpbusd` (the activations as embedded broadcasts), so the tile that
/// streams a panel in from memory computes 8 rows meanwhile; at 8 rows a pass is that one tile,
/// where 2-row tiles left 3 of 4 computing with the memory idle: batched decode and prefill run
/// faster with 8-row tiles than with 2- or 4-row ones.
const TILE_ROWS: usize = 8;
const _: () = assert!(
    TILE_ROWS == TILED_ROWS,
    "a tile's rows lie in one group of `QActs::tiled`"
);

/// The row tiles of rows `from..m` (`from` 0, or a multiple of 8 when the digits are tiled) and
/// panels `p0..p0+np`, every one of them in the `bits`-bit layout (4, 5, 6 or 8) and split or not
/// as `split` says (split: 6 bits).
///
/// # Safety
/// The CPU has AVX-512 F, BW and VNNI; `a` describes activations of `m` rows and an output of
/// `m × n` floats; `p0 + np <= panels`; panels `p0..p0+np` hold their codes in the `bits`-bit layout,
/// split as `split` says, and `QActs::halves` is filled when they are split.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn job(a: &Args, m: usize, from: usize, p0: usize, np: usize, bits: usize, split: bool) {
    tile_order(m - from, a.w.k, p0, np, TILE_ROWS, |r0, rows, ps, pn, first| {
        // The pass's rows (at most 8, in one group of `tiled`) in one tile: one panel a tile from
        // 5 rows on, both panels below. Cutting them 4 + 2 + 1 decoded each code vector and folded
        // each block once a tile.
        // SAFETY: forwarded from the caller; `tile_order` gives rows r0..r0+rows inside the
        // activations and panels ps..ps+pn (pn <= PASS_PANELS = 2) inside p0..p0+np, all of them
        // in the `bits`-bit layout.
        unsafe {
            let r = from + r0;
            match (bits, a.acts.digits == 1, split) {
                (_, false, true) => rows_tile::<6, false, true>(a, m, r, rows, ps, pn, first),
                (_, true, true) => rows_tile::<6, true, true>(a, m, r, rows, ps, pn, first),
                (4, false, _) => rows_tile::<4, false, false>(a, m, r, rows, ps, pn, first),
                (5, false, _) => rows_tile::<5, false, false>(a, m, r, rows, ps, pn, first),
                (6, false, _) => rows_tile::<6, false, false>(a, m, r, rows, ps, pn, first),
                (_, false, _) => rows_tile::<8, false, false>(a, m, r, rows, ps, pn, first),
                (4, true, _) => rows_tile::<4, true, false>(a, m, r, rows, ps, pn, first),
                (5, true, _) => rows_tile::<5, true, false>(a, m, r, rows, ps, pn, first),
                (6, true, _) => rows_tile::<6, true, false>(a, m, r, rows, ps, pn, first),
                (_, true, _) => rows_tile::<8, true, false>(a, m, r, rows, ps, pn, first),
            }
        }
    });
}

/// Rows `r..r+take` (`take` 1 to 8) times panels `ps..ps+pn` (`pn` = 1 or 2): one tile, or from
/// 5 rows on one tile a panel.
///
/// # Safety
/// As for `tile`, for each panel of the range.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn rows_tile<const BITS: usize, const ONE: bool, const SPLIT: bool>(
    a: &Args,
    m: usize,
    r: usize,
    take: usize,
    ps: usize,
    pn: usize,
    first: bool,
) {
    let g0 = r / TILED_ROWS * TILED_ROWS;
    let gstep = if a.acts.tiled.is_empty() {
        ROW_DIGITS
    } else {
        tiled_step(m, g0)
    };
    // A full group of 8 tiled rows is one pass's 8-row tile, a group of one row a one-row tile (only
    // the tiles that can run are built for each step: every tile is a large function).
    // SAFETY: forwarded from the caller.
    unsafe {
        match gstep {
            ROW_DIGITS => rows_tile_gs::<BITS, ONE, SPLIT, ROW_DIGITS>(a, r, take, ps, pn, first, gstep),
            64 if take == 8 => (ps..ps + pn).for_each(|p| tile::<8, 1, BITS, 64, ONE, SPLIT>(a, r, p, first, gstep)),
            8 if take == 1 && pn == 2 => tile::<1, 2, BITS, 8, ONE, SPLIT>(a, r, ps, first, gstep),
            8 if take == 1 => tile::<1, 1, BITS, 8, ONE, SPLIT>(a, r, ps, first, gstep),
            _ => rows_tile_gs::<BITS, ONE, SPLIT, 0>(a, r, take, ps, pn, first, gstep),
        }
    }
}

/// `GS` of a tile that reads the digits from the `hi` and `lo` rows (activations of fewer than
/// `TILED_MIN_ROWS` rows) rather than from `tiled` (no group step is 1).
const ROW_DIGITS: usize = 1;

/// `rows_tile` with the rows' group step `GS` known when it is not 0 (full groups and single rows),
/// or the row layout (`ROW_DIGITS`).
///
/// # Safety
/// As for `rows_tile`; `gstep` is the rows' group step, and `GS` is 0, `gstep`, or `ROW_DIGITS` when
/// `tiled` is empty.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn rows_tile_gs<const BITS: usize, const ONE: bool, const SPLIT: bool, const GS: usize>(
    a: &Args,
    r: usize,
    take: usize,
    ps: usize,
    pn: usize,
    first: bool,
    gstep: usize,
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        match (take, pn) {
            (8, _) => (ps..ps + pn).for_each(|p| tile::<8, 1, BITS, GS, ONE, SPLIT>(a, r, p, first, gstep)),
            (7, _) => (ps..ps + pn).for_each(|p| tile::<7, 1, BITS, GS, ONE, SPLIT>(a, r, p, first, gstep)),
            (6, _) => (ps..ps + pn).for_each(|p| tile::<6, 1, BITS, GS, ONE, SPLIT>(a, r, p, first, gstep)),
            (5, _) => (ps..ps + pn).for_each(|p| tile::<5, 1, BITS, GS, ONE, SPLIT>(a, r, p, first, gstep)),
            (4, 2) => tile::<4, 2, BITS, GS, ONE, SPLIT>(a, r, ps, first, gstep),
            (4, _) => tile::<4, 1, BITS, GS, ONE, SPLIT>(a, r, ps, first, gstep),
            (3, 2) => tile::<3, 2, BITS, GS, ONE, SPLIT>(a, r, ps, first, gstep),
            (3, _) => tile::<3, 1, BITS, GS, ONE, SPLIT>(a, r, ps, first, gstep),
            (2, 2) => tile::<2, 2, BITS, GS, ONE, SPLIT>(a, r, ps, first, gstep),
            (2, _) => tile::<2, 1, BITS, GS, ONE, SPLIT>(a, r, ps, first, gstep),
            (_, 2) => tile::<1, 2, BITS, GS, ONE, SPLIT>(a, r, ps, first, gstep),
            (_, _) => tile::<1, 1, BITS, GS, ONE, SPLIT>(a, r, ps, first, gstep),
        }
    }
}

/// One tile: rows `r0..r0+R` times panels `p0..p0+NP` (in the `BITS`-bit layout); `prefetch`:
/// prefetch the panels' code stream ahead; the activations' group step is `GS`, or `gs` when `GS`
/// is 0, and `ROW_DIGITS` reads the `hi` / `lo` rows. `SPLIT`: split panels (weight.rs), each
/// block's k steps 0-3 and 4-7 summed from the half's `QActs::halves` offset and folded in turn.
///
/// # Safety
/// As for `job`; rows `r0..r0+R` are inside the activations and `p0 + NP <= panels`; the group
/// step is that of the rows' group of `tiled` (unless `ROW_DIGITS`, when `tiled` is empty).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn tile<
    const R: usize,
    const NP: usize,
    const BITS: usize,
    const GS: usize,
    const ONE: bool,
    const SPLIT: bool,
>(
    a: &Args,
    r0: usize,
    p0: usize,
    prefetch: bool,
    gs: usize,
) {
    const _: () = assert!(
        QBLOCK == 32 && TILED_ROWS == 8,
        "the unrolled block below is 8 steps of 4"
    );
    debug_assert!(
        r0 % TILED_ROWS + R <= TILED_ROWS,
        "a tile's rows lie in one group of `tiled`"
    );
    let (k, n) = (a.w.k, a.w.n);
    let nb = k / QBLOCK;
    const { assert!(BITS == 4 || BITS == 5 || BITS == 6 || BITS == 8) };
    let low4 = _mm512_set1_epi8(0x0f);
    // Where a 5- or 6-bit code's high bits go.
    let high = _mm512_set1_epi8(if BITS == 5 { 0x10 } else { 0x30 });
    // Code bytes of one 32-wide block of one panel: BITS lines of 64.
    let block_bytes = BITS * 64;
    // SAFETY: panels p0..p0+NP exist (caller): their codes start at their offsets.
    let wp: [*const u8; NP] = std::array::from_fn(|p| unsafe { a.w.codes.as_ptr().add(a.w.code_at[p0 + p]) });
    // Rows r0..r0+R lie in one group of `tiled` (`tile_order` starts passes at multiples of 8 and
    // `job` cuts them 8, 4, 2, 1).
    let g0 = r0 / TILED_ROWS * TILED_ROWS;
    let rows = GS == ROW_DIGITS;
    let gstep = match GS {
        0 => gs,
        ROW_DIGITS => 0,
        _ => GS,
    };
    debug_assert!(rows || gstep == tiled_step(a.acts.tiled.len() / (2 * k), g0));
    // Tiled: the group's base plus the first row's 8 bytes. Rows: row r0 of `hi` and of `lo`.
    // Only addresses here (`wrapping_add`); each read below says why it is in bounds.
    let (xt, xh, xl) = if rows {
        let (h, l) = (a.acts.hi.as_ptr(), a.acts.lo.as_ptr());
        (std::ptr::null(), h.wrapping_add(r0 * k), l.wrapping_add(r0 * k))
    } else {
        let t = a.acts.tiled.as_ptr();
        (
            t.wrapping_add(g0 * 2 * k + (r0 - g0) * 8),
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    // The rows' scalars: entry b from here, the rows at `ro..ro + R` of its arrays (one address a
    // block, as the digits; only an address until read).
    let bs = a.acts.block_scalars.as_ptr().wrapping_add(g0 / TILED_ROWS * nb);
    let ro = r0 - g0;
    let mut acc = [[_mm512_setzero_ps(); NP]; R];
    for b in 0..nb {
        // SAFETY: entry (g0 / 8)·nb + b of `block_scalars`, which `run_job` checked holds
        // m.div_ceil(8)·nb (g0 < m, b < nb).
        let e = unsafe { &*bs.add(b) };
        // Row r of the tile in one of the entry's arrays.
        // SAFETY: ro + r < 8 (the rows lie in one group: the contract).
        let row_of = |v: &[i32; TILED_ROWS], r: usize| unsafe { *v.get_unchecked(ro + r) };
        // SAFETY: as `row_of`.
        let rowf_of = |v: &[f32; TILED_ROWS], r: usize| unsafe { *v.get_unchecked(ro + r) };
        if prefetch {
            for p in 0..NP {
                a.w.scales.prefetch((p0 + p) * nb + b);
            }
            for w in wp {
                // Only an address: a prefetch never faults (past the panel's end it fetches the
                // next one's start).
                let at = w.wrapping_add((b + PREFETCH_BLOCKS) * block_bytes);
                for line in (0..block_bytes).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(line) as *const i8);
                }
            }
        }
        // This block's codes and activations: 8 steps of 4 k, 64 bytes apart in the 8-bit codes
        // (the others: two steps a nibble line, then the bit lines), `gstep` in the activations.
        // SAFETY: block b < nb of each panel (k*PANEL*BITS/8 bytes from its offset).
        let wb: [*const u8; NP] = wp.map(|w| unsafe { w.add(b * block_bytes) });
        let xb: *const i8 = xt.wrapping_add(b * QBLOCK / 4 * gstep);
        // Rows: block b of each row's `hi` and `lo` (only addresses; unused when tiled).
        let xr: [[*const i8; 2]; R] = std::array::from_fn(|r| [xh, xl].map(|x| x.wrapping_add(r * k + b * QBLOCK)));
        // [row][digit][panel]; a single row keeps the even and odd k groups' sums apart (`ib`)
        // so that 4·NP dependency chains, not 2·NP, hide `vpdpbusd`'s latency; the two are added
        // at the block's end (exact integer sums: the same dots).
        let mut ia = [[[_mm512_setzero_si512(); NP]; 2]; R];
        let mut ib = [[[_mm512_setzero_si512(); NP]; 2]; R];
        // Split: each half's sums start from its offset (`QActs::halves`, filled for split panels
        // (contract)) in the digit that is added unscaled (`l`, or `h` alone for one digit).
        macro_rules! start_half {
            ($h:literal) => {{
                for (r, row) in ia.iter_mut().enumerate() {
                    let off = _mm512_set1_epi32(row_of(&e.halves[$h], r));
                    *row = [[_mm512_setzero_si512(); NP]; 2];
                    row[if ONE { 0 } else { 1 }] = [off; NP];
                }
                if R == 1 {
                    ib = [[[_mm512_setzero_si512(); NP]; 2]; R];
                }
            }};
        }
        if SPLIT {
            start_half!(0);
        }
        // Row `r` (a literal; none when the tile has fewer rows) of a k step of the tiled digits,
        // whose 8 bytes a row start at `xg`: its digits' dots with the panels' code vectors `w`,
        // each broadcast the instruction's memory operand at a constant offset from `xg` (pinned in
        // `asm!`: left to the compiler, a block's broadcasts were at times all loaded up front and
        // spilled, which halved the 8-row tile).
        macro_rules! tiled_dots {
            ($sums:expr, $w:expr, $xg:expr, $r:literal) => {
                if let Some(row) = $sums.get_mut($r) {
                    for (p, w) in $w.iter().enumerate() {
                        // SAFETY: step g of row r0+r's digits, 4 bytes each at offsets 8r and 8r + 4
                        // from `xg` inside the rows' group of `tiled` (`run_job` checked 2·m·k
                        // bytes; the group holds step g); AVX-512 VNNI is enabled here.
                        unsafe {
                            std::arch::asm!(
                                "vpdpbusd {acc}, {w}, dword ptr [{x} + {off}]{{1to16}}",
                                acc = inout(zmm_reg) row[0][p],
                                w = in(zmm_reg) *w,
                                x = in(reg) $xg,
                                off = const $r * 8,
                                options(pure, readonly, nostack, preserves_flags),
                            );
                            if !ONE {
                                std::arch::asm!(
                                    "vpdpbusd {acc}, {w}, dword ptr [{x} + {off}]{{1to16}}",
                                    acc = inout(zmm_reg) row[1][p],
                                    w = in(zmm_reg) *w,
                                    x = in(reg) $xg,
                                    off = const $r * 8 + 4,
                                    options(pure, readonly, nostack, preserves_flags),
                                );
                            }
                        }
                    }
                }
            };
        }
        // `tiled_dots` for the `hi` / `lo` rows: row `r`'s digits of step `g` (literals) at constant
        // offsets 4g from the row's block in each (`xr`).
        macro_rules! rows_dots {
            ($sums:expr, $w:expr, $g:literal, $r:literal) => {
                if let Some(row) = $sums.get_mut($r) {
                    for (d, digit) in row.iter_mut().enumerate().take(if ONE { 1 } else { 2 }) {
                        for (acc, w) in digit.iter_mut().zip(&$w) {
                            // SAFETY: step g of block b of row r0+r in its `hi` / `lo` row (rows
                            // r0..r0+R of m, `run_job` checked m·k bytes); AVX-512 VNNI is enabled.
                            unsafe {
                                std::arch::asm!(
                                    "vpdpbusd {acc}, {w}, dword ptr [{x} + {off}]{{1to16}}",
                                    acc = inout(zmm_reg) *acc,
                                    w = in(zmm_reg) *w,
                                    x = in(reg) xr[$r][d],
                                    off = const $g * 4,
                                    options(pure, readonly, nostack, preserves_flags),
                                )
                            };
                        }
                    }
                }
            };
        }
        // One 4-wide k step `g` (a literal: every offset below is a constant).
        macro_rules! step {
            ($g:literal) => {{
                // SAFETY: the block's BITS lines (see `wb`).
                let wv: [__m512i; NP] = std::array::from_fn(|p| unsafe { code_vector!(BITS, wb[p], $g, low4, high) });
                let sums = if R == 1 && $g % 2 == 1 { &mut ib } else { &mut ia };
                if !rows {
                    // The tiled digits: step g of the group at `xg`, each row's 8 bytes at a
                    // constant offset from it.
                    let xg = xb.wrapping_add($g * gstep);
                    tiled_dots!(sums, wv, xg, 0);
                    tiled_dots!(sums, wv, xg, 1);
                    tiled_dots!(sums, wv, xg, 2);
                    tiled_dots!(sums, wv, xg, 3);
                    tiled_dots!(sums, wv, xg, 4);
                    tiled_dots!(sums, wv, xg, 5);
                    tiled_dots!(sums, wv, xg, 6);
                    tiled_dots!(sums, wv, xg, 7);
                } else {
                    rows_dots!(sums, wv, $g, 0);
                    rows_dots!(sums, wv, $g, 1);
                    rows_dots!(sums, wv, $g, 2);
                    rows_dots!(sums, wv, $g, 3);
                    rows_dots!(sums, wv, $g, 4);
                    rows_dots!(sums, wv, $g, 5);
                    rows_dots!(sums, wv, $g, 6);
                    rows_dots!(sums, wv, $g, 7);
                }
            }};
        }
        // The sums so far folded into `acc`: the whole block, or (split) half `h`, with the block's
        // scales (`d`, `m`; split: `d_0`, `d_1`).
        macro_rules! fold {
            ($h:literal) => {{
                if R == 1 {
                    for (row, odd) in ia.iter_mut().zip(&ib) {
                        for (digit, od) in row.iter_mut().zip(odd) {
                            for (s, o) in digit.iter_mut().zip(od) {
                                *s = _mm512_add_epi32(*s, *o);
                            }
                        }
                    }
                }
                for p in 0..NP {
                    // SAFETY: block b of panel p0+p: 2*PANEL scales inside the scales.
                    let (dv, mv) = unsafe { block_scales!(&a.w.scales, p0 + p, nb, b) };
                    for r in 0..R {
                        let s = _mm512_set1_ps(rowf_of(&e.s, r));
                        // R·Σc·h + Σc·l: exact in i32 (mod.rs).
                        let dot = if ONE {
                            ia[r][0][p] // R = 1, Σc·l = 0: the same integer
                        } else {
                            let base = _mm512_set1_epi32(row_of(&e.base, r));
                            _mm512_add_epi32(_mm512_mullo_epi32(ia[r][0][p], base), ia[r][1][p])
                        };
                        if SPLIT {
                            let d = if $h == 0 { dv } else { mv };
                            acc[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, s), acc[r][p]);
                        } else {
                            let qs = _mm512_set1_ps(rowf_of(&e.qs, r));
                            acc[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dv, s), acc[r][p]);
                            acc[r][p] = _mm512_fmadd_ps(mv, qs, acc[r][p]);
                        }
                    }
                }
            }};
        }
        step!(0);
        step!(1);
        step!(2);
        step!(3);
        if SPLIT {
            fold!(0);
            start_half!(1);
        }
        step!(4);
        step!(5);
        step!(6);
        step!(7);
        if SPLIT {
            fold!(1);
        } else {
            fold!(0);
        }
    }
    for p in 0..NP {
        let col = (p0 + p) * PANEL;
        let valid = PANEL.min(n - col);
        let mask: __mmask16 = if valid == PANEL { 0xffff } else { (1u16 << valid) - 1 };
        for (r, row) in acc.iter().enumerate() {
            // SAFETY: row r0+r < m, columns col..col+valid < n of the output (rows `a.ld` apart); this
            // job alone writes these columns.
            unsafe { _mm512_mask_storeu_ps(a.out.add((r0 + r) * a.ld + col), mask, row[p]) };
        }
    }
}

/// `quantize_acts` for whole rows with AVX-512 (same operations, same results bit for bit):
/// 16 blocks at a time (`quantize16`), the rest one by one.
///
/// # Safety
/// The CPU has AVX-512 F and BW; `x` holds whole rows (of `k` for `Digits::Tiled { k }`), a
/// multiple of 32 floats; `a` is those rows' buffers: `hi` and `lo` one byte a float for
/// `Digits::Rows`, `tiled` two for `Digits::Tiled`, and the scale vectors one entry per 32.
///
/// `one`: the first digit only, as `quantize_one` computes it (`l` = 0, `R` = 1, `qs` = `s·Σh`;
/// `R` = 0 for the blocks it gives 0 or NaN scales): the same `h` and `s` as two digits.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn quantize(x: &[f32], a: &mut super::ActsMut, to: Digits, one: bool) {
    let groups = x.len() / (16 * QBLOCK);
    for g in 0..groups {
        let (xg, at) = (&x[g * 16 * QBLOCK..][..16 * QBLOCK], g * 16);
        // SAFETY: blocks 16g..16g+16 are inside x and the digit and scale buffers.
        unsafe {
            if one {
                quantize16::<true>(xg, a, at, to)
            } else {
                quantize16::<false>(xg, a, at, to)
            }
        };
    }
    // SAFETY: forwarded.
    unsafe { quantize_each(x, a, groups * 16, to, one) };
}

/// Where `quantize` puts the digits: `hi` and `lo` (every tile reads them), or only `tiled` for
/// rows of `k` (the VNNI tile's layout, `QActs::pack_tiled`; `hi` and `lo` stay untouched).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Digits {
    Rows,
    Tiled {
        k: usize,
    },
    /// `hi` and `lo` with the first `full` rows (a multiple of 16) in the AMX tile's blocks
    /// (`QActs::block_at`), the rest as rows.
    Amx {
        k: usize,
        full: usize,
    },
}

impl Digits {
    /// Where block `i` (row-major over the rows' blocks) starts in `hi` and `lo` (not `Tiled`).
    #[inline(always)]
    fn block_at(self, i: usize) -> usize {
        match self {
            Digits::Amx { k, full } => super::acts::block_at(i / (k / QBLOCK), i % (k / QBLOCK), k, full),
            _ => i * QBLOCK,
        }
    }
}

/// The two digits of block `bi` of row `row` (of `m` rows of `k`) into `a.tiled`: `steps[j]` = the
/// 4 `hi` bytes of k step j of the block, then its 4 `lo` bytes (little-endian), to step j of the
/// row in its group. The callers keep `row` and `bi` (no division a block).
///
/// # Safety
/// `a.tiled` holds `2·m·k` bytes, `row < m` and `bi < k / 32`.
#[inline(always)]
unsafe fn store_tiled(a: &mut super::ActsMut, k: usize, m: usize, (row, bi): (usize, usize), steps: &[u64; 8]) {
    let g0 = row / TILED_ROWS * TILED_ROWS;
    let gstep = tiled_step(m, g0);
    let at = g0 * 2 * k + (row - g0) * 8 + bi * (QBLOCK / 4) * gstep;
    debug_assert!(row < m && at + 7 * gstep + 8 <= a.tiled.len());
    let p = a.tiled.as_mut_ptr();
    for (j, &q) in steps.iter().enumerate() {
        // SAFETY: step bi·8 + j < k/4 of the row's group (2·rows·k bytes from g0·2k), 8 bytes at
        // the row's offset inside the step (contract).
        unsafe { std::ptr::write_unaligned(p.add(at + j * gstep) as *mut u64, q) };
    }
}

/// The per-block form, for blocks `from..` of `x`.
///
/// # Safety
/// As for `quantize`.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn quantize_each(x: &[f32], a: &mut super::ActsMut, from: usize, to: Digits, one: bool) {
    for (i, blk) in x.chunks_exact(QBLOCK).enumerate().skip(from) {
        // SAFETY: blk has 32 floats.
        let v = unsafe { [_mm512_loadu_ps(blk.as_ptr()), _mm512_loadu_ps(blk.as_ptr().add(16))] };
        let (s, base, qs, h, l) = if one { digits::<true>(v) } else { digits::<false>(v) };
        let mut bytes = [[0i8; QBLOCK]; 2];
        for (dst, q) in bytes.iter_mut().zip([h, l]) {
            // SAFETY: dst holds 32 bytes.
            unsafe {
                _mm_storeu_si128(dst.as_mut_ptr() as *mut __m128i, _mm512_cvtsepi32_epi8(q[0]));
                _mm_storeu_si128(dst.as_mut_ptr().add(16) as *mut __m128i, _mm512_cvtsepi32_epi8(q[1]));
            }
        }
        match to {
            Digits::Rows | Digits::Amx { .. } => {
                let at = to.block_at(i);
                a.hi[at..][..QBLOCK].copy_from_slice(&bytes[0]);
                a.lo[at..][..QBLOCK].copy_from_slice(&bytes[1]);
            }
            Digits::Tiled { k } => {
                let word =
                    |d: &[i8; QBLOCK], j: usize| u32::from_le_bytes(std::array::from_fn(|b| d[4 * j + b] as u8)) as u64;
                let steps: [u64; 8] = std::array::from_fn(|j| word(&bytes[0], j) | word(&bytes[1], j) << 32);
                let (m, nb) = (a.tiled.len() / (2 * k), k / QBLOCK);
                // SAFETY: block i is inside the rows `tiled` was sized for (caller).
                unsafe { store_tiled(a, k, m, (i / nb, i % nb), &steps) };
            }
        }
        a.s[i] = s;
        a.base[i] = base;
        a.qs[i] = qs;
    }
}

/// Sixteen vectors to one: lane `LANE_BLOCK[j]` of the result combines (by `op`, exact and
/// commutative: max or integer add) the 16 lanes of `v[j]`. Four levels of two shuffles and one op
/// per pair: 45 operations where 16 separate horizontal reductions take ~130, all independent.
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) fn reduce16(v: [__m512; 16], op: impl Fn(__m512, __m512) -> __m512) -> __m512 {
    // [a.lo256 | b.lo256] op [a.hi256 | b.hi256]: 8 partials of a, then 8 of b.
    let l1: [__m512; 8] = std::array::from_fn(|i| {
        let (a, b) = (v[2 * i], v[2 * i + 1]);
        op(_mm512_shuffle_f32x4::<0x44>(a, b), _mm512_shuffle_f32x4::<0xee>(a, b))
    });
    // 128-bit quarters 0, 2 of a, b with 1, 3: 4 partials of each of 4 vectors.
    let l2: [__m512; 4] = std::array::from_fn(|i| {
        let (a, b) = (l1[2 * i], l1[2 * i + 1]);
        op(_mm512_shuffle_f32x4::<0x88>(a, b), _mm512_shuffle_f32x4::<0xdd>(a, b))
    });
    // Within 128-bit lanes: elements 0, 1 of a, b with 2, 3.
    let l3: [__m512; 2] = std::array::from_fn(|i| {
        let (a, b) = (l2[2 * i], l2[2 * i + 1]);
        op(_mm512_shuffle_ps::<0x44>(a, b), _mm512_shuffle_ps::<0xee>(a, b))
    });
    let (a, b) = (l3[0], l3[1]);
    op(_mm512_shuffle_ps::<0x88>(a, b), _mm512_shuffle_ps::<0xdd>(a, b))
}

/// Which input vector of `reduce16` each result lane holds (checked by a cargo test).
pub(super) const LANE_BLOCK: [u32; 16] = [0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15];

/// `reduce16` with the lanes put back in input order: lane j = the reduction of `v[j]`.
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) fn reduce16_ordered(v: [__m512; 16], op: impl Fn(__m512, __m512) -> __m512) -> __m512 {
    let r = reduce16(v, op);
    // Lane j takes the lane that holds vector j: LANE_BLOCK's inverse, which is LANE_BLOCK itself
    // (a 4x4 transpose).
    // SAFETY: LANE_BLOCK holds 16 u32.
    let idx = unsafe { _mm512_loadu_si512(LANE_BLOCK.as_ptr() as *const _) };
    _mm512_permutexvar_ps(idx, r)
}

/// Max of |x| per block, and which blocks hold a NaN, for 16 blocks of 2 vectors each.
#[target_feature(enable = "avx512f")]
#[inline]
fn amax16(v: &[[__m512; 2]; 16]) -> (__m512, u16) {
    let mut nan = 0u16;
    let m: [__m512; 16] = std::array::from_fn(|b| {
        let [x0, x1] = v[b];
        if _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x0, x0) | _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x1, x1) != 0 {
            nan |= 1 << b;
        }
        _mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1))
    });
    (reduce16_ordered(m, |a, b| _mm512_max_ps(a, b)), nan)
}

/// One digit of 16 blocks: `(Σq, Σ|q|, q)` per block (lane b of the sums), `q` = `v · inv` (lane
/// b of `inv` for block b) rounded to nearest-even and clamped to ±127, as `quantize_block`
/// computes it; `skip` blocks (bit b) get zeros. `ABS`: compute `Σ|q|` (else zeros).
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
fn codes16<const ABS: bool>(v: &[[__m512; 2]; 16], inv: __m512, skip: u16) -> (__m512i, __m512i, [[__m512i; 2]; 16]) {
    let (lo, hi) = (_mm512_set1_ps(-127.0), _mm512_set1_ps(127.0));
    let zero = _mm512_setzero_si512();
    let mut q = [[zero; 2]; 16];
    let sums: [__m512; 16] = std::array::from_fn(|b| {
        if skip & (1 << b) != 0 {
            return _mm512_setzero_ps();
        }
        let iv = _mm512_permutexvar_ps(_mm512_set1_epi32(b as i32), inv);
        // Clamped, then converted with nearest-even rounding embedded in the conversion: the same
        // integers as rounding first (the bounds are integers), one instruction fewer a vector.
        let r = v[b].map(|x| {
            _mm512_cvt_roundps_epi32::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_min_ps(
                _mm512_max_ps(_mm512_mul_ps(x, iv), lo),
                hi,
            ))
        });
        q[b] = r;
        _mm512_castsi512_ps(_mm512_add_epi32(r[0], r[1]))
    });
    let add =
        |a: __m512, b: __m512| _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
    let sum = reduce16_ordered(sums, add);
    let abs = if ABS {
        let parts = q.map(|r| _mm512_castsi512_ps(_mm512_add_epi32(_mm512_abs_epi32(r[0]), _mm512_abs_epi32(r[1]))));
        _mm512_castps_si512(reduce16_ordered(parts, add))
    } else {
        _mm512_setzero_si512()
    };
    (_mm512_castps_si512(sum), abs, q)
}

/// `quantize_each` for blocks `at..at+16` (`x` = their 512 floats); `ONE`: the first digit only.
///
/// # Safety
/// As for `quantize`; blocks `at..at+16` are inside the digit and scale buffers.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn quantize16<const ONE: bool>(x: &[f32], a: &mut super::ActsMut, at: usize, to: Digits) {
    debug_assert!(x.len() == 16 * QBLOCK && at + 16 <= a.qs.len());
    // SAFETY: x holds 16 blocks of 32 floats.
    let v: [[__m512; 2]; 16] = std::array::from_fn(|b| unsafe {
        [
            _mm512_loadu_ps(x.as_ptr().add(b * QBLOCK)),
            _mm512_loadu_ps(x.as_ptr().add(b * QBLOCK + 16)),
        ]
    });
    let (amax, nan) = amax16(&v);
    let inf = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(amax, _mm512_set1_ps(f32::INFINITY));
    let tiny = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(amax, _mm512_set1_ps(f32::MIN_POSITIVE));
    let skip = nan | inf | tiny;
    // Correctly rounded divisions, lane by lane as the scalar ones.
    let inv_h = _mm512_div_ps(_mm512_set1_ps(127.0), amax);
    let s_h = _mm512_div_ps(amax, _mm512_set1_ps(127.0));
    let (sum_h, abs_h, h) = if ONE {
        codes16::<false>(&v, inv_h, skip)
    } else {
        codes16::<true>(&v, inv_h, skip)
    };
    let zero = _mm512_setzero_si512();
    let (base, sum_l, l) = if ONE {
        // R = 1 (0 where skipped), no second digit.
        (_mm512_maskz_mov_ps(!skip, _mm512_set1_ps(1.0)), zero, [[zero; 2]; 16])
    } else {
        // e = v - s_h·h, rounded after the product (no contraction).
        let err: [[__m512; 2]; 16] = std::array::from_fn(|b| {
            let sb = _mm512_permutexvar_ps(_mm512_set1_epi32(b as i32), s_h);
            [0, 1].map(|j| _mm512_sub_ps(v[b][j], _mm512_mul_ps(sb, _mm512_cvtepi32_ps(h[b][j]))))
        });
        // R = `digit_base` lane by lane (the skipped blocks' lanes, whatever they hold, are zeroed
        // below); 127·R exact.
        let (emax, _) = amax16(&err);
        let floor = |x: __m512| _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(x);
        let base = _mm512_min_ps(
            _mm512_min_ps(
                floor(_mm512_div_ps(amax, emax)),
                floor(_mm512_div_ps(_mm512_set1_ps(BASE_BUDGET), _mm512_cvtepi32_ps(abs_h))),
            ),
            _mm512_set1_ps(BASE_CAP),
        );
        let base = _mm512_maskz_mov_ps(!skip, base);
        let inv_l = _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(127.0), base), amax);
        let (sum_l, _, l) = codes16::<false>(&err, inv_l, skip);
        (base, sum_l, l)
    };
    let units = _mm512_mul_ps(_mm512_set1_ps(127.0), base);
    let base_i = _mm512_cvtps_epi32(base);
    // Both digits of a block in one 64-byte vector: i32 -> i16 -> i8 packs (exact: |q| <= 127), whose
    // 128-bit lane k holds dwords h[4k..], h[16+4k..], l[4k..], l[16+4k..]; the 4x4 dword transpose
    // puts h's 32 bytes, then l's, in order.
    // SAFETY: LANE_BLOCK holds 16 u32.
    // For `Digits::Tiled`, dword pairs (h[4j..], l[4j..]) for k steps j = 0..8 instead: h[4j..] is
    // dword 4j of `packed` for j < 4 and 4(j-4)+1 after, l[4j..] two dwords on.
    let order = match to {
        Digits::Rows | Digits::Amx { .. } => LANE_BLOCK,
        Digits::Tiled { .. } => [0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15],
    };
    // SAFETY: order holds 16 u32.
    let order = unsafe { _mm512_loadu_si512(order.as_ptr() as *const _) };
    // Digits::Tiled: the rows `tiled` holds, and block `at`'s row and place in it, stepped below.
    let (rows, mut pos) = match to {
        Digits::Tiled { k } => (a.tiled.len() / (2 * k), (at / (k / QBLOCK), at % (k / QBLOCK))),
        Digits::Rows | Digits::Amx { .. } => (0, (0, 0)),
    };
    for b in 0..16 {
        let i = at + b;
        let packed = _mm512_packs_epi16(
            _mm512_packs_epi32(h[b][0], h[b][1]),
            _mm512_packs_epi32(l[b][0], l[b][1]),
        );
        let both = _mm512_permutexvar_epi32(order, packed);
        match to {
            // SAFETY: block i has 32 codes in each digit buffer.
            Digits::Rows | Digits::Amx { .. } => unsafe {
                let at = to.block_at(i);
                _mm256_storeu_si256(a.hi.as_mut_ptr().add(at) as *mut __m256i, _mm512_castsi512_si256(both));
                _mm256_storeu_si256(
                    a.lo.as_mut_ptr().add(at) as *mut __m256i,
                    _mm512_extracti64x4_epi64::<1>(both),
                );
            },
            Digits::Tiled { k } => {
                let mut steps = [0u64; 8];
                // SAFETY: steps holds 64 bytes; block i (row `pos.0`, block `pos.1` of it) is
                // inside the rows `tiled` was sized for.
                unsafe {
                    _mm512_storeu_si512(steps.as_mut_ptr() as *mut _, both);
                    store_tiled(a, k, rows, pos, &steps);
                }
                pos.1 += 1;
                if pos.1 == k / QBLOCK {
                    pos = (pos.0 + 1, 0);
                }
            }
        }
    }
    // One digit: s = a/127, as `quantize_block_one` divides (units = 127 there).
    let s = _mm512_div_ps(amax, units);
    let s = _mm512_mask_blend_ps(tiny, s, _mm512_setzero_ps());
    let s = _mm512_mask_blend_ps(nan | inf, s, _mm512_set1_ps(f32::NAN));
    // s · (R·Σh + Σl): the integer sum is exact in f32 (< 2^24), one rounded product.
    let sum = _mm512_add_epi32(_mm512_mullo_epi32(sum_h, base_i), sum_l);
    let qs = _mm512_mul_ps(s, _mm512_cvtepi32_ps(sum));
    // SAFETY: entries at..at+16 of the three scale vectors exist (debug-asserted above).
    unsafe {
        _mm512_storeu_ps(a.s.as_mut_ptr().add(at), s);
        _mm512_storeu_si512(a.base.as_mut_ptr().add(at) as *mut _, base_i);
        _mm512_storeu_ps(a.qs.as_mut_ptr().add(at), qs);
    }
}

/// Both digits of a 32-float block: `(s, R, qs, h, l)` as `quantize_block` computes them; `ONE`:
/// the first only, `(s, 1, qs, h, 0)` as `quantize_block_one` does.
#[target_feature(enable = "avx512f,avx512bw")]
fn digits<const ONE: bool>(v: [__m512; 2]) -> (f32, i32, f32, [__m512i; 2], [__m512i; 2]) {
    let zero = [_mm512_setzero_si512(); 2];
    let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v[0], v[0]) | _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v[1], v[1]);
    let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
    if nan != 0 || amax.is_infinite() {
        return (f32::NAN, 0, f32::NAN, zero, zero);
    }
    if amax < f32::MIN_POSITIVE {
        return (0.0, 0, 0.0, zero, zero);
    }
    let (lo, hi) = (_mm512_set1_ps(-127.0), _mm512_set1_ps(127.0));
    // Nearest-even conversion (the default rounding mode), as `round_half_even` in acts.rs.
    let code = |x: __m512, inv: __m512| {
        _mm512_cvtps_epi32(_mm512_min_ps(
            _mm512_max_ps(_mm512_roundscale_ps::<0x08>(_mm512_mul_ps(x, inv)), lo),
            hi,
        ))
    };
    let s_h = _mm512_set1_ps(amax / 127.0);
    let h = v.map(|x| code(x, _mm512_set1_ps(127.0 / amax)));
    if ONE {
        let s = amax / 127.0;
        let sum = _mm512_reduce_add_epi32(_mm512_add_epi32(h[0], h[1]));
        return (s, 1, s * sum as f32, h, zero);
    }
    // e = v - s_h·h, rounded after the product (no contraction).
    let e = [0, 1].map(|j| _mm512_sub_ps(v[j], _mm512_mul_ps(s_h, _mm512_cvtepi32_ps(h[j]))));
    let emax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(e[0]), _mm512_abs_ps(e[1])));
    let abs_sum = _mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_abs_epi32(h[0]), _mm512_abs_epi32(h[1]))) as f32;
    let base = super::digit_base(amax, emax, abs_sum);
    let units = 127.0 * base;
    let l = e.map(|x| code(x, _mm512_set1_ps(units / amax)));
    let sum = _mm512_reduce_add_epi32(_mm512_add_epi32(
        _mm512_mullo_epi32(_mm512_add_epi32(h[0], h[1]), _mm512_set1_epi32(base as i32)),
        _mm512_add_epi32(l[0], l[1]),
    ));
    let s = amax / units;
    (s, base as i32, s * sum as f32, h, l)
}
