"""Constrained decoding through ``AsyncLLMEngine``: grammars compile in a worker thread
while the event loop keeps serving, asynchronous scheduling keeps every matcher current,
and a request abandoned at any point leaves nothing behind."""

from __future__ import annotations

import importlib.util
import json
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import jsonschema
import pytest

from helpers import run_ticker
from triollm import AsyncEngineArgs, AsyncLLMEngine, SamplingParams
from triollm.structured_output import StructuredOutputsParams

pytestmark = pytest.mark.anyio

SCHEMA = {"type": "object",
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                         "ok": {"type": "boolean"},
                         "color": {"enum": ["red", "green", "blue"]}},
          "required": ["id", "ok", "color"], "additionalProperties": False}


def constrained(**kwargs: Any) -> SamplingParams:
    return SamplingParams(max_tokens=kwargs.pop("max_tokens", 60), structured_outputs=(
        StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)), **kwargs)


def engine_args(path: Path, **kwargs: Any) -> AsyncEngineArgs:
    return AsyncEngineArgs(model=str(path), dtype="float32", max_model_len=128,
                           num_gpu_blocks_override=64, disable_log_requests=True, **kwargs)


def large_schema(fields: int) -> dict[str, Any]:
    return {"type": "object", "properties": {
        f"field_{i}": {"anyOf": [
            {"type": "string", "pattern": f"[a-z]{{1,{i % 7 + 1}}}"},
            {"type": "array", "items": {"type": "integer", "minimum": i,
                                        "maximum": i * 37 + 5}},
            {"enum": [f"v{i}_{j}" for j in range(8)]}]}
        for i in range(fields)}, "required": [f"field_{i}" for i in range(0, fields, 3)]}


@pytest.mark.parametrize("backend", ["guidance", pytest.param("xgrammar", marks=(
    pytest.mark.skipif(importlib.util.find_spec("xgrammar") is None,
                       reason="xgrammar is not installed")))])
async def test_a_large_schema_compiles_off_the_event_loop(llama_path: Path,
                                                          backend: str) -> None:
    # llguidance compiles the same schema several times faster
    fields = {"guidance": 600, "xgrammar": 120}[backend]
    params = SamplingParams(max_tokens=1, structured_outputs=StructuredOutputsParams(
        json=large_schema(fields)))
    lateness: list[float] = []
    args = engine_args(llama_path, structured_outputs_config={"backend": backend})
    async with AsyncLLMEngine.from_engine_args(args) as engine, \
            anyio.create_task_group() as tasks:
        tasks.start_soon(run_ticker, lateness)
        await anyio.sleep(0.01)
        async for _ in engine.generate("hello", params, "big"):
            pass
        tasks.cancel_scope.cancel()
        core = engine._core
        assert core is not None
        grammar = core.compile_structured_outputs(params)  # the cached one: its time
        assert grammar is not None
        stats = engine.statistics()
    assert (stats.grammar_cache_misses, stats.grammar_cache_hits) == (1, 1)
    assert grammar.compile_seconds > 0.03, "the compile must be long enough to mean something"
    # Had it compiled on the loop, one tick would have waited for all of it.
    assert max(lateness) < grammar.compile_seconds / 2, (max(lateness), grammar.compile_seconds)
    print(f"{backend}: compile {grammar.compile_seconds * 1000:.0f} ms; ticker: "
          f"{len(lateness)} ticks, max late {max(lateness) * 1000:.1f} ms")


async def _finals(path: Path, async_scheduling: bool) -> list[list[str]]:
    prompts = ["a", "bb cc", "one two three", "x y"]
    params = [constrained(temperature=0), constrained(seed=1, n=2),
              constrained(seed=2, logprobs=1), constrained(seed=3, max_tokens=5)]
    # an n > 1 request's outputs carry the samples that changed: keep each one's last
    finals: dict[int, dict[int, str]] = {index: {} for index in range(len(prompts))}

    async def consume(engine: AsyncLLMEngine, index: int) -> None:
        async for output in engine.generate(prompts[index], params[index], str(index)):
            for completion in output.outputs:
                finals[index][completion.index] = completion.text

    args = engine_args(path, async_scheduling=async_scheduling, max_num_batched_tokens=16,
                       block_size=4)
    async with AsyncLLMEngine.from_engine_args(args) as engine:
        async with anyio.create_task_group() as tasks:
            for index in range(len(prompts)):
                tasks.start_soon(consume, engine, index)
    return [[texts[n] for n in sorted(texts)] for texts in finals.values()]


