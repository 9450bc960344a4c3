//! AVX2 + FMA (+ F16C) attention work unit for x86-64, in two builds of one body.
//!
//! | entry           | features                        | register blocks (qk: heads x keys, pv: heads x 8-col vectors) |
//! |-----------------|---------------------------------|---------------------------------------------------------------|
//! | `attend`        | avx2, fma, f16c (16 ymm)        | qk 4x2 / 3x2 / 2x4 / 1x8, pv 4x2 / 3x2 / 2x4 / 1x8           |
//! | `attend_avx512` | + avx512f, avx512vl, avx512bw (32 regs, EVEX) | qk 4x4 / 3x4 / 2x8 / 1x16 (ymm; with head_dim % 16 == 0: the same blocks of **zmm** chains); pv with head_dim % 16 == 0: 4x4 / 3x4 / 2x8 / 1x8 16-col **zmm** vectors (else ymm 4x4 / 3x4 / 2x8 / 1x16); decode and prefill alike |
//!
//! On cores that execute a 512-bit op as two 256-bit halves the AVX-512 build wins mainly through
//! its 32 registers (twice the independent FMA chains per K/V load); on cores with a full 512-bit
//! datapath the zmm kernels gain as well. Decode `acc += p v` runs in zmm when head_dim % 16 == 0
//! (`pv_block_z`: half the loads, broadcasts and loop trips per column), and so do the decode
//! logits (`qk_block_z`), their 16 chains summed by one transpose-and-add tree (`sums16`).
//! Prefill (the widened f32 tiles) in the AVX-512 build, head_dim % 16 == 0 and no soft cap, takes
//! the unit's queries as vector lanes (`lanes_tile`): a key's logits for 16 queries are one zmm
//! summed over head_dim (4 partial sums) from the queries transposed once per unit and the key's
//! broadcast elements, so no horizontal sums (the per-query kernels spent as many shuffles and adds
//! on them as FMAs at head_dim 64), and the mask and online softmax run 16 queries a vector.
//! Otherwise the per-query kernels (`tile_heads`), zmm when head_dim % 16 == 0.
//! The body and micro-kernels are `#[inline(always)]` so that each entry compiles them for its
//! own features.
//!
//! | path                    | when                                  | K/V element load                      |
//! |-------------------------|---------------------------------------|---------------------------------------|
//! | `attend_decode` f32/f16/bf16 | one query row, group <= 4 (decode) | widened in the FMA loops (vcvtph2ps, zext<<16), once per 4 query heads |
//! | `attend` (widened)      | otherwise (prefill, chunked prefill)  | tile widened once to f32 scratch      |
//!
//! Requires head_dim % 8 == 0 (dispatch in `mod.rs` falls back to scalar otherwise).
//! Keys are taken in tiles of up to 64 tokens spanning consecutive table blocks. Decode: per
//! tile, one pass over K block by block with all KV heads of a block in memory order (one
//! sequential stretch per block), logits for every query head, the online-softmax update, then
//! the same pass over V. While a piece (one block's keys of one KV head) is computed, the next
//! piece of the pass (`PF_NEXT`: the next KV head's piece of the block, or the next block's first
//! one; the table is random, so at block ends hardware prefetchers cannot follow) is prefetched
//! into L1, a slice of lines per 4 keys (logits), per column group (ymm `acc += p v`) or per key
//! or two inside the key loop (zmm `acc += p v`); with it, half a tile ahead, the other pass's
//! piece of the same block and head (this tile's V in the K pass, the next tile's K in the V
//! pass) into L2 (`Pf`).
//! Prefill: per tile and KV head, the tile is widened once and serves every row and query head
//! of the unit. Micro-kernels: logits for MB query heads x TB keys with MB*TB independent FMA
//! chains and 8-way horizontal sums; `acc += p v` with MB x NV accumulators in registers.
//! Tolerance: see `mod.rs` (exp is `simd::x86::exp256`, a Cephes degree-5 polynomial, rel. error ~2e-7).

use std::arch::x86_64::*;

use super::{Ctx, DType, Kv, State, Unit};
use crate::simd::x86::exp256;

