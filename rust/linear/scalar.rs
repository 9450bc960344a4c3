//! The portable tile: the spec every SIMD tile matches bit for bit.
//!
//! | variant | tile                       | layout it reads                                           |
//! |---------|----------------------------|-----------------------------------------------------------|
//! | scalar  | one row x one panel a step | `QActs::hi`, `lo` rows; each panel's 8-bit or 4-bit codes |
//!
//! The integer dots of a block are exact in i32; the float steps (`(R·Σc·h + Σc·l)` converted,
//! then `mul_add` by `d·s` and `m·qs`) run in the order the SIMD tiles run them. Tolerance: the
//! SIMD tiles equal it bit for bit, and it is within 1e-5 relative of a float64 sum over the
//! unpacked weights (tests.rs).

use super::product::Args;
use super::{PANEL, QBLOCK};

/// Portable tile: rows `r0..r0+mr`, panel `p` (the same float operations in the same order as
/// the SIMD tiles; `mul_add` is a correctly rounded libm `fmaf` here).
pub(super) fn tile_scalar(a: &Args, r0: usize, mr: usize, p: usize) {
    let (k, nb, n) = (a.w.k, a.w.blocks(), a.w.n);
    let (codes, nibbles) = (a.w.panel_codes(p), a.w.panel_nibbles(p));
    let scales = p * nb * 2 * PANEL; // this panel's first scale
    for r in r0..r0 + mr {
        let (hi, lo) = (&a.acts.hi[r * k..][..k], &a.acts.lo[r * k..][..k]);
        let mut acc = [0f32; PANEL];
        for b in 0..nb {
            // Integer dots of the panel's 16 rows with both digits, 4 k at a time as the layout
            // stores them (the loop over 64 contiguous code bytes vectorizes).
            let (mut dh, mut dl) = ([0i32; PANEL], [0i32; PANEL]);
            if nibbles {
                // One 64-byte line holds groups 2q (low nibbles) and 2q+1 (high nibbles).
                for q in b * QBLOCK / 8..(b + 1) * QBLOCK / 8 {
                    let c = &codes[q * 4 * PANEL..][..4 * PANEL];
                    let (xh, xl) = (&hi[q * 8..][..8], &lo[q * 8..][..8]);
                    for i in 0..PANEL {
                        for j in 0..4 {
                            let (c0, c1) = ((c[i * 4 + j] & 0x0f) as i32, (c[i * 4 + j] >> 4) as i32);
                            dh[i] += c0 * xh[j] as i32 + c1 * xh[4 + j] as i32;
                            dl[i] += c0 * xl[j] as i32 + c1 * xl[4 + j] as i32;
                        }
                    }
                }
            } else {
                for g in b * QBLOCK / 4..(b + 1) * QBLOCK / 4 {
                    let c = &codes[g * 4 * PANEL..][..4 * PANEL];
                    let (xh, xl) = (&hi[g * 4..][..4], &lo[g * 4..][..4]);
                    for i in 0..PANEL {
                        for j in 0..4 {
                            dh[i] += c[i * 4 + j] as i32 * xh[j] as i32;
                            dl[i] += c[i * 4 + j] as i32 * xl[j] as i32;
                        }
                    }
                }
            }
            let sc = a.w.scales.block(scales + b * 2 * PANEL);
            let rb = r * nb + b;
            let (s, base, qs) = (a.acts.s[rb], a.acts.base[rb], a.acts.qs[rb]);
            for i in 0..PANEL {
                let (d, m) = (sc[i], sc[PANEL + i]);
                acc[i] = ((base * dh[i] + dl[i]) as f32).mul_add(d * s, acc[i]);
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
