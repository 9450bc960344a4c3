"""Fixtures of the KV-tier tests: a real redis-server on a free loopback port (helpers: ``tier_util``)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import pytest

INSTALL_HINT = (
    "redis-server is not installed: the Redis tier tests need a real server "
    "(Debian/Ubuntu: apt-get install -y redis-server; the README's test command installs it)"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process (no persistence) that tests can kill and start again on the same port."""

    def __init__(self, exe: str, workdir: str) -> None:
        self.exe, self.workdir = exe, workdir
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--dir", self.workdir, "--protected-mode", "no"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        import redis

        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=1)
        for _ in range(500):  # until it answers (or exits)
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode} on port {self.port}")
            try:
                if client.ping():
                    return
            except redis.exceptions.ConnectionError:
                time.sleep(0.02)
        raise RuntimeError("redis-server did not answer PING")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


@pytest.fixture
def redis_server(tmp_path):
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail(INSTALL_HINT)
    d = tmp_path / "redis"
    d.mkdir()
    srv = RedisServer(exe, os.fspath(d))
    srv.start()
    yield srv
    srv.stop()