/// Keys per tile; a tile spans consecutive blocks of the table (one segment per block piece).
const TILE: usize = 64;
/// Decode prefetches the piece this many pieces ahead in the same pass (pieces in memory order:
/// the KV heads of a block, then the next block's) into L1. The next piece is what the random table
/// hides from the hardware prefetchers; it beat the same head's piece two blocks ahead into L2,
/// 2-4 pieces ahead gained nothing more, and a whole block ahead lost the gain.
const PF_NEXT: usize = 1;

/// Element type codes for the const-generic kernels.
const F32: u8 = 0;
const F16: u8 = 1;
const BF16: u8 = 2;

/// `n` consecutive key rows of one KV head inside one block: K and V element pointers.
#[derive(Clone, Copy)]
struct Seg {
    k: *const u8,
    v: *const u8,
    n: usize,
}

/// Fill `st` with the partial attention of unit `u` (AVX2: 16 ymm registers).
///
/// # Safety
/// The CPU supports AVX2, FMA and F16C; `ctx` passed `validate`; head_dim % 8 == 0.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn attend(ctx: &Ctx, u: &Unit, st: &mut State) {
    // SAFETY: same contract; the body is inlined here and compiled for these features.
    unsafe { attend_body::<false>(ctx, u, st) }
}

/// `attend` compiled with AVX-512 F/VL/BW: the same 256-bit code, 32 registers (ymm0-31) and
/// register blocks twice as wide.
///
/// # Safety
/// As `attend`, and the CPU supports AVX-512 F, VL and BW.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw")]
pub(crate) unsafe fn attend_avx512(ctx: &Ctx, u: &Unit, st: &mut State) {
    // SAFETY: same contract; the body is inlined here and compiled for these features.
    unsafe { attend_body::<true>(ctx, u, st) }
}

/// The body of `attend` / `attend_avx512`; `WIDE` picks the 32-register blocks. Inlined into
/// each entry point so that it and every micro-kernel are compiled for that entry's features.
///
/// # Safety
/// As `attend`; WIDE only when the CPU supports AVX-512 F, VL and BW.
#[inline(always)]
unsafe fn attend_body<const WIDE: bool>(ctx: &Ctx, u: &Unit, st: &mut State) {
    let (g, d, bs) = (ctx.group, ctx.shape.head_dim, ctx.shape.block_size);
    let (nq, pr) = (u.queries(g), u.per_row(g));
    let scale = ctx.params.scale;
    // Query vectors of the unit, pre-scaled, contiguous [nq, d] (row-major over rows, heads).
    let mut qbuf = vec![0.0f32; nq * d];
    for (i, row) in (u.row0..u.row1).enumerate() {
        for (dst, src) in qbuf[i * pr * d..(i + 1) * pr * d].iter_mut().zip(ctx.q_row(row, u)) {
            *dst = src * scale;
        }
    }
    // One query row and small groups (decode): widen K/V inside the FMA loops, each element
    // once per block of 4 query heads. Otherwise (prefill): widen each tile once into f32 scratch.
    if u.row1 - u.row0 == 1 && g <= 4 {
        // SAFETY: same contract as this function.
        unsafe {
            match ctx.k.dtype() {
                DType::F32 => attend_decode::<F32, WIDE>(ctx, u, st, &qbuf),
                DType::F16 => attend_decode::<F16, WIDE>(ctx, u, st, &qbuf),
                DType::Bf16 => attend_decode::<BF16, WIDE>(ctx, u, st, &qbuf),
            }
        }
        return;
    }
    let (mut kbuf, mut vbuf) = (vec![0.0f32; TILE * d], vec![0.0f32; TILE * d]);
    let mut s = [0.0f32; 4 * TILE];
    // The AVX-512 build takes the unit's queries as vector lanes (`lanes_tile`) when head_dim is
    // a multiple of 16 and no soft cap applies: per KV head, its queries transposed once.
    let lanes = WIDE && d % 16 == 0 && ctx.params.soft_cap.is_none();
    let rows = u.row1 - u.row0;
    let lw = (rows * g).div_ceil(16) * 16;
    let qt: Vec<Vec<f32>> = if lanes {
        (u.h0..u.h1)
            .map(|h| {
                let mut t = vec![0f32; d * lw];
                for i in 0..rows {
                    for j in 0..g {
                        let m = i * pr + (h - u.h0) * g + j;
                        for c in 0..d {
                            t[c * lw + i * g + j] = qbuf[m * d + c];
                        }
                    }
                }
                t
            })
            .collect()
    } else {
        Vec::new()
    };
    let mut sl = if lanes { vec![0f32; TILE * 16] } else { Vec::new() };
    // Block pieces (block, offset, n) of the current tile.
    let mut pieces = [(0usize, 0usize, 0usize); TILE];
    let mut t = u.key_lo;
    while t < u.key_hi {
        let t_end = (t + TILE).min(u.key_hi);
        let mut np = 0;
        let mut p = t;
        while p < t_end {
            let (blk, off) = (ctx.block(u.seq, p), p % bs);
            let n = (bs - off).min(t_end - p);
            pieces[np] = (blk, off, n);
            np += 1;
            p += n;
        }
        if t_end < u.key_hi {
            // Touch the first line of the next tile's first block early (page walk + hardware
            // prefetcher start); prefetching whole tiles is slower (the miss queue fills up).
            let nb = ctx.shape.offset(ctx.block(u.seq, t_end), u.h0, t_end % bs);
            prefetch(ctx.k, nb, 8);
            prefetch(ctx.v, nb, 8);
        }
        let n = t_end - t;
        for h in u.h0..u.h1 {
            let mut at = 0;
            for &(blk, off, m) in &pieces[..np] {
                let base = ctx.shape.offset(blk, h, off);
                widen(ctx.k, base, m * d, &mut kbuf[at * d..(at + m) * d]);
                widen(ctx.v, base, m * d, &mut vbuf[at * d..(at + m) * d]);
                at += m;
            }
            let sg = [Seg {
                k: kbuf.as_ptr() as *const u8,
                v: vbuf.as_ptr() as *const u8,
                n,
            }];
            if lanes {
                // SAFETY: WIDE: AVX-512 F enabled and detected (`attend_avx512`); kbuf/vbuf hold n*d
                // f32 written just above; qt[h - h0] is this head's [d, lw] transposed queries.
                unsafe {
                    lanes_tile(
                        ctx,
                        u,
                        st,
                        &qt[h - u.h0],
                        lw,
                        &kbuf[..n * d],
                        &vbuf[..n * d],
                        t,
                        h,
                        &mut sl,
                    )
                };
                continue;
            }
            // SAFETY: kbuf/vbuf hold n*d f32 written just above and are not touched below.
            unsafe { tile_heads::<F32, WIDE>(ctx, u, st, &qbuf, &sg, t, n, h, &mut s) };
        }
        t = t_end;
    }
}

