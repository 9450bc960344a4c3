//! The Python border: every #[pyclass] / #[pyfunction], numpy extraction and validation.
//!
//! | file          | what                                                                  |
//! |---------------|-----------------------------------------------------------------------|
//! | mod.rs        | the exception classes, the one `From<Error> for PyErr`, `type_name`   |
//! | args.rs       | int / token / sequence-id argument parsing (the fallback's checks)    |
//! | alloc.rs      | `BlockAllocator`, `KVCacheManager`                                    |
//! | arrays.rs     | numpy array views and their validation                                |
//! | attention.rs  | `new_kv_cache`, `write_kv`, `copy_blocks`, `write_blocks`, `paged_attention` |
//! | linear.rs     | `QLinear`, `dequantize_gguf`, `gguf_strings`, `rms_norm`, `silu_and_mul`, `gelu_tanh_and_mul` |
//! | model.rs      | `LlamaDecoder`: the whole decoder stack in one call per step          |
//! | runtime.rs    | ISA and threads (`set_isa`, `kernel_info`, ...), probes, build info   |
//!
//! Arguments are checked exactly like `pagedkv_rs.fallback` does, in the same order, so both
//! backends raise the same exception types. Python objects are read before the core's mutex
//! is taken (errors that the fallback raises only after a state check are kept and raised in
//! turn), and results are turned into Python objects after it is released. Kernel arguments
//! are validated here (types, dtypes, contiguity, alignment, ndim, aliasing, writability) and
//! in the core (shapes, ids, lengths) before any unchecked access.

mod alloc;
mod args;
mod arrays;
mod attention;
mod linear;
mod model;
mod runtime;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use crate::error::Error;

pub use alloc::{BlockAllocator, KVCacheManager};
pub use attention::{copy_blocks, new_kv_cache, paged_attention, write_blocks, write_kv};
pub use linear::{dequantize_gguf, gelu_tanh_and_mul, gguf_strings, rms_norm, silu_and_mul, QLinear};
pub use model::LlamaDecoder;
pub use runtime::{
    build_profile, core_version, fma_peak, get_isa, get_num_threads, kernel_info, memory_bandwidth, set_isa,
    set_num_threads,
};

pyo3::import_exception!(pagedkv_rs.errors, OutOfBlocksError);
pyo3::import_exception!(pagedkv_rs.errors, UnknownSequenceError);
pyo3::import_exception!(pagedkv_rs.errors, DuplicateSequenceError);
pyo3::import_exception!(pagedkv_rs.errors, SequenceTooLongError);
pyo3::import_exception!(pagedkv_rs.errors, DoubleFreeError);

impl From<Error> for PyErr {
    fn from(e: Error) -> PyErr {
        let msg = e.to_string();
        match e {
            Error::OutOfBlocks { .. } => OutOfBlocksError::new_err(msg),
            Error::UnknownSequence(_) => UnknownSequenceError::new_err(msg),
            Error::DuplicateSequence(_) => DuplicateSequenceError::new_err(msg),
            Error::SequenceTooLong { .. } => SequenceTooLongError::new_err(msg),
            Error::DoubleFree { .. } => DoubleFreeError::new_err(msg),
            Error::Invalid(_) => PyValueError::new_err(msg),
            Error::Type(_) => PyTypeError::new_err(msg),
        }
    }
}

/// The type name of `obj` for error messages.
fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map_or_else(|_| "object".to_owned(), |n| n.to_string())
}
