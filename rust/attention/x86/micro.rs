//! The register-block micro-kernels both decode and the per-query prefill run: MB query vectors
//! (or accumulators) against the keys (or values) of one piece or tile segment, `[n, head_dim]`
//! elements of type DT (f32, f16, bf16), widened in the FMA loops.
//!
//! | kernel       | registers | block (MB x TB keys / NV column vectors)     | sums                       |
//! |--------------|-----------|----------------------------------------------|----------------------------|
//! | `qk_block`   | ymm       | MB * TB <= 16 FMA chains                     | 8-way `hadd` (`store_sums`) |
//! | `qk_block_z` | zmm       | MB * TB <= 16 FMA chains, d % 16 == 0        | transpose-and-add tree (`sums16`) |
//! | `pv_block`   | ymm       | MB x NV accumulators (`pv_cols`)             | none                       |
//! | `pv_block_z` | zmm       | MB x NV accumulators, d % 16 == 0 (`pv_cols_z`) | none                    |
//!
//! Logits go to `s[r * TILE + col + j]`; `acc` is `[MB, head_dim]`. Each takes a `Pf` (decode's
//! prefetch plan; `Pf::NONE` from prefill). The zmm kernels only ever run from `attend_avx512`.
//! Tolerance: 2e-5 from the scalar path (`attention/tests.rs`, every ISA); see `mod.rs`.

use std::arch::x86_64::*;

use super::common::{hsum, load16, load8};
use super::decode::Pf;
use super::TILE;

/// Horizontal sums of 8 vectors: lane i of the result = sum of lanes of `a[i]`.
///
/// # Safety
/// The CPU supports AVX (inlined into the AVX2 / AVX-512 entries, which check it).
#[inline(always)]
unsafe fn hsum8(a: &[__m256; 8]) -> __m256 {
    let t01 = _mm256_hadd_ps(a[0], a[1]);
    let t23 = _mm256_hadd_ps(a[2], a[3]);
    let t45 = _mm256_hadd_ps(a[4], a[5]);
    let t67 = _mm256_hadd_ps(a[6], a[7]);
    let u0 = _mm256_hadd_ps(t01, t23);
    let u1 = _mm256_hadd_ps(t45, t67);
    _mm256_add_ps(
        _mm256_permute2f128_ps::<0x20>(u0, u1),
        _mm256_permute2f128_ps::<0x31>(u0, u1),
    )
}

/// The logits of keys `j..j+TB` for MB query vectors: `s[r * TILE + j + t]` = the 8-lane sum of
/// chain `f(a[r * TB + t])` (MB * TB <= 16 chains; one or two 8-way horizontal sums). `f` makes a
/// chain 8 lanes (the identity for ymm, a fold for zmm), applied as the sums read it.
///
/// # Safety
/// The CPU supports AVX (inlined into the AVX2 / AVX-512 entries, which check it).
#[inline(always)]
unsafe fn store_sums<const MB: usize, const TB: usize, T: Copy>(
    a: &[T; 16],
    f: impl Fn(T) -> __m256,
    s: &mut [f32],
    j: usize,
) {
    let mut lanes = [0.0f32; 16];
    // SAFETY: lanes holds 16 f32; hsum8 needs AVX (contract).
    unsafe {
        _mm256_storeu_ps(
            lanes.as_mut_ptr(),
            hsum8(&[f(a[0]), f(a[1]), f(a[2]), f(a[3]), f(a[4]), f(a[5]), f(a[6]), f(a[7])]),
        );
        if MB * TB > 8 {
            _mm256_storeu_ps(
                lanes.as_mut_ptr().add(8),
                hsum8(&[
                    f(a[8]),
                    f(a[9]),
                    f(a[10]),
                    f(a[11]),
                    f(a[12]),
                    f(a[13]),
                    f(a[14]),
                    f(a[15]),
                ]),
            );
        }
    }
    put_logits::<MB, TB>(&lanes, s, j);
}

