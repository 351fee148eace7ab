"""Prefix caching on vs off, in one run: many requests that share a long system prompt.

The workload follows issue 5: ``--num-requests`` (64) requests whose prompts start with
the same ``--system-len`` (512) token system prompt and end in a short suffix of their
own. The first request runs alone (it fills the cache when caching is on); the rest
then arrive as a Poisson process at ``--request-rate`` (``inf``: all at once). Each
configuration runs in the same process on the same saved random-weight model, through
``AsyncLLMEngine`` (no HTTP), and reports time to first token of the requests after the
first, output throughput and the prefix-cache hit rate::

    python benchmarks/prefix_caching.py --request-rate inf 4
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import anyio
import torch
import transformers

from common import percentiles, save_llama
from triollm import AsyncEngineArgs, AsyncLLMEngine, SamplingParams


@dataclass
class Result:
    ttft: list[float]  # requests after the first
    first_ttft: float
    output_tokens: int
    elapsed: float
    hit_rate: float

    @property
    def throughput(self) -> float:
        return self.output_tokens / self.elapsed


def make_prompts(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    system = [rng.randrange(10, vocab_size) for _ in range(args.system_len)]
    return [system + [rng.randrange(10, vocab_size)
                      for _ in range(rng.randint(*args.suffix_len))]
            for _ in range(args.num_requests)]


async def run(path: str, prompts: list[list[int]], args: argparse.Namespace,
              caching: bool, rate: float) -> Result:
    engine_args = AsyncEngineArgs(
        model=path, dtype="bfloat16", max_model_len=2048, kv_cache_space_gb=2,
        max_num_seqs=args.max_num_seqs, enable_prefix_caching=caching,
        disable_log_requests=True)
    rng = random.Random(args.seed + 1)
    ttft: dict[int, float] = {}
    produced = 0

    async def one(index: int, engine: AsyncLLMEngine) -> None:
        nonlocal produced
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True,
                                detokenize=False)
        start = time.perf_counter()
        async for output in engine.generate({"prompt_token_ids": prompts[index]}, params,
                                            f"{caching}-{index}"):
            if index not in ttft and output.outputs[0].token_ids:
                ttft[index] = time.perf_counter() - start
            if output.finished:
                produced += len(output.outputs[0].token_ids)

    async with AsyncLLMEngine.from_engine_args(engine_args) as engine:
        # Warm-up on an unrelated prompt, then forget it so both runs start cold.
        async for _ in engine.generate({"prompt_token_ids": [5] * 40},
                                       SamplingParams(max_tokens=2), "warm-up"):
            pass
        await engine.reset_prefix_cache()
        start = time.perf_counter()
        await one(0, engine)
        async with anyio.create_task_group() as tg:
            for index in range(1, len(prompts)):
                if index > 1 and math.isfinite(rate):  # gaps between arrivals, none after
                    await anyio.sleep(rng.expovariate(rate))
                tg.start_soon(one, index, engine)
        elapsed = time.perf_counter() - start
        stats = engine.statistics()
        queries = stats.prefix_cache_queries
        hit_rate = stats.prefix_cache_hits / queries if queries else 0.0
    return Result([ttft[i] for i in range(1, len(prompts))], ttft[0], produced, elapsed,
                  hit_rate)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--system-len", type=int, default=512)
    parser.add_argument("--suffix-len", type=int, nargs=2, default=(16, 48))
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--request-rate", type=float, nargs="+", default=[math.inf])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{sys.platform}; {args.num_requests} requests, {args.system_len}-token shared "
          f"prefix, suffix {args.suffix_len[0]}-{args.suffix_len[1]}, "
          f"{args.output_len} output tokens each")
    with tempfile.TemporaryDirectory() as directory:
        save_llama(directory, max_position_embeddings=2048)
        vocab = transformers.AutoConfig.from_pretrained(directory).vocab_size
        prompts = make_prompts(args, vocab)
        for rate in args.request_rate:
            results = {}
            for caching in (False, True):
                results[caching] = anyio.run(run, directory, prompts, args, caching, rate,
                                             backend="trio")
                gc.collect()
            off, on = results[False], results[True]
            print(f"\nrequest rate {rate}/s (after the first request)")
            for name, result in (("caching off", off), ("caching on ", on)):
                print(f"  {name}: TTFT {percentiles(result.ttft)}; first request "
                      f"{1000 * result.first_ttft:.1f} ms; {result.throughput:7.1f} "
                      f"output tok/s; prefix-cache hit rate {100 * result.hit_rate:.1f}%")
            print(f"  TTFT after the first, off/on: mean "
                  f"{statistics.fmean(off.ttft) / statistics.fmean(on.ttft):.2f}x, median "
                  f"{statistics.median(off.ttft) / statistics.median(on.ttft):.2f}x; "
                  f"throughput on/off {on.throughput / off.throughput:.2f}x")


if __name__ == "__main__":
    main()
