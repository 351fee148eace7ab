"""Co-serving latency-sensitive and throughput requests: fcfs vs priority vs slo.

A mixed workload (issue 5): ``--num-requests`` requests arriving as a Poisson process at
``--request-rate``; ``--sensitive-fraction`` of them are short latency-sensitive chats
with an SLO (seconds per output token), the rest long throughput requests. The SLO is
``--slo-factor`` times the decode step measured on this machine at the start of the
run (one request decoding alone). The same workload runs under each scheduling policy
in turn, in one process, on the same saved random-weight model, through
``AsyncLLMEngine`` (no HTTP). Under ``fcfs`` the sensitive requests are ordinary ones
(their SLO is still judged); under ``priority`` they get priority -1::

    python benchmarks/coserving.py
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field

import anyio
import torch
import transformers

from common import quantile, save_llama
from triollm import AsyncEngineArgs, AsyncLLMEngine, SamplingParams


@dataclass
class Job:
    at: float
    prompt: list[int]
    max_tokens: int
    sensitive: bool


@dataclass
class Outcome:
    policy: str
    elapsed: float = 0.0
    output_tokens: int = 0
    attained: int = 0
    sensitive: int = 0
    tpot: list[float] = field(default_factory=list)  # sensitive requests
    ttft: list[float] = field(default_factory=list)  # sensitive requests
    batch_e2e: list[float] = field(default_factory=list)

    @property
    def throughput(self) -> float:
        return self.output_tokens / self.elapsed


def make_jobs(args: argparse.Namespace, vocab_size: int) -> list[Job]:
    rng = random.Random(args.seed)
    jobs, now = [], 0.0
    sensitive_every = round(1 / args.sensitive_fraction)
    for index in range(args.num_requests):
        sensitive = index % sensitive_every == sensitive_every // 2
        prompt_len = rng.randint(*(args.sensitive_prompt if sensitive else args.batch_prompt))
        output_len = rng.randint(*(args.sensitive_output if sensitive else args.batch_output))
        jobs.append(Job(now, [rng.randrange(10, vocab_size) for _ in range(prompt_len)],
                        output_len, sensitive))
        now += rng.expovariate(args.request_rate)
    return jobs


def engine_args(path: str, args: argparse.Namespace, policy: str) -> AsyncEngineArgs:
    return AsyncEngineArgs(model=path, dtype="bfloat16", max_model_len=1024,
                           kv_cache_space_gb=2, max_num_seqs=args.max_num_seqs,
                           scheduling_policy=policy, disable_log_requests=True)


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                          detokenize=False)


async def measure_decode_step(path: str, args: argparse.Namespace) -> float:
    """Median time per output token of one request decoding alone."""
    async with AsyncLLMEngine.from_engine_args(engine_args(path, args, "fcfs")) as engine:
        tpots = []
        for attempt in range(3):
            async for output in engine.generate({"prompt_token_ids": [5 + attempt] * 32},
                                                params(64), f"calibrate-{attempt}"):
                if output.finished and output.metrics is not None:
                    assert output.metrics.time_per_output_token is not None
                    tpots.append(output.metrics.time_per_output_token)
    return statistics.median(tpots)


async def run_policy(path: str, args: argparse.Namespace, policy: str, jobs: list[Job],
                     slo: float) -> Outcome:
    outcome = Outcome(policy)

    async def one(index: int, job: Job, engine: AsyncLLMEngine) -> None:
        sensitive = job.sensitive and policy != "fcfs"
        start = time.perf_counter()
        async for output in engine.generate(
                {"prompt_token_ids": job.prompt}, params(job.max_tokens), f"r{index}",
                priority=-1 if sensitive and policy == "priority" else 0,
                is_latency_sensitive=sensitive, slo=slo if job.sensitive else None):
            if not output.finished:
                continue
            outcome.output_tokens += len(output.outputs[0].token_ids)
            metrics = output.metrics
            assert metrics is not None
            if job.sensitive:
                outcome.sensitive += 1
                outcome.attained += bool(metrics.slo_attained)
                assert metrics.time_per_output_token is not None
                assert metrics.time_to_first_token is not None
                outcome.tpot.append(metrics.time_per_output_token)
                outcome.ttft.append(metrics.time_to_first_token)
            else:
                outcome.batch_e2e.append(time.perf_counter() - start)

    async with AsyncLLMEngine.from_engine_args(engine_args(path, args, policy)) as engine:
        async for _ in engine.generate({"prompt_token_ids": [5] * 64}, params(8), "warm-up"):
            pass
        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for index, job in enumerate(jobs):
                await anyio.sleep_until(start + job.at)
                tg.start_soon(one, index, job, engine)
        outcome.elapsed = time.perf_counter() - start
    return outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--sensitive-fraction", type=float, default=0.1)
    parser.add_argument("--request-rate", type=float, default=2.0)
    parser.add_argument("--batch-prompt", type=int, nargs=2, default=(256, 640))
    parser.add_argument("--batch-output", type=int, nargs=2, default=(64, 160))
    parser.add_argument("--sensitive-prompt", type=int, nargs=2, default=(16, 64))
    parser.add_argument("--sensitive-output", type=int, nargs=2, default=(32, 64))
    parser.add_argument("--slo-factor", type=float, default=3.0)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--policies", nargs="+", default=["fcfs", "priority", "slo"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as directory:
        save_llama(directory)
        vocab = transformers.AutoConfig.from_pretrained(directory).vocab_size
        jobs = make_jobs(args, vocab)
        step = anyio.run(measure_decode_step, directory, args, backend="trio")
        slo = args.slo_factor * step
        sensitive = sum(job.sensitive for job in jobs)
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; decode step "
              f"alone {1000 * step:.1f} ms -> SLO {1000 * slo:.1f} ms per output token; "
              f"{len(jobs)} requests ({sensitive} latency-sensitive) over "
              f"{jobs[-1].at:.1f} s")
        outcomes = []
        for policy in args.policies:
            outcomes.append(anyio.run(run_policy, directory, args, policy, jobs, slo,
                                      backend="trio"))
            gc.collect()
    base = next((o for o in outcomes if o.policy == "fcfs"), outcomes[0])
    print("\n| policy | SLO attained | sensitive TPOT median / p99 | sensitive TTFT median / "
          "p99 | batch e2e median | output tok/s | vs fcfs |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for o in outcomes:
        print(f"| {o.policy} | {o.attained}/{o.sensitive} "
              f"({100 * o.attained / max(o.sensitive, 1):.0f}%) | "
              f"{1000 * statistics.median(o.tpot):.1f} / {1000 * quantile(o.tpot, 0.99):.1f} ms | "
              f"{1000 * statistics.median(o.ttft):.0f} / {1000 * quantile(o.ttft, 0.99):.0f} ms | "
              f"{statistics.median(o.batch_e2e):.1f} s | {o.throughput:.1f} | "
              f"{o.throughput / base.throughput:.2f}x |")


if __name__ == "__main__":
    main()
