//! Prefill and chunked prefill: one tile (keys `t..t+n` of one KV head, widened once to f32 by the
//! body in `mod.rs`, `[n, head_dim]` in segments) against every query of the unit for that head.
//!
//! | kernel       | when                                                  | queries                      |
//! |--------------|-------------------------------------------------------|------------------------------|
//! | `tile_heads` | AVX2 build; AVX-512 build with head_dim % 16 != 0 or a soft cap | per query row, blocks of 4/2/1 group heads through the micro-kernels (zmm when head_dim % 16 == 0) |
//! | `lanes_tile` | AVX-512 build, head_dim % 16 == 0, no soft cap        | 16 a zmm (`qt`: `[head_dim, lw]` transposed once per unit) |
//!
//! `lanes_tile` computes a key's logits for 16 queries as one zmm summed over head_dim (4 partial
//! sums, `lane_logits`), masks and runs the online softmax 16 queries a vector, then `acc += p v`
//! 4 queries x 4 column vectors a block (`lane_pv`).
//! Tolerance: 2e-5 from the scalar path (`attention/tests.rs`, every ISA); see `mod.rs`.

use std::arch::x86_64::*;

use super::common::{exp_sub, scale_in_place, vmax};
use super::decode::Pf;
use super::micro::{pv_block, pv_block_z, qk_block, qk_block_z};
use super::{Seg, F32, TILE};
use crate::attention::{Ctx, State, Unit};
use crate::simd::x86::exp256;

