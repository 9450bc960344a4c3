//! Attention kernels and the KV cache: `new_kv_cache`, `write_kv`, `copy_blocks`, `write_blocks`, `paged_attention`.

use numpy::{PyArray, PyArrayDyn, PyArrayMethods, PyUntypedArray};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use super::args::dim;
use super::arrays::{cache, cache_pair, cache_pair_mut, kv, kv_mut, readonly, slice_of, typed};
use crate::attention::{self as att, Batch, Params, Queries};

/// Zeroed `(k_cache, v_cache)`, each `[num_blocks, num_kv_heads, block_size, head_dim]`,
/// every page touched up front.
#[pyfunction]
#[pyo3(signature = (num_blocks, block_size, num_kv_heads, head_dim, dtype = None),
       text_signature = "(num_blocks, block_size, num_kv_heads, head_dim, dtype='float16')")]
pub fn new_kv_cache<'py>(
    py: Python<'py>,
    num_blocks: i64,
    block_size: i64,
    num_kv_heads: i64,
    head_dim: i64,
    dtype: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyTuple>> {
    let shape = (
        dim("num_blocks", num_blocks, 0)?,
        dim("num_kv_heads", num_kv_heads, 1)?,
        dim("block_size", block_size, 1)?,
        dim("head_dim", head_dim, 1)?,
    );
    let np = py.import("numpy")?;
    let dt = match dtype {
        None => np.getattr("dtype")?.call1(("float16",))?,
        Some(d) if d.extract::<String>().is_ok_and(|s| s == "bfloat16") => np
            .getattr("dtype")?
            .call1((py.import("ml_dtypes")?.getattr("bfloat16")?,))?,
        Some(d) => np
            .getattr("dtype")?
            .call1((d,))
            .map_err(|_| PyTypeError::new_err(format!("dtype must be 'float32', 'float16' or 'bfloat16', got {d}")))?,
    };
    let name: String = dt.getattr("name")?.extract()?;
    if !matches!(name.as_str(), "float32" | "float16" | "bfloat16") {
        return Err(PyValueError::new_err(format!(
            "cache dtype must be float32, float16 or bfloat16, got {name}"
        )));
    }
    // `empty` + an explicit zero fill rather than `zeros`: calloc'd pages would fault in on
    // their first write_kv, mid-serving (a first touch is far slower than a write to a touched
    // page).
    let empty = np.getattr("empty")?;
    let k = empty.call1((shape, &dt))?;
    let v = empty.call1((shape, &dt))?;
    k.call_method1("fill", (0,))?;
    v.call_method1("fill", (0,))?;
    PyTuple::new(py, [k, v])
}

/// Scatter `key`/`value` `[T, num_kv_heads, head_dim]` float32 into `slot_mapping` (-1 = skip).
#[pyfunction]
pub fn write_kv(
    py: Python<'_>,
    k_cache: &Bound<'_, PyAny>,
    v_cache: &Bound<'_, PyAny>,
    key: &Bound<'_, PyAny>,
    value: &Bound<'_, PyAny>,
    slot_mapping: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let (kr, vr, dt, shape) = cache_pair_mut(k_cache, v_cache)?;
    let keyr = typed::<f32>(key, "key", 3, "float32")?;
    let valr = typed::<f32>(value, "value", 3, "float32")?;
    let slr = typed::<i64>(slot_mapping, "slot_mapping", 1, "int64")?;
    let want = [slr.shape[0], shape.num_kv_heads, shape.head_dim];
    if keyr.shape != want || valr.shape != want {
        return Err(PyValueError::new_err(format!(
            "key and value must be {want:?} (num_tokens, num_kv_heads, head_dim), got {:?} and {:?}",
            keyr.shape, valr.shape
        )));
    }
    for (r, n) in [(&keyr, "key"), (&valr, "value"), (&slr, "slot_mapping")] {
        if r.overlaps(&kr) || r.overlaps(&vr) {
            return Err(PyValueError::new_err(format!(
                "{n} must not share memory with the caches"
            )));
        }
    }
    let (kg, vg, sg) = (
        readonly::<f32>(&keyr, "key")?,
        readonly::<f32>(&valr, "value")?,
        readonly::<i64>(&slr, "slot_mapping")?,
    );
    let (ks, vs, ss) = (
        slice_of(&kg, "key")?,
        slice_of(&vg, "value")?,
        slice_of(&sg, "slot_mapping")?,
    );
    let numel = shape.numel().map_err(PyErr::from)?;
    // SAFETY: both caches passed `cache_pair` (C-contiguous, aligned, `numel` items, disjoint)
    // and are writeable; key/value/slots are disjoint from them (checked above). The Bound
    // arrays outlive the call. As with any numpy kernel that releases the GIL, the caller
    // must not mutate these arrays from another thread during the call.
    let (km, vm) = unsafe { (kv_mut(&kr, dt, numel), kv_mut(&vr, dt, numel)) };
    py.detach(|| att::write_kv(km, vm, shape, ks, vs, ss))
        .map_err(PyErr::from)
}

