"""The pooling routes on a real server on loopback: /v1/embeddings through the openai
client (base64, as the SDK asks by default, and float), /pooling, /classify, /score
and /rerank against sentence-transformers, the runner checks both ways, bad input and
clients that leave."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import numpy as np
import openai
import pytest
import sentence_transformers
from tests.server_helpers import ThreadedServer, server_in_thread

from triollm import AsyncEngineArgs, AsyncLLMEngine

TEXTS = ["The quick brown fox jumps over the lazy dog.", "hello",
         "Paged attention keeps the KV cache in fixed-size blocks.", "a b c d e f g"]


def serve(path: Path, name: str, **engine_args: Any) -> Iterator[ThreadedServer]:
    """A server of the model at ``path``; request chat templates trusted."""
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(
        model=str(path), dtype="float32", **engine_args))
    with server_in_thread(engine, served_model_names=(name,),
                          trust_request_chat_template=True) as running:
        yield running
    assert not running.errors, running.errors


@pytest.fixture(scope="module")
def embed_server(pooling_models: dict[str, Path]) -> Iterator[ThreadedServer]:
    yield from serve(pooling_models["bert"], "embedder", max_num_seqs=4)


@pytest.fixture(scope="module")
def cross_server(pooling_models: dict[str, Path]) -> Iterator[ThreadedServer]:
    yield from serve(pooling_models["cross"], "reranker", runner="pooling")


@pytest.fixture(scope="module")
def generation_server(llama_path: Path) -> Iterator[ThreadedServer]:
    yield from serve(llama_path, "tiny", max_model_len=256, num_gpu_blocks_override=64)


def client_for(server: ThreadedServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def post(server: ThreadedServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def assert_idle(server: ThreadedServer) -> None:
    stats = server.handle.engine.statistics()
    assert (stats.num_running, stats.num_waiting, stats.num_open_streams) == (0, 0, 0)
    assert stats.num_free_blocks == stats.num_total_blocks


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_embeddings_through_the_openai_client_match_sentence_transformers(
        embed_server: ThreadedServer, pooling_models: dict[str, Path]) -> None:
    client = client_for(embed_server)
    reference = sentence_transformers.SentenceTransformer(
        str(pooling_models["bert"]), device="cpu").encode(TEXTS)
    tokenizer = embed_server.handle.engine.tokenizer
    for encoding_format in ("base64", "float"):  # the SDK sends base64 unless told
        kwargs = {} if encoding_format == "base64" else {"encoding_format": "float"}
        reply = client.embeddings.create(model="embedder", input=TEXTS, **kwargs)
        ours = np.array([item.embedding for item in reply.data])
        assert [item.index for item in reply.data] == list(range(len(TEXTS)))
        assert cosine_rows(ours, reference).min() >= 0.999
        tokens = sum(len(tokenizer.encode(text)) for text in TEXTS)
        assert reply.usage.prompt_tokens == reply.usage.total_tokens == tokens
        assert reply.model == "embedder"
    raw = post(embed_server, "/v1/embeddings", {"input": TEXTS[0]}).json()
    assert isinstance(raw["data"][0]["embedding"], list) and raw["object"] == "list"
    # token ids, one prompt and several
    ids = tokenizer.encode(TEXTS[0])
    one = client.embeddings.create(model="embedder", input=ids)
    several = client.embeddings.create(model="embedder", input=[ids, tokenizer.encode(TEXTS[1])])
    np.testing.assert_allclose(one.data[0].embedding, reference[0], atol=1e-4)
    np.testing.assert_allclose(several.data[1].embedding, reference[1], atol=1e-4)
    assert [m.id for m in client.models.list().data] == ["embedder"]
    assert_idle(embed_server)


def test_pooling_classify_and_score_routes_of_an_embedding_model(
        embed_server: ThreadedServer) -> None:
    pooled = post(embed_server, "/pooling", {"input": TEXTS[:2]}).json()
    assert [len(item["data"]) for item in pooled["data"]] == [48, 48]
    assert pooled["usage"]["prompt_tokens"] > 0
    raw = post(embed_server, "/pooling", {"input": TEXTS[0], "use_activation": False}).json()
    assert abs(np.linalg.norm(raw["data"][0]["data"]) - 1.0) > 1e-3
    scored = post(embed_server, "/score", {"text_1": TEXTS[0], "text_2": [TEXTS[0], TEXTS[1]]})
    scores = [item["score"] for item in scored.json()["data"]]
    assert scores[0] == pytest.approx(1.0, abs=1e-5) and scores[1] < 1.0
    messages = [{"role": "user", "content": TEXTS[0]}]
    no_template = post(embed_server, "/v1/embeddings", {"messages": messages})
    assert no_template.status_code == 400 and "chat template" in no_template.text
    chat = post(embed_server, "/v1/embeddings", {
        "messages": messages, "chat_template": "{% for m in messages %}{{ m.content }}"
                                               "{% endfor %}"})
    assert chat.status_code == 200, chat.text
    plain = post(embed_server, "/v1/embeddings", {"input": TEXTS[0]}).json()
    np.testing.assert_allclose(chat.json()["data"][0]["embedding"],
                               plain["data"][0]["embedding"], atol=1e-6)
    wrong = post(embed_server, "/classify", {"input": TEXTS[0]})
    assert wrong.status_code == 400 and "classify model" in wrong.json()["error"]["message"]


def test_scores_and_rerank_of_a_cross_encoder_match_sentence_transformers(
        cross_server: ThreadedServer, pooling_models: dict[str, Path]) -> None:
    query, documents = TEXTS[0], TEXTS[1:]
    reference = sentence_transformers.CrossEncoder(
        str(pooling_models["cross"]), device="cpu").predict([(query, d) for d in documents])
    for path, body in [("/score", {"text_1": query, "text_2": documents}),
                       ("/v1/score", {"data_1": query, "data_2": documents}),
                       ("/score", {"queries": [query] * 3, "documents": documents})]:
        reply = post(cross_server, path, body)
        assert reply.status_code == 200, reply.text
        np.testing.assert_allclose([d["score"] for d in reply.json()["data"]], reference,
                                   atol=1e-5)
    order = list(np.argsort(-reference))
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        reply = post(cross_server, path, {"model": "reranker", "query": query, "top_n": 2,
                                          "documents": [{"text": d} for d in documents]})
        assert reply.status_code == 200, reply.text
        results = reply.json()["results"]
        assert [r["index"] for r in results] == order[:2]
        assert results[0]["document"]["text"] == documents[order[0]]
        assert results[0]["relevance_score"] == pytest.approx(reference[order[0]], abs=1e-5)
        assert reply.json()["usage"]["total_tokens"] > 0
    everything = post(cross_server, "/rerank", {"query": query, "documents": documents})
    assert len(everything.json()["results"]) == len(documents)
    embeddings = post(cross_server, "/v1/embeddings", {"input": "x"})
    assert embeddings.status_code == 400 and "embed model" in embeddings.json()["error"][
        "message"]
    assert_idle(cross_server)


def test_routes_say_which_runner_is_loaded(embed_server: ThreadedServer,
                                           generation_server: ThreadedServer) -> None:
    with pytest.raises(openai.BadRequestError, match="--runner pooling"):
        client_for(embed_server).chat.completions.create(
            model="embedder", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="--runner pooling"):
        client_for(embed_server).completions.create(model="embedder", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="--runner generate") as caught:
        client_for(generation_server).embeddings.create(model="tiny", input="hi")
    assert caught.value.body["param"] == "model"  # type: ignore[index]
    for path, body in [("/pooling", {"input": "x"}), ("/classify", {"input": "x"}),
                       ("/score", {"text_1": "a", "text_2": "b"}),
                       ("/rerank", {"query": "a", "documents": ["b"]})]:
        reply = post(generation_server, path, body)
        assert reply.status_code == 400 and "--runner generate" in reply.text
    tokenized = post(embed_server, "/tokenize", {"prompt": "hello"})
    assert tokenized.status_code == 200  # tokenize works for every runner, as in vLLM


def test_bad_input_is_a_400_naming_it_and_costs_no_one_else(
        embed_server: ThreadedServer, caplog: pytest.LogCaptureFixture) -> None:
    client = client_for(embed_server)
    vocab = len(embed_server.handle.engine.tokenizer)
    cases = [
        ({"input": [[5, 6], [5, vocab + 3]]}, "input[1]: prompt_token_ids"),
        ({"input": []}, "input"),
        ({"input": ["fine", ""]}, "input[1]"),
        ({"input": "x", "dimensions": 8}, "dimensions"),
        ({"input": "x", "instruction": "rank"}, "instruction"),
        ({"input": "x", "embed_dtype": "float16"}, "embed_dtype"),
        ({"input": "fox " * 300}, "max_model_len"),
        ({"input": "x", "messages": [{"role": "user", "content": "y"}]}, "input"),
    ]
    for body, expected in cases:
        reply = post(embed_server, "/v1/embeddings", body)
        assert reply.status_code == 400, (body, reply.text)
        assert expected in reply.text, (body, reply.text)
    with caplog.at_level(logging.WARNING):
        assert post(embed_server, "/v1/embeddings", {"input": "x", "dimensons": 3}
                    ).status_code == 200
    assert "['dimensons']" in caplog.text
    truncated = post(embed_server, "/v1/embeddings",
                     {"input": TEXTS[2], "truncate_prompt_tokens": 4}).json()
    assert truncated["usage"]["prompt_tokens"] == 4
    assert len(client.embeddings.create(model="embedder", input=TEXTS).data) == len(TEXTS)
    assert_idle(embed_server)


def test_clients_that_leave_are_aborted(embed_server: ThreadedServer) -> None:
    """30 clients send big batches and hang up at once; nothing stays behind and the
    server keeps serving."""
    body = {"input": [f"{TEXTS[2]} number {i}" for i in range(64)]}

    async def impatient(http: httpx.AsyncClient) -> None:
        with pytest.raises(httpx.TimeoutException):
            await http.post(embed_server.url + "/v1/embeddings", json=body, timeout=0.05)

    async def main() -> None:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=50)) as http, \
                anyio.create_task_group() as tasks:
            for _ in range(30):
                tasks.start_soon(impatient, http)

    anyio.run(main, backend="trio")

    deadline = time.monotonic() + 30  # the server's thread closes what the clients left
    while embed_server.handle.engine.statistics().num_open_streams and (
            time.monotonic() < deadline):
        time.sleep(0.05)
    assert_idle(embed_server)
    reply = client_for(embed_server).embeddings.create(model="embedder", input="still here")
    assert len(reply.data[0].embedding) == 48


def test_triollm_serve_runner_pooling(pooling_models: dict[str, Path]) -> None:
    """The CLI: vLLM's --task embed spelling and --pooler-config reach the engine."""
    from tests.server_helpers import server_process

    path = str(pooling_models["bert"])
    reference = sentence_transformers.SentenceTransformer(path, device="cpu").encode(TEXTS[:2])
    with server_process(path, "--task", "embed", "--dtype", "float32",
                        "--served-model-name", "e5", "--pooler-config",
                        '{"use_activation": false}') as (process, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        reply = client.embeddings.create(model="e5", input=TEXTS[:2])
        ours = np.array([item.embedding for item in reply.data])
        assert cosine_rows(ours, reference).min() >= 0.999
        assert abs(np.linalg.norm(ours[0]) - 1.0) > 1e-3  # --pooler-config: not normalized
        process.terminate()
        assert process.wait(60) == 0
