"""The HTTP transport under hostile clients, on loopback against real uvicorn servers (in a thread, or a
`pagedkv serve` process where file-descriptor limits, memory or signals matter): slowloris heads, stalled
and abandoned bodies, a huge header, more half-sent requests than file descriptors, a reader that stops
reading, SIGTERM past the grace period. Every wait is bounded; none measures speed (the worst /health
latency during each attack is printed, for the record, not asserted)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, Optional

import httpx
import pytest

from pagedkv_rs.serve.server import RESERVED_CONNECTIONS

MiB = 1 << 20


def _addr(url: str) -> tuple[str, int]:
    host, port = re.match(r"http://([\d.]+):(\d+)", url).groups()
    return host, int(port)


def _connect(url: str, rcvbuf: int = 0) -> socket.socket:
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(30)
    s.connect(_addr(url))
    return s


def _read_all(s: socket.socket) -> bytes:
    """What the server sent until it closed or reset the connection (TimeoutError if it did neither)."""
    out = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := s.recv(65536):
            out += chunk
    return out


def _closed_by_server(s: socket.socket) -> Optional[bytes]:
    """The bytes the server sent if it has closed the connection, else None (the socket is non-blocking)."""
    out = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return out
            out += chunk
    except BlockingIOError:
        return None
    except OSError:  # reset
        return out


class HealthProbe:
    """A thread that asks GET /health on a fresh connection every 50 ms: the worst latency and the failures."""

    def __init__(self, url: str) -> None:
        self.url, self.worst, self.count, self.failures = url, 0.0, 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                r = httpx.get(f"{self.url}/health", timeout=30)
                if r.status_code != 200:
                    self.failures.append(r.status_code)
            except httpx.HTTPError as e:
                self.failures.append(repr(e))
            self.worst = max(self.worst, time.monotonic() - t0)
            self.count += 1
            self._stop.wait(0.05)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(60)

    def report(self, attack: str) -> str:
        line = f"{attack}: worst /health {self.worst * 1000:.0f} ms over {self.count} probes, failures {self.failures}"
        print(line)
        return line


def _wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


# ------------------------------------------------------------------------------------ a real process
class Process:
    """A `pagedkv serve` process on a free port: its URL, pid, output, RSS and open file descriptors."""

    def __init__(self, *args: str, nofile: Optional[int] = None) -> None:
        cmd = [sys.executable, "-m", "pagedkv_rs.cli.main", "serve", "--port", "0", "--num-blocks", "96"]
        cmd += ["--log-level", "info", *args]

        def limit() -> None:
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=limit)
        self.lines: list[str] = []
        assert self.proc.stdout is not None
        deadline = time.monotonic() + 120
        for line in self.proc.stdout:  # uvicorn logs the port it bound
            self.lines.append(line)
            m = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", line)
            if m:
                self.url = m.group(1)
                threading.Thread(target=self._drain, daemon=True).start()
                return
            if time.monotonic() > deadline:
                break
        self.proc.kill()
        raise RuntimeError(f"pagedkv serve did not start (exit code {self.proc.wait()}): {''.join(self.lines)}")

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def rss(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) << 10

    @contextlib.contextmanager
    def peak_rss(self) -> Iterator[dict[str, int]]:
        """Samples the RSS every 5 ms while the block runs: yields a dict whose "peak" is the highest seen."""
        out = {"peak": self.rss()}
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                with contextlib.suppress(OSError, AttributeError):
                    out["peak"] = max(out["peak"], self.rss())
                stop.wait(0.005)

        t = threading.Thread(target=sample, daemon=True)
        t.start()
        try:
            yield out
        finally:
            stop.set()
            t.join(10)

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def capped() -> Iterator[Process]:
    """A server with 300 file descriptors, 200 connections, and head/body timeouts too long to rescue it."""
    p = Process("--max-connections", "200", "--header-timeout", "60", "--body-timeout", "60", nofile=300)
    try:
        yield p
    finally:
        p.stop()


# -------------------------------------------------------------------------------------------- tests
def test_slowloris_heads_and_silent_connections_are_closed_within_the_header_timeout(serve_tiny):
    with serve_tiny(server={"header_timeout": 1.0}) as (url, _, srv), HealthProbe(url) as probe:
        drip, silent = [_connect(url) for _ in range(50)], [_connect(url) for _ in range(5)]
        for s in drip:
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
        for s in drip + silent:
            s.setblocking(False)
        answers: dict[socket.socket, bytes] = {}
        t0 = time.monotonic()
        deadline = t0 + 30  # the header timeout is 1 s: 30 s is far past it, far below "never"
        while len(answers) < len(drip) + len(silent) and time.monotonic() < deadline:
            for s in drip + silent:
                if s in answers:
                    continue
                got = _closed_by_server(s)
                if got is not None:
                    answers[s] = got
                elif s in drip:
                    with contextlib.suppress(OSError):
                        s.send(b"X-Slow: 1\r\n")  # one header line at a time, never the end of the head
            time.sleep(0.25)
        open_left = len(drip) + len(silent) - len(answers)
        print(f"slowloris: the last of {len(answers)} connections closed after {time.monotonic() - t0:.2f} s")
        _wait(lambda: not srv.server_state.connections, 10, "the server still holds the slow connections")
        for s in drip + silent:
            s.close()
    probe.report("50 slowloris + 5 silent connections, header timeout 1 s")
    assert open_left == 0, f"{open_left} slow connections still open after 30 s"
    assert all(a.startswith(b"HTTP/1.1 408 ") and b'"header_timeout"' in a for a in answers.values()), answers
    assert not probe.failures


def test_past_the_cap_only_health_and_metrics_get_in(serve_tiny):
    with serve_tiny(server={"max_connections": 2, "header_timeout": 60}) as (url, _, srv):
        seats = [_connect(url) for _ in range(2)]  # silent: they hold the two seats
        _wait(lambda: len(srv.server_state.connections) == 2, 10, "the seats were not taken")
        with httpx.Client(base_url=url, timeout=20) as c:  # over the cap: one reserved connection per request
            assert c.get("/health").status_code == 200
            assert c.head("/metrics").status_code == 200
            busy = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
        assert busy.status_code == 503 and busy.json()["error"]["code"] == "too_many_connections", busy.text
        assert busy.headers["retry-after"] == "1" and busy.headers["connection"] == "close"
        reserve = [_connect(url) for _ in range(RESERVED_CONNECTIONS)]  # silent: they fill the reserve
        _wait(lambda: len(srv.server_state.connections) == 2 + RESERVED_CONNECTIONS, 10, "the reserve is not full")
        late = _connect(url)
        answer = _read_all(late)  # refused at once, without reading a byte of it
        assert answer.startswith(b"HTTP/1.1 503 ") and b'"too_many_connections"' in answer, answer
        for s in seats + reserve + [late]:
            s.close()
        _wait(lambda: not srv.server_state.connections, 10, "the closed connections are still held")
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 1}).status_code == 200


def test_the_connection_cap_fits_the_open_file_limit(monkeypatch):
    from pagedkv_rs.serve import server

    monkeypatch.setattr(server.resource, "getrlimit", lambda _: (300, 300))
    room = 300 - server.FD_HEADROOM - RESERVED_CONNECTIONS
    assert server.connection_limit(None) == room
    assert server.connection_limit(200) == 200
    assert server.connection_limit(10_000) == room
    with pytest.raises(ValueError, match="max_connections must be >= 1"):
        server.connection_limit(0)
    monkeypatch.setattr(server.resource, "getrlimit", lambda _: (64, 64))
    with pytest.raises(ValueError, match="open-file limit"):
        server.connection_limit(None)


@pytest.mark.parametrize(
    ("option", "value"), [("--header-timeout", "0"), ("--body-timeout", "-1"), ("--max-connections", "0")]
)
def test_bad_connection_options_fail_before_the_model_loads(option, value, capsys):
    from pagedkv_rs.cli.serve import main

    assert main(["--model", "/nonexistent.gguf", option, value]) == 2
    assert option in capsys.readouterr().err


def test_a_stalled_body_is_answered_408_and_closed(serve_tiny):
    with serve_tiny(server={"body_timeout": 1.0}) as (url, _, srv):
        s = _connect(url)
        s.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"prompt": ')
        answer = _read_all(s)  # the server closes it: bounded by the socket's 30 s timeout otherwise
        s.close()
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
        assert body["error"]["code"] == "body_timeout" and body["error"]["type"] == "invalid_request_error"
        _wait(lambda: not srv.server_state.connections, 10, "the server still holds the stalled connection")
        assert httpx.get(f"{url}/health").status_code == 200


def _drip_until_closed(s: socket.socket, piece: bytes, timeout: float = 30.0) -> Optional[bytes]:
    """Send ``piece`` every 0.25 s until the server closes the connection: what it sent, or None at the timeout."""
    s.setblocking(False)
    got, deadline = None, time.monotonic() + timeout
    while got is None and time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            s.send(piece)  # each byte also resets uvicorn's keep-alive timer
        time.sleep(0.25)
        got = _closed_by_server(s)
    s.close()
    return got


def test_a_body_answered_early_is_not_read_on_and_a_kept_alive_head_is_timed(serve_tiny):
    with serve_tiny(server={"header_timeout": 1.0, "body_timeout": 60}) as (url, _, srv):
        s = _connect(url)  # a declared 10 MB body is answered 413 before it is read: then the connection closes
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000\r\n\r\n{")
        got = _drip_until_closed(s, b" ")
        assert got is not None and got.startswith(b"HTTP/1.1 413 "), got

        s = _connect(url)  # one whole request, then a next head that never ends
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(65536).startswith(b"HTTP/1.1 200 ")
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        got = _drip_until_closed(s, b"X-Slow: 1\r\n")
        assert got is not None and got.startswith(b"HTTP/1.1 408 "), got
        _wait(lambda: not srv.server_state.connections, 10, "the connections are still held")


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_client_leaving_mid_body_logs_one_line_and_no_traceback(serve_tiny):
    rec = _Records()
    loggers = [logging.getLogger(n) for n in ("pagedkv_rs.serve", "uvicorn.error", "uvicorn")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(rec)
        lg.setLevel(logging.DEBUG)
    try:
        with serve_tiny() as (url, _, srv):
            s = _connect(url)
            s.sendall(b'POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n{"messa')
            time.sleep(0.2)  # the route is reading the body
            s.close()
            _wait(lambda: any("left before" in r.getMessage() for r in rec.records), 10, "no line about the client")
            _wait(lambda: not srv.server_state.connections, 10, "the connection was not released")
            assert httpx.get(f"{url}/health").status_code == 200
    finally:
        for lg, level in zip(loggers, levels):
            lg.removeHandler(rec)
            lg.setLevel(level)
    bad = [r for r in rec.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not bad, [(r.name, r.levelname, r.getMessage()) for r in bad]
    lines = [r for r in rec.records if "left before" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO and "/v1/chat/completions" in lines[0].getMessage()


def test_a_64_mib_header_is_refused_without_buffering_it(capped):
    rss0 = capped.rss()
    with HealthProbe(capped.url) as probe, capped.peak_rss() as rss:
        s = _connect(capped.url)
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: ")
        sent, piece = 0, b"a" * MiB
        with contextlib.suppress(OSError):  # the server closes the connection: a reset or a broken pipe
            while sent < 64 * MiB:
                s.sendall(piece)
                sent += len(piece)
            s.sendall(b"\r\n\r\n")
        answer = _read_all(s)
        s.close()
    grown = rss["peak"] - rss0
    probe.report("64 MiB header")
    print(
        f"64 MiB header: {sent / MiB:.0f} MiB accepted before the server closed; peak RSS growth {grown / MiB:.1f} MiB"
    )
    assert sent < 64 * MiB, "the server read the whole 64 MiB head"
    assert not answer or answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert grown < 32 * MiB, f"the RSS grew by {grown / MiB:.0f} MiB"
    assert not probe.failures


def test_half_sent_requests_past_the_fd_limit_do_not_lock_out_new_clients(capped):
    """320 requests that never finish their body, against a process with 300 file descriptors."""
    fds0, rss0 = capped.fds(), capped.rss()
    held: list[socket.socket] = []
    rss = {"peak": rss0}
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
    )
    try:
        with HealthProbe(capped.url) as probe, capped.peak_rss() as rss:
            worst_fds = fds0
            for _ in range(320):
                s = _connect(capped.url)
                with contextlib.suppress(OSError):  # refused at once past the reserve: a reset is fine
                    s.sendall(head)
                held.append(s)
                worst_fds = max(worst_fds, capped.fds())
            # Let the server accept and read them: past its 200 connections (it refuses the rest at once).
            deadline = time.monotonic() + 30
            while capped.fds() < fds0 + 200 and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(0.5)
            worst_fds = max(worst_fds, capped.fds())
            h = httpx.get(f"{capped.url}/health", timeout=20)
            busy = httpx.post(f"{capped.url}/v1/completions", json={"prompt": "a", "max_tokens": 1}, timeout=20)
        probe.report("320 half-sent requests, 300 fds, --max-connections 200")
        print(f"320 half-sent: fds {fds0} -> worst {worst_fds}; peak RSS growth {(rss['peak'] - rss0) / MiB:.1f} MiB")
        assert h.status_code == 200, h.text
        assert busy.status_code == 503 and busy.json()["error"]["code"] == "too_many_connections", busy.text
        assert busy.headers["retry-after"] == "1"
        assert worst_fds < 300
        assert not probe.failures
    finally:
        for s in held:
            s.close()
    _wait(lambda: capped.fds() <= fds0 + 2, 20, "the server kept the closed connections")
    ok = httpx.post(f"{capped.url}/v1/completions", json={"prompt": "a", "max_tokens": 1}, timeout=60)
    assert ok.status_code == 200, ok.text


def test_a_stalled_reader_whose_lease_expires_is_reset(serve_tiny, make_tiny_engine, wait_idle):
    from pagedkv_rs.models.tiny import TinyModel

    engine = make_tiny_engine(TinyModel(vocab_size=256, max_model_len=1024), num_blocks=1700)  # fast steps
    with serve_tiny(engine, stream_idle_timeout=0.5, sndbuf=16384) as (url, _, srv):
        body = {"prompt": [[5, 6, 7]] * 64, "max_tokens": 400, "ignore_eos": True, "stream": True, "temperature": 0}
        data = json.dumps(body).encode()
        s = _connect(url, rcvbuf=2048)
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(data), data)
        )
        try:
            _wait(lambda: engine.scheduler.stats()["num_running"] > 0, 30, "the request never started")
            wait_idle(engine, timeout=60)  # never read: the server's writes block, the lease expires
            # the request's KV is free; its connection and the unsent bytes must go too, not wait for the reader
            _wait(lambda: not srv.server_state.connections, 20, "the stalled reader's connection is still open")
            s.setblocking(False)
            assert _closed_by_server(s) is not None
        finally:
            s.close()
        assert httpx.get(f"{url}/health").status_code == 200


def test_sigterm_past_the_grace_period_ends_each_answer_properly():
    p = Process("--shutdown-grace", "1")
    try:
        out: dict[str, Any] = {}
        started = threading.Event()
        body = {"prompt": "Count to a thousand:", "max_tokens": 1000, "ignore_eos": True}

        def stream() -> None:
            with httpx.stream("POST", f"{p.url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
                out["events"] = []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        out["events"].append(line[6:])
                        started.set()

        def whole() -> None:
            out["whole"] = httpx.post(f"{p.url}/v1/completions", json=body, timeout=120)

        threads = [threading.Thread(target=stream), threading.Thread(target=whole)]
        for t in threads:
            t.start()
        assert started.wait(120)

        def running() -> bool:
            m = re.search(r"pagedkv:num_requests_running\{[^}]*\} (\S+)", httpx.get(f"{p.url}/metrics").text)
            return m is not None and float(m.group(1)) == 2

        _wait(running, 60, "both requests should be running")
        p.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(120)
        assert p.proc.wait(60) == 0
    finally:
        p.stop()
    log = "".join(p.lines)
    events = out["events"]
    assert events[-1] == "[DONE]", events[-3:]
    err = json.loads(events[-2])["error"]
    assert err["type"] == "service_unavailable_error" and "shutting down" in err["message"], err
    r = out["whole"]
    assert r.status_code == 503 and r.headers["content-type"] == "application/json", (r.status_code, r.text)
    assert r.json()["error"]["type"] == "service_unavailable_error"
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log
