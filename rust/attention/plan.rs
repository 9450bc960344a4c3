//! Work split of one batch and the merge of split work (see the "Work split" notes in `mod.rs`).
//!
//! `plan` cuts a batch into items (one per sequence for decode-like rows, one per (sequence, KV
//! head, chunk of rows) for prefill) and, when items are fewer than `4 * threads`, splits each
//! item's key range on block boundaries; `run` computes every unit on the rayon pool and writes
//! whole items straight into `out`; split items are merged by log-sum-exp (`merge`) first. `Plan`
//! holds one batch's split, checked once, for every call with its window (the decoder's layers).

use super::{
    active_isa, attend, key_range, validate_batch, validate_caches, validate_queries, Batch, CacheShape, Ctx, Kv,
    Params, Queries, State,
};
use crate::error::{Error, Result};
use crate::runtime::{self, Isa};

/// Query vectors per item when prefill rows are chunked: rows * group <= this (and the bound on
/// decode-like sequences' query vectors, times 4).
const ITEM_QUERIES: usize = 64;
/// Prefill items take twice as many rows when that still leaves 4 items per thread: each widened
/// K/V tile then serves twice the queries.
const WIDE_ITEM_QUERIES: usize = 2 * ITEM_QUERIES;
/// Split the key range only while a piece keeps at least this many keys.
const MIN_SPLIT_KEYS: usize = 256;

/// One unit of work: query rows `row0..row1` (all of one sequence) times the query heads of KV
/// heads `h0..h1`, over key positions `key_lo..key_hi` of that sequence. Query vector `m` of a
/// unit is row `row0 + m / (nh * group)`, query head `h0 * group + m % (nh * group)`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Unit {
    pub seq: usize,
    pub h0: usize,
    pub h1: usize,
    pub row0: usize,
    pub row1: usize,
    /// Position of row `row0`; row r sits at `pos0 + (r - row0)`.
    pub pos0: usize,
    pub key_lo: usize,
    pub key_hi: usize,
}

impl Unit {
    /// Query vectors per row.
    #[inline]
    pub fn per_row(&self, group: usize) -> usize {
        (self.h1 - self.h0) * group
    }
    #[inline]
    pub fn queries(&self, group: usize) -> usize {
        (self.row1 - self.row0) * self.per_row(group)
    }
}

/// Items (then their key-range splits when items are fewer than 4 per thread).
/// Returns units grouped per item: `units[i]` are the pieces of item i.
pub(super) fn plan(
    b: &Batch,
    shape: &CacheShape,
    group: usize,
    window: Option<usize>,
    threads: usize,
) -> Vec<Vec<Unit>> {
    let target = 4 * threads;
    let mut items = items_of(b, shape, group, window, WIDE_ITEM_QUERIES);
    if items.len() < target {
        items = items_of(b, shape, group, window, ITEM_QUERIES);
    }
    if items.is_empty() || items.len() >= target {
        return items.into_iter().map(|u| vec![u]).collect();
    }
    let want = target.div_ceil(items.len());
    let bs = shape.block_size;
    items
        .into_iter()
        .map(|u| {
            let n = u.key_hi - u.key_lo;
            let pieces = want.min(n / MIN_SPLIT_KEYS).max(1);
            if pieces == 1 {
                return vec![u];
            }
            // Cut points rounded to block boundaries so no tile straddles two pieces' blocks.
            let mut cuts = vec![u.key_lo];
            for j in 1..pieces {
                let c = (u.key_lo + n * j / pieces) / bs * bs;
                if c > *cuts.last().unwrap_or(&0) && c < u.key_hi {
                    cuts.push(c);
                }
            }
            cuts.push(u.key_hi);
            cuts.windows(2)
                .map(|w| Unit {
                    key_lo: w[0],
                    key_hi: w[1],
                    ..u
                })
                .collect()
        })
        .collect()
}

