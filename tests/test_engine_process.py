"""The engine in processes of its own (engine/process/): the balancer, the framing, a
data-parallel server's outputs and metrics, and what happens when an engine process
dies (SIGTERM under load: tests/test_tensor_parallel_faults.py)."""

from __future__ import annotations

import json
import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import psutil
import pytest
from hypothesis import given
from hypothesis import strategies as st

from server_helpers import server_in_thread, server_process
from triollm import AsyncEngineArgs, SamplingParams
from triollm.engine.process.balance import choose_replica
from triollm.engine.process.client import EngineClient, replica_cores
from triollm.engine.process.launch import PrestartedEngines, stop_engine_process
from triollm.engine.process.protocol import FrameReader, frame
from triollm.errors import EngineDeadError

ENGINE_ARGS = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=256,
                   optimization_level=0)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18], [19, 20, 21, 22]]


# -- pure parts -------------------------------------------------------------------------

@given(st.lists(st.integers(0, 5), min_size=1, max_size=6), st.integers(-1, 10))
def test_the_balancer_picks_a_least_loaded_replica_taking_equals_in_turn(
        loads: list[int], after: int) -> None:
    chosen = choose_replica(loads, after)
    assert loads[chosen] == min(loads)
    # no replica just after the previous choice (in turn) is as lightly loaded
    skipped = [(after + step) % len(loads) for step in range(1, len(loads))]
    skipped = skipped[:skipped.index(chosen)] if chosen in skipped else skipped
    assert all(loads[index] > min(loads) for index in skipped)


@given(st.lists(st.integers(0, 3), min_size=2, max_size=4))
def test_equal_replicas_take_requests_in_turn_and_stay_within_one_of_each_other(
        start: list[int]) -> None:
    loads = list(start)
    after = -1
    for _ in range(12):
        after = choose_replica(loads, after)
        loads[after] += 1
    assert max(loads) - min(loads) <= max(max(start) - min(start), 1)


@given(st.integers(1, 6), st.integers(1, 16))
def test_each_replica_gets_its_own_cores_while_there_are_enough(count: int,
                                                                cores: int) -> None:
    shares = replica_cores(count, range(cores))
    assert len(shares) == count
    if count == 1:
        assert shares == [None]
        return
    assert all(share for share in shares)
    if cores >= count:
        assert sorted(c for share in shares for c in share or ()) == list(range(cores))
        sizes = [len(share or ()) for share in shares]
        assert max(sizes) - min(sizes) <= 1


@given(st.lists(st.binary(max_size=300), max_size=5), st.lists(st.integers(1, 64),
                                                                  min_size=1))