/// Copy whole blocks `(src, dst)` in order; `pairs` is int64 `[n, 2]` or a sequence of pairs.
#[pyfunction]
pub fn copy_blocks(
    py: Python<'_>,
    k_cache: &Bound<'_, PyAny>,
    v_cache: &Bound<'_, PyAny>,
    pairs: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let (kr, vr, dt, shape) = cache_pair_mut(k_cache, v_cache)?;
    let flat: Vec<i64> = if pairs.cast::<PyUntypedArray>().is_ok() {
        let pr = typed::<i64>(pairs, "pairs", 2, "int64")?;
        if pr.shape[1] != 2 {
            return Err(PyValueError::new_err(format!(
                "pairs must be [n, 2], got {:?}",
                pr.shape
            )));
        }
        slice_of(&readonly::<i64>(&pr, "pairs")?, "pairs")?.to_vec()
    } else {
        let items: Vec<(i64, i64)> = pairs.extract().map_err(|_| {
            PyTypeError::new_err("pairs must be an int64 array [n, 2] or a sequence of (src, dst) int pairs")
        })?;
        items.into_iter().flat_map(|(a, b)| [a, b]).collect()
    };
    let numel = shape.numel().map_err(PyErr::from)?;
    // SAFETY: as in `write_kv`; `flat` is owned.
    let (km, vm) = unsafe { (kv_mut(&kr, dt, numel), kv_mut(&vr, dt, numel)) };
    py.detach(|| att::copy_blocks(km, vm, shape, &flat))
        .map_err(PyErr::from)
}

/// Write whole blocks into both caches: `k_blocks`/`v_blocks` `[n, num_kv_heads, block_size, head_dim]`
/// of the caches' dtype go to blocks `block_ids` (int64 `[n]` or a sequence of ints), in order.
#[pyfunction]
pub fn write_blocks(
    py: Python<'_>,
    k_cache: &Bound<'_, PyAny>,
    v_cache: &Bound<'_, PyAny>,
    block_ids: &Bound<'_, PyAny>,
    k_blocks: &Bound<'_, PyAny>,
    v_blocks: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let (kr, vr, dt, shape) = cache_pair_mut(k_cache, v_cache)?;
    let ids: Vec<i64> = if block_ids.cast::<PyUntypedArray>().is_ok() {
        let ir = typed::<i64>(block_ids, "block_ids", 1, "int64")?;
        slice_of(&readonly::<i64>(&ir, "block_ids")?, "block_ids")?.to_vec()
    } else {
        block_ids
            .extract()
            .map_err(|_| PyTypeError::new_err("block_ids must be an int64 array [n] or a sequence of ints"))?
    };
    let (skr, skd) = cache(k_blocks, "k_blocks")?;
    let (svr, svd) = cache(v_blocks, "v_blocks")?;
    let want = [ids.len(), shape.num_kv_heads, shape.block_size, shape.head_dim];
    for (r, d, name) in [(&skr, skd, "k_blocks"), (&svr, svd, "v_blocks")] {
        if d != dt {
            return Err(PyTypeError::new_err(format!(
                "{name} is {} but the caches are {}",
                d.name(),
                dt.name()
            )));
        }
        if r.shape != want {
            return Err(PyValueError::new_err(format!(
                "{name} must be {want:?} (len(block_ids), num_kv_heads, block_size, head_dim), got {:?}",
                r.shape
            )));
        }
        if r.overlaps(&kr) || r.overlaps(&vr) {
            return Err(PyValueError::new_err(format!(
                "{name} must not share memory with the caches"
            )));
        }
    }
    let numel = shape.numel().map_err(PyErr::from)?;
    let src_numel = ids.len() * shape.block_numel();
    // SAFETY: both caches passed `cache_pair` (C-contiguous, aligned, `numel` items, disjoint)
    // and are writeable; the sources passed `cache` with the caches' dtype and exactly
    // `src_numel` items, and share no memory with the caches (checked above). The Bound arrays
    // outlive the call; as for every kernel that releases the GIL, the caller must not mutate
    // them from another thread meanwhile.
    let (km, vm, ks, vs) = unsafe {
        (
            kv_mut(&kr, dt, numel),
            kv_mut(&vr, dt, numel),
            kv(&skr, dt, src_numel),
            kv(&svr, dt, src_numel),
        )
    };
    py.detach(|| att::write_blocks(km, vm, shape, &ids, ks, vs))
        .map_err(PyErr::from)
}

