"""Front-end overhead: delivering tokens to many concurrent streams.

A zero-cost fake model runner (one token per request per step) isolates the async
layer. For N concurrent streams it reports tokens delivered per second and loop time
per step for:

* triollm's AsyncLLMEngine on trio and on asyncio;
* "queues": the design it replaces, written here after the seed: an asyncio loop that
  runs each step in an executor thread (``run_in_executor``) and puts every output on
  the request's ``AsyncStream`` (an unbounded ``asyncio.Queue``), ``generate`` being an
  async generator over that stream;
* "queues+freeze": the same, with the start-up heap frozen for the garbage collector as
  triollm's engine does, so the delivery paths can be compared on their own.

All of them drive the same ``EngineCore`` and fake runner. Each runs in a fresh
interpreter. The "lagging" variant makes every consumer sleep after each output it
reads, by default four of the queue design's steps, so the engine steps faster than
consumers read: triollm merges DELTA outputs behind a full stream buffer, the queue
design queues one object per step.

    python benchmarks/frontend_overhead.py                  # N = 100, 1000, 10000
    python benchmarks/frontend_overhead.py --streams 100 --tokens 8
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import gc
import json
import subprocess
import sys
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
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


class _AsyncStream:
    """The seed's per-request stream: an unbounded asyncio.Queue behind ``__anext__``."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> _AsyncStream:
        return self

    async def __anext__(self) -> RequestOutput:
        result = await self._queue.get()
        if isinstance(result, BaseException):
            raise result
        return result


async def run_queues(streams: int, tokens: int, lag: float, freeze: bool = False
                     ) -> Result:
    """The asyncio design this project replaces, in miniature: as in the seed, the step
    runs in an executor thread, every output goes on its request's ``AsyncStream``, and
    ``generate`` is an async generator over that stream."""
    config = EngineArgs(**engine_args(streams, tokens)).create_engine_config()  # type: ignore[arg-type]
    runner = runner_for(streams, tokens)
    core = EngineCore(config, runner, build_demo_tokenizer())
    loop = asyncio.get_running_loop()
    request_streams: dict[str, _AsyncStream] = {}
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
                request_streams[output.request_id].put(output)
                if output.finished:
                    request_streams[output.request_id].put(StopAsyncIteration())
                    del request_streams[output.request_id]
            await asyncio.sleep(0)

    async def generate(prompt: dict[str, list[int]], sampling_params: SamplingParams,
                       request_id: str) -> AsyncGenerator[RequestOutput, None]:
        stream = _AsyncStream()
        request_streams[request_id] = stream
        core.add_request(request_id, prompt, sampling_params)
        new_work.set()
        try:
            async for output in stream:
                yield output
        except (Exception, asyncio.CancelledError):
            core.abort_requests([request_id])
            raise

    delivered = 0
    outputs = 0

    async def consume(i: int) -> None:
        nonlocal delivered, outputs
        prompt = {"prompt_token_ids": [5 + i % 800]}
        async for output in generate(prompt, params(tokens), str(i)):
            delivered += len(output.outputs[0].token_ids)
            outputs += 1
            if lag:
                await asyncio.sleep(lag)

    if freeze:  # what triollm's engine does after start-up
        gc.collect()
        gc.freeze()
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


VARIANTS: dict[str, tuple[str, Callable[[int, int, float], Awaitable[Result]]]] = {
    "queues/asyncio": ("asyncio", run_queues),
    "queues+freeze": ("asyncio", functools.partial(run_queues, freeze=True)),
    "triollm/asyncio": ("asyncio", run_triollm),
    "triollm/trio": ("trio", run_triollm),
}


def measure(name: str, streams: int, tokens: int, lag: float, repeats: int) -> Result:
    """The median of ``repeats`` runs, each in a fresh interpreter so that no run
    inherits another's heap or GC state (the engine freezes the start-up heap)."""
    command = [sys.executable, __file__, "--one", name, "--streams", str(streams),
               "--tokens", str(tokens), "--lag", str(lag)]
    results = []
    for _ in range(repeats):
        completed = subprocess.run(command, check=True, capture_output=True, text=True)
        results.append(Result(**json.loads(completed.stdout.strip().splitlines()[-1])))
    result = sorted(results, key=lambda r: r.seconds)[len(results) // 2]
    print(result.row(name), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--tokens", type=int, default=16, help="tokens per request")
    parser.add_argument("--min-outputs", type=int, default=25_600,
                        help="raise the tokens per request at small N so that a run "
                             "delivers at least this many outputs (a 16-token run at "
                             "N = 100 lasts under 30 ms, as short as its noise)")
    parser.add_argument("--lag", type=float, default=None,
                        help="seconds each lagging consumer sleeps after every output "
                             "(default: --lag-steps times the queue design's step time)")
    parser.add_argument("--lag-steps", type=float, default=4.0,
                        help="lagging consumers read this many engine steps apart")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs per variant (the median is reported)")
    parser.add_argument("--one", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        backend, function = VARIANTS[args.one]
        result = anyio.run(function, args.streams[0], args.tokens, args.lag or 0.0,
                           backend=backend)
        print(json.dumps(dataclasses.asdict(result)))
        return
    step_seconds: dict[int, float] = {}
    for lagging in (False, True):
        print("\nlagging consumers" if lagging else "\nconsumers keeping up")
        for streams in args.streams:
            tokens = max(args.tokens, -(-args.min_outputs // streams))
            lag = 0.0
            if lagging:
                lag = args.lag if args.lag is not None else (
                    args.lag_steps * step_seconds[streams])
                print(f" N = {streams}, {tokens} tokens per request, {lag * 1000:.1f} ms "
                      "per read")
            else:
                print(f" N = {streams}, {tokens} tokens per request")
            queues = measure("queues/asyncio", streams, tokens, lag, args.repeats)
            frozen = measure("queues+freeze", streams, tokens, lag, args.repeats)
            if not lagging:
                step_seconds[streams] = queues.seconds / max(queues.steps, 1)
            ratios = []
            for backend in ("asyncio", "trio"):
                ours = measure(f"triollm/{backend}", streams, tokens, lag, args.repeats)
                ratios.append(f"{backend} {queues.seconds / ours.seconds:.2f}x "
                              f"({frozen.seconds / ours.seconds:.2f}x vs queues+freeze)")
            print(f"  triollm vs queues: {', '.join(ratios)}")

if __name__ == "__main__":
    main()
