//! Whole-model forward passes in Rust (no pyo3): one call per engine step runs every layer.
//!
//! | file      | what                                                                          |
//! |-----------|-------------------------------------------------------------------------------|
//! | llama.rs  | `Decoder`: the one decoder stack every architecture runs, described by data    |
//! | team.rs   | the step team: kernel threads held for a small step, sharing its products     |
//!
//! The kernels are the existing ones (`ops`, `linear`, `attention`), called in the same order and
//! on the same float32 buffers as the numpy `LlamaModel` (the readable spec): the two agree to
//! the last bit where both use int8 weights (tests/models/test_fused.py asserts it). The whole
//! call runs inside one `pool().install`, so the kernel threads stay in one parallel session for
//! the step instead of being handed ~300 separate jobs from Python; a step of at most
//! `TEAM_MAX_TOKENS` tokens runs its products on the step team instead of rayon's parked workers.

pub mod llama;
pub mod team;

pub use llama::{Decoder, Head, Layer, RopeMode, RopeRows};
