"""Tensor parallelism under the async engine and the server: streams carry the same
greedy tokens as one rank; a rank process that is killed or stopped mid-stream fails
every open stream with ``EngineDeadError``, and no rank process or shared-memory
segment is left behind."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest

from helpers import MidStreamFault, fault_a_rank_mid_stream
from server_helpers import server_in_thread
from triollm import AsyncEngineArgs, AsyncLLMEngine, SamplingParams

PROMPT = "the quick brown fox jumps over"
GREEDY = SamplingParams(max_tokens=10, temperature=0.0)


def engine_args(llama_path: Path, **overrides: Any) -> AsyncEngineArgs:
    return AsyncEngineArgs(model=str(llama_path), dtype="float32", max_model_len=256,
                           num_gpu_blocks_override=64, tensor_parallel_size=2,
                           distributed_timeout_seconds=2.0, **overrides)


def rank_processes() -> list[psutil.Process]:
    return [child for child in psutil.Process().children(recursive=True)
            if "rank_worker" in " ".join(child.cmdline())]


def shared_memory_of(pid: int) -> set[str]:
    """The /dev/shm files ``pid`` maps that are still linked (a segment unlinked at once,
    as a POSIX semaphore's, leaves nothing behind)."""
    with open(f"/proc/{pid}/maps", encoding="utf-8") as maps:
        return {line.split()[5] for line in maps
                if "/dev/shm/" in line and not line.rstrip().endswith("(deleted)")}


# each fault once, on each event loop once: a rank process costs seconds to start
@pytest.mark.parametrize(("anyio_backend", "fault"), [("trio", signal.SIGKILL),
                                                      ("asyncio", signal.SIGSTOP)],
                         ids=["trio-killed", "asyncio-stopped"])
async def test_a_rank_that_dies_or_hangs_fails_every_stream(
        llama_path: Path, llama_llm: Any, fault: signal.Signals, anyio_backend: str) -> None:
    want = list(llama_llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)
    engine = AsyncLLMEngine.from_engine_args(engine_args(llama_path))
    shared: set[str] = set()

    def find_rank() -> psutil.Process:
        (rank,) = rank_processes()
        shared.update(shared_memory_of(rank.pid))  # read while it still runs
        return rank

    seen = MidStreamFault()
    await fault_a_rank_mid_stream(engine, PROMPT, GREEDY, find_rank, fault, seen)
    assert seen.tokens == want
    assert sorted(seen.errors) == [0, 1, 2]
    assert engine.errored
    assert not rank_processes()
    assert not shared


def test_the_server_answers_with_two_ranks_as_with_one(llama_path: Path,
                                                       llama_llm: Any) -> None:
    want = llama_llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].text
    engine = AsyncLLMEngine.from_engine_args(engine_args(llama_path,
                                                         disable_log_requests=True))
    with server_in_thread(engine, served_model_names=("tiny",)) as running:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="none", max_retries=0)
        reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10,
                                          temperature=0.0)
        assert reply.choices[0].text == want
        assert len(rank_processes()) == 1
    assert not running.errors, running.errors
    assert not rank_processes()


def test_a_killed_rank_ends_the_served_stream_with_an_error_and_the_server_exits(
        llama_path: Path) -> None:
    import httpx

    from server_helpers import server_process

    with server_process(str(llama_path), "--dtype", "float32", "--max-model-len", "256",
                        "--num-gpu-blocks-override", "64", "--tensor-parallel-size", "2",
                        "--served-model-name", "tiny", "--shutdown-grace", "1") as (
                            process, url):
        (rank,) = [child for child in psutil.Process(process.pid).children(recursive=True)
                   if "rank_worker" in " ".join(child.cmdline())]
        events = []
        with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": PROMPT, "max_tokens": 200, "stream": True,
                "ignore_eos": True}) as response:
            lines = (line for line in response.iter_lines() if line.startswith("data:"))
            events.append(next(lines))
            os.kill(rank.pid, signal.SIGKILL)
            events.extend(lines)
        code = process.wait(30)
    assert '"error"' in events[-2] and events[-1] == "data: [DONE]", events[-3:]
    assert code != 0
    assert not psutil.pid_exists(rank.pid) or rank.status() == psutil.STATUS_ZOMBIE


def test_sigterm_under_load_ends_within_the_grace_and_five_seconds_leaving_no_rank(
        llama_path: Path) -> None:
    """The server with two ranks (its engine in a process of its own, rank 1 that
    process's child) stops on SIGTERM mid-stream within ``--shutdown-grace`` + 5 s, and
    every process it started ends."""
    import time

    import httpx

    from server_helpers import server_process

    grace = 1
    with server_process(str(llama_path), "--dtype", "float32", "--max-model-len", "256",
                        "--num-gpu-blocks-override", "64", "--tensor-parallel-size", "2",
                        "--served-model-name", "tiny", "--shutdown-grace", str(grace)) as (
                            process, url):
        started = psutil.Process(process.pid).children(recursive=True)
        commands = [" ".join(child.cmdline()) for child in started]
        assert any("triollm.engine.process.child" in command for command in commands)
        assert any("rank_worker" in command for command in commands)
        events = []
        with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": PROMPT, "max_tokens": 200, "stream": True,
                "ignore_eos": True}) as response:
            lines = (line for line in response.iter_lines() if line.startswith("data:"))
            events.append(next(lines))
            stopped = time.monotonic()
            process.send_signal(signal.SIGTERM)
            events.extend(lines)
        code = process.wait(grace + 30)
        ended = time.monotonic() - stopped
    assert code == 0
    assert ended < grace + 5, ended
    assert events[-1] == "data: [DONE]", events[-3:]
    assert not [child for child in started
                if child.is_running() and child.status() != psutil.STATUS_ZOMBIE]
