"""The event loop does no work whose size a client controls: while a hostile request is
served or refused, a concurrent ``/health`` probe and a concurrent stream's events keep
coming. Each test holds the worst ``/health`` latency and the worst gap between stream
events during the request to under 100 ms more than the same probe's median before
it: a stream's gap is a model step plus the loop's delay, so the median taken before
the request removes the step (and the box's own load) and leaves what the request
added. A request that had the loop to itself adds about its own duration, seconds."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from server_helpers import ThreadedServer, server_in_thread
from triollm import AsyncEngineArgs, AsyncLLMEngine

MAX_MODEL_LEN = 256
#: What a hostile request may add to a probe's wait (issue 40's bound).
LOOP_DELAY = 0.1
#: A text the test tokenizer needs a second or more to encode (on the loop, a stall).
LONG_TEXT = "hello world " * 25_000
#: A request's own chat template that renders for a few seconds.
SLOW_TEMPLATE = ("{% for i in range(16000) %}{% for j in range(1000) %}{% endfor %}"
                 "{% endfor %}{{ messages[0]['content'] }}")


@pytest.fixture(scope="module")
def server(llama_path: Path) -> Iterator[ThreadedServer]:
    args = AsyncEngineArgs(model=str(llama_path), dtype="float32", max_model_len=MAX_MODEL_LEN,
                           num_gpu_blocks_override=256, disable_log_requests=True)
    engine = AsyncLLMEngine.from_engine_args(args)
    # The /health probe polls every 10 ms from the hostile client's address, faster than
    # one client's share allows (test_client_budget.py): no share here, so that what a
    # probe measures is the loop.
    with server_in_thread(engine, served_model_names=("tiny",),
                          max_request_body_bytes=4 * 1024 * 1024,
                          trust_request_chat_template=True, client_cpu_share=None) as running:
        yield running
    assert not running.errors, running.errors


@dataclass
class Probes:
    """Each ``/health`` call's (start, latency) and each stream event's (time, gap)."""

    health: list[tuple[float, float]] = field(default_factory=list)
    events: list[tuple[float, float]] = field(default_factory=list)

    def worst(self, start: float, end: float) -> tuple[float, float]:
        """The worst health latency and event gap of the probes overlapping a window."""
        health = [latency for begun, latency in self.health if begun + latency >= start
                  and begun <= end]
        gaps = [gap for at, gap in self.events if at >= start and at - gap <= end]
        assert health and gaps, "no probe ran while the hostile request was served"
        return max(health), max(gaps)

    def typical(self, before: float) -> tuple[float, float]:
        """The median health latency and event gap of the probes that ended before."""
        health = sorted(latency for begun, latency in self.health if begun + latency < before)
        gaps = sorted(gap for at, gap in self.events if at < before)
        return health[len(health) // 2], gaps[len(gaps) // 2]


@contextmanager
def probing(url: str) -> Iterator[Probes]:
    """``/health`` every 10 ms and one stream after another, in threads."""
    probes = Probes()
    stop = threading.Event()

    def health() -> None:
        with httpx.Client(timeout=120) as client:
            while not stop.is_set():
                begun = time.perf_counter()
                client.get(url + "/health").raise_for_status()
                probes.health.append((begun, time.perf_counter() - begun))
                time.sleep(0.01)

    def stream() -> None:
        body = {"prompt": "hello", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=120) as client:
            while not stop.is_set():
                last = time.perf_counter()
                with client.stream("POST", url + "/v1/completions", json=body) as reply:
                    for _ in reply.iter_lines():
                        now = time.perf_counter()
                        probes.events.append((now, now - last))
                        last = now
                        if stop.is_set():
                            break

    threads = [threading.Thread(target=health), threading.Thread(target=stream)]
    for thread in threads:
        thread.start()
    try:
        deadline = time.perf_counter() + 60
        while len(probes.events) < 20 or len(probes.health) < 20:
            assert time.perf_counter() < deadline, "the probes did not start"
            time.sleep(0.02)
        yield probes
    finally:
        stop.set()
        for thread in threads:
            thread.join(120)


def served_beside_probes(server: ThreadedServer, path: str, body: dict[str, Any]
                         ) -> httpx.Response:
    """Send the hostile request while probing; assert the loop kept answering."""
    with probing(server.url) as probes:
        start = time.perf_counter()
        reply = httpx.post(server.url + path, json=body, timeout=300)
        end = time.perf_counter()
        time.sleep(0.05)  # let the probes in flight finish
    health, gap = probes.worst(start, end)
    usual_health, usual_gap = probes.typical(start)
    assert health - usual_health < LOOP_DELAY and gap - usual_gap < LOOP_DELAY, (
        f"{path}: /health waited {health:.3f}s (median {usual_health:.3f}s before) and the "
        f"stream {gap:.3f}s (median {usual_gap:.3f}s) while the request took "
        f"{end - start:.3f}s")
    return reply


def test_a_long_prompt_to_tokenize_does_not_stall_the_loop(server: ThreadedServer) -> None:
    reply = served_beside_probes(server, "/tokenize", {"prompt": LONG_TEXT})
    assert reply.status_code == 200
    tokens = reply.json()["tokens"]
    assert reply.json()["count"] == len(tokens) > 100_000
    assert tokens[:7] == httpx.post(server.url + "/tokenize",
                                    json={"prompt": "hello world "}).json()["tokens"]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": LONG_TEXT, "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG_TEXT}],
                              "max_tokens": 1}),
], ids=["completions", "chat"])
def test_a_long_prompt_is_refused_without_stalling_the_loop(
        server: ThreadedServer, path: str, body: dict[str, Any]) -> None:
    reply = served_beside_probes(server, path, body)
    assert reply.status_code == 400
    error = reply.json()["error"]
    # counted from its first characters alone: a client's long prompt costs no more
    assert error["message"].startswith(f"{error['param']}: at least ")
    assert "leave no room to generate" in error["message"]
    assert error["param"] in ("prompt", "messages")


def test_a_long_prompt_truncated_by_the_request_is_served(server: ThreadedServer) -> None:
    reply = httpx.post(server.url + "/v1/completions", timeout=300, json={
        "prompt": LONG_TEXT, "max_tokens": 2, "truncate_prompt_tokens": 20})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] == 20


def test_a_slow_request_chat_template_does_not_stall_the_loop(
        server: ThreadedServer) -> None:
    reply = served_beside_probes(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
        "chat_template": SLOW_TEMPLATE})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] == len(httpx.post(
        server.url + "/tokenize", json={"prompt": "hi", "add_special_tokens": False}
    ).json()["tokens"])


@pytest.mark.parametrize("field,value", [
    ("stop", [f"zq{i}x" for i in range(300_000)]),
    ("stop", ["x" * 20_000]),
    ("bad_words", [f"w{i}" for i in range(5_000)]),
    ("allowed_token_ids", [1] * 100_000),
    ("logit_bias", {str(i): 1.0 for i in range(100_000)}),
])
def test_huge_lists_are_refused_naming_the_field(
        server: ThreadedServer, field: str, value: Any) -> None:
    for path, body in (("/v1/completions", {"prompt": "hello", "max_tokens": 4}),
                       ("/generate", {"prompt": "hello", "max_tokens": 4})):
        reply = httpx.post(server.url + path, json={**body, field: value}, timeout=60)
        assert reply.status_code == 400, (path, reply.text[:200])
        assert reply.json()["error"]["param"] == field, path


def test_stop_strings_at_the_bound_are_served_beside_a_stream(
        server: ThreadedServer) -> None:
    """As many stop strings as the server takes cost the concurrent stream nothing
    noticeable: matching is one automaton step per character, whatever their number."""
    stops = [f"zq{i}x" for i in range(128)]
    reply = served_beside_probes(server, "/v1/completions", {
        "prompt": "hello", "max_tokens": 100, "ignore_eos": True, "stop": stops, "n": 8})
    assert reply.status_code == 200, reply.text
    assert all(c["finish_reason"] == "length" for c in reply.json()["choices"])


def test_detokenize_is_bounded_by_the_context(server: ThreadedServer) -> None:
    reply = httpx.post(server.url + "/detokenize", json={"tokens": [5] * (MAX_MODEL_LEN + 1)})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "tokens"
    reply = httpx.post(server.url + "/detokenize", json={"tokens": [5] * MAX_MODEL_LEN})
    assert reply.status_code == 200 and reply.json()["prompt"]


def test_text_no_tokenizer_can_encode_is_a_400_on_every_route(server: ThreadedServer) -> None:
    """A lone surrogate in a message or a prompt is the client's error, named, never a
    500 (the body is checked before any route, so no text reaches a tokenizer)."""
    headers = {"content-type": "application/json"}
    message = b'[{"role": "user", "content": "a\\ud800b"}]'
    for path, body, param in (
            ("/tokenize", b'{"messages": %b}' % message, "messages[0].content"),
            ("/tokenize", b'{"prompt": "a\\ud800b"}', "prompt"),
            ("/v1/chat/completions", b'{"messages": %b}' % message, "messages[0].content"),
            ("/v1/completions", b'{"prompt": "a\\ud800b"}', "prompt")):
        reply = httpx.post(server.url + path, content=body, headers=headers)
        assert reply.status_code == 400, (path, reply.text)
        assert reply.json()["error"]["param"] == param, path
