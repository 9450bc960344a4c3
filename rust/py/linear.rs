//! Block-quantized linear layers (`QLinear`), GGUF block decoding (`dequantize_gguf`), GGUF string
//! arrays (`gguf_strings`) and the
//! row-wise ops around them (`rms_norm`, `silu_and_mul`).

use numpy::IntoPyArray;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use super::args::dim;
use super::arrays::{f32_2d, out_f32, readonly, readwrite_f32, slice_of, typed, u8_2d};
use crate::linear as lin;

/// A weight matrix `[n, k]` in the block-quantized layout of `rust/linear` (codes `c` held in 4,
/// 5, 6 or 8 bits, per-32 block `d`, `m`: `w = d*c + m`), applied as `x @ W.T` on the kernel threads.
#[pyclass(frozen, module = "pagedkv_rs._core")]
pub struct QLinear {
    w: std::sync::Arc<lin::QWeight>,
}

impl QLinear {
    /// The shared weights (the fused decoder holds them by reference count, not by copy).
    pub(super) fn weight(&self) -> std::sync::Arc<lin::QWeight> {
        self.w.clone()
    }
}

#[pymethods]
impl QLinear {
    /// From GGUF rows `data: uint8 [n, row_bytes]` of `ggml_type` (F32, F16, BF16, Q4_0, Q4_1,
    /// Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) and width `k` (a multiple of 32).
    #[staticmethod]
    fn from_gguf(py: Python<'_>, data: &Bound<'_, PyAny>, ggml_type: &str, k: i64) -> PyResult<Self> {
        let (g, shape) = u8_2d(data, "data")?;
        let raw = slice_of(&g, "data")?;
        let k = dim("k", k, 1)?;
        let n = shape[0];
        let w = py
            .detach(|| lin::QWeight::from_gguf(ggml_type, raw, n, k))
            .map_err(PyErr::from)?;
        Ok(QLinear {
            w: std::sync::Arc::new(w),
        })
    }

    /// Rows of several GGUF tensors stacked in order: `parts` is a sequence of
    /// `(data: uint8 [rows, row_bytes], ggml_type)`, all of width `k`. With `names` (one a part),
    /// an error about a part names it (`tensor 'NAME': ...`), else its index (`part i: ...`).
    #[staticmethod]
    #[pyo3(signature = (parts, k, names=None))]
    fn stack_gguf(py: Python<'_>, parts: &Bound<'_, PyAny>, k: i64, names: Option<Vec<String>>) -> PyResult<Self> {
        let k = dim("k", k, 1)?;
        let mut held = Vec::new();
        for (i, item) in parts.try_iter()?.enumerate() {
            let item = item?;
            let (data, ty): (Bound<'_, PyAny>, String) = item
                .extract()
                .map_err(|_| PyTypeError::new_err(format!("parts[{i}] must be a (data, ggml_type) pair")))?;
            let (g, shape) = u8_2d(&data, &format!("parts[{i}] data"))?;
            held.push((g, shape[0], ty));
        }
        let mut slices = Vec::with_capacity(held.len());
        for (i, (g, rows, ty)) in held.iter().enumerate() {
            slices.push((ty.as_str(), slice_of(g, &format!("parts[{i}] data"))?, *rows));
        }
        let names: Option<Vec<&str>> = names.as_ref().map(|v| v.iter().map(String::as_str).collect());
        let w = py
            .detach(|| lin::QWeight::from_gguf_named(&slices, names.as_deref(), k))
            .map_err(PyErr::from)?;
        Ok(QLinear {
            w: std::sync::Arc::new(w),
        })
    }

    /// Quantize float32 weights `[n, k]` (k a multiple of 32) per 32-wide block, asymmetric 8-bit.
    #[staticmethod]
    fn from_float(py: Python<'_>, w: &Bound<'_, PyAny>) -> PyResult<Self> {
        let (g, shape) = f32_2d(w, "w")?;
        let v = slice_of(&g, "w")?;
        let q = py
            .detach(|| lin::QWeight::from_f32(v, shape[0], shape[1]))
            .map_err(PyErr::from)?;
        Ok(QLinear {
            w: std::sync::Arc::new(q),
        })
    }

    /// From `codes: uint8 [n, k]`, `d`, `m`: float32 `[n, k/32]` (the inverse of `unpack`).
    #[staticmethod]
    fn from_parts(codes: &Bound<'_, PyAny>, d: &Bound<'_, PyAny>, m: &Bound<'_, PyAny>) -> PyResult<Self> {
        let (cg, cs) = u8_2d(codes, "codes")?;
        let (dg, ds) = f32_2d(d, "d")?;
        let (mg, ms) = f32_2d(m, "m")?;
        if ds != ms || ds[0] != cs[0] || cs[1] != ds[1] * lin::QBLOCK {
            return Err(PyValueError::new_err(format!(
                "need codes [n, k], d and m [n, k/{}]; got {cs:?}, {ds:?}, {ms:?}",
                lin::QBLOCK
            )));
        }
        let q = lin::QWeight::from_parts(
            cs[0],
            cs[1],
            slice_of(&cg, "codes")?,
            slice_of(&dg, "d")?,
            slice_of(&mg, "m")?,
        )
        .map_err(PyErr::from)?;
        Ok(QLinear {
            w: std::sync::Arc::new(q),
        })
    }

    /// Output features.
    #[getter]
    fn n(&self) -> usize {
        self.w.n()
    }

    /// Input features.
    #[getter]
    fn k(&self) -> usize {
        self.w.k()
    }

    /// Bytes held (codes and scales).
    #[getter]
    fn nbytes(&self) -> usize {
        self.w.nbytes()
    }

    /// How many panels (16 output rows each) hold their codes in each layout: `{4: .., 5: .., 6: ..,
    /// 8: ..}` (bits a code; a panel takes the fewest that hold its codes).
    #[getter]
    fn code_bits<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for bits in [4, 5, 6, 8] {
            d.set_item(bits, self.w.bits_panels(bits))?;
        }
        Ok(d)
    }

