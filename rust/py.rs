//! The Python border: every #[pyclass] / #[pyfunction], numpy extraction and validation.
use pyo3::prelude::*;

/// Version of the compiled core.
#[pyfunction]
pub fn core_version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}
