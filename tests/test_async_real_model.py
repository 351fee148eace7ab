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
