//! One error enum for the core; `py.rs` maps it onto the Python exception classes.

/// Every way a core operation can refuse its input. Refusals leave state untouched.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// Not enough free (or reclaimable cached) blocks.
    #[error("out of KV-cache blocks: need {need} blocks, {free} free")]
    OutOfBlocks { need: usize, free: usize },
    /// Bad argument value.
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, Error>;
