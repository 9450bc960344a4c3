//! AVX2 + FMA (+ F16C) attention work unit for x86-64.
//!
//! | variant    | elements | K/V load                                      |
//! |------------|----------|-----------------------------------------------|
//! | avx2 f32   | f32      | tiles read in place                           |
//! | avx2 f16   | f16      | tile widened once to f32 scratch (vcvtph2ps)  |
//! | avx2 bf16  | bf16     | tile widened once to f32 scratch (zext << 16) |
//!
//! Requires head_dim % 8 == 0 (dispatch in `mod.rs` falls back to scalar otherwise).
//! A unit walks its keys in tiles of at most 32 tokens inside one block; each tile is widened
//! once and then serves every query vector of the unit (all rows x all heads of the GQA group),
//! so K/V bytes leave memory once per group. Per query vector and tile: logits `q.k` for 8
//! tokens at a time (8 independent FMA chains, one 8x8 horizontal reduction), the tile max,
//! one rescale of the accumulator (online softmax), a vectorised exp, and `acc += p v` with
//! up to 8 accumulators over head_dim. The next tile is prefetched while this one computes.
//! Tolerance: see `mod.rs` (exp is a Cephes degree-5 polynomial, rel. error ~2e-7).

use std::arch::x86_64::*;

use super::{Ctx, Kv, State, Unit};

/// Keys per tile (also bounded by the block).
const TILE: usize = 32;

/// Fill `st` with the partial attention of unit `u`.
///
/// # Safety
/// The CPU supports AVX2, FMA and F16C; `ctx` passed `validate`; head_dim % 8 == 0.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn attend(ctx: &Ctx, u: &Unit, st: &mut State) {
    let (g, d, bs) = (ctx.group, ctx.shape.head_dim, ctx.shape.block_size);
    let nq = u.queries(g);
    let scale = ctx.params.scale;
    // Query vectors of the unit, pre-scaled, contiguous [nq, d].
    let mut qbuf = vec![0.0f32; nq * d];
    for (i, row) in (u.row0..u.row1).enumerate() {
        for (dst, src) in qbuf[i * g * d..(i + 1) * g * d].iter_mut().zip(ctx.q_row(row, u.kv_head)) {
            *dst = src * scale;
        }
    }
    let mut kbuf = vec![0.0f32; TILE * d];
    let mut vbuf = vec![0.0f32; TILE * d];
    let mut s = [0.0f32; TILE];
    let tile_at = |t: usize| {
        let off = t % bs;
        let n = (bs - off).min(TILE).min(u.key_hi - t);
        (ctx.shape.offset(ctx.block(u.seq, t), u.kv_head, off), n)
    };
    let mut t = u.key_lo;
    while t < u.key_hi {
        let (base, n) = tile_at(t);
        if t + n < u.key_hi {
            let (nb, nn) = tile_at(t + n);
            prefetch(ctx.k, nb, nn * d);
            prefetch(ctx.v, nb, nn * d);
        }
        let kt = widen(ctx.k, base, n * d, &mut kbuf);
        let vt = widen(ctx.v, base, n * d, &mut vbuf);
        for m in 0..nq {
            let (lo, hi) = ctx.key_range(u.pos0 + m / g, t, t + n);
            if lo >= hi {
                continue;
            }
            let (j0, j1) = (lo - t, hi - t);
            let sj = &mut s[j0..j1];
            qk(&qbuf[m * d..(m + 1) * d], &kt[j0 * d..j1 * d], d, sj);
            if let Some(c) = ctx.params.soft_cap {
                for x in sj.iter_mut() {
                    *x = c * (*x / c).tanh();
                }
            }
            let tmax = sj.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            let acc = &mut st.acc[m * d..(m + 1) * d];
            let old = st.max[m];
            if tmax > old {
                if old != f32::NEG_INFINITY {
                    let alpha = (old - tmax).exp();
                    scale_in_place(acc, alpha);
                    st.sum[m] *= alpha;
                }
                st.max[m] = tmax;
            }
            st.sum[m] += exp_sub(sj, st.max[m]);
            pv(sj, &vt[j0 * d..j1 * d], d, acc);
        }
        t += n;
    }
}

