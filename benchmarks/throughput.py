"""Offline throughput: triollm's ``LLM.generate`` against transformers, in one run.

Same random-weight model, same prompts, same per-request output lengths (ignore_eos,
greedy) for three engines:

* triollm ``LLM.generate`` (continuous batching, chunked prefill, paged KV cache);
* transformers ``model.generate`` with static batching: batches of ``max_num_seqs``
  requests, left-padded, each batch run to its longest request, counting only the
  tokens each request asked for;
* transformers' own continuous batching, the manager behind ``model.generate_batch``,
  given each request's own ``max_new_tokens`` (``generate_batch`` itself takes a
  single length for all requests, which would make it do more work than is counted);
* on request (``--engines triollm triollm-eager``), triollm with ``enforce_eager``:
  decode attention gathers KV blocks for SDPA instead of the compiled kernel;
* on request (``--engines triollm triollm-unpacked``), triollm with its linear layers
  left as loaded (aten's linear) instead of on oneDNN-packed weights. There is no
  engine option for this; the benchmark replaces the packing step with a no-op.

Reported: output tokens/s, ratios, and the fraction of the compute bound, i.e.
2 x parameters x tokens processed (prompt + output) over the bf16 matmul rate the
script measures on this machine.

    python benchmarks/throughput.py                       # the full run (slow on 2 cores)
    python benchmarks/throughput.py --num-requests 16 --models gpt2   # a quick look
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from unittest import mock

import torch
import transformers

from triollm import LLM, SamplingParams


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def model_config(name: str) -> transformers.PretrainedConfig:
    if name == "gpt2":  # GPT-2 small: 124M parameters
        return transformers.GPT2Config(n_embd=768, n_layer=12, n_head=12, n_positions=1024,
                                       vocab_size=50257, bos_token_id=50256,
                                       eos_token_id=50256)
    if name == "llama":  # Llama-family, ~125M parameters
        return transformers.LlamaConfig(hidden_size=768, intermediate_size=2048,
                                        num_hidden_layers=12, num_attention_heads=12,
                                        num_key_value_heads=12, vocab_size=32000,
                                        max_position_embeddings=1024, bos_token_id=1,
                                        eos_token_id=2, tie_word_embeddings=False)
    raise ValueError(f"unknown model {name!r}")


def make_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, vocab_size) for _ in range(rng.randint(*args.prompt_len))]
               for _ in range(args.num_requests)]
    outputs = [rng.randint(*args.output_len) for _ in range(args.num_requests)]
    return Workload(prompts, outputs)


def matmul_rate(dtype: torch.dtype, size: int = 2048, repeats: int = 10) -> float:
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    torch.matmul(a, b)
    start = time.perf_counter()
    for _ in range(repeats):
        torch.matmul(a, b)
    return 2 * size**3 * repeats / (time.perf_counter() - start)


def save_model(name: str, directory: str, seed: int) -> int:
    config = model_config(name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    # The engine needs a tokenizer to load; prompts are token ids, so any will do.
    from triollm.testing import train_test_tokenizer

    train_test_tokenizer().save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def run_triollm(path: str, workload: Workload, max_num_seqs: int,
                enforce_eager: bool = False, pack_linear: bool = True) -> float:
    packing = contextlib.nullcontext() if pack_linear else mock.patch(
        "triollm.model.runners.setup.pack_linear_layers", return_value=0)
    with packing:
        llm = LLM(path, dtype="bfloat16", max_num_seqs=max_num_seqs, max_model_len=1024,
                  max_num_batched_tokens=512, kv_cache_space_gb=2,
                  enforce_eager=enforce_eager)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
              for n in workload.output_lens]
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)  # type: ignore[arg-type]
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == workload.output_tokens, (produced, workload.output_tokens)
    del llm
    gc.collect()
    return elapsed


def load_hf(path: str, attn: str) -> transformers.PreTrainedModel:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, attn_implementation=attn).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@torch.inference_mode()
def run_static(path: str, workload: Workload, max_num_seqs: int) -> float:
    model = load_hf(path, "sdpa")
    start = time.perf_counter()
    for first in range(0, len(workload.prompts), max_num_seqs):
        batch = workload.prompts[first:first + max_num_seqs]
        longest = max(map(len, batch))
        ids = torch.zeros(len(batch), longest, dtype=torch.long)
        mask = torch.zeros(len(batch), longest, dtype=torch.long)
        for row, prompt in enumerate(batch):
            ids[row, longest - len(prompt):] = torch.tensor(prompt)
            mask[row, longest - len(prompt):] = 1
        new = max(workload.output_lens[first:first + max_num_seqs])
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                       min_new_tokens=new, do_sample=False)
    elapsed = time.perf_counter() - start
    del model
    gc.collect()
    return elapsed


def run_hf_continuous(path: str, workload: Workload, max_num_seqs: int) -> float:
    model = load_hf(path, "paged|sdpa")
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=max(
        workload.output_lens), eos_token_id=None, pad_token_id=0)
    start = time.perf_counter()
    with model.continuous_batching_context_manager(generation_config=config, block=True,
                                                   timeout=5) as manager:
        for prompt, new in zip(workload.prompts, workload.output_lens, strict=True):
            manager.add_request(input_ids=prompt, max_new_tokens=new)
        done = 0
        produced = 0
        while done < len(workload.prompts):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                done += 1
                produced += len(result.generated_tokens)
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching stopped early")
    elapsed = time.perf_counter() - start
    if produced != workload.output_tokens:
        logging.warning("transformers CB produced %d tokens, asked for %d", produced,
                        workload.output_tokens)
    del model
    gc.collect()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["gpt2", "llama"])
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(32, 256))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 256))
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--engines", nargs="+", default=["triollm", "static", "hf-cb"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    transformers.utils.logging.disable_progress_bar()

    rate = matmul_rate(torch.bfloat16)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"bf16 2048^3 matmul: {rate / 1e9:.0f} GFLOP/s")
    runners: dict[str, Callable[[str, Workload, int], float]] = {
        "triollm": run_triollm, "static": run_static, "hf-cb": run_hf_continuous,
        "triollm-eager": functools.partial(run_triollm, enforce_eager=True),
        "triollm-unpacked": functools.partial(run_triollm, pack_linear=False)}
    import tempfile

    for name in args.models:
        with tempfile.TemporaryDirectory() as directory:
            num_params = save_model(name, directory, args.seed)
            workload = make_workload(args, model_config(name).vocab_size)
            processed = workload.prompt_tokens + workload.output_tokens
            bound = 2 * num_params * processed / rate
            print(f"\n{name}: {num_params / 1e6:.0f}M parameters, {args.num_requests} requests, "
                  f"{workload.prompt_tokens} prompt + {workload.output_tokens} output tokens, "
                  f"max_num_seqs={args.max_num_seqs}; compute bound {bound:.1f} s")
            results: dict[str, float] = {}
            for engine in args.engines:
                elapsed = runners[engine](directory, workload, args.max_num_seqs)
                results[engine] = workload.output_tokens / elapsed
                print(f"  {engine:16s} {elapsed:7.1f} s  {results[engine]:8.1f} output tok/s  "
                      f"{bound / elapsed:6.1%} of compute bound", flush=True)
            if "triollm" in results:
                for engine, value in results.items():
                    if engine != "triollm":
                        print(f"  triollm / {engine}: {results['triollm'] / value:.2f}x")


if __name__ == "__main__":
    main()
