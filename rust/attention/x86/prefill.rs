//! Prefill and chunked prefill: one tile (keys `t..t+n` of one KV head, widened once to f32 by the
//! body in `mod.rs`, `[n, head_dim]` in segments) against every query of the unit for that head.
//!
//! | kernel       | when                                                  | queries                      |
//! |--------------|-------------------------------------------------------|------------------------------|
//! | `tile_heads` | AVX2 build; AVX-512 build with head_dim % 16 != 0 or a soft cap | per query row, blocks of 4/2/1 group heads through the micro-kernels (zmm when head_dim % 16 == 0) |
//! | `lanes_tile` | AVX-512 build, head_dim % 16 == 0, no soft cap        | 16 a zmm (`qt`: `[head_dim, lw]` transposed once per unit, `transpose_queries`) |
//!
//! `lanes_tile` computes a key's logits for 16 queries as one zmm summed over head_dim (4 partial
//! sums, each over the whole tile in turn, 2 vectors x 12 keys a block: `lane_logits`), masks and
//! runs the online softmax 16 queries a vector (`lane_softmax`), then `acc += p v` 4 queries x 4
//! column vectors a block, column block outermost (`lanes_pv`, `lane_pv`). Its tiles' rows are
//! `head_dim + 16` floats apart (`mod.rs`).
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

/// The queries of KV head `h` of unit `u`, times `scale`, transposed into `qt` `[d, lw]`: column
/// `q = i * group + j` (row `row0 + i`, group head `j`) holds that query's `d` elements; columns
/// `nq..lw` are zero (the buffer is reused unit after unit). 16 queries x 16 elements a block,
/// transposed in registers.
///
/// # Safety
/// The CPU supports AVX-512 F; `ctx` validated; `h` in `u.h0..u.h1`; head_dim % 16 == 0;
/// `qt.len() == d * lw`, `lw == (rows * group).div_ceil(16) * 16`.
#[inline(always)]
pub(super) unsafe fn transpose_queries(ctx: &Ctx, u: &Unit, h: usize, scale: f32, qt: &mut [f32], lw: usize) {
    let (g, d, hq) = (ctx.group, ctx.shape.head_dim, ctx.q.num_heads);
    let nq = (u.row1 - u.row0) * g;
    assert!(d.is_multiple_of(16) && lw == nq.div_ceil(16) * 16 && qt.len() == d * lw);
    assert!(u.row1 * hq * d <= ctx.q.q.len() && (h + 1) * g <= hq);
    let (sv, qp, tp) = (_mm512_set1_ps(scale), ctx.q.q.as_ptr(), qt.as_mut_ptr());
    for q0 in (0..lw).step_by(16) {
        // Element offsets of the block's 16 queries; padding columns (past nq) read as zeros.
        let qn = 16.min(nq - q0);
        let mut src = [0usize; 16];
        for (l, at) in src.iter_mut().enumerate().take(qn) {
            let (i, j) = ((q0 + l) / g, (q0 + l) % g);
            *at = ((u.row0 + i) * hq + h * g + j) * d;
        }
        for c0 in (0..d).step_by(16) {
            let mut r = [_mm512_setzero_ps(); 16];
            if qn == 16 {
                for (x, &at) in r.iter_mut().zip(&src) {
                    // SAFETY: at + d <= row1 * hq * d <= q.len() (asserted), c0 + 16 <= d.
                    *x = _mm512_mul_ps(sv, unsafe { _mm512_loadu_ps(qp.add(at + c0)) });
                }
            } else {
                for (x, &at) in r.iter_mut().zip(&src).take(qn) {
                    // SAFETY: as above.
                    *x = _mm512_mul_ps(sv, unsafe { _mm512_loadu_ps(qp.add(at + c0)) });
                }
            }
            // SAFETY: AVX-512 F (contract).
            let cols = unsafe { transpose16(&r) };
            for (c, x) in cols.iter().enumerate() {
                // SAFETY: row c0 + c < d of qt, columns q0..q0 + 16 <= lw (asserted length).
                unsafe { _mm512_storeu_ps(tp.add((c0 + c) * lw + q0), *x) };
            }
        }
    }
}

