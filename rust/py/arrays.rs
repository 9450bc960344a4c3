//! numpy arrays at the border: validated views (`Raw`: dtype, ndim, C-contiguity, alignment,
//! byte order, overlap), typed slices of them, KV-cache pairs and float32 outputs.

use half::{bf16, f16};
use numpy::{
    npyffi, Element, PyArray, PyArrayDescrMethods, PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn, PyUntypedArray,
    PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use super::type_name;
use crate::attention::{CacheShape, DType, Kv, KvMut};

/// A validated, C-contiguous, aligned numpy array: its bytes and shape.
pub(super) struct Raw<'py> {
    pub(super) arr: Bound<'py, PyUntypedArray>,
    pub(super) ptr: *mut u8,
    pub(super) nbytes: usize,
    pub(super) shape: Vec<usize>,
}

impl Raw<'_> {
    pub(super) fn overlaps(&self, other: &Raw) -> bool {
        let (a, b) = (self.ptr as usize, other.ptr as usize);
        self.nbytes > 0 && other.nbytes > 0 && a < b + other.nbytes && b < a + self.nbytes
    }
    pub(super) fn writeable(&self) -> bool {
        // SAFETY: `arr` is a live numpy array; reading its flags field is always valid.
        let flags = unsafe { (*self.arr.as_array_ptr()).flags };
        flags & npyffi::NPY_ARRAY_WRITEABLE != 0
    }
}

/// Cast to ndarray, check ndim, C-contiguity and alignment; the dtype is checked by the caller.
pub(super) fn raw<'py>(obj: &Bound<'py, PyAny>, name: &str, ndim: usize) -> PyResult<Raw<'py>> {
    let arr = obj
        .cast::<PyUntypedArray>()
        .map_err(|_| PyTypeError::new_err(format!("{name} must be a numpy.ndarray, got {}", type_name(obj))))?
        .clone();
    if arr.ndim() != ndim {
        return Err(PyValueError::new_err(format!(
            "{name} must be {ndim}-d, got shape {:?}",
            arr.shape()
        )));
    }
    if !arr.is_c_contiguous() {
        return Err(PyValueError::new_err(format!(
            "{name} must be C-contiguous (use numpy.ascontiguousarray)"
        )));
    }
    let dt = arr.dtype();
    if dt.is_native_byteorder() == Some(false) {
        return Err(PyTypeError::new_err(format!("{name} must be in native byte order")));
    }
    let item = dt.itemsize();
    // SAFETY: `arr` is a live numpy array; `data` is its data pointer.
    let ptr = unsafe { (*arr.as_array_ptr()).data } as *mut u8;
    let shape = arr.shape().to_vec();
    let nbytes = shape.iter().product::<usize>() * item;
    if nbytes > 0 && !(ptr as usize).is_multiple_of(item.max(1)) {
        return Err(PyValueError::new_err(format!(
            "{name} data is not aligned to its {item}-byte items"
        )));
    }
    Ok(Raw {
        arr,
        ptr,
        nbytes,
        shape,
    })
}

pub(super) fn dtype_name(r: &Raw) -> String {
    r.arr
        .dtype()
        .getattr("name")
        .and_then(|n| n.extract::<String>())
        .unwrap_or_else(|_| "?".into())
}

/// A typed array (float32 / int32 / int64) of `ndim` dimensions.
pub(super) fn typed<'py, T: Element>(
    obj: &Bound<'py, PyAny>,
    name: &str,
    ndim: usize,
    want: &str,
) -> PyResult<Raw<'py>> {
    let r = raw(obj, name, ndim)?;
    if !r.arr.dtype().is_equiv_to(&numpy::dtype::<T>(obj.py())) {
        return Err(PyTypeError::new_err(format!(
            "{name} must be {want}, got {}",
            dtype_name(&r)
        )));
    }
    Ok(r)
}

pub(super) fn readonly<'py, T: Element>(r: &Raw<'py>, name: &str) -> PyResult<PyReadonlyArrayDyn<'py, T>> {
    r.arr
        .cast::<PyArrayDyn<T>>()
        .map_err(|_| PyTypeError::new_err(format!("{name} has the wrong dtype")))?
        .try_readonly()
        .map_err(|e| PyValueError::new_err(format!("{name}: {e}")))
}

pub(super) fn slice_of<'a, T: Element>(a: &'a PyReadonlyArrayDyn<'_, T>, name: &str) -> PyResult<&'a [T]> {
    a.as_slice().map_err(|e| PyValueError::new_err(format!("{name}: {e}")))
}

/// A KV cache: 4-d, float32 / float16 / bfloat16.
pub(super) fn cache<'py>(obj: &Bound<'py, PyAny>, name: &str) -> PyResult<(Raw<'py>, DType)> {
    let r = raw(obj, name, 4)?;
    let dt = r.arr.dtype();
    // The dtype's name (a Python attribute lookup, done for every cache of every layer each
    // fused decode step) only when kind and size do not settle it.
    let d = match (dt.kind(), dt.itemsize()) {
        (b'f', 4) => DType::F32,
        (b'f', 2) => DType::F16,
        (_, size) => match dtype_name(&r).as_str() {
            "bfloat16" if size == 2 => DType::Bf16,
            n => {
                return Err(PyTypeError::new_err(format!(
                    "{name} must be float32, float16 or bfloat16, got {n}"
                )))
            }
        },
    };
    Ok((r, d))
}

