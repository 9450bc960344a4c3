"""Bounded load: 48 streaming clients (a third hang up mid-stream) plus a flood past the queue bound."""

from __future__ import annotations

import asyncio
import random
import time

import httpx


def test_48_streams_a_third_disconnecting_and_a_flood(serve_tiny, make_tiny_engine, wait_idle):
    # 48 seats and a queue of 48: every stream is admitted even if all 48 arrive before a step schedules
    # them; the flood then finds the seats taken and the queue filling up
    engine = make_tiny_engine(num_blocks=1024, max_num_seqs=48)
    with serve_tiny(engine, max_queued_requests=48) as (url, _, _srv):
        statuses: list[int] = []
        finished = disconnected = 0

        async def stream_client(i: int, c: httpx.AsyncClient) -> None:
            nonlocal finished, disconnected
            body = {
                "prompt": f"client {i} says hello",
                "max_tokens": 48,
                "ignore_eos": True,
                "stream": True,
                "temperature": 0,
            }
            async with c.stream("POST", "/v1/completions", json=body) as r:
                statuses.append(r.status_code)
                if r.status_code != 200:
                    return
                seen = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        seen += 1
                        if i % 3 == 0 and seen == 4:
                            disconnected += 1
                            return  # hang up mid-stream
                        if line == "data: [DONE]":
                            finished += 1

        async def flood(c: httpx.AsyncClient) -> None:
            while len(statuses) < 48:  # once every stream has its answer head (it was submitted)
                await asyncio.sleep(0.01)
            rs = await asyncio.gather(
                *(
                    c.post(
                        "/v1/completions",
                        json={"prompt": [7] * random.randint(1, 60), "max_tokens": 8, "temperature": 0},
                    )
                    for _ in range(80)
                )
            )
            statuses.extend(r.status_code for r in rs)

        async def main() -> None:
            limits = httpx.Limits(max_connections=200)
            async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as c:
                await asyncio.wait_for(asyncio.gather(*(stream_client(i, c) for i in range(48)), flood(c)), timeout=60)

        t0 = time.monotonic()
        asyncio.run(main())
        took = time.monotonic() - t0
        assert len(statuses) == 48 + 80
        assert all(200 <= s < 300 or 400 <= s < 500 or s == 503 for s in statuses), sorted(set(statuses))
        assert 503 in statuses, "the flood never hit the queue bound"
        assert statuses[:48].count(200) == 48 and disconnected == 16 and finished == 32, (disconnected, finished)
        assert httpx.get(f"{url}/health").status_code == 200
        ok = httpx.post(f"{url}/v1/completions", json={"prompt": "still there?", "max_tokens": 2, "temperature": 0})
        assert ok.status_code == 200
        s = wait_idle(engine)
        assert s["num_running"] == s["num_waiting"] == s["kv_live_blocks"] == 0
        print(
            f"load: {len(statuses)} responses in {took:.1f} s; {statuses.count(503)} x 503, "
            f"{finished} streams finished, {disconnected} hung up"
        )
