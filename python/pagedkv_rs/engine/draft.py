"""The draft model of speculative decoding (``--speculative draft:PATH``): a small GGUF of the target's
vocabulary, run in the same process on its own KV pool, proposes the drafts of the sequences that speculate.

A drafting step takes the speculating sequences together. First the draft model catches up on the tokens of each
that it has not seen: at first the whole prompt (less its prefix-cache hit), later the tokens accepted since its
last draft, after its KV was truncated back to the longest prefix it shares with the sequence (the drafts the
target rejected go, as in the target's KV). That forward ends at the sequence's pending token and gives its first
draft; each further draft position is one more forward of all the sequences still drafting (never one per
sequence). Drafts are the draft model's argmax; the target verifies them as it verifies n-gram drafts
(``speculative.verify``: a draft is accepted iff it equals the target's own token), so the outputs do not depend
on the draft model, only the speed does.

The pool (``SpeculativeConfig.kv`` bytes, the engine's block size and KV dtype, prefix caching on: the completions
of an ``n > 1`` request share their prompt) holds one block table per speculating sequence, under the sequence's
own id. The scheduler calls ``release`` when a sequence finishes or is preempted (it catches up again if it runs
again). When the pool is short, the KV of sequences not drafting this step goes first, then the batch's order
decides (the scheduler's: oldest or highest priority first): a sequence may take the KV of those after it, never
of those before, so the same sequences draft step after step instead of evicting each other. A sequence that
does not fit even so, or that would pass the draft model's context, does not draft this step (or stops at the
drafts it has): never an error, never a wait.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np

from pagedkv_rs import kernels
from pagedkv_rs.errors import OutOfBlocksError
from pagedkv_rs.models.gguf_loader import GGUFError, load_gguf

__all__ = ["DraftRunner", "check_vocabulary", "load_drafter"]


class DraftRunner:
    """The draft model, its KV pool (a ``KVCacheManager`` and one (K, V) pair per layer), and its counters."""

    def __init__(
        self, model: Any, manager_cls: type, num_blocks: int, block_size: int, kv_cache_dtype: Any = "float16"
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"the draft model's KV pool holds no block of {block_size} tokens")
        self.model = model
        self.kv = manager_cls(num_blocks, block_size, enable_prefix_caching=True)
        self.kv_caches: list[tuple[np.ndarray, np.ndarray]] = [
            kernels.new_kv_cache(num_blocks, block_size, model.num_kv_heads, model.head_dim, kv_cache_dtype)
            for _ in range(model.num_layers)
        ]
        self.max_len = min(int(model.max_model_len), int(self.kv.max_seq_len))
        # the logits of each forward, written into rows of one reused buffer (as the runner's) if the model can
        self._logits: Optional[np.ndarray] = np.empty((0, model.vocab_size), np.float32) if _takes_out(model) else None
        # per sequence id: its KV holds the sequence's first ``seen`` tokens, then ``tail`` (its unverified drafts)
        self._seen: dict[int, int] = {}
        self._tail: dict[int, list[int]] = {}
        self._used: dict[int, int] = {}  # the drafting step that last used its KV
        self._step = 0
        self.num_forwards = 0
        self.num_tokens = 0  # tokens computed: catch-up and drafts
        self.num_skipped = 0  # sequences that could not draft for lack of room in the pool or the context
        self.seconds = 0.0

    def propose(self, reqs: Sequence[Any], ks: Sequence[int]) -> list[list[int]]:
        """Up to ``ks[i]`` greedy drafts after the pending token of each request (its last token)."""
        t0 = time.perf_counter()
        self._step += 1
        order = [r.seq_id for r in reqs]
        drafts: list[list[int]] = [[] for _ in reqs]
        live: list[int] = []
        counts: list[int] = []
        for j, (req, k) in enumerate(zip(reqs, ks)):
            n = self._catch_up(req, int(k), order[j + 1 :])
            if n:
                live.append(j)
                counts.append(n)
            else:
                self.num_skipped += 1
        while live:
            ids = [reqs[j].seq_id for j in live]
            tokens = self._forward(ids, counts)
            more = []
            for j, sid, t in zip(live, ids, tokens):
                drafts[j].append(t)
                if len(drafts[j]) < ks[j] and self._extend(sid, t):
                    more.append(j)
            live, counts = more, [1] * len(more)
        self.seconds += time.perf_counter() - t0
        return drafts

    def release(self, seq_id: int) -> None:
        """Free a sequence's draft KV (finished, aborted or preempted)."""
        if seq_id in self._seen:
            self.kv.free(seq_id)
            del self._seen[seq_id], self._tail[seq_id], self._used[seq_id]

    def _catch_up(self, req: Any, k: int, after: list[int]) -> int:
        """Bring the sequence's draft KV up to its tokens; how many it computes in the first forward (0: none,
        it does not draft this step). ``after``: the sequences after it in this step, which give way to it."""
        sid, toks = req.seq_id, req.all_token_ids
        size = len(toks)
        if sid in self._used:
            self._used[sid] = self._step  # drafting this step or not, sequences after it do not take its KV
        if size < 2 or size + k - 1 > self.max_len:
            self.release(sid)
            return 0
        try:
            if sid in self._seen:
                seen, tail = self._seen[sid], self._tail[sid]
                p = min(seen, size - 1)  # the request only appends: its first ``seen`` tokens are unchanged
                if p == seen:
                    for a, b in zip(tail, toks[seen:]):
                        if a != b:
                            break
                        p += 1
                    p = min(p, size - 1)  # the pending token is computed here: its logits give the first draft
                if p < seen + len(tail):
                    self.kv.truncate(sid, p)
                self._seen[sid], self._tail[sid] = p, []  # its KV: exactly the sequence's first p tokens
                if not self._room(self.kv.blocks_needed_to_append(sid, size - p), after):
                    return 0
                self._copy(self.kv.append(sid, toks[p:]))
                computed = self.kv.num_computed_tokens(sid)
            else:
                salt = req.kv_salt  # the target's prefix-cache isolation holds in the draft pool too
                if not self._room(self.kv.blocks_needed(toks, salt), after):
                    return 0
                computed = self.kv.allocate(sid, toks, salt)
        except OutOfBlocksError:  # pragma: no cover - _room checked the blocks
            self.release(sid)
            return 0
        self._seen[sid], self._tail[sid], self._used[sid] = size, [], self._step
        return size - computed

    def _extend(self, sid: int, token: int) -> bool:
        """Append a draft to the sequence's KV (computed by the next forward), if it fits."""
        if not self.kv.can_append(sid, 1):
            return False
        self._copy(self.kv.append(sid, [token]))
        self._tail[sid].append(token)
        return True

    def _room(self, need: int, after: list[int]) -> bool:
        """Whether ``need`` blocks can be had. The KV of sequences not drafting this step goes first (least
        recently used first), then that of the sequences ``after`` this one, last first: the batch's order (the
        scheduler's: oldest or highest priority first) decides who drafts when the pool is short, the same way
        every step, so no two sequences keep evicting each other. Nothing goes when even that would not do."""
        have = self.kv.num_free_blocks + self.kv.num_cached_blocks
        if need <= have:
            return True
        later = set(after)
        idle = sorted(
            (s for s in self._used if s not in later and self._used[s] < self._step), key=self._used.__getitem__
        )
        victims = idle + [s for s in reversed(after) if s in self._seen]
        if need > have + sum(len(self.kv.block_table(s)) for s in victims):
            return False
        for sid in victims:
            self.release(sid)
            have = self.kv.num_free_blocks + self.kv.num_cached_blocks
            if need <= have:
                break
        return need <= have

    def _copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write copies the manager asks for (a block shared through the prefix cache)."""
        if pairs:
            idx = np.asarray(pairs, np.int64)
            for k, v in self.kv_caches:
                kernels.copy_blocks(k, v, idx)

    def _forward(self, seq_ids: list[int], counts: list[int]) -> list[int]:
        """One forward of the draft model over these sequences' next ``counts`` tokens: each one's argmax."""
        batch = self.kv.prepare_batch(seq_ids, counts)
        buf = self._logits
        if buf is None:
            logits = self.model.forward(batch, self.kv_caches)
        else:
            if len(buf) < len(seq_ids):
                buf = self._logits = np.empty((len(seq_ids), buf.shape[1]), np.float32)
            logits = self.model.forward(batch, self.kv_caches, out=buf[: len(seq_ids)])
        self.num_forwards += 1
        self.num_tokens += sum(counts)
        return [int(t) for t in np.argmax(logits, axis=1)]

    def check_invariants(self) -> None:
        """The pool's invariants, and each sequence's KV: exactly its tracked tokens, all computed."""
        self.kv.check_invariants()
        assert sorted(self.kv.seq_ids()) == sorted(self._seen)
        for sid, seen in self._seen.items():
            n = seen + len(self._tail[sid])
            assert self.kv.num_tokens(sid) == self.kv.num_computed_tokens(sid) == n, sid

    def stats(self) -> dict[str, Any]:
        """The draft model's forwards, tokens, seconds and skipped sequences; its pool's use."""
        return {
            "spec_decode_draft_forwards": self.num_forwards,
            "spec_decode_draft_tokens": self.num_tokens,
            "spec_decode_draft_seconds": self.seconds,
            "spec_decode_draft_skipped": self.num_skipped,
            "spec_decode_draft_kv_blocks": self.kv.num_blocks,
            "spec_decode_draft_kv_live_blocks": self.kv.num_live_blocks,
        }


def _takes_out(model: Any) -> bool:
    try:
        return "out" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def check_vocabulary(draft: dict[str, Any], target: dict[str, Any], path: str) -> None:
    """Refuse a draft model whose vocabulary (``tokenizer.ggml.tokens``) is not the target's, naming where."""
    a, b = draft.get("tokenizer.ggml.tokens"), target.get("tokenizer.ggml.tokens")
    if not a or not b:
        which = "draft model" if not a else "target model"
        raise GGUFError(f"speculative draft {path}: the {which} has no vocabulary (tokenizer.ggml.tokens)")
    if len(a) != len(b):
        raise GGUFError(
            f"speculative draft {path}: its vocabulary has {len(a)} tokens, the target's {len(b)} "
            "(a draft model needs the target's vocabulary)"
        )
    if a != b:
        i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        raise GGUFError(
            f"speculative draft {path}: its vocabulary differs from the target's: token {i} is {a[i]!r} in the "
            f"draft, {b[i]!r} in the target (a draft model needs the target's vocabulary)"
        )


