//! AVX2 + FMA (+ F16C) attention work unit for x86-64, in two builds of one body.
//!
//! | entry           | features                        | register blocks (qk: heads x keys, pv: heads x 8-col vectors) |
//! |-----------------|---------------------------------|---------------------------------------------------------------|
//! | `attend`        | avx2, fma, f16c (16 ymm)        | qk 4x2 / 3x2 / 2x4 / 1x8, pv 4x2 / 3x2 / 2x4 / 1x8           |
//! | `attend_avx512` | + avx512f, avx512vl, avx512bw (32 regs, EVEX) | qk 4x4 / 3x4 / 2x8 / 1x16 (ymm; with head_dim % 16 == 0: the same blocks of **zmm** chains, and 8x2 for a decode unit's 8+ vectors); pv with head_dim % 16 == 0: 4x4 / 3x4 / 2x8 / 1x8 16-col **zmm** vectors, 8x2 for 8+ (else ymm 4x4 / 3x4 / 2x8 / 1x16); decode and prefill alike |
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
//! | `attend_decode` f32/f16/bf16 | group <= 4 and one query row (decode) or rows x group <= 12 (20 with head_dim >= 256; verification) | widened in the FMA loops (vcvtph2ps, zext<<16), once per block of 4 query vectors (8 in zmm for 8+) |
//! | `attend` (widened)      | otherwise (prefill, chunked prefill)  | tile widened once to f32 scratch      |
//!
//! | file       | holds                                                                              |
//! |------------|------------------------------------------------------------------------------------|
//! | mod.rs     | this page, the two entries and their body: the decode / prefill choice, the prefill tile loop (each tile widened once) |
//! | decode.rs  | `attend_decode`: the K and V passes over a tile's blocks, the prefetch plan `Pf`   |
//! | prefill.rs | a widened tile against the unit's queries: `tile_heads` (per query), `lanes_tile` (queries as zmm lanes) |
//! | micro.rs   | the register-block micro-kernels: logits (`qk_block`, `qk_block_z`), `acc += p v` (`pv_block`, `pv_block_z`), their horizontal sums |
//! | common.rs  | element loads and widening, cache-line prefetch, the online-softmax helpers        |
//!
//! Requires head_dim % 8 == 0 (the dispatch in `attention/mod.rs` falls back to scalar otherwise).
//! Keys are taken in tiles of up to 64 tokens spanning consecutive table blocks. Decode: per tile,
//! one pass over K and one over V block by block (decode.rs). Prefill: per tile and KV head, the
//! tile is widened once and serves every row and query head of the unit (prefill.rs).
//! Micro-kernels: logits for MB query heads x TB keys with MB*TB independent FMA chains and
//! horizontal sums; `acc += p v` with MB x NV accumulators in registers (micro.rs).
//! Tolerance: max abs error 2e-5 from the scalar path for every ISA, dtype and path
//! (`attention/tests.rs`: random shapes, head_dim 8 to 256, windows, soft caps); against the float64
//! reference see `attention/mod.rs` (exp is `simd::x86::exp256`, a Cephes degree-5 polynomial, rel.
//! error ~2e-7).

mod common;
mod decode;
mod micro;
mod prefill;

use super::{Ctx, DType, State, Unit};
use common::{prefetch, widen};
use decode::attend_decode;
use prefill::{lanes_tile, tile_heads, transpose_queries};
use std::cell::Cell;

/// Keys per tile; a tile spans consecutive blocks of the table (one segment per block piece).
const TILE: usize = 64;
/// Query vectors per KV head (rows x group) up to which a unit of several rows takes the decode
/// path. Its cost grows with every vector (K/V widened once per block of 8 or 4), while the prefill
/// path's widened tile and 16 query lanes cost about the same for 1 to 16 vectors. With
/// head_dim 64 (SmolLM2, 700 keys) the decode path is ~1.5x faster at 6 vectors, ~1.2x at 9-12 and
/// ~10% slower at 15; with head_dim 256 (Gemma 3) the widened tiles outgrow L1 and the decode path
/// stays ~10% faster at 16 and 20 vectors. Head dims between keep the smaller bound.
#[inline]
fn few_rows_queries(head_dim: usize) -> usize {
    if head_dim >= 256 {
        20
    } else {
        12
    }
}

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

