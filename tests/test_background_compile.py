"""The async engine serves eagerly while the model compiles in the background, and
switches to the compiled forward at a step boundary, idle too: a compile process builds
the saved artifacts under the serving process's own key, which then
loads them (the same greedy tokens before and after the switch); where nothing is saved
a thread compiles, which never outlives the engine (closed mid-compile too), and a
failed compile leaves it eager; ``LLM`` still compiles before it returns; torch's
compile caches kept private under triollm's cache root."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from test_greedy_matches_transformers import MAX_TOKENS, PROMPTS, reference
from triollm import AsyncEngineArgs, AsyncLLMEngine, EngineArgs, SamplingParams
from triollm.model.cpu.build import trusted_cache_dir
from triollm.model.cpu.threads import ComputeThreads
from triollm.model.runners import (
    background_compile,
    compile_cache,
    compile_process,
    torch_runner,
)
from triollm.model.runners import compile as runner_compile

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
THREAD_NAME = "triollm-compile"


def compile_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == THREAD_NAME]


def engine_for(path: Path) -> AsyncLLMEngine:
    return AsyncLLMEngine.from_engine_args(AsyncEngineArgs(
        model=str(path), dtype="float32", max_model_len=128, num_gpu_blocks_override=256,
        optimization_level=2, cpu_threads=1))


#: How long a test waits for the compile to reach its gate (a compile that fails first
#: never does: the test fails rather than hangs).
ENTER_SECONDS = 120


class GatedCompile:
    """Holds the compile inside dynamo's compile session (where torch reports
    ``is_compiling()`` on every thread), at the backend of its first graph, until
    ``release`` is set or the runner stops it; ``entered`` is set once it got there."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        real = runner_compile._inductor_with_shared_input_calls_fused

        def gated(stop: Callable[[], bool], *args: Any) -> Any:
            backend = real(stop, *args)

            def wait_then_compile(*args: Any) -> Any:
                self.entered.set()
                while not self.release.wait(0.01) and not stop():
                    pass
                return backend(*args)
            return wait_then_compile

        monkeypatch.setattr(runner_compile, "_inductor_with_shared_input_calls_fused", gated)
        # nothing loaded from the compiled-model cache: every shape reaches the backend,
        # in the compile thread
        monkeypatch.setattr(runner_compile, "cache_directory", lambda key: None)
        monkeypatch.setattr(background_compile, "saves_artifacts", lambda model: False)


