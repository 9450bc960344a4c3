"""Run an app with uvicorn; SIGTERM/SIGINT drain it: stop accepting, finish or abort what runs.

On the first signal the app turns ``draining`` (``/health`` and new requests answer 503), uvicorn
closes its listening sockets and waits up to ``grace`` seconds for running requests to finish;
then it cancels the rest, whose engine requests are aborted, and the lifespan stops the engine.
A second SIGINT exits at once.
"""

from __future__ import annotations

import signal
import socket
from types import FrameType
from typing import Any, Optional

import uvicorn

__all__ = ["Server", "serve"]


class Server(uvicorn.Server):
    """uvicorn's server that marks the pagedkv app as draining when asked to stop."""

    def __init__(
        self,
        app: Any,
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        grace: float = 30.0,
        log_level: str = "info",
        **config: Any,
    ) -> None:
        self.app = app
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

    def begin_drain(self) -> None:
        state = getattr(self.app.state, "pagedkv", None)
        if state is not None:
            state.draining = True
        self.should_exit = True

    def handle_exit(self, sig: int, frame: Optional[FrameType]) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
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
) -> None:
    """Serve ``app`` until SIGTERM/SIGINT (blocking); ``sock``: an already bound socket to use."""
    Server(app, host=host, port=port, grace=grace, **config).run(sockets=None if sock is None else [sock])
