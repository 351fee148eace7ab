"""What the server writes to its log, read as an operator reads it: one start-up line,
one access-log line per request at its end (status, duration, tokens), and the stats
line only while there is work."""

from __future__ import annotations

import json
import logging
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from server_helpers import ThreadedServer, server_in_thread, server_process
from triollm import AsyncEngineArgs, AsyncLLMEngine
from triollm.engine.stats import EngineStatistics, IterationStats, LoggingStatLogger
from triollm.log_text import MAX_LOGGED_CHARS

MODEL = "tiny"
ACCESS = "triollm.server.access_log"
STATS = "triollm.engine.stats"
#: The stats interval of the servers here: many lines within a request's lifetime.
INTERVAL = 0.02
#: The access line's shape (a request with tokens also names them).
LINE = re.compile(r'(\S+) "(\S+) (\S+) HTTP/1\.1" (\d+|-) (\d+\.\d{3})s'
                  r'(?: prompt_tokens=(\d+) completion_tokens=(\d+))?( disconnected)?')


def make_engine(llama_path: Path, **args: object) -> AsyncLLMEngine:
    return AsyncLLMEngine.from_engine_args(AsyncEngineArgs(
        model=str(llama_path), dtype="float32", max_model_len=256,
        num_gpu_blocks_override=64, **args))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def server(llama_path: Path) -> Iterator[ThreadedServer]:
    with server_in_thread(make_engine(llama_path), served_model_names=(MODEL,),
                          access_log=True, access_log_excluded_paths=("/metrics",),
                          log_stats_interval=None) as running:
        yield running
    assert not running.errors, running.errors


def wait_for(caplog: pytest.LogCaptureFixture, found: Callable[[list[logging.LogRecord]], bool],
             timeout: float = 60.0) -> list[logging.LogRecord]:
    """The records captured so far, once ``found`` holds for them."""
    deadline = time.monotonic() + timeout
    while not found(list(caplog.records)):
        assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
        time.sleep(0.01)
    return list(caplog.records)


def access_lines(caplog: pytest.LogCaptureFixture, tag: str,
                 barrier: str | None = None) -> list[re.Match[str]]:
    """The access lines of requests whose target has ``tag``; with ``barrier``, once the
    line of a later request tagged so is written (so that no line of the first can still
    come)."""
    def lines(records: list[logging.LogRecord], marker: str) -> list[re.Match[str]]:
        return [m for r in records if r.name == ACCESS
                and (m := LINE.fullmatch(r.getMessage()))
                and m.group(3).partition("?t=")[2] == marker]

    wait_for(caplog, lambda records: bool(lines(records, tag)))
    if barrier is not None:
        wait_for(caplog, lambda records: bool(lines(records, barrier)))
    return lines(list(caplog.records), tag)


def completion(server: ThreadedServer, tag: str, **body: object) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions?t={tag}", timeout=60, json={
        "model": MODEL, "prompt": "The rain in Spain", "max_tokens": 6,
        "ignore_eos": True, **body})


# -- the access log -----------------------------------------------------------------------


def test_a_request_gets_one_access_line_with_its_status_duration_and_tokens(
        server: ThreadedServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS)
    usage = completion(server, "plain").json()["usage"]
    httpx.get(server.url + "/health?t=barrier-plain")
    [line] = access_lines(caplog, "plain", "barrier-plain")
    client, method, _, status, duration, prompt, generated, gone = line.groups()
    assert client.startswith("127.0.0.1:") and method == "POST" and status == "200"
    assert (int(prompt), int(generated)) == (usage["prompt_tokens"],
                                             usage["completion_tokens"]) == (
        usage["prompt_tokens"], 6)
    assert float(duration) > 0 and gone is None


