//! pagedkv_rs: paged KV-cache block allocator, block tables and paged attention.
//!
//! The core modules know nothing of Python; `py` is the only border.
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod allocator;
pub mod attention;
pub mod block_table;
pub mod error;
pub mod linear;
pub mod model;
pub mod ops;
pub mod probe;
#[cfg(feature = "python")]
mod py;
pub mod runtime;
pub mod simd;
#[cfg(test)]
mod testing;

#[cfg(feature = "python")]
#[pyo3::pymodule]
#[pyo3(name = "_core", module = "pagedkv_rs")]
mod _core {
    #[pymodule_export]
    use super::py::core_version;

    // Block allocator and block tables.
    #[pymodule_export]
    use super::py::{BlockAllocator, KVCacheManager};

    // Kernel functions (attention, cache writes, threads, probes).
    #[pymodule_export]
    use super::py::{
        build_profile, copy_blocks, fma_peak, get_isa, get_num_threads, kernel_info, memory_bandwidth, new_kv_cache,
        paged_attention, set_isa, set_num_threads, write_blocks, write_kv,
    };

    // Block-quantized linear layers and the row-wise ops around them.
    #[pymodule_export]
    use super::py::{dequantize_gguf, gelu_tanh_and_mul, gguf_strings, rms_norm, silu_and_mul, QLinear};

    // The fused decoder stack: every layer of one engine step in one call.
    #[pymodule_export]
    use super::py::LlamaDecoder;
}