/// Per-thread prefill scratch, reused unit after unit (a unit writes every element it reads):
/// the widened K and V tiles, the transposed queries and the lanes' logits tiles.
#[derive(Default)]
struct Scratch {
    kbuf: Vec<f32>,
    vbuf: Vec<f32>,
    qt: Vec<f32>,
    sl: Vec<f32>,
}

thread_local! {
    static SCRATCH: Cell<Scratch> = Cell::new(Scratch::default());
}

/// The first `n` elements of `v`, grown (zeroed once) when shorter.
fn grown(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if v.len() < n {
        v.resize(n, 0.0);
    }
    &mut v[..n]
}

/// The unit's query vectors, pre-scaled, contiguous `[nq, d]` (row-major over rows, heads).
#[inline(always)]
fn scaled_queries(ctx: &Ctx, u: &Unit) -> Vec<f32> {
    let (d, pr) = (ctx.shape.head_dim, u.per_row(ctx.group));
    let scale = ctx.params.scale;
    let mut qbuf = vec![0.0f32; u.queries(ctx.group) * d];
    for (i, row) in (u.row0..u.row1).enumerate() {
        for (dst, src) in qbuf[i * pr * d..(i + 1) * pr * d].iter_mut().zip(ctx.q_row(row, u)) {
            *dst = src * scale;
        }
    }
    qbuf
}

/// The unit's query vectors, pre-scaled, contiguous `[nq, d]` in head-major order (KV head, row,
/// group head): the vectors of one KV head together, as `attend_decode` takes them. One row: the
/// unit's own order.
#[inline(always)]
fn head_major_queries(ctx: &Ctx, u: &Unit) -> Vec<f32> {
    let (g, d, rows) = (ctx.group, ctx.shape.head_dim, u.row1 - u.row0);
    let scale = ctx.params.scale;
    let mut qbuf = vec![0.0f32; u.queries(g) * d];
    let mut at = 0;
    for h in 0..u.h1 - u.h0 {
        for row in u.row0..u.row0 + rows {
            for (dst, src) in qbuf[at..at + g * d]
                .iter_mut()
                .zip(&ctx.q_row(row, u)[h * g * d..(h + 1) * g * d])
            {
                *dst = src * scale;
            }
            at += g * d;
        }
    }
    qbuf
}

/// `attend_decode` for the cache's element type.
///
/// # Safety
/// As `attend_decode`.
#[inline(always)]
unsafe fn attend_decode_dt<const WIDE: bool>(ctx: &Ctx, u: &Unit, st: &mut State, qbuf: &[f32]) {
    // SAFETY: same contract.
    unsafe {
        match ctx.k.dtype() {
            DType::F32 => attend_decode::<F32, WIDE>(ctx, u, st, qbuf),
            DType::F16 => attend_decode::<F16, WIDE>(ctx, u, st, qbuf),
            DType::Bf16 => attend_decode::<BF16, WIDE>(ctx, u, st, qbuf),
        }
    }
}

/// The body of `attend` / `attend_avx512`; `WIDE` picks the 32-register blocks. Inlined into
/// each entry point so that it and every micro-kernel are compiled for that entry's features.
///
/// # Safety
/// As `attend`; WIDE only when the CPU supports AVX-512 F, VL and BW.
#[inline(always)]
unsafe fn attend_body<const WIDE: bool>(ctx: &Ctx, u: &Unit, st: &mut State) {
    let g = ctx.group;
    let rows = u.row1 - u.row0;
    // Few query rows and small groups (decode, a speculative step's verification): widen K/V
    // inside the FMA loops, each element once per block of 4 (or 8) query vectors. Otherwise (prefill):
    // widen each tile once into f32 scratch.
    if g <= 4 && (rows == 1 || rows * g <= few_rows_queries(ctx.shape.head_dim)) {
        let qbuf = head_major_queries(ctx, u);
        if rows == 1 {
            // SAFETY: same contract as this function; one row: head-major is the unit's order.
            unsafe { attend_decode_dt::<WIDE>(ctx, u, st, &qbuf) };
            return;
        }
        let d = ctx.shape.head_dim;
        let mut hm = State::new(u.queries(g), d);
        // SAFETY: same contract as this function.
        unsafe { attend_decode_dt::<WIDE>(ctx, u, &mut hm, &qbuf) };
        // Back to the unit's order: vector (KV head h, row r, group head j) is m = r * nh * g + h * g + j.
        let (nh, rg) = (u.h1 - u.h0, rows * g);
        for (mh, (&mx, &sm)) in hm.max.iter().zip(&hm.sum).enumerate() {
            let (h, r, j) = (mh / rg, (mh % rg) / g, mh % g);
            let m = r * nh * g + h * g + j;
            st.max[m] = mx;
            st.sum[m] = sm;
            st.acc[m * d..(m + 1) * d].copy_from_slice(&hm.acc[mh * d..(mh + 1) * d]);
        }
        return;
    }
    // Taken and put back rather than borrowed in a closure: a closure is not compiled with this
    // entry's target features, and the kernels inlined into it would not be either.
    let mut sc = SCRATCH.take();
    // SAFETY: same contract as this function.
    unsafe { attend_tiles::<WIDE>(ctx, u, st, &mut sc) };
    SCRATCH.set(sc);
}

