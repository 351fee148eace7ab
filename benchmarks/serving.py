"""Online serving benchmark, in the spirit of vLLM's benchmark_serving.

Poisson arrivals at each ``--request-rate`` (``inf``: all at once), random prompt and
output lengths, streaming ``/v1/completions``. Reports request and output-token
throughput, and TTFT, TPOT, ITL and end-to-end latency (mean, median, p99).

Point it at any OpenAI-compatible server::

    python benchmarks/serving.py --base-url http://127.0.0.1:8000 --model MODEL

or let it save a random-weight Llama (~85M parameters, the test tokenizer) and launch
the servers itself, one after the other on the same model and workload::

    python benchmarks/serving.py --launch triollm transformers --request-rate 1 4 inf

(``transformers`` is ``transformers serve --continuous-batching``, pip extra
``transformers[serving]``.) Launched servers all start first and stay up (idle ones
use no CPU); each seed's workload then runs on each server in turn, the order
alternating from seed to seed, so a pair of runs is minutes apart, not a whole
benchmark. With several servers and seeds, a summary pairs each rate's runs seed by
seed and counts how often the first server's output throughput is the higher.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import anyio
import httpx

from common import percentiles, quantile, save_llama


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


async def one_request(http: httpx.AsyncClient, url: str, model: str, prompt: str,
                      max_tokens: int) -> RequestResult:
    # Greedy, no ignore_eos: `transformers serve` refuses fields it does not know.
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    times: list[float] = []  # events that carry text
    any_times: list[float] = []  # events that carry a choice (special tokens have no text)
    usage: dict[str, int] = {}
    try:
        async with http.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return RequestResult(False, error=(await response.aread()).decode()[:200])
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if event.get("usage"):
                    usage = event["usage"]
                choices = event.get("choices") or []
                if choices:
                    any_times.append(time.perf_counter())
                if any(choice.get("text") for choice in choices):
                    times.append(any_times[-1])
    except httpx.HTTPError as error:
        return RequestResult(False, error=repr(error))
    times = times or any_times
    if not times:
        return RequestResult(False, error="no tokens")
    tokens = usage.get("completion_tokens") or len(times)
    return RequestResult(True, prompt_tokens=usage.get("prompt_tokens", 0),
                         output_tokens=tokens, ttft=times[0] - start, e2e=times[-1] - start,
                         itl=[b - a for a, b in itertools.pairwise(times)])


async def run_rate(url: str, model: str, workload: list[tuple[str, int]], rate: float,
                   seed: int) -> tuple[list[RequestResult], float]:
    rng = random.Random(seed)
    results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=len(workload) + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        start = time.perf_counter()

        async def send(prompt: str, max_tokens: int) -> None:
            results.append(await one_request(http, url, model, prompt, max_tokens))

        async with anyio.create_task_group() as tasks:
            for index, (prompt, max_tokens) in enumerate(workload):
                # The gaps fall between arrivals only: a sleep after the last one would
                # add dead time to the run and to every server's elapsed time alike.
                if index and math.isfinite(rate):
                    await anyio.sleep(rng.expovariate(rate))
                tasks.start_soon(send, prompt, max_tokens)
        elapsed = time.perf_counter() - start
    return results, elapsed


@dataclass(frozen=True)
class RunSummary:
    output_throughput: float
    p99_tpot: float


def report(name: str, rate: float, seed: int, results: list[RequestResult],
           elapsed: float) -> RunSummary:
    ok = [r for r in results if r.ok]
    failed = len(results) - len(ok)
    tokens = sum(r.output_tokens for r in ok)
    print(f"\n[{name}] request rate {rate}, seed {seed}: {len(ok)} ok, {failed} failed, "
          f"{elapsed:.1f} s")
    if failed:
        print(f"  first failure: {next(r.error for r in results if not r.ok)}")
    print(f"  request throughput {len(ok) / elapsed:7.2f} req/s   output throughput "
          f"{tokens / elapsed:8.1f} tok/s")
    tpots = [t for r in ok if (t := r.tpot) is not None]
    print(f"  TTFT  {percentiles([r.ttft for r in ok])}")
    print(f"  TPOT  {percentiles(tpots)}")
    print(f"  ITL   {percentiles([x for r in ok for x in r.itl])}")
    print(f"  E2E   {percentiles([r.e2e for r in ok])}", flush=True)
    return RunSummary(tokens / elapsed, quantile(tpots, 0.99) if tpots else math.nan)


def sign_test(wins: int, trials: int) -> float:
    """One-sided p-value of at least ``wins`` of ``trials`` if each were a coin toss."""
    return sum(math.comb(trials, k) for k in range(wins, trials + 1)) / 2 ** trials


def print_pairs(runs: dict[tuple[float, int], dict[str, RunSummary]], labels: list[str]
                ) -> None:
    """Per rate, each seed's output throughput and p99 TPOT of the first server against
    each other one, and a sign test over the seeds."""
    first = labels[0]
    for other in labels[1:]:
        for rate in sorted({rate for rate, _ in runs}):
            pairs = [(seed, by[first], by[other]) for (r, seed), by in runs.items()
                     if r == rate]
            print(f"\n{first} vs {other}, request rate {rate}:")
            print(f"{'seed':>6} {'output tok/s':>22} {'ratio':>7} {'p99 TPOT (ms)':>20}")
            for seed, a, b in pairs:
                print(f"{seed:>6} {a.output_throughput:10.1f} vs {b.output_throughput:7.1f}"
                      f" {a.output_throughput / b.output_throughput:6.3f}x"
                      f" {1000 * a.p99_tpot:9.1f} vs {1000 * b.p99_tpot:7.1f}")
            wins = sum(a.output_throughput > b.output_throughput for _, a, b in pairs)
            ratios = [a.output_throughput / b.output_throughput for _, a, b in pairs]
            print(f"  output throughput higher in {wins} of {len(pairs)} seeds (geometric "
                  f"mean ratio {statistics.geometric_mean(ratios):.3f}x, one-sided sign test "
                  f"p = {sign_test(wins, len(pairs)):.4f}); p99 TPOT lower in "
                  f"{sum(a.p99_tpot < b.p99_tpot for _, a, b in pairs)} of {len(pairs)}",
                  flush=True)


def make_workload(args: argparse.Namespace, seed: int) -> list[tuple[str, int]]:
    from triollm.model.loader import demo_corpus

    words = " ".join(demo_corpus()).split()
    rng = random.Random(seed)
    workload = []
    for _ in range(args.num_prompts):
        start = rng.randrange(len(words))
        length = rng.randint(*args.prompt_words)
        prompt = " ".join((words[start:] + words)[:length])
        workload.append((prompt, rng.randint(*args.output_len)))
    return workload


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def launched(kind: str, model_dir: str, max_num_seqs: int) -> Iterator[tuple[str, str]]:
    port = free_port()
    if kind == "triollm":
        command = [sys.executable, "-m", "triollm", "serve", model_dir, "--host", "127.0.0.1",
                   "--port", str(port),
                   "--dtype", "bfloat16", "--max-model-len", "1024",
                   "--max-num-seqs", str(max_num_seqs), "--max-num-batched-tokens", "512",
                   "--disable-log-requests", "--log-level", "warning"]
        model = model_dir
    else:
        command = ["transformers", "serve", model_dir, "--continuous-batching", "--port",
                   str(port), "--host", "127.0.0.1", "--dtype", "bfloat16", "--device", "cpu",
                   "--cb-max-batch-tokens", "512", "--log-level", "warning"]
        model = model_dir
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{kind} server did not start (exit {process.poll()})")
            time.sleep(0.5)
        # Warm up (first requests load kernels, and transformers loads the model lazily).
        anyio.run(run_rate, url, model, [("warm up", 4)] * 2, math.inf, 0)
        yield url, model
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", help="an OpenAI-compatible server to measure")
    parser.add_argument("--model", help="model name to send (with --base-url)")
    parser.add_argument("--launch", nargs="+", choices=["triollm", "transformers"],
                        help="save a random-weight model and launch these servers (all stay up)")
    parser.add_argument("--request-rate", type=float, nargs="+", default=[1.0, 4.0, math.inf])
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--prompt-words", type=int, nargs=2, default=[16, 160])
    parser.add_argument("--output-len", type=int, nargs=2, default=[16, 96],
                        help="max_tokens range (a request may stop earlier at EOS)")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--seed", type=int, nargs="+", default=[0],
                        help="workload and arrival seeds; each one is a run per rate")
    args = parser.parse_args()
    print(f"{args.num_prompts} requests, prompts {args.prompt_words[0]}-{args.prompt_words[1]}"
          f" words, outputs {args.output_len[0]}-{args.output_len[1]} tokens (greedy)")
    if args.base_url:
        run_all({args.base_url: (args.base_url, args.model)}, args)
        return
    if not args.launch:
        parser.error("give --base-url or --launch")
    with tempfile.TemporaryDirectory() as model_dir, ExitStack() as servers:
        save_llama(model_dir, pad_token_id=3)
        urls: dict[str, tuple[str, str]] = {}
        for kind in args.launch:
            label = kind if kind not in urls else f"{kind}#{len(urls) + 1}"
            urls[label] = servers.enter_context(launched(kind, model_dir, args.max_num_seqs))
        run_all(urls, args)


def run_all(urls: dict[str, tuple[str, str]], args: argparse.Namespace) -> None:
    labels = list(urls)
    runs: dict[tuple[float, int], dict[str, RunSummary]] = {}
    for index, seed in enumerate(args.seed):
        workload = make_workload(args, seed)
        for rate in args.request_rate:
            # Alternate the order so that drift in the machine's speed favours no server.
            for label in labels if index % 2 == 0 else labels[::-1]:
                url, model = urls[label]
                results, elapsed = anyio.run(run_rate, url, model, workload, rate, seed)
                runs.setdefault((rate, seed), {})[label] = report(label, rate, seed, results,
                                                                  elapsed)
    if len(labels) > 1 and len(args.seed) > 1:
        print_pairs(runs, labels)


if __name__ == "__main__":
    main()
