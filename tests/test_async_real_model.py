"""The async engine over real transformers models: a forward that raises, and an event
loop that keeps serving while a long torch step runs in the model thread."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from conftest import POISON
from helpers import run_ticker
from triollm import AsyncEngineArgs, AsyncLLMEngine, EngineDeadError, SamplingParams
from triollm.testing import build_tiny_model

pytestmark = pytest.mark.anyio

async def test_a_forward_that_raises_fails_every_stream_and_the_task_group(
        poison_model: Path) -> None:
    args = AsyncEngineArgs(model=str(poison_model), trust_remote_code=True, dtype="float32",
                           max_model_len=256, num_gpu_blocks_override=128,
                           disable_log_requests=True)
    engine = AsyncLLMEngine.from_engine_args(args)
    errors: dict[str, BaseException] = {}
    received: dict[str, int] = {}
    streaming = anyio.Event()

    async def consume(request_id: str, prompt: list[int]) -> None:
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        try:
            async for _ in engine.generate({"prompt_token_ids": prompt}, params, request_id):
                received[request_id] = received.get(request_id, 0) + 1
                if received[request_id] == 3:
                    streaming.set()
        except EngineDeadError as error:
            errors[request_id] = error

    with pytest.raises(BaseExceptionGroup) as raised:
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            async with anyio.create_task_group() as consumers:
                for i in range(3):
                    consumers.start_soon(consume, str(i), [10 + i, 11, 12])
                await streaming.wait()
                consumers.start_soon(consume, "poison", [5, POISON, 6])
    (original,) = raised.value.exceptions
    assert type(original) is RuntimeError and "poison token" in str(original)
    assert sorted(errors) == ["0", "1", "2", "poison"]
    assert all(e.__cause__ is original for e in errors.values())
    assert all(received.get(str(i), 0) >= 1 for i in range(3))
    with pytest.raises(EngineDeadError):
        await engine.check_health()


async def test_the_loop_keeps_serving_during_a_long_real_model_step(
        tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> None:
    path = build_tiny_model("llama", tmp_path_factory.mktemp("wide") / "model", tokenizer,
                            hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                            num_attention_heads=8, num_key_value_heads=8)
    args = AsyncEngineArgs(model=str(path), dtype="float32", max_model_len=512,
                           max_num_batched_tokens=512, num_gpu_blocks_override=64,
                           disable_log_requests=True)
    engine = AsyncLLMEngine.from_engine_args(args)
    lateness: list[float] = []

    async with engine, anyio.create_task_group() as tg:
        tg.start_soon(run_ticker, lateness)
        started = time.perf_counter()
        prompt = {"prompt_token_ids": [(7 * i) % 400 + 5 for i in range(500)]}
        async for _ in engine.generate(prompt, SamplingParams(max_tokens=1), "long"):
            pass
        prefill_time = time.perf_counter() - started
        tg.cancel_scope.cancel()
    # The 500-token prefill is one model step; had it run on the loop, one tick would
    # have waited for all of it.
    assert prefill_time > 0.05, "the step must be long enough to mean something"
    assert max(lateness) < prefill_time / 2
    print(f"prefill step {prefill_time * 1000:.0f} ms; ticker: {len(lateness)} ticks, "
          f"max late {max(lateness) * 1000:.1f} ms")


async def _outputs(path: Path, async_scheduling: bool,
                   requests: list[tuple[list[int], SamplingParams]]) -> list[Any]:
    args = AsyncEngineArgs(model=str(path), dtype="float32", max_model_len=128,
                           max_num_batched_tokens=32, block_size=4, max_num_seqs=8,
                           num_gpu_blocks_override=96, disable_log_requests=True,
                           async_scheduling=async_scheduling)
    finals: dict[int, Any] = {}

    async def consume(engine: AsyncLLMEngine, index: int, prompt: list[int],
                      params: SamplingParams) -> None:
        async for output in engine.generate({"prompt_token_ids": prompt}, params, str(index)):
            finals[index] = output

    async with AsyncLLMEngine.from_engine_args(args) as engine:
        assert engine.config.scheduler.async_scheduling is async_scheduling
        async with anyio.create_task_group() as tasks:
            for index, (prompt, params) in enumerate(requests):
                tasks.start_soon(consume, engine, index, prompt, params)
        stats = engine.statistics()
        assert (stats.num_running, stats.num_waiting, stats.num_open_streams) == (0, 0, 0)
        assert stats.num_free_blocks == stats.num_total_blocks
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason,
              None if c.logprobs is None else
              [{t: round(lp.logprob, 3) for t, lp in position.items()} for position in c.logprobs])
             for c in finals[i].outputs]
            for i in range(len(requests))]


async def test_asynchronous_scheduling_gives_the_outputs_of_scheduling_in_turn(
        llama_path: Path) -> None:
    """With ``async_scheduling`` a request's next step is scheduled before its last token
    is known. Stops found only then (a stop token id, a stop string) discard that step's
    work; penalties and seeded sampling read the tokens sampled so far. Every output is
    the same as when each step is scheduled after the previous one is processed."""
    prompts = [[5, 17, 29], [40, 41, 42, 43, 44, 45, 46], [300], [99, 7, 250, 11, 60],
               [123, 124], [400, 3, 88, 19, 201, 202, 203, 204, 205]]
    plain = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    reference = await _outputs(llama_path, False, [(p, plain) for p in prompts])
    # Stops taken from the greedy outputs, so they fire mid-stream.
    stop_token = reference[0][0][0][6]
    stop_text = reference[1][0][1][8:11]
    assert stop_text.strip()
    requests = [
        (prompts[0], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                    stop_token_ids=[stop_token])),
        (prompts[1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                    stop=[stop_text])),
        (prompts[2], SamplingParams(temperature=1.0, seed=7, max_tokens=16, n=2,
                                    presence_penalty=0.5, frequency_penalty=0.4,
                                    repetition_penalty=1.3)),
        (prompts[3], SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=12,
                                    min_tokens=4)),
        (prompts[4], SamplingParams(temperature=0, max_tokens=1)),
        (prompts[5], SamplingParams(temperature=0, max_tokens=18, logprobs=2)),
    ]
    in_turn = await _outputs(llama_path, False, requests)
    ahead = await _outputs(llama_path, True, requests)
    assert ahead == in_turn
    assert in_turn[0][0][2:4] == ("stop", stop_token)
    assert in_turn[1][0][2:4] == ("stop", stop_text)
    assert in_turn[5][0][4] is not None