    /// How many panels are split: GGUF Q6_K rows held exactly, each 32-wide block as two 16-wide
    /// halves with scales of their own (`w = d_h*(c - 32)`), which `unpack` cannot express.
    #[getter]
    fn split_panels(&self) -> usize {
        self.w.split_panels()
    }

    /// The weights' values, float64 `[n, k]` (exactly what the products read; every layout).
    fn dequantize<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let (n, k) = (self.w.n(), self.w.k());
        let w = py.detach(|| self.w.dequantize());
        let a = numpy::ndarray::Array2::from_shape_vec((n, k), w).map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(a.into_pyarray(py).into_any())
    }

    /// Activation digits of this weight's products: 2 (default), or 1 (llama.cpp's Q8 activations:
    /// half the integer work of a compute-bound product, ~2 significant digits less).
    #[getter]
    fn act_digits(&self) -> usize {
        self.w.act_digits()
    }

    /// Set the activation digits (1 or 2) for the products from now on; shared with every holder
    /// of this weight (a fused decoder built from it too). Anything else: ValueError, unchanged.
    fn set_act_digits(&self, digits: i64) -> PyResult<()> {
        let d = usize::try_from(digits)
            .map_err(|_| PyValueError::new_err(format!("act_digits must be 1 or 2, got {digits}")))?;
        self.w.set_act_digits(d).map_err(PyErr::from)
    }

    /// `(codes uint8 [n, k], d float32 [n, k/32], m float32 [n, k/32])`; ValueError for a weight
    /// with split panels (`split_panels`; `dequantize` gives its values).
    fn unpack<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        if self.w.split_panels() > 0 {
            return Err(PyValueError::new_err(format!(
                "this weight has {} split panels (GGUF Q6_K: two scales a 32-wide block), which codes, d and m \
                 cannot express; use dequantize() for its values",
                self.w.split_panels()
            )));
        }
        let (n, nb) = (self.w.n(), self.w.k() / lin::QBLOCK);
        let (c, d, m) = py.detach(|| self.w.unpack());
        let shaped = |v: Vec<f32>| numpy::ndarray::Array2::from_shape_vec((n, nb), v);
        let c = numpy::ndarray::Array2::from_shape_vec((n, self.w.k()), c)
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        let d = shaped(d).map_err(|e| PyValueError::new_err(e.to_string()))?;
        let m = shaped(m).map_err(|e| PyValueError::new_err(e.to_string()))?;
        PyTuple::new(
            py,
            [
                c.into_pyarray(py).into_any(),
                d.into_pyarray(py).into_any(),
                m.into_pyarray(py).into_any(),
            ],
        )
    }

    /// `x @ W.T`: `x` float32 `[m, k]` -> float32 `[m, n]` (into `out` when given).
    #[pyo3(signature = (x, *, out = None))]
    fn __call__<'py>(
        &self,
        py: Python<'py>,
        x: &Bound<'py, PyAny>,
        out: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let xr = typed::<f32>(x, "x", 2, "float32")?;
        let (m, k) = (xr.shape[0], xr.shape[1]);
        if k != self.w.k() {
            return Err(PyValueError::new_err(format!(
                "x must be [m, {}], got {:?}",
                self.w.k(),
                xr.shape
            )));
        }
        let n = self.w.n();
        let out_obj = out_f32(py, out, &[m, n], &[(&xr, "x")])?;
        let xg = readonly::<f32>(&xr, "x")?;
        let mut og = readwrite_f32(&out_obj, "out")?;
        let xs = slice_of(&xg, "x")?;
        let o = og
            .as_slice_mut()
            .map_err(|e| PyValueError::new_err(format!("out: {e}")))?;
        let w = &self.w;
        py.detach(|| lin::linear(xs, m, w, o)).map_err(PyErr::from)?;
        drop(og);
        Ok(out_obj)
    }

    fn __repr__(&self) -> PyResult<String> {
        let isa = lin::variant_name(lin::active_isa()?);
        Ok(format!("QLinear(n={}, k={}, isa={isa:?})", self.w.n(), self.w.k()))
    }
}

