//! Decode (one query row, or a few: rows x group <= `few_rows_queries`, group <= 4, as a
//! speculative step's verification has): per tile of up to `TILE` keys, one pass over K block by
//! block with all KV heads of a block in memory order (one sequential stretch per block), logits
//! for every query head, the online-softmax update, then the same pass over V. Each K/V element is
//! widened inside the FMA loops (vcvtph2ps, zext<<16), once per block of 4 query heads.
//!
//! | item            | what                                                                          |
//! |-----------------|-------------------------------------------------------------------------------|
//! | `attend_decode` | the two passes; per query block the micro-kernel (zmm when WIDE and head_dim % 16 == 0) |
//! | `pieces`        | a key range's pieces `(block, offset, n)` (a piece: one block's keys of one KV head) |
//! | `Pf`, `PF_NEXT` | the prefetch plan: the next piece into L1, the other pass's piece into L2     |
//! | `tile`          | a bounds-checked pointer to a piece                                           |
//!
//! Layout: a piece is `n * head_dim` contiguous elements of f32, f16 or bf16. While a piece is
//! computed, the next piece of the pass (`PF_NEXT`: the next KV head's piece of the block, or the
//! next block's first one; the table is random, so at block ends hardware prefetchers cannot
//! follow) is prefetched into L1, a slice of lines per 4 keys (logits), per column group (ymm
//! `acc += p v`) or per key or two inside the key loop (zmm `acc += p v`); with it, half a tile
//! ahead, the other pass's piece of the same block and head (this tile's V in the K pass, the next
//! tile's K in the V pass) into L2 (`Pf`).
//! Tolerance: 2e-5 from the scalar path (`attention/tests.rs`, every ISA); see `mod.rs`.

use std::arch::x86_64::*;

use super::common::{exp_sub, prefetch, scale_in_place, vmax};
use super::micro::{pv_block, pv_block_z, qk_block, qk_block_z};
use super::{F32, TILE};
use crate::attention::{Ctx, Kv, State, Unit};

/// Decode prefetches the piece this many pieces ahead in the same pass (pieces in memory order:
/// the KV heads of a block, then the next block's) into L1. The next piece is what the random table
/// hides from the hardware prefetchers; it beat the same head's piece two blocks ahead into L2,
/// 2-4 pieces ahead gained nothing more, and a whole block ahead lost the gain.
const PF_NEXT: usize = 1;

