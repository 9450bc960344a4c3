//! The Python border: every #[pyclass] / #[pyfunction], numpy extraction and validation.
use pyo3::prelude::*;

/// Version of the compiled core.
#[pyfunction]
pub fn core_version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

// =============================================================================================
// Kernel functions: new_kv_cache, write_kv, copy_blocks, paged_attention, threads, info, probes.
// Everything from Python is validated here (types, dtypes, contiguity, alignment, ndim,
// aliasing, writability) and in `attention::validate` (shapes, ids, lengths) before any
// unchecked access; failures raise TypeError / ValueError.
// =============================================================================================

mod kernel {
    use half::{bf16, f16};
    use numpy::{
        npyffi, Element, PyArray, PyArrayDescrMethods, PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn,
        PyUntypedArray, PyUntypedArrayMethods,
    };
    use pyo3::exceptions::{PyTypeError, PyValueError};
    use pyo3::prelude::*;
    use pyo3::types::{PyDict, PyTuple};

    use crate::attention::{self as att, Batch, CacheShape, DType, Kv, KvMut, Params};
    use crate::error::Error;

    fn value_err(e: Error) -> PyErr {
        PyValueError::new_err(e.to_string())
    }

    /// A validated, C-contiguous, aligned numpy array: its bytes and shape.
    struct Raw<'py> {
        arr: Bound<'py, PyUntypedArray>,
        ptr: *mut u8,
        nbytes: usize,
        shape: Vec<usize>,
    }

    impl Raw<'_> {
        fn overlaps(&self, other: &Raw) -> bool {
            let (a, b) = (self.ptr as usize, other.ptr as usize);
            self.nbytes > 0 && other.nbytes > 0 && a < b + other.nbytes && b < a + self.nbytes
        }
        fn writeable(&self) -> bool {
            // SAFETY: `arr` is a live numpy array; reading its flags field is always valid.
            let flags = unsafe { (*self.arr.as_array_ptr()).flags };
            flags & npyffi::NPY_ARRAY_WRITEABLE != 0
        }
    }

    /// Cast to ndarray, check ndim, C-contiguity and alignment; the dtype is checked by the caller.
    fn raw<'py>(obj: &Bound<'py, PyAny>, name: &str, ndim: usize) -> PyResult<Raw<'py>> {
        let arr = obj
            .cast::<PyUntypedArray>()
            .map_err(|_| PyTypeError::new_err(format!("{name} must be a numpy.ndarray, got {}", type_name(obj))))?
            .clone();
        if arr.ndim() != ndim {
            return Err(PyValueError::new_err(format!("{name} must be {ndim}-d, got shape {:?}", arr.shape())));
        }
        if !arr.is_c_contiguous() {
            return Err(PyValueError::new_err(format!("{name} must be C-contiguous (use numpy.ascontiguousarray)")));
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
        if nbytes > 0 && (ptr as usize) % item.max(1) != 0 {
            return Err(PyValueError::new_err(format!("{name} data is not aligned to its {item}-byte items")));
        }
        Ok(Raw { arr, ptr, nbytes, shape })
    }

    fn type_name(obj: &Bound<'_, PyAny>) -> String {
        obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into())
    }

    fn dtype_name(r: &Raw) -> String {
        r.arr.dtype().getattr("name").and_then(|n| n.extract::<String>()).unwrap_or_else(|_| "?".into())
    }

    /// A typed array (float32 / int32 / int64) of `ndim` dimensions.
    fn typed<'py, T: Element>(obj: &Bound<'py, PyAny>, name: &str, ndim: usize, want: &str) -> PyResult<Raw<'py>> {
        let r = raw(obj, name, ndim)?;
        if !r.arr.dtype().is_equiv_to(&numpy::dtype::<T>(obj.py())) {
            return Err(PyTypeError::new_err(format!("{name} must be {want}, got {}", dtype_name(&r))));
        }
        Ok(r)
    }

    fn readonly<'py, T: Element>(r: &Raw<'py>, name: &str) -> PyResult<PyReadonlyArrayDyn<'py, T>> {
        r.arr
            .cast::<PyArrayDyn<T>>()
            .map_err(|_| PyTypeError::new_err(format!("{name} has the wrong dtype")))?
            .try_readonly()
            .map_err(|e| PyValueError::new_err(format!("{name}: {e}")))
    }

    fn slice_of<'a, T: Element>(a: &'a PyReadonlyArrayDyn<'_, T>, name: &str) -> PyResult<&'a [T]> {
        a.as_slice().map_err(|e| PyValueError::new_err(format!("{name}: {e}")))
    }

    /// A KV cache: 4-d, float32 / float16 / bfloat16.
    fn cache<'py>(obj: &Bound<'py, PyAny>, name: &str) -> PyResult<(Raw<'py>, DType)> {
        let r = raw(obj, name, 4)?;
        let dt = r.arr.dtype();
        let (kind, size) = (dt.kind(), dt.itemsize());
        let d = match (kind, size, dtype_name(&r).as_str()) {
            (b'f', 4, _) => DType::F32,
            (b'f', 2, _) => DType::F16,
            (_, 2, "bfloat16") => DType::Bf16,
            (_, _, n) => {
                return Err(PyTypeError::new_err(format!("{name} must be float32, float16 or bfloat16, got {n}")))
            }
        };
        Ok((r, d))
    }

    fn cache_pair<'py>(k: &Bound<'py, PyAny>, v: &Bound<'py, PyAny>) -> PyResult<(Raw<'py>, Raw<'py>, DType, CacheShape)> {
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
        let shape = CacheShape { num_blocks: s[0], num_kv_heads: s[1], block_size: s[2], head_dim: s[3] };
        shape.numel().map_err(value_err)?;
        Ok((kr, vr, kd, shape))
    }

    /// Read-only typed view of a validated cache.
    ///
    /// # Safety
    /// `r` passed `cache`/`raw` (C-contiguous, aligned, `numel` items of `dt`) and stays alive
    /// and unmodified by others for `'a`.
    unsafe fn kv<'a>(r: &Raw, dt: DType, numel: usize) -> Kv<'a> {
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
    unsafe fn kv_mut<'a>(r: &Raw, dt: DType, numel: usize) -> KvMut<'a> {
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

    fn dim(name: &str, v: i64, min: i64) -> PyResult<usize> {
        if v < min || v > (1 << 40) {
            return Err(PyValueError::new_err(format!("{name} must be in [{min}, 2**40], got {v}")));
        }
        Ok(v as usize)
    }

    /// Zeroed `(k_cache, v_cache)`, each `[num_blocks, num_kv_heads, block_size, head_dim]`.
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
            Some(d) if d.extract::<String>().is_ok_and(|s| s == "bfloat16") => {
                np.getattr("dtype")?.call1((py.import("ml_dtypes")?.getattr("bfloat16")?,))?
            }
            Some(d) => np
                .getattr("dtype")?
                .call1((d,))
                .map_err(|_| PyTypeError::new_err(format!("dtype must be 'float32', 'float16' or 'bfloat16', got {d}")))?,
        };
        let name: String = dt.getattr("name")?.extract()?;
        if !matches!(name.as_str(), "float32" | "float16" | "bfloat16") {
            return Err(PyValueError::new_err(format!("cache dtype must be float32, float16 or bfloat16, got {name}")));
        }
        let zeros = np.getattr("zeros")?;
        let k = zeros.call1((shape, &dt))?;
        let v = zeros.call1((shape, &dt))?;
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
        let (kr, vr, dt, shape) = cache_pair(k_cache, v_cache)?;
        if !kr.writeable() || !vr.writeable() {
            return Err(PyValueError::new_err("k_cache and v_cache must be writeable"));
        }
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
                return Err(PyValueError::new_err(format!("{n} must not share memory with the caches")));
            }
        }
        let (kg, vg, sg) = (readonly::<f32>(&keyr, "key")?, readonly::<f32>(&valr, "value")?, readonly::<i64>(&slr, "slot_mapping")?);
        let (ks, vs, ss) = (slice_of(&kg, "key")?, slice_of(&vg, "value")?, slice_of(&sg, "slot_mapping")?);
        let numel = shape.numel().map_err(value_err)?;
        // SAFETY: both caches passed `cache_pair` (C-contiguous, aligned, `numel` items, disjoint)
        // and are writeable; key/value/slots are disjoint from them (checked above). The Bound
        // arrays outlive the call. As with any numpy kernel that releases the GIL, the caller
        // must not mutate these arrays from another thread during the call.
        let (km, vm) = unsafe { (kv_mut(&kr, dt, numel), kv_mut(&vr, dt, numel)) };
        py.detach(|| att::write_kv(km, vm, shape, ks, vs, ss)).map_err(value_err)
    }

    /// Copy whole blocks `(src, dst)` in order; `pairs` is int64 `[n, 2]` or a sequence of pairs.
    #[pyfunction]
    pub fn copy_blocks(
        py: Python<'_>,
        k_cache: &Bound<'_, PyAny>,
        v_cache: &Bound<'_, PyAny>,
        pairs: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let (kr, vr, dt, shape) = cache_pair(k_cache, v_cache)?;
        if !kr.writeable() || !vr.writeable() {
            return Err(PyValueError::new_err("k_cache and v_cache must be writeable"));
        }
        let flat: Vec<i64> = if pairs.cast::<PyUntypedArray>().is_ok() {
            let pr = typed::<i64>(pairs, "pairs", 2, "int64")?;
            if pr.shape[1] != 2 {
                return Err(PyValueError::new_err(format!("pairs must be [n, 2], got {:?}", pr.shape)));
            }
            slice_of(&readonly::<i64>(&pr, "pairs")?, "pairs")?.to_vec()
        } else {
            let items: Vec<(i64, i64)> = pairs.extract().map_err(|_| {
                PyTypeError::new_err("pairs must be an int64 array [n, 2] or a sequence of (src, dst) int pairs")
            })?;
            items.into_iter().flat_map(|(a, b)| [a, b]).collect()
        };
        let numel = shape.numel().map_err(value_err)?;
        // SAFETY: as in `write_kv`; `flat` is owned.
        let (km, vm) = unsafe { (kv_mut(&kr, dt, numel), kv_mut(&vr, dt, numel)) };
        py.detach(|| att::copy_blocks(km, vm, shape, &flat)).map_err(value_err)
    }

    /// Causal varlen paged attention; returns `out` float32 `[num_tokens, num_q_heads, head_dim]`.
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
            return Err(PyValueError::new_err(format!("q head_dim {d} != cache head_dim {}", shape.head_dim)));
        }
        if hq == 0 || hq % shape.num_kv_heads != 0 {
            return Err(PyValueError::new_err(format!(
                "num_q_heads ({hq}) must be a positive multiple of num_kv_heads ({})",
                shape.num_kv_heads
            )));
        }
        let btr = typed::<i32>(block_tables, "block_tables", 2, "int32")?;
        let slr = typed::<i32>(seq_lens, "seq_lens", 1, "int32")?;
        let qslr = typed::<i32>(query_start_loc, "query_start_loc", 1, "int32")?;
        let nseq = slr.shape[0];
        if btr.shape[0] != nseq || qslr.shape[0] != nseq + 1 {
            return Err(PyValueError::new_err(format!(
                "need block_tables [B, max_blocks], seq_lens [B], query_start_loc [B+1]; got {:?}, {:?}, {:?}",
                btr.shape, slr.shape, qslr.shape
            )));
        }
        let params = Params::new(d, scale, sliding_window, soft_cap).map_err(value_err)?;
        let out_obj = match out {
            Some(o) => o.clone(),
            None => PyArray::<f32, _>::zeros(py, [t, hq, d], false).into_any(),
        };
        let outr = typed::<f32>(&out_obj, "out", 3, "float32")?;
        if outr.shape != qr.shape {
            return Err(PyValueError::new_err(format!("out must have q's shape {:?}, got {:?}", qr.shape, outr.shape)));
        }
        for (r, n) in [(&qr, "q"), (&kr, "k_cache"), (&vr, "v_cache"), (&btr, "block_tables"), (&slr, "seq_lens"), (&qslr, "query_start_loc")] {
            if outr.overlaps(r) {
                return Err(PyValueError::new_err(format!("out must not share memory with {n}")));
            }
        }
        let (qg, btg, slg, qslg) = (
            readonly::<f32>(&qr, "q")?,
            readonly::<i32>(&btr, "block_tables")?,
            readonly::<i32>(&slr, "seq_lens")?,
            readonly::<i32>(&qslr, "query_start_loc")?,
        );
        let mut og = outr
            .arr
            .cast::<PyArrayDyn<f32>>()
            .map_err(|_| PyTypeError::new_err("out must be float32"))?
            .try_readwrite()
            .map_err(|e| PyValueError::new_err(format!("out must be writeable and not borrowed elsewhere: {e}")))?;
        let batch = Batch {
            q: slice_of(&qg, "q")?,
            num_q_heads: hq,
            block_tables: slice_of(&btg, "block_tables")?,
            max_blocks: btr.shape[1],
            seq_lens: slice_of(&slg, "seq_lens")?,
            query_start_loc: slice_of(&qslg, "query_start_loc")?,
        };
        let o = og.as_slice_mut().map_err(|e| PyValueError::new_err(format!("out: {e}")))?;
        let numel = shape.numel().map_err(value_err)?;
        // SAFETY: both caches passed `cache_pair` (C-contiguous, aligned, `numel` items) and are
        // only read; `out` is disjoint from them (checked above). The Bound arrays outlive the
        // call. As with any numpy kernel that releases the GIL, the caller must not mutate the
        // caches from another thread during the call.
        let (k, v) = unsafe { (kv(&kr, dt, numel), kv(&vr, dt, numel)) };
        py.detach(|| att::paged_attention(k, v, shape, batch, params, o)).map_err(value_err)?;
        drop(og);
        Ok(out_obj)
    }

    /// Use `"auto"` (best detected SIMD) or `"scalar"` (the reference path) kernels.
    #[pyfunction]
    pub fn set_kernel_backend(name: &str) -> PyResult<()> {
        att::set_backend(name).map_err(value_err)
    }

    /// Size the kernel thread pool.
    #[pyfunction]
    pub fn set_num_threads(n: i64) -> PyResult<()> {
        att::set_num_threads(usize::try_from(n).unwrap_or(0)).map_err(value_err)
    }

    #[pyfunction]
    pub fn get_num_threads() -> PyResult<usize> {
        att::num_threads().map_err(value_err)
    }

    /// Kernel configuration: backend, ISA detected and in use, threads, cache layout.
    #[pyfunction]
    pub fn kernel_info(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("backend", att::backend())?;
        d.set_item("isa", att::active_isa(8).name())?;
        d.set_item("detected_isa", att::detected_isa().name())?;
        d.set_item("num_threads", att::num_threads().map_err(value_err)?)?;
        d.set_item("layout", "[num_blocks, num_kv_heads, block_size, head_dim]")?;
        d.set_item("build_profile", build_profile())?;
        // AVX-512 is detected for information only: no AVX-512 kernel exists (AVX2 runs there).
        #[cfg(target_arch = "x86_64")]
        d.set_item("cpu_has_avx512f", std::arch::is_x86_feature_detected!("avx512f"))?;
        Ok(d)
    }

    /// `"release"` or `"debug"`: benchmarks refuse a debug build.
    #[pyfunction]
    pub fn build_profile() -> &'static str {
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        }
    }

    fn threads_or_pool(threads: Option<i64>) -> PyResult<usize> {
        match threads {
            None => att::num_threads().map_err(value_err),
            Some(n) if (1..=1024).contains(&n) => Ok(n as usize),
            Some(n) => Err(PyValueError::new_err(format!("threads must be in [1, 1024], got {n}"))),
        }
    }

    /// Read bandwidth in GB/s: multithreaded SIMD read-sum over a `bytes` buffer, best of 5.
    #[pyfunction]
    #[pyo3(signature = (bytes = 1 << 30, threads = None), text_signature = "(bytes=1073741824, threads=None)")]
    pub fn memory_bandwidth(py: Python<'_>, bytes: i64, threads: Option<i64>) -> PyResult<f64> {
        let th = threads_or_pool(threads)?;
        if !(1 << 20..=1 << 36).contains(&bytes) {
            return Err(PyValueError::new_err(format!("bytes must be in [2**20, 2**36], got {bytes}")));
        }
        py.detach(|| att::probe::memory_bandwidth(bytes as usize, th)).map_err(value_err)
    }

    /// Peak fp32 FMA GFLOP/s over all threads, measured for `seconds`.
    #[pyfunction]
    #[pyo3(signature = (seconds = 0.2, threads = None))]
    pub fn fma_peak(py: Python<'_>, seconds: f64, threads: Option<i64>) -> PyResult<f64> {
        let th = threads_or_pool(threads)?;
        py.detach(|| att::probe::fma_peak(seconds, th)).map_err(value_err)
    }
}

pub use kernel::{
    build_profile, copy_blocks, fma_peak, get_num_threads, kernel_info, memory_bandwidth, new_kv_cache, paged_attention,
    set_kernel_backend, set_num_threads, write_kv,
};
