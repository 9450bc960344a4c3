//! The decoder stack over the paged KV cache, for one engine step of `T` tokens: one code path for
//! every architecture (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 3), which differ only in the data
//! each layer carries (optional parts in brackets).
//!
//! Per layer, for the step's tokens `x [T, H]` (the residual stream, updated in place):
//!
//! ```text
//! h    = rms_norm(x, attn_norm)                  (fused with the previous layer's residual add)
//! qkv  = h · Wqkvᵀ (+ bqkv)                      [T, (Hq + 2 Hkv) D]; Hq D need not equal H
//! q, k = [rms_norm per head (q_norm, k_norm)]    Qwen3, Gemma 3
//! q, k = rope(q), rope(k)                        the layer's table's cos/sin rows at each position
//! write_kv(k, v) at slot_mapping; o = paged_attention(q, scale, the layer's window)   [T, Hq, D]
//! o    = o · Woᵀ  [then rms_norm(o, post_attn_norm)]                                  Gemma 3
//! h    = rms_norm(o, ffn_norm, residual = x)                       (x += attention output)
//! delta = act(h · Wgateᵀ) * (h · Wupᵀ) · Wdownᵀ  [then rms_norm(delta, post_ffn_norm)]
//!                                                (act: SiLU or GELU-tanh; added by the next norm)
//! ```
//!
//! Geometry comes from the weights: `H` = the QKV input width, `F` = half of `w_gate_up`'s rows;
//! `Hq`, `Hkv` and `D` are given (the fused QKV rows cannot tell them apart). RoPE's cos/sin rows
//! come with each step beside its batch (`rope`, one `[T, D/2]` pair per base: any scaling and each
//! layer's base live in them, and no `[max_len, D/2]` table is held here); `RopeMode::Half` rotates `(x[i], x[i + D/2])`, `Adjacent` rotates `(x[2i], x[2i + 1])`. Each
//! product is the multiply then the subtraction/addition in f32 (no fused multiply-add), as numpy
//! computes it.
//!
//! The step's batch is `attention::Batch` (the arrays of `BatchInputs`), checked once per step; the
//! attention work split is planned once per step for each distinct window of the layers
//! (`attention::Plan`) and reused by every layer with that window.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::team::{with_team, Team};
use crate::attention::{self, Batch, CacheShape, Kv, KvMut, Params, Plan, Queries};
use crate::error::{Error, Result};
use crate::linear::{self, Product, QWeight};
use crate::ops::Activation;
use crate::{ops, runtime};

/// Steps of at most this many tokens run their products on the step team (`team.rs`); larger
/// ones (prefill) hand them to rayon (their products are long enough to amortize a worker's
/// wake-up, and work stealing balances them better on a busy machine). Up to 32 tokens (decode at
/// 32 sequences) the team's steps are shorter than rayon's; at 8 they are the same.
pub const TEAM_MAX_TOKENS: usize = 32;
/// Rows per parallel job of the per-row pass after the QKV product (norms, RoPE, V copy); steps
/// of at most this many tokens run it on the calling thread.
const PREP_ROWS: usize = 32;

/// Which elements RoPE rotates together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeMode {
    /// `(x[i], x[i + D/2])` (Hugging Face's rotate-half).
    Half,
    /// `(x[2i], x[2i + 1])` (GGUF row order).
    Adjacent,
}

impl RopeMode {
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "half" => Ok(RopeMode::Half),
            "adjacent" => Ok(RopeMode::Adjacent),
            _ => Err(Error::Invalid(format!(
                "rope_mode must be 'half' or 'adjacent', got {name:?}"
            ))),
        }
    }
}