def load_drafter(
    config: Any, target: Any, manager_cls: type, block_size: int, kv_cache_dtype: Any = "float16"
) -> Optional[DraftRunner]:
    """The ``DraftRunner`` of a ``SpeculativeConfig`` with method "draft" (None for any other), its file checked:
    a GGUF the loader takes, of the target's vocabulary (the target must come from a GGUF file too)."""
    if config is None or config.method != "draft":
        return None
    from pagedkv_rs.models.llama import LlamaModel, LlamaWeights, eos_ids_from_metadata

    target_path = getattr(getattr(target, "weights", None), "path", None)
    if target_path is None:
        raise ValueError(
            f"speculative draft {config.path}: the target model ({type(target).__name__}) has no GGUF file, so its "
            "vocabulary cannot be compared with the draft's"
        )
    g = load_gguf(config.path)
    check_vocabulary(g.metadata, load_gguf(target_path, load_tensors=False).metadata, config.path)
    if g.config.vocab_size != target.vocab_size:
        raise GGUFError(
            f"speculative draft {config.path}: {g.config.vocab_size} logits per token, the target {target.vocab_size}"
        )
    model = LlamaModel(LlamaWeights(g), eos_token_ids=eos_ids_from_metadata(g.metadata))
    num_blocks = config.kv_bytes // model.kv_bytes_per_block(block_size, kv_cache_dtype)
    if num_blocks < 1:
        raise ValueError(
            f"speculative kv={config.kv_bytes} holds no block: one block of the draft model takes "
            f"{model.kv_bytes_per_block(block_size, kv_cache_dtype)} bytes"
        )
    return DraftRunner(model, manager_cls, num_blocks, block_size, kv_cache_dtype)
