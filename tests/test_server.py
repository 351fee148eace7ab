"""The OpenAI-compatible server, over a real tiny model on 127.0.0.1, through the
official ``openai`` client (sync, and async under trio and asyncio) and raw HTTP."""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest

from server_helpers import ThreadedServer, server_in_thread
from triollm import AsyncEngineArgs, AsyncLLMEngine
from triollm.server.app import build_app
from triollm.server.metrics import PrometheusStatLogger
from triollm.server.state import CorsSettings, ServerSettings, ServerState
from triollm.testing import FakeModelRunner

API_KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
LOGPROB_ENTRIES = 50_000
MODEL = "tiny"
BODY_LIMIT = 64 * 1024
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def server(llama_path: Path) -> Iterator[ThreadedServer]:
    args = AsyncEngineArgs(model=str(llama_path), dtype="float32", max_model_len=MAX_MODEL_LEN,
                           num_gpu_blocks_override=512, max_num_seqs=96,
                           disable_log_requests=True)
    engine = AsyncLLMEngine.from_engine_args(args)
    with server_in_thread(engine, api_key=API_KEY, served_model_names=(MODEL,),
                          max_request_body_bytes=BODY_LIMIT,
                          max_logprob_entries=LOGPROB_ENTRIES) as running:
        yield running
    assert not running.errors, running.errors


