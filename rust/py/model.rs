//! The fused decoder (`LlamaDecoder`): the decoder stack of every supported architecture, run in
//! one GIL-free call per engine step (see `rust/model/llama.rs`).

use std::sync::Arc;

use numpy::PyArrayMethods;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use super::arrays::{cache_pair_mut, kv_mut, out_f32, readonly, readwrite_f32, slice_of, typed, Raw};
use super::linear::QLinear;
use super::type_name;
use crate::attention::KvMut;
use crate::attention::{Batch, CacheShape, DType};
use crate::model::{Decoder, Head, Layer, RopeMode, RopeRows};
use crate::ops::Activation;

/// A decoder stack over `QLinear` weights (shared, not copied), described by data.
///
/// `layers`: one dict per layer with `attn_norm`, `ffn_norm` (float32 `[H]`), `wqkv`, `wo`,
/// `wgu`, `wdown` (`QLinear`), and optionally (None or absent: not there) `bqkv` (float32
/// `[(Hq + 2 Hkv) D]`), `q_norm`, `k_norm` (float32 `[D]`, per head before RoPE),
/// `post_attn_norm`, `post_ffn_norm` (float32 `[H]`), `rope_table` (int, default 0: which of the
/// step's `rope_tables` RoPE row pairs the layer rotates with) and `sliding_window` (int; absent:
/// the decoder's `sliding_window`). Each step brings its `BatchInputs` and `rope`: `rope_tables`
/// pairs of float32 `[T, D/2]` cos and sin rows at its tokens' positions. `rope_mode`: "half" or
/// "adjacent".
/// `activation`: "silu" or "gelu_tanh"; `attn_scale`: the attention logits' scale (None: 1/sqrt(D)).
/// `lm_head`: a `QLinear` `[V, H]`, or a sequence of them holding consecutive vocabulary rows.
#[pyclass(frozen, module = "pagedkv_rs._core")]
pub struct LlamaDecoder {
    inner: Arc<Decoder>,
}

/// `d[key]`, `None` when missing or None.
fn item<'py>(d: &Bound<'py, PyDict>, key: &str) -> PyResult<Option<Bound<'py, PyAny>>> {
    Ok(d.get_item(key)?.filter(|v| !v.is_none()))
}

