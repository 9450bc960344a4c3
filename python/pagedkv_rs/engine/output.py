"""Outputs: detokenizing, stop strings, logprob rows and the ``RequestOutput``s users see.

``OutputProcessor`` turns a step's sampled tokens and logprob rows (``runner.StepResult``) into
request state and outputs. A failure in one request's own post-processing (a tokenizer that fails
to decode one of its tokens) fails only that request: ``process`` returns it with the error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

from pagedkv_rs.engine.pooling import EmbeddingRequestOutput, absorb, embedding_output
from pagedkv_rs.engine.request import Request, RequestOutput, RequestStatus
from pagedkv_rs.engine.runner import StepResult
from pagedkv_rs.engine.structured import advance

__all__ = ["OutputProcessor"]


class OutputProcessor:
    """Post-processing of one engine's steps (``tokenizer``: its ``decode`` names tokens and finds stop strings)."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    def output(self, req: Request) -> Union[RequestOutput, EmbeddingRequestOutput]:
        """A snapshot of ``req``'s group (its text is decoded on first access), or a pooling request's embedding."""
        if req.pooling is not None:
            return embedding_output(req)
        return RequestOutput.from_request(req, None if self.tokenizer is None else self.tokenizer.decode)

    def process(
        self, samplers: Sequence[Request], changed: Sequence[Request], result: StepResult
    ) -> tuple[list[Request], list[Request], dict[str, BaseException]]:
        """Attach this step's logprobs, advance grammar matchers and match stop strings.

        Returns (heads to report, requests a stop string or their grammar's end finished, request id ->
        its own failure). The caller finishes the stopped ones in the scheduler. A pooling request whose
        embedding this step completed is reported and stopped.
        """
        stopped, failed = advance(changed)
        pooled: list[Request] = []
        if result.pooled:
            pooled, pool_failed = absorb(result.pooled)
            stopped += pooled
            failed.update(pool_failed)
        self._attach_logprobs(samplers, result, failed)
        for r in changed:
            if r.params.stop and r.head.request_id not in failed:
                try:
                    if self._stop_string(r):
                        stopped.append(r)
                except Exception as e:
                    failed[r.head.request_id] = e
        heads: dict[str, Request] = {}
        for r in [*changed, *pooled]:
            if r.head.request_id not in failed:
                heads.setdefault(r.head.request_id, r.head)
        return list(heads.values()), stopped, failed

    def _attach_logprobs(
        self, samplers: Sequence[Request], result: StepResult, failed: dict[str, BaseException]
    ) -> None:
        """Append this step's logprob rows to the requests that got them: arrays, decoded only when read."""
        for j, row in (result.logprobs or {}).items():
            r = samplers[j]
            if r.logprobs is None or len(r.logprobs) != len(r.output_token_ids) - 1:
                continue  # aborted (or the fork did not happen) since the step was scheduled
            try:
                r.logprobs.append(*row)
            except Exception as e:
                failed.setdefault(r.head.request_id, e)
        for j, rows in (result.emitted_logprobs or {}).items():  # speculating rows: one per token kept
            r = samplers[j]
            new = len(r.output_token_ids) - len(r.logprobs) if r.logprobs is not None else 0
            if r.logprobs is None or not 0 < new <= len(rows):
                continue
            try:
                for row in rows[:new]:
                    r.logprobs.append(*row)
            except Exception as e:
                failed.setdefault(r.head.request_id, e)
        for r, lo, rows in result.prompt_logprobs:
            # a request that finished in this very step keeps them (max_tokens=1); an aborted one is gone
            plp = r.prompt_logprobs
            if r.status is RequestStatus.FINISHED_ABORTED or plp is None or len(plp) != lo + 1:
                continue
            try:
                for row in rows:
                    plp.append(*row)
            except Exception as e:
                failed.setdefault(r.head.request_id, e)

    def _stop_string(self, r: Request) -> bool:
        """Whether ``r``'s output text contains a stop string (after min_tokens); if so cut the text there."""
        if self.tokenizer is None or r.status not in (RequestStatus.RUNNING, RequestStatus.FINISHED_LENGTH):
            return False
        if len(r.output_token_ids) < r.params.min_tokens:
            return False
        text = self.tokenizer.decode(r.output_token_ids)
        hits = [(i, s) for s in r.params.stop if (i := text.find(s)) >= 0]
        if not hits:
            return False
        new = 1 if r.spec is None else r.spec.new_tokens
        if new > 1:  # several tokens this step (speculation): stop after the first one that completes a stop string
            text = self._first_stop(r, new)
            hits = [(i, s) for s in r.params.stop if (i := text.find(s)) >= 0]
        i, stop = min(hits)
        r.stop_text = text[: i + len(stop)] if r.params.include_stop_str_in_output else text[:i]
        r.stop_reason = stop
        return True

    def _first_stop(self, r: Request, new: int) -> str:
        """Cut ``r``'s tokens of this step after the first at which its text holds a stop string (as one token
        per step would have stopped it); returns that text."""
        outs = r.output_token_ids
        keep = len(outs)
        for size in range(max(len(outs) - new + 1, r.params.min_tokens, 1), len(outs) + 1):
            text = self.tokenizer.decode(outs[:size])
            if any(s in text for s in r.params.stop):
                keep = size
                break
        drop = len(outs) - keep
        if drop:
            del outs[keep:]
            del r.all_token_ids[len(r.all_token_ids) - drop :]
            del r.token_times[len(r.token_times) - drop :]
            if r.logprobs is not None:
                r.logprobs.truncate(keep)
        return self.tokenizer.decode(outs)