/// The 16 x 16 transpose of `r` (lane `c` of `r[i]` -> lane `i` of the result's `c`): 32-bit
/// then 64-bit interleaves inside 128-bit lanes, then two rounds of 128-bit lane shuffles.
///
/// # Safety
/// The CPU supports AVX-512 F.
#[inline(always)]
unsafe fn transpose16(r: &[__m512; 16]) -> [__m512; 16] {
    // t[2p], t[2p + 1]: rows 2p, 2p + 1 interleaved (columns 0,1 / 2,3 of each 128-bit lane).
    let mut t = [_mm512_setzero_ps(); 16];
    for p in 0..8 {
        t[2 * p] = _mm512_unpacklo_ps(r[2 * p], r[2 * p + 1]);
        t[2 * p + 1] = _mm512_unpackhi_ps(r[2 * p], r[2 * p + 1]);
    }
    // u[4a + k]: rows 4a..4a + 4, column k + 4L in 128-bit lane L.
    let mut u = [_mm512_setzero_ps(); 16];
    let pd = _mm512_castps_pd;
    for a in 0..4 {
        let (t0, t1, t2, t3) = (pd(t[4 * a]), pd(t[4 * a + 1]), pd(t[4 * a + 2]), pd(t[4 * a + 3]));
        u[4 * a] = _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2));
        u[4 * a + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2));
        u[4 * a + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3));
        u[4 * a + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3));
    }
    let mut out = [_mm512_setzero_ps(); 16];
    for k in 0..4 {
        // 0x88: lanes 0, 2 of each source; 0xDD: lanes 1, 3.
        let v0 = _mm512_shuffle_f32x4::<0x88>(u[k], u[4 + k]);
        let v1 = _mm512_shuffle_f32x4::<0xDD>(u[k], u[4 + k]);
        let v2 = _mm512_shuffle_f32x4::<0x88>(u[8 + k], u[12 + k]);
        let v3 = _mm512_shuffle_f32x4::<0xDD>(u[8 + k], u[12 + k]);
        out[k] = _mm512_shuffle_f32x4::<0x88>(v0, v2);
        out[k + 8] = _mm512_shuffle_f32x4::<0xDD>(v0, v2);
        out[k + 4] = _mm512_shuffle_f32x4::<0x88>(v1, v3);
        out[k + 12] = _mm512_shuffle_f32x4::<0xDD>(v1, v3);
    }
    out
}

/// One zmm of 16 queries in `lanes_tile`: each lane's visible keys `[lo, hi)` relative to the
/// tile (empty for padding lanes), its state row `ms`, and the vector's key span `jlo..jhi`.
struct LaneVec {
    lo: __m512i,
    hi: __m512i,
    ms: [usize; 16],
    lanes: usize,
    jlo: usize,
    jhi: usize,
}

impl LaneVec {
    /// Queries `q0..q0 + 16` (of `nq`) of KV head `h` against keys `t..t + n`.
    ///
    /// # Safety
    /// The CPU supports AVX-512 F.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn new(ctx: &Ctx, u: &Unit, q0: usize, nq: usize, t: usize, n: usize, h: usize) -> Self {
        let g = ctx.group;
        let pr = u.per_row(g);
        let lanes = 16.min(nq - q0);
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
        // SAFETY: the arrays hold 16 i32.
        let (lo, hi) = unsafe {
            (
                _mm512_loadu_si512(lo.as_ptr() as *const _),
                _mm512_loadu_si512(hi.as_ptr() as *const _),
            )
        };
        LaneVec {
            lo,
            hi,
            ms,
            lanes,
            jlo,
            jhi,
        }
    }
}

