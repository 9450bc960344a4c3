"""The kernel inputs of one step, built for a whole batch in one call by ``KVCacheManager.prepare_batch``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["BatchInputs"]


@dataclass(frozen=True)
class BatchInputs:
    """Per-step batch for ``B`` sequences scheduling ``T`` tokens in all.

    Sequence ``i`` computes tokens at positions ``seq_lens[i] - q_len_i ... seq_lens[i] - 1``
    where ``q_len_i = query_start_loc[i + 1] - query_start_loc[i]``.
    """

    input_ids: np.ndarray  # int64 [T]   token ids being computed this step
    positions: np.ndarray  # int64 [T]   their positions in their sequences
    query_start_loc: np.ndarray  # int32 [B+1] row offsets of each sequence's tokens
    seq_lens: np.ndarray  # int32 [B]   KV length of each sequence after this step
    block_tables: np.ndarray  # int32 [B, max_blocks] padded with -1
    indptr: np.ndarray  # int32 [B+1] CSR row offsets into indices
    indices: np.ndarray  # int32 [nnz] block ids, sequence after sequence
    last_page_len: np.ndarray  # int32 [B]   tokens in each sequence's last block (0 if empty)
    slot_mapping: np.ndarray  # int64 [T]   block * block_size + offset for each token

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