/// `s[r * TILE + j + t] = lanes[r * TB + t]`: the logits of TB keys for MB query vectors, as the
/// register blocks sum them (chain r * TB + t), into the tile's per-query rows.
#[inline(always)]
fn put_logits<const MB: usize, const TB: usize>(lanes: &[f32; 16], s: &mut [f32], j: usize) {
    for r in 0..MB {
        s[r * TILE + j..r * TILE + j + TB].copy_from_slice(&lanes[r * TB..(r + 1) * TB]);
    }
}

/// `s[r * TILE + col + j] = q[r] . k[j]` for MB query vectors `q` `[MB, d]` and keys `k` `[n, d]` of
/// type DT, TB keys at a time (MB * TB <= 8 independent FMA chains, one 8-way horizontal sum).
///
/// # Safety
/// `kp` points to n * d elements of type DT.
#[inline(always)]
pub(super) unsafe fn qk_block<const MB: usize, const TB: usize, const DT: u8>(
    q: &[f32],
    kp: *const u8,
    n: usize,
    d: usize,
    s: &mut [f32],
    col: usize,
    pf: Pf,
) {
    assert!(MB * TB <= 16 && q.len() == MB * d && col + n <= TILE && s.len() >= MB * TILE && d.is_multiple_of(8));
    let s = &mut s[col..];
    let qp = q.as_ptr();
    let pf = pf.spread(n.max(1));
    let mut j = 0;
    while j + TB <= n {
        // SAFETY: per the `Pf` contract.
        unsafe { pf.part(j, j + TB) };
        let mut a = [_mm256_setzero_ps(); 16];
        for c in (0..d).step_by(8) {
            let mut kv = [_mm256_setzero_ps(); TB];
            for (t, x) in kv.iter_mut().enumerate() {
                // SAFETY: (j + t) < n and c + 8 <= d: inside k (function contract).
                *x = unsafe { load8::<DT>(kp, (j + t) * d + c) };
            }
            for r in 0..MB {
                // SAFETY: r < MB and c + 8 <= d: inside q (asserted length).
                let qv = unsafe { _mm256_loadu_ps(qp.add(r * d + c)) };
                for t in 0..TB {
                    a[r * TB + t] = _mm256_fmadd_ps(qv, kv[t], a[r * TB + t]);
                }
            }
        }
        // SAFETY: AVX is part of the caller's features.
        unsafe { store_sums::<MB, TB, __m256>(&a, |v| v, s, j) };
        j += TB;
    }
    while j < n {
        // SAFETY: per the `Pf` contract.
        unsafe { pf.part(j, j + 1) };
        for r in 0..MB {
            let mut a = _mm256_setzero_ps();
            for c in (0..d).step_by(8) {
                // SAFETY: j < n, r < MB, c + 8 <= d.
                unsafe { a = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(r * d + c)), load8::<DT>(kp, j * d + c), a) };
            }
            s[r * TILE + j] = hsum(a);
        }
        j += 1;
    }
}

/// `acc[r] += sum_j p[r * TILE + col + j] * v[j]` for MB accumulators `acc` `[MB, d]`, v `[n, d]` of
/// type DT; NV vectors of head_dim at a time (MB * NV accumulators in registers).
///
/// # Safety
/// `vp` points to n * d elements of type DT.
#[inline(always)]
pub(super) unsafe fn pv_block<const MB: usize, const NV: usize, const DT: u8>(
    p: &[f32],
    col: usize,
    vp: *const u8,
    n: usize,
    d: usize,
    acc: &mut [f32],
    pf: Pf,
) {
    assert!(acc.len() == MB * d && col + n <= TILE && p.len() >= MB * TILE && d.is_multiple_of(8));
    let p = &p[col..];
    let ap = acc.as_mut_ptr();
    let pf = pf.spread(d / 8);
    let mut c = 0;
    while c + 8 * NV <= d {
        // SAFETY: c + 8 * NV <= d; lengths asserted / per contract.
        unsafe {
            pf.part(c / 8, (c + 8 * NV) / 8);
            pv_cols::<MB, NV, DT>(p, vp, n, d, c, ap);
        }
        c += 8 * NV;
    }
    while NV > 2 && c + 16 <= d {
        // SAFETY: c + 16 <= d.
        unsafe {
            pf.part(c / 8, (c + 16) / 8);
            pv_cols::<MB, 2, DT>(p, vp, n, d, c, ap);
        }
        c += 16;
    }
    while c < d {
        // SAFETY: c + 8 <= d since d % 8 == 0.
        unsafe {
            pf.part(c / 8, (c + 8) / 8);
            pv_cols::<MB, 1, DT>(p, vp, n, d, c, ap);
        }
        c += 8;
    }
}

