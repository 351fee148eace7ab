"""Weight-only quantization against bf16: decode tokens/s at batch 1, 4 and 16 and
prefill tokens/s, for ``--quantization int4`` and ``int8`` and the bf16 model, in one run.

The model has Qwen2.5-0.5B's shape (24 layers, hidden 896, MLP 4864, 14 query and 2
key-value heads, its 151,936-token vocabulary with the LM head tied to the embeddings),
or with ``--shape llama-3.2-1b`` Llama-3.2-1B's (16 layers, hidden 2048, MLP 8192, 32
query and 8 key-value heads, 128,256 tokens, tied), with random bf16 weights;
quantization replaces the decoder's linear layers, and the tied head computes on an int8
copy, its greedy rows (all of them here) ranking on an int4 copy and recomputing their
candidates on the bf16 weight (the embeddings stay bf16; see
model/quantization/rescored_head.py). Each configuration runs in a process of its own,
which loads (and compiles, at ``--optimization-level``) once; the processes then take
turns, ``--rounds`` times, each warming up and measuring while the others wait, so that
a change in the machine's memory speed during the run reaches every mode alike. A
measurement is

- decode at batch ``b``: ``b`` prompts of 32 tokens generating ``--decode-tokens``
  (greedy, ignore_eos), minus the same prompts generating one token, over the tokens
  decoded after the first;
- prefill: one prompt of ``--prefill-tokens`` generating one token.

Reported: each round's tokens/s and how many cores the rest of the machine (the waiting
modes' processes included) kept busy meanwhile (benchmarks/vs_vllm.py's
``LoadSampler``; over a tenth of a core marks the figure contaminated); then per mode
the median over rounds, and the median, lowest and highest of its ratio to bf16 measured
in the same round.

    python benchmarks/quantization.py
    python benchmarks/quantization.py --modes bf16 int4 --batches 1 --optimization-level 0
    python benchmarks/quantization.py --batches 1 --rounds 5
    python benchmarks/quantization.py --shape llama-3.2-1b
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from vs_vllm import (
    CONTAMINATED_CORES,
    LoadSampler,
    offline_env,
    platform_line,
    process_cpu_seconds,
    process_tree,
)

#: Per shape: its transformers config class; hidden, intermediate, layers, query heads,
#: key-value heads, vocabulary (each with its LM head tied to the embeddings).
SHAPES = {"qwen2.5-0.5b": ("Qwen2Config", (896, 4864, 24, 14, 2, 151936)),
          "llama-3.2-1b": ("LlamaConfig", (2048, 8192, 16, 32, 8, 128256))}


def model_config(shape: str = "qwen2.5-0.5b") -> Any:
    """The transformers config of the model of ``shape`` (``SHAPES``)."""
    import transformers

    config_class, (hidden, intermediate, layers, heads, kv_heads, vocab) = SHAPES[shape]
    return getattr(transformers, config_class)(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
        max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2)


def save_model(directory: str, shape: str = "qwen2.5-0.5b") -> None:
    import torch
    import transformers

    from triollm.testing import train_test_tokenizer

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(model_config(shape),
                                                          dtype=torch.bfloat16)
    with torch.no_grad():  # weights of a trained model's scale, not init's 0.02 everywhere
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0, parameter.shape[1] ** -0.5)
    model.save_pretrained(directory)
    train_test_tokenizer().save_pretrained(directory)


def child(model: str, mode: str, batches: list[int], decode_tokens: int,
          prefill_tokens: int, optimization_level: int, repeats: int) -> None:
    """Load ``mode``'s engine, print ``READY``, then measure once per line read from
    stdin (one ``RESULT`` line each) until stdin closes."""
    from triollm import LLM, SamplingParams

    quantization = None if mode == "bf16" else mode
    started = time.perf_counter()
    llm = LLM(model, dtype="bfloat16", max_model_len=max(prefill_tokens + 8, 512),
              max_num_seqs=max(batches), max_num_batched_tokens=max(prefill_tokens, 2048),
              quantization=quantization, optimization_level=optimization_level,
              enable_prefix_caching=False)
    load_s = time.perf_counter() - started
    print(f"READY {load_s}", flush=True)
    for _ in sys.stdin:
        print("RESULT " + json.dumps(measure(llm, SamplingParams, load_s, batches,
                                             decode_tokens, prefill_tokens, repeats)),
              flush=True)


class LiveChild:
    """A mode's measuring process (``child``), loaded once and measured on request, so
    that the modes' measurements can take turns within one run."""

    def __init__(self, command: list[str], what: str) -> None:
        self.what = what
        self.process = subprocess.Popen(command, env=offline_env(), stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        self.load_s = float(self._line("READY "))

    def _line(self, prefix: str) -> str:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(prefix):
                return line[len(prefix):]
        raise RuntimeError(f"{self.what} exited with {self.process.wait()} before {prefix!r}")

    def measure(self, idle: list[LiveChild]) -> tuple[dict[str, float], float]:
        """One measurement; and the cores the rest of the machine used meanwhile,
        counting the ``idle`` children's (which are ours, so ``LoadSampler`` skips them)."""
        assert self.process.stdin is not None
        idle_pids = {child.process.pid for child in idle}
        before = _tree_seconds(idle_pids)
        started = time.monotonic()
        sampler = LoadSampler(set())
        self.process.stdin.write("measure\n")
        self.process.stdin.flush()
        result = json.loads(self._line("RESULT "))
        others = sampler.others_cores()
        idle_cores = (_tree_seconds(idle_pids) - before) / (time.monotonic() - started)
        return result, others + idle_cores

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _tree_seconds(roots: set[int]) -> float:
    """CPU seconds used so far by the processes ``roots`` and their descendants."""
    processes = process_cpu_seconds()
    return sum(processes[pid][0] for pid in process_tree(roots, processes))


def measure(llm: Any, sampling_params: Any, load_s: float, batches: list[int],
            decode_tokens: int, prefill_tokens: int, repeats: int) -> dict[str, float]:
    """Decode tok/s at each batch size and prefill tok/s of ``llm`` (triollm's or vLLM's
    ``LLM``, with its ``SamplingParams``), best of ``repeats``, after one warm-up."""
    rng = random.Random(0)

    def prompts(count: int, length: int) -> list[dict[str, list[int]]]:
        return [{"prompt_token_ids": [rng.randrange(10, 1000) for _ in range(length)]}
                for _ in range(count)]

    def seconds(batch: list[dict[str, list[int]]], tokens: int) -> float:
        params = sampling_params(temperature=0, max_tokens=tokens, ignore_eos=True)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            llm.generate(batch, params, use_tqdm=False)
            best = min(best, time.perf_counter() - start)
        return best

    seconds(prompts(1, 32), 4)  # warm-up
    result: dict[str, float] = {"load_s": load_s}
    for size in batches:
        batch = prompts(size, 32)
        decode = seconds(batch, decode_tokens) - seconds(batch, 1)
        result[f"decode_b{size}"] = size * (decode_tokens - 1) / decode
    result["prefill"] = prefill_tokens / seconds(prompts(1, prefill_tokens), 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", default=["bf16", "int8", "int4"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--decode-tokens", type=int, default=33)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--optimization-level", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shape", choices=list(SHAPES), default="qwen2.5-0.5b")
    args = parser.parse_args()
    print(f"# {platform_line()}; Python {platform.python_version()}; {args.shape} shape")
    keys = [f"decode_b{size}" for size in args.batches] + ["prefill"]
    rounds: list[dict[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory() as directory, contextlib.ExitStack() as stack:
        save_model(directory, args.shape)
        children = {}
        for mode in args.modes:  # one at a time: loading (compiling) is CPU-bound
            children[mode] = LiveChild(
                [sys.executable, __file__, "--child", directory, mode,
                 json.dumps(args.batches), str(args.decode_tokens),
                 str(args.prefill_tokens), str(args.optimization_level),
                 str(args.repeats)], mode)
            stack.callback(children[mode].close)
            print(f"{mode}: loaded in {children[mode].load_s:.0f} s", flush=True)
        for number in range(args.rounds):
            results = {}
            for mode, live in children.items():
                results[mode], others = live.measure(
                    [other for other in children.values() if other is not live])
                flag = "  CONTAMINATED" if others > CONTAMINATED_CORES else ""
                print(f"round {number + 1} {mode}: " + " ".join(
                    f"{key} {results[mode][key]:.1f}" for key in keys)
                    + f"; others used {others:.2f} cores{flag}", flush=True)
            rounds.append(results)
    print(f"median of {args.rounds} rounds, tok/s (ratio to bf16 in the same round: "
          "median, lowest-highest)")
    print(f"{'tok/s':>8}" + "".join(f"{key:>28}" for key in keys))
    for mode in args.modes:
        cells = ""
        for key in keys:
            cell = f"{statistics.median(r[mode][key] for r in rounds):.1f}"
            if "bf16" in args.modes:
                ratios = sorted(r[mode][key] / r["bf16"][key] for r in rounds)
                cell += (f" ({statistics.median(ratios):.2f}x, "
                         f"{ratios[0]:.2f}-{ratios[-1]:.2f})")
            cells += cell.rjust(28)
        print(f"{mode:>8}{cells}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), int(sys.argv[5]),
              int(sys.argv[6]), int(sys.argv[7]), int(sys.argv[8]))
    else:
        main()