/// One decoder layer's weights.
#[derive(Clone)]
pub struct Layer {
    pub attn_norm: Vec<f32>,
    /// `[(Hq + 2 Hkv) D, H]`: query, key, value rows.
    pub wqkv: Arc<QWeight>,
    /// `[(Hq + 2 Hkv) D]` (Qwen2), `None` for Llama.
    pub bqkv: Option<Vec<f32>>,
    /// `[H, Hq D]`.
    pub wo: Arc<QWeight>,
    pub ffn_norm: Vec<f32>,
    /// `[2F, H]`: gate rows, then up rows.
    pub w_gate_up: Arc<QWeight>,
    /// `[H, F]`.
    pub w_down: Arc<QWeight>,
    /// `[D]`: RMSNorm of each query / key head before RoPE (Qwen3, Gemma 3).
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    /// `[H]`: RMSNorm of the attention / FFN output before its residual add (Gemma 3).
    pub post_attn_norm: Option<Vec<f32>>,
    pub post_ffn_norm: Option<Vec<f32>>,
    /// Index of this layer's RoPE rows in the step's `rope` (Gemma 3's local and global layers have
    /// their own bases).
    pub rope_table: usize,
    /// Attend only the last `w` positions, the query's own included (local layers).
    pub sliding_window: Option<usize>,
}

/// The step's RoPE rows for one base: `cos`, `sin` `[T, D/2]` each, row `r` at token `r`'s position.
#[derive(Clone, Copy)]
pub struct RopeRows<'a> {
    pub cos: &'a [f32],
    pub sin: &'a [f32],
}

/// The decoder stack: layers, RoPE tables and the numbers they need.
pub struct Decoder {
    layers: Vec<Layer>,
    /// How many RoPE row pairs a step brings (`Layer::rope_table` indexes them).
    num_ropes: usize,
    rope: RopeMode,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    hidden: usize,
    ffn: usize,
    eps: f32,
    act: Activation,
    /// Attention logits scale (`None`: `1/sqrt(D)`).
    attn_scale: Option<f64>,
    head: Option<Head>,
}

/// The output head: the final RMSNorm and the vocabulary projection `[V, H]`.
pub struct Head {
    pub norm: Vec<f32>,
    /// `[V, H]` as consecutive row chunks (vocabulary slices): a large head is built chunk by chunk
    /// so its file pages can be dropped as it goes; each chunk's logits are the same bits as one matrix's.
    pub lm_head: Vec<Arc<QWeight>>,
}

impl Head {
    fn vocab(&self) -> usize {
        self.lm_head.iter().map(|w| w.n()).sum()
    }
}

