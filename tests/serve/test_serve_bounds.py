"""Per-request bounds over HTTP (issue 32), each against a real uvicorn server on loopback: an ``n > 1``
fan-out holds a seat per sequence (or gets a 400), and a text too long for the context is refused by its
bytes before it is tokenized while ``/health`` keeps answering."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from conftest import running
from pagedkv_rs.serve import build_app

BIG = "The quick brown fox jumps over the lazy dog. " * ((4 << 20) // 45 - 100)  # ~4 MiB, under the body limit


class RunningCount:
    """The tiny model, recording the scheduler's running count at every forward."""

    def __init__(self, model: Any) -> None:
        self._m = model
        self.engine: Any = None
        self.counts: list[int] = []
        for a in ("num_layers", "num_kv_heads", "head_dim", "vocab_size", "max_model_len", "eos_token_ids"):
            setattr(self, a, getattr(model, a))

    def forward(self, batch: Any, kv_caches: Any) -> Any:
        s = self.engine.scheduler
        self.counts.append(len(s.running) + len(s.loading) + s.reserved_seats)
        return self._m.forward(batch, kv_caches)


def test_64_prompts_x_n16_never_run_more_than_max_num_seqs_and_a_bystander_is_served(
    serve_tiny, make_tiny_engine, tiny_model, wait_idle
):
    model = RunningCount(tiny_model)
    engine = model.engine = make_tiny_engine(model, num_blocks=2048, max_num_seqs=64)
    with serve_tiny(engine) as (url, _, _):
        flood = {"prompt": [f"item {i} of the list" for i in range(64)], "n": 16, "max_tokens": 4, "ignore_eos": True}
        with ThreadPoolExecutor(2) as ex:
            big = ex.submit(httpx.post, url + "/v1/completions", json=flood, timeout=600)
            small = ex.submit(
                httpx.post, url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=600
            )
            r, b = big.result(), small.result()
        assert r.status_code == 200 and len(r.json()["choices"]) == 64 * 16
        assert b.status_code == 200 and b.json()["choices"][0]["finish_reason"] in ("length", "stop")
        assert max(model.counts) == 64  # seats are filled, never exceeded
        assert wait_idle(engine)["kv_live_blocks"] == 0


def test_a_fan_out_that_can_never_fit_is_a_400(serve_tiny, make_tiny_engine):
    with serve_tiny(make_tiny_engine(max_num_seqs=8)) as (url, engine, _):
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "n": 9, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "max_num_seqs=8" in r.text
        assert not engine.has_unfinished_requests()
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "n": 8, "max_tokens": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 8


class CountingTokenizer:
    """A tokenizer that records the length of every text it is asked to encode or render."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok
        self.texts: list[int] = []
        self.lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)

    def encode(self, text: str, **kw: Any) -> list[int]:
        with self.lock:
            self.texts.append(len(text))
        return self._tok.encode(text, **kw)

    def apply_chat_template(self, messages: Any, *a: Any, **kw: Any) -> Any:
        with self.lock:
            self.texts.append(sum(len(m["content"]) for m in messages))
        return self._tok.apply_chat_template(messages, *a, **kw)


def test_a_4mib_prompt_is_refused_untokenized_and_health_answers_during_seven(llm, make_tiny_engine):
    tok = CountingTokenizer(llm.tokenizer)
    engine = make_tiny_engine()
    with running(build_app(engine, tokenizer=tok, served_model_name="tiny")) as (url, _):
        attacks = [("/v1/completions", {"prompt": BIG, "max_tokens": 1})] * 5
        attacks.append(("/v1/chat/completions", {"messages": [{"role": "user", "content": BIG}]}))
        attacks.append(("/tokenize", {"prompt": BIG}))
        done = threading.Event()
        health: list[int] = []

        def poll() -> None:
            with httpx.Client(timeout=10) as c:  # a stalled loop fails it here: ReadTimeout
                while not done.is_set():
                    health.append(c.get(url + "/health").status_code)

        with ThreadPoolExecutor(len(attacks) + 1) as ex:
            watcher = ex.submit(poll)
            results = list(ex.map(lambda a: httpx.post(url + a[0], json=a[1], timeout=60), attacks))
            done.set()
            watcher.result()
        for r in results:
            err = r.json()["error"]
            assert r.status_code == 400 and err["code"] == "context_length_exceeded", r.text
            assert f"maximum context length is {engine.max_model_len} tokens" in err["message"]
        assert health and set(health) == {200}
        assert not tok.texts  # nothing was tokenized (or rendered)
        ok = httpx.post(url + "/tokenize", json={"prompt": "a b c " * 2000})  # long, within the bound
        assert ok.status_code == 200 and ok.json()["count"] == len(llm.tokenizer.encode("a b c " * 2000))
        assert tok.texts == [12000]
