"""`triollm serve` as users run it: a subprocess that crashes with its model, or stops
gracefully on SIGTERM."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from conftest import POISON
from server_helpers import server_process


def test_a_model_crash_ends_every_stream_with_an_error_and_the_process_non_zero(
        poison_model: Path) -> None:
    with server_process(str(poison_model), "--trust-remote-code", "--dtype", "float32",
                        "--max-model-len", "256", "--num-gpu-blocks-override", "256",
                        "--served-model-name", "poison") as (process, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        errors: dict[int, BaseException] = {}
        received = {i: 0 for i in range(3)}
        streaming = threading.Barrier(4)

        def stream(i: int) -> None:
            chunks = client.completions.create(
                model="poison", prompt=[10 + i, 11, 12], max_tokens=200, temperature=0,
                stream=True, extra_body={"ignore_eos": True})
            try:
                for _ in chunks:
                    received[i] += 1
                    if received[i] == 2:
                        streaming.wait(30)
            except openai.APIError as error:
                errors[i] = error

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
        for thread in threads:
            thread.start()
        streaming.wait(60)
        with pytest.raises(openai.APIStatusError):  # the poison request fails too
            client.completions.create(model="poison", prompt=[5, POISON, 6], max_tokens=5)
        for thread in threads:
            thread.join(30)
        assert sorted(errors) == [0, 1, 2], received
        assert all("engine died" in str(e) for e in errors.values()), errors
        assert httpx.get(url + "/health").status_code == 503
        assert process.wait(30) != 0
    assert "poison token reached the model" in process.output  # type: ignore[attr-defined]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_lets_requests_finish_then_exits_zero(llama_path: Path,
                                                            signum: signal.Signals) -> None:
    with server_process(str(llama_path), "--dtype", "float32", "--max-model-len", "256",
                        "--num-gpu-blocks-override", "256") as (process, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        stream = client.completions.create(
            model=str(llama_path), prompt="a long story", max_tokens=200, temperature=0,
            stream=True, extra_body={"ignore_eos": True})
        chunks = [next(iter(stream))]  # the request is in flight
        process.send_signal(signum)
        chunks.extend(stream)  # ... and still runs to its end
        assert chunks[-1].choices[0].finish_reason == "length"
        assert process.wait(30) == 0
    assert "shutting down" in process.output  # type: ignore[attr-defined]


def _stalled_client(url: str, body: bytes) -> socket.socket:
    """A client that sends a streaming request, then never reads: the server's sends
    fill the socket buffers and block."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.connect((host, int(port)))
    client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                   b"Content-Type: application/json\r\n"
                   b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return client


def test_the_grace_ends_every_stream_even_a_client_that_never_reads(
        poison_model: Path) -> None:
    """SIGTERM with a 1 s grace: a stream still running then ends with an error event
    and [DONE], a client that never reads cannot hold the process, and it exits 0."""
    with server_process(str(poison_model), "--trust-remote-code", "--dtype", "float32",
                        "--max-model-len", "512", "--num-gpu-blocks-override", "512",
                        "--served-model-name", "slow", "--shutdown-grace", "1") as (
                            process, url):
        # The poison model fails on token POISON: no request may sample it.
        never_poison = {"logit_bias": {str(POISON): -100}, "ignore_eos": True}
        heavy = json.dumps({"model": "slow", "prompt": [10, 11, 12], "max_tokens": 400,
                            "n": 16, "logprobs": 20, "stream": True, **never_poison})
        stalled = _stalled_client(url, heavy.encode())
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        stream = client.completions.create(
            model="slow", prompt=[20, 21, 22], max_tokens=400, stream=True,
            logit_bias={str(POISON): -100}, extra_body={"ignore_eos": True})
        events = []
        with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                "model": "slow", "prompt": [30, 31], "max_tokens": 400, "stream": True,
                **never_poison}) as raw:
            assert raw.status_code == 200, raw.read()
            lines = raw.iter_lines()
            events.append(next(line for line in lines if line.startswith("data:")))
            next(iter(stream))
            time.sleep(1.0)  # the stalled client's socket buffers fill meanwhile
            stopped = time.monotonic()
            process.send_signal(signal.SIGTERM)
            events.extend(line for line in lines if line.startswith("data:"))
        assert process.wait(15) == 0
        took = time.monotonic() - stopped
        stalled.close()
    assert took < 1 + 5, took
    # The stalled client really held its handler, and only the exit let go of it.
    assert "still stuck" in process.output  # type: ignore[attr-defined]
    error = json.loads(events[-2].removeprefix("data: "))
    assert error["error"]["code"] == 503, events[-3:]
    assert events[-1] == "data: [DONE]"


def test_a_second_stop_signal_ends_the_process_at_once(poison_model: Path) -> None:
    with server_process(str(poison_model), "--trust-remote-code", "--dtype", "float32",
                        "--max-model-len", "512", "--num-gpu-blocks-override", "512",
                        "--served-model-name", "slow", "--shutdown-grace", "60") as (
                            process, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        stream = client.completions.create(
            model="slow", prompt=[20, 21, 22], max_tokens=400, stream=True,
            logit_bias={str(POISON): -100}, extra_body={"ignore_eos": True})
        next(iter(stream))  # a request in flight holds the 60 s grace open
        process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(subprocess.TimeoutExpired):
            process.wait(0.5)  # the first signal waits for the request
        process.send_signal(signal.SIGTERM)
        assert process.wait(5) == 128 + signal.SIGTERM
    assert "received SIGTERM again: exiting now" in process.output  # type: ignore[attr-defined]