@pytest.fixture(scope="module")
def client(server: ThreadedServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def metric(server: ThreadedServer, name: str, **labels: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    total = 0.0
    found = False
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            total += float(match.group(2))
            found = True
    assert found, f"{name} not in /metrics"
    return total


def assert_idle(server: ThreadedServer, timeout: float = 10.0) -> None:
    """No request running or waiting, every KV block free (polls: aborts land at the
    next step boundary)."""
    deadline = time.monotonic() + timeout
    while True:
        running = metric(server, "vllm:num_requests_running")
        waiting = metric(server, "vllm:num_requests_waiting")
        stats = server.handle.engine.statistics()
        if (running, waiting, stats.num_free_blocks, stats.num_open_streams) == (
                0, 0, stats.num_total_blocks, 0):
            assert metric(server, "vllm:kv_cache_usage_perc") == 0
            return
        assert time.monotonic() < deadline, (running, waiting, stats)
        time.sleep(0.05)


# -- completions and chat through the openai client ------------------------------------

def test_completion_text_usage_and_stop(client: openai.OpenAI) -> None:
    first = client.completions.create(model=MODEL, prompt="The cat sat on", max_tokens=12,
                                      temperature=0, extra_body={"ignore_eos": True})
    [choice] = first.choices
    assert choice.finish_reason == "length" and choice.text
    assert first.usage is not None and first.usage.completion_tokens == 12
    assert first.usage.total_tokens == first.usage.prompt_tokens + 12
    # Stop on a piece of what greedy decoding writes: the text ends just before it.
    stop = choice.text[len(choice.text) // 2:][:3]
    if stop.strip():
        stopped = client.completions.create(model=MODEL, prompt="The cat sat on",
                                            max_tokens=12, temperature=0, stop=[stop])
        assert stopped.choices[0].finish_reason == "stop"
        assert stopped.choices[0].text == choice.text[: choice.text.index(stop)]


def test_streaming_equals_non_streaming(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 16,
                              "temperature": 0, "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True,
                                            stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "length" and all(f is None for f in finals[:-1])


def test_streamed_echo_and_logprobs_equal_the_whole_reply(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8,
                              "n": 2, "seed": 5, "temperature": 1.0, "echo": True,
                              "logprobs": 1, "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, **kwargs))
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(c.text for c in mine) == choice.text
        assert mine[0].text.startswith("Once upon a time")
        assert choice.logprobs is not None
        streamed_tokens = [t for c in mine for t in (c.logprobs.tokens or [])
                           if c.logprobs is not None]
        streamed_values = [v for c in mine for v in (c.logprobs.token_logprobs or [])
                           if c.logprobs is not None]
        assert streamed_tokens == choice.logprobs.tokens
        assert streamed_values[0] is None and choice.logprobs.token_logprobs
        assert streamed_values[1:] == pytest.approx(choice.logprobs.token_logprobs[1:],
                                                    abs=1e-4)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_continuous_usage_stats_count_up_in_every_chunk(client: openai.OpenAI,
                                                        route: str) -> None:
    options: Any = {"include_usage": True, "continuous_usage_stats": True}
    common: dict[str, Any] = {"model": MODEL, "max_tokens": 12, "temperature": 0,
                              "stream": True, "stream_options": options,
                              "extra_body": {"ignore_eos": True}}
    if route == "chat":
        chunks: list[Any] = list(client.chat.completions.create(
            messages=[{"role": "user", "content": "Count."}], **common))
    else:
        chunks = list(client.completions.create(prompt="Once upon a time", **common))
    usages = [c.usage for c in chunks]
    assert all(u is not None for u in usages)
    completion = [u.completion_tokens for u in usages]
    assert completion == sorted(completion) and completion[-1] == 12
    assert len({u.prompt_tokens for u in usages}) == 1
    assert all(u.total_tokens == u.prompt_tokens + u.completion_tokens for u in usages)
    # without include_usage there is no usage at all, as in vLLM
    plain = list(client.completions.create(prompt="Hi", model=MODEL, max_tokens=3,
                                           stream=True,
                                           stream_options={"continuous_usage_stats": True}))  # type: ignore[typeddict-unknown-key]
    assert all(c.usage is None for c in plain)


def test_n_seed_logprobs_and_echo(client: openai.OpenAI) -> None:
    result = client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, n=3,
                                       seed=7, temperature=1.0, logprobs=2,
                                       extra_body={"ignore_eos": True})
    assert sorted(c.index for c in result.choices) == [0, 1, 2]
    assert result.usage is not None and result.usage.completion_tokens == 18
    for choice in result.choices:
        assert choice.logprobs is not None
        assert len(choice.logprobs.tokens or []) == 6
        joined = "".join(choice.logprobs.tokens or [])
        if "\ufffd" not in joined + choice.text:  # byte tokens of a split character
            assert joined == choice.text
        assert all(lp is not None and lp <= 0 for lp in choice.logprobs.token_logprobs or [])
        # top 2 plus the sampled token, keyed by text (byte tokens may share a text)
        assert all(1 <= len(top) <= 3 for top in choice.logprobs.top_logprobs or [])
    again = client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, n=3, seed=7,
                                      temperature=1.0, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in result.choices]
    echoed = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, echo=True,
                                       temperature=0)
    assert echoed.choices[0].text.startswith("Hello")


def test_logit_bias_and_allowed_token_ids(server: ThreadedServer,
                                         client: openai.OpenAI) -> None:
    def token_text(token: int) -> str:
        response = httpx.post(server.url + "/detokenize", headers=AUTH, json={"tokens": [token]})
        return str(response.json()["prompt"])

    forced = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5,
                                       temperature=0, logit_bias={"77": 100}, logprobs=0,
                                       extra_body={"ignore_eos": True})
    assert forced.choices[0].logprobs is not None
    assert forced.choices[0].logprobs.tokens == [token_text(77)] * 5
    banned = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5,
                                       temperature=0, logit_bias={"77": 100}, logprobs=0,
                                       extra_body={"ignore_eos": True,
                                                   "bad_words": [token_text(77)]})
    assert banned.choices[0].logprobs is not None
    assert token_text(77) not in (banned.choices[0].logprobs.tokens or [])
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
        temperature=1.0, seed=3, logprobs=True,
        extra_body={"allowed_token_ids": [40, 41], "ignore_eos": True})
    content = chat.choices[0].logprobs.content if chat.choices[0].logprobs else None
    assert content and len(content) == 6
    assert {t.token for t in content} <= {token_text(40), token_text(41)}


def test_prompt_logprobs(server: ThreadedServer, client: openai.OpenAI) -> None:
    prompt = "The lighthouse keeper counted ships"
    tokens = httpx.post(server.url + "/tokenize", headers=AUTH,
                        json={"prompt": prompt}).json()["tokens"]
    asked = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2,
                                      temperature=0, extra_body={"prompt_logprobs": 2})
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2,
                                       temperature=0, echo=True, logprobs=2)
    positions = (asked.choices[0].model_extra or {})["prompt_logprobs"]
    assert len(positions) == len(tokens)
    assert positions[0] is None and all(1 <= len(p) <= 3 for p in positions[1:])
    # Each position holds the prompt's own token, with the log-probability that echo +
    # logprobs reports for it.
    assert echoed.choices[0].logprobs is not None
    echoed_values = (echoed.choices[0].logprobs.token_logprobs or [])[:len(tokens)]
    for token, position, value in zip(tokens[1:], positions[1:], echoed_values[1:],
                                      strict=True):
        assert value is not None and value <= 0
        assert abs(position[str(token)]["logprob"] - value) < 1e-4

    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
        extra_body={"prompt_logprobs": 0})
    chat_positions = (chat.model_extra or {})["prompt_logprobs"]
    assert chat.usage is not None and len(chat_positions) == chat.usage.prompt_tokens
    assert all(len(p) == 1 for p in chat_positions[1:])  # just the prompt's own token
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert (plain.choices[0].model_extra or {}).get("prompt_logprobs") is None


