"""Speculative decoding (n-gram and draft model) against plain decoding: decode
tokens/s at batch 1 and 4 on a grounded workload (prompt lookup finds matches) and on
one without matches, with and without ``--speculative-config``, in one run.

The model has Qwen2.5-0.5B's shape with random bf16 weights (benchmarks/quantization.py
builds it). Random weights summarise nothing, so the workloads are made from the
model's own behaviour, once, in a first process:

- candidates: 12 prompts of 32 random tokens, each continued greedily for
  ``--lookahead-tokens`` tokens (192);
- grounded: the 4 candidates whose last 64 tokens of continuation prompt lookup
  predicts best (the model has settled into a loop by then). The prompt is the
  candidate and its whole continuation, so the text the model goes on writing repeats
  what the prompt holds, as in summarising or editing a given text;
- no match: the 4 candidates whose continuation it predicts worst, the prompt alone.

The draft model (``draft_model``) is the target's own first ``--draft-layers`` decoder
layers with its final norm and (tied) head: a random model has no smaller sibling that
agrees with it, and a truncated copy is the cheapest honest one; its acceptance rate is
reported as measured.

Each configuration then runs in a process of its own: load (and compile, at
``--optimization-level``), warm up, then for each workload and batch ``b``: ``b``
prompts generating ``--decode-tokens`` (greedy, ignore_eos), timed from the last of
their first tokens to the last of their last tokens (each request's own token times), over
the tokens decoded after the first; the best of ``--repeats``. (Subtracting a run of one
token from a run of all of them, as this did before, left the prefill's run-to-run
spread in the figure: the grounded prompts' prefill takes seconds.) Reported: tokens/s, the
speed-up, the draft acceptance rate, and how many cores the rest of the machine kept
busy meanwhile (over a tenth of a core marks the figure contaminated).

    python benchmarks/speculative.py
    python benchmarks/speculative.py --num-speculative-tokens 5 --optimization-level 0
    python benchmarks/speculative.py --draft-layers 6
    python benchmarks/speculative.py --methods ngram --paired-rounds 8   # one process

With ``--paired-rounds R`` every configuration's engine is loaded in one process and
measured in turn, one generation each, R times; reported per cell is the median of the
rounds' ratios to plain and their range, which compares runs seconds apart in one
process instead of separate processes (whose spread was about 10%). With
``--control`` a second plain engine is measured like the others: its ratio is what two
identical engines differ by, the yardstick for the others'.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from typing import Any

from quantization import save_model
from vs_vllm import CONTAMINATED_CORES, platform_line, run_child

CANDIDATES = 12
PROMPT_TOKENS = 32
#: Of each candidate's continuation, the last tokens prompt lookup is scored on.
SCORED_TOKENS = 64
WORKLOAD_SIZE = 4
#: The dtype the engines compute in (``--dtype``; children read it from the environment).
DTYPE_VARIABLE = "SPECULATIVE_BENCHMARK_DTYPE"


def dtype() -> str:
    return os.environ.get(DTYPE_VARIABLE, "bfloat16")


def predicted_fraction(prompt: list[int], output: list[int], low: int, high: int) -> float:
    """How many of ``output``'s tokens prompt lookup proposes as the next token."""
    from triollm.engine.speculative.ngram import NgramIndex

    index = NgramIndex(low, high)
    tokens = list(prompt)
    hits = 0
    for token in output:
        hits += index.propose(tokens, 1) == [token]
        tokens.append(token)
    return hits / len(output)


def save_draft(model: str, directory: str, layers: int) -> None:
    """The target at ``model`` cut to its first ``layers`` decoder layers."""
    import torch
    import transformers

    draft = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    draft.model.layers = draft.model.layers[:layers]
    draft.config.num_hidden_layers = layers
    if getattr(draft.config, "layer_types", None):
        draft.config.layer_types = draft.config.layer_types[:layers]
    draft.save_pretrained(directory)
    transformers.AutoTokenizer.from_pretrained(model).save_pretrained(directory)


def select(model: str, path: str, low: int, high: int, optimization_level: int,
           lookahead: int) -> None:
    from triollm import LLM, SamplingParams

    llm = LLM(model, dtype=dtype(), max_model_len=1024, max_num_seqs=CANDIDATES,
              optimization_level=optimization_level)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 1000) for _ in range(PROMPT_TOKENS)]
               for _ in range(CANDIDATES)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=lookahead,
                                          ignore_eos=True), use_tqdm=False)
    continuations = [list(o.outputs[0].token_ids) for o in outputs]
    scored = sorted((predicted_fraction(p + out[:-SCORED_TOKENS], out[-SCORED_TOKENS:],
                                        low, high), p, out)
                    for p, out in zip(prompts, continuations, strict=True))
    workloads = {
        "grounded": [p + out for _, p, out in scored[-WORKLOAD_SIZE:]],
        "no_match": [p for _, p, _ in scored[:WORKLOAD_SIZE]],
    }
    with open(path, "w") as file:
        json.dump(workloads, file)
    print("RESULT " + json.dumps({"grounded_predicted": [s for s, _, _ in
                                                          scored[-WORKLOAD_SIZE:]],
                                  "no_match_predicted": [s for s, _, _ in
                                                         scored[:WORKLOAD_SIZE]]}),
          flush=True)


