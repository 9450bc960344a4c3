//! Scalar spec of one attention work unit: the forced-scalar path and the cargo-test oracle.
//!
//! | variant | elements         | loop                                                        |
//! |---------|------------------|-------------------------------------------------------------|
//! | scalar  | f32 / f16 / bf16 | per query vector, per key token: one-pass online softmax    |
//!
//! Layout as in `mod.rs`. Each query vector walks its keys token by token through the block
//! table, so K/V are re-read once per query head (clarity over speed). Tolerance vs the float64
//! numpy reference: see `mod.rs`.

use super::{Ctx, Elem, Kv, State, Unit};

/// Fill `st` with the partial attention of unit `u` (unnormalised accumulator, max, sum).
pub(crate) fn attend(ctx: &Ctx, u: &Unit, st: &mut State) {
    match (ctx.k, ctx.v) {
        (Kv::F32(k), Kv::F32(v)) => attend_t(ctx, k, v, u, st),
        (Kv::F16(k), Kv::F16(v)) => attend_t(ctx, k, v, u, st),
        (Kv::Bf16(k), Kv::Bf16(v)) => attend_t(ctx, k, v, u, st),
        _ => unreachable!("k/v dtypes checked equal by validate"),
    }
}

fn attend_t<T: Elem>(ctx: &Ctx, k: &[T], v: &[T], u: &Unit, st: &mut State) {
    let (g, d) = (ctx.group, ctx.shape.head_dim);
    let pr = u.per_row(g);
    let p = ctx.params;
    for (i, row) in (u.row0..u.row1).enumerate() {
        let pos = u.pos0 + i;
        let (lo, hi) = ctx.key_range(pos, u.key_lo, u.key_hi);
        let qs = ctx.q_row(row, u);
        for h in 0..pr {
            let m = i * pr + h;
            let kv_head = u.h0 + h / g;
            let q = &qs[h * d..(h + 1) * d];
            let acc = &mut st.acc[m * d..(m + 1) * d];
            let (mut mx, mut sum) = (f32::NEG_INFINITY, 0.0f32);
            for t in lo..hi {
                let off = ctx.shape.offset(ctx.block(u.seq, t), kv_head, t % ctx.shape.block_size);
                let kt = &k[off..off + d];
                let mut s = q.iter().zip(kt).map(|(a, b)| a * b.to_f32()).sum::<f32>() * p.scale;
                if let Some(c) = p.soft_cap {
                    s = c * (s / c).tanh();
                }
                let new_mx = mx.max(s);
                let alpha = (mx - new_mx).exp(); // 0 when mx = -inf
                let w = (s - new_mx).exp();
                sum = sum * alpha + w;
                for (a, b) in acc.iter_mut().zip(&v[off..off + d]) {
                    *a = *a * alpha + w * b.to_f32();
                }
                mx = new_mx;
            }
            st.max[m] = mx;
            st.sum[m] = sum;
        }
    }
}