impl Decoder {
    /// Check every layer's shapes against the first layer, `head_dim` and the `num_ropes` RoPE row
    /// pairs each step brings.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        layers: Vec<Layer>,
        num_ropes: usize,
        head_dim: usize,
        rope: RopeMode,
        num_heads: usize,
        num_kv_heads: usize,
        eps: f32,
        act: Activation,
        attn_scale: Option<f64>,
    ) -> Result<Self> {
        let bad = |m: String| Err(Error::Invalid(m));
        let Some(first) = layers.first() else {
            return bad("a decoder needs at least one layer".into());
        };
        if num_ropes == 0 {
            return bad("a decoder needs at least one RoPE table".into());
        }
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return bad(format!("head_dim must be even and positive, got {head_dim}"));
        }
        if let Some(s) = attn_scale {
            if !(s.is_finite() && s > 0.0) {
                return bad(format!("attn_scale must be finite and > 0, got {s}"));
            }
        }
        if num_heads == 0 || num_kv_heads == 0 || !num_heads.is_multiple_of(num_kv_heads) {
            return bad(format!(
                "num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})"
            ));
        }
        if !(eps >= 0.0 && eps.is_finite()) {
            return bad(format!("rms_eps must be finite and >= 0, got {eps}"));
        }
        let (d, h) = (head_dim, first.wqkv.k());
        let (nq, nkv) = (num_heads * d, num_kv_heads * d);
        let ffn = first.w_gate_up.n() / 2;
        for (i, l) in layers.iter().enumerate() {
            let checks = [
                ("attn_norm", (l.attn_norm.len(), 1), (h, 1)),
                ("ffn_norm", (l.ffn_norm.len(), 1), (h, 1)),
                ("wqkv", (l.wqkv.n(), l.wqkv.k()), (nq + 2 * nkv, h)),
                ("wo", (l.wo.n(), l.wo.k()), (h, nq)),
                ("w_gate_up", (l.w_gate_up.n(), l.w_gate_up.k()), (2 * ffn, h)),
                ("w_down", (l.w_down.n(), l.w_down.k()), (h, ffn)),
            ];
            for (name, got, want) in checks {
                if got != want {
                    return bad(format!(
                        "layer {i}: {name} is {got:?}, expected {want:?} (hidden {h}, {num_heads} query and \
                         {num_kv_heads} KV heads of {d}, ffn {ffn}; (n, k) for weights, (len, 1) for norms)"
                    ));
                }
            }
            if let Some(b) = &l.bqkv {
                if b.len() != nq + 2 * nkv {
                    return bad(format!(
                        "layer {i}: bqkv has {} values, expected {}",
                        b.len(),
                        nq + 2 * nkv
                    ));
                }
            }
            if ffn == 0 {
                return bad(format!("layer {i}: w_gate_up needs an even, positive number of rows"));
            }
            let optional = [
                ("q_norm", &l.q_norm, d),
                ("k_norm", &l.k_norm, d),
                ("post_attn_norm", &l.post_attn_norm, h),
                ("post_ffn_norm", &l.post_ffn_norm, h),
            ];
            for (name, v, want) in optional {
                if let Some(v) = v {
                    if v.len() != want {
                        return bad(format!("layer {i}: {name} has {} values, expected {want}", v.len()));
                    }
                }
            }
            if l.rope_table >= num_ropes {
                return bad(format!(
                    "layer {i}: rope_table {} is not one of the {num_ropes} tables",
                    l.rope_table
                ));
            }
            if l.sliding_window == Some(0) {
                return bad(format!("layer {i}: sliding_window must be >= 1"));
            }
        }
        Ok(Decoder {
            layers,
            num_ropes,
            rope,
            num_heads,
            num_kv_heads,
            head_dim: d,
            hidden: h,
            ffn,
            eps,
            act,
            attn_scale,
            head: None,
        })
    }

    /// Attach the output head (`forward_logits` needs it): `norm [H]`, `lm_head [V, H]`.
    pub fn with_head(mut self, head: Head) -> Result<Self> {
        let h = self.hidden;
        let k = head.lm_head.iter().map(|w| w.k()).find(|&k| k != h).unwrap_or(h);
        if head.norm.len() != h || k != h || head.lm_head.is_empty() {
            return Err(Error::Invalid(format!(
                "the head needs final_norm [{h}] and lm_head [V, {h}], got final_norm [{}] and lm_head [{}, {k}]",
                head.norm.len(),
                head.vocab(),
            )));
        }
        self.head = Some(head);
        Ok(self)
    }

    /// Rows of the output head (the vocabulary), `None` without a head.
    pub fn vocab_size(&self) -> Option<usize> {
        self.head.as_ref().map(Head::vocab)
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }
    pub fn hidden_size(&self) -> usize {
        self.hidden
    }
    pub fn num_heads(&self) -> usize {
        self.num_heads
    }
    pub fn num_kv_heads(&self) -> usize {
        self.num_kv_heads
    }
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }
    pub fn intermediate_size(&self) -> usize {
        self.ffn
    }
    /// How many RoPE row pairs each step brings.
    pub fn num_rope_tables(&self) -> usize {
        self.num_ropes
    }

    /// Run every layer over the step: `x [T, H]` is the embedded tokens on entry and the residual
    /// stream after the last layer (before the final norm) on return. `caches` are one
    /// `(k_cache, v_cache)` per layer, all of `shape`.
    ///
    /// `spin`: the other kernel threads spin (running any job the step hands out) for the whole
    /// call instead of parking between its ~10 products per layer (see `with_spinning_workers`).
    pub fn forward_hidden(
        &self,
        x: &mut [f32],
        batch: &Batch,
        rope: &[RopeRows],
        caches: &mut [(KvMut, KvMut)],
        shape: CacheShape,
        spin: bool,
    ) -> Result<()> {
        self.forward_then(x, batch, rope, caches, shape, spin, |_, _| Ok(()))
    }

    /// `forward_hidden`, then the head in the same call: `logits [N, V]` of the rows `rows` (each
    /// below `T`) of the final residual stream, `lm_head · rms_norm(x[rows], final_norm)`.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_logits(
        &self,
        x: &mut [f32],
        batch: &Batch,
        rope: &[RopeRows],
        caches: &mut [(KvMut, KvMut)],
        shape: CacheShape,
        rows: &[usize],
        spin: bool,
        logits: &mut [f32],
    ) -> Result<()> {
        let bad = |m: String| Err(Error::Invalid(m));
        let Some(head) = &self.head else {
            return bad("this decoder has no head (build it with final_norm and lm_head)".into());
        };
        let (t, h, v) = (batch.positions.len(), self.hidden, head.vocab());
        if let Some((i, &r)) = rows.iter().enumerate().find(|(_, &r)| r >= t) {
            return bad(format!(
                "logits row {i} is token {r}, not in [0, {t}) (the step's tokens)"
            ));
        }
        if logits.len() != rows.len() * v {
            return bad(format!(
                "logits must be [{}, {v}], got {} values",
                rows.len(),
                logits.len()
            ));
        }
        self.forward_then(x, batch, rope, caches, shape, spin, |x, mm| {
            let mut last = Vec::with_capacity(rows.len() * h);
            for &r in rows {
                last.extend_from_slice(&x[r * h..][..h]);
            }
            let mut hn = vec![0f32; last.len()];
            ops::rms_norm(&last, h, &head.norm, self.eps, None, &mut hn)?;
            if let [w] = head.lm_head.as_slice() {
                return mm.linear(&hn, rows.len(), w, logits);
            }
            // Chunk by chunk straight into its columns of the logits (rows `v` apart).
            let mut at = 0;
            for w in &head.lm_head {
                mm.linear_strided(&hn, rows.len(), w, &mut logits[at..], v)?;
                at += w.n();
            }
            Ok(())
        })
    }

    /// Check, plan, run every layer, then `tail(x)` on the residual stream, all on the kernel pool
    /// (inside one spinning region when `spin`).
    #[allow(clippy::too_many_arguments)]
    fn forward_then(
        &self,
        x: &mut [f32],
        b: &Batch,
        rope: &[RopeRows],
        caches: &mut [(KvMut, KvMut)],
        shape: CacheShape,
        spin: bool,
        tail: impl FnOnce(&[f32], Mm) -> Result<()> + Send,
    ) -> Result<()> {
        let t = b.positions.len();
        self.check(x, b, rope, caches.len(), shape)?;
        // The attention inputs are checked (in the plans) before the first cache write, so a bad
        // batch leaves the caches as they were.
        let pool = runtime::pool()?;
        let threads = pool.current_num_threads();
        let mut plans: Vec<Plan> = Vec::with_capacity(1);
        for l in &self.layers {
            if !plans.iter().any(|p| p.window() == l.sliding_window) {
                plans.push(Plan::new(*b, shape, t, self.num_heads, l.sliding_window, threads)?);
            }
        }
        for (kc, vc) in caches.iter() {
            attention::validate_caches(&view(kc), &view(vc), &shape)?;
        }
        if t == 0 {
            return tail(x, Mm::Rayon);
        }
        if t <= TEAM_MAX_TOKENS && threads > 1 && !spin {
            let isa = linear::active_isa()?;
            return with_team(&pool, |team| {
                let mm = Mm::Team(team, isa);
                self.run(x, b, rope, &plans, caches, shape, mm)?;
                tail(x, mm)
            });
        }
        let body = || -> Result<()> {
            self.run(x, b, rope, &plans, caches, shape, Mm::Rayon)?;
            tail(x, Mm::Rayon)
        };
        pool.install(|| if spin { with_spinning_workers(body) } else { body() })
    }

    fn check(&self, x: &[f32], b: &Batch, rope: &[RopeRows], num_caches: usize, shape: CacheShape) -> Result<()> {
        let bad = |m: String| Err(Error::Invalid(m));
        let t = b.positions.len();
        if x.len() != t * self.hidden {
            return bad(format!(
                "x must be [{t}, {}] (one row per position), got {} values",
                self.hidden,
                x.len()
            ));
        }
        if b.slot_mapping.len() != t {
            return bad(format!(
                "slot_mapping must have {t} entries (one per token), got {}",
                b.slot_mapping.len()
            ));
        }
        if let Some((i, &p)) = b.positions.iter().enumerate().find(|(_, &p)| p < 0) {
            return bad(format!("positions[{i}] = {p} is negative"));
        }
        let half = self.head_dim / 2;
        if rope.len() != self.num_ropes {
            return bad(format!(
                "the step needs {} RoPE (cos, sin) row pairs, got {}",
                self.num_ropes,
                rope.len()
            ));
        }
        for (i, r) in rope.iter().enumerate() {
            if r.cos.len() != t * half || r.sin.len() != t * half {
                return bad(format!(
                    "rope[{i}]: cos and sin must be [{t}, {half}] (tokens, head_dim/2), got {} and {} values",
                    r.cos.len(),
                    r.sin.len()
                ));
            }
        }
        if num_caches != self.layers.len() {
            return bad(format!(
                "need {} (k_cache, v_cache) pairs, one per layer, got {num_caches}",
                self.layers.len()
            ));
        }
        if shape.num_kv_heads != self.num_kv_heads || shape.head_dim != self.head_dim {
            return bad(format!(
                "caches must be [num_blocks, {}, block_size, {}] (num_kv_heads, head_dim), got [{}, {}, {}, {}]",
                self.num_kv_heads,
                self.head_dim,
                shape.num_blocks,
                shape.num_kv_heads,
                shape.block_size,
                shape.head_dim
            ));
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        x: &mut [f32],
        b: &Batch,
        rope: &[RopeRows],
        plans: &[Plan],
        caches: &mut [(KvMut, KvMut)],
        shape: CacheShape,
        mm: Mm,
    ) -> Result<()> {
        let t = b.positions.len();
        let (h, d, f) = (self.hidden, self.head_dim, self.ffn);
        let (nq, nkv) = (self.num_heads * d, self.num_kv_heads * d);
        let mut hn = vec![0f32; t * h];
        let mut qkv = vec![0f32; t * (nq + 2 * nkv)];
        let mut q = vec![0f32; t * nq];
        let (mut k, mut v) = (vec![0f32; t * nkv], vec![0f32; t * nkv]);
        let mut attn = vec![0f32; t * nq];
        let mut o = vec![0f32; t * h];
        let mut o2 = vec![
            0f32;
            if self
                .layers
                .iter()
                .any(|l| l.post_attn_norm.is_some() || l.post_ffn_norm.is_some())
            {
                t * h
            } else {
                0
            }
        ];
        let mut gu = vec![0f32; t * 2 * f];
        let mut act = vec![0f32; t * f];
        let mut delta = vec![0f32; t * h];
        for (i, (layer, (kc, vc))) in self.layers.iter().zip(caches.iter_mut()).enumerate() {
            let params = Params::new(d, self.attn_scale, layer.sliding_window.map(|w| w as i64), None)?;
            if i == 0 {
                ops::rms_norm(x, h, &layer.attn_norm, self.eps, None, &mut hn)?;
            } else {
                ops::rms_norm(&delta, h, &layer.attn_norm, self.eps, Some(x), &mut hn)?;
            }
            mm.linear(&hn, t, &layer.wqkv, &mut qkv)?;
            if let Some(bias) = &layer.bqkv {
                for row in qkv.chunks_exact_mut(nq + 2 * nkv) {
                    for (a, &c) in row.iter_mut().zip(bias) {
                        *a += c;
                    }
                }
            }
            // Each row's query and key heads (per-head normed first: Qwen3, Gemma 3) rotated into
            // q and k, its values copied into v: one pass over qkv, in parallel jobs of rows.
            let table = &rope[layer.rope_table];
            let w = nq + 2 * nkv;
            let prep = |r0: usize, q: &mut [f32], k: &mut [f32], v: &mut [f32]| -> Result<()> {
                let mut normed = vec![0f32; nq.max(nkv)];
                let rows = q
                    .chunks_exact_mut(nq)
                    .zip(k.chunks_exact_mut(nkv))
                    .zip(v.chunks_exact_mut(nkv));
                for (i, ((qr, kr), vr)) in rows.enumerate() {
                    let r = r0 + i;
                    let row = &qkv[r * w..][..w];
                    let (c, s) = (&table.cos[r * d / 2..][..d / 2], &table.sin[r * d / 2..][..d / 2]);
                    for (src, dst, norm, n) in [
                        (&row[..nq], qr, &layer.q_norm, nq),
                        (&row[nq..nq + nkv], kr, &layer.k_norm, nkv),
                    ] {
                        match norm {
                            Some(nw) => {
                                ops::rms_norm_local(src, d, nw, self.eps, None, &mut normed[..n])?;
                                rope_heads(&normed[..n], dst, d, c, s, self.rope);
                            }
                            None => rope_heads(src, dst, d, c, s, self.rope),
                        }
                    }
                    vr.copy_from_slice(&row[nq + nkv..]);
                }
                Ok(())
            };
            if t > PREP_ROWS {
                use rayon::prelude::*;
                q.par_chunks_mut(PREP_ROWS * nq)
                    .zip(k.par_chunks_mut(PREP_ROWS * nkv))
                    .zip(v.par_chunks_mut(PREP_ROWS * nkv))
                    .enumerate()
                    .try_for_each(|(j, ((q, k), v))| prep(j * PREP_ROWS, q, k, v))?;
            } else {
                prep(0, &mut q, &mut k, &mut v)?;
            }
            attention::write_kv(reborrow(kc), reborrow(vc), shape, &k, &v, b.slot_mapping)?;
            let plan = plans
                .iter()
                .find(|p| p.window() == layer.sliding_window)
                .ok_or_else(|| Error::Invalid(format!("layer {i}: no attention plan for its window")))?;
            let queries = Queries {
                q: &q,
                num_heads: self.num_heads,
            };
            plan.attend(view(kc), view(vc), queries, params, &mut attn)?;
            mm.linear(&attn, t, &layer.wo, &mut o)?;
            let o_in = match &layer.post_attn_norm {
                Some(w) => {
                    ops::rms_norm(&o, h, w, self.eps, None, &mut o2)?;
                    &o2
                }
                None => &o,
            };
            ops::rms_norm(o_in, h, &layer.ffn_norm, self.eps, Some(x), &mut hn)?;
            mm.linear(&hn, t, &layer.w_gate_up, &mut gu)?;
            ops::act_and_mul(&gu, f, self.act, &mut act)?;
            mm.linear(&act, t, &layer.w_down, &mut delta)?;
            if let Some(w) = &layer.post_ffn_norm {
                ops::rms_norm(&delta, h, w, self.eps, None, &mut o2)?;
                std::mem::swap(&mut delta, &mut o2);
            }
        }
        for (a, &c) in x.iter_mut().zip(&delta) {
            *a += c;
        }
        Ok(())
    }
}