/// One tile (keys t..t+n of KV head h, in segments) against every query vector of head h.
///
/// # Safety
/// Each segment's `k`, `v` point to `n * d` elements of type DT; the segments' n sum to `n`;
/// `ctx` validated; head_dim % 8 == 0.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) unsafe fn tile_heads<const DT: u8, const WIDE: bool>(
    ctx: &Ctx,
    u: &Unit,
    st: &mut State,
    qbuf: &[f32],
    segs: &[Seg],
    t: usize,
    n: usize,
    h: usize,
    s: &mut [f32; 4 * TILE],
) {
    let (g, d) = (ctx.group, ctx.shape.head_dim);
    let pr = u.per_row(g);
    let es = if DT == F32 { 4 } else { 2 };
    // The AVX-512 build runs the logits and `acc += p v` with zmm columns when they tile head_dim,
    // as decode does.
    let zmm = WIDE && d % 16 == 0;
    for i in 0..u.row1 - u.row0 {
        let (lo, hi) = ctx.key_range(u.pos0 + i, t, t + n);
        if lo >= hi {
            continue;
        }
        let (j0, j1) = (lo - t, hi - t);
        // The group's query vectors of this row share the key range: blocks of 4/2/1.
        let mut hg = 0;
        while hg < g {
            let m0 = i * pr + (h - u.h0) * g + hg;
            let mb = match g - hg {
                r if r >= 4 => 4,
                3 => 3,
                2 => 2,
                _ => 1,
            };
            let q = &qbuf[m0 * d..(m0 + mb) * d];
            let sm = &mut s[..mb * TILE];
            // Logits of the rows j0..j1 of the tile, segment by segment, into columns 0..j1-j0.
            let mut at = 0;
            for sg in segs {
                let (a, b) = (at.max(j0), (at + sg.n).min(j1));
                if a < b {
                    // SAFETY: rows a-at..b-at of the segment are inside it (a >= at, b <= at+n);
                    // columns a-j0..b-j0 are inside 0..TILE; q and sm are sized above; the zmm
                    // kernels run only when WIDE, i.e. in `attend_avx512` (AVX-512 F detected and enabled).
                    unsafe {
                        let kp = sg.k.add((a - at) * d * es);
                        match (mb, WIDE) {
                            (4, true) if zmm => qk_block_z::<4, 4, DT>(q, kp, b - a, d, sm, a - j0, Pf::NONE),
                            (3, true) if zmm => qk_block_z::<3, 4, DT>(q, kp, b - a, d, sm, a - j0, Pf::NONE),
                            (2, true) if zmm => qk_block_z::<2, 8, DT>(q, kp, b - a, d, sm, a - j0, Pf::NONE),
                            (_, true) if zmm => qk_block_z::<1, 16, DT>(q, kp, b - a, d, sm, a - j0, Pf::NONE),
                            (4, false) => qk_block::<4, 2, DT>(q, kp, b - a, d, sm, a - j0, Pf::NONE),
                            (3, false) => qk_block::<3, 2, DT>(q, kp, b - a, d, sm, a - j0, Pf::NONE),
                            (2, false) => qk_block::<2, 4, DT>(q, kp, b - a, d, sm, a - j0, Pf::NONE),
                            (_, false) => qk_block::<1, 8, DT>(q, kp, b - a, d, sm, a - j0, Pf::NONE),
                            (4, true) => qk_block::<4, 4, DT>(q, kp, b - a, d, sm, a - j0, Pf::NONE),
                            (3, true) => qk_block::<3, 4, DT>(q, kp, b - a, d, sm, a - j0, Pf::NONE),
                            (2, true) => qk_block::<2, 8, DT>(q, kp, b - a, d, sm, a - j0, Pf::NONE),
                            (_, true) => qk_block::<1, 16, DT>(q, kp, b - a, d, sm, a - j0, Pf::NONE),
                        }
                    }
                }
                at += sg.n;
            }
            for r in 0..mb {
                let m = m0 + r;
                let sj = &mut sm[r * TILE..r * TILE + (j1 - j0)];
                if let Some(c) = ctx.params.soft_cap {
                    for x in sj.iter_mut() {
                        *x = c * (*x / c).tanh();
                    }
                }
                let tmax = vmax(sj);
                let old = st.max[m];
                if tmax > old {
                    if old != f32::NEG_INFINITY {
                        let alpha = (old - tmax).exp();
                        scale_in_place(&mut st.acc[m * d..(m + 1) * d], alpha);
                        st.sum[m] *= alpha;
                    }
                    st.max[m] = tmax;
                }
                st.sum[m] += exp_sub(sj, st.max[m]);
            }
            let acc = &mut st.acc[m0 * d..(m0 + mb) * d];
            let mut at = 0;
            for sg in segs {
                let (a, b) = (at.max(j0), (at + sg.n).min(j1));
                if a < b {
                    // SAFETY: as for the logits; acc is [mb, d].
                    unsafe {
                        let vp = sg.v.add((a - at) * d * es);
                        match (mb, WIDE) {
                            (4, true) if zmm => pv_block_z::<4, 4, DT>(sm, a - j0, vp, b - a, d, acc, Pf::NONE),
                            (3, true) if zmm => pv_block_z::<3, 4, DT>(sm, a - j0, vp, b - a, d, acc, Pf::NONE),
                            (2, true) if zmm => pv_block_z::<2, 8, DT>(sm, a - j0, vp, b - a, d, acc, Pf::NONE),
                            (_, true) if zmm => pv_block_z::<1, 8, DT>(sm, a - j0, vp, b - a, d, acc, Pf::NONE),
                            (4, false) => pv_block::<4, 2, DT>(sm, a - j0, vp, b - a, d, acc, Pf::NONE),
                            (3, false) => pv_block::<3, 2, DT>(sm, a - j0, vp, b - a, d, acc, Pf::NONE),
                            (2, false) => pv_block::<2, 4, DT>(sm, a - j0, vp, b - a, d, acc, Pf::NONE),
                            (_, false) => pv_block::<1, 8, DT>(sm, a - j0, vp, b - a, d, acc, Pf::NONE),
                            (4, true) => pv_block::<4, 4, DT>(sm, a - j0, vp, b - a, d, acc, Pf::NONE),
                            (3, true) => pv_block::<3, 4, DT>(sm, a - j0, vp, b - a, d, acc, Pf::NONE),
                            (2, true) => pv_block::<2, 8, DT>(sm, a - j0, vp, b - a, d, acc, Pf::NONE),
                            (_, true) => pv_block::<1, 16, DT>(sm, a - j0, vp, b - a, d, acc, Pf::NONE),
                        }
                    }
                }
                at += sg.n;
            }
            hg += mb;
        }
    }
}

