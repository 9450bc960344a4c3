//! pagedkv_rs: paged KV-cache block allocator, block tables and paged attention.
//!
//! The core modules know nothing of Python; `py` is the only border.
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod error;
mod py;

#[pyo3::pymodule]
#[pyo3(name = "_core", module = "pagedkv_rs")]
mod _core {
    #[pymodule_export]
    use super::py::{build_profile, core_version};
}