/// Decode unit (one query row): per tile of up to TILE keys, one pass over K block by block
/// (all KV heads of a block in memory order: one sequential stretch per block) computing every
/// query head's logits, the online-softmax update of every query head, then one pass over V in
/// the same order. Each K/V element is widened in the FMA loops, once per 4 query heads.
///
/// # Safety
/// As `attend`, plus u.row1 - u.row0 == 1 (so every key in u.key_lo..u.key_hi is visible).
#[inline(always)]
unsafe fn attend_decode<const DT: u8, const WIDE: bool>(ctx: &Ctx, u: &Unit, st: &mut State, qbuf: &[f32]) {
    let (g, d) = (ctx.group, ctx.shape.head_dim);
    let nq = u.queries(g);
    debug_assert!(u.row1 - u.row0 == 1);
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
                // Online softmax over this tile's logits, per query head.
                for m in 0..nq {
                    let sj = &mut s[m * TILE..m * TILE + (t_end - t)];
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
                    while hg < g {
                        let m0 = (h - u.h0) * g + hg;
                        let mb = match g - hg {
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
struct Pf {
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
    const NONE: Pf = Pf {
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
    fn spread(self, parts: usize) -> Pf {
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
    unsafe fn part(&self, lo: usize, hi: usize) {
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

/// 8 elements at element index `i` of a DT array, widened to f32.
///
/// # Safety
/// `p` points to at least `i + 8` elements of type DT.
#[inline(always)]
unsafe fn load8<const DT: u8>(p: *const u8, i: usize) -> __m256 {
    // SAFETY: per the function contract.
    unsafe {
        match DT {
            F32 => _mm256_loadu_ps((p as *const f32).add(i)),
            F16 => _mm256_cvtph_ps(_mm_loadu_si128((p as *const u16).add(i) as *const __m128i)),
            _ => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(
                (p as *const u16).add(i) as *const __m128i,
            )))),
        }
    }
}

/// One tile (keys t..t+n of KV head h, in segments) against every query vector of head h.
///
/// # Safety
/// Each segment's `k`, `v` point to `n * d` elements of type DT; the segments' n sum to `n`;
/// `ctx` validated; head_dim % 8 == 0.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn tile_heads<const DT: u8, const WIDE: bool>(
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

/// Elements `base..base+len` of a cache, widened to f32 into `dst` (`dst.len() == len`).
#[target_feature(enable = "avx2,fma,f16c")]
fn widen(kv: Kv, base: usize, len: usize, dst: &mut [f32]) {
    assert!(dst.len() == len && len.is_multiple_of(8));
    match kv {
        Kv::F32(c) => dst.copy_from_slice(&c[base..base + len]),
        Kv::F16(c) => {
            let src = &c[base..base + len];
            for i in (0..len).step_by(8) {
                // SAFETY: len % 8 == 0, so i + 8 <= len for src and dst.
                unsafe { _mm256_storeu_ps(dst.as_mut_ptr().add(i), load8::<F16>(src.as_ptr() as *const u8, i)) };
            }
        }
        Kv::Bf16(c) => {
            let src = &c[base..base + len];
            for i in (0..len).step_by(8) {
                // SAFETY: as above.
                unsafe { _mm256_storeu_ps(dst.as_mut_ptr().add(i), load8::<BF16>(src.as_ptr() as *const u8, i)) };
            }
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

/// Sum of the 8 lanes of `a`.
///
/// # Safety
/// The CPU supports AVX (inlined into the AVX2 / AVX-512 entries, which check it).
#[inline(always)]
unsafe fn hsum(a: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<0x55>(s, s)))
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
unsafe fn qk_block<const MB: usize, const TB: usize, const DT: u8>(
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
unsafe fn pv_block<const MB: usize, const NV: usize, const DT: u8>(
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
// 512-bit (zmm) `acc += p v` for decode: used by `attend_avx512` when head_dim % 16 == 0. Only
// ever reached from that entry (AVX-512 F enabled and detected); the AVX2 build never calls them.

/// 16 elements at element index `i` of a DT array, widened to f32 (zmm).
///
/// # Safety
/// `p` points to at least `i + 16` elements of type DT; the CPU supports AVX-512 F.
#[inline(always)]
unsafe fn load16<const DT: u8>(p: *const u8, i: usize) -> __m512 {
    // SAFETY: per the function contract.
    unsafe {
        match DT {
            F32 => _mm512_loadu_ps((p as *const f32).add(i)),
            F16 => _mm512_cvtph_ps(_mm256_loadu_si256((p as *const u16).add(i) as *const __m256i)),
            _ => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
                (p as *const u16).add(i) as *const __m256i,
            )))),
        }
    }
}

/// `qk_block` with zmm: MB query vectors x TB keys, 16 columns of head_dim a step (d % 16 == 0),
/// MB * TB <= 16 zmm accumulators summed by one transpose-and-add tree (`sums16`). Half the FMAs,
/// loads and widenings of the ymm kernel per key. The tree replaced folding each chain to 8 lanes
/// and two 8-way `hadd` sums (74 shuffle/add uops for 16 chains against 45): with the old sums the
/// horizontal work, not the FMAs, bounded the loop.
///
/// # Safety
/// `kp` points to n * d elements of type DT; the CPU supports AVX-512 F.
#[inline(always)]
unsafe fn qk_block_z<const MB: usize, const TB: usize, const DT: u8>(
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
unsafe fn pv_block_z<const MB: usize, const NV: usize, const DT: u8>(
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
unsafe fn lanes_tile(
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

/// Max of a slice (empty: -inf).
#[target_feature(enable = "avx2,fma,f16c")]
fn vmax(x: &[f32]) -> f32 {
    let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut chunks = x.chunks_exact(8);
    for ch in &mut chunks {
        // SAFETY: ch has exactly 8 elements.
        m = _mm256_max_ps(m, unsafe { _mm256_loadu_ps(ch.as_ptr()) });
    }
    let h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
    let h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    let h = _mm_max_ss(h, _mm_shuffle_ps::<0x55>(h, h));
    chunks.remainder().iter().fold(_mm_cvtss_f32(h), |a, &b| a.max(b))
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
    // SAFETY: this function's target features include the AVX the sum uses.
    unsafe { hsum(sum) + tail }
}
