"""Run an app with uvicorn; SIGTERM/SIGINT drain it: stop accepting, finish or abort what runs.

On the first signal the app turns ``draining`` (``/health`` and new requests answer 503), uvicorn
closes its listening sockets and waits up to ``grace`` seconds for running requests to finish;
then the server aborts the rest (cause ``shutdown``), so that each answers properly (a stream: an
error event, then ``data: [DONE]``; a whole request: a 503 in the API's error shape), uvicorn
cancels only what has still not ended ``END_WAIT`` seconds later, and the lifespan stops the engine.
A second SIGINT exits at once: ``Server.forced`` is then true (``pagedkv serve`` exits with 130).

The connections are bounded by ``Protocol`` (uvicorn's httptools protocol, with the limits uvicorn
lacks): the request head must arrive within ``header_timeout`` and fit ``max_header_bytes``; the body
must not stall for ``body_timeout``; past ``max_connections`` open connections, ``RESERVED_CONNECTIONS``
more are read only to answer ``/health`` and ``/metrics`` (anything else: 503) and further ones are
refused at once, so the process never runs out of file descriptors and a probe still gets in. A
response the app leaves unfinished (a stalled reader's expired lease) resets the connection: its
unsent buffers are dropped, not kept for a peer that does not read.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import resource
import signal
import socket
import struct
from types import FrameType
from typing import Any, Optional

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from pagedkv_rs.serve.app import OPEN_PATHS
from pagedkv_rs.serve.protocol import error_body

__all__ = ["Server", "serve", "Protocol"]

log = logging.getLogger("pagedkv_rs.serve")
FORCED_EXIT_WAIT = 2.0  # seconds aborted requests get to send their last bytes after a second SIGINT
END_WAIT = 2.0  # seconds requests aborted at the end of the grace period get to answer before they are cancelled
DEFAULT_MAX_CONNECTIONS = 1024
RESERVED_CONNECTIONS = 16  # past max_connections: for /health and /metrics only
OVER_CAP_HEADER_TIMEOUT = 2.0  # seconds a connection in the reserve gets to send its request head
FD_HEADROOM = 64  # file descriptors kept for the process itself (model, tiers, logs) beside the connections
_HEAD, _BODY, _APP, _LINGER = range(4)  # waiting for or reading a head, reading a body, answering, closing
LINGER_SECONDS = 2.0  # a connection answered before its body ended reads and drops what still comes, then closes


def _error_json(message: str, type: str, code: str) -> bytes:
    return json.dumps(error_body(message, type, None, code)).encode()


def _raw_error(status: int, reason: str, body: bytes) -> bytes:
    """A whole HTTP/1.1 error response, written straight to a transport."""
    retry = b"retry-after: 1\r\n" if status == 503 else b""
    head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n%s\r\n"
    return head % (status, reason.encode(), len(body), retry) + body


class Protocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a header timeout and size limit, a body timeout and a connection cap.

    The limits are class attributes: ``Server`` makes a subclass with its own.
    """

    header_timeout = 10.0  # seconds from the connection (or the previous response) to the end of the head
    body_timeout = 30.0  # seconds the body may stall between two reads
    max_header_bytes = 64 << 10
    max_connections = DEFAULT_MAX_CONNECTIONS
    reserved = RESERVED_CONNECTIONS
    open_paths = OPEN_PATHS

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.timer: Optional[asyncio.TimerHandle] = None
        self.phase, self.head_bytes, self.head_timeout, self.deadline, self.last_read = _HEAD, 0, 0.0, 0.0, 0.0
        n = len(self.connections)
        self.over_cap = n > self.max_connections
        if n > self.max_connections + self.reserved:
            self._refuse(503, "too_many_connections")
            return
        self._start_head()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.phase == _LINGER:
            return  # the rest of a body already answered: dropped unparsed
        super().data_received(data)
        if self.phase == _HEAD and not self.transport.is_closing():
            self.head_bytes += len(data)  # counted after parsing: a chunk that ends the head is not held against it
            if self.head_bytes > self.max_header_bytes:
                self._refuse(431, "header_too_large")
        elif self.phase == _BODY:
            self.last_read = self.loop.time()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self.phase != _HEAD:
            self._start_head()

    def on_headers_complete(self) -> None:
        self.phase, self.last_read = _BODY, self.loop.time()
        self._arm(self.body_timeout)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        if self.phase == _BODY:
            self.phase = _APP
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():
            return
        if self.phase == _BODY:  # answered before its body ended (a 413, a 401): the rest is not worth reading
            self._disarm()
            self._linger()
        elif self.phase == _APP:
            self._start_head()  # the next head is due (uvicorn's keep-alive timer closes an idle one sooner)

    def _linger(self) -> None:
        """Half-close, drop what the client still sends for ``LINGER_SECONDS``, then close.

        Closing at once with unread bytes in the socket makes the kernel reset the connection, which can
        destroy the answer before the client reads it.
        """
        self.phase = _LINGER
        try:
            self.transport.write_eof()
        except (NotImplementedError, OSError, RuntimeError):
            self.transport.close()
            return
        self.timer = self.loop.call_later(LINGER_SECONDS, self.transport.close)

    def handle_websocket_upgrade(self) -> None:
        self.phase = _APP  # the connection now belongs to the websocket protocol: no timer of ours
        self._disarm()
        super().handle_websocket_upgrade()

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        if self.over_cap:
            cycle.keep_alive = False  # one answer, then the reserved seat is free again
            if cycle.scope["path"] not in self.open_paths or cycle.scope["method"] not in ("GET", "HEAD"):
                app = _too_many_connections

        async def run(scope: Any, receive: Any, send: Any) -> None:
            try:
                await app(scope, receive, send)
            finally:
                if cycle.response_started and not cycle.response_complete and not cycle.disconnected:
                    cycle.disconnected = True
                    self._reset()
                    log.debug("%s: response left unfinished; connection reset", _peer(self.client))

        super()._start_asgi_task(cycle, run)

    def _reset(self) -> None:
        """Drop the connection and its unsent bytes (a close() would wait for a reader that may never read)."""
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):  # linger 0: the kernel discards its send buffer too and sends RST
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()

    # ------------------------------------------------------------------------------- timers
    def _start_head(self) -> None:
        self.phase, self.head_bytes = _HEAD, 0
        self.head_timeout = min(self.header_timeout, OVER_CAP_HEADER_TIMEOUT) if self.over_cap else self.header_timeout
        self.deadline = self.loop.time() + self.head_timeout
        self._arm(self.head_timeout)

    def _arm(self, delay: float) -> None:
        self._disarm()
        self.timer = self.loop.call_later(delay, self._on_timer)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _on_timer(self) -> None:
        self.timer = None
        if self.transport.is_closing():
            return
        now = self.loop.time()
        if self.flow.read_paused:  # the server, not the client, is holding the request back
            self.deadline, self.last_read = now + self.head_timeout, now
        if self.phase == _HEAD:
            if now < self.deadline:
                self._arm(self.deadline - now)
            else:
                self._refuse(408, "header_timeout")
        elif self.phase == _BODY:
            idle = now - self.last_read
            if idle < self.body_timeout:
                self._arm(self.body_timeout - idle)
            else:
                self._refuse(408, "body_timeout")

    def _refuse(self, status: int, code: str) -> None:
        """Answer ``status`` (unless a response has begun) and close; the app, if running, sees a disconnect."""
        self._disarm()
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if cycle.response_started:
                cycle.disconnected = True
                self._reset()
                return
            cycle.disconnected = True
            cycle.message_event.set()
        message, reason = {
            408: (f"the request did not arrive within {self._timeout(code)} s", "Request Timeout"),
            431: (f"the request head is larger than {self.max_header_bytes} bytes", "Request Header Fields Too Large"),
            503: (f"the server has too many open connections ({self.max_connections})", "Service Unavailable"),
        }[status]
        kind = "service_unavailable_error" if status == 503 else "invalid_request_error"
        log.debug("%s: %s (%s); connection closed", _peer(self.client), message, code)  # a flood: no info spam
        self.transport.write(_raw_error(status, reason, _error_json(message, kind, code)))
        self.transport.close()

    def _timeout(self, code: str) -> float:
        return self.body_timeout if code == "body_timeout" else self.head_timeout