/// Who runs a step's weight products: rayon's pool, or the step team (the same bits either way).
#[derive(Clone, Copy)]
enum Mm<'t> {
    Rayon,
    Team(&'t Team, runtime::Isa),
}

impl Mm<'_> {
    fn linear(self, x: &[f32], m: usize, w: &QWeight, out: &mut [f32]) -> Result<()> {
        match self {
            Mm::Rayon => linear::linear(x, m, w, out),
            Mm::Team(team, isa) => team.run(&Product::new(isa, x, m, w, out, team.threads())?),
        }
    }

    /// `linear` into rows `ld` floats apart (`Product::strided`).
    fn linear_strided(self, x: &[f32], m: usize, w: &QWeight, out: &mut [f32], ld: usize) -> Result<()> {
        match self {
            Mm::Rayon => linear::linear_strided(x, m, w, out, ld),
            Mm::Team(team, isa) => team.run(&Product::strided(isa, x, m, w, out, ld, team.threads())?),
        }
    }
}

/// Run `f` on the current pool thread while every other thread of the pool spins in
/// `rayon::yield_now` (executing whatever jobs `f`'s parallel loops hand out) instead of going to
/// sleep between them: a parked rayon worker takes tens of microseconds to wake, and a decode
/// step of a small model is a few hundred products of 10-30 us each.
///
/// A spinner that lands on the calling thread itself (it pops one from its own deque while it
/// waits inside a join) returns at once, so `f` always finishes and sets the flag.
fn with_spinning_workers<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    let others = rayon::current_num_threads().saturating_sub(1);
    let owner = rayon::current_thread_index();
    if others == 0 || owner.is_none() {
        return f();
    }
    let done = AtomicBool::new(false);
    let mut out = None;
    rayon::scope(|s| {
        for _ in 0..others {
            s.spawn(|_| {
                while rayon::current_thread_index() != owner && !done.load(Ordering::Acquire) {
                    if rayon::yield_now() != Some(rayon::Yield::Executed) {
                        std::hint::spin_loop();
                    }
                }
            });
        }
        out = Some(f());
        done.store(true, Ordering::Release);
    });
    match out {
        Some(r) => r,
        None => unreachable!("the scope body ran"),
    }
}

