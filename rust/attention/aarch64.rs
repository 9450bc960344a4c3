//! NEON attention work unit for aarch64 (NEON is part of the aarch64 baseline).
//!
//! | entry    | elements         | loop                                                                 |
//! |----------|------------------|----------------------------------------------------------------------|
//! | `attend` | f32 / f16 / bf16 | per row and KV head: tiles of 32 keys, logits for the whole GQA group, one online-softmax update per head and tile, then `acc += p·v` |
//!
//! Each key/value row of a tile is widened to f32 once (f16/bf16 through `half`'s slice
//! conversion) and serves every query head of its group: K/V are read once per GQA group.
//! Dot products and `acc += w·v` run on 4-lane f32 vectors (`vfmaq_f32`, two accumulators),
//! any head_dim (a scalar tail covers head_dim % 4). `exp` is `simd::exp` (relative error < 2e-7).
//! Layout as in `mod.rs`. Tolerance vs the float64 numpy reference: see `mod.rs`.
//! Tested against the scalar spec by the cargo tests (run under qemu-aarch64 on x86-64 hosts:
//! `.ci/aarch64`); no benchmark figures yet (no aarch64 machine here).

use std::arch::aarch64::*;

use half::slice::HalfFloatSliceExt;

use super::{Ctx, Kv, State, Unit};
use crate::simd::exp;

/// Keys per tile.
const TILE: usize = 32;

/// Fill `st` with the partial attention of unit `u` (unnormalised accumulator, max, sum).
///
/// # Safety
/// The CPU has NEON (always true on aarch64); `ctx` passed `validate`.
#[target_feature(enable = "neon")]
pub(crate) unsafe fn attend(ctx: &Ctx, u: &Unit, st: &mut State) {
    let (g, d, bs) = (ctx.group, ctx.shape.head_dim, ctx.shape.block_size);
    let pr = u.per_row(g);
    let p = ctx.params;
    let mut kbuf = vec![0f32; TILE * d];
    let mut vbuf = vec![0f32; TILE * d];
    let mut s = vec![0f32; g * TILE];
    for (i, row) in (u.row0..u.row1).enumerate() {
        let (lo, hi) = ctx.key_range(u.pos0 + i, u.key_lo, u.key_hi);
        let qs = ctx.q_row(row, u);
        for kvh in 0..u.h1 - u.h0 {
            let kv_head = u.h0 + kvh;
            let m0 = i * pr + kvh * g; // this group's first query vector in the unit
            let mut t0 = lo;
            while t0 < hi {
                let n = TILE.min(hi - t0);
                for tt in 0..n {
                    let t = t0 + tt;
                    let off = ctx.shape.offset(ctx.block(u.seq, t), kv_head, t % bs);
                    widen(ctx.k, off, &mut kbuf[tt * d..(tt + 1) * d]);
                    widen(ctx.v, off, &mut vbuf[tt * d..(tt + 1) * d]);
                }
                for j in 0..g {
                    let q = &qs[(kvh * g + j) * d..(kvh * g + j + 1) * d];
                    for tt in 0..n {
                        // SAFETY: q and the key row are both d floats.
                        let mut l = unsafe { dot(q, &kbuf[tt * d..(tt + 1) * d]) } * p.scale;
                        if let Some(c) = p.soft_cap {
                            l = c * (l / c).tanh();
                        }
                        s[j * TILE + tt] = l;
                    }
                }
                for j in 0..g {
                    let m = m0 + j;
                    let sj = &mut s[j * TILE..j * TILE + n];
                    let old = st.max[m];
                    let new = sj.iter().fold(old, |a, &b| a.max(b));
                    let alpha = exp(old - new); // 0 while old is -inf
                    let mut sum = st.sum[m] * alpha;
                    for w in sj.iter_mut() {
                        *w = exp(*w - new);
                        sum += *w;
                    }
                    let acc = &mut st.acc[m * d..(m + 1) * d];
                    // SAFETY: acc and every value row are d floats; sj has n <= TILE weights.
                    unsafe { scale_add(acc, alpha, sj, &vbuf, d) };
                    st.max[m] = new;
                    st.sum[m] = sum;
                }
                t0 += n;
            }
        }
    }
}

/// Row `off..off + dst.len()` of a cache as f32.
fn widen(kv: Kv, off: usize, dst: &mut [f32]) {
    let d = dst.len();
    match kv {
        Kv::F32(x) => dst.copy_from_slice(&x[off..off + d]),
        Kv::F16(x) => x[off..off + d].convert_to_f32_slice(dst),
        Kv::Bf16(x) => x[off..off + d].convert_to_f32_slice(dst),
    }
}

/// `a · b` (same length).
///
/// # Safety
/// The CPU has NEON; `a.len() == b.len()` (the vector loads read both up to `a.len()`).
#[target_feature(enable = "neon")]
unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len();
    let (mut x0, mut x1) = (vdupq_n_f32(0.0), vdupq_n_f32(0.0));
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n = a.len() = b.len().
        unsafe {
            x0 = vfmaq_f32(x0, vld1q_f32(a.as_ptr().add(i)), vld1q_f32(b.as_ptr().add(i)));
            x1 = vfmaq_f32(x1, vld1q_f32(a.as_ptr().add(i + 4)), vld1q_f32(b.as_ptr().add(i + 4)));
        }
        i += 8;
    }
    if i + 4 <= n {
        // SAFETY: i + 4 <= n.
        unsafe { x0 = vfmaq_f32(x0, vld1q_f32(a.as_ptr().add(i)), vld1q_f32(b.as_ptr().add(i))) };
        i += 4;
    }
    let mut s = vaddvq_f32(vaddq_f32(x0, x1));
    for j in i..n {
        s += a[j] * b[j];
    }
    s
}

/// `acc = acc * alpha + Σ_t w[t] · v[t]` over the rows of `v` (`w.len()` rows of `d` floats).
///
/// # Safety
/// The CPU has NEON; `acc.len() == d` and `v.len() >= w.len() * d` (the vector loads and
/// stores are unchecked).
#[target_feature(enable = "neon")]
unsafe fn scale_add(acc: &mut [f32], alpha: f32, w: &[f32], v: &[f32], d: usize) {
    let mut c = 0;
    while c + 4 <= d {
        // SAFETY: c + 4 <= d = acc.len(); row t of v holds d floats at t * d.
        unsafe {
            let mut a = vmulq_n_f32(vld1q_f32(acc.as_ptr().add(c)), alpha);
            for (t, &wt) in w.iter().enumerate() {
                a = vfmaq_n_f32(a, vld1q_f32(v.as_ptr().add(t * d + c)), wt);
            }
            vst1q_f32(acc.as_mut_ptr().add(c), a);
        }
        c += 4;
    }
    for (j, a) in acc.iter_mut().enumerate().skip(c) {
        *a = *a * alpha + w.iter().enumerate().map(|(t, &wt)| wt * v[t * d + j]).sum::<f32>();
    }
}
