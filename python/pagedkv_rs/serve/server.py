"""Run an app with uvicorn; SIGTERM/SIGINT drain it: stop accepting, finish or abort what runs.

On the first signal the app turns ``draining`` (``/health`` and new requests answer 503), uvicorn
closes its listening sockets and waits up to ``grace`` seconds for running requests to finish;
then it cancels the rest, whose engine requests are aborted, and the lifespan stops the engine.
A second SIGINT exits at once: ``Server.forced`` is then true (``pagedkv serve`` exits with 130).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from types import FrameType
from typing import Any, Optional

import uvicorn

__all__ = ["Server", "serve"]

log = logging.getLogger("pagedkv_rs.serve")
FORCED_EXIT_WAIT = 2.0  # seconds aborted requests get to send their last bytes after a second SIGINT


class Server(uvicorn.Server):
    """uvicorn's server that marks the pagedkv app as draining when asked to stop.

    ``banner``: what is served (model, KV pool, ...), logged once listening, with the address;
    ``log_config``: a ``logging.config.dictConfig`` input (default: uvicorn's own).
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
        **config: Any,
    ) -> None:
        self.app = app
        self.banner = banner
        self.forced = False
        if config.get("log_config", ()) is None:
            del config["log_config"]
        config.setdefault("access_log", False)  # the app's RequestIdMiddleware writes it, with request ids
        super().__init__(
            uvicorn.Config(
                app,
                host=host,
                port=port,
                timeout_graceful_shutdown=grace,
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
        await super().shutdown(sockets)
        if not self.force_exit:
            return
        # uvicorn skips the lifespan's shutdown on a forced exit and leaves running requests to be cancelled
        # with the loop (a traceback each). Abort them instead: each answers its client "shutting down" and ends.
        state = getattr(self.app.state, "pagedkv", None)
        for job in list(getattr(state, "jobs", ())):
            job.abort("shutdown")
        tasks = list(self.server_state.tasks)
        if tasks:
            await asyncio.wait(tasks, timeout=FORCED_EXIT_WAIT)
        for task in tasks:
            task.cancel()
        await self.lifespan.shutdown()

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
    """Serve ``app`` until SIGTERM/SIGINT (blocking); ``sock``: an already bound socket to use.

    Returns the stopped server (``forced``: a second SIGINT cut the drain short).
    """
    srv = Server(app, host=host, port=port, grace=grace, **config)
    srv.run(sockets=None if sock is None else [sock])
    return srv
