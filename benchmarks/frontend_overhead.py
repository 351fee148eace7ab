"""Front-end overhead: delivering tokens to many concurrent streams.

A zero-cost fake model runner (one token per request per step) isolates the async
layer. For N concurrent streams it reports tokens delivered per second and loop time
per step for:

* triollm's AsyncLLMEngine on trio and on asyncio;
* "queues": the design it replaces, written here: an asyncio loop that runs each step
  in an executor thread (as the seed's ``run_in_executor``) and puts every output on an
  unbounded ``asyncio.Queue`` per request, consumers awaiting ``queue.get()``.

All three drive the same ``EngineCore`` and fake runner, so only the delivery path
differs. The "lagging" variant makes every consumer sleep after each output it reads,
so the engine steps faster than consumers read: triollm merges DELTA outputs behind a
full stream buffer, the queue design queues one object per step.

    python benchmarks/frontend_overhead.py                  # N = 100, 1000, 10000
    python benchmarks/frontend_overhead.py --streams 100 --tokens 8
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio

from triollm import (
    AsyncEngineArgs,
    AsyncLLMEngine,
    EngineArgs,
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
)
from triollm.engine.core import EngineCore
from triollm.model.loader import build_demo_tokenizer
from triollm.testing import FakeModelRunner

VOCAB = 900


@dataclass
class Result:
    seconds: float
    tokens: int
    steps: int
    outputs: int

    def row(self, name: str) -> str:
        return (f"  {name:14s} {self.tokens / self.seconds:10.0f} tok/s  "
                f"{1000 * self.seconds / max(self.steps, 1):8.2f} ms/step  "
                f"{self.outputs:8d} outputs delivered")


def engine_args(streams: int, tokens: int) -> dict[str, object]:
    return {"max_model_len": tokens + 8, "max_num_seqs": streams,
            "max_num_batched_tokens": streams, "block_size": 16}


def params(tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, ignore_eos=True, detokenize=False,
                          output_kind=RequestOutputKind.DELTA)


def runner_for(streams: int, tokens: int) -> FakeModelRunner:
    blocks = streams * (-(-(tokens + 8) // 16))
    return FakeModelRunner(num_kv_blocks=blocks, vocab_size=VOCAB)


async def run_triollm(streams: int, tokens: int, lag: float) -> Result:
    runner = runner_for(streams, tokens)
    args = AsyncEngineArgs(disable_log_requests=True, **engine_args(streams, tokens))  # type: ignore[arg-type]
    engine = AsyncLLMEngine.from_engine_args(args, runner_factory=lambda: runner)
    delivered = 0
    outputs = 0

    async def consume(i: int) -> None:
        nonlocal delivered, outputs
        prompt = {"prompt_token_ids": [5 + i % 800]}
        async for output in engine.generate(prompt, params(tokens), str(i)):
            delivered += len(output.outputs[0].token_ids)
            outputs += 1
            if lag:
                await anyio.sleep(lag)

    async with engine:
        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for i in range(streams):
                tg.start_soon(consume, i)
        elapsed = time.perf_counter() - start
        steps = engine.statistics().num_steps
    assert delivered == streams * tokens, (delivered, streams * tokens)
    return Result(elapsed, delivered, steps, outputs)


async def run_queues(streams: int, tokens: int, lag: float) -> Result:
    """The asyncio design this project replaces, in miniature."""
    config = EngineArgs(**engine_args(streams, tokens)).create_engine_config()  # type: ignore[arg-type]
    runner = runner_for(streams, tokens)
    core = EngineCore(config, runner, build_demo_tokenizer())
    loop = asyncio.get_running_loop()
    queues: dict[str, asyncio.Queue[RequestOutput]] = {}
    new_work = asyncio.Event()
    steps = 0

    async def engine_loop() -> None:
        nonlocal steps
        while True:
            if not core.has_unfinished_requests():
                new_work.clear()
                await new_work.wait()
            scheduled = core.schedule()
            result = await loop.run_in_executor(None, runner.execute_model, scheduled)
            steps += 1
            for output in core.process(scheduled, result):
                queues[output.request_id].put_nowait(output)
            await asyncio.sleep(0)

    delivered = 0
    outputs = 0

    async def consume(i: int) -> None:
        nonlocal delivered, outputs
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        queues[str(i)] = queue
        core.add_request(str(i), {"prompt_token_ids": [5 + i % 800]}, params(tokens))
        new_work.set()
        while True:
            output = await queue.get()
            delivered += len(output.outputs[0].token_ids)
            outputs += 1
            if output.finished:
                break
            if lag:
                await asyncio.sleep(lag)

    task = asyncio.create_task(engine_loop())
    start = time.perf_counter()
    await asyncio.gather(*(consume(i) for i in range(streams)))
    elapsed = time.perf_counter() - start
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    assert delivered == streams * tokens
    return Result(elapsed, delivered, steps, outputs)


def measure(name: str, backend: str, function: Callable[[int, int, float], Awaitable[Result]],
            streams: int, tokens: int, lag: float) -> Result:
    result: Result = anyio.run(function, streams, tokens, lag, backend=backend)
    print(result.row(name), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--tokens", type=int, default=16, help="tokens per request")
    parser.add_argument("--lag", type=float, default=0.02,
                        help="seconds each lagging consumer sleeps after every output")
    args = parser.parse_args()
    for lag in (0.0, args.lag):
        title = "lagging consumers" if lag else "consumers keeping up"
        per_read = f", {lag * 1000:.0f} ms per read" if lag else ""
        print(f"\n{title} ({args.tokens} tokens per request{per_read})")
        for streams in args.streams:
            print(f" N = {streams}")
            queues = measure("queues/asyncio", "asyncio", run_queues, streams, args.tokens, lag)
            ratios = []
            for backend in ("asyncio", "trio"):
                ours = measure(f"triollm/{backend}", backend, run_triollm, streams,
                               args.tokens, lag)
                ratios.append(f"{backend} {queues.seconds / ours.seconds:.2f}x")
            print(f"  triollm vs queues: {', '.join(ratios)}")


if __name__ == "__main__":
    main()
