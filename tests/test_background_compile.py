"""The async engine serves eagerly while a thread of the runner's compiles the model, and
switches to the compiled forward at a step boundary: the same greedy tokens before and
after the switch, a compile thread that never outlives the engine (closed mid-compile
too), a failed compile that leaves it eager; ``LLM`` still compiles before it returns;
torch's compile caches kept private under triollm's cache root."""

from __future__ import annotations

import logging
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from test_greedy_matches_transformers import MAX_TOKENS, PROMPTS, reference
from triollm import AsyncEngineArgs, AsyncLLMEngine, EngineArgs, SamplingParams
from triollm.model.runners import background_compile, compile_cache, torch_runner
from triollm.model.runners import compile as runner_compile

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
THREAD_NAME = "triollm-compile"


def compile_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == THREAD_NAME]


def engine_for(path: Path) -> AsyncLLMEngine:
    return AsyncLLMEngine.from_engine_args(AsyncEngineArgs(
        model=str(path), dtype="float32", max_model_len=128, num_gpu_blocks_override=256,
        optimization_level=2, cpu_threads=1))


class GatedCompile:
    """Holds the compile inside dynamo's compile session (where torch reports
    ``is_compiling()`` on every thread), at the backend of its first graph, until
    ``release`` is set or the runner stops it; ``entered`` is set once it got there."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        real = runner_compile._inductor_with_shared_input_calls_fused

        def gated(stop: Callable[[], bool]) -> Any:
            backend = real(stop)

            def wait_then_compile(*args: Any) -> Any:
                self.entered.set()
                while not self.release.wait(0.01) and not stop():
                    pass
                return backend(*args)
            return wait_then_compile

        monkeypatch.setattr(runner_compile, "_inductor_with_shared_input_calls_fused", gated)


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


@pytest.mark.anyio
async def test_requests_before_and_after_the_switch_give_the_eager_greedy_tokens(
        llama_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = GatedCompile(monkeypatch)
    async with engine_for(llama_path) as engine:
        await anyio.to_thread.run_sync(gate.entered.wait)
        during = await greedy_tokens(engine, "during")
        stats = engine.statistics()
        assert stats.compiling and not stats.compiled_forward
        gate.release.set()
        await wait_until_compiled(engine)
        after = await greedy_tokens(engine, "after")
        assert engine.statistics().compiled_forward
        assert len(compile_threads()) == 0
    assert during == reference(llama_path)
    assert after == reference(llama_path)


@pytest.mark.anyio
async def test_closing_the_engine_mid_compile_stops_and_joins_the_compile_thread(
        llama_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    gate = GatedCompile(monkeypatch)
    with caplog.at_level(logging.INFO, logger="triollm.model.runners"):
        async with engine_for(llama_path) as engine:
            await anyio.to_thread.run_sync(gate.entered.wait)
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

    monkeypatch.setattr(torch_runner, "build_compiled", broken)
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
