"""``/v1/embeddings`` with the real ``openai`` client and LangChain against a server over the bundled SmolLM2."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest

TEXTS = ["The capital of France is Paris.", "Cats sleep most of the day."]


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_openai_client_float_and_base64_equal_llm_embed(llm, llm_server):
    c = client(llm_server)
    floats = c.embeddings.create(model="smollm2", input=TEXTS, encoding_format="float")
    b64 = c.embeddings.create(model="smollm2", input=TEXTS, encoding_format="base64")  # asked for: kept a string
    default = c.embeddings.create(model="smollm2", input=TEXTS)  # the client asks for base64 and decodes it
    want = llm.embed(TEXTS)
    assert [d.index for d in floats.data] == [0, 1]
    for i, w in enumerate(want):
        assert floats.data[i].embedding == w.outputs.embedding
        assert np.frombuffer(base64.b64decode(b64.data[i].embedding), "<f4").tolist() == w.outputs.embedding
        assert default.data[i].embedding == w.outputs.embedding
        assert len(floats.data[i].embedding) == llm.model.hidden_size
    n = sum(len(w.prompt_token_ids) for w in want)
    assert floats.usage.prompt_tokens == n and floats.usage.total_tokens == n
    assert floats.model == "smollm2" and floats.object == "list"


def test_base64_is_little_endian_float32(llm_server):
    body = {"model": "smollm2", "input": TEXTS[0]}
    as_float = httpx.post(f"{llm_server}/v1/embeddings", json={**body, "encoding_format": "float"}).json()
    as_b64 = httpx.post(f"{llm_server}/v1/embeddings", json={**body, "encoding_format": "base64"}).json()
    raw = base64.b64decode(as_b64["data"][0]["embedding"])
    assert np.frombuffer(raw, "<f4").tolist() == as_float["data"][0]["embedding"]


def test_token_id_inputs_equal_text(llm, llm_server):
    c = client(llm_server)
    ids = [llm.tokenizer.encode(t, add_special_tokens=True) for t in TEXTS]
    by_text = c.embeddings.create(model="smollm2", input=TEXTS, encoding_format="float")
    by_ids = c.embeddings.create(model="smollm2", input=ids, encoding_format="float")
    one = c.embeddings.create(model="smollm2", input=ids[1], encoding_format="float")
    assert [d.embedding for d in by_ids.data] == [d.embedding for d in by_text.data]
    assert one.data[0].embedding == by_text.data[1].embedding


def test_dimensions_user_and_normalize(llm, llm_server):
    c = client(llm_server)
    h = llm.model.hidden_size
    ok = c.embeddings.create(model="smollm2", input=TEXTS[0], dimensions=h, user="u-1", encoding_format="float")
    assert len(ok.data[0].embedding) == h
    with pytest.raises(openai.BadRequestError) as e:
        c.embeddings.create(model="smollm2", input=TEXTS[0], dimensions=h // 2)
    assert e.value.body["param"] == "dimensions" and e.value.body["code"] == "unsupported_parameter"
    raw = httpx.post(
        f"{llm_server}/v1/embeddings", json={"input": TEXTS[0], "normalize": False, "encoding_format": "float"}
    ).json()
    v = np.asarray(raw["data"][0]["embedding"])
    assert abs(np.linalg.norm(v) - 1.0) > 1e-3
    np.testing.assert_allclose(v / np.linalg.norm(v), ok.data[0].embedding, atol=1e-6)


@pytest.mark.parametrize(
    "body, param, code",
    [
        ({"input": TEXTS[0], "truncate": True}, "truncate", "unsupported_parameter"),
        ({"input": TEXTS[0], "add_special_tokens": False}, "add_special_tokens", "unsupported_parameter"),
        ({"input": []}, "input", None),
        ({"input": [""]}, "input", None),
        ({"input": ["a"] * 65}, "input", None),
        ({"input": [[1, 2], []]}, "input", None),
        ({"input": [[1, 10**9]]}, "input", None),
        ({"input": TEXTS[0], "encoding_format": "int8"}, "encoding_format", None),
        ({"input": "word " * 20000}, "input", "context_length_exceeded"),
        ({"input": list(range(1, 9000))}, "input", "context_length_exceeded"),
        ({"input": TEXTS[0], "model": "other"}, "model", "model_not_found"),
    ],
)
def test_bad_requests_get_openai_errors(llm_server, body, param, code):
    r = httpx.post(f"{llm_server}/v1/embeddings", json=body, timeout=60)
    assert r.status_code == (404 if code == "model_not_found" else 400), r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == code and err["message"]
    assert set(err) == {"message", "type", "param", "code"}


def test_model_without_hidden_states_is_refused(serve_tiny):
    with serve_tiny() as (url, engine, _):
        r = httpx.post(f"{url}/v1/embeddings", json={"input": "hello"})
        assert r.status_code == 400 and "forward_hidden" in r.json()["error"]["message"]
        assert not engine.has_unfinished_requests()


def test_embeddings_beside_a_completion(llm, llm_server):
    """A generation and embeddings on one server at once: both answered, the embedding the same as alone."""
    import concurrent.futures

    c = client(llm_server)
    alone = c.embeddings.create(model="smollm2", input=TEXTS, encoding_format="float")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        gen = pool.submit(
            c.completions.create, model="smollm2", prompt="Once upon a time", max_tokens=24, temperature=0
        )
        emb = pool.submit(c.embeddings.create, model="smollm2", input=TEXTS, encoding_format="float")
        text = gen.result().choices[0].text
        got = emb.result()
    np.testing.assert_allclose([d.embedding for d in got.data], [d.embedding for d in alone.data], atol=1e-5)
    assert text


def test_langchain_openai_embeddings(llm, llm_server):
    from langchain_openai import OpenAIEmbeddings

    emb = OpenAIEmbeddings(
        model="smollm2", base_url=f"{llm_server}/v1", api_key="unused", check_embedding_ctx_length=False
    )
    docs = emb.embed_documents(TEXTS)
    query = emb.embed_query("Where is Paris?")
    want = llm.embed([*TEXTS, "Where is Paris?"])
    np.testing.assert_allclose(docs, [w.outputs.embedding for w in want[:2]], atol=1e-6)
    np.testing.assert_allclose(query, want[2].outputs.embedding, atol=1e-6)


def test_server_mean_pooling(llm, serve_tiny, make_tiny_engine):
    with serve_tiny(engine=make_tiny_engine(llm.model), embedding_pooling="mean") as (url, engine, _):
        got = client(url).embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
        assert engine.scheduler.stats()["kv_live_blocks"] == 0
    mean = llm.embed(TEXTS, pooling="mean")
    last = llm.embed(TEXTS, pooling="last")
    for d, m, lt in zip(got.data, mean, last):  # this engine's KV is float32, the LLM's float16
        np.testing.assert_allclose(d.embedding, m.outputs.embedding, atol=2e-3)
        assert np.abs(np.asarray(d.embedding) - lt.outputs.embedding).max() > 1e-2


def test_unknown_pooling_is_refused_when_the_app_is_built(llm):
    from pagedkv_rs.serve import build_app

    with pytest.raises(ValueError, match="pooling must be one of"):
        build_app(llm, embedding_pooling="cls", shutdown_engine=False)


def test_full_queue_is_a_503(llm, serve_tiny, make_tiny_engine):
    with serve_tiny(engine=make_tiny_engine(llm.model), max_queued_requests=1) as (url, engine, _):
        r = httpx.post(f"{url}/v1/embeddings", json={"input": TEXTS})
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
        assert r.headers["retry-after"] == "1"
        assert not engine.has_unfinished_requests()