/// Tile `base..base+len` of a cache as f32: in place for f32, else widened into `buf`.
#[target_feature(enable = "avx2,fma,f16c")]
fn widen<'b>(kv: Kv<'b>, base: usize, len: usize, buf: &'b mut [f32]) -> &'b [f32] {
    match kv {
        Kv::F32(c) => &c[base..base + len],
        Kv::F16(c) => {
            let (src, dst) = (&c[base..base + len], &mut buf[..len]);
            for i in (0..len).step_by(8) {
                // SAFETY: len % 8 == 0 (head_dim % 8 == 0), so i + 8 <= len for src and dst.
                unsafe {
                    let h = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
                    _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
                }
            }
            dst
        }
        Kv::Bf16(c) => {
            let (src, dst) = (&c[base..base + len], &mut buf[..len]);
            for i in (0..len).step_by(8) {
                // SAFETY: as above.
                unsafe {
                    let h = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
                    let w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
                    _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_castsi256_ps(w));
                }
            }
            dst
        }
    }
}

/// Prefetch `base..base+len` of a cache into L1, one cache line at a time.
#[target_feature(enable = "avx2,fma,f16c")]
fn prefetch(kv: Kv, base: usize, len: usize) {
    let (p, bytes) = match kv {
        Kv::F32(c) => (c[base..base + len].as_ptr() as *const i8, len * 4),
        Kv::F16(c) => (c[base..base + len].as_ptr() as *const i8, len * 2),
        Kv::Bf16(c) => (c[base..base + len].as_ptr() as *const i8, len * 2),
    };
    for off in (0..bytes).step_by(64) {
        // SAFETY: off < bytes, the byte length of the in-bounds subslice `p` points to.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.add(off)) };
    }
}

/// Horizontal sums of 8 vectors: lane i of the result = sum of lanes of `a[i]`.
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum8(a: &[__m256; 8]) -> __m256 {
    let t01 = _mm256_hadd_ps(a[0], a[1]);
    let t23 = _mm256_hadd_ps(a[2], a[3]);
    let t45 = _mm256_hadd_ps(a[4], a[5]);
    let t67 = _mm256_hadd_ps(a[6], a[7]);
    let u0 = _mm256_hadd_ps(t01, t23);
    let u1 = _mm256_hadd_ps(t45, t67);
    _mm256_add_ps(_mm256_permute2f128_ps::<0x20>(u0, u1), _mm256_permute2f128_ps::<0x31>(u0, u1))
}

#[target_feature(enable = "avx2,fma,f16c")]
fn hsum(a: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<0x55>(s, s)))
}

/// `s[j] = q . k[j]` for k `[n, d]`.
#[target_feature(enable = "avx2,fma,f16c")]
fn qk(q: &[f32], k: &[f32], d: usize, s: &mut [f32]) {
    let n = s.len();
    assert!(q.len() == d && k.len() == n * d && d % 8 == 0);
    let (qp, kp) = (q.as_ptr(), k.as_ptr());
    let mut j = 0;
    while j + 8 <= n {
        let mut a = [_mm256_setzero_ps(); 8];
        for c in (0..d).step_by(8) {
            // SAFETY: c + 8 <= d and (j + 7) * d + c + 8 <= n * d, checked by the assert above.
            unsafe {
                let qv = _mm256_loadu_ps(qp.add(c));
                for (r, acc) in a.iter_mut().enumerate() {
                    *acc = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kp.add((j + r) * d + c)), *acc);
                }
            }
        }
        // SAFETY: j + 8 <= n = s.len().
        unsafe { _mm256_storeu_ps(s.as_mut_ptr().add(j), hsum8(&a)) };
        j += 8;
    }
    while j < n {
        let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut c = 0;
        while c + 16 <= d {
            // SAFETY: c + 16 <= d; row j < n.
            unsafe {
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(c)), _mm256_loadu_ps(kp.add(j * d + c)), a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(c + 8)), _mm256_loadu_ps(kp.add(j * d + c + 8)), a1);
            }
            c += 16;
        }
        if c < d {
            // SAFETY: c + 8 == d here since d % 8 == 0.
            unsafe { a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(c)), _mm256_loadu_ps(kp.add(j * d + c)), a0) };
        }
        s[j] = hsum(_mm256_add_ps(a0, a1));
        j += 1;
    }
}