fn vector(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<f32>> {
    let r = typed::<f32>(obj, name, 1, "float32")?;
    Ok(slice_of(&readonly::<f32>(&r, name)?, name)?.to_vec())
}

fn qweight(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Arc<crate::linear::QWeight>> {
    let q = obj
        .cast::<QLinear>()
        .map_err(|_| PyTypeError::new_err(format!("{name} must be a QLinear, got {}", type_name(obj))))?;
    Ok(q.get().weight())
}

#[pymethods]
impl LlamaDecoder {
    #[new]
    #[pyo3(signature = (layers, *, head_dim, num_heads, num_kv_heads, rms_eps, rope_mode = "half", rope_tables = 1, sliding_window = None, final_norm = None, lm_head = None, activation = "silu", attn_scale = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        layers: &Bound<'_, PyAny>,
        head_dim: i64,
        num_heads: i64,
        num_kv_heads: i64,
        rms_eps: f64,
        rope_mode: &str,
        rope_tables: i64,
        sliding_window: Option<i64>,
        final_norm: Option<&Bound<'_, PyAny>>,
        lm_head: Option<&Bound<'_, PyAny>>,
        activation: &str,
        attn_scale: Option<f64>,
    ) -> PyResult<Self> {
        let pos_int = |name: &str, v: i64| -> PyResult<usize> {
            if !(1..=1 << 20).contains(&v) {
                return Err(PyValueError::new_err(format!("{name} must be in [1, 2**20], got {v}")));
            }
            Ok(v as usize)
        };
        let window = sliding_window
            .map(|w| pos_int("sliding_window", w.min(1 << 20)))
            .transpose()?;
        let seq: Vec<Bound<'_, PyAny>> = layers
            .try_iter()
            .map_err(|_| {
                PyTypeError::new_err(format!("layers must be a sequence of dicts, got {}", type_name(layers)))
            })?
            .collect::<PyResult<_>>()?;
        let mut out = Vec::with_capacity(seq.len());
        for (i, l) in seq.iter().enumerate() {
            let d = l
                .cast::<PyDict>()
                .map_err(|_| PyTypeError::new_err(format!("layers[{i}] must be a dict, got {}", type_name(l))))?;
            let get = |k: &str| -> PyResult<Bound<'_, PyAny>> {
                item(d, k)?.ok_or_else(|| PyValueError::new_err(format!("layers[{i}] has no '{k}'")))
            };
            let name = |k: &str| format!("layers[{i}]['{k}']");
            let opt = |k: &str| item(d, k)?.map(|b| vector(&b, &name(k))).transpose();
            let int = |k: &str| -> PyResult<Option<i64>> {
                item(d, k)?
                    .map(|o| {
                        o.extract::<i64>().map_err(|_| {
                            PyTypeError::new_err(format!("{} must be an int, got {}", name(k), type_name(&o)))
                        })
                    })
                    .transpose()
            };
            let rope_table = match int("rope_table")? {
                None => 0,
                Some(r) if r >= 0 => r as usize,
                Some(r) => {
                    return Err(PyValueError::new_err(format!(
                        "{} must be >= 0, got {r}",
                        name("rope_table")
                    )))
                }
            };
            let layer_window = match int("sliding_window")? {
                None => window,
                Some(w) => Some(pos_int(&name("sliding_window"), w.min(1 << 20))?),
            };
            out.push(Layer {
                attn_norm: vector(&get("attn_norm")?, &name("attn_norm"))?,
                wqkv: qweight(&get("wqkv")?, &name("wqkv"))?,
                bqkv: item(d, "bqkv")?.map(|b| vector(&b, &name("bqkv"))).transpose()?,
                wo: qweight(&get("wo")?, &name("wo"))?,
                ffn_norm: vector(&get("ffn_norm")?, &name("ffn_norm"))?,
                w_gate_up: qweight(&get("wgu")?, &name("wgu"))?,
                w_down: qweight(&get("wdown")?, &name("wdown"))?,
                q_norm: opt("q_norm")?,
                k_norm: opt("k_norm")?,
                post_attn_norm: opt("post_attn_norm")?,
                post_ffn_norm: opt("post_ffn_norm")?,
                rope_table,
                sliding_window: layer_window,
            });
        }
        let num_ropes = pos_int("rope_tables", rope_tables)?;
        let d = pos_int("head_dim", head_dim)?;
        let act = Activation::parse(activation).map_err(PyErr::from)?;
        let (hq, hkv) = (pos_int("num_heads", num_heads)?, pos_int("num_kv_heads", num_kv_heads)?);
        let rope = RopeMode::parse(rope_mode).map_err(PyErr::from)?;
        let head = match (final_norm.filter(|v| !v.is_none()), lm_head.filter(|v| !v.is_none())) {
            (None, None) => None,
            (Some(n), Some(w)) => Some(Head {
                norm: vector(n, "final_norm")?,
                lm_head: if w.cast::<QLinear>().is_ok() {
                    vec![qweight(w, "lm_head")?]
                } else {
                    let items = w.try_iter().map_err(|_| {
                        PyTypeError::new_err(format!(
                            "lm_head must be a QLinear or a sequence of them, got {}",
                            type_name(w)
                        ))
                    })?;
                    items
                        .enumerate()
                        .map(|(i, q)| qweight(&q?, &format!("lm_head[{i}]")))
                        .collect::<PyResult<_>>()?
                },
            }),
            _ => {
                return Err(PyValueError::new_err(
                    "final_norm and lm_head come together (both or neither)",
                ))
            }
        };
        let dec = py
            .detach(|| {
                let d = Decoder::new(out, num_ropes, d, rope, hq, hkv, rms_eps as f32, act, attn_scale)?;
                match head {
                    Some(h) => d.with_head(h),
                    None => Ok(d),
                }
            })
            .map_err(PyErr::from)?;
        Ok(LlamaDecoder { inner: Arc::new(dec) })
    }

    #[getter]
    fn num_layers(&self) -> usize {
        self.inner.num_layers()
    }
    #[getter]
    fn hidden_size(&self) -> usize {
        self.inner.hidden_size()
    }
    #[getter]
    fn num_heads(&self) -> usize {
        self.inner.num_heads()
    }
    #[getter]
    fn num_kv_heads(&self) -> usize {
        self.inner.num_kv_heads()
    }
    #[getter]
    fn head_dim(&self) -> usize {
        self.inner.head_dim()
    }
    #[getter]
    fn intermediate_size(&self) -> usize {
        self.inner.intermediate_size()
    }

    #[getter]
    fn vocab_size(&self) -> Option<usize> {
        self.inner.vocab_size()
    }

    /// Every layer over one step: `x` float32 `[T, H]` (the embedded tokens) becomes the residual
    /// stream after the last layer, in place, and is returned. `batch`: the step's `BatchInputs`
    /// as `prepare_batch` builds it, read by attribute name: `positions`, `slot_mapping` (int64
    /// `[T]`), `indptr`, `indices` (the CSR block table, int32), `seq_lens` (int32 `[B]`),
    /// `query_start_loc` (int32 `[B+1]`). `rope`: per RoPE base, the (cos, sin) float32 `[T, D/2]`
    /// rows at the step's positions (`LlamaWeights.rope_rows`). `kv_caches`: one
    /// `(k_cache, v_cache)` per layer, all of one shape and dtype. The GIL is released.
    /// `spin`: the kernel threads spin for the call instead of parking between products (off by
    /// default: on a busy machine the spinners take the cores the kernels need, and the call gets
    /// slower).
    #[pyo3(signature = (x, batch, kv_caches, *, rope, spin = false))]
    fn forward_hidden<'py>(
        &self,
        py: Python<'py>,
        x: &Bound<'py, PyAny>,
        batch: &Bound<'py, PyAny>,
        kv_caches: &Bound<'py, PyAny>,
        rope: &Bound<'py, PyAny>,
        spin: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let dec = &self.inner;
        self.with_step(py, x, batch, rope, kv_caches, |xs, b, rope, caches, shape| {
            dec.forward_hidden(xs, b, rope, caches, shape, spin)
        })?;
        Ok(x.clone())
    }

    /// `forward_hidden`, then the head (`final_norm`, `lm_head`) in the same GIL-free call:
    /// float32 logits `[N, V]` of the tokens `logits_indices` (ints into the step's `T` tokens;
    /// None: each sequence's last token, `query_start_loc[1:] - 1`). `x` is left holding the
    /// residual stream as `forward_hidden` leaves it. `out`: a C-contiguous writeable float32
    /// `[N, V]` array to write the logits into and return (a caller's buffer reused step after
    /// step skips mapping fresh pages for every step's logits), else a new one.
    #[pyo3(signature = (x, batch, kv_caches, logits_indices = None, *, rope, spin = false, out = None))]
    #[allow(clippy::too_many_arguments)]
    fn forward<'py>(
        &self,
        py: Python<'py>,
        x: &Bound<'py, PyAny>,
        batch: &Bound<'py, PyAny>,
        kv_caches: &Bound<'py, PyAny>,
        logits_indices: Option<&Bound<'py, PyAny>>,
        rope: &Bound<'py, PyAny>,
        spin: bool,
        out: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let dec = &self.inner;
        let v = dec.vocab_size().ok_or_else(|| {
            PyValueError::new_err("this LlamaDecoder has no head: build it with final_norm and lm_head")
        })?;
        let rows: Vec<usize> = match logits_indices.filter(|o| !o.is_none()) {
            Some(o) => {
                let ints: Vec<i64> = o.extract().map_err(|_| {
                    PyTypeError::new_err(format!(
                        "logits_indices must be a sequence of ints, got {}",
                        type_name(o)
                    ))
                })?;
                ints.iter()
                    .enumerate()
                    .map(|(i, &r)| {
                        usize::try_from(r)
                            .map_err(|_| PyValueError::new_err(format!("logits_indices[{i}] = {r} is negative")))
                    })
                    .collect::<PyResult<_>>()?
            }
            None => {
                let qsl_o = batch
                    .getattr(intern!(py, "query_start_loc"))
                    .map_err(|_| PyTypeError::new_err("batch has no 'query_start_loc' (pass a BatchInputs)"))?;
                let qsl = typed::<i32>(&qsl_o, "batch.query_start_loc", 1, "int32")?;
                let g = readonly::<i32>(&qsl, "batch.query_start_loc")?;
                let q = slice_of(&g, "batch.query_start_loc")?;
                let mut rows = Vec::with_capacity(q.len().saturating_sub(1));
                for (i, w) in q.windows(2).enumerate() {
                    if w[1] <= w[0] || w[0] < 0 {
                        return Err(PyValueError::new_err(format!(
                            "sequence {i} has no token this step (query_start_loc {} -> {}): pass logits_indices",
                            w[0], w[1]
                        )));
                    }
                    rows.push(w[1] as usize - 1);
                }
                rows
            }
        };
        let xr = typed::<f32>(x, "x", 2, "float32")?;
        let out = out_f32(py, out.filter(|o| !o.is_none()), &[rows.len(), v], &[(&xr, "x")])?;
        {
            let mut og = readwrite_f32(&out, "out")?;
            let logits = og
                .as_slice_mut()
                .map_err(|e| PyValueError::new_err(format!("out must be C-contiguous: {e}")))?;
            self.with_step(py, x, batch, rope, kv_caches, |xs, b, rope, caches, shape| {
                dec.forward_logits(xs, b, rope, caches, shape, &rows, spin, logits)
            })?;
        }
        Ok(out)
    }

    fn __repr__(&self) -> String {
        let d = &self.inner;
        format!(
            "LlamaDecoder(num_layers={}, hidden_size={}, num_heads={}, num_kv_heads={}, head_dim={})",
            d.num_layers(),
            d.hidden_size(),
            d.num_heads(),
            d.num_kv_heads(),
            d.head_dim()
        )
    }
}

