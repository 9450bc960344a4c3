"""Lost clients are reclaimed: disconnects, stopped readers (leases), keep-alives, request timeouts, drain."""

from __future__ import annotations

import json
import re
import signal
import socket
import threading
import time

import httpx


def _metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{labels} not in /metrics")


def _raw_post(url: str, body: dict, rcvbuf: int = 0) -> socket.socket:
    host, port = re.match(r"http://([\d.]+):(\d+)", url).groups()
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect((host, int(port)))
    data = json.dumps(body).encode()
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(data), data)
    )
    return s


def _wait_running(engine, n: int = 1, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.scheduler.stats()["num_running"] < n:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.002)


def test_disconnect_mid_stream_frees_blocks_within_a_step(serve_tiny, make_tiny_engine, slow_model, wait_idle):
    engine = make_tiny_engine(slow_model(0.02))
    with serve_tiny(engine) as (url, _, _srv):
        body = {"prompt": "hello " * 40, "max_tokens": 500, "ignore_eos": True, "stream": True, "temperature": 0}
        with httpx.Client(base_url=url) as c, c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(x for x in lines if x.startswith("data: "))
            assert engine.scheduler.stats()["kv_live_blocks"] > 0
            steps = engine.scheduler.num_steps
        wait_idle(engine)
        assert engine.scheduler.num_steps - steps <= 2  # freed within one step (+ the one in flight)
        assert _metric(url, "pagedkv:request_aborted_total", cause="client_disconnect") == 1

        s = _raw_post(url, {**body, "stream": False})  # not streamed: abandoned while waiting for the result
        _wait_running(engine)
        steps = engine.scheduler.num_steps
        s.close()
        wait_idle(engine)
        assert engine.scheduler.num_steps - steps <= 2
        assert _metric(url, "pagedkv:request_aborted_total", cause="client_disconnect") == 2


def test_a_reader_that_stops_reading_loses_its_lease(serve_tiny, make_tiny_engine, wait_idle):
    from pagedkv_rs.models.tiny import TinyModel

    engine = make_tiny_engine(TinyModel(vocab_size=256, max_model_len=1024), num_blocks=1700)  # fast steps
    with serve_tiny(engine, stream_idle_timeout=0.5, sndbuf=16384) as (url, _, _srv):
        # 64 choices stream ~8 KB per step; unread, that fills the socket buffers within a few dozen steps
        body = {"prompt": [[5, 6, 7]] * 64, "max_tokens": 400, "ignore_eos": True, "stream": True, "temperature": 0}
        s = _raw_post(url, body, rcvbuf=2048)
        try:
            _wait_running(engine)
            wait_idle(engine, timeout=60)  # never read: the server's writes block, the lease expires
            assert _metric(url, "pagedkv:request_aborted_total", cause="lease_expired") == 1
            assert _metric(url, "pagedkv:request_success_total", finished_reason="length") == 0
        finally:
            s.close()
        assert httpx.get(f"{url}/health").status_code == 200


def test_keepalive_comments_during_a_long_prefill(serve_tiny, make_tiny_engine, slow_model):
    engine = make_tiny_engine(slow_model(0.4))
    with serve_tiny(engine, keepalive_interval=0.1) as (url, _, _srv):
        body = {"prompt": "x", "max_tokens": 1, "stream": True}
        text = httpx.post(f"{url}/v1/completions", json=body, timeout=30).text
        head = text.split("data: ", 1)[0]
        assert ": keep-alive" in head, text
        assert text.endswith("data: [DONE]\n\n")


def test_sigterm_lets_running_requests_finish(serve_tiny, make_tiny_engine, slow_model, wait_idle):
    engine = make_tiny_engine(slow_model(0.01))
    results: dict = {}
    with serve_tiny(engine, grace=20) as (url, _, srv):
        body = {"prompt": "x", "max_tokens": 40, "ignore_eos": True, "temperature": 0}
        t = threading.Thread(
            target=lambda: results.update(r=httpx.post(f"{url}/v1/completions", json=body, timeout=30))
        )
        t.start()
        _wait_running(engine)
        srv.handle_exit(signal.SIGTERM, None)
        t.join(30)
        assert results["r"].status_code == 200
        assert results["r"].json()["usage"]["completion_tokens"] == 40
        srv_thread_deadline = time.monotonic() + 10
        while srv.started and not srv.should_exit and time.monotonic() < srv_thread_deadline:
            time.sleep(0.01)
    wait_idle(engine)


def test_past_the_grace_period_running_requests_are_aborted(serve_tiny, make_tiny_engine, slow_model, wait_idle):
    engine = make_tiny_engine(slow_model(0.01))
    results: dict = {}
    with serve_tiny(engine, grace=0.3) as (url, _, srv):
        body = {"prompt": "x", "max_tokens": 900, "ignore_eos": True, "stream": True, "temperature": 0}

        def read() -> None:
            try:
                results["text"] = httpx.post(f"{url}/v1/completions", json=body, timeout=30).text
            except httpx.HTTPError as e:  # the connection is cut when the grace period is over
                results["error"] = e

        t = threading.Thread(target=read)
        t.start()
        _wait_running(engine)
        t0 = time.monotonic()
        srv.handle_exit(signal.SIGTERM, None)
        t.join(30)
        assert time.monotonic() - t0 < 10
        assert "text" not in results or '"finish_reason": "length"' not in results["text"]
    wait_idle(engine)