/// Columns `c..c + 8 * W` of `pv_block`.
///
/// # Safety
/// c + 8 * W <= d; `vp` holds n * d DT elements; `ap` holds MB * d f32; p.len() >= (MB - 1) * TILE + n.
#[inline(always)]
unsafe fn pv_cols<const MB: usize, const W: usize, const DT: u8>(
    p: &[f32],
    vp: *const u8,
    n: usize,
    d: usize,
    c: usize,
    ap: *mut f32,
) {
    let pp = p.as_ptr();
    let mut a = [[_mm256_setzero_ps(); W]; MB];
    for (r, row) in a.iter_mut().enumerate() {
        for (w, x) in row.iter_mut().enumerate() {
            // SAFETY: r < MB, c + 8 * w + 8 <= d: inside acc [MB, d].
            *x = unsafe { _mm256_loadu_ps(ap.add(r * d + c + 8 * w)) };
        }
    }
    for j in 0..n {
        let mut vv = [_mm256_setzero_ps(); W];
        for (w, x) in vv.iter_mut().enumerate() {
            // SAFETY: j < n, c + 8 * w + 8 <= d: inside v [n, d].
            *x = unsafe { load8::<DT>(vp, j * d + c + 8 * w) };
        }
        for (r, row) in a.iter_mut().enumerate() {
            // SAFETY: r < MB and j < n, so r * TILE + j < p.len() (function contract).
            let pj = _mm256_set1_ps(unsafe { *pp.add(r * TILE + j) });
            for (w, x) in row.iter_mut().enumerate() {
                *x = _mm256_fmadd_ps(pj, vv[w], *x);
            }
        }
    }
    for (r, row) in a.iter().enumerate() {
        for (w, x) in row.iter().enumerate() {
            // SAFETY: as for the loads.
            unsafe { _mm256_storeu_ps(ap.add(r * d + c + 8 * w), *x) };
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 512-bit (zmm) logits and `acc += p v`: used by `attend_avx512` when head_dim % 16 == 0. Only
// ever reached from that entry (AVX-512 F enabled and detected); the AVX2 build never calls them.

/// `qk_block` with zmm: MB query vectors x TB keys, 16 columns of head_dim a step (d % 16 == 0),
/// MB * TB <= 16 zmm accumulators summed by one transpose-and-add tree (`sums16`). Half the FMAs,
/// loads and widenings of the ymm kernel per key. The tree replaced folding each chain to 8 lanes
/// and two 8-way `hadd` sums (74 shuffle/add uops for 16 chains against 45): with the old sums the
/// horizontal work, not the FMAs, bounded the loop.
///
/// # Safety
/// `kp` points to n * d elements of type DT; the CPU supports AVX-512 F.
#[inline(always)]
pub(super) unsafe fn qk_block_z<const MB: usize, const TB: usize, const DT: u8>(
    q: &[f32],
    kp: *const u8,
    n: usize,
    d: usize,
    s: &mut [f32],
    col: usize,
    pf: Pf,
) {
    assert!(MB * TB <= 16 && q.len() == MB * d && col + n <= TILE && s.len() >= MB * TILE && d.is_multiple_of(16));
    let s = &mut s[col..];
    let qp = q.as_ptr();
    let pf = pf.spread(n.max(1));
    let fold = |a: __m512| -> __m256 {
        _mm256_add_ps(
            _mm512_castps512_ps256(a),
            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a))),
        )
    };
    let mut j = 0;
    while j + TB <= n {
        // SAFETY: per the `Pf` contract.
        unsafe { pf.part(j, j + TB) };
        let mut a = [_mm512_setzero_ps(); 16];
        for c in (0..d).step_by(16) {
            let mut kv = [_mm512_setzero_ps(); TB];
            for (t, x) in kv.iter_mut().enumerate() {
                // SAFETY: (j + t) < n and c + 16 <= d: inside k (function contract).
                *x = unsafe { load16::<DT>(kp, (j + t) * d + c) };
            }
            for r in 0..MB {
                // SAFETY: r < MB and c + 16 <= d: inside q (asserted length).
                let qv = unsafe { _mm512_loadu_ps(qp.add(r * d + c)) };
                for t in 0..TB {
                    a[r * TB + t] = _mm512_fmadd_ps(qv, kv[t], a[r * TB + t]);
                }
            }
        }
        // The MB * TB chains' sums in lanes 0.. of one zmm (chains past MB * TB are zero).
        let mut lanes = [0.0f32; 16];
        // SAFETY: lanes holds 16 f32; AVX-512 F is part of the caller's features.
        unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), sums16(&a)) };
        put_logits::<MB, TB>(&lanes, s, j);
        j += TB;
    }
    while j < n {
        // SAFETY: per the `Pf` contract.
        unsafe { pf.part(j, j + 1) };
        for r in 0..MB {
            let mut a = _mm512_setzero_ps();
            for c in (0..d).step_by(16) {
                // SAFETY: j < n, r < MB, c + 16 <= d.
                unsafe { a = _mm512_fmadd_ps(_mm512_loadu_ps(qp.add(r * d + c)), load16::<DT>(kp, j * d + c), a) };
            }
            // SAFETY: AVX is part of the caller's features.
            s[r * TILE + j] = unsafe { hsum(fold(a)) };
        }
        j += 1;
    }
}

