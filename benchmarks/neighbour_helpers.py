"""The C kernels' helper threads beside a busy neighbour, on and off in one process.

vs_vllm.py's neighbour rows compare each engine quiet and beside a busy-loop process,
with the thread policy choosing the helpers in the busy rounds. This measures only what
the helpers (src/triollm/model/cpu/helpers.py) change: one ``LLM`` on vs_vllm.py's 27m
(or 85m) model and small offline workload, a ``while True: pass`` process beside it
throughout, and rounds that run the workload once with the kernels' helpers and once
without (``set_spare_threads`` 1 / 0 on the model thread, which is this thread for
``LLM``), alternating so both see the same machine. Prints each round and the medians.

    python benchmarks/neighbour_helpers.py [--model 27m] [--rounds 6]

The thread policy is left as it is: beside the neighbour it computes on one thread in
both modes (each round prints the count).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

import vs_vllm
from triollm import LLM, SamplingParams
from triollm.model.cpu import helpers as cpu_helpers
from triollm.model.cpu import threads as cpu_threads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", choices=sorted(vs_vllm.MODELS), default="27m")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        vocab = vs_vllm.save_model(args.model, directory)
        workload = vs_vllm.make_workloads(vocab, seed=0)["small"]
        prompts = [{"prompt_token_ids": ids} for ids in workload["prompts"]]
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                                 detokenize=False) for n in workload["output_lens"]]
        tokens = sum(workload["output_lens"])
        # The policy would set the count itself on each change; here the rounds do.
        cpu_threads.set_spare_threads = lambda count: None  # type: ignore[assignment]
        rates: dict[str, list[float]] = {"helpers": [], "no helpers": []}
        with vs_vllm.busy_neighbour(True):
            llm = LLM(directory, dtype="bfloat16", max_model_len=1024,
                      max_num_seqs=vs_vllm.OFFLINE["small"][3])
            llm.generate(prompts[:8], params[:8], use_tqdm=False)  # the policy adapts
            for round_ in range(args.rounds):
                for mode in rates:
                    cpu_helpers.set_spare_threads(1 if mode == "helpers" else 0)
                    started = time.perf_counter()
                    llm.generate(prompts, params, use_tqdm=False)  # type: ignore[arg-type]
                    rate = tokens / (time.perf_counter() - started)
                    rates[mode].append(rate)
                    print(f"round {round_ + 1}, {mode}: {rate:.1f} tok/s "
                          f"({torch.get_num_threads()} compute thread(s))", flush=True)
        for mode, values in rates.items():
            print(f"{mode}: median {statistics.median(values):.1f} tok/s, "
                  f"range {min(values):.1f}-{max(values):.1f}")
        medians = {mode: statistics.median(values) for mode, values in rates.items()}
        print(f"helpers / no helpers (medians): "
              f"{medians['helpers'] / medians['no helpers']:.2f}x")


if __name__ == "__main__":
    main()