/// Rotate each `D`-wide head of `src` into `dst` by `cos`, `sin` `[D/2]`.
#[inline]
fn rope_heads(src: &[f32], dst: &mut [f32], d: usize, cos: &[f32], sin: &[f32], mode: RopeMode) {
    let half = d / 2;
    for (x, out) in src.chunks_exact(d).zip(dst.chunks_exact_mut(d)) {
        match mode {
            RopeMode::Half => {
                let (x1, x2) = x.split_at(half);
                let (o1, o2) = out.split_at_mut(half);
                for j in 0..half {
                    o1[j] = x1[j] * cos[j] - x2[j] * sin[j];
                    o2[j] = x2[j] * cos[j] + x1[j] * sin[j];
                }
            }
            RopeMode::Adjacent => {
                for j in 0..half {
                    let (a, b) = (x[2 * j], x[2 * j + 1]);
                    out[2 * j] = a * cos[j] - b * sin[j];
                    out[2 * j + 1] = b * cos[j] + a * sin[j];
                }
            }
        }
    }
}

fn reborrow<'a>(c: &'a mut KvMut) -> KvMut<'a> {
    match c {
        KvMut::F32(s) => KvMut::F32(s),
        KvMut::F16(s) => KvMut::F16(s),
        KvMut::Bf16(s) => KvMut::Bf16(s),
    }
}

fn view<'a>(c: &'a KvMut) -> Kv<'a> {
    match c {
        KvMut::F32(s) => Kv::F32(s),
        KvMut::F16(s) => Kv::F16(s),
        KvMut::Bf16(s) => Kv::Bf16(s),
    }
}
