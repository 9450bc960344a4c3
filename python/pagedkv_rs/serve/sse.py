"""SSE framing: the streamed answer, an ASGI response that writes a job's chunks and watches for disconnect."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from fastapi.responses import Response

from pagedkv_rs.serve.jobs import Job, disconnected
from pagedkv_rs.serve.protocol import error_body
from pagedkv_rs.serve.render import View

__all__ = ["SSEResponse", "DONE", "PING"]

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
DONE = b"data: [DONE]\n\n"
PING = b": keep-alive\n\n"


class SSEResponse(Response):
    """The streamed answer: an ASGI response that writes the job's chunks and watches for disconnect."""

    def __init__(self, job: Job, view: View) -> None:
        self.job, self.view = job, view
        self.status_code = 200
        self.background = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        job = self.job
        gone = asyncio.ensure_future(disconnected(receive))
        gone.add_done_callback(lambda t: None if t.cancelled() else job.abort("client_disconnect"))
        job.writer = writer = asyncio.ensure_future(self._write(send))
        try:
            await asyncio.wait((writer, gone), return_when=asyncio.FIRST_COMPLETED)
            if not writer.done():
                writer.cancel()
        finally:
            gone.cancel()
            job.close()

    async def _write(self, send: Any) -> None:
        job, view = self.job, self.view

        async def write(body: bytes) -> None:
            job.send_since = time.monotonic()
            await send({"type": "http.response.body", "body": body, "more_body": True})
            job.last_write = time.monotonic()
            job.send_since = None

        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        body = view.first(len(job.streams) * job.n)
        if body:
            await write(body)
        while True:
            if not job.pending and not job.done and not job.ping:
                job.event.clear()
                await job.event.wait()
            items, job.pending, job.num_pending = job.pending, {}, 0
            body = b"".join(view.delta(i, out) for i, out in sorted(items.items()))
            if job.ping and not body:
                body = PING
            job.ping = False
            if job.done and not job.pending:
                err = job.failure()
                if err is not None:
                    body += b"data: " + json.dumps(error_body(err.message, err.type, err.param, err.code)).encode()
                    body += b"\n\n"
                elif view.req.include_usage():
                    body += view.final_usage([f for f in job.final if f is not None])
                await write(body + DONE)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            if body:
                await write(body)