/// Decode GGUF rows `data: uint8 [n, row_bytes]` of type `ggml_type` (F32, F16, BF16, Q4_0,
/// Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) and width `k` to float32 `[n, k]` (into `out` when given), exactly as `gguf` does.
#[pyfunction]
#[pyo3(signature = (data, ggml_type, k, *, out = None))]
pub fn dequantize_gguf<'py>(
    py: Python<'py>,
    data: &Bound<'py, PyAny>,
    ggml_type: &str,
    k: i64,
    out: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let dr = typed::<u8>(data, "data", 2, "uint8")?;
    let k = dim("k", k, 1)?;
    let n = dr.shape[0];
    let out_obj = out_f32(py, out, &[n, k], &[(&dr, "data")])?;
    let dg = readonly::<u8>(&dr, "data")?;
    let raw = slice_of(&dg, "data")?;
    let mut og = readwrite_f32(&out_obj, "out")?;
    let o = og
        .as_slice_mut()
        .map_err(|e| PyValueError::new_err(format!("out: {e}")))?;
    py.detach(|| lin::gguf::dequantize(ggml_type, raw, n, k, o))
        .map_err(PyErr::from)?;
    drop(og);
    Ok(out_obj)
}

/// Read `count` GGUF strings (a u64 little-endian byte length, then UTF-8 bytes) from the bytes
/// `data: uint8 [N]` at byte offset `offset`: `(strings, offset after the last one)`. A truncated
/// or non-UTF-8 item raises ValueError naming the item.
#[pyfunction]
pub fn gguf_strings<'py>(
    py: Python<'py>,
    data: &Bound<'py, PyAny>,
    offset: i64,
    count: i64,
) -> PyResult<(Bound<'py, PyList>, usize)> {
    let dr = typed::<u8>(data, "data", 1, "uint8")?;
    let (offset, count) = (dim("offset", offset, 0)?, dim("count", count, 0)?);
    let dg = readonly::<u8>(&dr, "data")?;
    let buf = slice_of(&dg, "data")?;
    let (items, end) = lin::gguf::string_array(buf, offset, count).map_err(|e| {
        PyValueError::new_err(match e {
            lin::gguf::StringsError::Truncated { item, at, need } => {
                format!("item {item} needs {need} bytes at offset {at}, data has {}", buf.len())
            }
            lin::gguf::StringsError::NotUtf8 { item } => format!("item {item} is not UTF-8"),
        })
    })?;
    Ok((PyList::new(py, items)?, end))
}