def test_truncate_prompt_tokens(client: openai.OpenAI) -> None:
    long_prompt = [40] * (MAX_MODEL_LEN + 10)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=2)
    result = client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=2,
                                       extra_body={"truncate_prompt_tokens": 10})
    assert result.usage is not None and result.usage.prompt_tokens == 10


def test_batched_prompts(client: openai.OpenAI) -> None:
    result = client.completions.create(model=MODEL, prompt=["one", "two", "three"],
                                       max_tokens=4, n=2, temperature=0)
    assert sorted(c.index for c in result.choices) == list(range(6))
    assert result.usage is not None and result.usage.completion_tokens <= 24


def test_chat_streaming_and_not(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "Say something."}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                           temperature=0, logprobs=True, top_logprobs=3)
    [choice] = reply.choices
    assert choice.message.role == "assistant" and choice.message.content is not None
    assert reply.usage is not None and reply.usage.completion_tokens == len(
        choice.logprobs.content or []) if choice.logprobs else False
    assert all(len(t.top_logprobs) == 3 for t in (choice.logprobs.content or []))
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens


def test_errors_surface_as_the_clients_exception_types(server: ThreadedServer,
                                                       client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=-1)
    assert "temperature" in str(raised.value)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0
                      ).completions.create(model=MODEL, prompt="x", max_tokens=2)


@pytest.mark.anyio
async def test_async_client(server: ThreadedServer, anyio_backend: str) -> None:
    """``AsyncOpenAI`` under trio and under asyncio, several requests at once."""
    async_client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY,
                                      max_retries=0)
    texts: dict[int, str] = {}

    async def one(i: int) -> None:
        if i % 2:
            stream = await async_client.completions.create(
                model=MODEL, prompt=f"Number {i}", max_tokens=8, temperature=0, stream=True)
            texts[i] = "".join([c.choices[0].text async for c in stream if c.choices])
        else:
            result = await async_client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Number {i}"}],
                max_tokens=8, temperature=0)
            texts[i] = result.choices[0].message.content or ""

    async with anyio.create_task_group() as tasks:
        for i in range(6):
            tasks.start_soon(one, i)
    assert len(texts) == 6
    await async_client.close()


# -- the other endpoints ---------------------------------------------------------------

