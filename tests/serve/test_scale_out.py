"""Scale-out on loopback with real components: two ``pagedkv serve`` replicas (one kernel thread each, pinned to one
CPU), a real ``redis-server`` KV tier they share with a secret, and the real sglang-router (``cache_aware`` and
``round_robin``) in front. Every request succeeds; ``cache_aware``'s prefix hit rate is at least round robin's; a
prefix computed on one replica is loaded from Redis on the other; a replica stopped mid-run costs no request."""

from __future__ import annotations

import argparse
import os
import shutil
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
from test_kv_events import Subscriber, stored, vllm_hashes

from pagedkv_rs.cli.bench import serve as bench

ROUTER_HINT = "sglang-router is not installed: pip install 'sglang-router>=0.3.2,<0.4' (the test extra)"
REDIS_HINT = (
    "redis-server is not installed: the scale-out tests need a real server "
    "(Debian/Ubuntu: apt-get install -y redis-server; the README's test command installs it)"
)
START_S = 240.0  # model load on a shared 2-core machine
REQUEST_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, what: str, seconds: float = START_S) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before answering {url}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{what} did not answer {url} within {seconds:.0f} s")


def stop(proc: Optional[subprocess.Popen]) -> None:
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait(30)


class Cluster:
    """The replicas (``urls``, ``procs``) over one Redis tier."""

    def __init__(self, tmp: str) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail(REDIS_HINT)
        self.tmp = tmp
        self.redis_port = free_port()
        self.redis = subprocess.Popen(
            [exe, "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
            + ["--dir", tmp, "--protected-mode", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        self.secret = os.path.join(tmp, "tier-secret")
        with open(self.secret, "w") as f:
            f.write("scale-out-test-secret\n")
        self.procs: list[subprocess.Popen] = []
        self.urls: list[str] = []
        self.events: list[str] = []  # each replica's KV-events endpoint (vLLM's block hashes, PYTHONHASHSEED=0)

    def start_replicas(self, n: int = 2) -> None:
        for _ in range(n):
            self.urls.append(f"http://127.0.0.1:{free_port()}")
            self.events.append(f"tcp://127.0.0.1:{free_port()}")
            self.procs.append(self._launch(len(self.procs)))
        for i in range(n):
            wait_http(f"{self.urls[i]}/health", self.procs[i], f"replica {i}")

    def _launch(self, i: int) -> subprocess.Popen:
        port = self.urls[i].rsplit(":", 1)[1]
        events = self.events[i].rsplit(":", 1)[1]  # vLLM's rule: an endpoint with * binds, one without connects
        cmd = [sys.executable, "-m", "pagedkv_rs.cli.main", "serve", "--port", port, "--num-blocks", "512"]
        cmd += ["--kv-tier", f"redis://127.0.0.1:{self.redis_port}/0", "--kv-tier-secret-file", self.secret]
        cmd += ["--metrics-compat", "vllm", "--shutdown-grace", "20", "--log-level", "warning"]
        cmd += ["--kv-events-endpoint", f"tcp://*:{events}", "--prefix-hash", "vllm"]
        cpus = sorted(os.sched_getaffinity(0))
        cpu = {cpus[i % len(cpus)]}  # one CPU each: the kernel pool sizes itself from the CPU set
        with open(os.path.join(self.tmp, f"replica{i}.log"), "a") as log:  # the child keeps its own fd
            pin = lambda: os.sched_setaffinity(0, cpu)  # noqa: E731
            env = {**os.environ, "PYTHONHASHSEED": "0"}
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=pin, env=env)

    def restart(self, i: int) -> None:
        """Start replica i again on its port (after a test stopped it)."""
        stop(self.procs[i])
        self.procs[i] = self._launch(i)
        wait_http(f"{self.urls[i]}/health", self.procs[i], f"replica {i}")

    def counters(self) -> list[dict[str, float]]:
        return [bench._counters(httpx.get(f"{u}/metrics", timeout=10).text) for u in self.urls]

    def tier_counter(self, i: int, name: str) -> float:
        text = httpx.get(f"{self.urls[i]}/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"{name}{{"))

    def close(self) -> None:
        for p in self.procs:
            stop(p)
        stop(self.redis)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(os.fspath(tmp_path_factory.mktemp("scale-out")))
    try:
        c.start_replicas(2)
        yield c
    finally:
        c.close()


class Router:
    def __init__(self, workers: list[str], policy: str, log_path: str) -> None:
        try:
            import sglang_router  # noqa: F401
        except ImportError:
            pytest.fail(ROUTER_HINT)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--prometheus-port", str(free_port()), "--policy", policy, "--log-level", "warn"]
        cmd += ["--worker-startup-timeout-secs", "60", "--worker-urls", *workers]
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        wait_http(f"{self.url}/readiness", self.proc, f"sglang-router ({policy})", 90)
        self._wait_workers(len(workers))

    def _wait_workers(self, n: int) -> None:
        end = time.monotonic() + 90
        while time.monotonic() < end:
            try:
                r = httpx.get(f"{self.url}/workers", timeout=5)
                if r.status_code == 200 and len(r.json().get("workers", [])) >= n:
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.3)
        raise RuntimeError(f"sglang-router did not register {n} workers")

    def close(self) -> None:
        stop(self.proc)


@pytest.fixture
def router(cluster: Cluster, tmp_path) -> Iterator[Any]:
    made: list[Router] = []

    def start(policy: str) -> Router:
        r = Router(cluster.urls, policy, os.fspath(tmp_path / f"router-{policy}.log"))
        made.append(r)
        return r

    yield start
    for r in made:
        r.close()


def bench_args(url: str, metrics: list[str], seed: int, **kw: Any) -> argparse.Namespace:
    args = bench.build_parser().parse_args(["--base-url", url, "--workload", "prefix-repetition", "--no-progress"])
    for m in metrics:
        args.metrics_url = (args.metrics_url or []) + [m]
    args.seed = seed
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def run_workload(url: str, cluster: Cluster, seed: int, **kw: Any) -> dict[str, Any]:
    """The prefix-repetition workload through ``url``: 3 prefix groups of 4 requests, shuffled, 2 in flight."""
    defaults = dict(
        num_prompts=12,
        prefix_repetition_num_prefixes=3,
        prefix_repetition_prefix_len=96,
        prefix_repetition_suffix_len=8,
        output_len=2,
        max_concurrency=2,
        timeout=REQUEST_S,
    )
    defaults.update(kw)
    return bench._run_loop(bench.run(bench_args(url, cluster.urls, seed, **defaults)))


def test_cache_aware_hit_rate_at_least_round_robin(cluster, router):
    results = {}
    for seed, policy in enumerate(("round_robin", "cache_aware")):
        r = router(policy)
        results[policy] = run_workload(r.url, cluster, seed=100 + seed)  # fresh prefixes per policy
        r.close()
    for policy, res in results.items():
        assert res["num_failed"] == 0, (policy, res["errors"])
        assert res["num_requests"] == 12
        assert res["prefix_cache_queries"] > 0
    rr, ca = results["round_robin"], results["cache_aware"]
    assert ca["prefix_hit_rate"] >= rr["prefix_hit_rate"], (ca, rr)
    assert min(rr["per_server_queries"]) > 0  # round robin used both replicas
    assert ca["prefix_hit_rate"] > 0.5  # each group's later requests hit the replica that computed its prefix
    assert ca["warm_requests"] > 6  # the requests that found their prefix (usage.prompt_tokens_details)
    for res in (rr, ca):  # the replicas publish KV events; the bench reads their counters
        assert res["warm_requests"] + res["cold_requests"] == 12
        assert res["kv_event_batches"] > 0 and res["kv_events"] >= res["kv_event_batches"]
        assert res["kv_event_dropped_batches"] == 0


def test_router_learns_the_served_model_id(cluster, router):
    r = router("cache_aware")
    ours = httpx.get(f"{cluster.urls[0]}/v1/models", timeout=10).json()["data"][0]["id"]
    assert [m["id"] for m in httpx.get(f"{r.url}/v1/models", timeout=10).json()["data"]] == [ours]
    info = httpx.get(f"{cluster.urls[0]}/server_info", timeout=10).json()
    assert info["served_model_name"] == ours and "/" not in info["model_path"]  # the served name, never a path


def test_vllm_metric_names_agree(cluster):
    text = httpx.get(f"{cluster.urls[0]}/metrics", timeout=10).text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        ours = [ln.split(" ")[1] for ln in text.splitlines() if ln.startswith(f"pagedkv:{name}{{")]
        theirs = [ln.split(" ")[1] for ln in text.splitlines() if ln.startswith(f"vllm:{name}{{")]
        assert ours and ours == theirs, name
    assert 'vllm:cache_config_info{block_size="16"' in text and 'num_gpu_blocks="512"' in text
    for name in ("prefix_cache_queries_total", "prefix_cache_hits_total", "prompt_tokens_total"):
        assert f'vllm:{name}{{model_name="' in text, name
    assert "vllm:time_to_first_token_seconds_bucket{" in text and "vllm:e2e_request_latency_seconds_count{" in text


def test_prefix_computed_on_a_is_loaded_from_redis_on_b(cluster):
    prompt = "pagedkv scale-out: " + " ".join(f"tenant{i % 17} document line {i}" for i in range(60))
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    a, b = cluster.urls
    r = httpx.post(f"{a}/v1/completions", json=body, timeout=REQUEST_S)
    assert r.status_code == 200, r.text
    end = time.monotonic() + 30  # write-through is asynchronous: wait until A's writer stored the blocks
    while cluster.tier_counter(0, "pagedkv:kv_tier_stored_blocks_total") <= 0 and time.monotonic() < end:
        time.sleep(0.2)
    assert cluster.tier_counter(0, "pagedkv:kv_tier_stored_blocks_total") > 0
    hit_before = cluster.tier_counter(1, "pagedkv:kv_tier_hit_tokens_total")
    sub = Subscriber(cluster.events[1])
    try:
        time.sleep(0.5)  # PUB/SUB: a subscription made after a send misses it
        r = httpx.post(f"{b}/v1/completions", json=body, timeout=REQUEST_S)
        assert r.status_code == 200, r.text
        loaded = cluster.tier_counter(1, "pagedkv:kv_tier_hit_tokens_total") - hit_before
        assert loaded >= 16 * 8
        # B announces the blocks it loaded, with the tier as their medium and vLLM's hashes of their tokens
        sub.wait_for(lambda: sum(len(e.block_hashes) for e in stored(sub.events) if e.medium == "REDIS") >= 8)
    finally:
        sub.close()
    ids = httpx.post(f"{b}/tokenize", json={"prompt": prompt}, timeout=30).json()["tokens"]
    from_redis = [e for e in stored(sub.events) if e.medium == "REDIS"]
    assert from_redis[0].parent_block_hash is None and from_redis[0].token_ids[:16] == ids[:16]
    hashes = [h for e in from_redis for h in e.block_hashes]
    want = vllm_hashes(ids, seed="0")
    assert hashes[: len(want)] == want[: len(hashes)]  # after them: B's own writes of the blocks it completed


def finished_requests(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith("pagedkv:request_success_total{")
    )


def stop_mid_run(cluster: Cluster, router: Any, sig: int, seed: int, **kw: Any) -> tuple[dict[str, Any], float]:
    """Run the workload through a round-robin router; after 4 requests finished, send ``sig`` to replica 1."""
    r = router("round_robin")
    kw.setdefault("output_len", 24)  # requests long enough that the run is still going when 4 have finished
    start = sum(finished_requests(u) for u in cluster.urls)
    out: dict[str, Any] = {}
    t = threading.Thread(target=lambda: out.update(run_workload(r.url, cluster, seed=seed, num_prompts=15, **kw)))
    t.start()
    end = time.monotonic() + 300
    while sum(finished_requests(u) for u in cluster.urls) - start < 4 and t.is_alive() and time.monotonic() < end:
        time.sleep(0.02)
    stopped_at = sum(finished_requests(u) for u in cluster.urls) - start
    cluster.procs[1].send_signal(sig)
    t.join(600)
    assert not t.is_alive()
    assert stopped_at < 15, "the replica was stopped after the run: nothing was tested"
    return out, stopped_at


def test_killing_a_replica_mid_run_costs_only_its_requests_in_flight(cluster, router):
    """SIGKILL: what replica 1 was answering is lost (at most the 2 in flight), every other request succeeds:
    the router retries the refused connections on replica 0."""
    out, _ = stop_mid_run(cluster, router, signal.SIGKILL, seed=400, no_stream=True)
    try:
        assert out["num_failed"] <= 2, out["errors"]
        assert out["num_requests"] + out["num_failed"] == 15
    finally:
        cluster.restart(1)


def test_stopping_a_replica_mid_run_costs_no_request(cluster, router):
    """SIGTERM: replica 1 drains (new requests: 503 + Retry-After, which the router retries on replica 0), finishes
    what it runs and exits; no request fails."""
    out, _ = stop_mid_run(cluster, router, signal.SIGTERM, seed=300)
    assert out["num_failed"] == 0, out["errors"]
    assert out["num_requests"] == 15
    assert cluster.procs[1].wait(60) == 0  # it drained and exited cleanly