/// Decode unit (one query row or a few): per tile of up to TILE keys, one pass over K block by block
/// (all KV heads of a block in memory order: one sequential stretch per block) computing every
/// query head's logits, the online-softmax update of every query head, then one pass over V in
/// the same order. Each K/V element is widened in the FMA loops, once per block of 4 query vectors (8 in zmm when a unit has 8 or more).
/// `qbuf` and `st` hold the query vectors head-major (KV head, row, group head); keys past a row's
/// position or before its window get p = 0.
///
/// # Safety
/// As `attend`; `qbuf` holds the unit's `queries` vectors of head_dim, head-major.
#[inline(always)]
pub(super) unsafe fn attend_decode<const DT: u8, const WIDE: bool>(ctx: &Ctx, u: &Unit, st: &mut State, qbuf: &[f32]) {
    let (g, d) = (ctx.group, ctx.shape.head_dim);
    let nq = u.queries(g);
    let rows = u.row1 - u.row0;
    // Query vectors per KV head: the head's group of each row, in `qbuf` and `st` together.
    let rg = rows * g;
    // The AVX-512 build runs the logits and `acc += p v` with zmm columns when they tile head_dim.
    let zmm = WIDE && d % 16 == 0;
    let mut s = vec![0.0f32; nq * TILE];
    let es = if DT == F32 { 4 } else { 2 };
    let mut cur = [(0usize, 0usize, 0usize); TILE];
    let mut nxt = [(0usize, 0usize, 0usize); TILE];
    let mut t = u.key_lo;
    let mut nc = pieces(ctx, u.seq, t, (t + TILE).min(u.key_hi), &mut cur);
    while t < u.key_hi {
        let t_end = (t + TILE).min(u.key_hi);
        let nt_end = (t_end + TILE).min(u.key_hi);
        let nn = pieces(ctx, u.seq, t_end, nt_end, &mut nxt);
        // Touch the first line of every (block, head) tile of the next tile into L1 (page walks
        // start early). The pieces themselves are prefetched in the passes below, PF_NEXT
        // pieces ahead, a slice per slice of work done (see `Pf`).
        for &(blk, off, _) in &nxt[..nn] {
            for h in u.h0..u.h1 {
                let b = ctx.shape.offset(blk, h, off);
                prefetch(ctx.k, b, 8);
                prefetch(ctx.v, b, 8);
            }
        }
        for (pass, kv) in [(0, ctx.k), (1, ctx.v)] {
            if pass == 1 {
                // Online softmax over this tile's logits, per query vector. With several rows,
                // a row's keys past its own position (or before its window) are masked: p = 0.
                for m in 0..nq {
                    let (lo, hi) = if rows == 1 {
                        (t, t_end)
                    } else {
                        ctx.key_range(u.pos0 + (m % rg) / g, t, t_end)
                    };
                    let row = &mut s[m * TILE..m * TILE + (t_end - t)];
                    if lo >= hi {
                        row.fill(0.0);
                        continue;
                    }
                    row[..lo - t].fill(0.0);
                    row[hi - t..].fill(0.0);
                    let sj = &mut row[lo - t..hi - t];
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
            }
            let mut col = 0;
            let nh = u.h1 - u.h0;
            for i in 0..nc {
                let (blk, off, n) = cur[i];
                for h in u.h0..u.h1 {
                    // The piece PF_NEXT after this one in the same pass, in memory order (this
                    // block's next KV heads, then the next blocks', running on into the next tile).
                    let q = i * nh + (h - u.h0) + PF_NEXT;
                    let (j, hn) = (q / nh, u.h0 + q % nh);
                    let ahead = if j < nc {
                        Some(cur[j])
                    } else if j - nc < nn {
                        Some(nxt[j - nc])
                    } else {
                        None
                    };
                    let mut pf = match ahead {
                        Some((nb, no, na)) => Pf::new(tile(kv, ctx.shape.offset(nb, hn, no), na * d), na * d * es),
                        None => Pf::NONE,
                    };
                    // Half a tile further (`Pf::far`): in the K pass this piece's V, in the V pass
                    // the next tile's K piece in the same place (block i, head h).
                    let far = match pass {
                        0 => Some((ctx.v, cur[i])),
                        _ => (i < nn).then(|| (ctx.k, nxt[i])),
                    };
                    if let Some((fkv, (fb, fo, fa))) = far {
                        pf = pf.with_far(tile(fkv, ctx.shape.offset(fb, h, fo), fa * d), fa * d * es);
                    }
                    let ptr = tile(kv, ctx.shape.offset(blk, h, off), n * d);
                    let mut hg = 0;
                    while hg < rg {
                        let m0 = (h - u.h0) * rg + hg;
                        let mb = match rg - hg {
                            // zmm: blocks of 8 vectors (several rows) widen each element half as often
                            r if r >= 8 && WIDE && zmm => 8,
                            r if r >= 4 => 4,
                            3 => 3,
                            2 => 2,
                            _ => 1,
                        };
                        let pf = if hg == 0 { pf } else { Pf::NONE };
                        let sm = &mut s[m0 * TILE..(m0 + mb) * TILE];
                        // SAFETY: `tile` returned n*d in-bounds elements of DT; col + n <= TILE;
                        // pf points to the in-bounds piece it was made from (or is NONE); the zmm kernels run
                        // only when WIDE, i.e. in `attend_avx512` (AVX-512 F detected and enabled).
                        unsafe {
                            if pass == 0 {
                                let q = &qbuf[m0 * d..(m0 + mb) * d];
                                match (mb, WIDE) {
                                    (8, true) if zmm => qk_block_z::<8, 2, DT>(q, ptr, n, d, sm, col, pf),
                                    (4, true) if zmm => qk_block_z::<4, 4, DT>(q, ptr, n, d, sm, col, pf),
                                    (3, true) if zmm => qk_block_z::<3, 4, DT>(q, ptr, n, d, sm, col, pf),
                                    (2, true) if zmm => qk_block_z::<2, 8, DT>(q, ptr, n, d, sm, col, pf),
                                    (_, true) if zmm => qk_block_z::<1, 16, DT>(q, ptr, n, d, sm, col, pf),
                                    (4, false) => qk_block::<4, 2, DT>(q, ptr, n, d, sm, col, pf),
                                    (3, false) => qk_block::<3, 2, DT>(q, ptr, n, d, sm, col, pf),
                                    (2, false) => qk_block::<2, 4, DT>(q, ptr, n, d, sm, col, pf),
                                    (_, false) => qk_block::<1, 8, DT>(q, ptr, n, d, sm, col, pf),
                                    (4, true) => qk_block::<4, 4, DT>(q, ptr, n, d, sm, col, pf),
                                    (3, true) => qk_block::<3, 4, DT>(q, ptr, n, d, sm, col, pf),
                                    (2, true) => qk_block::<2, 8, DT>(q, ptr, n, d, sm, col, pf),
                                    (_, true) => qk_block::<1, 16, DT>(q, ptr, n, d, sm, col, pf),
                                }
                            } else {
                                let acc = &mut st.acc[m0 * d..(m0 + mb) * d];
                                match (mb, WIDE) {
                                    (8, true) if zmm => pv_block_z::<8, 2, DT>(sm, col, ptr, n, d, acc, pf),
                                    (4, true) if zmm => pv_block_z::<4, 4, DT>(sm, col, ptr, n, d, acc, pf),
                                    (3, true) if zmm => pv_block_z::<3, 4, DT>(sm, col, ptr, n, d, acc, pf),
                                    (2, true) if zmm => pv_block_z::<2, 8, DT>(sm, col, ptr, n, d, acc, pf),
                                    (_, true) if zmm => pv_block_z::<1, 8, DT>(sm, col, ptr, n, d, acc, pf),
                                    (4, false) => pv_block::<4, 2, DT>(sm, col, ptr, n, d, acc, pf),
                                    (3, false) => pv_block::<3, 2, DT>(sm, col, ptr, n, d, acc, pf),
                                    (2, false) => pv_block::<2, 4, DT>(sm, col, ptr, n, d, acc, pf),
                                    (_, false) => pv_block::<1, 8, DT>(sm, col, ptr, n, d, acc, pf),
                                    (4, true) => pv_block::<4, 4, DT>(sm, col, ptr, n, d, acc, pf),
                                    (3, true) => pv_block::<3, 4, DT>(sm, col, ptr, n, d, acc, pf),
                                    (2, true) => pv_block::<2, 8, DT>(sm, col, ptr, n, d, acc, pf),
                                    (_, true) => pv_block::<1, 16, DT>(sm, col, ptr, n, d, acc, pf),
                                }
                            }
                        }
                        hg += mb;
                    }
                }
                col += n;
            }
        }
        std::mem::swap(&mut cur, &mut nxt);
        nc = nn;
        t = t_end;
    }
}

/// Block pieces `(block, offset, n)` of key positions `t..t_end` of sequence `seq`; returns their count.
fn pieces(ctx: &Ctx, seq: usize, t: usize, t_end: usize, out: &mut [(usize, usize, usize); TILE]) -> usize {
    let bs = ctx.shape.block_size;
    let (mut p, mut np) = (t, 0);
    while p < t_end {
        let (blk, off) = (ctx.block(seq, p), p % bs);
        let n = (bs - off).min(t_end - p);
        out[np] = (blk, off, n);
        np += 1;
        p += n;
    }
    np
}

/// A later piece to prefetch into L1 while the current one is computed, a slice of it per slice
/// of work done (a burst of a whole piece per piece stalls on the loads; every other line only is
/// slower too: there is no adjacent-line prefetch to lean on). The ymm kernels issue their slices
/// between the FMA loops (inside, the AVX2 build spilled the `acc += p v` accumulators to the
/// stack); the zmm `acc += p v` issues them inside its key loop (32 registers; `pv_cols_z`), the
/// zmm logits per 4 keys (inside their column loop they gained nothing from DRAM and cost time
/// with K/V in cache).
///
/// Beside it a far piece, half a tile ahead (the other pass's piece of the same block and head),
/// goes to L2 (`_MM_HINT_T1`) in the same slices: with the next piece alone the prefetch ran only
/// 2-8 KiB ahead of a random table, too short for small heads (head_dim 64) to hide DRAM latency.
#[derive(Clone, Copy)]
pub(super) struct Pf {
    p: *const u8,
    /// 64-byte lines from `p` inside the piece (`bytes.div_ceil(64)`).
    lines: usize,
    /// The far piece (null: none) and its lines.
    far: *const u8,
    far_lines: usize,
    /// Lines per part (see `spread`).
    step: usize,
}

impl Pf {
    pub(super) const NONE: Pf = Pf {
        p: std::ptr::null(),
        lines: 0,
        far: std::ptr::null(),
        far_lines: 0,
        step: 0,
    };
    /// The piece at `p`, `bytes` long.
    fn new(p: *const u8, bytes: usize) -> Pf {
        Pf {
            p,
            lines: bytes.div_ceil(64),
            far: std::ptr::null(),
            far_lines: 0,
            step: 0,
        }
    }
    /// The same, with the far piece at `p`, `bytes` long (cut into the near piece's slices).
    fn with_far(self, p: *const u8, bytes: usize) -> Pf {
        Pf {
            far: p,
            far_lines: bytes.div_ceil(64),
            ..self
        }
    }
    /// The same piece cut into `parts` (> 0) parts of whole lines, for `part`.
    #[inline(always)]
    pub(super) fn spread(self, parts: usize) -> Pf {
        Pf {
            step: self.lines.div_ceil(parts),
            ..self
        }
    }
    /// Prefetch parts `lo..hi` into L1 (the far piece's into L2).
    ///
    /// # Safety
    /// `p` points to the `bytes` bytes given to `new` (or this is `NONE`), `far` to those given
    /// to `with_far` (or is null with no lines).
    #[inline(always)]
    pub(super) unsafe fn part(&self, lo: usize, hi: usize) {
        let end = (hi * self.step).min(self.lines);
        let mut l = lo * self.step;
        while l < end {
            // SAFETY: l < lines, so line l starts inside the piece.
            unsafe {
                let a = self.p.add(64 * l) as *const i8;
                _mm_prefetch::<_MM_HINT_T0>(a);
            }
            l += 1;
        }
        let (end, mut l) = ((hi * self.step).min(self.far_lines), lo * self.step);
        while l < end {
            // SAFETY: l < far_lines, so line l starts inside the far piece.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(self.far.add(64 * l) as *const i8) };
            l += 1;
        }
    }
}

/// Pointer to elements `base..base + len` of a cache (bounds-checked).
fn tile(kv: Kv, base: usize, len: usize) -> *const u8 {
    match kv {
        Kv::F32(c) => c[base..base + len].as_ptr() as *const u8,
        Kv::F16(c) => c[base..base + len].as_ptr() as *const u8,
        Kv::Bf16(c) => c[base..base + len].as_ptr() as *const u8,
    }
}