async def test_asynchronous_scheduling_keeps_every_matcher_current(llama_path: Path) -> None:
    """A step scheduled before the previous token is known still gets the mask of the
    matcher that has taken that token: outputs are those of scheduling in turn."""
    in_turn = await _finals(llama_path, False)
    ahead = await _finals(llama_path, True)
    assert ahead == in_turn
    for texts in in_turn[:3]:
        for text in texts:
            jsonschema.validate(json.loads(text), SCHEMA)
    assert not in_turn[3][0].endswith("}")  # cut by max_tokens


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["in-turn", "ahead"])
@pytest.mark.parametrize("after", [0, 1, 4])
async def test_a_request_abandoned_at_any_point_leaves_nothing_behind(
        llama_path: Path, async_scheduling: bool, after: int) -> None:
    args = engine_args(llama_path, async_scheduling=async_scheduling)
    async with AsyncLLMEngine.from_engine_args(args) as engine:
        seen = 0
        async for _ in engine.generate("hello", constrained(seed=5, n=2), "gone"):
            seen += 1
            if seen > after:
                break
        # the runner drops a request's matchers with the next step it runs
        async for output in engine.generate("next", constrained(temperature=0), "next"):
            final = output
        jsonschema.validate(json.loads(final.outputs[0].text), SCHEMA)
        core = engine._core
        assert core is not None
        runner: Any = core.runner
        stats = engine.statistics()
        assert (stats.num_running, stats.num_waiting, stats.num_open_streams) == (0, 0, 0)
        assert stats.num_free_blocks == stats.num_total_blocks
        # engine ids are "<request_id>-<n>": only the last request may still be there
        assert all(r.startswith("next-") for r in runner._requests), list(runner._requests)


async def test_an_invalid_schema_fails_generate_before_the_engine(llama_path: Path) -> None:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(
        json={"type": "object", "properties": {"a": {"type": "nope"}}}))
    async with AsyncLLMEngine.from_engine_args(engine_args(llama_path)) as engine:
        with pytest.raises(ValueError, match=r"^structured_outputs\.json: "):
            async for _ in engine.generate("hello", params, "bad"):
                pass
        stats = engine.statistics()
        assert (stats.num_running, stats.num_waiting, stats.num_open_streams) == (0, 0, 0)
        config = await engine.get_decoding_config()
        assert config is engine.config.structured_outputs


async def test_a_flood_of_distinct_constraints_compiles_in_a_few_threads(
        llama_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from triollm.engine.async_requests import COMPILE_THREADS

    running, most = [0], [0]
    lock = threading.Lock()
    async with AsyncLLMEngine.from_engine_args(engine_args(llama_path)) as engine:
        core = engine._core
        assert core is not None
        compile_now = core.compile_structured_outputs

        def slow_compile(params: SamplingParams, request_id: str = "") -> Any:
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
            try:
                time.sleep(0.05)
                return compile_now(params, request_id)
            finally:
                with lock:
                    running[0] -= 1

        monkeypatch.setattr(core, "compile_structured_outputs", slow_compile)

        async def one(index: int) -> None:
            params = SamplingParams(max_tokens=1, structured_outputs=StructuredOutputsParams(
                regex=f"a{{{index + 1}}}"))
            async for _ in engine.generate("hello", params, f"r{index}"):
                pass

        async with anyio.create_task_group() as tasks:
            for index in range(4 * COMPILE_THREADS + 4):
                tasks.start_soon(one, index)
    assert 1 <= most[0] <= COMPILE_THREADS
