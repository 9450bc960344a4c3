//! The Python border: every #[pyclass] / #[pyfunction], numpy extraction and validation.
use pyo3::prelude::*;

/// Version of the compiled core.
#[pyfunction]
pub fn core_version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

/// "release" or "debug": benchmarks refuse to measure a debug build.
#[pyfunction]
pub fn build_profile() -> &'static str {
    if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    }
}