def test_frames_cut_anywhere_come_out_whole_and_in_order(messages: list[bytes],
                                                         cuts: list[int]) -> None:
    data = b"".join(frame(message) for message in messages)
    reader = FrameReader()
    received: list[object] = []
    position = 0
    for size in cuts * (len(data) // max(sum(cuts), 1) + 1):
        received.extend(reader.feed(data[position:position + size]))
        position += size
    received.extend(reader.feed(data[position:]))
    assert received == messages


def test_offline_llm_and_the_in_process_engine_refuse_data_parallelism() -> None:
    from triollm import LLM, AsyncLLMEngine

    with pytest.raises(ValueError, match="data_parallel_size: LLM runs one engine"):
        LLM(data_parallel_size=2)
    with pytest.raises(ValueError, match="data_parallel_size: AsyncLLMEngine runs one"):
        AsyncLLMEngine.from_engine_args(AsyncEngineArgs(data_parallel_size=2))
    with pytest.raises(ValueError, match="data_parallel_size: must be a positive"):
        AsyncEngineArgs(data_parallel_size=0).create_engine_config()


# -- the client on both event loops ----------------------------------------------------

@pytest.mark.anyio
async def test_the_client_streams_aborts_and_then_stops_its_engine_process(
        llama_path: Path) -> None:
    """The client takes the process started ahead of it (as ``triollm serve`` does)."""
    with PrestartedEngines([None]) as prestarted:
        started_pid = prestarted.pids[0]
        client = EngineClient.from_engine_args(AsyncEngineArgs(str(llama_path), **ENGINE_ARGS),
                                               prestarted=prestarted)
        await _serve_abort_and_stop(client, started_pid)


def test_engine_processes_never_taken_are_ended_and_reaped() -> None:
    with PrestartedEngines([None, None]) as prestarted:
        untaken = psutil.Process(prestarted.pids[0])
        taken = prestarted.take(1)
        assert taken is not None and prestarted.take(1) is None
        assert list(prestarted.pids) == [0]
    assert not untaken.is_running()  # ended and reaped
    assert taken[0].poll() is None  # the taker's to stop
    taken[1].close()
    stop_engine_process(taken[0], wait=0)
    assert taken[0].returncode is not None


async def _serve_abort_and_stop(client: EngineClient, started_pid: int) -> None:
    async with client as engine:
        (pid,) = engine.engine_pids
        assert pid == started_pid and psutil.pid_exists(pid)
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        outputs = [output async for output in engine.generate(
            {"prompt_token_ids": PROMPTS[0]}, params, "a")]
        assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 6
        long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        received = []
        async for output in engine.generate({"prompt_token_ids": PROMPTS[1]}, long, "b"):
            received.append(output)
            if len(received) == 2:
                await engine.abort("b")
        assert received[-1].finished and received[-1].outputs[0].finish_reason == "abort"
        with pytest.raises(ValueError, match="prompt"):
            async for _ in engine.generate({"prompt_token_ids": []}, params, "c"):
                pass
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"


# -- a data-parallel server --------------------------------------------------------------

@pytest.fixture(scope="module")
def dp_server(llama_path: Path) -> Iterator[Any]:
    engine = EngineClient.from_engine_args(AsyncEngineArgs(
        str(llama_path), data_parallel_size=2, **ENGINE_ARGS))
    with server_in_thread(engine, served_model_names=("tiny",)) as server:
        yield server


def _completions(url: str, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's greedy completion's token ids, all sent at once."""
    results: dict[int, list[int]] = {}

    def one(index: int) -> None:
        reply = httpx.post(url + "/v1/completions", json={
            "model": "tiny", "prompt": prompts[index], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}, timeout=120).json()
        results[index] = reply["choices"][0]["token_ids"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return [results[i] for i in range(len(prompts))]


def test_two_replicas_answer_greedy_requests_as_one_engine_does(dp_server: Any,
                                                                 llama_llm: Any) -> None:
    expected = [output.outputs[0].token_ids for output in llama_llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)]
    assert _completions(dp_server.url, PROMPTS) == [list(ids) for ids in expected]


def test_metrics_carry_one_engine_label_per_replica_and_both_served(dp_server: Any) -> None:
    _completions(dp_server.url, PROMPTS[:4])
    text = httpx.get(dp_server.url + "/metrics").text
    for engine in ("0", "1"):
        assert f'vllm:num_requests_running{{engine="{engine}",model_name="tiny"}}' in text
        line = next(line for line in text.splitlines() if line.startswith(
            f'vllm:request_success_total{{engine="{engine}",finished_reason="length"'))
        assert float(line.split()[-1]) >= 1  # the balancer gave each replica requests


# -- faults ------------------------------------------------------------------------------

def _engine_processes(server_pid: int) -> list[psutil.Process]:
    return [child for child in psutil.Process(server_pid).children(recursive=True)
            if "triollm.engine.process.child" in " ".join(child.cmdline())]


def _stream(url: str, prompt: list[int], events: list[str], started: threading.Barrier
            ) -> None:
    with httpx.stream("POST", url + "/v1/completions", json={
            "model": "tiny", "prompt": prompt, "max_tokens": 4000, "temperature": 0,
            "stream": True, "ignore_eos": True}, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 2:
                    started.wait(60)


def _gone(pids: list[int]) -> bool:
    return not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"
                   for pid in pids)


def test_a_killed_engine_process_ends_every_stream_with_an_error_and_the_server_non_zero(
        llama_path: Path, tmp_path: Path) -> None:
    # The surviving engine's streams must still be running when the kill lands: each
    # waits for every stream to begin, and under load the other engine's first tokens
    # can come late, so they ask for 4000 tokens (the tiny Llama's rotary positions go
    # past its config's 512; only the config says otherwise).
    long_llama = tmp_path / "llama-4k"
    shutil.copytree(llama_path, long_llama)
    config = json.loads((long_llama / "config.json").read_text())
    (long_llama / "config.json").write_text(json.dumps(
        {**config, "max_position_embeddings": 4096}))
    with server_process(str(long_llama), "--dtype", "float32", "--max-model-len", "4096",
                        "--num-gpu-blocks-override", "1024", "--served-model-name", "tiny",
                        "--data-parallel-size", "2") as (process, url):
        engines = _engine_processes(process.pid)
        assert len(engines) == 2
        streams = [[] for _ in range(4)]  # type: list[list[str]]
        started = threading.Barrier(5)
        threads = [threading.Thread(target=_stream, args=(url, PROMPTS[i], streams[i],
                                                          started)) for i in range(4)]
        for thread in threads:
            thread.start()
        started.wait(60)
        engines[0].send_signal(signal.SIGKILL)
        for thread in threads:
            thread.join(60)
        for events in streams:
            assert events[-1] == "[DONE]"
            assert "engine" in json.loads(events[-2]).get("error", {}).get("message", ""), (
                len(events), events[-3:])
        assert process.wait(30) != 0
    assert _gone([engine.pid for engine in engines])


def test_a_hung_engine_process_is_dead_within_the_heartbeat_timeout(
        llama_path: Path) -> None:
    async def main() -> None:
        client = EngineClient.from_engine_args(
            AsyncEngineArgs(str(llama_path), **ENGINE_ARGS), heartbeat_timeout=2.0)
        with pytest.raises(EngineDeadError, match="hung"):
            async with client as engine:
                (pid,) = engine.engine_pids
                assert pid is not None
                psutil.Process(pid).suspend()
                params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
                with pytest.raises(EngineDeadError, match="hung"):
                    async for _ in engine.generate({"prompt_token_ids": PROMPTS[0]},
                                                   params, "x"):
                        pass
                await anyio.sleep_forever()
        assert _gone([pid])

    anyio.run(main, backend="trio")


def test_data_parallel_flags_for_other_nodes_are_refused_naming_why(
        capsys: pytest.CaptureFixture[str]) -> None:
    from triollm import cli

    assert cli.main(["serve", "--data-parallel-size", "2",
                     "--data-parallel-size-local", "1"]) == 2
    assert "--data-parallel-size-local 1: every replica runs on this machine" in (
        capsys.readouterr().err)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--data-parallel-address", "10.0.0.1"])
    assert exit_info.value.code == 2
    assert "all run on this machine" in capsys.readouterr().err