/// One unit per decode-like sequence, else per (sequence, KV head, chunk of rows with at most
/// `queries` query vectors).
fn items_of(b: &Batch, shape: &CacheShape, group: usize, window: Option<usize>, queries: usize) -> Vec<Unit> {
    let rows_per = (queries / group).max(1);
    let mut items = Vec::new();
    for seq in 0..b.seq_lens.len() {
        let (r0, r1) = (b.query_start_loc[seq] as usize, b.query_start_loc[seq + 1] as usize);
        let seq_len = b.seq_lens[seq] as usize;
        let first_pos = seq_len - (r1 - r0);
        // Few rows (decode): one unit reads whole blocks (all KV heads: one contiguous stretch
        // of K and one of V per block). Many rows (prefill): one unit per KV head and row chunk.
        let hkv = shape.num_kv_heads;
        let (step, rows_per) = if (r1 - r0) * hkv * group <= ITEM_QUERIES * 4 {
            (hkv, r1 - r0)
        } else {
            (1, rows_per)
        };
        for h0 in (0..hkv).step_by(step) {
            let mut r = r0;
            while r < r1 {
                let re = (r + rows_per).min(r1);
                let pos0 = first_pos + (r - r0);
                let (key_lo, _) = key_range(window, pos0, 0, seq_len);
                let key_hi = pos0 + (re - r);
                items.push(Unit {
                    seq,
                    h0,
                    h1: h0 + step,
                    row0: r,
                    row1: re,
                    pos0,
                    key_lo,
                    key_hi,
                });
                r = re;
            }
        }
    }
    items
}

/// The step's work split for one attention window: built once per step (the decoder builds one
/// per distinct window of its layers) from a checked batch, then run by every layer with that window.
pub struct Plan<'a> {
    batch: Batch<'a>,
    shape: CacheShape,
    group: usize,
    window: Option<usize>,
    /// Work units grouped per item (`plan.rs`).
    units: Vec<Vec<Unit>>,
}

impl<'a> Plan<'a> {
    /// Check `batch` against the cache geometry (`num_tokens` query rows, `num_q_heads` query
    /// heads) and split its work for `threads` threads under `window`.
    pub fn new(
        batch: Batch<'a>,
        shape: CacheShape,
        num_tokens: usize,
        num_q_heads: usize,
        window: Option<usize>,
        threads: usize,
    ) -> Result<Self> {
        shape.numel()?;
        if num_q_heads == 0 || !num_q_heads.is_multiple_of(shape.num_kv_heads) {
            return Err(Error::Invalid(format!(
                "num_q_heads ({num_q_heads}) must be a positive multiple of num_kv_heads ({})",
                shape.num_kv_heads
            )));
        }
        validate_batch(&shape, &batch, num_tokens)?;
        Ok(Self::checked(
            batch,
            shape,
            num_q_heads / shape.num_kv_heads,
            window,
            threads,
        ))
    }

    /// `new` for a batch `validate_batch` accepted.
    pub(super) fn checked(
        batch: Batch<'a>,
        shape: CacheShape,
        group: usize,
        window: Option<usize>,
        threads: usize,
    ) -> Self {
        let units = plan(&batch, &shape, group, window, threads);
        Plan {
            batch,
            shape,
            group,
            window,
            units,
        }
    }

    /// The sliding window this plan was split for.
    pub fn window(&self) -> Option<usize> {
        self.window
    }

    /// `paged_attention` of one layer's queries `q` over the planned batch; `params` must carry
    /// the plan's window.
    pub fn attend(&self, k: Kv, v: Kv, q: Queries, params: Params, out: &mut [f32]) -> Result<()> {
        let isa = active_isa(self.shape.head_dim)?;
        runtime::pool()?.install(|| run_planned(isa, k, v, self, q, params, out))
    }
}

/// Run a plan on checked caches and queries of its batch.
pub(super) fn run_planned(
    isa: Isa,
    k: Kv,
    v: Kv,
    plan: &Plan,
    q: Queries,
    params: Params,
    out: &mut [f32],
) -> Result<()> {
    let shape = plan.shape;
    validate_caches(&k, &v, &shape)?;
    let num_tokens = validate_queries(&shape, &q, out.len())?;
    let planned_tokens = plan.batch.query_start_loc.last().copied().unwrap_or(0) as usize;
    if num_tokens != planned_tokens || q.num_heads / shape.num_kv_heads != plan.group {
        return Err(Error::Invalid(format!(
            "q is [{num_tokens}, {}] but the plan is for {planned_tokens} tokens of {} query heads",
            q.num_heads,
            plan.group * shape.num_kv_heads
        )));
    }
    if params.sliding_window != plan.window {
        return Err(Error::Invalid(format!(
            "sliding_window {:?} but the plan was split for {:?}",
            params.sliding_window, plan.window
        )));
    }
    assert!(isa.available(), "{isa:?} is not supported by this CPU");
    let isa = if !shape.head_dim.is_multiple_of(8) {
        Isa::Scalar
    } else {
        isa
    };
    let ctx = Ctx {
        k,
        v,
        shape,
        batch: plan.batch,
        q,
        params,
        group: plan.group,
    };
    run(isa, &ctx, &plan.units, out);
    Ok(())
}