/// `acc += sum_j p[j] * v[j]` for v `[n, d]`, in chunks of up to 8 vectors of head_dim.
#[target_feature(enable = "avx2,fma,f16c")]
fn pv(p: &[f32], v: &[f32], d: usize, acc: &mut [f32]) {
    assert!(v.len() == p.len() * d && acc.len() == d && d % 8 == 0);
    let mut c = 0;
    while c + 64 <= d {
        pv_chunk::<8>(p, v, d, c, acc);
        c += 64;
    }
    match (d - c) / 8 {
        0 => {}
        1 => pv_chunk::<1>(p, v, d, c, acc),
        2 => pv_chunk::<2>(p, v, d, c, acc),
        3 => pv_chunk::<3>(p, v, d, c, acc),
        4 => pv_chunk::<4>(p, v, d, c, acc),
        5 => pv_chunk::<5>(p, v, d, c, acc),
        6 => pv_chunk::<6>(p, v, d, c, acc),
        _ => pv_chunk::<7>(p, v, d, c, acc),
    }
}

/// Columns `c..c + 8*NV` of `pv`. Caller guarantees c + 8*NV <= d and the asserted lengths.
#[target_feature(enable = "avx2,fma,f16c")]
fn pv_chunk<const NV: usize>(p: &[f32], v: &[f32], d: usize, c: usize, acc: &mut [f32]) {
    debug_assert!(c + 8 * NV <= d && acc.len() == d && v.len() == p.len() * d);
    let ap = acc.as_mut_ptr();
    let mut a = [_mm256_setzero_ps(); NV];
    for (i, x) in a.iter_mut().enumerate() {
        // SAFETY: c + 8 * i + 8 <= c + 8 * NV <= d = acc.len().
        *x = unsafe { _mm256_loadu_ps(ap.add(c + 8 * i)) };
    }
    for (j, &pj) in p.iter().enumerate() {
        let w = _mm256_set1_ps(pj);
        for (i, x) in a.iter_mut().enumerate() {
            // SAFETY: j < p.len(), so j * d + c + 8 * i + 8 <= p.len() * d = v.len().
            *x = _mm256_fmadd_ps(w, unsafe { _mm256_loadu_ps(v.as_ptr().add(j * d + c + 8 * i)) }, *x);
        }
    }
    for (i, x) in a.iter().enumerate() {
        // SAFETY: as for the loads.
        unsafe { _mm256_storeu_ps(ap.add(c + 8 * i), *x) };
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn scale_in_place(x: &mut [f32], alpha: f32) {
    let w = _mm256_set1_ps(alpha);
    let mut chunks = x.chunks_exact_mut(8);
    for ch in &mut chunks {
        // SAFETY: ch has exactly 8 elements.
        unsafe { _mm256_storeu_ps(ch.as_mut_ptr(), _mm256_mul_ps(w, _mm256_loadu_ps(ch.as_ptr()))) };
    }
    for y in chunks.into_remainder() {
        *y *= alpha;
    }
}

/// `s[j] = exp(s[j] - mx)`, returns the sum.
#[target_feature(enable = "avx2,fma,f16c")]
fn exp_sub(s: &mut [f32], mx: f32) -> f32 {
    let m = _mm256_set1_ps(mx);
    let mut sum = _mm256_setzero_ps();
    let mut chunks = s.chunks_exact_mut(8);
    for ch in &mut chunks {
        // SAFETY: ch has exactly 8 elements.
        unsafe {
            let e = exp256(_mm256_sub_ps(_mm256_loadu_ps(ch.as_ptr()), m));
            _mm256_storeu_ps(ch.as_mut_ptr(), e);
            sum = _mm256_add_ps(sum, e);
        }
    }
    let mut tail = 0.0;
    for y in chunks.into_remainder() {
        *y = (*y - mx).exp();
        tail += *y;
    }
    hsum(sum) + tail
}

/// e^x for 8 lanes (Cephes expf: range reduction by ln 2, degree-5 polynomial); x clamped to
/// [-87.3, 88.3] so results stay normal.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn exp256(x: __m256) -> __m256 {
    let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3)), _mm256_set1_ps(88.3));
    let fx = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693_359_4), x);
    let r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.121_944_4e-4), r);
    let mut y = _mm256_set1_ps(1.987_569_1e-4);
    for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 5.000_000_1e-1] {
        y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c));
    }
    let r2 = _mm256_mul_ps(r, r);
    let y = _mm256_add_ps(_mm256_fmadd_ps(y, r2, r), _mm256_set1_ps(1.0));
    let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)));
    _mm256_mul_ps(y, _mm256_castsi256_ps(e))
}
