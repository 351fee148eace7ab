"""How much a cold start's background compile slows the requests served meanwhile.

Starts ``python -m triollm serve`` on the demo model with every cache empty (fresh
``TRIOLLM_CACHE`` and ``TORCHINDUCTOR_CACHE_DIR``), and as soon as it answers, keeps
``--clients`` clients streaming ``--max-tokens``-token completions back to back until
the log says the compiled forward is in use, then ``--after-seconds`` more. Reported,
for the compile (first answer to switch) and after it: the longest gap between two
tokens of one stream, the p50/p99 request latency and the tokens per second; the time
from launch to the switch; and, from the server's log, how long the serving process
took to load the compiled model, and the longest token gap within that load.
``LoadSampler`` (vs_vllm.py) says how many cores the rest of the machine kept busy.

    python benchmarks/compile_stall.py
    python benchmarks/compile_stall.py --clients 2 --max-tokens 32 --json /tmp/stall.json
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from vs_vllm import LoadSampler

COMPILED = re.compile(r"compiled forward in use after ([0-9.]+) s")
LOADED = re.compile(r"loaded the compiled model from \S+ in ([0-9.]+) s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8391)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--after-seconds", type=float, default=20.0)
    parser.add_argument("--compile-wait", type=float, default=400.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="compile-stall-"))
    env = {**os.environ, "TRIOLLM_CACHE": str(work / "triollm"),
           "TORCHINDUCTOR_CACHE_DIR": str(work / "torch")}
    log_path = work / "server.log"
    started = time.monotonic()
    with open(log_path, "wb") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "triollm", "serve", "--port", str(args.port),
             "--host", "127.0.0.1"], stdout=log, stderr=subprocess.STDOUT, env=env,
            start_new_session=True)
    url = f"http://127.0.0.1:{args.port}/v1/completions"
    body = {"model": "triollm/tiny-demo", "prompt": "Hello there", "stream": True,
            "max_tokens": args.max_tokens, "ignore_eos": True}
    #: (start, end, token arrival times) per request, seconds since launch
    requests: list[tuple[float, float, list[float]]] = []
    stop = threading.Event()

    def one(client: httpx.Client) -> None:
        begun = time.monotonic() - started
        arrivals = []
        with client.stream("POST", url, json=body) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    arrivals.append(time.monotonic() - started)
        requests.append((begun, time.monotonic() - started, arrivals))

    failures: list[str] = []

    def client_loop() -> None:
        with httpx.Client(timeout=300) as client:
            while not stop.is_set():
                try:
                    one(client)
                except httpx.HTTPError as error:
                    failures.append(f"{time.monotonic() - started:.1f} s: {error!r}")
                    time.sleep(0.5)

    load = LoadSampler(set())
    first: float | None = None
    switch: float | None = None
    try:
        while first is None:
            try:
                with httpx.Client(timeout=300) as client:
                    one(client)
                first = time.monotonic() - started
            except httpx.HTTPError:
                time.sleep(0.2)
        clients = [threading.Thread(target=client_loop) for _ in range(args.clients)]
        for thread in clients:
            thread.start()
        deadline = time.monotonic() + args.compile_wait
        while time.monotonic() < deadline and switch is None and server.poll() is None:
            if COMPILED.search(log_path.read_text(errors="replace")):
                switch = time.monotonic() - started
            time.sleep(0.2)
        if server.poll() is None:
            time.sleep(args.after_seconds)
        stop.set()
        for thread in clients:
            thread.join()
    finally:
        others = load.others_cores()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        server.wait(60)
    text = log_path.read_text(errors="replace")
    loaded = LOADED.search(text)
    result = {"first_answer_s": first, "switch_s": switch,
              "server_exit": server.returncode, "failed_requests": len(failures),
              "first_failure": failures[0] if failures else None,
              "load_s": float(loaded.group(1)) if loaded else None,
              "others_cores": others, "log": str(log_path),
              "during": summary(requests, first, switch or float("inf")),
              "after": summary(requests, switch, float("inf")) if switch else None}
    if loaded and switch:
        # the load ends just before the switch (the next step, or within 0.5 s idle)
        result["during_load"] = summary(requests, switch - float(loaded.group(1)) - 0.5,
                                        switch)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


def summary(requests: list[tuple[float, float, list[float]]], start: float, end: float
            ) -> dict[str, float] | None:
    """Token gaps within ``[start, end)`` and latencies of requests begun in it."""
    gaps = [later - earlier for _, _, arrivals in requests
            for earlier, later in itertools.pairwise(arrivals)
            if start <= earlier < end]
    latencies = sorted(done - begun for begun, done, _ in requests if start <= begun < end)
    tokens = sum(1 for _, _, arrivals in requests for t in arrivals if start <= t < end)
    if not latencies or not gaps:
        return None
    span = min(end, max(done for _, done, _ in requests)) - start
    return {"max_token_gap_s": max(gaps), "requests": len(latencies),
            "p50_s": statistics.median(latencies),
            "p99_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
            "tokens_per_s": tokens / span if span > 0 else 0.0}


if __name__ == "__main__":
    main()