impl LlamaDecoder {
    /// Validate one step's arguments (see `forward_hidden`) and run `f` on them with the GIL
    /// released.
    #[allow(clippy::too_many_arguments)]
    fn with_step<'py>(
        &self,
        py: Python<'py>,
        x: &Bound<'py, PyAny>,
        batch: &Bound<'py, PyAny>,
        rope_o: &Bound<'py, PyAny>,
        kv_caches: &Bound<'py, PyAny>,
        f: impl FnOnce(&mut [f32], &Batch, &[RopeRows], &mut [(KvMut, KvMut)], CacheShape) -> crate::error::Result<()>
            + Send,
    ) -> PyResult<()> {
        let xr = typed::<f32>(x, "x", 2, "float32")?;
        if xr.shape[1] != self.inner.hidden_size() {
            return Err(PyValueError::new_err(format!(
                "x must be [T, {}], got {:?}",
                self.inner.hidden_size(),
                xr.shape
            )));
        }
        // The BatchInputs, by field name (docs/internals/kernels.md, "One step's batch").
        let field = |name: &Bound<'py, pyo3::types::PyString>| -> PyResult<Bound<'py, PyAny>> {
            batch
                .getattr(name)
                .map_err(|_| PyTypeError::new_err(format!("batch has no '{name}' (pass a BatchInputs)")))
        };
        let (pos_o, slot_o, ip_o, ix_o, sl_o, qsl_o) = (
            field(intern!(py, "positions"))?,
            field(intern!(py, "slot_mapping"))?,
            field(intern!(py, "indptr"))?,
            field(intern!(py, "indices"))?,
            field(intern!(py, "seq_lens"))?,
            field(intern!(py, "query_start_loc"))?,
        );
        let pos = typed::<i64>(&pos_o, "batch.positions", 1, "int64")?;
        let slot = typed::<i64>(&slot_o, "batch.slot_mapping", 1, "int64")?;
        let ipr = typed::<i32>(&ip_o, "batch.indptr", 1, "int32")?;
        let bt = typed::<i32>(&ix_o, "batch.indices", 1, "int32")?;
        let sl = typed::<i32>(&sl_o, "batch.seq_lens", 1, "int32")?;
        let qsl = typed::<i32>(&qsl_o, "batch.query_start_loc", 1, "int32")?;
        // The RoPE rows: a sequence of (cos, sin) float32 [T, D/2] pairs.
        let mut rope_arrs = Vec::new();
        for (i, p) in rope_o
            .try_iter()
            .map_err(|_| {
                PyTypeError::new_err(format!(
                    "rope must be a sequence of (cos, sin) pairs, got {}",
                    type_name(rope_o)
                ))
            })?
            .enumerate()
        {
            let p = p?;
            let (co, so): (Bound<'py, PyAny>, Bound<'py, PyAny>) = p.extract().map_err(|_| {
                PyTypeError::new_err(format!("rope[{i}] must be a (cos, sin) pair, got {}", type_name(&p)))
            })?;
            rope_arrs.push((
                typed::<f32>(&co, &format!("rope[{i}] cos"), 2, "float32")?,
                typed::<f32>(&so, &format!("rope[{i}] sin"), 2, "float32")?,
            ));
        }
        let t = xr.shape[0];
        if pos.shape[0] != t || slot.shape[0] != t {
            return Err(PyValueError::new_err(format!(
                "x has {t} rows but batch.positions / slot_mapping have {} / {}",
                pos.shape[0], slot.shape[0]
            )));
        }
        let nseq = sl.shape[0];
        if qsl.shape[0] != nseq + 1 {
            return Err(PyValueError::new_err(format!(
                "need seq_lens [B], query_start_loc [B+1]; got {:?}, {:?}",
                sl.shape, qsl.shape
            )));
        }
        // The caches: one pair per layer, all of one geometry and dtype, disjoint from each other
        // and from every other argument.
        let pairs: Vec<Bound<'py, PyAny>> = if let Ok(l) = kv_caches.cast::<PyList>() {
            l.iter().collect()
        } else if let Ok(tu) = kv_caches.cast::<PyTuple>() {
            tu.iter().collect()
        } else {
            return Err(PyTypeError::new_err(format!(
                "kv_caches must be a list of (k_cache, v_cache) pairs, got {}",
                type_name(kv_caches)
            )));
        };
        if pairs.len() != self.inner.num_layers() {
            return Err(PyValueError::new_err(format!(
                "need {} (k_cache, v_cache) pairs, one per layer, got {}",
                self.inner.num_layers(),
                pairs.len()
            )));
        }
        let mut raws: Vec<Raw<'py>> = Vec::with_capacity(2 * pairs.len());
        let mut geometry: Option<(DType, CacheShape)> = None;
        for (i, p) in pairs.iter().enumerate() {
            let (k, v): (Bound<'py, PyAny>, Bound<'py, PyAny>) = p.extract().map_err(|_| {
                PyTypeError::new_err(format!(
                    "kv_caches[{i}] must be a (k_cache, v_cache) pair, got {}",
                    type_name(p)
                ))
            })?;
            let (kr, vr, dt, shape) =
                cache_pair_mut(&k, &v).map_err(|e| PyValueError::new_err(format!("kv_caches[{i}]: {e}")))?;
            match geometry {
                None => geometry = Some((dt, shape)),
                Some(g) if g != (dt, shape) => {
                    return Err(PyValueError::new_err(format!(
                        "kv_caches[{i}] is {} {:?}, kv_caches[0] is {} {:?}: every layer's caches must match",
                        dt.name(),
                        kr.shape,
                        g.0.name(),
                        raws[0].shape
                    )))
                }
                _ => {}
            }
            raws.push(kr);
            raws.push(vr);
        }
        let (dt, shape) = geometry.ok_or_else(|| PyValueError::new_err("kv_caches is empty"))?;
        for (a, ra) in raws.iter().enumerate() {
            for rb in &raws[a + 1..] {
                if ra.overlaps(rb) {
                    return Err(PyValueError::new_err("kv_caches must not share memory with each other"));
                }
            }
            for (r, n) in rope_arrs.iter().flat_map(|(c, s)| [(c, "rope"), (s, "rope")]).chain([
                (&xr, "x"),
                (&pos, "batch.positions"),
                (&slot, "batch.slot_mapping"),
                (&ipr, "batch.indptr"),
                (&bt, "batch.indices"),
                (&sl, "batch.seq_lens"),
                (&qsl, "batch.query_start_loc"),
            ]) {
                if ra.overlaps(r) {
                    return Err(PyValueError::new_err(format!(
                        "{n} must not share memory with kv_caches"
                    )));
                }
            }
        }
        for (r, n) in rope_arrs.iter().flat_map(|(c, s)| [(c, "rope"), (s, "rope")]).chain([
            (&pos, "batch.positions"),
            (&slot, "batch.slot_mapping"),
            (&ipr, "batch.indptr"),
            (&bt, "batch.indices"),
            (&sl, "batch.seq_lens"),
            (&qsl, "batch.query_start_loc"),
        ]) {
            if xr.overlaps(r) {
                return Err(PyValueError::new_err(format!("x must not share memory with {n}")));
            }
        }
        let (pg, sg, ipg, btg, slg, qslg) = (
            readonly::<i64>(&pos, "batch.positions")?,
            readonly::<i64>(&slot, "batch.slot_mapping")?,
            readonly::<i32>(&ipr, "batch.indptr")?,
            readonly::<i32>(&bt, "batch.indices")?,
            readonly::<i32>(&sl, "batch.seq_lens")?,
            readonly::<i32>(&qsl, "batch.query_start_loc")?,
        );
        let rope_guards = rope_arrs
            .iter()
            .map(|(c, s)| Ok((readonly::<f32>(c, "rope cos")?, readonly::<f32>(s, "rope sin")?)))
            .collect::<PyResult<Vec<_>>>()?;
        let rope = rope_guards
            .iter()
            .map(|(c, s)| {
                Ok(RopeRows {
                    cos: slice_of(c, "rope cos")?,
                    sin: slice_of(s, "rope sin")?,
                })
            })
            .collect::<PyResult<Vec<_>>>()?;
        let step = Batch {
            positions: slice_of(&pg, "batch.positions")?,
            slot_mapping: slice_of(&sg, "batch.slot_mapping")?,
            block_tables: slice_of(&btg, "batch.indices")?,
            max_blocks: 0,
            indptr: Some(slice_of(&ipg, "batch.indptr")?),
            seq_lens: slice_of(&slg, "batch.seq_lens")?,
            query_start_loc: slice_of(&qslg, "batch.query_start_loc")?,
        };
        let mut xg = xr
            .arr
            .cast::<numpy::PyArrayDyn<f32>>()
            .map_err(|_| PyTypeError::new_err("x must be float32"))?
            .try_readwrite()
            .map_err(|e| PyValueError::new_err(format!("x must be writeable and not borrowed elsewhere: {e}")))?;
        let xs = xg
            .as_slice_mut()
            .map_err(|e| PyValueError::new_err(format!("x: {e}")))?;
        let numel = shape.numel().map_err(PyErr::from)?;
        // SAFETY: every cache passed `cache_pair_mut` (C-contiguous, aligned, `numel` items of
        // `dt`, writeable), no two of them and no other argument share memory (checked above),
        // and the Bound arrays in `raws` outlive the call. As with any numpy kernel that releases
        // the GIL, the caller must not touch these arrays from another thread during the call.
        let mut caches: Vec<_> = raws
            .chunks_exact(2)
            .map(|kv| unsafe { (kv_mut(&kv[0], dt, numel), kv_mut(&kv[1], dt, numel)) })
            .collect();
        py.detach(|| f(xs, &step, &rope, &mut caches, shape))
            .map_err(PyErr::from)?;
        drop(xg);
        Ok(())
    }
}