def load_engine(model: str, speculative: str, batches: list[int], optimization_level: int
                ) -> Any:
    from triollm import LLM

    return LLM(model, dtype=dtype(), max_model_len=1024, max_num_seqs=max(batches),
               optimization_level=optimization_level, enable_prefix_caching=False,
               speculative_config=json.loads(speculative) if speculative else None)


def decode_rate(llm: Any, batch: list[list[int]], tokens: int, repeats: int) -> float:
    """Tokens/s after each request's first, from the requests' own token times: the
    prefill (seconds for the grounded prompts) stays out of it. The best of
    ``repeats``."""
    from triollm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in batch]
    best = 0.0
    for _ in range(repeats):
        outputs = llm.generate(prompts, params, use_tqdm=False)
        metrics = [o.metrics for o in outputs]
        assert all(m and m.first_token_time and m.last_token_time for m in metrics)
        started = max(m.first_token_time for m in metrics)
        ended = max(m.last_token_time for m in metrics)
        best = max(best, len(batch) * (tokens - 1) / (ended - started))
    return best


def child(model: str, workloads_path: str, speculative: str, batches: list[int],
          decode_tokens: int, optimization_level: int, repeats: int) -> None:
    with open(workloads_path) as file:
        workloads: dict[str, list[list[int]]] = json.load(file)
    started = time.perf_counter()
    llm = load_engine(model, speculative, batches, optimization_level)
    load_s = time.perf_counter() - started
    decode_rate(llm, workloads["no_match"][:1], 4, 1)  # warm-up
    result: dict[str, float] = {"load_s": load_s}
    for name, prompts in workloads.items():
        for size in batches:
            batch = prompts[:size]
            before = llm.engine.statistics().spec_decoding
            result[f"{name}_b{size}"] = decode_rate(llm, batch, decode_tokens, repeats)
            after = llm.engine.statistics().spec_decoding
            if before is not None and after is not None:
                drafted = after.num_draft_tokens - before.num_draft_tokens
                accepted = after.num_accepted_tokens - before.num_accepted_tokens
                result[f"{name}_b{size}_acceptance"] = accepted / drafted if drafted else 0.0
    print("RESULT " + json.dumps(result), flush=True)


def paired_child(model: str, workloads_path: str, configs: dict[str, str],
                 batches: list[int], decode_tokens: int, optimization_level: int,
                 rounds: int) -> None:
    """Every configuration's engine in this one process, measured in turn, one
    generation each, ``rounds`` times (the order rotating each round): each round's
    ratio to plain compares runs seconds apart in one process, free of the spread
    between processes."""
    with open(workloads_path) as file:
        workloads: dict[str, list[list[int]]] = json.load(file)
    engines = {mode: load_engine(model, config, batches, optimization_level)
               for mode, config in configs.items()}
    for llm in engines.values():
        decode_rate(llm, workloads["no_match"][:1], 4, 1)  # warm-up
    modes = list(engines)
    rates: dict[str, dict[str, list[float]]] = {mode: {} for mode in modes}
    for index in range(rounds):
        order = modes[index % len(modes):] + modes[:index % len(modes)]
        for name, prompts in workloads.items():
            for size in batches:
                for mode in order:
                    rates[mode].setdefault(f"{name}_b{size}", []).append(
                        decode_rate(engines[mode], prompts[:size], decode_tokens, 1))
    print("RESULT " + json.dumps(rates), flush=True)