/// RMSNorm of float32 `x [T, H]` times `weight [H]`; with `residual` (float32 `[T, H]`), first
/// `residual += x` in place and normalise that (vLLM's fused_add_rms_norm). Returns `out`.
#[pyfunction]
#[pyo3(signature = (x, weight, eps, *, residual = None, out = None))]
pub fn rms_norm<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
    weight: &Bound<'py, PyAny>,
    eps: f64,
    residual: Option<&Bound<'py, PyAny>>,
    out: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let xr = typed::<f32>(x, "x", 2, "float32")?;
    let wr = typed::<f32>(weight, "weight", 1, "float32")?;
    let h = xr.shape[1];
    if wr.shape[0] != h {
        return Err(PyValueError::new_err(format!(
            "weight must be [{h}], got {:?}",
            wr.shape
        )));
    }
    let rr = residual
        .map(|r| typed::<f32>(r, "residual", 2, "float32"))
        .transpose()?;
    let mut inputs = vec![(&xr, "x"), (&wr, "weight")];
    if let Some(r) = &rr {
        if r.shape != xr.shape {
            return Err(PyValueError::new_err(format!(
                "residual must have x's shape {:?}, got {:?}",
                xr.shape, r.shape
            )));
        }
        if r.overlaps(&xr) || r.overlaps(&wr) {
            return Err(PyValueError::new_err("residual must not share memory with x or weight"));
        }
        inputs.push((r, "residual"));
    }
    let out_obj = out_f32(py, out, &xr.shape, &inputs)?;
    let (xg, wg) = (readonly::<f32>(&xr, "x")?, readonly::<f32>(&wr, "weight")?);
    let mut rg = residual.map(|r| readwrite_f32(r, "residual")).transpose()?;
    let mut og = readwrite_f32(&out_obj, "out")?;
    let (xs, ws) = (slice_of(&xg, "x")?, slice_of(&wg, "weight")?);
    let rs = match rg.as_mut() {
        Some(g) => Some(
            g.as_slice_mut()
                .map_err(|e| PyValueError::new_err(format!("residual: {e}")))?,
        ),
        None => None,
    };
    let os = og
        .as_slice_mut()
        .map_err(|e| PyValueError::new_err(format!("out: {e}")))?;
    py.detach(|| crate::ops::rms_norm(xs, h, ws, eps as f32, rs, os))
        .map_err(PyErr::from)?;
    drop(og);
    Ok(out_obj)
}

/// SwiGLU activation: float32 `gate_up [T, 2F]` (gate columns, then up) -> `silu(gate) * up [T, F]`.
#[pyfunction]
#[pyo3(signature = (gate_up, *, out = None))]
pub fn silu_and_mul<'py>(
    py: Python<'py>,
    gate_up: &Bound<'py, PyAny>,
    out: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    act_and_mul(py, gate_up, out, crate::ops::Activation::Silu)
}

/// GeGLU activation (Gemma): float32 `gate_up [T, 2F]` -> `gelu_tanh(gate) * up [T, F]`.
#[pyfunction]
#[pyo3(signature = (gate_up, *, out = None))]
pub fn gelu_tanh_and_mul<'py>(
    py: Python<'py>,
    gate_up: &Bound<'py, PyAny>,
    out: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    act_and_mul(py, gate_up, out, crate::ops::Activation::GeluTanh)
}

fn act_and_mul<'py>(
    py: Python<'py>,
    gate_up: &Bound<'py, PyAny>,
    out: Option<&Bound<'py, PyAny>>,
    act: crate::ops::Activation,
) -> PyResult<Bound<'py, PyAny>> {
    let gr = typed::<f32>(gate_up, "gate_up", 2, "float32")?;
    if gr.shape[1] % 2 != 0 || gr.shape[1] == 0 {
        return Err(PyValueError::new_err(format!(
            "gate_up must be [T, 2F], got {:?}",
            gr.shape
        )));
    }
    let f = gr.shape[1] / 2;
    let out_obj = out_f32(py, out, &[gr.shape[0], f], &[(&gr, "gate_up")])?;
    let gg = readonly::<f32>(&gr, "gate_up")?;
    let mut og = readwrite_f32(&out_obj, "out")?;
    let gs = slice_of(&gg, "gate_up")?;
    let os = og
        .as_slice_mut()
        .map_err(|e| PyValueError::new_err(format!("out: {e}")))?;
    py.detach(|| crate::ops::act_and_mul(gs, f, act, os))
        .map_err(PyErr::from)?;
    drop(og);
    Ok(out_obj)
}
