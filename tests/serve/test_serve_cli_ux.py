"""A real ``pagedkv serve`` process as a newcomer starts it: the start-up line, the GGUF's and the operator's
default sampling, request ids in the header and the access log, the served name, a second Ctrl-C, and the
option errors it reports before loading anything."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from pagedkv_rs.models.gguf_loader import bundled_model_path

SERVE = [sys.executable, "-m", "pagedkv_rs.cli.main", "serve"]


class Proc:
    """A ``pagedkv serve`` subprocess; its merged stdout/stderr is collected in ``lines``."""

    def __init__(self, *args: str) -> None:
        self.p = subprocess.Popen(
            [*SERVE, "--port", "0", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.lines.append(line)

    def wait_for(self, pattern: str, timeout: float = 120) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                m = re.search(pattern, line)
                if m:
                    return m
            if self.p.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r} in:\n{''.join(self.lines)}")

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()


@pytest.fixture(scope="module")
def sampling_gguf(tmp_path_factory) -> Path:
    """The bundled SmolLM2 with llama.cpp's general.sampling.* keys added: top_k 1, temp 1.0, and mirostat
    (a sampler the engine does not have), written by gguf-py's own metadata copier."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    out = tmp_path_factory.mktemp("gguf") / "smol-sampling.gguf"
    reader = gguf.GGUFReader(bundled_model_path())
    writer = gguf.GGUFWriter(str(out), arch="llama", endianess=reader.endianess)
    keys = gguf.Keys.General
    new = {
        keys.SAMPLING_TOP_K: MetadataDetails(gguf.GGUFValueType.INT32, 1),
        keys.SAMPLING_TEMP: MetadataDetails(gguf.GGUFValueType.FLOAT32, 1.0),
        keys.SAMPLING_MIROSTAT: MetadataDetails(gguf.GGUFValueType.INT32, 2),
    }
    copy_with_new_metadata(reader, writer, new, [])
    return out


def _complete(c: httpx.Client, **fields) -> str:
    body = {"prompt": "The three primary colors are", "max_tokens": 10, "ignore_eos": True, **fields}
    r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_serve_process_logs_serves_and_samples_as_configured(sampling_gguf):
    proc = Proc(
        "--model", str(sampling_gguf), "--num-blocks", "64", "--served-model-name", "smol",
        "--default-temperature", "0.7", "--access-log", "--shutdown-grace", "60",
    )  # fmt: skip
    try:
        m = proc.wait_for(r"pagedkv_rs [\d.]+ serving .*listening on (http://127\.0\.0\.1:\d+)")
        url, banner = m.group(1), m.group(0)
        for part in (
            "serving 'smol' (smol-sampling.gguf)",
            "architecture llama",
            "weights ",
            "KV pool 64 blocks of 16 tokens = ",
            "context length ",
            " threads",
            "ISA ",
            # the operator's temperature over the file's 1.0; the file's top_k; pagedkv generate's top_p, penalty
            "sampling defaults repetition_penalty=1.1, temperature=0.7, top_k=1, top_p=0.9;",
        ):
            assert part in banner, (part, banner)
        assert "general.sampling.mirostat" in proc.text  # named as not used, at start-up
        with httpx.Client(base_url=url, timeout=60) as c:
            models = c.get("/v1/models").json()
            assert [m["id"] for m in models["data"]] == ["smol"] and str(sampling_gguf) not in json.dumps(models)
            # unset top_k is the file's 1: greedy, whatever the temperature; an explicit top_k=0 samples
            greedy = _complete(c, temperature=0)
            assert _complete(c) == greedy and _complete(c, temperature=1.5) == greedy
            assert {_complete(c, top_k=0, temperature=1.5, seed=s) for s in range(3)} - {greedy}
            r = c.get("/health", headers={"X-Request-Id": "probe-42"})
            assert r.json() == {"status": "ok"} and r.headers["x-request-id"] == "probe-42"
        proc.wait_for(r'\[probe-42\] 127\.0\.0\.1:\d+ "GET /health HTTP/1\.1" 200')
        assert "Traceback" not in proc.text

        # a second Ctrl-C while a long stream runs: the stream is told, the process exits 130, no traceback
        lines: list[str] = []

        def stream() -> None:
            body = {"prompt": "Count:", "max_tokens": 900, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)

        th = threading.Thread(target=stream)
        th.start()
        deadline = time.monotonic() + 60
        while not lines and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.p.send_signal(signal.SIGINT)
        proc.wait_for(r"Waiting for connections to close", timeout=30)
        assert proc.p.poll() is None  # the first Ctrl-C drains: the stream still runs
        proc.p.send_signal(signal.SIGINT)
        assert proc.p.wait(30) == 130
        th.join(30)
        assert lines[-1] == "data: [DONE]" and "shutting down" in "".join(lines[-4:])
        assert "Traceback" not in proc.text and "stopped by a second interrupt" in proc.text
    finally:
        proc.close()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--override-generation-config", "{temperature: 0}"], "--override-generation-config: not valid JSON"),
        (["--override-generation-config", "[1]"], "must be a JSON object"),
        (["--override-generation-config", '{"temprature": 0.2}'], "unknown sampling key 'temprature'"),
        (["--override-generation-config", '{"top_k": 1.5}'], "top_k must be an integer"),
        (["--override-generation-config", '{"temperature": true}'], "temperature must be a number"),
        (
            ["--override-generation-config", '{"temperature": 0.2}', "--default-temperature", "0.3"],
            "temperature is set twice",
        ),
        (["--default-top-p", "2"], "top_p must be in (0, 1]"),
    ],
)
def test_bad_default_sampling_is_a_clear_cli_error(args, message):
    r = subprocess.run([*SERVE, "--num-blocks", "8", *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr
    assert "Uvicorn running" not in r.stderr
