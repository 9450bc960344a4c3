//! One error enum for the core; `py.rs` maps it onto the Python exception classes.

/// Every way a core operation can refuse its input. Refusals leave state untouched.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// Not enough free (or reclaimable cached) blocks.
    #[error("out of KV-cache blocks: need {need} blocks, {free} free")]
    OutOfBlocks { need: u64, free: u64 },
    /// The sequence id is not held (the id as the caller wrote it).
    #[error("unknown sequence id {0}")]
    UnknownSequence(String),
    /// The sequence id is already held.
    #[error("sequence id {0} is already allocated")]
    DuplicateSequence(u64),
    /// The sequence would exceed `max_seq_len` (itself capped by the whole pool).
    #[error("sequence of {len} tokens exceeds the limit of {limit} tokens ({num_blocks} blocks x {block_size})")]
    SequenceTooLong {
        len: u64,
        limit: u64,
        num_blocks: usize,
        block_size: usize,
    },
    /// More references dropped than a block holds.
    #[error("block {block} freed {times} time(s) but its ref count is {ref_count}")]
    DoubleFree { block: u32, times: u32, ref_count: u32 },
    /// Bad argument value (ValueError).
    #[error("{0}")]
    Invalid(String),
    /// Bad argument type (TypeError).
    #[error("{0}")]
    Type(String),
}

pub type Result<T> = std::result::Result<T, Error>;
