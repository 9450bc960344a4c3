"""``RequestStream``: one request's incremental outputs, buffered as a lease (blocking, ``async for``, ``listen``).

Streams are leases: each ``submit()`` stream buffers at most ``stream_buffer`` outputs (later ones
are merged into the last); if the buffer stays full for ``stream_idle_timeout`` seconds the engine
aborts the request with cause "lease_expired", frees its blocks, and the stream raises
``StreamLeaseExpiredError`` (``expire_leases``).

A stream knows nothing of the engine: it is given a clock (for ``full_since``) and an on-cancel
callback (the engine's abort).
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

from pagedkv_rs.engine.request import RequestOutput, StreamLeaseExpiredError

if TYPE_CHECKING:
    import asyncio  # imported where a stream is read asynchronously: importing it costs start-up time

__all__ = ["RequestStream", "check_lease", "gather_finals", "publish", "expire_leases", "take_final", "wake_all"]


class RequestStream:
    """Incremental ``RequestOutput``s of one request: iterate (blocking), ``async for``, or ``listen``.

    The last item has ``finished=True``. Leaving the loop early (break + close, cancelling the
    task, or ``cancel()``) aborts the request. At most ``maxlen`` outputs wait unread: a later one
    is merged into the last (cumulative tokens, concatenated deltas) and the buffer counts as full
    from then until the reader takes an item (``full_since``, the engine's clock).

    An asyncio consumer is woken through ``loop.call_soon_threadsafe``; a step wakes each loop once
    for all the streams it fed (not once per stream).
    """

    def __init__(
        self,
        request_id: str,
        maxlen: Optional[int] = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_cancel: Optional[Callable[[str], Any]] = None,
    ) -> None:
        self.request_id = request_id
        self._clock = clock
        self._on_cancel = on_cancel
        self._items: deque[Union[RequestOutput, BaseException]] = deque()
        self._cond = threading.Condition()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._event: Optional[asyncio.Event] = None
        self._listener: Optional[Any] = None  # Callable[[RequestOutput | BaseException], None]
        self.finished = False
        self.maxlen = maxlen
        self.full_since: Optional[float] = None

    def _put(self, item: Union[RequestOutput, BaseException], wake: bool = True) -> bool:
        """Buffer ``item``; wake the reader now (``wake``) or let the caller batch the wake-up (``_wake_all``).

        Returns whether the stream has an asyncio consumer to wake.
        """
        with self._cond:
            if self.finished:
                return False
            self.finished = isinstance(item, BaseException) or item.finished
            items = self._items
            if (
                self.maxlen is not None
                and len(items) >= self.maxlen
                and isinstance(item, RequestOutput)
                and isinstance(items[-1], RequestOutput)
            ):
                items[-1] = _merge(items[-1], item)
                if self.full_since is None:
                    self.full_since = self._clock()
            else:
                items.append(item)
            self._cond.notify_all()
            loop = self._loop
        if wake and loop is not None:
            wake_all(loop, [self])
        return loop is not None

    def _on_loop(self) -> None:
        """On the consumer's loop: hand the buffered items to the listener, or wake the ``async for``."""
        listener = self._listener
        if listener is None:
            if self._event is not None:
                self._event.set()
            return
        for item in self._drain():
            try:
                listener(item)
            except Exception as e:  # a failing callback loses nothing else: later items and streams still go
                assert self._loop is not None
                self._loop.call_exception_handler(
                    {"message": f"stream {self.request_id!r}: listener failed", "exception": e}
                )

    def listen(self, callback: Any, loop: Optional[asyncio.AbstractEventLoop] = None) -> None:
        """Call ``callback(item)`` on ``loop`` (default: the running one) for each output, instead of iterating.

        An item is a ``RequestOutput`` (the last has ``finished=True``) or the exception the stream
        ends with. Call it once, from the loop's thread; outputs that arrived before are delivered too.
        The callback runs on the loop and must not block; ``cancel()`` still aborts the request.
        """
        if loop is None:
            import asyncio

            loop = asyncio.get_running_loop()
        with self._cond:
            if self._loop is not None:
                raise RuntimeError(f"request {self.request_id!r}: the stream already has an asyncio consumer")
            self._loop, self._listener = loop, callback
            pending = bool(self._items)
        if pending:
            loop.call_soon(self._on_loop)

    def _expire(self, error: BaseException) -> None:
        """The lease ran out: drop the unread outputs; the next read raises ``error``."""
        with self._cond:
            self._items.clear()
            self._items.append(error)
            self.finished = True
            self.full_since = None
            self._cond.notify_all()
            loop = self._loop
        if loop is not None:
            wake_all(loop, [self])

    def _take(
        self, timeout: Optional[float] = None, asked: Optional[float] = None
    ) -> Union[RequestOutput, BaseException]:
        """The next item; ``asked``: the caller's whole timeout, for the message (``timeout`` is what is left)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._items, timeout):
                raise TimeoutError(f"request {self.request_id!r}: not finished within {asked or timeout} s")
            self.full_since = None
            return self._items.popleft()

    def _drain(self) -> list[Union[RequestOutput, BaseException]]:
        with self._cond:
            items = list(self._items)
            self._items.clear()
            self.full_since = None
            return items

    def __iter__(self) -> Iterator[RequestOutput]:
        return self._iter()

    def _iter(self) -> Iterator[RequestOutput]:
        try:
            while True:
                item = self._take()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self.cancel()

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._aiter()

    async def _aiter(self) -> AsyncIterator[RequestOutput]:
        import asyncio

        with self._cond:
            if self._listener is not None:
                raise RuntimeError(f"request {self.request_id!r}: the stream already has a listener")
            self._loop = asyncio.get_running_loop()
            self._event = asyncio.Event()
        try:
            while True:
                with self._cond:
                    item = self._items.popleft() if self._items else None
                    if item is None:
                        self._event.clear()
                    else:
                        self.full_since = None
                if item is None:
                    await self._event.wait()
                    continue
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self.cancel()

    def result(self, timeout: Optional[float] = None) -> RequestOutput:
        """Block until the request finishes; returns its final output."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            item = self._take(left, timeout)
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                return item

    def cancel(self) -> None:
        """Abort the request unless it already finished (the engine counts cause "cancelled")."""
        if not self.finished and self._on_cancel is not None:
            self._on_cancel(self.request_id)


def check_lease(stream_buffer: Any, stream_idle_timeout: Any) -> None:
    """The lease of an engine's streams: a buffer of >= 1 outputs, an idle timeout of >= 0 seconds."""
    if isinstance(stream_buffer, bool) or not isinstance(stream_buffer, int) or stream_buffer < 1:
        raise ValueError(f"stream_buffer must be an int >= 1, got {stream_buffer!r}")
    if not isinstance(stream_idle_timeout, (int, float)) or not stream_idle_timeout >= 0:
        raise ValueError(f"stream_idle_timeout must be a number of seconds >= 0, got {stream_idle_timeout!r}")


def take_final(stream: RequestStream, final: dict[str, RequestOutput]) -> bool:
    """Drain ``stream``; its final output goes to ``final`` (the error it ended with is raised). Whether it ended."""
    for item in stream._drain():
        if isinstance(item, BaseException):
            raise item
        if item.finished:
            final[stream.request_id] = item
    return stream.request_id in final


def gather_finals(
    streams: Sequence[RequestStream],
    step: Callable[[], Any],
    *,
    use_tqdm: Optional[bool] = None,
    background: Callable[[], bool] = lambda: False,
) -> list[RequestOutput]:
    """Call ``step`` until every stream has ended; their final outputs, in order. Cancels them on the way out.

    ``use_tqdm``: a progress bar (None: for 64 streams or more); ``background()``: whether a background
    loop steps too (then pause between tries: it may hold the step).
    """
    bar = None
    if use_tqdm or (use_tqdm is None and len(streams) >= 64):
        from tqdm.auto import tqdm

        bar = tqdm(total=len(streams), desc="generate", unit="req")
    final: dict[str, RequestOutput] = {}
    pending = list(streams)
    try:
        while pending:
            step()
            pending = [s for s in pending if not take_final(s, final)]
            if bar is not None:
                bar.update(len(final) - bar.n)
            if pending and background():
                time.sleep(0.0005)
    finally:
        if bar is not None:
            bar.close()
        for s in streams:
            s.cancel()
    return [final[s.request_id] for s in streams]


def publish(streams: dict[str, RequestStream], outputs: Sequence[RequestOutput]) -> None:
    """Hand each output to its stream (a finished one leaves ``streams``); wake each asyncio loop once."""
    woken: dict[asyncio.AbstractEventLoop, list[RequestStream]] = {}
    for o in outputs:
        s = streams.get(o.request_id)
        if s is not None:
            if s._put(o, wake=False):
                woken.setdefault(s._loop, []).append(s)  # type: ignore[arg-type]
            if o.finished:
                del streams[o.request_id]
    for loop, group in woken.items():
        wake_all(loop, group)


def expire_leases(streams: dict[str, RequestStream], now: float, timeout: float) -> list[str]:
    """End the streams whose buffer has been full for ``timeout`` seconds; returns their ids (to abort)."""
    gone = []
    for rid, st in list(streams.items()):
        since = st.full_since
        if since is not None and now - since >= timeout and not st.finished:
            del streams[rid]
            st._expire(
                StreamLeaseExpiredError(
                    f"request {rid!r} aborted: its stream buffer of {st.maxlen} outputs stayed full for "
                    f"{timeout} s without a read"
                )
            )
            gone.append(rid)
    return gone


def wake_all(loop: asyncio.AbstractEventLoop, streams: Sequence[RequestStream]) -> None:
    """Wake the asyncio consumers of ``streams`` (all on ``loop``) with one ``call_soon_threadsafe``."""

    def wake() -> None:
        for s in streams:
            s._on_loop()

    try:
        loop.call_soon_threadsafe(wake)
    except RuntimeError:  # the consumer's loop is closed: nobody is listening
        pass


def _merge(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    """A copy of ``new`` carrying the deltas of both (an unread output folded into the next)."""
    deltas = {c.index: c.new_token_ids for c in old.outputs}
    outs = []
    for c in new.outputs:
        c = copy.copy(c)
        c.new_token_ids = deltas.get(c.index, []) + c.new_token_ids
        outs.append(c)
    return dataclasses.replace(new, outputs=outs, new_token_ids=outs[0].new_token_ids)
