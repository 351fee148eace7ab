"""Structured outputs: per-token time and throughput with a JSON schema on every request
against none, at batch 1 and 16, on the same model in one run; and the cost of applying
the allowed-token bitmask to the logits.

``run`` (the default): the benchmarks' random-weight Llama (benchmarks/common.py),
optionally with its logits widened to ``--vocab-size`` (the tokenizer's 512 tokens plus
padding the grammar forbids, so the mask is applied at a real model's width; outputs
are then not detokenized, in either configuration). Every
request asks for ``--output-len`` tokens with ``ignore_eos``; the schema (an array of at
least 64 small objects) cannot be complete sooner, so each step computes and applies a
real mask. Configurations alternate (none, json, none, json, ...) ``--repeats`` times per
batch size through one ``LLM``; the ratios are json / none of the medians. TPOT is the
mean of the requests' ``time_per_output_token``; throughput is output tokens per second
of the whole batch.

``mask``: ``apply_bitmask`` (triollm's batched unpack and masked fill) against
xgrammar's ``apply_token_bitmask_inplace_cpu`` on ``[rows, vocab]`` float32 logits.

    python benchmarks/structured_outputs.py --backend auto --output-len 64
    python benchmarks/structured_outputs.py --vocab-size 151936
    python benchmarks/structured_outputs.py mask --vocab-size 151936 --rows 1 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Any

from common import save_llama, timed

SCHEMA: dict[str, Any] = {
    "type": "array", "minItems": 64,
    "items": {"type": "object", "additionalProperties": False,
              "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                             "tag": {"enum": ["alpha", "beta", "gamma"]},
                             "ok": {"type": "boolean"}},
              "required": ["id", "tag", "ok"]},
}


def widen(model_dir: str, vocab_size: int) -> None:
    """Give the saved model ``vocab_size`` logits (new rows random, never allowed by a
    grammar: the tokenizer has no such tokens)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    model.resize_token_embeddings(vocab_size, mean_resizing=False)
    model.save_pretrained(model_dir)


def run(args: argparse.Namespace) -> None:
    from triollm import LLM, SamplingParams
    from triollm.structured_output import StructuredOutputsParams

    with tempfile.TemporaryDirectory() as directory:
        save_llama(directory)
        if args.vocab_size:
            widen(directory, args.vocab_size)
        llm = LLM(directory, max_num_seqs=max(args.batch), max_model_len=512,
                  structured_outputs_config={"backend": args.backend})
    constraint = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 500 + 5 for j in range(32)]}
               for i in range(max(args.batch))]

    def once(batch: int, constrained: bool) -> tuple[float, float]:
        # Widened, an unconstrained sample mostly draws ids the tokenizer lacks, whose
        # detokenizing would be measured instead: neither configuration detokenizes.
        params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.8,
                                seed=1, detokenize=not args.vocab_size,
                                structured_outputs=constraint if constrained else None)
        start = time.perf_counter()
        outputs = llm.generate(prompts[:batch], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        tpots = [o.metrics.time_per_output_token for o in outputs if o.metrics is not None]
        return statistics.fmean(t for t in tpots if t is not None), tokens / elapsed

    once(1, True)  # compiles the grammar, warms the model
    once(max(args.batch), False)
    report: dict[str, Any] = {"backend": llm.engine.config.structured_outputs.backend,
                              "vocab_size": llm.engine.vocab_size,
                              "output_len": args.output_len}
    for batch in args.batch:
        runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for _ in range(args.repeats):
            for constrained in (False, True):
                runs[constrained].append(once(batch, constrained))
        tpot = {c: statistics.median(r[0] for r in runs[c]) for c in runs}
        throughput = {c: statistics.median(r[1] for r in runs[c]) for c in runs}
        report[f"batch {batch}"] = {
            "tpot_ms": {"none": round(tpot[False] * 1000, 2), "json": round(tpot[True] * 1000, 2)},
            "throughput_tok_s": {"none": round(throughput[False], 1),
                                 "json": round(throughput[True], 1)},
            "tpot_ratio": round(tpot[True] / tpot[False], 3),
            "throughput_ratio": round(throughput[True] / throughput[False], 3),
        }
        print(f"batch {batch:3d}: TPOT none {tpot[False] * 1000:7.2f} ms, json "
              f"{tpot[True] * 1000:7.2f} ms ({tpot[True] / tpot[False]:.3f}x); throughput "
              f"none {throughput[False]:7.1f} tok/s, json {throughput[True]:7.1f} tok/s "
              f"({throughput[True] / throughput[False]:.3f}x)", flush=True)
    print("RESULT " + json.dumps(report))


def mask(args: argparse.Namespace) -> None:
    import torch

    from triollm.structured_output.bitmask import apply_bitmask

    generator = torch.Generator().manual_seed(0)
    words = (args.vocab_size + 31) // 32
    for rows in args.rows:
        logits = torch.randn(rows, args.vocab_size, generator=generator)
        bitmask = torch.randint(-2**31, 2**31 - 1, (rows, words), dtype=torch.int32,
                                generator=generator)
        every = list(range(rows))
        ours = timed(lambda x=logits, m=bitmask, r=every: apply_bitmask(x, m, r), args.repeats)
        line = f"rows {rows:3d}, vocab {args.vocab_size}: apply_bitmask {ours * 1e6:8.1f} us"
        try:
            import xgrammar
        except ImportError:
            print(line + " (xgrammar not installed)")
            continue
        theirs = timed(lambda x=logits, m=bitmask: xgrammar.apply_token_bitmask_inplace(
            x, m, backend="cpu"), args.repeats)
        print(line + f"; xgrammar's cpu kernel {theirs * 1e6:8.1f} us ({theirs / ours:.1f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", nargs="?", choices=("run", "mask"), default="run")
    parser.add_argument("--backend", default="auto", choices=("auto", "xgrammar", "guidance"))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vocab-size", type=int, default=0,
                        help="widen the model's logits to this many (0: the tokenizer's)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    args = parser.parse_args()
    if args.what == "mask":
        args.vocab_size = args.vocab_size or 151936
        args.repeats = max(args.repeats, 50)
        mask(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