/// Causal varlen paged attention; returns `out` float32 `[num_tokens, num_q_heads, head_dim]`.
/// `block_tables`: int32 `[B, max_blocks]` (padded), or the CSR tuple `(indptr, indices)` /
/// `(indptr, indices, last_page_len)` (docs/internals/kernels.md).
#[pyfunction]
#[pyo3(signature = (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *, scale = None,
                    sliding_window = None, soft_cap = None, out = None))]
#[allow(clippy::too_many_arguments)]
pub fn paged_attention<'py>(
    py: Python<'py>,
    q: &Bound<'py, PyAny>,
    k_cache: &Bound<'py, PyAny>,
    v_cache: &Bound<'py, PyAny>,
    block_tables: &Bound<'py, PyAny>,
    seq_lens: &Bound<'py, PyAny>,
    query_start_loc: &Bound<'py, PyAny>,
    scale: Option<f64>,
    sliding_window: Option<i64>,
    soft_cap: Option<f64>,
    out: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let (kr, vr, dt, shape) = cache_pair(k_cache, v_cache)?;
    let qr = typed::<f32>(q, "q", 3, "float32")?;
    let (t, hq, d) = (qr.shape[0], qr.shape[1], qr.shape[2]);
    if d != shape.head_dim {
        return Err(PyValueError::new_err(format!(
            "q head_dim {d} != cache head_dim {}",
            shape.head_dim
        )));
    }
    if hq == 0 || hq % shape.num_kv_heads != 0 {
        return Err(PyValueError::new_err(format!(
            "num_q_heads ({hq}) must be a positive multiple of num_kv_heads ({})",
            shape.num_kv_heads
        )));
    }
    let slr = typed::<i32>(seq_lens, "seq_lens", 1, "int32")?;
    let qslr = typed::<i32>(query_start_loc, "query_start_loc", 1, "int32")?;
    let nseq = slr.shape[0];
    // The table: padded `[B, max_blocks]`, or the CSR tuple `(indptr, indices[, last_page_len])`.
    let csr = block_tables.cast::<PyTuple>().ok();
    let (btr, ipr, lplr) = match &csr {
        None if block_tables.cast::<PyUntypedArray>().is_err() => {
            return Err(PyTypeError::new_err(format!(
                "block_tables must be an int32 [B, max_blocks] numpy.ndarray or a tuple (indptr, indices) or \
                 (indptr, indices, last_page_len) of int32 arrays, got {}",
                block_tables.get_type().name()?
            )))
        }
        None => (typed::<i32>(block_tables, "block_tables", 2, "int32")?, None, None),
        Some(t) if t.len() == 2 || t.len() == 3 => {
            let (ip, ix) = (t.get_item(0)?, t.get_item(1)?);
            let ipr = typed::<i32>(&ip, "indptr", 1, "int32")?;
            let ixr = typed::<i32>(&ix, "indices", 1, "int32")?;
            let lplr = match t.len() {
                3 => Some(typed::<i32>(&t.get_item(2)?, "last_page_len", 1, "int32")?),
                _ => None,
            };
            (ixr, Some(ipr), lplr)
        }
        Some(t) => {
            return Err(PyValueError::new_err(format!(
                "block_tables must be an int32 [B, max_blocks] array or a tuple (indptr, indices) or \
                 (indptr, indices, last_page_len), got a tuple of {}",
                t.len()
            )))
        }
    };
    if qslr.shape[0] != nseq + 1 || (ipr.is_none() && btr.shape[0] != nseq) {
        return Err(PyValueError::new_err(format!(
            "need block_tables [B, max_blocks], seq_lens [B], query_start_loc [B+1]; got {:?}, {:?}, {:?}",
            btr.shape, slr.shape, qslr.shape
        )));
    }
    let params = Params::new(d, scale, sliding_window, soft_cap).map_err(PyErr::from)?;
    let out_obj = match out {
        Some(o) => o.clone(),
        None => PyArray::<f32, _>::zeros(py, [t, hq, d], false).into_any(),
    };
    let outr = typed::<f32>(&out_obj, "out", 3, "float32")?;
    if outr.shape != qr.shape {
        return Err(PyValueError::new_err(format!(
            "out must have q's shape {:?}, got {:?}",
            qr.shape, outr.shape
        )));
    }
    for (r, n) in [
        (&qr, "q"),
        (&kr, "k_cache"),
        (&vr, "v_cache"),
        (&btr, "block_tables"),
        (&slr, "seq_lens"),
        (&qslr, "query_start_loc"),
    ] {
        if outr.overlaps(r) {
            return Err(PyValueError::new_err(format!("out must not share memory with {n}")));
        }
    }
    for (r, n) in [(&ipr, "indptr"), (&lplr, "last_page_len")] {
        if r.as_ref().is_some_and(|r| outr.overlaps(r)) {
            return Err(PyValueError::new_err(format!("out must not share memory with {n}")));
        }
    }
    let (qg, btg, slg, qslg) = (
        readonly::<f32>(&qr, "q")?,
        readonly::<i32>(&btr, "block_tables")?,
        readonly::<i32>(&slr, "seq_lens")?,
        readonly::<i32>(&qslr, "query_start_loc")?,
    );
    let ipg = ipr.as_ref().map(|r| readonly::<i32>(r, "indptr")).transpose()?;
    let lplg = lplr.as_ref().map(|r| readonly::<i32>(r, "last_page_len")).transpose()?;
    let mut og = outr
        .arr
        .cast::<PyArrayDyn<f32>>()
        .map_err(|_| PyTypeError::new_err("out must be float32"))?
        .try_readwrite()
        .map_err(|e| PyValueError::new_err(format!("out must be writeable and not borrowed elsewhere: {e}")))?;
    let indptr = ipg.as_ref().map(|g| slice_of(g, "indptr")).transpose()?;
    // The standalone kernel reads only the tables: no positions or slots.
    let batch = Batch {
        positions: &[],
        slot_mapping: &[],
        block_tables: slice_of(&btg, "block_tables")?,
        max_blocks: if indptr.is_some() { 0 } else { btr.shape[1] },
        indptr,
        seq_lens: slice_of(&slg, "seq_lens")?,
        query_start_loc: slice_of(&qslg, "query_start_loc")?,
    };
    if let Some(g) = &lplg {
        att::check_last_page_len(&batch, shape.block_size, slice_of(g, "last_page_len")?).map_err(PyErr::from)?;
    }
    let o = og
        .as_slice_mut()
        .map_err(|e| PyValueError::new_err(format!("out: {e}")))?;
    let numel = shape.numel().map_err(PyErr::from)?;
    // SAFETY: both caches passed `cache_pair` (C-contiguous, aligned, `numel` items) and are
    // only read; `out` is disjoint from them (checked above). The Bound arrays outlive the
    // call. As with any numpy kernel that releases the GIL, the caller must not mutate the
    // caches from another thread during the call.
    let (k, v) = unsafe { (kv(&kr, dt, numel), kv(&vr, dt, numel)) };
    let queries = Queries {
        q: slice_of(&qg, "q")?,
        num_heads: hq,
    };
    py.detach(|| att::paged_attention(k, v, shape, batch, queries, params, o))
        .map_err(PyErr::from)?;
    drop(og);
    Ok(out_obj)
}