def report_paired(rates: dict[str, dict[str, list[float]]], keys: list[str]) -> None:
    """Per configuration and cell: the median of the rounds' ratios to plain, and their
    range."""
    print(f"{'ratio':>8}" + "".join(f"{key:>26}" for key in keys))
    for mode, cells in rates.items():
        if mode == "plain":
            continue
        line = ""
        for key in keys:
            ratios = sorted(a / b for a, b in zip(cells[key], rates["plain"][key],
                                                  strict=True))
            line += (f"{statistics.median(ratios):.2f}x "
                     f"({ratios[0]:.2f}-{ratios[-1]:.2f})").rjust(26)
        print(f"{mode:>8}{line}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--decode-tokens", type=int, default=33)
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--disable-by-batch-size", type=int, default=None,
                        help="the config's key (default: the engine's)")
    parser.add_argument("--methods", nargs="+", default=["ngram", "draft_model"],
                        choices=["ngram", "draft_model"], help="the speculative runs")
    parser.add_argument("--draft-layers", type=int, default=4,
                        help="the draft model's decoder layers, the target's first")
    parser.add_argument("--lookahead-tokens", type=int, default=192,
                        help="each candidate's greedy continuation, scored on its last "
                             f"{SCORED_TOKENS} tokens")
    parser.add_argument("--optimization-level", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--paired-rounds", type=int, default=0,
                        help="instead of a process per configuration, all engines in one "
                             "process measured in turn this many times, reporting the "
                             "median of the rounds' ratios to plain")
    parser.add_argument("--control", action="store_true",
                        help="a second plain engine, measured like the others")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    os.environ[DTYPE_VARIABLE] = args.dtype
    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_min": args.prompt_lookup_min,
            "prompt_lookup_max": args.prompt_lookup_max}
    if args.disable_by_batch_size is not None:
        spec["disable_by_batch_size"] = args.disable_by_batch_size
    print(f"# {platform_line()}; {os.cpu_count()} CPUs; Python {platform.python_version()}")
    print(f"# speculative_config {json.dumps(spec)}; draft_model: the target's first "
          f"{args.draft_layers} layers; dtype {args.dtype}")
    here = os.path.dirname(os.path.abspath(__file__))
    with tempfile.TemporaryDirectory() as directory:
        model = os.path.join(directory, "model")
        save_model(model)
        configs = {"plain": ""}
        if args.control:
            configs["plain-2"] = ""
        if "ngram" in args.methods:
            configs["ngram"] = json.dumps(spec)
        if "draft_model" in args.methods:
            draft = os.path.join(directory, "draft")
            save_draft(model, draft, args.draft_layers)
            draft_spec = {"method": "draft_model", "model": draft,
                          "num_speculative_tokens": args.num_speculative_tokens}
            if args.disable_by_batch_size is not None:
                draft_spec["disable_by_batch_size"] = args.disable_by_batch_size
            configs["draft_model"] = json.dumps(draft_spec)
        workloads = os.path.join(directory, "workloads.json")
        chosen, others = run_child(
            [sys.executable, os.path.join(here, "speculative.py"), "--select", model,
             workloads, str(args.prompt_lookup_min), str(args.prompt_lookup_max),
             str(args.optimization_level), str(args.lookahead_tokens)], "workload selection")
        print(f"# next tokens prompt lookup predicted: grounded "
              f"{[round(s, 2) for s in chosen['grounded_predicted']]}, no match "
              f"{[round(s, 2) for s in chosen['no_match_predicted']]}")
        keys = [f"{name}_b{size}" for name in ("grounded", "no_match")
                for size in args.batches]
        if args.paired_rounds:
            rates, others = run_child(
                [sys.executable, os.path.join(here, "speculative.py"), "--paired-child",
                 model, workloads, json.dumps(configs), json.dumps(args.batches),
                 str(args.decode_tokens), str(args.optimization_level),
                 str(args.paired_rounds)], "paired runs")
            flag = "  CONTAMINATED" if others > CONTAMINATED_CORES else ""
            print(f"# {args.paired_rounds} rounds in one process; others used "
                  f"{others:.2f} cores{flag}")
            report_paired(rates, keys)
            return
        results = {}
        for mode, config in configs.items():
            command = [sys.executable, os.path.join(here, "speculative.py"), "--child", model,
                       workloads, config, json.dumps(args.batches), str(args.decode_tokens),
                       str(args.optimization_level), str(args.repeats)]
            result, others = run_child(command, mode)
            results[mode] = result
            flag = "  CONTAMINATED" if others > CONTAMINATED_CORES else ""
            print(f"{mode}: loaded in {result['load_s']:.0f} s; others used "
                  f"{others:.2f} cores{flag}", flush=True)
    print(f"{'tok/s':>8}" + "".join(f"{key:>24}" for key in keys))
    base = results["plain"]
    for mode, result in results.items():
        cells = "".join(
            (f"{result[key]:.1f}" + (f" ({result[key] / base[key]:.2f}x)"
                                     if mode != "plain" else "")).rjust(24) for key in keys)
        print(f"{mode:>8}{cells}")
    for mode in results:
        if mode != "plain":
            print(f"acceptance {mode}" + "".join(
                f"{results[mode].get(key + '_acceptance', 0.0):>22.2f}" for key in keys))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--select":
        select(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]),
               int(sys.argv[7]))
    elif len(sys.argv) > 1 and sys.argv[1] == "--paired-child":
        paired_child(sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), json.loads(sys.argv[5]),
                     int(sys.argv[6]), int(sys.argv[7]), int(sys.argv[8]))
    elif len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], sys.argv[4], json.loads(sys.argv[5]),
              int(sys.argv[6]), int(sys.argv[7]), int(sys.argv[8]))
    else:
        main()
