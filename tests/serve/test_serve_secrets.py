"""Credentials: never empty, never only on the command line, and no shared tier that accepts forged K/V by
default (issue 32's secret findings), with the real ``pagedkv serve`` process."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

import httpx
import pytest
from test_serve_cli_ux import Proc

from pagedkv_rs.cli.args import check_shared_tiers, read_secret
from pagedkv_rs.serve import build_app

SERVE = [sys.executable, "-m", "pagedkv_rs.cli.main", "serve"]
ENV = "PAGEDKV_TEST_SECRET"


def test_read_secret_from_flag_file_and_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert read_secret(None, None, ENV, "--key") is None
    assert read_secret("abc", None, ENV, "--key") == "abc"
    f = tmp_path / "key"
    f.write_text("  s3cret  \nignored second line\n")
    assert read_secret(None, os.fspath(f), ENV, "--key") == "s3cret"
    monkeypatch.setenv(ENV, "from-env")
    assert read_secret(None, None, ENV, "--key") == "from-env"
    assert read_secret("flag-wins", None, ENV, "--key") == "flag-wins"


@pytest.mark.parametrize(
    ("value", "content", "env", "message"),
    [
        ("", None, None, "--key is empty"),
        (None, "\n", None, "--key-file .* is empty"),
        (None, None, "", r"\$PAGEDKV_TEST_SECRET is empty"),
        ("abc", "def", None, "not both"),
        (None, "x" * 5000, None, "longer than 4096 bytes"),
    ],
)
def test_read_secret_refuses_empty_or_ambiguous(tmp_path, monkeypatch, value, content, env, message):
    monkeypatch.delenv(ENV, raising=False)
    if env is not None:
        monkeypatch.setenv(ENV, env)
    path = None
    if content is not None:
        path = os.fspath(tmp_path / "key")
        with open(path, "w") as fh:
            fh.write(content)
    with pytest.raises(ValueError, match=message):
        read_secret(value, path, ENV, "--key")


def _tier_args(tiers, secret=None, insecure=False):
    return argparse.Namespace(kv_tiers=tiers, kv_tier_secret=secret, kv_tier_insecure=insecure)


def test_shared_tier_without_a_secret_is_refused_unless_insecure():
    with pytest.raises(ValueError, match="without a secret accepts K/V from anyone"):
        check_shared_tiers(_tier_args(["redis://127.0.0.1:6379/0"]))
    assert "inject" in check_shared_tiers(_tier_args(["redis://127.0.0.1:6379/0"], insecure=True))
    assert check_shared_tiers(_tier_args(["redis://127.0.0.1:6379/0"], secret="k")) is None
    assert check_shared_tiers(_tier_args(["redis://127.0.0.1:6379/0?secret=k"])) is None
    assert check_shared_tiers(_tier_args(["disk:/tmp/x"])) is None  # a private directory is not shared
    assert check_shared_tiers(_tier_args(None)) is None


def test_build_app_refuses_an_empty_api_key(llm):
    with pytest.raises(ValueError, match="api_key is empty"):
        build_app(llm, api_key="", shutdown_engine=False)


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--api-key", ""], {}, "--api-key is empty"),
        ([], {"PAGEDKV_API_KEY": ""}, r"\$PAGEDKV_API_KEY is empty"),
        (["--kv-tier", "redis://127.0.0.1:1/0"], {}, "without a secret accepts K/V from anyone"),
        (["--kv-tier-secret-file", "/nonexistent/secret"], {}, "No such file"),
    ],
)
def test_serve_refuses_bad_credentials_before_loading(args, env, message):
    e = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDKV_")}
    r = subprocess.run([*SERVE, "--port", "0", *args], capture_output=True, text=True, timeout=120, env={**e, **env})
    assert r.returncode == 2, r.stderr
    assert re.search(message, r.stderr), r.stderr
    assert "Traceback" not in r.stderr and "serving" not in r.stderr


def _serve(*args: str, env: dict[str, str]) -> Proc:
    old = dict(os.environ)
    os.environ.update(env)
    try:
        return Proc("--num-blocks", "32", *args)
    finally:
        os.environ.clear()
        os.environ.update(old)


def test_serve_takes_the_api_key_from_the_environment_and_from_a_file(tmp_path):
    key_file = tmp_path / "api-key"
    key_file.write_text("file-key\n")
    for args, env, key in (
        ([], {"PAGEDKV_API_KEY": "env-key"}, "env-key"),
        (["--api-key-file", os.fspath(key_file)], {}, "file-key"),
    ):
        proc = _serve(*args, env=env)
        try:
            url = proc.wait_for(r"listening on (http://127\.0\.0\.1:\d+)").group(1)
            assert httpx.get(f"{url}/v1/models").status_code == 401
            assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
            assert key not in " ".join(proc.p.args)  # not on the command line
        finally:
            proc.close()


def test_serve_with_an_insecure_shared_tier_warns(tmp_path):
    proc = _serve("--kv-tier", "redis://127.0.0.1:1/0", "--kv-tier-insecure", env={})
    try:
        proc.wait_for(r"listening on http://127\.0\.0\.1:\d+")
        assert "KV tier without a secret (--kv-tier-insecure)" in proc.text
    finally:
        proc.close()