def test_models_health_version_tokenize_and_openapi(server: ThreadedServer,
                                                    client: openai.OpenAI) -> None:
    [card] = client.models.list().data
    assert card.id == MODEL
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version", headers=AUTH).json()["version"]
    tokens = httpx.post(server.url + "/tokenize", headers=AUTH,
                        json={"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    assert tokens["max_model_len"] == MAX_MODEL_LEN
    text = httpx.post(server.url + "/detokenize", headers=AUTH,
                      json={"tokens": tokens["tokens"]}).json()
    assert text["prompt"].strip() == "Hello world"
    chat = httpx.post(server.url + "/tokenize", headers=AUTH,
                      json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 1
    schema = httpx.get(server.url + "/openapi.json", headers=AUTH).json()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
                 "/tokenize", "/detokenize", "/generate", "/metrics", "/version"):
        assert path in schema["paths"], path
    fields = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    for name in ("prompt", "max_tokens", "n", "logprobs", "echo", "stop", "seed", "top_k",
                 "min_p", "repetition_penalty", "min_tokens", "stop_token_ids", "ignore_eos",
                 "priority", "is_latency_sensitive", "slo", "stream_options"):
        assert name in fields, name


def test_seed_generate_endpoint(server: ThreadedServer) -> None:
    """vLLM's minimal /generate of the seed's api_server, plain and streaming."""
    body = {"prompt": "Hello", "max_tokens": 5, "temperature": 0}
    plain = httpx.post(server.url + "/generate", headers=AUTH, json=body).json()
    assert plain["text"][0].startswith("Hello")
    with httpx.stream("POST", server.url + "/generate", headers=AUTH,
                      json={**body, "stream": True}) as r:
        chunks = [c for c in r.read().split(b"\0") if c]
    assert json.loads(chunks[-1])["text"] == plain["text"]
    assert httpx.post(server.url + "/generate", headers=AUTH, json={"prompt": "x", "bogus": 1}
                      ).status_code == 400


def test_metrics_count_a_completion_under_vllm_names(server: ThreadedServer,
                                                     client: openai.OpenAI) -> None:
    before = metric(server, "vllm:request_success_total", finished_reason="length")
    generated_before = metric(server, "vllm:generation_tokens_total")
    client.completions.create(model=MODEL, prompt="count", max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    assert metric(server, "vllm:request_success_total",
                  finished_reason="length") == before + 1
    assert metric(server, "vllm:generation_tokens_total") == generated_before + 5
    for name in ("vllm:prompt_tokens_total", "vllm:time_to_first_token_seconds_count",
                 "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_count"):
        assert metric(server, name) > 0, name


def test_slo_attainment_is_counted_per_request(server: ThreadedServer,
                                              client: openai.OpenAI) -> None:
    def count(outcome: str) -> float:
        return metric(server, "triollm:request_slo_total", outcome=outcome)

    attained, missed = count("attained"), count("missed")
    client.completions.create(model=MODEL, prompt="count", max_tokens=4, temperature=0,
                              extra_body={"ignore_eos": True, "is_latency_sensitive": "True",
                                          "slo": 60.0, "ttft_slo": 60.0})
    assert (count("attained"), count("missed")) == (attained + 1, missed)
    client.completions.create(model=MODEL, prompt="count", max_tokens=4, temperature=0,
                              extra_body={"ignore_eos": True, "slo": 1e-9})
    assert (count("attained"), count("missed")) == (attained + 1, missed + 1)
    client.completions.create(model=MODEL, prompt="count", max_tokens=4, temperature=0)
    assert (count("attained"), count("missed")) == (attained + 1, missed + 1)


# -- bad input ---------------------------------------------------------------------------

def test_bad_input_gets_openai_errors_and_the_server_keeps_serving(
        server: ThreadedServer, client: openai.OpenAI) -> None:
    auth = {"Authorization": f"Bearer {API_KEY}"}
    url = server.url + "/v1/completions"
    good = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    cases: list[tuple[str, dict[str, Any], int, str | None]] = [
        ("invalid JSON", {"content": b"{not json", "headers": {
            **auth, "content-type": "application/json"}}, 400, None),
        ("wrong type", {"json": {**good, "max_tokens": "many"}}, 400, "max_tokens"),
        ("out of range temperature", {"json": {**good, "temperature": -0.5}}, 400,
         "temperature"),
        ("out of range top_p", {"json": {**good, "top_p": 1.5}}, 400, "top_p"),
        ("prompt too long", {"json": {**good, "prompt": [5] * MAX_MODEL_LEN}}, 400, "prompt"),
        ("empty prompt", {"json": {**good, "prompt": ""}}, 400, "prompt"),
        ("n too large", {"json": {**good, "n": 1000}}, 400, "n"),
        ("non-positive ttft_slo", {"json": {**good, "ttft_slo": 0}}, 400, "ttft_slo"),
        ("priority under fcfs", {"json": {**good, "priority": 1}}, 400, "priority"),
        ("logit_bias key not a token id", {"json": {**good, "logit_bias": {"a": 1}}}, 400,
         "logit_bias"),
        ("logit_bias outside the vocabulary", {"json": {**good, "logit_bias": {"999999": 1}}},
         400, "logit_bias"),
        ("empty allowed_token_ids", {"json": {**good, "allowed_token_ids": []}}, 400,
         "allowed_token_ids"),
        ("best_of above n", {"json": {**good, "best_of": 3}}, 400, "best_of"),
        ("prompt_logprobs while streaming",
         {"json": {**good, "stream": True, "prompt_logprobs": 1}}, 400, "prompt_logprobs"),
        ("truncate_prompt_tokens of 0", {"json": {**good, "truncate_prompt_tokens": 0}},
         400, "truncate_prompt_tokens"),
        ("unknown model", {"json": {**good, "model": "nope"}}, 404, "model"),
        ("body over the limit", {"json": {**good, "prompt": "x" * (BODY_LIMIT + 1)}}, 413,
         None),
    ]
    for name, kwargs, status, param in cases:
        kwargs.setdefault("headers", auth)
        response = httpx.post(url, **kwargs)
        assert response.status_code == status, (name, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, name
        assert error["message"] and error["code"] == status, name
        if param is not None:
            assert error["param"] == param, (name, error)
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = httpx.post(url, json=good, headers=headers)
        assert response.status_code == 401
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(server.url + "/health").status_code == 200  # open without a key
    assert httpx.get(server.url + "/metrics").status_code == 200
    chat = httpx.post(server.url + "/v1/chat/completions", headers=auth,
                      json={"model": MODEL, "messages": []})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
    assert client.completions.create(model=MODEL, prompt="still here", max_tokens=3
                                     ).choices[0].text is not None
    assert_idle(server)



def assert_openai_error(response: httpx.Response, status: int, param: str | None = None
                        ) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert error["message"]
    if param is not None:
        assert error["param"] == param, error


def post_json(url: str, body: dict[str, Any]) -> httpx.Response:
    """POST ``body`` as ASCII JSON, so a lone surrogate travels as ``\\ud800`` (as any
    client can send it)."""
    return httpx.post(url, content=json.dumps(body).encode(),
                      headers={**AUTH, "content-type": "application/json"})


def test_hostile_requests_get_400s_and_the_server_keeps_serving(
        server: ThreadedServer, client: openai.OpenAI) -> None:
    """Each of these once killed the engine, or answered a bare 500 or ``{"detail"}``."""
    url = server.url + "/v1/completions"
    good = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    for body, param in [
        ({**good, "seed": 1180591620717411303424}, "seed"),
        ({**good, "n": 2, "seed": 18446744073709551615}, "seed"),
        ({**good, "max_tokens": 2**63}, "max_tokens"),
        ({**good, "max_tokens": MAX_MODEL_LEN}, "max_tokens"),  # prompt + max_tokens > context
        ({**good, "prompt": "a\ud800b"}, "prompt"),
        ({**good, "n": 50, "logprobs": 20, "max_tokens": 50}, "logprobs"),  # > LOGPROB_ENTRIES
        ({**good, "cache_salt": ""}, "cache_salt"),
    ]:
        assert_openai_error(post_json(url, body), 400, param)
    for body, param in [
        ({"prompt": "hi", "logprobs": 10_000}, "logprobs"),
        ({"prompt": "hi", "prompt_logprobs": 10_000}, "prompt_logprobs"),
        ({"prompt": "hi", "n": 5000}, "n"),
        ({"prompt": "hi", "seed": 2**70}, "seed"),
        ({"prompt": "hi", "output_kind": 1}, "output_kind"),
    ]:
        assert_openai_error(post_json(server.url + "/generate", body), 400, param)
    for body, param in [({"messages": []}, "messages"), ({"prompt": "a\ud800b"}, "prompt")]:
        assert_openai_error(post_json(server.url + "/tokenize", body), 400, param)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "a\ud800b"}]}
    assert_openai_error(post_json(server.url + "/v1/chat/completions", chat), 400,
                        "messages[0].content")
    # Errors raised outside the routes: unknown route, wrong method, a body that does
    # not parse (invalid UTF-8, JSON nested deeper than Python's parser goes).
    assert_openai_error(httpx.get(server.url + "/v2/nothing", headers=AUTH), 404)
    assert_openai_error(httpx.get(url, headers=AUTH), 405)
    json_headers = {**AUTH, "content-type": "application/json"}
    assert_openai_error(httpx.post(url, content=b'{"prompt": "\xff\xfe"}',
                                   headers=json_headers), 400)
    assert_openai_error(httpx.post(url, content=b"[" * 20_000 + b"]" * 20_000,
                                   headers=json_headers), 400)
    # A reply just under the logprob limit is built off the event loop and arrives whole.
    big = httpx.post(url, headers=AUTH, timeout=60, json={
        **good, "n": 20, "logprobs": 20, "max_tokens": 100, "ignore_eos": True})
    assert big.status_code == 200
    assert all(len(c["logprobs"]["tokens"]) == 100 for c in big.json()["choices"])
    assert client.completions.create(model=MODEL, prompt="still here", max_tokens=3
                                     ).choices[0].text is not None
    assert_idle(server)


def test_the_key_guards_every_route_but_health_ping_and_metrics(
        server: ThreadedServer) -> None:
    for method, path in [("POST", "/generate"), ("POST", "/tokenize"), ("POST", "/detokenize"),
                         ("GET", "/version"), ("GET", "/openapi.json"), ("GET", "/v1/models"),
                         ("POST", "/v1/completions"), ("GET", "/v2/nothing")]:
        response = httpx.request(method, server.url + path, json={"prompt": "x"})
        assert_openai_error(response, 401)
    for path in ("/health", "/ping", "/metrics"):
        assert httpx.get(server.url + path).status_code == 200, path
    assert httpx.post(server.url + "/ping").status_code == 200


def test_clients_reusing_one_request_id_do_not_meet(server: ThreadedServer) -> None:
    """Two clients sending the same X-Request-Id at once are both served, each with its
    own answer (the engine knows them by ids of the server's own)."""
    import concurrent.futures

    headers = {**AUTH, "X-Request-Id": "shared-id"}

    def ask(prompt: str) -> httpx.Response:
        return httpx.post(server.url + "/v1/completions", headers=headers, timeout=60, json={
            "model": MODEL, "prompt": prompt, "max_tokens": 20, "temperature": 0,
            "ignore_eos": True, "stream": False})

    prompts = ["The cat sat", "Numbers go one two", "The cat sat", "Rain fell"] * 2
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        replies = list(pool.map(ask, prompts))
    assert [r.status_code for r in replies] == [200] * len(prompts)
    assert all(r.json()["id"] == "shared-id" for r in replies)
    texts = [r.json()["choices"][0]["text"] for r in replies]
    alone = {p: ask(p).json()["choices"][0]["text"] for p in set(prompts)}
    assert texts == [alone[p] for p in prompts]
    assert_idle(server)


def test_tool_calls_are_refused_not_ignored(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "What is the weather?"}]
    tools: Any = [{"type": "function", "function": {
        "name": "weather", "parameters": {"type": "object", "properties": {}}}}]
    refused: list[tuple[dict[str, Any], str]] = [
        ({"tools": tools}, "tool_choice"),  # no tool_choice means "auto", as in vLLM
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tools": []}, "tools"),
    ]
    for kwargs, param in refused:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                           **kwargs)
        assert (caught.value.body or {}).get("param") == param, (kwargs, caught.value.body)
    # what can be served is: plain text, and tools the model is told of but not made to call
    served = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, tools=tools, tool_choice="none",
        response_format={"type": "text"})
    assert served.choices[0].message.content is not None
    assert client.completions.create(
        model=MODEL, prompt="hi", max_tokens=2,
        extra_body={"response_format": {"type": "text"}}).choices

