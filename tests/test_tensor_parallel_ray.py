"""``distributed_executor_backend="ray"``: rank 1 as a Ray actor decodes greedily as one
rank does, on a Ray instance the executor starts itself and on a running cluster
(``ray start --head``, one per module) that ``RAY_ADDRESS`` or the
caller's own ``ray.init`` names; an actor killed or stopped mid-stream fails every
stream with ``EngineDeadError`` and leaves no actor and no placement group behind,
and the cluster runs on; without Ray the flag says how to get it."""

from __future__ import annotations

import importlib.util
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from helpers import MidStreamFault, fault_a_rank_mid_stream
from triollm import LLM, AsyncEngineArgs, AsyncLLMEngine, EngineArgs, SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0.0)
PROMPTS = ["hello world", "the quick brown fox jumps over"]


def rank_actors(root: psutil.Process) -> list[psutil.Process]:
    """The live processes under ``root`` that hold a rank (Ray titles them by actor)."""
    found = []
    for child in root.children(recursive=True):
        try:
            if "RankActor" in " ".join(child.cmdline()) and (
                    child.status() != psutil.STATUS_ZOMBIE):
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found


def wait_for_no_rank_actor(root: psutil.Process, seconds: float = 15.0) -> list[psutil.Process]:
    """Ray ends a killed actor's process asynchronously: what is left after ``seconds``."""
    deadline = time.monotonic() + seconds
    while (left := rank_actors(root)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.fixture(scope="module", autouse=True)
def ray_token() -> Iterator[None]:
    """Ray's token authentication (its default for a new cluster), with one token of
    this module's for every Ray it starts or joins, whatever token file this machine
    has: set before the first ``ray.init`` of the process, which keeps its token."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_AUTH_MODE", "token")
        patch.setenv("RAY_AUTH_TOKEN", secrets.token_hex(32))
        patch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
        yield


@pytest.fixture(scope="module")
def ray_cluster(ray_token: None) -> Iterator[tuple[psutil.Process, str]]:
    """A running one-node cluster on this machine: its ``ray start`` process and
    address."""
    pytest.importorskip("ray")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # short: Ray's unix socket paths live under it, and those have a length limit
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    log = Path(temp_dir) / "head.log"
    with log.open("w") as out:
        head = subprocess.Popen(
            [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
             "--port", str(port), "--num-cpus", "2", "--include-dashboard", "false",
             "--disable-usage-stats", "--temp-dir", temp_dir],
            stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while "block forever" not in log.read_text():
            assert head.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        yield psutil.Process(head.pid), f"127.0.0.1:{port}"
        assert head.poll() is None, "the cluster ended with the engine"
    finally:
        head.send_signal(signal.SIGTERM)  # --block: ends every process it started
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_a_ray_instance_of_the_executors_own_serves_a_rank_and_ends_with_it(
        llama_path: Path, llama_llm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    ray = pytest.importorskip("ray")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    llm = LLM(str(llama_path), dtype="float32", max_model_len=256, tensor_parallel_size=2,
              distributed_executor_backend="ray")
    try:
        assert ray.is_initialized()
        (actor,) = rank_actors(psutil.Process())
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        want = [o.outputs[0].token_ids for o in llama_llm.generate(PROMPTS, GREEDY,
                                                                   use_tqdm=False)]
        assert got == want
    finally:
        llm.engine.runner.shutdown()
    assert not ray.is_initialized()
    assert not wait_for_no_rank_actor(psutil.Process())
    assert not psutil.pid_exists(actor.pid) or actor.status() == psutil.STATUS_ZOMBIE


# each fault once, on each event loop once, and each way of naming the cluster once:
# RAY_ADDRESS (the executor connects, and disconnects at shutdown) and the caller's own
# ray.init (left connected)
@pytest.mark.parametrize(("anyio_backend", "fault", "named_by"), [
    ("trio", signal.SIGKILL, "RAY_ADDRESS"), ("asyncio", signal.SIGSTOP, "ray.init")],
    ids=["trio-killed-RAY_ADDRESS", "asyncio-stopped-ray.init"])
async def test_a_ray_actor_that_dies_or_hangs_on_a_cluster_fails_every_stream(
        ray_cluster: tuple[psutil.Process, str], llama_path: Path, llama_llm: Any,
        fault: signal.Signals, named_by: str, anyio_backend: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    ray = pytest.importorskip("ray")
    head, address = ray_cluster
    if named_by == "RAY_ADDRESS":
        monkeypatch.setenv("RAY_ADDRESS", address)
    else:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
        ray.init(address=address, log_to_driver=False)
    want = list(llama_llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False)[0]
                .outputs[0].token_ids)
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(
        model=str(llama_path), dtype="float32", max_model_len=256,
        num_gpu_blocks_override=64, tensor_parallel_size=2,
        distributed_executor_backend="ray", distributed_timeout_seconds=2.0))
    seen = MidStreamFault()

    def find_rank() -> psutil.Process:
        (actor,) = rank_actors(head)  # on the cluster, not under this process
        return actor

    try:
        await fault_a_rank_mid_stream(engine, PROMPTS[1], GREEDY, find_rank, fault, seen)
        assert seen.tokens == want
        assert sorted(seen.errors) == [0, 1, 2]
        assert engine.errored
        assert not wait_for_no_rank_actor(head)
        # the executor disconnects what it connected, and leaves the caller's own alone
        assert ray.is_initialized() == (named_by == "ray.init")
        if named_by == "ray.init":
            table = ray.util.placement_group_table()
            assert table and all(group["state"] == "REMOVED" for group in table.values())
    finally:
        actor = seen.rank
        if actor is not None and fault == signal.SIGSTOP and psutil.pid_exists(actor.pid):
            os.kill(actor.pid, signal.SIGCONT)
        if ray.is_initialized():
            ray.shutdown()


def test_without_ray_the_flag_says_how_to_get_it(llama_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "ray" else real(name, *args))
    with pytest.raises(ValueError, match=r"pip install 'triollm\[ray\]'"):
        EngineArgs(model=str(llama_path), tensor_parallel_size=2,
                   distributed_executor_backend="ray").create_engine_config()
