"""`triollm serve` as users run it: a subprocess that crashes with its model, or stops
gracefully on SIGTERM."""

from __future__ import annotations

import signal
import threading
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
