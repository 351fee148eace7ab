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
batch size through one ``LLM``; the ratios are json / none of the medians. The per-token
time is the batch's time over its output length (every request is as long, so it is the
step time); throughput is output tokens per second of the whole batch. ``--engines
triollm vllm`` runs the same workload, each engine in its own process, through vLLM's
CPU build too (same model, same schema, its ``structured_outputs_config`` backend), so
both engines' ratios come from one run.

``loop``: the event loop's lateness (a 1 ms sleep in a loop) while ``AsyncLLMEngine``
compiles a large schema for a request, against the same request without one.

``mask``: ``apply_bitmask`` (triollm's batched unpack and masked fill) against
xgrammar's ``apply_token_bitmask_inplace_cpu`` on ``[rows, vocab]`` float32 logits.

    python benchmarks/structured_outputs.py --backend auto --output-len 64
    python benchmarks/structured_outputs.py --vocab-size 151936
    python benchmarks/structured_outputs.py --engines triollm vllm \
        --vllm-python "$(../shared/anchors/vllm_cpu/setup.sh)"
    python benchmarks/structured_outputs.py loop --fields 100 400
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
from vs_vllm import (
    CONTAMINATED_CORES,
    _patch_vllm_version,
    platform_line,
    python_for,
    run_child,
)

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


def measure(engine: str, model_dir: str, options: dict[str, Any]) -> None:
    """Runs in its own process: one engine's medians, printed as one ``RESULT`` line."""
    if engine == "vllm":
        _patch_vllm_version()
        from vllm import LLM, SamplingParams
        from vllm.sampling_params import StructuredOutputsParams
    else:
        from triollm import LLM, SamplingParams  # type: ignore[assignment]
        from triollm.structured_output import (  # type: ignore[assignment]
            StructuredOutputsParams,
        )
    batches, output_len = options["batch"], options["output_len"]
    llm = LLM(model=model_dir, dtype="bfloat16", max_num_seqs=max(batches), max_model_len=512,
              structured_outputs_config={"backend": options["backend"]}, seed=0)
    constraint = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 500 + 5 for j in range(32)]}
               for i in range(max(batches))]

    def once(batch: int, constrained: bool) -> tuple[float, float]:
        # Widened, an unconstrained sample mostly draws ids the tokenizer lacks, whose
        # detokenizing would be measured instead: neither configuration detokenizes.
        params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.8,
                                seed=1, detokenize=not options["vocab_size"],
                                structured_outputs=constraint if constrained else None)
        start = time.perf_counter()
        outputs = llm.generate(prompts[:batch], params, use_tqdm=False)  # type: ignore[arg-type]
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        assert tokens == batch * output_len, tokens
        return elapsed / output_len, tokens / elapsed

    once(1, True)  # compiles the grammar, warms the model
    once(max(batches), False)
    report: dict[str, Any] = {}
    for batch in batches:
        runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for _ in range(options["repeats"]):
            for constrained in (False, True):
                runs[constrained].append(once(batch, constrained))
        report[str(batch)] = {
            "tpot_ms": {c: 1000 * statistics.median(r[0] for r in runs[v])
                        for c, v in (("none", False), ("json", True))},
            "tok_s": {c: statistics.median(r[1] for r in runs[v])
                      for c, v in (("none", False), ("json", True))}}
    print("RESULT " + json.dumps(report), flush=True)


def run(args: argparse.Namespace) -> None:
    """Each engine in a child process of its own, on the same saved model."""
    options = {"batch": args.batch, "output_len": args.output_len, "repeats": args.repeats,
               "backend": args.backend, "vocab_size": args.vocab_size}
    print(platform_line())
    with tempfile.TemporaryDirectory() as directory:
        save_llama(directory)
        if args.vocab_size:
            widen(directory, args.vocab_size)
        for engine in args.engines:
            python = python_for(engine, args.vllm_python)
            result, others = run_child(
                [python, __file__, "--child", engine, directory, json.dumps(options)],
                f"{engine} run")
            flag = "  CONTAMINATED" if others > CONTAMINATED_CORES else ""
            print(f"{engine} (backend {args.backend}, others used {others:.2f} cores{flag}):")
            for batch, figures in result.items():
                tpot, rate = figures["tpot_ms"], figures["tok_s"]
                print(f"  batch {int(batch):3d}: step time none {tpot['none']:7.2f} ms, json "
                      f"{tpot['json']:7.2f} ms ({tpot['json'] / tpot['none']:.3f}x); "
                      f"throughput none {rate['none']:7.1f} tok/s, json {rate['json']:7.1f} "
                      f"tok/s ({rate['json'] / rate['none']:.3f}x)", flush=True)


