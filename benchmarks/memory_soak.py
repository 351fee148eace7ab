"""The server's resident memory over a soak of mixed requests.

Starts ``triollm serve`` (the demo model unless ``--model``), sends ``--requests``
completions from 8 client threads (a mix of plain, streaming, echo with logprobs, and
n=3), and prints the server process's RSS every 500 requests. Run it with allocator
settings in the environment to see what holds memory, e.g.
``ONEDNN_PRIMITIVE_CACHE_CAPACITY=16`` or ``MALLOC_MMAP_THRESHOLD_=65536``.

    python benchmarks/memory_soak.py --requests 3000
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import random
import re
import subprocess
import sys
import threading

import httpx

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
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("serve_args", nargs="*", help="more `triollm serve` flags")
    options = parser.parse_args()
    process = subprocess.Popen(
        [sys.executable, "-m", "triollm", "serve", options.model, "--host", "127.0.0.1",
         "--port", "0", "--max-model-len", "512", "--disable-log-requests",
         *options.serve_args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert process.stdout is not None
    url = None
    for line in process.stdout:
        found = re.search(r"triollm serving .* at (http://\S+)", line)
        if found:
            url = found.group(1).rstrip(",")
            break
    assert url is not None, "the server did not start"
    threading.Thread(target=lambda: [None for _ in process.stdout or []], daemon=True).start()
    client = httpx.Client(timeout=120)
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

    try:
        print(f"start: {rss_mib(process.pid)} MiB", flush=True)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            for start in range(0, options.requests, 500):
                list(pool.map(one, range(start, min(start + 500, options.requests))))
                print(f"{min(start + 500, options.requests)} requests: "
                      f"{rss_mib(process.pid)} MiB", flush=True)
    finally:
        process.terminate()
        process.wait(60)


if __name__ == "__main__":
    main()