def test_a_stream_gets_one_access_line_after_its_last_byte(
        server: ThreadedServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS)
    events: list[str] = []
    with httpx.stream("POST", f"{server.url}/v1/completions?t=stream", timeout=60, json={
            "model": MODEL, "prompt": "The rain in Spain", "max_tokens": 8, "n": 2,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    usage = json.loads(events[-2])["usage"]
    httpx.get(server.url + "/health?t=barrier-stream")
    [line] = access_lines(caplog, "stream", "barrier-stream")
    # Written at the end: the completion tokens are known only after the last event.
    assert line.group(4) == "200" and line.group(8) is None
    assert (int(line.group(6)), int(line.group(7))) == (
        usage["prompt_tokens"], usage["completion_tokens"]) == (usage["prompt_tokens"], 16)


def test_a_client_gone_mid_stream_gets_one_line_marked_disconnected(
        server: ThreadedServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS)
    with httpx.stream("POST", f"{server.url}/v1/chat/completions?t=gone", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 200, "ignore_eos": True, "stream": True}) as response:
        lines = response.iter_lines()
        while not next(lines).startswith("data: "):
            pass
    [line] = access_lines(caplog, "gone")
    httpx.get(server.url + "/health?t=barrier-gone")
    assert [m.group() for m in access_lines(caplog, "gone", "barrier-gone")] == [line.group()]
    assert line.group(4) == "200" and line.group(8) == " disconnected"
    assert int(line.group(6)) > 0 and 0 < int(line.group(7)) < 200


@pytest.mark.parametrize("stream", [False, True], ids=["reply", "stream"])
def test_a_generate_request_with_samples_counts_each_samples_tokens_once(
        stream: bool, server: ThreadedServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS)
    tag = f"generate-{stream}"
    reply = httpx.post(f"{server.url}/generate?t={tag}", timeout=60, json={
        "prompt": "The rain in Spain", "max_tokens": 5, "n": 2, "ignore_eos": True,
        "stream": stream})
    assert reply.status_code == 200, reply.text
    [line] = access_lines(caplog, tag)
    assert line.group(4) == "200" and int(line.group(6)) > 0 and line.group(7) == "10"


def test_an_embedding_request_line_counts_its_prompt_tokens(
        pooling_models: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS)
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(
        model=str(pooling_models["bert"]), dtype="float32"))
    with server_in_thread(engine, served_model_names=("embedder",), access_log=True) as server:
        usage = httpx.post(server.url + "/v1/embeddings?t=embed", timeout=60, json={
            "model": "embedder", "input": ["one text", "and another one"]}).json()["usage"]
        [line] = access_lines(caplog, "embed")
    assert line.group(4) == "200" and usage["prompt_tokens"] > 2
    assert (int(line.group(6)), int(line.group(7))) == (usage["prompt_tokens"], 0)


def test_a_request_without_tokens_has_none_on_its_line(
        server: ThreadedServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS)
    assert completion(server, "unknown-model", model="nope").status_code == 404
    httpx.get(server.url + "/health?t=no-tokens")
    [refused] = access_lines(caplog, "unknown-model")
    [health] = access_lines(caplog, "no-tokens")
    assert refused.group(4) == "404" and health.group(4) == "200"
    assert refused.group(6) is None and health.group(6) is None


def test_endpoints_left_out_of_the_access_log_write_no_line(
        server: ThreadedServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS)
    httpx.get(server.url + "/metrics?t=left-out")
    httpx.get(server.url + "/health?t=after-left-out")
    access_lines(caplog, "after-left-out")
    assert not [r for r in caplog.records if "left-out" in r.getMessage()
                and "after" not in r.getMessage()]


def test_a_client_cannot_write_unbounded_or_forged_text_to_the_access_log(
        server: ThreadedServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS)
    path = "/forged%0AINFO%20fake" + "x" * 10_000
    httpx.get(server.url + path + "?t=long")
    [record] = wait_for(caplog, lambda records: any(
        "forged" in r.getMessage() for r in records))[-1:]
    message = record.getMessage()
    assert "\n" not in message and "%0AINFO%20fake" in message
    assert len(message) < 2 * MAX_LOGGED_CHARS and "characters)" in message


# -- the stats line -----------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def statistics(running: int = 0, waiting: int = 0) -> EngineStatistics:
    return EngineStatistics(num_running=running, num_waiting=waiting, num_free_blocks=8,
                            num_total_blocks=8, num_open_streams=running + waiting,
                            num_preemptions=0, num_steps=0)


def test_the_stats_line_is_at_info_only_while_there_is_work_and_once_after(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    stats_line = LoggingStatLogger("CPU", clock=clock)
    caplog.set_level(logging.DEBUG, logger=STATS)

    def interval(tokens: int = 0, running: int = 0, waiting: int = 0) -> int:
        clock.now += 10.0
        stats_line.record(IterationStats(num_generation_tokens=tokens))
        caplog.clear()
        stats_line.log(statistics(running, waiting))
        [record] = caplog.records
        return record.levelno

    assert [interval() for _ in range(3)] == [logging.DEBUG] * 3  # idle
    assert interval(waiting=1) == logging.INFO  # a request waits, no token yet
    assert interval(tokens=5, running=1) == logging.INFO
    assert interval(tokens=3) == logging.INFO  # finished within the interval
    assert interval() == logging.INFO  # the last line: throughput falls to zero
    assert "generation throughput: 0.0 tokens/s" in caplog.records[0].getMessage()
    assert [interval() for _ in range(3)] == [logging.DEBUG] * 3


def stats_records(records: list[logging.LogRecord]) -> list[logging.LogRecord]:
    return [r for r in records if r.name == STATS]


def test_a_served_engine_logs_no_stats_line_while_idle_and_lines_while_busy(
        llama_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=STATS)
    with server_in_thread(make_engine(llama_path), served_model_names=(MODEL,),
                          log_stats_interval=INTERVAL) as server:
        idle = wait_for(caplog, lambda records: len(stats_records(records)) >= 5)
        assert {r.levelno for r in stats_records(idle)} == {logging.DEBUG}
        caplog.clear()
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": "hi", "max_tokens": 200, "ignore_eos": True,
                "stream": True}) as response:
            lines = response.iter_lines()
            busy = wait_for(caplog, lambda records: any(
                "Running: 1 reqs" in r.getMessage() for r in stats_records(records)))
            assert all(r.levelno == logging.INFO for r in stats_records(busy)
                       if "Running: 1 reqs" in r.getMessage())
            for _ in lines:
                pass

        def idle_again(records: list[logging.LogRecord]) -> bool:
            levels = [r.levelno for r in stats_records(records)]
            return levels[-3:] == [logging.DEBUG] * 3 and logging.INFO in levels

        records = stats_records(wait_for(caplog, idle_again))
    # Busy, the lines are at info without a gap; the last of them, once the request
    # ended, says the throughput fell to zero; then idle lines at debug.
    levels = [r.levelno for r in records]
    first = levels.index(logging.INFO)
    last = len(levels) - 1 - levels[::-1].index(logging.INFO)
    assert set(levels[first:last + 1]) == {logging.INFO}, levels
    assert set(levels[last + 1:]) == {logging.DEBUG}, levels
    final = records[last].getMessage()
    assert "Running: 0 reqs" in final and "generation throughput: 0.0" in final, final


