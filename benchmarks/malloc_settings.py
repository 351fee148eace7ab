"""What glibc's malloc settings (model/cpu/malloc.py) buy in speed, in one run.

Each round starts one process per setting, in turn, on the benchmarks' random-weight
Llama (common.save_llama: 12 layers, hidden 768, bf16) through ``LLM.generate``, after
a warm-up: a prefill workload (``--prefill-prompts`` prompts of 512 tokens, one output
token each) and a decode workload (``--decode-prompts`` prompts of 16 tokens, 64 output
tokens each). Settings (chosen through the environment, so one build serves all):

* ``glibc``: glibc's own dynamic thresholds (``TRIOLLM_KEEP_MALLOC=1``);
* ``kept``: triollm's (mmap threshold 32 MiB, trim threshold 2 GiB);
* ``trim-N``: mmap threshold 32 MiB, trim threshold N MiB (glibc's ``MALLOC_*_``
  variables, with ``TRIOLLM_KEEP_MALLOC=1``).

Prints each process's tokens/s and peak RSS, the medians, and each setting's ratio to
``glibc``, with the load average around the run (others' work makes the rates noisy;
the alternation gives every setting the same machine).

    python benchmarks/malloc_settings.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import common

SETTINGS = ("glibc", "kept", "trim-64", "trim-256")


def environment(setting: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("MALLOC_") and key != "TRIOLLM_KEEP_MALLOC"}
    if setting == "kept":
        return env
    env["TRIOLLM_KEEP_MALLOC"] = "1"
    if setting.startswith("trim-"):
        env["MALLOC_MMAP_THRESHOLD_"] = str(32 * 2**20)
        env["MALLOC_TRIM_THRESHOLD_"] = str(int(setting.removeprefix("trim-")) * 2**20)
    return env


def child(path: str, prefill_prompts: int, decode_prompts: int, eager: bool) -> None:
    """One process's measurement, printed as a JSON line."""
    import random
    import resource
    import time

    from triollm import LLM, SamplingParams

    llm = LLM(path, dtype="bfloat16", max_model_len=1024, max_num_seqs=32,
              enforce_eager=eager)
    rng = random.Random(0)
    vocab = llm.get_tokenizer().vocab_size

    def run(num: int, prompt_len: int, out_len: int) -> float:
        prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(prompt_len)]}
                   for _ in range(num)]
        params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True,
                                detokenize=False)
        started = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)  # type: ignore[arg-type]
        return num * (prompt_len if out_len == 1 else out_len) / (time.perf_counter() - started)

    run(4, 512, 1)
    run(8, 16, 16)
    result = {"prefill": run(prefill_prompts, 512, 1), "decode": run(decode_prompts, 16, 64),
              "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}
    print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prefill-prompts", type=int, default=32)
    parser.add_argument("--decode-prompts", type=int, default=32)
    parser.add_argument("--eager", action="store_true",
                        help="enforce_eager (no torch.compile: starts in seconds)")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS),
                        help=f"which settings to compare (default: {' '.join(SETTINGS)})")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child:
        child(options.child, options.prefill_prompts, options.decode_prompts, options.eager)
        return
    results: dict[str, list[dict[str, float]]] = {setting: [] for setting in options.settings}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as directory:
        common.save_llama(directory)
        for round_ in range(options.rounds):
            for setting in options.settings:
                done = subprocess.run(
                    [sys.executable, __file__, "--child", directory, "--prefill-prompts",
                     str(options.prefill_prompts), "--decode-prompts",
                     str(options.decode_prompts), *(["--eager"] if options.eager else [])],
                    env=environment(setting),
                    capture_output=True, text=True, check=True)
                line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
                result = json.loads(line.removeprefix("RESULT "))
                results[setting].append(result)
                print(f"round {round_ + 1} {setting:9s} prefill {result['prefill']:7.0f} "
                      f"tok/s  decode {result['decode']:6.1f} tok/s  peak RSS "
                      f"{result['peak_rss_mib']} MiB  (load {os.getloadavg()[0]:.1f})",
                      flush=True)
    print(f"load average before {load_before[0]:.1f}, after {os.getloadavg()[0]:.1f} "
          f"({os.cpu_count()} cores)")
    base = {key: statistics.median(r[key] for r in results["glibc"])
            for key in ("prefill", "decode")} if "glibc" in results else None
    for setting, runs in results.items():
        medians = {key: statistics.median(r[key] for r in runs)
                   for key in ("prefill", "decode", "peak_rss_mib")}
        ratios = (f"  vs glibc: prefill {medians['prefill'] / base['prefill']:.3f}x, "
                  f"decode {medians['decode'] / base['decode']:.3f}x" if base else "")
        print(f"{setting:9s} median prefill {medians['prefill']:7.0f} tok/s, decode "
              f"{medians['decode']:6.1f} tok/s, peak RSS {medians['peak_rss_mib']:.0f} MiB"
              f"{ratios}")


if __name__ == "__main__":
    main()
