//! The portable tile: the spec every SIMD tile matches bit for bit.
//!
//! | variant | tile                       | layout it reads                                           |
//! |---------|----------------------------|-----------------------------------------------------------|
//! | scalar  | one row x one panel a step | `QActs::hi`, `lo` rows; a block of any layout as 8 bits   |
//!
//! The integer dots of a block are exact in i32; the float steps (`(R·Σc·h + Σc·l)` converted,
//! then `mul_add` by `d·s` and `m·qs`) run in the order the SIMD tiles run them. A split panel's
//! block (weight.rs) is two such dots, one a 16-wide half, each started from the half's
//! `QActs::halves` offset and folded in turn: `mul_add` by `d_0·s`, then by `d_1·s`. Tolerance: the
//! SIMD tiles equal it bit for bit, and it is within 1e-5 relative of a float64 sum over the
//! unpacked weights (tests.rs).

use super::product::Args;
use super::weight::{block_codes, LINE};
use super::{PANEL, QBLOCK};

/// Portable tile: rows `r0..r0+mr`, panel `p` (the same float operations in the same order as
/// the SIMD tiles; `mul_add` is a correctly rounded libm `fmaf` here).
pub(super) fn tile_scalar(a: &Args, r0: usize, mr: usize, p: usize) {
    let (k, nb, n) = (a.w.k, a.w.blocks(), a.w.n);
    let (codes, bits, split) = (a.w.panel_codes(p), a.w.panel_bits(p), a.w.panel_split(p));
    let scales = p * nb * 2 * PANEL; // this panel's first scale
    let mut block = [0u8; QBLOCK * PANEL];
    for r in r0..r0 + mr {
        let (hi, lo) = (&a.acts.hi[r * k..][..k], &a.acts.lo[r * k..][..k]);
        let mut acc = [0f32; PANEL];
        for b in 0..nb {
            // The block's codes as the 8-bit layout holds them: 8 lines of 16 rows × 4 k.
            let c: &[u8] = if bits == 8 {
                &codes[b * QBLOCK * PANEL..][..QBLOCK * PANEL]
            } else {
                block_codes(codes, bits, b, &mut block);
                &block
            };
            // Integer dots of the panel's 16 rows with both digits, 4 k at a time (the loop over
            // 64 contiguous code bytes vectorizes).
            // Split: [half] (k steps 0-3, 4-7); else the whole block in [0].
            let (mut dh, mut dl) = ([[0i32; PANEL]; 2], [[0i32; PANEL]; 2]);
            for g in 0..QBLOCK / 4 {
                let c = &c[g * LINE..][..LINE];
                let (xh, xl) = (&hi[b * QBLOCK + g * 4..][..4], &lo[b * QBLOCK + g * 4..][..4]);
                let h = usize::from(split && g >= QBLOCK / 8);
                for i in 0..PANEL {
                    for j in 0..4 {
                        dh[h][i] += c[i * 4 + j] as i32 * xh[j] as i32;
                        dl[h][i] += c[i * 4 + j] as i32 * xl[j] as i32;
                    }
                }
            }
            let sc = a.w.scales.block(scales + b * 2 * PANEL);
            let rb = r * nb + b;
            let (s, base, qs) = (a.acts.s[rb], a.acts.base[rb], a.acts.qs[rb]);
            for i in 0..PANEL {
                if split {
                    // w = d_h·(c - SPLIT_ZERO): each half's dot from its offset (exact in i32).
                    for (h, &d) in [sc[i], sc[PANEL + i]].iter().enumerate() {
                        let off = a.acts.halves[rb * 2 + h];
                        let dot = base.wrapping_mul(dh[h][i]).wrapping_add(dl[h][i].wrapping_add(off));
                        acc[i] = (dot as f32).mul_add(d * s, acc[i]);
                    }
                    continue;
                }
                let (d, m) = (sc[i], sc[PANEL + i]);
                acc[i] = ((base * dh[0][i] + dl[0][i]) as f32).mul_add(d * s, acc[i]);
                acc[i] = m.mul_add(qs, acc[i]);
            }
        }
        for (i, v) in acc.iter().enumerate().take(PANEL.min(n - p * PANEL)) {
            // SAFETY: r < m rows and column p*PANEL + i < n of the output (rows `a.ld` apart) the
            // caller sized; jobs write disjoint column ranges.
            unsafe { *a.out.add(r * a.ld + p * PANEL + i) = *v };
        }
    }
}
