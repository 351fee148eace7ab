"""What one hostile client costs the honest ones: throughput and p99 TPOT, in one run.

Starts ``triollm serve`` (the demo model unless ``--model``) and runs phases of
``--seconds`` each. In every phase ``--honest`` client threads loop over streamed
completions (``--max-tokens`` tokens, ignore_eos, usage included); in all but the
baseline phases one more thread sends one kind of hostile request in a loop:

* ``tokenize-8mb``, ``completions-8mb``, ``chat-8mb``: an 8 MB prompt (just under the
  8 MiB body limit) to /tokenize, completions and chat (both refused for length);
* ``template``: a chat request carrying its own ``chat_template`` of nested loops
  (``range(10000)`` in ``range(10000)``), refused unless the server trusts request
  templates; ``template-trusted`` is the same against a second server started with
  ``--trust-request-chat-template`` (with its own baseline phases), skipped where that
  flag is refused;
* ``stop-300k``: a completion with 300,000 stop strings;
* ``slow-body``: ``--slow-connections`` connections that send headers, then a body
  byte every 2 s, reopened when the server cuts them;
* ``n-stream``: a streamed completion with ``n`` = ``--n`` choices;
* ``health-flood``: ``GET /health`` in a loop, the control for the floods above: what
  answering a client's requests as fast as it sends them costs, whatever they ask.

Reported per phase: the honest clients' output tokens/s and p99 TPOT (per request:
seconds from its first to its last event over its tokens after the first), each as a
ratio to the baselines on either side of it (a baseline phase runs before each hostile
phase and after the last, so a drift of the machine's speed over the run stays out), the
p99 time to first token and the largest gap between two events
of an honest stream (a stalled event loop shows in one of these, or in throughput alone
when the stall lands before a request's first event), the hostile requests' statuses,
the CPU the hostile client itself and the server (with its worker processes) used, in
cores (on a small machine the attacker's own CPU is the honest clients' loss too),
and the CPU the rest of the machine used meanwhile (vs_vllm.py's ``LoadSampler``, in
cores): a figure measured while others used more than a tenth of a core is noisy.
The target is under 10% loss.

    python benchmarks/hostile_load.py                    # every kind, 15 s phases
    python benchmarks/hostile_load.py --kinds stop-300k slow-body --seconds 10
    python benchmarks/hostile_load.py --rounds 3 --seconds 20   # medians over 3 rounds
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import multiprocessing.synchronize
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx

from common import quantile
from triollm.testing import served_url
from vs_vllm import LoadSampler, process_cpu_seconds

BIG = 8_000_000
TEMPLATE = ("{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}"
            "{% endfor %}{{ messages[0]['content'] }}")
KINDS = ("tokenize-8mb", "completions-8mb", "chat-8mb", "template", "stop-300k",
         "slow-body", "n-stream", "health-flood", "template-trusted")


@dataclass
class Phase:
    tokens: int = 0
    tpots: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    max_gap: float = 0.0
    seconds: float = 0.0
    hostile: dict[str, int] = field(default_factory=dict)
    others_cores: float = 0.0
    hostile_cores: float = 0.0
    server_cores: float = 0.0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds

    @property
    def p99_tpot(self) -> float:
        return quantile(self.tpots, 0.99) if self.tpots else float("nan")

    @property
    def p99_ttft(self) -> float:
        return quantile(self.ttfts, 0.99) if self.ttfts else float("nan")


@contextmanager
def server(model: str, extra: list[str]) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    process = subprocess.Popen(
        [sys.executable, "-m", "triollm", "serve", model, "--host", "127.0.0.1", "--port",
         "0", "--max-model-len", "512", "--disable-log-requests", "--optimization-level",
         "0", "--disable-uvicorn-access-log", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert process.stdout is not None
    lines: list[str] = []
    url = served_url(process.stdout, lines)
    try:
        if url is None:
            raise RuntimeError("the server did not start:\n" + "".join(lines[-5:]))
        threading.Thread(target=lambda: [None for _ in process.stdout or []],
                         daemon=True).start()
        yield url, process
    finally:
        process.terminate()
        process.wait(60)


def honest_client(url: str, model: str, max_tokens: int, stop: threading.Event,
                  phase: Phase, lock: threading.Lock) -> None:
    with httpx.Client(timeout=300) as client:
        while not stop.is_set():
            times: list[float] = []
            tokens = 0
            sent = time.perf_counter()
            with client.stream("POST", url + "/v1/completions", json={
                    "model": model, "prompt": "the cat sat on the", "max_tokens": max_tokens,
                    "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}) as response:
                for line in response.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line.removeprefix("data: "))
                    if event.get("choices"):
                        times.append(time.perf_counter())
                    if event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
            gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
            with lock:
                phase.tokens += tokens
                phase.max_gap = max([phase.max_gap, *gaps])
                if times:
                    phase.ttfts.append(times[0] - sent)
                if tokens > 1 and len(times) > 1:
                    phase.tpots.append((times[-1] - times[0]) / (tokens - 1))


def request_loop(send: Callable[[httpx.Client], int], address: str
                 ) -> Callable[[threading.Event, Phase], None]:
    def loop(stop: threading.Event, phase: Phase) -> None:
        transport = httpx.HTTPTransport(local_address=address)
        with httpx.Client(timeout=300, transport=transport) as client:
            while not stop.is_set():
                try:
                    status = str(send(client))
                except httpx.HTTPError as error:
                    status = type(error).__name__
                phase.hostile[status] = phase.hostile.get(status, 0) + 1
    return loop


def slow_bodies(url: str, count: int, address: str
                ) -> Callable[[threading.Event, Phase], None]:
    host, port = url.removeprefix("http://").rsplit(":", 1)

    def connect() -> socket.socket:
        connection = socket.create_connection((host, int(port)), source_address=(address, 0))
        connection.setblocking(False)
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                           b"application/json\r\nContent-Length: 1000000\r\n\r\n")
        return connection

    def loop(stop: threading.Event, phase: Phase) -> None:
        connections = [connect() for _ in range(count)]
        phase.hostile["opened"] = count
        try:
            while not stop.wait(2.0):
                for i, connection in enumerate(connections):
                    try:
                        connection.send(b" ")
                        connection.recv(65536, socket.MSG_PEEK)
                        raise ConnectionError  # answered (408, 503) or closed: again
                    except BlockingIOError:
                        pass
                    except OSError:
                        connection.close()
                        connections[i] = connect()
                        phase.hostile["reopened"] = phase.hostile.get("reopened", 0) + 1
        finally:
            for connection in connections:
                connection.close()
    return loop


def hostile_loops(url: str, model: str, options: argparse.Namespace
                  ) -> dict[str, Callable[[threading.Event, Phase], None]]:
    prompt = ("lorem ipsum dolor " * (BIG // 18 + 1))[:BIG]
    stops = [f"zq{i}x" for i in range(300_000)]
    chat = {"model": model, "max_tokens": 4, "chat_template": TEMPLATE,
            "messages": [{"role": "user", "content": "hi"}]}

    address = options.hostile_address

    def post(path: str, body: dict[str, object]) -> Callable[[httpx.Client], int]:
        content = json.dumps(body).encode()  # once: the client's own CPU is not measured
        headers = {"content-type": "application/json"}
        return lambda client: client.post(url + path, content=content,
                                          headers=headers).status_code

    def n_stream(client: httpx.Client) -> int:
        with client.stream("POST", url + "/v1/completions", json={
                "model": model, "prompt": "the cat", "max_tokens": options.max_tokens,
                "n": options.n, "ignore_eos": True, "stream": True}) as response:
            for _ in response.iter_lines():
                pass
            return response.status_code

    def looped(send: Callable[[httpx.Client], int]
               ) -> Callable[[threading.Event, Phase], None]:
        return request_loop(send, address)

    return {
        "tokenize-8mb": looped(post("/tokenize", {"model": model, "prompt": prompt})),
        "completions-8mb": looped(post("/v1/completions", {
            "model": model, "prompt": prompt, "max_tokens": 4})),
        "chat-8mb": looped(post("/v1/chat/completions", {
            "model": model, "max_tokens": 4,
            "messages": [{"role": "user", "content": prompt}]})),
        "template": looped(post("/v1/chat/completions", chat)),
        "template-trusted": looped(post("/v1/chat/completions", chat)),
        "stop-300k": looped(post("/v1/completions", {
            "model": model, "prompt": "the cat", "max_tokens": options.max_tokens,
            "ignore_eos": True, "stop": stops})),
        "slow-body": slow_bodies(url, options.slow_connections, address),
        "n-stream": looped(n_stream),
        "health-flood": looped(lambda client: client.get(url + "/health").status_code),
    }


FORK = multiprocessing.get_context("fork")
#: How long after its phase a hostile request still in flight may run before its
#: client leaves (and the server stops its work).
CUT_AFTER_SECONDS = 2.0


def _hostile_main(hostile: Callable[[threading.Event, Phase], None],
                  stop: multiprocessing.synchronize.Event,
                  counts: multiprocessing.Queue[dict[str, int]]) -> None:
    phase, stopping, reported = Phase(), threading.Event(), threading.Lock()

    def report(cut: bool) -> None:
        if reported.acquire(blocking=False):
            if cut:
                phase.hostile["cut"] = phase.hostile.get("cut", 0) + 1
            times = os.times()
            counts.put({**phase.hostile, "cpu_ms": int(1000 * (times.user + times.system))})
            counts.close()
            counts.join_thread()

    def relay() -> None:
        stop.wait()
        stopping.set()
        time.sleep(CUT_AFTER_SECONDS)
        # a request still in flight: the client leaves (its connections close with it)
        report(cut=True)
        os._exit(0)

    threading.Thread(target=relay, daemon=True).start()
    hostile(stopping, phase)
    report(cut=False)


def tree_cpu_seconds(root: int) -> float:
    """CPU seconds used so far by process ``root`` and its descendants now alive."""
    processes = process_cpu_seconds()
    tree, changed = {root}, True
    while changed:
        grown = tree | {pid for pid, (_, parent) in processes.items() if parent in tree}
        changed, tree = grown != tree, grown
    return sum(processes[pid][0] for pid in tree if pid in processes)


def run_phase(url: str, options: argparse.Namespace,
              hostile: Callable[[threading.Event, Phase], None] | None,
              server_pid: int) -> Phase:
    phase = Phase()
    server_cpu = tree_cpu_seconds(server_pid)
    lock = threading.Lock()
    stop = threading.Event()
    sampler = LoadSampler(set())
    hostile_process = None
    counts: multiprocessing.Queue[dict[str, int]] = FORK.Queue()
    stop_hostile_process = FORK.Event()
    if hostile is not None:
        # A process of its own (forked: the loop is a closure), so that the hostile
        # client's work never takes the GIL from the honest clients measured here.
        hostile_process = FORK.Process(target=_hostile_main, args=(
            hostile, stop_hostile_process, counts), daemon=True)
        hostile_process.start()
        time.sleep(0.5)  # the hostile request is in before the honest ones start
    honest = [threading.Thread(target=honest_client, args=(
        url, options.model, options.max_tokens, stop, phase, lock), daemon=True)
        for _ in range(options.honest)]
    started = time.perf_counter()
    for thread in honest:
        thread.start()
    time.sleep(options.seconds)
    stop.set()
    stop_hostile_process.set()  # no hostile request starts after the phase
    for thread in honest:
        thread.join()
    phase.seconds = time.perf_counter() - started
    phase.others_cores = sampler.others_cores()
    phase.server_cores = (tree_cpu_seconds(server_pid) - server_cpu) / phase.seconds
    if hostile_process is not None:
        phase.hostile = counts.get(timeout=60)
        phase.hostile_cores = phase.hostile.pop("cpu_ms") / 1000 / phase.seconds
        hostile_process.join(30)
    return phase


def report(name: str, phase: Phase, base: tuple[float, float] | None) -> None:
    ratios = ""
    if base is not None:
        ratios = (f"  {phase.rate / base[0]:5.2f}x tok/s  "
                  f"{phase.p99_tpot / base[1]:5.2f}x p99 TPOT")
    statuses = " ".join(f"{key}:{value}" for key, value in sorted(phase.hostile.items()))
    print(f"{name:17s} {phase.rate:7.1f} tok/s  p99 TPOT {1000 * phase.p99_tpot:7.1f} ms  "
          f"p99 TTFT {1000 * phase.p99_ttft:7.0f} ms  max gap {1000 * phase.max_gap:7.0f} "
          f"ms{ratios}  server {phase.server_cores:.2f} hostile client "
          f"{phase.hostile_cores:.2f} others {phase.others_cores:.2f} cores  {statuses}",
          flush=True)


def run_server_phases(options: argparse.Namespace, kinds: list[str], extra: list[str]
                      ) -> None:
    """A baseline phase before each hostile phase and one after the last: each kind is
    compared with the baselines on either side of it, so a drift of the machine's speed
    over the run (seen at 19% between a run's first and last baselines) stays out. With
    ``--rounds`` above 1 every kind runs once a round (in reverse order every other
    round), and each kind's ratios are summed up by their median over the rounds: one
    phase's p99 over some 70 requests is nearly its slowest request."""
    ratios: dict[str, list[tuple[float, float]]] = {kind: [] for kind in kinds}
    with server(options.model, extra) as (url, process):
        loops = hostile_loops(url, options.model, options)
        run_phase(url, options, None, process.pid)  # warm-up
        before = run_phase(url, options, None, process.pid)
        report("baseline", before, None)
        for round_index in range(options.rounds):
            order = kinds if round_index % 2 == 0 else kinds[::-1]
            for kind in order:
                phase = run_phase(url, options, loops[kind], process.pid)
                after = run_phase(url, options, None, process.pid)
                base = (statistics.fmean([before.rate, after.rate]),
                        statistics.fmean([before.p99_tpot, after.p99_tpot]))
                report(kind, phase, base)
                report("baseline", after, None)
                ratios[kind].append((phase.rate / base[0], phase.p99_tpot / base[1]))
                before = after
    print(f"median over {options.rounds} round(s) (range), against the baselines on "
          "either side:")
    for kind, pairs in ratios.items():
        rates, tails = sorted(r for r, _ in pairs), sorted(t for _, t in pairs)
        print(f"{kind:17s} tok/s {statistics.median(rates):5.2f}x ({rates[0]:.2f}-"
              f"{rates[-1]:.2f})  p99 TPOT {statistics.median(tails):5.2f}x "
              f"({tails[0]:.2f}-{tails[-1]:.2f})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("--model", default="triollm/tiny-demo",
                        help="model to serve (default: the demo model)")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS),
                        help="hostile kinds to run (default: all)")
    parser.add_argument("--seconds", type=float, default=15.0,
                        help="length of each phase (default: 15)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="times each kind runs, interleaved; the summary is the "
                             "median over rounds (default: 1)")
    parser.add_argument("--honest", type=int, default=4,
                        help="honest streaming clients (default: 4)")
    parser.add_argument("--max-tokens", type=int, default=32,
                        help="tokens per honest request (default: 32)")
    parser.add_argument("--n", type=int, default=4,
                        help="choices of the n-stream kind (default: 4)")
    parser.add_argument("--slow-connections", type=int, default=200,
                        help="connections of the slow-body kind (default: 200)")
    parser.add_argument("--hostile-address", default="127.0.0.2",
                        help="the loopback address the hostile client connects from, not "
                             "the honest clients' 127.0.0.1 (default: 127.0.0.2)")
    parser.add_argument("serve_args", nargs="*",
                        help="more `triollm serve` flags, after --")
    options = parser.parse_args()
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; "
          f"{options.rounds} round(s) of {options.seconds:g} s phases, {options.honest} "
          f"honest clients x {options.max_tokens} tokens", flush=True)
    kinds = [kind for kind in options.kinds if kind != "template-trusted"]
    if kinds:
        run_server_phases(options, kinds, options.serve_args)
    if "template-trusted" in options.kinds:
        try:
            run_server_phases(options, ["template-trusted"],
                              [*options.serve_args, "--trust-request-chat-template"])
        except RuntimeError as error:
            print(f"template-trusted: skipped ({str(error).splitlines()[-1].strip()})")


if __name__ == "__main__":
    main()
