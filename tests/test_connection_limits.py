"""What connections may hold, over HTTP against a real server: slow bodies are cut,
requests past the concurrency limit get 503 in OpenAI's shape, idle and half-sent
connections are closed, and the server serves everyone else meanwhile and after."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from server_helpers import ThreadedServer, server_in_thread
from triollm import AsyncEngineArgs, AsyncLLMEngine
from triollm.cli import build_parser, server_options_from_namespace
from triollm.server.serve import ServerOptions
from triollm.testing import FakeModelRunner

BODY_TIMEOUT = 1.0
#: A slow client trickles for at most this long before it gives up (the old server held
#: such connections for as long as bytes kept coming).
GIVE_UP = 20 * BODY_TIMEOUT


def server_options(*flags: str) -> dict[str, Any]:
    """The connection fields of ``ServerOptions`` as ``triollm serve FLAGS`` sets them."""
    options = server_options_from_namespace(build_parser().parse_args(["serve", *flags]))
    names = ("limit_concurrency", "body_read_timeout", "keep_alive_timeout",
             "h11_max_incomplete_event_size", "h11_max_header_count")
    return {name: getattr(options, name) for name in names}


@pytest.fixture
def engine() -> AsyncLLMEngine:
    return AsyncLLMEngine.from_engine_args(AsyncEngineArgs(disable_log_requests=True),
                                           runner_factory=FakeModelRunner)


@pytest.fixture
def server(engine: AsyncLLMEngine, request: pytest.FixtureRequest) -> Iterator[ThreadedServer]:
    with server_in_thread(engine, served_model_names=("demo",),
                          **server_options(*request.param)) as running:
        yield running
    assert not running.errors, running.errors


def open_request(url: str, *, content_length: int = 10**6,
                 extra_headers: bytes = b"") -> socket.socket:
    """A connection that has sent a POST's headers and none of its body."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    client = socket.create_connection((host, int(port)))
    client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                   b"Content-Type: application/json\r\n" + extra_headers +
                   b"Content-Length: " + str(content_length).encode() + b"\r\n\r\n")
    return client


def trickle(url: str, interval: float) -> tuple[bytes, float]:
    """Send a body a byte every ``interval`` seconds until the server answers or closes,
    or ``GIVE_UP`` passes; what the server sent and the seconds the connection lasted."""
    client = open_request(url)
    client.settimeout(interval)
    started = time.monotonic()
    reply = b""
    try:
        while time.monotonic() - started < GIVE_UP:
            try:
                client.sendall(b" ")
            except OSError:
                break
            try:
                chunk = client.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if not chunk:
                break
            reply += chunk
    finally:
        client.close()
    return reply, time.monotonic() - started


def stream_completes(url: str) -> bool:
    """Whether a streamed completion sends events and ends with [DONE]."""
    events, done = 0, False
    with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
            "model": "demo", "prompt": "hi", "max_tokens": 16, "ignore_eos": True,
            "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            events += line.startswith("data: {")
            done = done or line == "data: [DONE]"
    return events > 0 and done


def complete(url: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=60,
                      json={"model": "demo", "prompt": "hi", "max_tokens": 2})


def status_and_body(reply: bytes) -> tuple[int, dict[str, Any], bytes]:
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body), head.lower()


@pytest.mark.parametrize("server", [("--body-read-timeout", str(BODY_TIMEOUT),
                                     "--limit-concurrency", "0")], indirect=True)
def test_slow_bodies_are_cut_after_the_timeout_while_others_are_served(
        server: ThreadedServer) -> None:
    with concurrent.futures.ThreadPoolExecutor(40) as pool:
        slow = [pool.submit(trickle, server.url, 0.25) for _ in range(32)]
        assert httpx.get(server.url + "/health").status_code == 200
        assert stream_completes(server.url)
        results = [future.result() for future in slow]
    for reply, lasted in results:
        status, body, head = status_and_body(reply)
        assert status == 408 and body["error"]["code"] == 408, reply
        assert b"connection: close" in head
        assert lasted < GIVE_UP
    assert stream_completes(server.url)


@pytest.mark.parametrize("server", [("--limit-concurrency", "4", "--body-read-timeout", "300",
                                     "--h11-max-header-count", "16")], indirect=True)
def test_requests_past_the_limit_get_503_and_the_server_recovers(
        server: ThreadedServer) -> None:
    holding = [open_request(server.url) for _ in range(4)]
    try:
        for _ in range(200):  # until the server has read all four requests' headers
            if complete(server.url).status_code == 503:
                break
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            refused = list(pool.map(lambda _: complete(server.url), range(64)))
        for response in refused:
            assert response.status_code == 503
            assert response.json()["error"]["type"] == "ServiceUnavailableError"
            assert response.headers["connection"] == "close"
        assert httpx.get(server.url + "/health").status_code == 200  # never counted
    finally:
        for client in holding:
            client.close()
    for _ in range(100):  # the slots free as the server sees each client gone
        response = complete(server.url)
        if response.status_code == 200:
            break
        time.sleep(0.05)
    assert response.status_code == 200
    assert stream_completes(server.url)


@pytest.mark.parametrize("server", [("--h11-max-header-count", "16",
                                     "--timeout-keep-alive", "0.5")], indirect=True)
def test_too_many_headers_get_431_and_idle_connections_are_closed(
        server: ThreadedServer) -> None:
    many = b"".join(b"X-%d: y\r\n" % i for i in range(20))
    client = open_request(server.url, content_length=0, extra_headers=many)
    client.settimeout(30)
    reply = b""
    while chunk := client.recv(65536):
        reply += chunk
    client.close()
    status, body, _ = status_and_body(reply)
    assert status == 431 and body["error"]["code"] == 431
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    half_sent = socket.create_connection((host, int(port)))
    half_sent.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    half_sent.settimeout(30)
    assert half_sent.recv(1) == b""  # closed by the server
    half_sent.close()


def test_keep_alive_comes_from_vllms_variable_unless_the_flag_is_given(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "7")
    assert server_options()["keep_alive_timeout"] == 7
    assert server_options("--timeout-keep-alive", "2")["keep_alive_timeout"] == 2
    monkeypatch.delenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE")
    defaults = server_options()
    assert defaults == {name: getattr(ServerOptions(), name) for name in defaults}
    unlimited = server_options("--limit-concurrency", "0", "--body-read-timeout", "0")
    assert (unlimited["limit_concurrency"], unlimited["body_read_timeout"]) == (None, None)
