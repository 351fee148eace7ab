"""Inputs that once reached code that could not encode them, or wrote the log in full:
over HTTP against the real server, every one is answered in OpenAI's shape (a 4xx), and
what one request writes to the log is bounded whatever it sends.
"""

from __future__ import annotations

import json
import logging
import pickle
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from server_helpers import ThreadedServer, server_in_thread
from triollm import AsyncEngineArgs, AsyncLLMEngine
from triollm.log_text import MAX_LOGGED_CHARS, clipped, clipped_names
from triollm.server.body_text import LARGE_BODY_BYTES, body_problem, lone_surrogate_field
from triollm.server.tokenizer_process import TokenizerProcess
from triollm.testing import FakeModelRunner


@pytest.fixture(scope="module")
def server() -> Iterator[ThreadedServer]:
    args = AsyncEngineArgs(max_model_len=128, max_num_seqs=16, num_gpu_blocks_override=256,
                           enable_log_requests=True, max_log_len=50)
    engine = AsyncLLMEngine.from_engine_args(
        args, runner_factory=lambda: FakeModelRunner(num_kv_blocks=256, vocab_size=900))
    with server_in_thread(engine, served_model_names=("m",),
                          h11_max_incomplete_event_size=64 * 1024) as running:
        yield running
    assert not running.errors, running.errors


def assert_openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["message"]
    return error


COMPLETION = '"model":"m","prompt":"hi","max_tokens":2'
CHAT = '"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":2'
SURROGATE = "\\ud800"  # as JSON spells it


@pytest.mark.parametrize(("route", "body", "param"), [
    ("/v1/completions", f'{{"model":"{SURROGATE}","prompt":"hi"}}', "model"),
    ("/v1/completions", f'{{{COMPLETION},"request_id":"{SURROGATE}"}}', "request_id"),
    ("/v1/completions", f'{{{COMPLETION},"request_id":"{SURROGATE}","stream":true}}',
     "request_id"),
    ("/v1/chat/completions", f'{{{CHAT},"request_id":"x{SURROGATE}"}}', "request_id"),
    ("/v1/chat/completions", f'{{{CHAT},"user":"{SURROGATE}"}}', "user"),
    ("/v1/chat/completions",
     f'{{"model":"m","messages":[{{"role":"user","content":"{SURROGATE}"}}]}}',
     "messages[0].content"),
    ("/v1/completions", f'{{{COMPLETION},"stop":["a","\\udfff"]}}', "stop[1]"),
    ("/v1/completions", f'{{{COMPLETION},"logit_bias":{{"{SURROGATE}":1}}}}',
     "logit_bias.\\ud800"),
    ("/v1/completions", f'{{{COMPLETION},"{SURROGATE}":1}}', "\\ud800"),
    ("/v1/responses", f'{{"model":"m","input":"a","request_id":"{SURROGATE}"}}',
     "request_id"),
    ("/tokenize", f'{{"model":"m","prompt":"{SURROGATE}"}}', "prompt"),
    ("/detokenize", f'{{"model":"{SURROGATE}","tokens":[1]}}', "model"),
    ("/v1/embeddings", f'{{"model":"{SURROGATE}","input":"a"}}', "model"),
])
def test_a_lone_surrogate_anywhere_in_a_body_is_a_400_naming_the_field(
        server: ThreadedServer, route: str, body: str, param: str) -> None:
    response = httpx.post(server.url + route, content=body.encode(),
                          headers={"content-type": "application/json"}, timeout=30)
    error = assert_openai_error(response, 400)
    assert error["param"] == param
    assert "not valid Unicode" in error["message"]


def test_a_surrogate_pair_is_text_and_is_served(server: ThreadedServer) -> None:
    # "\ud83d\ude00" is one emoji as ASCII-only JSON spells it: valid, not refused.
    body = f'{{{COMPLETION},"request_id":"\\ud83d\\ude00","stop":["\\\\ud800"]}}'
    response = httpx.post(server.url + "/v1/completions", content=body.encode(),
                          headers={"content-type": "application/json"}, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["id"] == "\U0001f600"


def test_a_request_id_header_that_is_not_utf8_is_served(server: ThreadedServer) -> None:
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 2}).encode()
    reply = raw_exchange(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                         b"X-Request-Id: \xff\xfe\x80\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    assert reply.startswith(b"HTTP/1.1 200")


def raw_exchange(server: ThreadedServer, request: bytes) -> bytes:
    """Send raw bytes; the reply up to its end or the server's close."""
    host, port = server.url.rsplit("//", 1)[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as connection:
        connection.sendall(request)
        reply = b""
        while True:
            head, _, rest = reply.partition(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), None)
            if length is not None and len(rest) >= length:
                return reply
            chunk = connection.recv(65536)
            if not chunk:
                return reply
            reply += chunk


@pytest.mark.parametrize(("request_bytes", "status"), [
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"y" * 200_000 + b"\r\n\r\n", 431),
    (b"NOT HTTP AT ALL\r\n\r\n", 400),
])
def test_hypercorns_own_refusals_are_json_in_openais_shape(
        server: ThreadedServer, request_bytes: bytes, status: int) -> None:
    reply = raw_exchange(server, request_bytes)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status}".encode())
    assert b"content-type: application/json" in head.lower()
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status


