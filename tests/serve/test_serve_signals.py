"""SIGTERM sent by the OS to a real `pagedkv serve` process: it stops accepting, lets running streams finish
within --shutdown-grace, aborts what is left past it, and exits 0."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import pytest


def _start(grace: float) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "pagedkv_rs.cli.main", "serve", "--port", "0", "--num-blocks", "96"]
    cmd += ["--shutdown-grace", str(grace), "--log-level", "info"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + 120
    for line in proc.stdout:  # uvicorn logs the port it bound
        m = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", line)
        if m:
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep the pipe drained
            return proc, m.group(1)
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError(f"pagedkv serve did not start (exit code {proc.wait()})")


def _stream(url: str, max_tokens: int, out: dict[str, Any], started: threading.Event) -> None:
    """One streaming completion: counts the content chunks, records the finish reason or the cut."""
    body = {"prompt": "Count to a thousand:", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    body["stream_options"] = {"include_usage": True}
    out["chunks"], out["finish"], out["tokens"] = 0, None, None
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:  # aborted past the grace period: an error event, then [DONE]
                    out["error"] = chunk["error"]["type"]
                    continue
                if chunk.get("usage"):
                    out["tokens"] = chunk["usage"]["completion_tokens"]
                for choice in chunk["choices"]:
                    out["chunks"] += 1
                    out["finish"] = choice.get("finish_reason") or out["finish"]
                started.set()
    except httpx.HTTPError as e:  # cut when the grace period ends
        out["error"] = repr(e)
    finally:
        started.set()


@pytest.mark.parametrize("grace", [60.0, 1.0])
def test_sigterm_drains_a_real_server_process(grace):
    proc, url = _start(grace)
    try:
        short: dict[str, Any] = {}
        long: dict[str, Any] = {}
        ev_short, ev_long = threading.Event(), threading.Event()
        # a 1000-token stream cannot finish within 1 s; 8 and 16 tokens finish within 60 s even on a loaded machine
        threads = [
            threading.Thread(target=_stream, args=(url, 8, short, ev_short)),
            threading.Thread(target=_stream, args=(url, 1000 if grace < 5 else 16, long, ev_long)),
        ]
        for t in threads:
            t.start()
        assert ev_short.wait(60) and ev_long.wait(60), (short, long)
        assert short["status"] == long["status"] == 200, (short, long)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(httpx.HTTPError):  # the listening socket is closed: a new client is refused
            httpx.get(f"{url}/health", timeout=5).raise_for_status()
        for t in threads:
            t.join(90)
        rc = proc.wait(60)
        assert rc == 0
        assert time.monotonic() - t0 < grace + 20
        if grace >= 5:  # both streams ran to their end inside the grace period
            assert (short["finish"], long["finish"]) == ("length", "length"), (short, long)
            assert (short["tokens"], long["tokens"]) == (8, 16)
        else:  # the long stream was cut short, not finished
            assert long["finish"] != "length" and long["tokens"] is None, long
            assert long["error"] == "service_unavailable_error", long
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