def large_schema(fields: int) -> dict[str, Any]:
    """An object of ``fields`` properties, each a string pattern, a bounded integer array
    or an enum: slow to compile in both backends."""
    return {"type": "object", "properties": {
        f"field_{i}": {"anyOf": [
            {"type": "string", "pattern": f"[a-z]{{1,{i % 7 + 1}}}"},
            {"type": "array", "items": {"type": "integer", "minimum": i, "maximum": i * 37 + 5}},
            {"enum": [f"v{i}_{j}" for j in range(8)]}]}
        for i in range(fields)}, "required": [f"field_{i}" for i in range(0, fields, 3)]}


def loop(args: argparse.Namespace) -> None:
    """How late a 1 ms sleep on the event loop wakes while the async engine compiles a
    large schema (and generates one token), against the same wait with no compile."""
    import trio

    from triollm import AsyncEngineArgs, AsyncLLMEngine, SamplingParams
    from triollm.structured_output import StructuredOutputsParams

    async def ticker(lateness: list[float]) -> None:
        while True:
            start = time.perf_counter()
            await trio.sleep(0.001)
            lateness.append(time.perf_counter() - start - 0.001)

    async def main(directory: str) -> None:
        engine_args = AsyncEngineArgs(model=directory, max_model_len=512, enforce_eager=True,
                                      structured_outputs_config={"backend": args.backend})
        async with AsyncLLMEngine.from_engine_args(engine_args) as engine:
            for fields in args.fields:
                params = SamplingParams(max_tokens=1, structured_outputs=StructuredOutputsParams(
                    json=large_schema(fields)))
                plain = SamplingParams(max_tokens=1)
                figures = {}
                for name, chosen in (("none", plain), ("schema", params)):
                    lateness: list[float] = []
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(ticker, lateness)
                        await trio.sleep(0.05)
                        start = time.perf_counter()
                        async for _ in engine.generate("hello", chosen, f"{name}-{fields}"):
                            pass
                        figures[name] = (time.perf_counter() - start, max(lateness))
                        nursery.cancel_scope.cancel()
                (plain_s, plain_late), (schema_s, schema_late) = figures["none"], figures["schema"]
                print(f"{fields:4d} fields ({args.backend}): request {schema_s * 1000:7.1f} ms "
                      f"with the schema (compile included), {plain_s * 1000:6.1f} ms without; "
                      f"largest tick lateness {schema_late * 1000:6.1f} ms vs "
                      f"{plain_late * 1000:6.1f} ms", flush=True)

    with tempfile.TemporaryDirectory() as directory:
        save_llama(directory)
        trio.run(main, directory)


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
    parser.add_argument("what", nargs="?", choices=("run", "mask", "loop"), default="run")
    parser.add_argument("--fields", type=int, nargs="+", default=[100, 400],
                        help="loop: the large schema's property counts")
    parser.add_argument("--backend", default="auto", choices=("auto", "xgrammar", "guidance"))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vocab-size", type=int, default=0,
                        help="widen the model's logits to this many (0: the tokenizer's)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--engines", nargs="+", choices=("triollm", "vllm"),
                        default=["triollm"], help="vllm: vLLM's CPU build, the same run")
    parser.add_argument("--vllm-python", default=None,
                        help="the python of vLLM's venv (../shared/anchors/vllm_cpu/setup.sh)")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        engine, model_dir, options = args.child
        measure(engine, model_dir, json.loads(options))
    elif args.what == "loop":
        loop(args)
    elif args.what == "mask":
        args.vocab_size = args.vocab_size or 151936
        args.repeats = max(args.repeats, 50)
        mask(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