# -- clients that go away ----------------------------------------------------------------

def test_clients_that_disconnect_are_aborted(server: ThreadedServer,
                                             client: openai.OpenAI) -> None:
    """50 streaming and 20 non-streaming clients leave early; nothing stays behind."""
    aborted_before = metric(server, "vllm:request_success_total", finished_reason="abort")
    finished_before = metric(server, "vllm:request_success_total", finished_reason="length")
    body = {"model": MODEL, "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}

    async def streaming_client(i: int, http: httpx.AsyncClient) -> None:
        async with http.stream("POST", server.url + "/v1/completions", headers=headers,
                               json={**body, "prompt": f"stream {i}", "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    break  # read one event, then hang up

    async def impatient_client(i: int, http: httpx.AsyncClient) -> None:
        with pytest.raises(httpx.TimeoutException):
            await http.post(server.url + "/v1/completions", headers=headers,
                            json={**body, "prompt": f"wait {i}"}, timeout=0.3)

    async def main() -> None:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(timeout=60, limits=limits) as http, \
                anyio.create_task_group() as tasks:
            for i in range(50):
                tasks.start_soon(streaming_client, i, http)
            for i in range(20):
                tasks.start_soon(impatient_client, i, http)

    anyio.run(main, backend="trio")
    assert_idle(server)
    aborted = metric(server, "vllm:request_success_total",
                     finished_reason="abort") - aborted_before
    finished = metric(server, "vllm:request_success_total",
                      finished_reason="length") - finished_before
    # each request that reached the engine either ran to its length before its client
    # left or was aborted (an impatient client may leave before its request is added);
    # most are aborted, though on a fast CPU more of the 200 tokens fit in the 0.3 s
    assert aborted + finished <= 70
    assert aborted >= 35
    assert client.completions.create(model=MODEL, prompt="after", max_tokens=3).choices


@pytest.mark.anyio
async def test_impossible_tokens_get_a_finite_logprob(llama_path: Path) -> None:
    """A log-probability of -inf (a token the model rules out) is sent as -9999.0, as
    vLLM does: JSON has no -inf, so it would otherwise fail the response."""
    impossible = 40

    def runner_factory() -> Any:
        from triollm.model.runners.torch_runner import TorchModelRunner

        runner = TorchModelRunner(config)

        def rule_out(module: Any, inputs: Any, logits: Any) -> Any:
            logits[..., impossible] = float("-inf")
            return logits

        runner.model.get_output_embeddings().register_forward_hook(rule_out)
        return runner

    args = AsyncEngineArgs(model=str(llama_path), dtype="float32", max_model_len=64,
                           enforce_eager=True, disable_log_requests=True)
    config = args.create_engine_config()
    engine = AsyncLLMEngine.from_engine_args(args, runner_factory=runner_factory)
    state = ServerState(engine=engine, settings=ServerSettings(served_model_names=("m",)),
                        metrics=PrometheusStatLogger(engine, "m"))
    transport = httpx.ASGITransport(app=build_app(state))
    body = {"model": "m", "prompt": [7, impossible, 9], "max_tokens": 2, "echo": True,
            "logprobs": 1, "temperature": 0}
    async with engine, httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        response = await http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        logprobs = response.json()["choices"][0]["logprobs"]
        assert logprobs["token_logprobs"][1] == -9999.0  # the prompt's impossible token
        assert -9999.0 in logprobs["top_logprobs"][1].values()
        assert all(-9999.0 < lp <= 0 for lp in logprobs["token_logprobs"][2:])
        async with http.stream("POST", "/v1/completions",
                               json={**body, "stream": True}) as stream:
            assert stream.status_code == 200
            events = [json.loads(line[5:]) async for line in stream.aiter_lines()
                      if line.startswith("data:") and line != "data: [DONE]"]
        streamed = [lp for event in events for choice in event["choices"]
                    for lp in (choice["logprobs"] or {}).get("token_logprobs", [])]
        assert streamed[:2] == [None, -9999.0]


def test_tls(tmp_path: Path, llama_path: Path) -> None:
    """--ssl-keyfile / --ssl-certfile: hypercorn serves HTTPS."""
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1"],
                   check=True, capture_output=True)
    args = AsyncEngineArgs(model=str(llama_path), dtype="float32", max_model_len=64,
                           num_gpu_blocks_override=32, disable_log_requests=True)
    engine = AsyncLLMEngine.from_engine_args(args)
    with server_in_thread(engine, ssl_keyfile=str(key), ssl_certfile=str(cert),
                          served_model_names=(MODEL,)) as running:
        assert running.url.startswith("https://")
        response = httpx.post(running.url + "/v1/completions", verify=False,
                              json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert response.status_code == 200 and response.json()["choices"]


@pytest.mark.anyio
async def test_new_requests_get_503_while_the_server_shuts_down() -> None:
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(disable_log_requests=True),
                                             runner_factory=FakeModelRunner)
    state = ServerState(engine=engine, settings=ServerSettings(served_model_names=("demo",)),
                        metrics=PrometheusStatLogger(engine, "demo"), shutting_down=True)
    transport = httpx.ASGITransport(app=build_app(state))
    async with engine, httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        for path, body in (("/v1/completions", {"model": "demo", "prompt": "hi"}),
                           ("/v1/chat/completions", {"model": "demo", "messages": [
                               {"role": "user", "content": "hi"}]}),
                           ("/generate", {"prompt": "hi"})):
            response = await http.post(path, json=body)
            assert response.status_code == 503, path
            assert response.json()["error"]["type"] == "ServiceUnavailableError", path
        assert (await http.get("/health")).status_code == 200  # the engine still runs


@pytest.mark.anyio
async def test_a_stream_the_engine_refuses_is_an_error_reply_not_a_broken_stream() -> None:
    """A streamed request whose prompt the engine refuses (a token outside the
    vocabulary) gets the same 400 as an unstreamed one, before any event, and leaves
    nothing open in the engine."""
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(disable_log_requests=True),
                                             runner_factory=FakeModelRunner)
    state = ServerState(engine=engine, settings=ServerSettings(served_model_names=("demo",)),
                        metrics=PrometheusStatLogger(engine, "demo"))
    transport = httpx.ASGITransport(app=build_app(state))
    refused = [10**9]
    async with engine, httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        for path, body in (("/v1/completions", {"model": "demo", "prompt": [[5, 6], refused]}),
                           ("/v1/completions", {"model": "demo", "prompt": refused}),
                           ("/v1/chat/completions", {"model": "demo", "messages": [
                               {"role": "user", "content": "hi"}], "logit_bias": {
                               str(10**9): 1}})):
            for stream in (False, True):
                response = await http.post(path, json={**body, "stream": stream})
                assert response.status_code == 400, (path, stream, response.text)
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        stats = engine.statistics()
        assert (stats.num_running, stats.num_waiting, stats.num_open_streams) == (0, 0, 0)


# -- browsers ----------------------------------------------------------------------------

def test_cors_by_default_any_origin_even_on_errors(server: ThreadedServer,
                                                   client: openai.OpenAI) -> None:
    """vLLM's defaults: any origin. A preflight needs no API key, and error responses carry
    the CORS headers too, so a browser can read them."""
    origin = {"Origin": "https://app.example"}
    preflight = httpx.options(server.url + "/v1/completions", headers={
        **origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "*"
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    ok = httpx.post(server.url + "/v1/completions", json=body,
                    headers={**origin, "Authorization": f"Bearer {API_KEY}"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "*"
    denied = httpx.post(server.url + "/v1/completions", json=body, headers=origin)
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == "*"
    assert "access-control-allow-origin" not in httpx.get(server.url + "/health").headers


@pytest.mark.anyio
async def test_cors_restricted_to_the_allowed_origins() -> None:
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(disable_log_requests=True),
                                             runner_factory=FakeModelRunner)
    cors = CorsSettings(allowed_origins=("https://app.example",), allow_credentials=True)
    state = ServerState(engine=engine, settings=ServerSettings(
        served_model_names=("demo",), cors=cors), metrics=PrometheusStatLogger(engine, "demo"))
    transport = httpx.ASGITransport(app=build_app(state))
    async with engine, httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        def preflight(origin: str) -> dict[str, str]:
            return {"Origin": origin, "Access-Control-Request-Method": "POST"}

        allowed = await http.options("/v1/completions", headers=preflight("https://app.example"))
        assert allowed.status_code == 200
        assert allowed.headers["access-control-allow-origin"] == "https://app.example"
        assert allowed.headers["access-control-allow-credentials"] == "true"
        refused = await http.options("/v1/completions", headers=preflight("https://evil.example"))
        assert refused.status_code == 400
        assert "access-control-allow-origin" not in refused.headers
        response = await http.post("/v1/completions", json={"model": "demo", "prompt": "hi"},
                                   headers={"Origin": "https://evil.example"})
        assert response.status_code == 200  # CORS is the browser's check, not the server's
        assert "access-control-allow-origin" not in response.headers


def test_a_bug_in_a_route_is_a_logged_openai_500_and_the_server_carries_on(
        server: ThreadedServer, client: openai.OpenAI, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    from triollm.server.routes import tokenize

    def broken(*args: Any, **kwargs: Any) -> str:
        raise RuntimeError("a bug in a route")

    monkeypatch.setattr(tokenize, "decode_text", broken)
    with caplog.at_level(logging.ERROR, logger="triollm.server.errors"):
        response = httpx.post(server.url + "/detokenize", json={"tokens": [5]},
                              headers={**AUTH, "X-Request-Id": "r-9"})
        assert_openai_error(response, 500)
        # Logged by the server's thread once the 500 has gone out.
        deadline = time.monotonic() + 10
        while "a bug in a route" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.01)
    assert "a bug in a route" in caplog.text and "request id r-9" in caplog.text
    assert client.completions.create(model=MODEL, prompt="still here", max_tokens=3
                                     ).choices[0].text is not None


@pytest.mark.anyio
async def test_the_prompts_of_one_completion_enter_the_engine_together() -> None:
    """A list of prompts is one batch: with one token each, they take one or two steps
    between them (added while the first step runs), not one step per prompt."""
    runners: list[FakeModelRunner] = []

    def factory() -> FakeModelRunner:
        runners.append(FakeModelRunner(step_delay=0.01))
        return runners[-1]

    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(disable_log_requests=True),
                                             runner_factory=factory)
    state = ServerState(engine=engine, settings=ServerSettings(served_model_names=("demo",)),
                        metrics=PrometheusStatLogger(engine, "demo"))
    transport = httpx.ASGITransport(app=build_app(state))
    async with engine, httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        response = await http.post("/v1/completions", json={
            "model": "demo", "prompt": [[5, 6], [7, 8, 9], [10], [11, 12]], "max_tokens": 1})
        assert response.status_code == 200, response.text
        assert [c["index"] for c in response.json()["choices"]] == [0, 1, 2, 3]
        steps = [len(step.scheduled) for step in runners[0].computed if step.scheduled]
        assert sum(steps) == 4 and len(steps) <= 2, steps
