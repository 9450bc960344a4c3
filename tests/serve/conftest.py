"""Fixtures: a REAL uvicorn server on 127.0.0.1 (a free port, in a thread), over the bundled SmolLM2
(``llm_server``) or over the random-weight TinyModel with SmolLM2's tokenizer (``serve_tiny``)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

try:
    import fastapi  # noqa: F401
    import httpx  # noqa: F401
    import openai  # noqa: F401
    import prometheus_client  # noqa: F401
    import uvicorn  # noqa: F401
except ImportError as e:  # fail, never skip: the serve tests need the serve and test extras
    raise ImportError(f"{e}: install the server and its test clients with pip install '.[test,model,serve]'") from e

from pagedkv_rs.engine import LLMEngine
from pagedkv_rs.llm import LLM, _TextDecoder
from pagedkv_rs.models.tiny import TinyModel
from pagedkv_rs.serve import Server, build_app


@contextlib.contextmanager
def running(app: Any, grace: float = 5.0, sndbuf: int = 0, **server: Any) -> Iterator[tuple[str, Server]]:
    """Serve ``app`` on a free 127.0.0.1 port in a background thread; yields (base URL, server).

    ``sndbuf``: a fixed kernel send buffer for the accepted connections (they inherit it);
    ``server``: ``Server`` options (the connection limits).
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if sndbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = Server(app, log_level="warning", grace=grace, **server)
    th = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        if not th.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", srv
    finally:
        srv.begin_drain()
        th.join(30)
        sock.close()


@pytest.fixture(scope="session")
def llm() -> Iterator[LLM]:
    m = LLM(num_blocks=512)
    yield m
    m.shutdown()


@pytest.fixture(scope="session")
def llm_server(llm: LLM) -> Iterator[str]:
    """Base URL of a server over the bundled SmolLM2, served as model "smollm2"."""
    with running(build_app(llm, served_model_name="smollm2", shutdown_engine=False)) as (url, _):
        yield url


@pytest.fixture(scope="session")
def tiny_model(llm: LLM) -> TinyModel:
    return TinyModel(vocab_size=llm.tokenizer.vocab_size, max_model_len=1024, eos_token_ids=(2,))


class SlowModel:
    """The tiny model with a fixed sleep in every forward: engine steps long enough to count."""

    def __init__(self, model: TinyModel, seconds: float) -> None:
        self._m, self.seconds = model, seconds
        for a in ("num_layers", "num_kv_heads", "head_dim", "vocab_size", "max_model_len", "eos_token_ids"):
            setattr(self, a, getattr(model, a))

    def forward(self, batch: Any, kv_caches: Any) -> Any:
        time.sleep(self.seconds)
        return self._m.forward(batch, kv_caches)


@pytest.fixture
def slow_model(tiny_model: TinyModel) -> Any:
    return lambda seconds: SlowModel(tiny_model, seconds)


@pytest.fixture
def make_tiny_engine(llm: LLM, tiny_model: TinyModel) -> Any:
    def make(model: Any = None, **kwargs: Any) -> LLMEngine:
        kwargs.setdefault("num_blocks", 256)
        return LLMEngine(model or tiny_model, tokenizer=_TextDecoder(llm.tokenizer), **kwargs)

    return make


@pytest.fixture
def serve_tiny(llm: LLM, make_tiny_engine: Any) -> Any:
    """``with serve_tiny(server={...}, **build_app_kwargs) as (url, engine, server)``: a fresh tiny engine behind a
    server (``server``: ``Server`` options)."""

    @contextlib.contextmanager
    def start(
        engine: Any = None, grace: float = 5.0, sndbuf: int = 0, server: Any = None, **kwargs: Any
    ) -> Iterator[tuple[str, LLMEngine, Server]]:
        eng = engine or make_tiny_engine()
        kwargs.setdefault("served_model_name", "tiny")
        app = build_app(eng, tokenizer=llm.tokenizer, **kwargs)
        with running(app, grace, sndbuf, **(server or {})) as (url, srv):
            yield url, eng, srv

    return start


def _wait_idle(engine: LLMEngine, timeout: float = 10.0) -> dict[str, Any]:
    """Poll until nothing runs or waits and no KV block is live; returns the scheduler stats."""
    deadline = time.monotonic() + timeout
    while True:
        s = engine.scheduler.stats()
        if (s["num_running"], s["num_waiting"], s["num_swapped"], s["kv_live_blocks"]) == (0, 0, 0, 0):
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle after {timeout} s: {s}")
        time.sleep(0.005)


@pytest.fixture
def wait_idle() -> Any:
    return _wait_idle
