"""The engine in its own process and data parallelism: what they cost and gain, in one run.

Runs one workload (``--requests`` concurrent greedy requests of ``--max-tokens`` tokens,
``--rounds`` times) through three engines of the same model, one after the other, in
this process's event loop (trio):

* ``in-process``: ``AsyncLLMEngine`` (the model thread in this process);
* ``process x1``: ``EngineClient`` with one engine process (``VLLM_ENABLE_V1_MULTIPROCESSING=1``);
* ``process x2``: ``EngineClient`` with ``data_parallel_size=2``, each replica on its
  own share of the cores.

Reported per engine: output tokens/s, mean time per output token, engine steps, and
for the engine processes the wall time per step over the in-process engine's (the
per-step cost of the socket, pickling and the second event loop, where both run the
same steps), with the CPU the rest of the machine used meanwhile (vs_vllm.py's
``LoadSampler``, in cores): a figure taken while others used more than a tenth of a
core is noisy.

    python benchmarks/engine_process.py                 # the benchmarks' 85M Llama
    python benchmarks/engine_process.py --model triollm/tiny-demo --requests 16
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

import anyio

from common import save_llama
from triollm import AsyncEngineArgs, AsyncLLMEngine, SamplingParams
from triollm.engine.process.client import EngineClient
from vs_vllm import LoadSampler


async def workload(engine: Any, options: argparse.Namespace) -> tuple[int, float, list[float]]:
    """(tokens, seconds, each request's mean time per output token) over the rounds."""
    params = SamplingParams(max_tokens=options.max_tokens, temperature=0, ignore_eos=True)
    tokens = 0
    tpots: list[float] = []

    async def one(round_: int, index: int) -> None:
        nonlocal tokens
        prompt = {"prompt_token_ids": [5 + index % 50, 6, 7, 8 + round_ % 50] * 4}
        first = last = 0.0
        count = 0
        async for output in engine.generate(prompt, params, f"r{round_}-{index}"):
            last = time.perf_counter()
            if count == 0:
                first = last
            count = len(output.outputs[0].token_ids)
        tokens += count
        if count > 1:
            tpots.append((last - first) / (count - 1))

    started = time.perf_counter()
    for round_ in range(options.rounds):
        async with anyio.create_task_group() as task_group:
            for index in range(options.requests):
                task_group.start_soon(one, round_, index)
    return tokens, time.perf_counter() - started, tpots


async def measure(name: str, engine: Any, options: argparse.Namespace,
                  base: float | None) -> float:
    async with engine:
        await workload(engine, options)  # warm-up
        steps_before = engine.statistics().num_steps
        sampler = LoadSampler(set())
        tokens, seconds, tpots = await workload(engine, options)
        others = sampler.others_cores()
        steps = engine.statistics().num_steps - steps_before
    per_step = seconds / max(steps, 1)
    # replicas' steps overlap: a per-step figure compares only one engine with another
    extra = (f"  {1000 * (per_step - base):+6.2f} ms/step vs in-process"
             if base is not None and engine.data_parallel_size == 1 else "")
    print(f"{name:12s} {tokens / seconds:8.1f} tok/s  mean TPOT "
          f"{1000 * statistics.fmean(tpots):6.1f} ms  {steps:5d} steps  "
          f"{1000 * per_step:6.2f} ms/step{extra}  others {others:.2f} cores", flush=True)
    return per_step


async def main_async(options: argparse.Namespace, model: str) -> None:
    kwargs = dict(model=model, max_model_len=512, optimization_level=options.optimization_level,
                  disable_log_stats=True)
    base = await measure("in-process", AsyncLLMEngine.from_engine_args(
        AsyncEngineArgs(**kwargs)), options, None)
    await measure("process x1", EngineClient.from_engine_args(
        AsyncEngineArgs(**kwargs)), options, base)
    await measure("process x2", EngineClient.from_engine_args(
        AsyncEngineArgs(**kwargs, data_parallel_size=2)), options, base)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None,
                        help="a model (default: the benchmarks' 85M Llama, saved to a "
                             "temporary directory)")
    parser.add_argument("--requests", type=int, default=8, help="concurrent requests")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--optimization-level", type=int, default=0)
    options = parser.parse_args()
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; "
          f"{options.rounds} rounds of {options.requests} requests x "
          f"{options.max_tokens} tokens", flush=True)
    with tempfile.TemporaryDirectory() as directory:
        model = options.model
        if model is None:
            save_llama(directory)
            model = directory
        anyio.run(main_async, options, model, backend="trio")


if __name__ == "__main__":
    main()
