"""The real ``openai`` client (sync, async, streaming) against a server over the bundled SmolLM2."""

from __future__ import annotations

import asyncio

import httpx
import openai

from pagedkv_rs.engine.request import SamplingParams

PROMPT = "The capital of France is"


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_greedy_completion_equals_llm_generate(llm, llm_server):
    want = llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0.0))[0]
    got = client(llm_server).completions.create(model="smollm2", prompt=PROMPT, max_tokens=6, temperature=0)
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert got.usage.completion_tokens == len(want.token_ids)
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    # the same prompt as token ids gives the same tokens back through /detokenize
    ids = client(llm_server).completions.create(
        model="smollm2", prompt=want.prompt_token_ids, max_tokens=6, temperature=0
    )
    assert ids.choices[0].text == want.text
    back = httpx.post(f"{llm_server}/detokenize", json={"tokens": want.token_ids}).json()
    assert back["prompt"] == want.text


def test_streamed_text_equals_whole_text_and_usage_chunk(llm_server):
    c = client(llm_server)
    whole = c.completions.create(model="smollm2", prompt=PROMPT, max_tokens=8, temperature=0)
    chunks = list(
        c.completions.create(
            model="smollm2",
            prompt=PROMPT,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == whole.choices[0].finish_reason


def test_chat_uses_the_gguf_template(llm, llm_server):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    want = llm.chat(msgs, SamplingParams(max_tokens=6, temperature=0.0))[0]
    got = client(llm_server).chat.completions.create(
        model="smollm2", messages=msgs, max_completion_tokens=6, temperature=0
    )
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    assert got.usage.prompt_tokens == len(llm.tokenizer.apply_chat_template(msgs))
    tok = httpx.post(f"{llm_server}/tokenize", json={"messages": msgs}).json()
    assert tok["tokens"] == llm.tokenizer.apply_chat_template(msgs) and tok["count"] == got.usage.prompt_tokens
    # streamed chat: a role chunk, then content deltas adding up to the same text
    chunks = list(
        client(llm_server).chat.completions.create(
            model="smollm2", messages=msgs, max_tokens=6, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want.text


def test_async_client_concurrent_and_prefix_cache_usage(llm_server):
    prompt = "Once upon a time, in a land far away, there lived a small dragon who loved to read books about"

    async def main() -> list:
        c = openai.AsyncOpenAI(base_url=f"{llm_server}/v1", api_key="unused", max_retries=0)
        first = await c.completions.create(model="smollm2", prompt=prompt, max_tokens=4, temperature=0)
        rest = await asyncio.gather(
            *(c.completions.create(model="smollm2", prompt=prompt, max_tokens=4, temperature=0) for _ in range(2))
        )
        await c.close()
        return [first, *rest]

    outs = asyncio.run(main())
    assert len({o.choices[0].text for o in outs}) == 1
    assert outs[0].usage.prompt_tokens > 16
    assert all(o.usage.prompt_tokens_details.cached_tokens >= 16 for o in outs[1:])


def test_models_version_health(llm_server):
    models = client(llm_server).models.list()
    assert [m.id for m in models.data] == ["smollm2"]
    assert httpx.get(f"{llm_server}/health").status_code == 200
    assert httpx.get(f"{llm_server}/version").json()["version"]
