//! The kernel runtime from Python: the ISA setting, threads, `kernel_info`, the machine probes
//! and build information.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::{attention, linear, probe, runtime};

/// Version of the compiled core.
#[pyfunction]
pub fn core_version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

/// Use `"auto"` (the widest ISA detected) or force `"scalar"`, `"avx2"`, `"avx512"` or `"neon"`
/// (ValueError naming the available ones when this CPU lacks it; `kernel_info()["isas"]`).
#[pyfunction]
pub fn set_isa(name: &str) -> PyResult<()> {
    Ok(runtime::set_isa(name)?)
}

/// The ISA setting: `"auto"` or the forced ISA's name.
#[pyfunction]
pub fn get_isa() -> PyResult<&'static str> {
    Ok(runtime::isa_setting_name()?)
}

/// Size the kernel thread pool.
#[pyfunction]
pub fn set_num_threads(n: i64) -> PyResult<()> {
    Ok(runtime::set_num_threads(usize::try_from(n).unwrap_or(0))?)
}

/// Threads of the kernel pool.
#[pyfunction]
pub fn get_num_threads() -> PyResult<usize> {
    Ok(runtime::num_threads()?)
}

/// Kernel configuration: the ISA setting (`isa`), what attention runs (`active_isa`, for
/// head_dim % 8 == 0), the widest detected (`detected_isa`), the ISAs `set_isa` accepts here
/// (`isas`), the linear layer's build, whether the AVX2 build runs its AVX-VNNI form (`avx_vnni`), threads, whether the kernel threads flush subnormal floats to
/// zero (`flush_subnormals`), cache layout and build profile.
#[pyfunction]
pub fn kernel_info(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    let setting = runtime::isa_setting_name()?;
    let isas: Vec<&str> = runtime::available_isas().iter().map(|i| i.name()).collect();
    d.set_item("isa", setting)?;
    d.set_item("active_isa", attention::active_isa(8)?.name())?;
    d.set_item("detected_isa", runtime::detected_isa().name())?;
    d.set_item("isas", isas)?;
    d.set_item("linear_isa", linear::variant_name(runtime::isa()?))?;
    d.set_item("detected_linear_isa", linear::variant_name(runtime::detected_isa()))?;
    d.set_item("avx_vnni", runtime::avx_vnni())?;
    d.set_item("num_threads", runtime::num_threads()?)?;
    d.set_item(
        "flush_subnormals",
        runtime::pool()?.install(runtime::flushes_subnormals),
    )?;
    d.set_item("layout", "[num_blocks, num_kv_heads, block_size, head_dim]")?;
    d.set_item("build_profile", build_profile())?;
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
        None => Ok(runtime::num_threads()?),
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
        return Err(PyValueError::new_err(format!(
            "bytes must be in [2**20, 2**36], got {bytes}"
        )));
    }
    Ok(py.detach(|| probe::memory_bandwidth(bytes as usize, th))?)
}

/// Peak fp32 FMA GFLOP/s over all threads, measured for `seconds` with the widest FMAs the
/// kernels use (zmm on AVX-512 CPUs).
#[pyfunction]
#[pyo3(signature = (seconds = 0.2, threads = None))]
pub fn fma_peak(py: Python<'_>, seconds: f64, threads: Option<i64>) -> PyResult<f64> {
    let th = threads_or_pool(threads)?;
    Ok(py.detach(|| probe::fma_peak(seconds, th))?)
}