def log_text(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(record.getMessage() for record in caplog.records)


def test_one_request_writes_a_bounded_amount_to_the_log(
        server: ThreadedServer, caplog: pytest.LogCaptureFixture) -> None:
    # ~4 MB of unknown field names, a 1 MB id, as many stop strings as a request may
    # carry: each logged value is clipped and the names counted, so the log grows by
    # kilobytes, not megabytes.
    body: dict[str, Any] = {f"unknown_{i:06d}_" + "x" * 40: 1 for i in range(80_000)}
    body.update(model="m", prompt="hi " * 30, max_tokens=2, request_id="r" * 1_000_000,
                stop=[f"stop{i:03d}" + "s" * 20 for i in range(128)])
    content = json.dumps(body).encode()
    with caplog.at_level(logging.INFO):
        response = httpx.post(server.url + "/v1/completions", content=content,
                              headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == 200, response.text[:300]
    logged = log_text(caplog)
    assert "ignored" in logged and "and 79980 more" in logged
    assert "Received request" in logged and "Finished request" in logged
    assert len(logged) < 20_000 < len(content) // 100


def test_a_failing_route_logs_a_clipped_request_id(
        server: ThreadedServer, caplog: pytest.LogCaptureFixture) -> None:
    # X-Request-Id is what error lines name before a route picks an id.
    with caplog.at_level(logging.INFO):
        response = httpx.post(server.url + "/v1/completions", content=b"{",
                              headers={"content-type": "application/json",
                                       "x-request-id": "h" * 10_000}, timeout=30)
    assert_openai_error(response, 400)
    assert "h" * (MAX_LOGGED_CHARS + 1) not in log_text(caplog)


def test_clipped_values_are_short_and_encodable() -> None:
    assert clipped("abc") == "abc"
    long = clipped("a" * 1000)
    assert long.startswith("a" * MAX_LOGGED_CHARS) and "1000 characters" in long
    assert len(long) < MAX_LOGGED_CHARS + 30
    assert clipped("x\ud800").encode("utf-8") == b"x\\ud800"
    names = clipped_names({f"n{i:03d}" for i in range(100)}, limit=3)
    assert names == "['n000', 'n001', 'n002'] and 97 more"
    assert clipped_names(["b", "a"]) == "['a', 'b']"


@pytest.mark.parametrize(("body", "field"), [
    (b'{"a":"ok"}', None),
    (b'{"a":"\\ud83d\\ude00"}', None),  # a pair is one character
    (b'{"a":"\\\\ud800"}', None),  # an escaped backslash, then text
    (b'{"a":"\\ud800"}', "a"),
    (b'{"a":"\\ude00"}', "a"),
    (b'{"a":["x",{"b":"\\ud800x"}]}', "a[1].b"),
    (b'"\\udbff"', "body"),
    (b'{"a":"\\ud800', None),  # not JSON: FastAPI answers it
    (b"[" * 20_000 + b'"\\ud800"' + b"]" * 20_000, None),  # nested past the parser
])
def test_lone_surrogates_are_found_where_they_are(body: bytes, field: str | None) -> None:
    assert lone_surrogate_field(body) == field


def test_a_large_bodys_checks_run_in_the_tokenizer_process() -> None:
    """The worker process loads body_text.py by itself (standard library only) and
    answers as the server would in-process."""
    body = json.dumps({"prompt": "hi", "stop": [f"s{i}" for i in range(300)],
                       "pad": "x" * LARGE_BODY_BYTES}).encode()
    surrogate = b'{"prompt": "hi", "pad": "' + b"x" * LARGE_BODY_BYTES + b'", "user": "\\ud800"}'
    fine = json.dumps({"prompt": "hi", "stop": ["a"], "pad": "x" * LARGE_BODY_BYTES}).encode()
    worker = TokenizerProcess(pickle.dumps(None))
    try:
        for checked in (body, surrogate, fine):
            _, data = worker.call("check_body", checked, 128, 4096)
            expected = body_problem(checked, 128, 4096)
            assert json.loads(data) == (None if expected is None else list(expected))
        assert body_problem(body, 128, 4096) == (
            "stop", "stop: at most 128 strings of 4096 characters in all; got 300 strings")
        assert body_problem(surrogate, 128, 4096) is not None
        assert body_problem(fine, 128, 4096) is None
    finally:
        worker.close()
