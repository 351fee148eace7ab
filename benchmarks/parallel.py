"""Tensor parallelism on this machine: decode step time with 2 ranks against 1, the time
the driver spends in collectives per step, and the executors' own cost per step.

Per configuration, in a process of its own (eager forward for every rank count: tensor
parallelism runs eagerly, so 1 rank eager is its baseline): load, warm up, then decode
``--batch`` prompts of 16 tokens for ``--decode-tokens`` tokens (greedy, ignore_eos)
and for one token; the difference over the extra tokens is one decode step. For 2 ranks
also, over the same steps:

- ``comm``: seconds the driver spent in all-reduces and the logits' gather, per step;
- ``send``: seconds the driver spent handing the step's message to the executor (mp:
  pickle and pipe writes; ray: actor calls), per step.

Models: the tiny Llama of the test suite and the Qwen2.5-0.5B shape of
benchmarks/quantization.py (random bf16 weights). Reported with how many cores the rest
of the machine kept busy (benchmarks/vs_vllm.py's ``LoadSampler``).

    python benchmarks/parallel.py
    python benchmarks/parallel.py --models tiny --backends mp --decode-tokens 32
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from vs_vllm import CONTAMINATED_CORES, platform_line, run_child

PROMPT_TOKENS = 16


def child(model: str, tp: int, backend: str, batch: int, decode_tokens: int,
          dtype: str) -> None:
    from triollm import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, max_model_len=256, tensor_parallel_size=tp,
              distributed_executor_backend=backend, optimization_level=0,
              num_gpu_blocks_override=64)
    runner: Any = llm.engine.runner
    prompts = [{"prompt_token_ids": [10 + i + j for j in range(PROMPT_TOKENS)]}
               for i in range(batch)]
    sent = [0.0]
    if tp > 1:
        send = runner.executor.send

        def timed_send(message: bytes) -> None:
            started = time.perf_counter()
            send(message)
            sent[0] += time.perf_counter() - started

        runner.executor.send = timed_send

    def run(tokens: int) -> tuple[float, float, float]:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        if tp > 1:
            runner.group.take_comm_seconds()
        sent[0] = 0.0
        started = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        comm = runner.group.take_comm_seconds() if tp > 1 else 0.0
        return seconds, comm, sent[0]

    run(4)  # warm-up
    long, short = run(decode_tokens), run(1)
    steps = decode_tokens - 1
    result = {name: (a - b) / steps for name, a, b in zip(("step", "comm", "send"), long,
                                                          short, strict=True)}
    if tp > 1:
        runner.shutdown()
    print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "qwen0.5b"])
    parser.add_argument("--backends", nargs="+", default=["mp", "ray"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--decode-tokens", type=int, default=24)
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        model, tp, backend, batch, tokens, dtype = args.child
        child(model, int(tp), backend, int(batch), int(tokens), dtype)
        return
    print(platform_line())
    with tempfile.TemporaryDirectory() as root:
        for name in args.models:
            directory = str(Path(root) / name)
            if name == "tiny":
                from triollm.testing import build_tiny_model

                build_tiny_model("llama", directory)
                dtype = "float32"
            else:
                from quantization import save_model

                save_model(directory)
                dtype = "bfloat16"
            configs = [(1, "uni")] + [(2, backend) for backend in args.backends]
            base = None
            for tp, backend in configs:
                command = [sys.executable, __file__, "--child", directory, str(tp), backend,
                           str(args.batch), str(args.decode_tokens), dtype]
                try:
                    result, others = run_child(command, f"{name} tp={tp} {backend}")
                except RuntimeError as error:
                    print(f"{name:9} tp={tp} {backend:4}: failed: {str(error)[-300:]}")
                    continue
                base = base or result["step"]
                mark = " (contaminated)" if others > CONTAMINATED_CORES else ""
                print(f"{name:9} tp={tp} {backend:4} batch {args.batch}: step "
                      f"{result['step'] * 1e3:7.2f} ms ({base / result['step']:.2f}x of 1 "
                      f"rank), comm {result['comm'] * 1e3:6.2f} ms, send "
                      f"{result['send'] * 1e3:5.3f} ms; others busy {others:.2f} cores"
                      f"{mark}", flush=True)


if __name__ == "__main__":
    main()
