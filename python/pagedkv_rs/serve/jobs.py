"""Job tracking: the server's shared state and one ``Job`` per HTTP generation request.

Each HTTP generation request is a ``Job``: one engine request per prompt, submitted with
``engine.submit()``; each engine stream hands its outputs to the job on the event loop
(``RequestStream.listen``: one loop wake-up per engine step for all streams), and the writer takes
the newest cumulative output of each choice (or, not streaming, waits for the last). The
``watchdog`` ticks over the live jobs: past ``request_timeout`` the job is aborted (``timeout``); a
writer stuck in ``send`` for ``stream_idle_timeout`` (a reader that stopped reading) is aborted
(``lease_expired``); an SSE stream silent for ``keepalive_interval`` is asked for a ping, so a dead
peer is noticed. A client that disconnects (``disconnected``) is aborted at once, which frees its
KV blocks before the engine's next step.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, MutableMapping
from typing import Any, Callable, Optional, Union

from pagedkv_rs.engine.request import RequestOutput
from pagedkv_rs.serve.metrics import ServerMetrics
from pagedkv_rs.serve.protocol import APIError

__all__ = ["State", "Job", "watchdog", "disconnected", "MAX_PENDING_OUTPUTS"]

MAX_PENDING_OUTPUTS = 4096  # outputs one job may hold unsent before its lease expires


class State:
    """What the routes share: the engine, its tokenizer, limits, metrics and the live jobs."""

    def __init__(self, engine: Any, tokenizer: Any, model_name: str, model_path: Optional[str], **limits: Any):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.model_path = model_path
        self.api_key: Optional[bytes] = limits["api_key"]
        self.max_queued: int = limits["max_queued_requests"]
        self.request_timeout: Optional[float] = limits["request_timeout"]
        self.lease: float = limits["stream_idle_timeout"]
        self.keepalive: float = limits["keepalive_interval"]
        self.max_body: int = limits["max_body_bytes"]
        self.shutdown_engine: bool = limits["shutdown_engine"]
        self.max_model_len = int(engine.max_model_len)
        self.vocab_size = int(engine.model.vocab_size)
        self.metrics = ServerMetrics(engine, model_name)
        self.jobs: set[Job] = set()
        self.draining = False
        self.created = int(time.time())
        self.sampling_defaults: dict[str, Any] = {}  # request field -> the server's default
        self.embedding_pooling = "last"  # how /v1/embeddings pools: "last" or "mean"

    def engine_alive(self) -> bool:
        return bool(self.engine.is_running)


class Job:
    """One HTTP generation request: its engine streams, their newest outputs, and why it ended."""

    def __init__(self, state: State, streams: list[Any], n: int, streaming: bool) -> None:
        self.state = state
        self.streams = streams
        self.n = n
        self.streaming = streaming
        self.final: list[Optional[RequestOutput]] = [None] * len(streams)
        self.pending: dict[int, RequestOutput] = {}  # stream index -> newest unsent output
        self.num_pending = 0
        self.event = asyncio.Event()
        self.cause: Optional[str] = None  # why the server aborted it
        self.error: Optional[BaseException] = None
        self.deadline = None if state.request_timeout is None else time.monotonic() + state.request_timeout
        self.last_write = time.monotonic()
        self.send_since: Optional[float] = None  # a send() is in progress since
        self.ping = False
        self.writer: Optional[asyncio.Task[Any]] = None
        self.prefilled = [False] * len(streams)
        self.left = len(streams)
        self.closed = False
        for i, st in enumerate(streams):
            st.listen(functools.partial(self._on_output, i))
        state.jobs.add(self)

    @property
    def done(self) -> bool:
        return self.left == 0

    def _on_output(self, i: int, item: Union[RequestOutput, BaseException]) -> None:
        """On the event loop, for each item of engine stream ``i`` (``RequestStream.listen``)."""
        if self.closed:
            return
        if isinstance(item, BaseException):
            self.error = item
            self.left -= 1
            self.abort("error")
            self.event.set()
            return
        m = self.state.metrics
        if not self.prefilled[i] and item.finish_reason != "abort":  # the prompt was prefilled
            m.prompt_tokens.inc(len(item.prompt_token_ids))
            self.prefilled[i] = True
        if item.new_token_ids:
            m.generation_tokens.inc(len(item.new_token_ids))
        if self.streaming:
            self.pending[i] = item
            self.num_pending += 1
            if self.num_pending > MAX_PENDING_OUTPUTS:
                self.abort("lease_expired")
        if item.finished:
            self.final[i] = item
            self.left -= 1
            if item.finish_reason != "abort":  # aborts are counted by cause
                m.finished(item)
        self.event.set()

    def abort(self, cause: str) -> None:
        """Abort every unfinished engine request of the job (frees their blocks now); counts ``cause`` once."""
        if self.cause is None and any(f is None for f in self.final):
            self.cause = cause
            self.state.metrics.aborted(cause)
        for s in self.streams:
            s.cancel()
        if cause == "lease_expired" and self.writer is not None:
            self.writer.cancel()

    async def wait(self) -> None:
        """Until every engine stream has ended."""
        while not self.done:
            self.event.clear()
            await self.event.wait()

    def close(self) -> None:
        self.state.jobs.discard(self)
        if not self.done:
            self.abort("shutdown" if self.cause is None else self.cause)
        self.closed = True

    def failure(self) -> Optional[APIError]:
        """The error the job ended with, if the server (not the model) ended it."""
        if self.error is not None:
            return APIError(f"the engine failed this request: {self.error}", status=500, type="server_error")
        if self.cause == "timeout":
            return APIError(
                f"request exceeded the server's request timeout of {self.state.request_timeout} s",
                status=504,
                type="timeout_error",
                code="request_timeout",
            )
        if self.cause is not None or any(f is not None and f.finish_reason == "abort" for f in self.final):
            return APIError(
                "the request was aborted: the server is shutting down",
                status=503,
                type="service_unavailable_error",
                headers={"Retry-After": "1"},
            )
        return None


async def disconnected(receive: Callable[[], Awaitable[MutableMapping[str, Any]]]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def watchdog(state: State) -> None:
    """Timeouts, expired leases and keep-alive pings of the live jobs."""
    tick = min(0.5, state.keepalive / 2, state.lease / 4, (state.request_timeout or 1.0) / 4)
    while True:
        await asyncio.sleep(tick)
        now = time.monotonic()
        for job in list(state.jobs):
            if job.done:
                continue
            if job.deadline is not None and now > job.deadline:
                job.abort("timeout")
            elif job.send_since is not None and now - job.send_since > state.lease:
                job.abort("lease_expired")
            elif job.streaming and now - job.last_write > state.keepalive:
                job.ping = True
                job.event.set()