/// `exp` of 16 lanes (`exp256` on each half).
///
/// # Safety
/// The CPU supports AVX-512 F (and AVX2 + FMA).
#[inline(always)]
unsafe fn exp512(x: __m512) -> __m512 {
    let lo = exp256(_mm512_castps512_ps256(x));
    let hi = exp256(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(x))));
    _mm512_castpd_ps(_mm512_insertf64x4::<1>(
        _mm512_castpd256_pd512(_mm256_castps_pd(lo)),
        _mm256_castps_pd(hi),
    ))
}

/// Prefill tile with the queries as vector lanes (AVX-512, head_dim % 16 == 0, no soft cap): keys
/// `t..t+n` of KV head `h` (`k`, `v`: `[n, d]` f32), against this head's `rows * group` queries,
/// 16 a vector (`qt`: `[d, lw]`, query `i * group + j` = row `i`, group head `j`). A key's logits
/// for 16 queries are one zmm summed over head_dim from `qt` and the key's broadcast elements (no
/// horizontal sums); the causal / sliding-window mask, the running max, the rescale and the sum
/// run 16 queries a vector; `acc += p v` takes 4 queries x 4 column vectors a block with the
/// probabilities broadcast. `sl` holds the tile's `[n, 16]` logits, then probabilities.
///
/// # Safety
/// The CPU supports AVX-512 F (and AVX2 + FMA + F16C); `qt.len() == d * lw`, `lw >= rows * group`,
/// `k.len() == v.len() == n * d` with `n <= TILE`, `sl.len() >= TILE * 16`; `ctx` validated.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) unsafe fn lanes_tile(
    ctx: &Ctx,
    u: &Unit,
    st: &mut State,
    qt: &[f32],
    lw: usize,
    k: &[f32],
    v: &[f32],
    t: usize,
    h: usize,
    sl: &mut [f32],
) {
    let (g, d) = (ctx.group, ctx.shape.head_dim);
    let pr = u.per_row(g);
    let n = k.len() / d;
    let nq = (u.row1 - u.row0) * g;
    assert!(qt.len() == d * lw && lw >= nq && v.len() == n * d && n <= TILE && sl.len() >= TILE * 16);
    let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
    for q0 in (0..nq).step_by(16) {
        let lanes = 16.min(nq - q0);
        // Each lane's visible keys, relative to t: [lo, hi) (an empty range for padding lanes),
        // its state index m, and the group's key span.
        let (mut lo, mut hi, mut ms) = ([0i32; 16], [0i32; 16], [0usize; 16]);
        let (mut jlo, mut jhi) = (n, 0);
        for l in 0..lanes {
            let q = q0 + l;
            let (i, j) = (q / g, q % g);
            let (a, b) = ctx.key_range(u.pos0 + i, t, t + n);
            ms[l] = i * pr + (h - u.h0) * g + j;
            if a < b {
                (lo[l], hi[l]) = ((a - t) as i32, (b - t) as i32);
                jlo = jlo.min(a - t);
                jhi = jhi.max(b - t);
            }
        }
        if jlo >= jhi {
            continue;
        }
        // SAFETY: the arrays hold 16 i32.
        let (lov, hiv) = unsafe {
            (
                _mm512_loadu_si512(lo.as_ptr() as *const _),
                _mm512_loadu_si512(hi.as_ptr() as *const _),
            )
        };
        let qp = qt.as_ptr().wrapping_add(q0);
        // Logits of keys jlo..jhi, 4 keys a pass (16 FMA chains sharing the `qt` loads), masked.
        let mut tmax = ninf;
        let mut j = jlo;
        while j < jhi {
            // SAFETY: q0 + 16 <= lw (qt's columns), keys j.. inside k, rows j.. inside sl.
            unsafe {
                if j + 4 <= jhi {
                    lane_logits::<4>(qp, lw, k, d, j, (lov, hiv), sl, &mut tmax);
                    j += 4;
                } else {
                    lane_logits::<1>(qp, lw, k, d, j, (lov, hiv), sl, &mut tmax);
                    j += 1;
                }
            }
        }
        // Online softmax, 16 queries a vector (padding lanes: max -inf, sum 0, never stored).
        let (mut old, mut sum) = ([f32::NEG_INFINITY; 16], [0f32; 16]);
        for l in 0..lanes {
            (old[l], sum[l]) = (st.max[ms[l]], st.sum[ms[l]]);
        }
        // SAFETY: 16 f32 each.
        let (oldv, sumv) = unsafe { (_mm512_loadu_ps(old.as_ptr()), _mm512_loadu_ps(sum.as_ptr())) };
        let newv = _mm512_max_ps(oldv, tmax);
        // A lane with nothing visible yet keeps -inf; exp(x - 0) of its -inf logits is 0.
        let none = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(newv, ninf);
        let base = _mm512_mask_blend_ps(none, newv, _mm512_setzero_ps());
        // SAFETY: AVX-512 F (contract).
        let alpha = unsafe { exp512(_mm512_sub_ps(oldv, base)) };
        let mut psum = _mm512_setzero_ps();
        for j in jlo..jhi {
            // SAFETY: j < n rows of 16 in sl.
            unsafe {
                let pv = exp512(_mm512_sub_ps(_mm512_loadu_ps(sl.as_ptr().add(j * 16)), base));
                _mm512_storeu_ps(sl.as_mut_ptr().add(j * 16), pv);
                psum = _mm512_add_ps(psum, pv);
            }
        }
        let (mut nw, mut al, mut ns) = ([0f32; 16], [0f32; 16], [0f32; 16]);
        // SAFETY: 16 f32 each.
        unsafe {
            _mm512_storeu_ps(nw.as_mut_ptr(), newv);
            _mm512_storeu_ps(al.as_mut_ptr(), alpha);
            _mm512_storeu_ps(ns.as_mut_ptr(), _mm512_fmadd_ps(sumv, alpha, psum));
        }
        for l in 0..lanes {
            let m = ms[l];
            if old[l] != f32::NEG_INFINITY && al[l] != 1.0 {
                scale_in_place(&mut st.acc[m * d..(m + 1) * d], al[l]);
            }
            (st.max[m], st.sum[m]) = (nw[l], ns[l]);
        }
        // acc[m] += sum_j p[j][lane] v[j]: 4 lanes x 4 column vectors a block (16 chains).
        let mut l0 = 0;
        while l0 < lanes {
            let lb = 4.min(lanes - l0);
            let mut c = 0;
            while c < d {
                let wide = c + 64 <= d;
                // SAFETY: lanes l0..l0+lb hold state rows ms[..] of st.acc ([nq, d]), columns
                // c..c+64 (or c..c+16) inside d; rows jlo..jhi of sl and v inside n.
                unsafe {
                    match (lb, wide) {
                        (4, true) => lane_pv::<4, 4>(st, &ms[l0..], d, c, v, sl, l0, jlo, jhi),
                        (3, true) => lane_pv::<3, 4>(st, &ms[l0..], d, c, v, sl, l0, jlo, jhi),
                        (2, true) => lane_pv::<2, 4>(st, &ms[l0..], d, c, v, sl, l0, jlo, jhi),
                        (_, true) => lane_pv::<1, 4>(st, &ms[l0..], d, c, v, sl, l0, jlo, jhi),
                        (4, false) => lane_pv::<4, 1>(st, &ms[l0..], d, c, v, sl, l0, jlo, jhi),
                        (3, false) => lane_pv::<3, 1>(st, &ms[l0..], d, c, v, sl, l0, jlo, jhi),
                        (2, false) => lane_pv::<2, 1>(st, &ms[l0..], d, c, v, sl, l0, jlo, jhi),
                        (_, false) => lane_pv::<1, 1>(st, &ms[l0..], d, c, v, sl, l0, jlo, jhi),
                    }
                }
                c += if wide { 64 } else { 16 };
            }
            l0 += lb;
        }
    }
}