/// `pv_block` with zmm: MB accumulators x NV 16-column vectors of head_dim at a time, d % 16 == 0.
///
/// # Safety
/// `vp` points to n * d elements of type DT; the CPU supports AVX-512 F.
#[inline(always)]
pub(super) unsafe fn pv_block_z<const MB: usize, const NV: usize, const DT: u8>(
    p: &[f32],
    col: usize,
    vp: *const u8,
    n: usize,
    d: usize,
    acc: &mut [f32],
    pf: Pf,
) {
    assert!(acc.len() == MB * d && col + n <= TILE && p.len() >= MB * TILE && d.is_multiple_of(16));
    let p = &p[col..];
    let ap = acc.as_mut_ptr();
    let pf = pf.spread(d / 8);
    let mut c = 0;
    while c + 16 * NV <= d {
        // SAFETY: c + 16 * NV <= d; lengths asserted / per contract.
        unsafe {
            pv_cols_z::<MB, NV, DT>(p, vp, n, d, c, ap, pf, c / 8, (c + 16 * NV) / 8);
        }
        c += 16 * NV;
    }
    while NV > 2 && c + 32 <= d {
        // SAFETY: c + 32 <= d.
        unsafe {
            pv_cols_z::<MB, 2, DT>(p, vp, n, d, c, ap, pf, c / 8, (c + 32) / 8);
        }
        c += 32;
    }
    while c < d {
        // SAFETY: c + 16 <= d since d % 16 == 0.
        unsafe {
            pv_cols_z::<MB, 1, DT>(p, vp, n, d, c, ap, pf, c / 8, (c + 16) / 8);
        }
        c += 16;
    }
}