/// The prefill path of `attend_body`: the unit's keys tile by tile, each tile widened once.
///
/// # Safety
/// As `attend_body`.
#[inline(always)]
unsafe fn attend_tiles<const WIDE: bool>(ctx: &Ctx, u: &Unit, st: &mut State, sc: &mut Scratch) {
    let (g, d, bs) = (ctx.group, ctx.shape.head_dim, ctx.shape.block_size);
    // The AVX-512 build takes the unit's queries as vector lanes (`lanes_tile`) when head_dim is
    // a multiple of 16 and no soft cap applies: per KV head, its queries transposed once.
    let lanes = WIDE && d % 16 == 0 && ctx.params.soft_cap.is_none();
    let rows = u.row1 - u.row0;
    let lw = (rows * g).div_ceil(16) * 16;
    let nh = u.h1 - u.h0;
    // Rows of the widened tiles `ld` floats apart: for the lanes kernel one line more than
    // head_dim, so that a column block of the tile's rows spreads over the L1 sets (at a stride of
    // 1 KiB they fell into a quarter of them and evicted each other before their next use).
    let ld = if lanes { d + 16 } else { d };
    let kbuf = grown(&mut sc.kbuf, TILE * ld);
    let vbuf = grown(&mut sc.vbuf, TILE * ld);
    let (qt, sl, qbuf) = if lanes {
        let qt = grown(&mut sc.qt, nh * d * lw);
        for (hi, t) in qt.chunks_exact_mut(d * lw).enumerate() {
            // SAFETY: WIDE: AVX-512 F enabled and detected (`attend_avx512`); d % 16 == 0; t is
            // [d, lw] with lw = rows * group rounded up to 16.
            unsafe { transpose_queries(ctx, u, u.h0 + hi, ctx.params.scale, t, lw) };
        }
        (&*qt, grown(&mut sc.sl, TILE * 64), Vec::new())
    } else {
        (&[][..], &mut [][..], scaled_queries(ctx, u))
    };
    let mut s = [0.0f32; 4 * TILE];
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
                if ld == d {
                    widen(ctx.k, base, m * d, &mut kbuf[at * d..(at + m) * d]);
                    widen(ctx.v, base, m * d, &mut vbuf[at * d..(at + m) * d]);
                } else {
                    for r in 0..m {
                        let row = (at + r) * ld;
                        widen(ctx.k, base + r * d, d, &mut kbuf[row..row + d]);
                        widen(ctx.v, base + r * d, d, &mut vbuf[row..row + d]);
                    }
                }
                at += m;
            }
            let sg = [Seg {
                k: kbuf.as_ptr() as *const u8,
                v: vbuf.as_ptr() as *const u8,
                n,
            }];
            if lanes {
                // SAFETY: WIDE: AVX-512 F enabled and detected (`attend_avx512`); kbuf/vbuf hold n
                // rows of d f32, ld apart, written just above; qt[h - h0] is this head's [d, lw] transposed queries.
                unsafe {
                    lanes_tile(
                        ctx,
                        u,
                        st,
                        &qt[(h - u.h0) * d * lw..(h - u.h0 + 1) * d * lw],
                        lw,
                        &kbuf[..n * ld],
                        &vbuf[..n * ld],
                        ld,
                        t,
                        h,
                        sl,
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
