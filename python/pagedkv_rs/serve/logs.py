"""Request ids and logging: an ``X-Request-Id`` on every request and response, the id on every log line
written while serving it, an optional access log, and the server's logging configuration.

An incoming ``X-Request-Id`` is kept when it is 1 to ``MAX_REQUEST_ID`` characters of ``[A-Za-z0-9._:-]``
(anything else could forge log lines or bloat them); otherwise the server makes one (32 hex digits).
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from contextvars import ContextVar
from typing import Any

__all__ = ["MAX_REQUEST_ID", "RequestIdFilter", "RequestIdMiddleware", "current_request_id", "log_config"]

MAX_REQUEST_ID = 128
_SANE_ID = re.compile(rb"[A-Za-z0-9._:\-]{1,%d}" % MAX_REQUEST_ID)
_REQUEST_ID: ContextVar[str] = ContextVar("pagedkv_request_id", default="-")
access_log = logging.getLogger("pagedkv_rs.serve.access")


def current_request_id() -> str:
    """The id of the request being served in this task ("-" outside a request)."""
    return _REQUEST_ID.get()


class RequestIdFilter(logging.Filter):
    """Puts the current request id on every record as ``request_id`` (for the format's ``%(request_id)s``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = _REQUEST_ID.get()
        return True


class RequestIdMiddleware:
    """ASGI middleware: the request's id in a context variable and in the ``X-Request-Id`` response header;
    with ``access_log``, one line per request on the ``pagedkv_rs.serve.access`` logger.

    The context variable is not reset on the way out: each request runs in its own task (its own context),
    and the handler of an unexpected exception, outside this middleware, logs with the id still set.
    """

    def __init__(self, app: Any, access_log: bool = False) -> None:
        self.app, self.access_log = app, access_log

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = None
        for k, v in scope["headers"]:
            if k == b"x-request-id":
                if _SANE_ID.fullmatch(v):
                    rid = v.decode()
                break
        if rid is None:
            rid = uuid.uuid4().hex
        _REQUEST_ID.set(rid)
        header = (b"x-request-id", rid.encode())
        status = 0
        t0 = time.perf_counter()

        async def send_with_id(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), header]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            if self.access_log:
                client = scope.get("client")
                access_log.info(
                    '%s "%s %s HTTP/%s" %d %.1f ms',
                    f"{client[0]}:{client[1]}" if client else "-",
                    scope["method"],
                    scope["path"],
                    scope.get("http_version", "1.1"),
                    status,
                    (time.perf_counter() - t0) * 1e3,
                )


def log_config(level: str = "info") -> dict[str, Any]:
    """``logging.config.dictConfig`` input for ``pagedkv serve``: uvicorn's and pagedkv_rs's loggers on
    stderr, each line with its request id; uvicorn's own access log stays off (ours replaces it)."""
    lvl = level.upper()
    handler = ["default"]
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"request_id": {"()": RequestIdFilter}},
        "formatters": {
            "default": {"format": "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"},
        },
        "handlers": {
            "default": {
                "class": "logging.StreamHandler",
                "formatter": "default",
                "filters": ["request_id"],
                "stream": "ext://sys.stderr",
            }
        },
        "loggers": {
            "uvicorn": {"handlers": handler, "level": lvl, "propagate": False},
            "uvicorn.error": {"level": lvl},
            "uvicorn.access": {"level": "WARNING"},
            "pagedkv_rs": {"handlers": handler, "level": lvl, "propagate": False},
        },
    }