async def _too_many_connections(scope: Any, receive: Any, send: Any) -> None:
    """The answer to a request other than /health or /metrics on a connection past the cap."""
    body = _error_json("the server has too many open connections", "service_unavailable_error", "too_many_connections")
    headers = [(b"content-type", b"application/json"), (b"retry-after", b"1"), (b"connection", b"close")]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _peer(client: Any) -> str:
    return f"{client[0]}:{client[1]}" if client else "?"


def connection_limit(requested: Optional[int]) -> int:
    """``requested`` (default ``DEFAULT_MAX_CONNECTIONS``) lowered to what the open-file limit leaves."""
    if requested is not None and requested < 1:
        raise ValueError(f"max_connections must be >= 1, got {requested}")
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    room = DEFAULT_MAX_CONNECTIONS if soft == resource.RLIM_INFINITY else soft - FD_HEADROOM - RESERVED_CONNECTIONS
    if room < 1:
        raise ValueError(f"the open-file limit ({soft}) leaves no room for connections; raise it (ulimit -n)")
    want = DEFAULT_MAX_CONNECTIONS if requested is None else requested
    if want > room:
        if requested is not None:
            log.warning("max_connections %d lowered to %d: the open-file limit is %d", want, room, soft)
        return room
    return want


class Server(uvicorn.Server):
    """uvicorn's server that marks the pagedkv app as draining when asked to stop.

    ``banner``: what is served (model, KV pool, ...), logged once listening, with the address;
    ``log_config``: a ``logging.config.dictConfig`` input (default: uvicorn's own);
    ``header_timeout``, ``body_timeout`` (seconds), ``max_header_bytes``, ``max_connections``: the
    connection limits (``Protocol``; ``max_connections`` is lowered to fit the open-file limit).
    """

    def __init__(
        self,
        app: Any,
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        grace: float = 30.0,
        log_level: str = "info",
        banner: Optional[str] = None,
        header_timeout: float = Protocol.header_timeout,
        body_timeout: float = Protocol.body_timeout,
        max_header_bytes: int = Protocol.max_header_bytes,
        max_connections: Optional[int] = None,
        **config: Any,
    ) -> None:
        for name, v in (("header_timeout", header_timeout), ("body_timeout", body_timeout)):
            if not v > 0:
                raise ValueError(f"{name} must be > 0, got {v}")
        if not grace >= 0:
            raise ValueError(f"grace must be >= 0, got {grace}")
        if max_header_bytes < 1024:
            raise ValueError(f"max_header_bytes must be >= 1024, got {max_header_bytes}")
        self.app = app
        self.banner = banner
        self.forced = False
        self.grace = grace
        limits = {
            "header_timeout": header_timeout,
            "body_timeout": body_timeout,
            "max_header_bytes": max_header_bytes,
            "max_connections": connection_limit(max_connections),
        }
        config.setdefault("http", type("Protocol", (Protocol,), limits))
        if config.get("log_config", ()) is None:
            del config["log_config"]
        config.setdefault("access_log", False)  # the app's RequestIdMiddleware writes it, with request ids
        super().__init__(
            uvicorn.Config(
                app,
                host=host,
                port=port,
                timeout_graceful_shutdown=grace + END_WAIT,  # past grace: jobs aborted; past this: cancelled
                log_level=log_level,
                lifespan="on",
                **config,
            )
        )

    async def startup(self, sockets: Optional[list[socket.socket]] = None) -> None:
        await super().startup(sockets)
        if self.should_exit or self.banner is None:
            return
        addrs = []
        for srv in getattr(self, "servers", ()):
            for s in srv.sockets or ():
                host, port = s.getsockname()[:2]
                addrs.append(f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}")
        log.info("%s; listening on %s", self.banner, ", ".join(addrs) or "?")

    async def shutdown(self, sockets: Optional[list[socket.socket]] = None) -> None:
        # Past the grace period abort the jobs, so each answers "shutting down" before uvicorn cancels what is left.
        timer = asyncio.get_running_loop().call_later(self.grace, self._abort_jobs)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()
        if not self.force_exit:
            return
        # uvicorn skips the lifespan's shutdown on a forced exit and leaves running requests to be cancelled
        # with the loop (a traceback each). Abort them instead: each answers its client "shutting down" and ends.
        self._abort_jobs()
        tasks = list(self.server_state.tasks)
        if tasks:
            await asyncio.wait(tasks, timeout=FORCED_EXIT_WAIT)
        for task in tasks:
            task.cancel()
        await self.lifespan.shutdown()

    def _abort_jobs(self) -> None:
        state = getattr(self.app.state, "pagedkv", None)
        jobs = list(getattr(state, "jobs", ()))
        if jobs:
            log.info("shutdown grace period over: aborting %d running request(s)", len(jobs))
        for job in jobs:
            job.abort("shutdown")

    def begin_drain(self) -> None:
        state = getattr(self.app.state, "pagedkv", None)
        if state is not None:
            state.draining = True
        self.should_exit = True

    def handle_exit(self, sig: int, frame: Optional[FrameType]) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = self.forced = True
        else:
            self.begin_drain()


def serve(
    app: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    grace: float = 30.0,
    sock: Optional[socket.socket] = None,
    **config: Any,
) -> Server:
    """Serve ``app`` until SIGTERM/SIGINT (blocking); ``sock``: an already bound socket to use;
    ``config``: ``Server``'s options (the connection limits) and uvicorn's.

    Returns the stopped server (``forced``: a second SIGINT cut the drain short).
    """
    srv = Server(app, host=host, port=port, grace=grace, **config)
    srv.run(sockets=None if sock is None else [sock])
    return srv
