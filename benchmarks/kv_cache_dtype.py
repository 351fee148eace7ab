"""The 8-bit KV cache against the model's dtype: decode tokens/s at batch 1 over a long
context, and the blocks the same ``--kv-cache-space-gb`` holds, for ``--kv-cache-dtype
auto`` (bf16) and ``fp8_e5m2`` (and any other value asked for), in one run.

The model is benchmarks/quantization.py's: Qwen2.5-0.5B's shape with random bf16
weights. Each configuration runs in a process of its own: load (and compile, at
``--optimization-level``), then per context length one prompt of that many tokens is
prefilled once (prefix caching keeps it), and decode is timed as the prompt generating
``--decode-tokens`` minus the prompt generating one token (both reuse the cached prompt),
over the tokens decoded after the first; best of ``--repeats``. Reported with the cores
the rest of the machine kept busy meanwhile (over a tenth marks it contaminated).

``--kernel`` times the C decode kernel alone instead, on one thread, by the thread's
CPU time (which other processes' load on the machine disturbs less than wall time):
one layer of that model (2 KV heads of 64, 14 query heads, 16-token blocks scattered over
an 8,192-block cache), bf16 against the 8-bit caches, median of 50 calls.

    python benchmarks/kv_cache_dtype.py
    python benchmarks/kv_cache_dtype.py --contexts 4000 --modes auto fp8_e5m2 fp8
    python benchmarks/kv_cache_dtype.py --kernel
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
import time

from quantization import save_model
from vs_vllm import CONTAMINATED_CORES, platform_line, run_child


def child(model: str, mode: str, contexts: list[int], decode_tokens: int,
          optimization_level: int, repeats: int) -> None:
    from triollm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model, dtype="bfloat16", max_model_len=max(contexts) + decode_tokens + 8,
              max_num_seqs=16, kv_cache_dtype=mode, optimization_level=optimization_level,
              kv_cache_space_gb=0.25)
    load_s = time.perf_counter() - started
    rng = random.Random(0)

    def seconds(prompt: list[int], tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            best = min(best, time.perf_counter() - start)
        return best

    result: dict[str, float] = {"load_s": load_s,
                                "blocks": llm.engine.runner.num_kv_blocks}  # type: ignore[attr-defined]
    for context in contexts:
        prompt = [rng.randrange(10, 1000) for _ in range(context)]
        seconds(prompt, 2)  # prefill once: the prefix cache keeps the prompt
        decode = seconds(prompt, decode_tokens) - seconds(prompt, 1)
        result[f"decode_{context}"] = (decode_tokens - 1) / decode
    print("RESULT " + json.dumps(result), flush=True)


def kernel() -> None:
    import statistics

    import torch

    from triollm.model.cpu import decode as cpu_decode

    torch.set_num_threads(1)  # the kernel runs on the calling thread: its CPU time counts
    decode = cpu_decode.load_kernel()
    if decode is None:
        raise SystemExit("the C decode kernel did not build here")
    kv_heads, dim, block, blocks = 2, 64, 16, 8192
    torch.manual_seed(0)
    keys, values = torch.randn(kv_heads, blocks, block, dim), torch.randn(kv_heads, blocks,
                                                                          block, dim)
    dtypes = [torch.bfloat16, torch.float8_e5m2, torch.float8_e4m3fn]
    caches = {dtype: (keys.to(dtype), values.to(dtype)) for dtype in dtypes}
    print(f"{'batch x context':>16}" + "".join(f"{str(d)[6:]:>16}" for d in dtypes))
    for batch, context in ((1, 2048), (1, 4096), (4, 4096), (16, 1024)):
        tables = torch.randperm(blocks)[:batch * context // block].view(batch, -1)
        lens = torch.full((batch,), context)
        query = torch.randn(batch, 14, dim)
        cells = []
        for dtype in dtypes:
            times = []
            for _ in range(60):
                start = time.thread_time()
                decode(query, *caches[dtype], tables, lens, dim ** -0.5, None, None)
                times.append(time.thread_time() - start)
            cells.append(f"{statistics.median(times[10:]) * 1e3:13.3f} ms")
        print(f"{batch:>10} x {context:<4}" + "".join(cells), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", default=["auto", "fp8_e5m2"])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 4000])
    parser.add_argument("--decode-tokens", type=int, default=17)
    parser.add_argument("--optimization-level", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--kernel", action="store_true",
                        help="time the C decode kernel alone (CPU time, one thread)")
    args = parser.parse_args()
    print(f"# {platform_line()}; Python {platform.python_version()}")
    if args.kernel:
        kernel()
        return
    with tempfile.TemporaryDirectory() as directory:
        save_model(directory)
        results = {}
        for mode in args.modes:
            command = [sys.executable, __file__, "--child", directory, mode,
                       json.dumps(args.contexts), str(args.decode_tokens),
                       str(args.optimization_level), str(args.repeats)]
            result, others = run_child(command, mode)
            results[mode] = result
            flag = "  CONTAMINATED" if others > CONTAMINATED_CORES else ""
            print(f"{mode}: loaded in {result['load_s']:.0f} s, {result['blocks']} blocks in "
                  f"0.25 GiB; others used {others:.2f} cores{flag}", flush=True)
    keys = [f"decode_{context}" for context in args.contexts]
    print(f"{'tok/s, batch 1':>14}" + "".join(f"{key:>22}" for key in keys))
    base = results.get("auto")
    for mode, result in results.items():
        cells = "".join(
            f"{result[key]:>12.2f}" + (f" ({result[key] / base[key]:.2f}x)" if base else "")
            .ljust(10) for key in keys)
        print(f"{mode:>14}{cells}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), int(sys.argv[5]),
              int(sys.argv[6]), int(sys.argv[7]))
    else:
        main()