/// Columns `c..c + 16 * W` of `pv_block_z`, issuing parts `lo..hi` of `pf` spread over its keys (one
/// every `n / (hi - lo)` keys, the rest after the last): one burst before the call put more misses
/// in flight than the core's fill buffers hold and stalled the accumulator loads after it.
///
/// # Safety
/// c + 16 * W <= d; `vp` holds n * d DT elements; `ap` holds MB * d f32; p.len() >= (MB - 1) * TILE + n;
/// the CPU supports AVX-512 F; `pf` is a piece's `Pf` (or `NONE`) spread so that `lo..hi` are its parts.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn pv_cols_z<const MB: usize, const W: usize, const DT: u8>(
    p: &[f32],
    vp: *const u8,
    n: usize,
    d: usize,
    c: usize,
    ap: *mut f32,
    pf: Pf,
    lo: usize,
    hi: usize,
) {
    let pp = p.as_ptr();
    let mut a = [[_mm512_setzero_ps(); W]; MB];
    for (r, row) in a.iter_mut().enumerate() {
        for (w, x) in row.iter_mut().enumerate() {
            // SAFETY: r < MB, c + 16 * w + 16 <= d: inside acc [MB, d].
            *x = unsafe { _mm512_loadu_ps(ap.add(r * d + c + 16 * w)) };
        }
    }
    // Parts lo..hi of the prefetch, one every `step` keys (`Pf`), the rest after the last key.
    let step = n.div_ceil((hi - lo).max(1)).max(1);
    let (mut part, mut next) = (lo, 0);
    for j in 0..n {
        if j == next && part < hi {
            // SAFETY: per the `Pf` contract.
            unsafe { pf.part(part, part + 1) };
            part += 1;
            next += step;
        }
        let mut vv = [_mm512_setzero_ps(); W];
        for (w, x) in vv.iter_mut().enumerate() {
            // SAFETY: j < n, c + 16 * w + 16 <= d: inside v [n, d].
            *x = unsafe { load16::<DT>(vp, j * d + c + 16 * w) };
        }
        for (r, row) in a.iter_mut().enumerate() {
            // SAFETY: r < MB and j < n, so r * TILE + j < p.len() (function contract).
            let pj = _mm512_set1_ps(unsafe { *pp.add(r * TILE + j) });
            for (w, x) in row.iter_mut().enumerate() {
                *x = _mm512_fmadd_ps(pj, vv[w], *x);
            }
        }
    }
    // SAFETY: per the `Pf` contract.
    unsafe { pf.part(part, hi) };
    for (r, row) in a.iter().enumerate() {
        for (w, x) in row.iter().enumerate() {
            // SAFETY: as for the loads.
            unsafe { _mm512_storeu_ps(ap.add(r * d + c + 16 * w), *x) };
        }
    }
}

/// Lane i = the sum of the 16 lanes of `a[i]`: a transpose-and-add tree (16 unpacks, 8 + 4 + 2
/// shuffles, 15 adds for 16 sums).
///
/// # Safety
/// The CPU supports AVX-512 F.
#[inline(always)]
unsafe fn sums16(a: &[__m512; 16]) -> __m512 {
    // Per 128-bit segment: t[i] = [a0 0+2, a1 0+2, a0 1+3, a1 1+3] of a[2i], a[2i+1].
    let mut t = [_mm512_setzero_ps(); 8];
    for (i, x) in t.iter_mut().enumerate() {
        let (p, q) = (a[2 * i], a[2 * i + 1]);
        *x = _mm512_add_ps(_mm512_unpacklo_ps(p, q), _mm512_unpackhi_ps(p, q));
    }
    // Per segment: u[i] = the segment sums of a[4i..4i+4].
    let mut u = [_mm512_setzero_ps(); 4];
    for (i, x) in u.iter_mut().enumerate() {
        let (p, q) = (t[2 * i], t[2 * i + 1]);
        *x = _mm512_add_ps(_mm512_shuffle_ps::<0x44>(p, q), _mm512_shuffle_ps::<0xEE>(p, q));
    }
    // Segments added pairwise across vectors: segment s of the result = the sums of a[4s..4s+4].
    let v0 = _mm512_add_ps(
        _mm512_shuffle_f32x4::<0x88>(u[0], u[1]),
        _mm512_shuffle_f32x4::<0xDD>(u[0], u[1]),
    );
    let v1 = _mm512_add_ps(
        _mm512_shuffle_f32x4::<0x88>(u[2], u[3]),
        _mm512_shuffle_f32x4::<0xDD>(u[2], u[3]),
    );
    _mm512_add_ps(
        _mm512_shuffle_f32x4::<0x88>(v0, v1),
        _mm512_shuffle_f32x4::<0xDD>(v0, v1),
    )
}
