"""Multi-LoRA throughput: the same request mix over the base model alone and over 1, 4 and
16 distinct adapters, in one run.

The model is the benchmarks' random-weight Llama (benchmarks/common.py: 12 layers, hidden
768, ~85M parameters); the adapters are random PEFT adapters made with PEFT's own
``get_peft_model`` (rank ``--rank``, every attention and MLP projection, non-zero B).
Every configuration gets the same prompts and output lengths (greedy, ignore_eos);
with ``k`` adapters, request ``i`` runs adapter ``i % k`` and ``max_loras`` is ``k``, so
each step mixes all of them. Each configuration runs in a process of its own: load,
one warm-up request per adapter, then the whole batch through ``LLM.generate``, timed.

The base model runs first and last; the ratios are to the mean of those two runs.
Reported: output tokens/s, the ratio to the base model, and how many cores the rest of
the machine kept busy meanwhile (benchmarks/vs_vllm.py's ``LoadSampler``; over a tenth
of a core marks the figure contaminated).

    python benchmarks/lora.py                      # base, base with --enable-lora, 1, 4, 16
    python benchmarks/lora.py --adapters 4 --num-requests 32
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

from vs_vllm import CONTAMINATED_CORES, run_child

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def save_adapters(base: str, root: Path, count: int, rank: int) -> list[str]:
    from triollm.testing import build_lora_adapter

    return [str(build_lora_adapter(base, root / f"adapter-{index}", rank=rank, alpha=2 * rank,
                                   target_modules=TARGETS, seed=index, scale=0.02))
            for index in range(count)]


def make_workload(count: int, vocab: int, seed: int) -> dict[str, list[list[int]] | list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(rng.randint(64, 192))]
               for _ in range(count)]
    return {"prompts": prompts, "output_lens": [rng.randint(64, 160) for _ in range(count)]}


def child(model: str, workload_file: str, adapters_json: str, enable_lora: bool,
          max_num_seqs: int, rank: int) -> None:
    from triollm import LLM, LoRARequest, SamplingParams

    workload = json.loads(Path(workload_file).read_text())
    paths: list[str] = json.loads(adapters_json)
    requests = [LoRARequest(f"adapter-{i}", i + 1, path) for i, path in enumerate(paths)]
    llm = LLM(model, max_num_seqs=max_num_seqs, max_model_len=512,
              enable_lora=enable_lora,
              **({"max_loras": max(1, len(requests)), "max_lora_rank": rank}
                 if enable_lora else {}))
    prompts = [{"prompt_token_ids": p} for p in workload["prompts"]]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
              for n in workload["output_lens"]]
    loras = [requests[i % len(requests)] if requests else None for i in range(len(prompts))]
    warm = [None, *requests]
    llm.generate([prompts[0]] * len(warm), SamplingParams(max_tokens=4, ignore_eos=True),
                 use_tqdm=False, lora_request=warm)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print("RESULT " + json.dumps({"tokens": tokens, "elapsed": elapsed}), flush=True)


def run(label: str, model: str, workload_file: str, adapters: list[str], enable_lora: bool,
        max_num_seqs: int, rank: int) -> dict[str, float]:
    result, others = run_child(
        [sys.executable, __file__, "--child", model, workload_file, json.dumps(adapters),
         str(int(enable_lora)), str(max_num_seqs), str(rank)], label)
    return {"tok_s": result["tokens"] / result["elapsed"], "others_cores": others}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 16],
                        help="distinct adapter counts to measure (default: 1 4 16)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        model, workload, adapters, enable, seqs, rank = args.child
        child(model, workload, adapters, enable == "1", int(seqs), int(rank))
        return

    from transformers import AutoTokenizer

    from common import save_llama

    print(f"machine: {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} logical CPUs")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = str(root / "llama")
        save_llama(model)
        adapters = save_adapters(model, root, max(args.adapters), args.rank)
        vocab = len(AutoTokenizer.from_pretrained(model))
        workload_file = root / "workload.json"
        workload_file.write_text(json.dumps(make_workload(args.num_requests, vocab, args.seed)))
        configs = [("base model, LoRA off", [], False), ("base model, --enable-lora", [], True)]
        configs += [(f"{k} adapter{'s' if k > 1 else ''}", adapters[:k], True)
                    for k in args.adapters]
        # the base again at the end: the first and last runs bracket any drift of the
        # machine's speed (about 10% from run to run here)
        configs.append(("base model, LoRA off (again)", [], False))
        results = {}
        for label, paths, enable in configs:
            results[label] = run(label, model, str(workload_file), paths, enable,
                                 args.max_num_seqs, args.rank)
            print(f"  {label}: {results[label]['tok_s']:.1f} tok/s", flush=True)

    base = (results["base model, LoRA off"]["tok_s"]
            + results["base model, LoRA off (again)"]["tok_s"]) / 2
    print(f"\n{args.num_requests} requests, 64-192 prompt / 64-160 output tokens, "
          f"max_num_seqs {args.max_num_seqs}, rank {args.rank}, all 7 projections, bf16\n")
    print("| configuration | output tok/s | vs base | cost |")
    print("|---|---|---|---|")
    for label, result in results.items():
        flag = (f" (others {result['others_cores']:.2f} cores: contaminated)"
                if result["others_cores"] > CONTAMINATED_CORES else "")
        ratio = result["tok_s"] / base
        print(f"| {label} | {result['tok_s']:.1f}{flag} | {ratio:.2f}x | "
              f"{100 * (1 - ratio):.0f}% |")


if __name__ == "__main__":
    main()