def test_disable_log_stats_silences_the_stats_line(llama_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=STATS)
    with server_in_thread(make_engine(llama_path, disable_log_stats=True),
                          served_model_names=(MODEL,), log_stats_interval=INTERVAL) as server:
        httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "hi", "max_tokens": 20, "ignore_eos": True})
        started = time.monotonic()
        while time.monotonic() < started + 20 * INTERVAL:  # many intervals, still silent
            httpx.get(server.url + "/health")
    assert not stats_records(list(caplog.records))


# -- triollm serve ------------------------------------------------------------------------


def test_triollm_serve_writes_one_start_line_and_one_access_line_per_request_in_one_format(
        llama_path: Path, tmp_path: Path) -> None:
    """In the format of ``VLLM_LOGGING_CONFIG_PATH``'s config, which the engine's own
    process applies whole (a logger of its own with its own format included)."""
    config = tmp_path / "logging.json"
    line_format = "%(levelname)s %(asctime)s [{}] %(name)s: %(message)s"
    config.write_text(json.dumps({
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"root": {"format": line_format.format("cfg")},
                       "runners": {"format": line_format.format("cfg runners")}},
        "handlers": {name: {"class": "logging.StreamHandler", "formatter": name,
                            "stream": "ext://sys.stdout"} for name in ("root", "runners")},
        "loggers": {"triollm.model.runners": {"handlers": ["runners"], "propagate": False}},
        "root": {"level": "INFO", "handlers": ["root"]}}))
    with server_process(str(llama_path), "--dtype", "float32", "--max-model-len", "256",
                        "--num-gpu-blocks-override", "64", "--served-model-name", MODEL,
                        "--disable-access-log-for-endpoints", "/metrics,/ping",
                        env={"VLLM_LOGGING_CONFIG_PATH": str(config)}
                        ) as (process, url):
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "ignore_eos": True}
        httpx.post(url + "/v1/completions?t=plain", json=body, timeout=60)
        with httpx.stream("POST", url + "/v1/completions?t=stream", timeout=60,
                          json={**body, "stream": True}) as response:
            list(response.iter_lines())
        with httpx.stream("POST", url + "/v1/completions?t=gone", timeout=60,
                          json={**body, "max_tokens": 200, "stream": True}) as response:
            next(response.iter_lines())
        httpx.get(url + "/ping")
        httpx.get(url + "/metrics")
        process.send_signal(signal.SIGTERM)  # the requests in flight end first
        assert process.wait(30) == 0
    # transformers' progress bars, while the weights load, are not log lines.
    lines = [line for line in process.output.splitlines()  # type: ignore[attr-defined]
             if line and not re.search(r"\d+%\|.*\| *\d+/\d+ \[", line)]
    assert all(re.match(r"(DEBUG|INFO|WARNING|ERROR|CRITICAL) \d{4}-\d\d-\d\d .* \[cfg",
                        line) for line in lines), lines
    # a line of the engine process's
    assert any("[cfg runners] triollm.model.runners: engine ready" in line for line in lines)
    assert len([line for line in lines if re.search(r"Running on|serving .* at", line)]) == 1
    access = [LINE.search(line) for line in lines if "access_log" in line]
    tagged = {m.group(3).partition("?t=")[2]: m for m in access if m is not None}
    assert len(access) == len(tagged) == 3, lines  # /ping and /metrics left out
    assert [tagged[t].group(4, 7) for t in ("plain", "stream")] == [("200", "4")] * 2
    assert tagged["plain"].group(6) == tagged["stream"].group(6) != "0"
    assert tagged["gone"].group(4) == "200" and tagged["gone"].group(8) == " disconnected"