/// Logits of keys `j..j+KB` for the 16 queries whose transposed vectors start at `qp` (row stride
/// `lw`), masked to each lane's `[lo, hi)` (else -inf), stored as rows of 16 in `sl`, folded into
/// `tmax`.
///
/// # Safety
/// AVX-512 F; `qp` points to `d` rows of 16 readable f32 at stride `lw`; `j + KB <= k.len() / d`;
/// `sl` holds `(j + KB) * 16` f32.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn lane_logits<const KB: usize>(
    qp: *const f32,
    lw: usize,
    k: &[f32],
    d: usize,
    j: usize,
    (lov, hiv): (__m512i, __m512i),
    sl: &mut [f32],
    tmax: &mut __m512,
) {
    debug_assert!((j + KB) * d <= k.len() && sl.len() >= (j + KB) * 16);
    let kp = k.as_ptr();
    // PARTS partial sums a key over head_dim (element c into part c % PARTS), added pairwise at
    // the end: chains of d / PARTS products, as short as the lane-parallel kernels' (one chain of d
    // put the SmolLM2 logits past LOGIT_TOL from the float64 oracle).
    const PARTS: usize = 4;
    let mut acc = [[_mm512_setzero_ps(); PARTS]; KB];
    for c0 in (0..d).step_by(PARTS) {
        for p in 0..PARTS {
            let c = c0 + p;
            // SAFETY: c < d rows of qt (d % 16 == 0, contract).
            let qv = unsafe { _mm512_loadu_ps(qp.add(c * lw)) };
            for (x, a) in acc.iter_mut().enumerate() {
                // SAFETY: key j + x < n, element c < d: inside k (contract).
                a[p] = _mm512_fmadd_ps(qv, _mm512_set1_ps(unsafe { *kp.add((j + x) * d + c) }), a[p]);
            }
        }
    }
    let acc = acc.map(|a| _mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])));
    let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
    for (x, a) in acc.iter().enumerate() {
        let jv = _mm512_set1_epi32((j + x) as i32);
        let vis = _mm512_cmpge_epi32_mask(jv, lov) & _mm512_cmplt_epi32_mask(jv, hiv);
        let sv = _mm512_mask_blend_ps(vis, ninf, *a);
        *tmax = _mm512_max_ps(*tmax, sv);
        // SAFETY: row j + x of sl (contract).
        unsafe { _mm512_storeu_ps(sl.as_mut_ptr().add((j + x) * 16), sv) };
    }
}