/// Raw `out` pointer shared by the workers; each unit writes a disjoint set of (row, head) vectors.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: the pointer is only used to write the disjoint regions described in `write_out`.
unsafe impl Send for OutPtr {}
// SAFETY: as above; no two threads write the same element.
unsafe impl Sync for OutPtr {}

/// Write normalised rows of one item into out.
///
/// # Safety
/// `out` points to `num_tokens * num_q_heads * head_dim` f32 and no other thread writes the
/// (row0..row1, heads of h0..h1) vectors of this item concurrently.
unsafe fn write_out(ctx: &Ctx, u: &Unit, acc: &[f32], sum: &[f32], out: OutPtr) {
    let (g, d) = (ctx.group, ctx.shape.head_dim);
    let pr = u.per_row(g);
    for (i, row) in (u.row0..u.row1).enumerate() {
        let base = (row * ctx.q.num_heads + u.h0 * g) * d;
        // SAFETY: base + pr*d <= num_tokens*hq*d since row < num_tokens and h1*g <= hq
        // (validated); exclusivity per the function contract.
        let dst = unsafe { std::slice::from_raw_parts_mut(out.0.add(base), pr * d) };
        for h in 0..pr {
            let m = i * pr + h;
            let inv = if sum[m] > 0.0 { 1.0 / sum[m] } else { 0.0 };
            for (o, a) in dst[h * d..(h + 1) * d].iter_mut().zip(&acc[m * d..(m + 1) * d]) {
                *o = a * inv;
            }
        }
    }
}

pub(super) fn run(isa: Isa, ctx: &Ctx, units: &[Vec<Unit>], out: &mut [f32]) {
    use rayon::prelude::*;
    let d = ctx.shape.head_dim;
    let optr = OutPtr(out.as_mut_ptr());
    // (item, piece, unit), costliest first: a thread's last units are then cheap ones, so at the
    // end neither thread waits long for the other (a causal prefill's row chunks differ in keys
    // as much as in number).
    let mut flat: Vec<(usize, usize, Unit)> = units
        .iter()
        .enumerate()
        .flat_map(|(i, us)| us.iter().enumerate().map(move |(p, u)| (i, p, *u)))
        .collect();
    flat.sort_by_key(|&(_, _, u)| std::cmp::Reverse((u.key_hi - u.key_lo) * u.queries(ctx.group)));
    let mut partials: Vec<(usize, usize, State)> = flat
        .par_iter()
        .with_max_len(1)
        .filter_map(|&(i, p, u)| {
            let mut st = State::new(u.queries(ctx.group), d);
            attend(isa, ctx, &u, &mut st);
            if units[i].len() == 1 {
                // SAFETY: `out` has the validated length and items cover disjoint (row, head) sets.
                unsafe { write_out(ctx, &u, &st.acc, &st.sum, optr) };
                None
            } else {
                Some((i, p, st))
            }
        })
        .collect();
    // Pieces back in order, so that the merges add them in one order whatever ran first.
    partials.sort_by_key(|&(i, p, _)| (i, p));
    // Log-sum-exp merge of split items (few by construction).
    let mut merged: Vec<Option<State>> = (0..units.len()).map(|_| None).collect();
    for (i, _, st) in partials {
        match &mut merged[i] {
            None => merged[i] = Some(st),
            Some(m) => merge(m, &st, d),
        }
    }
    for (i, st) in merged.into_iter().enumerate() {
        if let Some(st) = st {
            // SAFETY: sequential here; same region argument as above.
            unsafe { write_out(ctx, &units[i][0], &st.acc, &st.sum, optr) };
        }
    }
}

/// `a <- a (+) b` in log-sum-exp form.
fn merge(a: &mut State, b: &State, d: usize) {
    for m in 0..a.max.len() {
        let mx = a.max[m].max(b.max[m]);
        if mx == f32::NEG_INFINITY {
            continue;
        }
        let wa = (a.max[m] - mx).exp();
        let wb = (b.max[m] - mx).exp();
        a.sum[m] = a.sum[m] * wa + b.sum[m] * wb;
        for (x, y) in a.acc[m * d..(m + 1) * d].iter_mut().zip(&b.acc[m * d..(m + 1) * d]) {
            *x = *x * wa + *y * wb;
        }
        a.max[m] = mx;
    }
}