/// `cache_pair` for kernels that write the caches.
pub(super) fn cache_pair_mut<'py>(
    k: &Bound<'py, PyAny>,
    v: &Bound<'py, PyAny>,
) -> PyResult<(Raw<'py>, Raw<'py>, DType, CacheShape)> {
    let pair = cache_pair(k, v)?;
    if !pair.0.writeable() || !pair.1.writeable() {
        return Err(PyValueError::new_err("k_cache and v_cache must be writeable"));
    }
    Ok(pair)
}

pub(super) fn cache_pair<'py>(
    k: &Bound<'py, PyAny>,
    v: &Bound<'py, PyAny>,
) -> PyResult<(Raw<'py>, Raw<'py>, DType, CacheShape)> {
    let (kr, kd) = cache(k, "k_cache")?;
    let (vr, vd) = cache(v, "v_cache")?;
    if kd != vd || kr.shape != vr.shape {
        return Err(PyValueError::new_err(format!(
            "k_cache and v_cache must match: {:?} {} vs {:?} {}",
            kr.shape,
            kd.name(),
            vr.shape,
            vd.name()
        )));
    }
    if kr.overlaps(&vr) {
        return Err(PyValueError::new_err("k_cache and v_cache must not share memory"));
    }
    let s = &kr.shape;
    let shape = CacheShape {
        num_blocks: s[0],
        num_kv_heads: s[1],
        block_size: s[2],
        head_dim: s[3],
    };
    shape.numel().map_err(PyErr::from)?;
    Ok((kr, vr, kd, shape))
}

/// Read-only typed view of a validated cache.
///
/// # Safety
/// `r` passed `cache`/`raw` (C-contiguous, aligned, `numel` items of `dt`) and stays alive
/// and unmodified by others for `'a`.
pub(super) unsafe fn kv<'a>(r: &Raw, dt: DType, numel: usize) -> Kv<'a> {
    // SAFETY: per the function contract; numel * item == r.nbytes. A 0-element array may
    // have a dangling data pointer, so use an empty slice then.
    unsafe {
        match dt {
            _ if numel == 0 => Kv::F32(&[]),
            DType::F32 => Kv::F32(std::slice::from_raw_parts(r.ptr as *const f32, numel)),
            DType::F16 => Kv::F16(std::slice::from_raw_parts(r.ptr as *const f16, numel)),
            DType::Bf16 => Kv::Bf16(std::slice::from_raw_parts(r.ptr as *const bf16, numel)),
        }
    }
}

/// Mutable typed view of a validated, writeable cache.
///
/// # Safety
/// As for `kv`, plus: nothing else reads or writes the array for `'a`.
pub(super) unsafe fn kv_mut<'a>(r: &Raw, dt: DType, numel: usize) -> KvMut<'a> {
    // SAFETY: per the function contract.
    unsafe {
        match dt {
            _ if numel == 0 => KvMut::F32(&mut []),
            DType::F32 => KvMut::F32(std::slice::from_raw_parts_mut(r.ptr as *mut f32, numel)),
            DType::F16 => KvMut::F16(std::slice::from_raw_parts_mut(r.ptr as *mut f16, numel)),
            DType::Bf16 => KvMut::Bf16(std::slice::from_raw_parts_mut(r.ptr as *mut bf16, numel)),
        }
    }
}

pub(super) fn u8_2d<'py>(obj: &Bound<'py, PyAny>, name: &str) -> PyResult<(PyReadonlyArrayDyn<'py, u8>, Vec<usize>)> {
    let r = typed::<u8>(obj, name, 2, "uint8")?;
    Ok((readonly::<u8>(&r, name)?, r.shape))
}

pub(super) fn f32_2d<'py>(obj: &Bound<'py, PyAny>, name: &str) -> PyResult<(PyReadonlyArrayDyn<'py, f32>, Vec<usize>)> {
    let r = typed::<f32>(obj, name, 2, "float32")?;
    Ok((readonly::<f32>(&r, name)?, r.shape))
}

/// A writeable float32 output: `out` when given (checked: shape, writeable, disjoint from
/// `inputs`), else a new zeroed array of `shape`.
pub(super) fn out_f32<'py>(
    py: Python<'py>,
    out: Option<&Bound<'py, PyAny>>,
    shape: &[usize],
    inputs: &[(&Raw, &str)],
) -> PyResult<Bound<'py, PyAny>> {
    let obj = match out {
        Some(o) => o.clone(),
        None => PyArray::<f32, _>::zeros(py, shape.to_vec(), false).into_any(),
    };
    let r = typed::<f32>(&obj, "out", shape.len(), "float32")?;
    if r.shape != shape {
        return Err(PyValueError::new_err(format!(
            "out must be {shape:?}, got {:?}",
            r.shape
        )));
    }
    for (i, name) in inputs {
        if r.overlaps(i) {
            return Err(PyValueError::new_err(format!("out must not share memory with {name}")));
        }
    }
    Ok(obj)
}

pub(super) fn readwrite_f32<'py>(
    obj: &Bound<'py, PyAny>,
    name: &str,
) -> PyResult<numpy::PyReadwriteArrayDyn<'py, f32>> {
    obj.cast::<PyArrayDyn<f32>>()
        .map_err(|_| PyTypeError::new_err(format!("{name} must be float32")))?
        .try_readwrite()
        .map_err(|e| PyValueError::new_err(format!("{name} must be writeable and not borrowed elsewhere: {e}")))
}