/// Prefill tile with the queries as vector lanes (AVX-512, head_dim % 16 == 0, no soft cap): keys
/// `t..t+n` of KV head `h` (`k`, `v`: `n` rows of `d` f32, `ld` apart), against this head's `rows * group` queries,
/// 16 a vector (`qt`: `[d, lw]`, query `i * group + j` = row `i`, group head `j`). A key's logits
/// for 16 queries are one zmm summed over head_dim from `qt` and the key's broadcast elements (no
/// horizontal sums), in 4 partial sums (`PARTS`), each over every key of the tile before the next,
/// two vectors (32 queries) x 12 keys a block; the causal / sliding-window mask, the running max,
/// the rescale and the sum run 16 queries a vector; `acc += p v` takes 4 queries x 4 column
/// vectors a block with the probabilities broadcast. `sl` holds each vector's two tiles of
/// `[n, 16]` partial logits, then logits and probabilities in the first (vector `b` at
/// `b * 2 * TILE * 16`).
///
/// # Safety
/// The CPU supports AVX-512 F (and AVX2 + FMA + F16C); `qt.len() == d * lw`, `lw >= rows * group`,
/// `k.len() == v.len() == n * ld` with `n <= TILE` and `ld >= d`, `sl.len() >= TILE * 64`; `ctx` validated.
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
    ld: usize,
    t: usize,
    h: usize,
    sl: &mut [f32],
) {
    let (g, d) = (ctx.group, ctx.shape.head_dim);
    let n = k.len() / ld;
    let nq = (u.row1 - u.row0) * g;
    assert!(qt.len() == d * lw && lw >= nq && ld >= d && k.len() == n * ld && v.len() == n * ld);
    assert!(n <= TILE && sl.len() >= TILE * 64);
    for q0 in (0..nq).step_by(32) {
        // SAFETY: AVX-512 F (contract).
        let va = unsafe { LaneVec::new(ctx, u, q0, nq, t, n, h) };
        // No closure (`then`): it would not be compiled with AVX-512.
        let vb = if q0 + 16 < nq {
            // SAFETY: as above.
            Some(unsafe { LaneVec::new(ctx, u, q0 + 16, nq, t, n, h) })
        } else {
            None
        };
        let (mut jlo, mut jhi) = (va.jlo, va.jhi);
        if let Some(b) = &vb {
            (jlo, jhi) = (jlo.min(b.jlo), jhi.max(b.jhi));
        }
        if jlo >= jhi {
            continue;
        }
        let qp = qt.as_ptr().wrapping_add(q0);
        // Logits of keys jlo..jhi (unmasked) as 4 partial sums over head_dim (element c into
        // part c % 4), each part over every key block before the next, so that the part's rows
        // of transposed queries stay in L1 while the keys stream: 2 vectors x 12 keys a block
        // (24 FMA chains sharing 2 `qt` loads and 12 broadcasts), or 1 x 16.
        for part in 0..PARTS {
            let mut j = jlo;
            // SAFETY: q0 + 16 * QB <= lw (qt's columns: QB = 2 only when the second vector
            // exists), keys j..j + KB <= jhi <= n inside k and sl's tiles.
            unsafe {
                if vb.is_some() {
                    while j + 12 <= jhi {
                        lane_logits::<2, 12>(qp, lw, k, d, ld, j, part, sl);
                        j += 12;
                    }
                    while j + 4 <= jhi {
                        lane_logits::<2, 4>(qp, lw, k, d, ld, j, part, sl);
                        j += 4;
                    }
                    while j < jhi {
                        lane_logits::<2, 1>(qp, lw, k, d, ld, j, part, sl);
                        j += 1;
                    }
                } else {
                    while j + 16 <= jhi {
                        lane_logits::<1, 16>(qp, lw, k, d, ld, j, part, sl);
                        j += 16;
                    }
                    while j + 4 <= jhi {
                        lane_logits::<1, 4>(qp, lw, k, d, ld, j, part, sl);
                        j += 4;
                    }
                    while j < jhi {
                        lane_logits::<1, 1>(qp, lw, k, d, ld, j, part, sl);
                        j += 1;
                    }
                }
            }
        }
        // SAFETY: AVX-512 F (contract); vector b's two tiles at sl[b * 2 * TILE * 16..].
        unsafe { lane_softmax(st, &va, d, &mut sl[..2 * TILE * 16]) };
        if let Some(b) = &vb {
            // SAFETY: as above.
            unsafe { lane_softmax(st, b, d, &mut sl[2 * TILE * 16..4 * TILE * 16]) };
        }
        // SAFETY: as above; v holds n >= jhi rows, ld apart.
        unsafe { lanes_pv(st, [Some(&va), vb.as_ref()], d, v, ld, sl) };
    }
}

