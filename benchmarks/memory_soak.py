"""The server's resident memory over a soak of mixed requests, then of large ones.

Starts ``triollm serve`` (the demo model unless ``--model``), sends ``--requests``
completions from 8 client threads (a mix of plain, streaming, echo with logprobs, and
n=3), and prints the server process's RSS every 500 requests. Then ``--large`` rounds
of large requests, one at a time: an ``--large-chars`` prompt (8 MB by default, just
under the 8 MiB body limit) to ``/tokenize``, the same prompt to ``/v1/completions``
and as a chat message (both refused for length after tokenizing), printing the RSS
after each round, with the seconds since the start, and the peak RSS sampled every
0.2 s. Run it with allocator settings in the environment to see what holds memory,
e.g. ``ONEDNN_PRIMITIVE_CACHE_CAPACITY=16``, ``MALLOC_MMAP_THRESHOLD_=65536``, or
``TRIOLLM_KEEP_MALLOC=1`` (glibc's own thresholds; model/cpu/malloc.py).

    python benchmarks/memory_soak.py --requests 3000
    python benchmarks/memory_soak.py --requests 0 --large 10
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import random
import subprocess
import sys
import threading
import time

import httpx

from triollm.testing import served_url

WORDS = ["cat", "dog", "sun", "rain", "tree"]


def rss_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) // 1024
    raise RuntimeError("no VmRSS")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="triollm/tiny-demo")
    parser.add_argument("--requests", type=int, default=3000,
                        help="mixed requests (default: 3000; 0: none)")
    parser.add_argument("--large", type=int, default=0,
                        help="rounds of large requests after them (default: 0)")
    parser.add_argument("--large-chars", type=int, default=8_000_000,
                        help="characters of a large request's prompt (default: 8 MB)")
    parser.add_argument("serve_args", nargs="*", help="more `triollm serve` flags")
    options = parser.parse_args()
    process = subprocess.Popen(
        [sys.executable, "-m", "triollm", "serve", options.model, "--host", "127.0.0.1",
         "--port", "0", "--max-model-len", "512", "--disable-log-requests",
         *options.serve_args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert process.stdout is not None
    url = served_url(process.stdout)
    assert url is not None, "the server did not start"
    threading.Thread(target=lambda: [None for _ in process.stdout or []], daemon=True).start()
    client = httpx.Client(timeout=900)
    rng = random.Random(0)

    def one(i: int) -> None:
        body: dict[str, object] = {
            "model": options.model, "ignore_eos": True, "max_tokens": rng.randint(4, 32),
            "prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60)))}
        if i % 4 == 1:
            with client.stream("POST", url + "/v1/completions",
                               json={**body, "stream": True}) as response:
                for _ in response.iter_lines():
                    pass
            return
        if i % 4 == 2:
            body.update(logprobs=5, echo=True)
        if i % 4 == 3:
            body["n"] = 3
        client.post(url + "/v1/completions", json=body).raise_for_status()

    started = time.monotonic()
    try:
        print(f"start: {rss_mib(process.pid)} MiB", flush=True)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            for start in range(0, options.requests, 500):
                list(pool.map(one, range(start, min(start + 500, options.requests))))
                print(f"{min(start + 500, options.requests)} requests: "
                      f"{rss_mib(process.pid)} MiB", flush=True)
        if options.large:
            large_soak(client, url, options.model, options.large, options.large_chars,
                       process.pid, started)
    finally:
        process.terminate()
        process.wait(60)


def large_soak(client: httpx.Client, url: str, model: str, rounds: int, chars: int,
               pid: int, started: float) -> None:
    """``rounds`` of an 8 MB prompt to /tokenize, completions and chat, one at a time,
    printing the server's RSS after each round and its peak, sampled meanwhile."""
    peak = [rss_mib(pid)]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.2):
            peak[0] = max(peak[0], rss_mib(pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    prompt = " ".join(WORDS[i % len(WORDS)] for i in range(chars // 4))[:chars]
    print(f"large requests: {len(prompt):,}-character prompts", flush=True)
    try:
        for round_ in range(rounds):
            statuses = [
                client.post(url + "/tokenize", json={"model": model, "prompt": prompt}),
                client.post(url + "/v1/completions", json={
                    "model": model, "prompt": prompt, "max_tokens": 4}),
                client.post(url + "/v1/chat/completions", json={
                    "model": model, "max_tokens": 4,
                    "messages": [{"role": "user", "content": prompt}]})]
            print(f"{time.monotonic() - started:6.0f} s  round {round_ + 1}: RSS "
                  f"{rss_mib(pid)} MiB, peak {peak[0]} MiB  (statuses "
                  f"{' '.join(str(r.status_code) for r in statuses)})", flush=True)
    finally:
        done.set()
        sampler.join()


if __name__ == "__main__":
    main()