/// `acc[ms[r]][c..c + 16 * CW] += sum_{j in jlo..jhi} sl[j][l0 + r] * v[j][c..]` for `r < LB`.
///
/// # Safety
/// AVX-512 F; `ms[..LB]` are distinct query rows of `st.acc` (`[*, d]`); `c + 16 * CW <= d`;
/// `jhi * d <= v.len()`, `jhi * 16 <= sl.len()`, `l0 + LB <= 16`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn lane_pv<const LB: usize, const CW: usize>(
    st: &mut State,
    ms: &[usize],
    d: usize,
    c: usize,
    v: &[f32],
    sl: &[f32],
    l0: usize,
    jlo: usize,
    jhi: usize,
) {
    debug_assert!(ms.len() >= LB && c + 16 * CW <= d && jhi * d <= v.len() && l0 + LB <= 16);
    let mut a = [[_mm512_setzero_ps(); CW]; LB];
    for (r, row) in a.iter_mut().enumerate() {
        let ap = st.acc[ms[r] * d + c..].as_ptr();
        for (w, x) in row.iter_mut().enumerate() {
            // SAFETY: c + 16 * w + 16 <= d: inside query ms[r]'s acc row.
            *x = unsafe { _mm512_loadu_ps(ap.add(16 * w)) };
        }
    }
    let (vp, sp) = (v.as_ptr(), sl.as_ptr());
    for j in jlo..jhi {
        let mut vv = [_mm512_setzero_ps(); CW];
        for (w, x) in vv.iter_mut().enumerate() {
            // SAFETY: j < jhi and c + 16 * w + 16 <= d: inside v.
            *x = unsafe { _mm512_loadu_ps(vp.add(j * d + c + 16 * w)) };
        }
        for (r, row) in a.iter_mut().enumerate() {
            // SAFETY: row j < jhi of sl, lane l0 + r < 16.
            let pj = _mm512_set1_ps(unsafe { *sp.add(j * 16 + l0 + r) });
            for (w, x) in row.iter_mut().enumerate() {
                *x = _mm512_fmadd_ps(pj, vv[w], *x);
            }
        }
    }
    for (r, row) in a.iter().enumerate() {
        let ap = st.acc[ms[r] * d + c..].as_mut_ptr();
        for (w, x) in row.iter().enumerate() {
            // SAFETY: as for the loads.
            unsafe { _mm512_storeu_ps(ap.add(16 * w), *x) };
        }
    }
}