class GatedProcess:
    """Holds the compile thread before it starts the compile process until ``release``
    is set; ``entered`` is set once it got there. triollm's cache root is ``cache``
    (no compiled model: the process compiles), with the session's C kernels and torch
    caches."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        monkeypatch.setenv("TRIOLLM_CACHE", str(cache))
        # a compile process even where an earlier test's left the compiled model: it
        # then loads it, and reports its key, instead of compiling it again
        monkeypatch.setattr(background_compile, "has_artifacts", lambda *args: False)
        monkeypatch.setenv(compile_cache.ENVIRONMENT_VARIABLE, os.environ.get(
            compile_cache.ENVIRONMENT_VARIABLE) or str(trusted_cache_dir("torch")))
        #: the server's cache key, and the one the compile process reported
        self.keys: list[str] = []
        real = background_compile.run_compile_process
        follow = compile_process._follow

        def gated(job: Any, stop: Callable[[], bool]) -> bool:
            self.keys.append(job.key)
            self.entered.set()
            while not self.release.wait(0.01) and not stop():
                pass
            return real(job, stop)

        def followed(*args: Any) -> Any:
            result, tail = follow(*args)
            self.keys.append(result["key"])
            return result, tail

        monkeypatch.setattr(background_compile, "run_compile_process", gated)
        monkeypatch.setattr(compile_process, "_follow", followed)


async def greedy_tokens(engine: AsyncLLMEngine, tag: str) -> list[list[int]]:
    tokens: list[list[int]] = [[] for _ in PROMPTS]

    async def one(index: int) -> None:
        async for output in engine.generate(PROMPTS[index], GREEDY, f"{tag}-{index}"):
            tokens[index] = list(output.outputs[0].token_ids)

    async with anyio.create_task_group() as group:
        for index in range(len(PROMPTS)):
            group.start_soon(one, index)
    return tokens


async def wait_until_compiled(engine: AsyncLLMEngine) -> None:
    assert engine._core is not None
    runner = engine._core.runner
    assert isinstance(runner, torch_runner.TorchModelRunner)
    await anyio.to_thread.run_sync(runner.wait_for_compile)
    assert not engine.statistics().compiling


def compile_processes() -> list[int]:
    """This process's children running the compile process."""
    children = []
    for stat_path in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_path.read_text().rsplit(")", 1)[1].split()
            command = (stat_path.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and b"compile_child" in command:
            children.append(int(stat_path.parent.name))
    return children


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A triollm cache root with the session's C kernels and no compiled model: the
    first compile process compiles it; later ones (the other async backend) load it."""
    cache = tmp_path_factory.mktemp("compile-cache")
    shutil.copytree(trusted_cache_dir(), cache / "kernels")
    return cache


@pytest.mark.anyio
async def test_a_compile_process_builds_what_the_server_loads_and_switches_to_idle(
        llama_path: Path, monkeypatch: pytest.MonkeyPatch, shared_cache: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    gate = GatedProcess(monkeypatch, shared_cache)
    with caplog.at_level(logging.INFO, logger="triollm.model.runners"):
        async with engine_for(llama_path) as engine:
            assert await anyio.to_thread.run_sync(gate.entered.wait, ENTER_SECONDS), (
                "the compile never reached the gate")
            during = await greedy_tokens(engine, "during")
            stats = engine.statistics()
            assert stats.compiling and not stats.compiled_forward
            gate.release.set()
            await wait_until_compiled(engine)
            # no request: the idle engine switches on its own
            with anyio.fail_after(30):
                while True:
                    if engine.statistics().compiled_forward:
                        break
                    await anyio.sleep(0.05)
            after = await greedy_tokens(engine, "after")
            assert engine._core is not None
            decoder = engine._core.runner.model.get_decoder()._compiled_call_impl
            assert len(compile_threads()) == 0 and compile_processes() == []
    # loaded under the server's own key what the process compiled (the first backend's
    # compile; the other's process loaded it), and checked against the eager logits
    server_key, process_key = gate.keys
    assert process_key == server_key == decoder.directory.name
    assert (decoder.loaded, decoder.compiled) == (2, 0)
    assert "compile process: compiling the model: 2/2" in caplog.text
    assert "compiling the model failed" not in caplog.text
    assert during == reference(llama_path)
    assert after == reference(llama_path)


@pytest.mark.anyio
async def test_closing_the_engine_mid_compile_stops_and_joins_the_compile_thread(
        llama_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    gate = GatedCompile(monkeypatch)
    with caplog.at_level(logging.INFO, logger="triollm.model.runners"):
        async with engine_for(llama_path) as engine:
            assert await anyio.to_thread.run_sync(gate.entered.wait, ENTER_SECONDS), (
                "the compile never reached the gate")
            assert len(compile_threads()) == 1
            runner = engine._core.runner if engine._core is not None else None
    assert len(compile_threads()) == 0
    assert runner is not None and not runner.compiled
    assert "compiling the model failed" not in caplog.text


@pytest.mark.anyio
async def test_an_error_in_the_compile_thread_leaves_the_engine_serving_eagerly(
        llama_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    def broken(*args: Any) -> bool:
        raise RuntimeError("the compiler vanished")

    monkeypatch.setattr(background_compile, "saves_artifacts", lambda model: False)
    monkeypatch.setattr(background_compile, "build_compiled", broken)
    with caplog.at_level(logging.WARNING, logger=background_compile.__name__):
        async with engine_for(llama_path) as engine:
            await wait_until_compiled(engine)
            tokens = await greedy_tokens(engine, "eager")
            assert not engine.statistics().compiled_forward
            assert engine.is_running
    assert "the compiler vanished" in caplog.text
    assert tokens == reference(llama_path)


def test_only_the_async_engine_compiles_in_the_background() -> None:
    assert AsyncEngineArgs().create_engine_config().model.compile_in_background
    assert not EngineArgs().create_engine_config().model.compile_in_background


def test_a_background_compile_that_will_not_stop_is_left_after_the_bound(
        caplog: pytest.LogCaptureFixture) -> None:
    finish = threading.Event()
    compile = background_compile.BackgroundCompile(lambda stop: finish.wait(30))
    with caplog.at_level(logging.WARNING, logger=background_compile.__name__):
        assert not compile.close(timeout=0.05)
    assert "did not stop" in caplog.text
    finish.set()
    assert compile.close()
    assert compile.done and compile.compiled


def test_torch_compile_caches_go_under_the_private_triollm_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRIOLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(compile_cache.ENVIRONMENT_VARIABLE, raising=False)
    directory = compile_cache.use_private_compile_cache()
    assert directory == tmp_path / "cache" / "torch"
    assert os.environ[compile_cache.ENVIRONMENT_VARIABLE] == str(directory)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700


def test_a_compile_cache_the_user_chose_is_kept(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRIOLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(compile_cache.ENVIRONMENT_VARIABLE, str(tmp_path / "mine"))
    assert compile_cache.use_private_compile_cache() == tmp_path / "mine"
    assert not (tmp_path / "cache").exists()


def test_adopting_the_compiled_counts_rounds_the_count_in_use_down() -> None:
    calls: list[int] = []
    threads = ComputeThreads(4, set_threads=calls.append)
    threads.keep_to([1, 2])
    assert threads.threads == 2 and calls[-1] == 2
    threads.keep_to([1, 2, 4])
    assert threads.threads == 2
