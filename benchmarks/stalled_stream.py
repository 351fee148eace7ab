"""What a consumer that stops reading costs the engine's loop.

First the fold alone: ``RequestChannel.put`` of 1,000 to ``--tokens`` one-token DELTA
outputs behind a consumer that never reads (per-put cost should not grow with the
backlog). Then end to end: one request generates ``--tokens`` tokens (DELTA outputs,
one per step) over the zero-cost fake runner. Its consumer reads the first output, then
stops reading until the request has finished; a second run reads every output as it
comes. Behind a stalled consumer the engine folds each new output into the one it holds
pending, so the difference between the two runs is what that folding costs the loop.

    python benchmarks/stalled_stream.py --tokens 16000 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import anyio

from triollm import (
    AsyncEngineArgs,
    AsyncLLMEngine,
    CompletionOutput,
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
)
from triollm.engine.channel import RequestChannel
from triollm.engine.stats import IterationStats
from triollm.testing import FakeModelRunner


class FinishedEvent:
    """A stat logger that is set once a request has finished."""

    def __init__(self) -> None:
        self.event = anyio.Event()

    def record(self, stats: IterationStats) -> None:
        if stats.finished:
            self.event.set()


async def fold_only(num_outputs: int) -> float:
    """Seconds to put ``num_outputs`` one-token DELTA outputs into a channel whose
    consumer never reads."""
    channel = RequestChannel("stalled", RequestOutputKind.DELTA, 1, anyio.Event)
    outputs = [RequestOutput("stalled", None, [1, 2, 3], None, [CompletionOutput(
        0, "x", [i % 900], None, None)], finished=False) for i in range(num_outputs)]
    started = time.perf_counter()
    for output in outputs:
        channel.put(output)
    elapsed = time.perf_counter() - started
    merged = await channel.get()  # the first, buffered
    merged = await channel.get()  # the rest, folded
    assert len(merged.outputs[0].token_ids) == num_outputs - 1
    return elapsed


def save_long_context_config(directory: str, tokens: int) -> None:
    """A model folder with just a config and the test tokenizer: the fake runner needs
    no weights, only a context long enough for ``tokens``."""
    import transformers

    from triollm.testing import tiny_config, train_test_tokenizer

    tokenizer = train_test_tokenizer()
    tiny_config("llama", len(tokenizer), max_position_embeddings=tokens + 64
                ).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    assert transformers.AutoConfig.from_pretrained(directory).max_position_embeddings > tokens


async def one_run(model: str, tokens: int, stall: bool) -> float:
    args = AsyncEngineArgs(model=model, max_model_len=tokens + 8, max_num_batched_tokens=tokens + 8,
                           disable_log_requests=True, num_gpu_blocks_override=tokens // 16 + 8)
    runner = FakeModelRunner(num_kv_blocks=tokens // 16 + 8, vocab_size=900)
    finished = FinishedEvent()
    engine = AsyncLLMEngine.from_engine_args(args, runner_factory=lambda: runner,
                                             stat_loggers=[finished])
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, detokenize=False,
                            output_kind=RequestOutputKind.DELTA)
    received = 0
    async with engine:
        started = time.perf_counter()
        stream = engine.generate({"prompt_token_ids": [5, 6, 7]}, params, "stalled")
        async for output in stream:
            received += len(output.outputs[0].token_ids)
            if stall:
                await finished.event.wait()
        elapsed = time.perf_counter() - started
    assert received == tokens, received
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--backend", default="trio", choices=["trio", "asyncio"])
    options = parser.parse_args()
    sizes = sorted({1000, options.tokens // 4, options.tokens})
    for size in sizes:
        fold = min(anyio.run(fold_only, size, backend=options.backend) for _ in range(3))
        print(f"fold alone: {size} puts behind a stalled reader: {fold * 1000:.1f} ms "
              f"({fold / size * 1e6:.2f} us per put, best of 3)")
    model = tempfile.mkdtemp(prefix="stalled-stream-")
    save_long_context_config(model, options.tokens)
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(options.repeats):
        for stall in (False, True):  # alternate, so machine drift falls on both
            times[stall].append(anyio.run(one_run, model, options.tokens, stall,
                                          backend=options.backend))
    reading, stalled = (statistics.median(times[s]) for s in (False, True))
    print(f"{options.tokens} tokens on {options.backend}, median of {options.repeats}: "
          f"reader keeps up {reading * 1000:.0f} ms, reader stalled {stalled * 1000:.0f} ms, "
          f"stall costs {(stalled - reading) * 1000:+.0f} ms")


if __name__ == "__main__":
    main()