/// One vector's logits, summed from the two tiles of `sl` (`[2, TILE, 16]`: parts 0 + 1, parts
/// 2 + 3; rows `jlo..jhi` written) into the first and masked to each lane's keys, and its online
/// softmax: the first tile then holds its probabilities, its lanes' `acc` rows are rescaled.
///
/// # Safety
/// The CPU supports AVX-512 F; `sl.len() >= 2 * TILE * 16`; `vec.ms` are distinct query rows of
/// `st` (`[*, d]`).
#[inline(always)]
unsafe fn lane_softmax(st: &mut State, vec: &LaneVec, d: usize, sl: &mut [f32]) {
    let (lanes, ms, jlo, jhi) = (vec.lanes, &vec.ms, vec.jlo, vec.jhi);
    if jlo >= jhi {
        return;
    }
    assert!(sl.len() >= 2 * TILE * 16 && jhi <= TILE);
    let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
    // Each lane's keys [lo, hi) keep their logits, the rest -inf; the max of each lane.
    let mut tmax = ninf;
    for j in jlo..jhi {
        let jv = _mm512_set1_epi32(j as i32);
        let vis = _mm512_cmpge_epi32_mask(jv, vec.lo) & _mm512_cmplt_epi32_mask(jv, vec.hi);
        // SAFETY: j < jhi <= TILE rows of 16 in both tiles of sl (asserted).
        unsafe {
            let s = _mm512_add_ps(
                _mm512_loadu_ps(sl.as_ptr().add(j * 16)),
                _mm512_loadu_ps(sl.as_ptr().add((TILE + j) * 16)),
            );
            let sv = _mm512_mask_blend_ps(vis, ninf, s);
            tmax = _mm512_max_ps(tmax, sv);
            _mm512_storeu_ps(sl.as_mut_ptr().add(j * 16), sv);
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
        // SAFETY: j < jhi <= TILE rows of 16 in sl (asserted).
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
}

/// `acc[m] += sum_j p[j][lane] v[j]` for the lanes of up to two vectors (vector `i`'s
/// probabilities in `sl` at `i * 2 * TILE * 16`, rows of 16): 64 columns of head_dim at a time,
/// for every 4 lanes of both vectors (4 lanes x 4 column vectors a block, 16 chains), so that
/// those columns of the V tile stay in L1 while they serve all 32 queries.
///
/// # Safety
/// The CPU supports AVX-512 F; `sl.len() >= 4 * TILE * 16` when the second vector is given, else
/// `2 * TILE * 16`; `v` holds each vector's `jhi` rows of `d`, `ld` apart; the vectors' `ms` are distinct query
/// rows of `st` (`[*, d]`).
#[inline(always)]
unsafe fn lanes_pv(st: &mut State, vecs: [Option<&LaneVec>; 2], d: usize, v: &[f32], ld: usize, sl: &[f32]) {
    let mut c = 0;
    while c < d {
        let wide = c + 64 <= d;
        for (i, vec) in vecs.iter().enumerate() {
            let Some(vec) = vec else { continue };
            let (lanes, ms, jlo, jhi) = (vec.lanes, &vec.ms, vec.jlo, vec.jhi);
            if jlo >= jhi {
                continue;
            }
            let sv = &sl[i * 2 * TILE * 16..(i * 2 + 1) * TILE * 16];
            let mut l0 = 0;
            while l0 < lanes {
                let lb = 4.min(lanes - l0);
                // SAFETY: lanes l0..l0+lb hold state rows ms[..] of st.acc ([nq, d]), columns
                // c..c+64 (or c..c+16) inside d; rows jlo..jhi of sv and v inside n (contract).
                unsafe {
                    match (lb, wide) {
                        (4, true) => lane_pv::<4, 4>(st, &ms[l0..], d, c, v, ld, sv, l0, jlo, jhi),
                        (3, true) => lane_pv::<3, 4>(st, &ms[l0..], d, c, v, ld, sv, l0, jlo, jhi),
                        (2, true) => lane_pv::<2, 4>(st, &ms[l0..], d, c, v, ld, sv, l0, jlo, jhi),
                        (_, true) => lane_pv::<1, 4>(st, &ms[l0..], d, c, v, ld, sv, l0, jlo, jhi),
                        (4, false) => lane_pv::<4, 1>(st, &ms[l0..], d, c, v, ld, sv, l0, jlo, jhi),
                        (3, false) => lane_pv::<3, 1>(st, &ms[l0..], d, c, v, ld, sv, l0, jlo, jhi),
                        (2, false) => lane_pv::<2, 1>(st, &ms[l0..], d, c, v, ld, sv, l0, jlo, jhi),
                        (_, false) => lane_pv::<1, 1>(st, &ms[l0..], d, c, v, ld, sv, l0, jlo, jhi),
                    }
                }
                l0 += lb;
            }
        }
        c += if wide { 64 } else { 16 };
    }
}

/// Partial sums a logit is made of in `lanes_tile`: element c of head_dim goes to part c % PARTS,
/// and the logit is `(s0 + s1) + (s2 + s3)`. Chains of d / PARTS products, as short as the
/// lane-parallel kernels' (one chain of d put the SmolLM2 logits past LOGIT_TOL from the float64
/// oracle).
const PARTS: usize = 4;

/// Part `part` of the logits of keys `j..j+KB` for QB vectors of 16 queries (vector `b`'s
/// transposed queries start at `qp + 16 b`, row stride `lw`): the chain over elements
/// `part, part + 4, ..` of head_dim, stored as rows of 16 in vector b's tiles of `sl` (`[QB, 2,
/// TILE, 16]`): parts 0 and 2 stored into tiles 0 and 1, parts 1 and 3 added to them. Each lane's
/// sums are the same for any QB and KB.
///
/// # Safety
/// AVX-512 F; `qp` points to `d` rows of `16 * QB` readable f32 at stride `lw`; `part < PARTS`;
/// key rows `ld` apart in `k`, `j + KB <= k.len() / ld` and `j + KB <= TILE`; `sl` holds `QB * 2 * TILE * 16` f32.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn lane_logits<const QB: usize, const KB: usize>(
    qp: *const f32,
    lw: usize,
    k: &[f32],
    d: usize,
    ld: usize,
    j: usize,
    part: usize,
    sl: &mut [f32],
) {
    debug_assert!((j + KB) * ld <= k.len() && j + KB <= TILE && part < PARTS && sl.len() >= QB * 2 * TILE * 16);
    let kp = k.as_ptr().wrapping_add(j * ld);
    let mut acc = [[_mm512_setzero_ps(); KB]; QB];
    for c in (part..d).step_by(PARTS) {
        let mut qv = [_mm512_setzero_ps(); QB];
        for (b, x) in qv.iter_mut().enumerate() {
            // SAFETY: c < d rows of qt, columns 16 b..16 b + 16 inside the row (contract).
            *x = unsafe { _mm512_loadu_ps(qp.add(c * lw + 16 * b)) };
        }
        for x in 0..KB {
            // SAFETY: key j + x < n, element c < d: inside k (contract).
            let kv = _mm512_set1_ps(unsafe { *kp.add(x * ld + c) });
            for (row, q) in acc.iter_mut().zip(&qv) {
                row[x] = _mm512_fmadd_ps(*q, kv, row[x]);
            }
        }
    }
    let (sp, tile, add) = (sl.as_mut_ptr(), part / 2, part % 2 == 1);
    for (b, row) in acc.iter().enumerate() {
        for (x, a) in row.iter().enumerate() {
            // SAFETY: row j + x < TILE of vector b's tile `tile` (contract).
            unsafe {
                let at = sp.add(((2 * b + tile) * TILE + j + x) * 16);
                let s = if add {
                    _mm512_add_ps(_mm512_loadu_ps(at), *a)
                } else {
                    *a
                };
                _mm512_storeu_ps(at, s);
            }
        }
    }
}

/// `acc[ms[r]][c..c + 16 * CW] += sum_{j in jlo..jhi} sl[j][l0 + r] * v[j][c..]` for `r < LB`.
///
/// # Safety
/// AVX-512 F; `ms[..LB]` are distinct query rows of `st.acc` (`[*, d]`); `c + 16 * CW <= d`;
/// rows `ld` apart in `v`, `jhi * ld <= v.len()`, `jhi * 16 <= sl.len()`, `l0 + LB <= 16`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn lane_pv<const LB: usize, const CW: usize>(
    st: &mut State,
    ms: &[usize],
    d: usize,
    c: usize,
    v: &[f32],
    ld: usize,
    sl: &[f32],
    l0: usize,
    jlo: usize,
    jhi: usize,
) {
    debug_assert!(ms.len() >= LB && c + 16 * CW <= d && jhi * ld <= v.len() && l0 + LB <= 16);
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
            *x = unsafe { _mm512_loadu_ps(vp.add(j * ld + c + 16 * w)) };
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
