"""What OpenTelemetry tracing costs the engine: requests per second with and without
``otlp_traces_endpoint``, in one run, through ``AsyncLLMEngine``.

* ``fake``: the zero-cost fake runner (one token per request per step), so the engine
  does nothing but schedule, deliver and finish requests: the worst case for any
  per-request cost on the event loop. Requests are short (4 tokens), so every few steps
  finish many of them and each one becomes a span.
* ``llama``: the benchmarks' 85M random-weight Llama in bf16 (common.save_llama), 64
  requests of 64 prompt and 64 output tokens, 16 at a time: a real step.

The OTLP/HTTP collector is a child process that answers every export. Rounds alternate
tracing off and on in fresh interpreters, so drift shows up in both.

    python benchmarks/tracing_overhead.py                 # both workloads, 2 rounds
    python benchmarks/tracing_overhead.py --workloads fake --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from common import save_llama
from vs_vllm import CONTAMINATED_CORES, platform_line, run_child


def collector(port_file: str) -> None:
    """An OTLP/HTTP endpoint that answers 200 and counts the bytes it was sent."""
    received = {"requests": 0, "bytes": 0}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            received["bytes"] += len(self.rfile.read(int(self.headers["Content-Length"])))
            received["requests"] += 1
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    Path(port_file).write_text(str(server.server_address[1]))
    server.serve_forever()


#: workload -> (requests, prompt tokens, output tokens, concurrency)
WORKLOADS = {"fake": (2000, 4, 4, 128), "llama": (64, 64, 64, 16)}


def child(endpoint: str | None, workload: str, model_dir: str | None) -> None:
    import trio

    from triollm import AsyncEngineArgs, AsyncLLMEngine, SamplingParams
    from triollm.sampling_params import RequestOutputKind
    from triollm.testing import FakeModelRunner

    os.environ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "http/protobuf"
    requests, prompt_len, tokens, concurrency = WORKLOADS[workload]
    if model_dir is None:
        runner = FakeModelRunner(num_kv_blocks=100_000, vocab_size=1000)
        engine = AsyncLLMEngine.from_engine_args(
            AsyncEngineArgs(max_model_len=256, max_num_seqs=concurrency, block_size=16,
                            otlp_traces_endpoint=endpoint, disable_log_stats=True),
            runner_factory=lambda: runner)
    else:
        engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(
            model=model_dir, dtype="bfloat16", max_model_len=256, max_num_seqs=concurrency,
            otlp_traces_endpoint=endpoint, disable_log_stats=True))
    prompt = {"prompt_token_ids": [(7 * i) % 900 + 10 for i in range(prompt_len)]}
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, detokenize=False,
                            output_kind=RequestOutputKind.FINAL_ONLY)

    async def main() -> float:
        async with engine:
            sent = iter(range(requests))

            async def client() -> None:
                for index in sent:
                    async for _ in engine.generate(prompt, params, f"r{index}"):
                        pass

            started = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for _ in range(concurrency):
                    nursery.start_soon(client)
            return time.perf_counter() - started

    elapsed = trio.run(main)
    print("RESULT " + json.dumps({"requests_per_s": requests / elapsed}))


def emit_cost(endpoint: str) -> float:
    """Microseconds the event loop spends making one finished request's span."""
    from triollm.engine.stats import FinishedParentStats
    from triollm.engine.tracing import RequestTracer

    os.environ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "http/protobuf"
    tracer = RequestTracer(endpoint)
    now = time.time()
    finished = FinishedParentStats(
        request_id="req-1", model_name="model",
        trace_headers={"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-"
                                      "00f067aa0ba902b7-01"},
        arrival_time=now - 1, finished_time=now, first_scheduled_time=now - 0.9,
        first_token_time=now - 0.8, last_token_time=now, num_prompt_tokens=50,
        num_generation_tokens=30, max_num_generation_tokens=30, max_tokens=30,
        temperature=0.7, top_p=0.9)
    samples = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(400):  # below the SDK's queue limit (2048), so none is dropped
            tracer.emit(finished)
        samples.append((time.perf_counter() - started) / 400 * 1e6)
        tracer.force_flush()
    tracer.shutdown()
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS),
                        default=["fake", "llama"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", nargs=3, metavar=("ENDPOINT", "WORKLOAD", "MODEL"))
    parser.add_argument("--collector", metavar="PORT_FILE")
    args = parser.parse_args()
    if args.collector:
        collector(args.collector)
        return
    if args.child:
        endpoint, workload, model = args.child
        child(None if endpoint == "-" else endpoint, workload, None if model == "-" else model)
        return

    port_file = Path(f"/tmp/triollm-collector-{os.getpid()}")
    receiver = subprocess.Popen([sys.executable, __file__, "--collector", str(port_file)])
    try:
        while not port_file.exists():
            time.sleep(0.05)
        endpoint = f"http://127.0.0.1:{port_file.read_text()}/v1/traces"
        print(platform_line())
        model_dir = tempfile.mkdtemp(prefix="triollm-tracing-llama-")
        if "llama" in args.workloads:
            save_llama(model_dir)
        for workload in args.workloads:
            model = model_dir if workload == "llama" else "-"
            results: dict[str, list[float]] = {"off": [], "on": []}
            for round_index in range(args.rounds):
                for label in ("off", "on"):
                    result, others = run_child(
                        [sys.executable, __file__, "--child",
                         endpoint if label == "on" else "-", workload, model],
                        f"{workload} tracing {label}", neighbours={receiver.pid})
                    flag = (f"  CONTAMINATED (others > {CONTAMINATED_CORES} cores)"
                            if others > CONTAMINATED_CORES else "")
                    print(f"{workload} round {round_index + 1} tracing {label:3s}: "
                          f"{result['requests_per_s']:8.1f} requests/s  (others: "
                          f"{others:.3f} cores){flag}")
                    results[label].append(result["requests_per_s"])
            off, on = statistics.median(results["off"]), statistics.median(results["on"])
            print(f"{workload} median: off {off:.1f}, on {on:.1f} requests/s: tracing costs "
                  f"{100 * (1 - on / off):.1f}% ({1e6 * (1 / on - 1 / off):.0f} us per "
                  f"request)")
        shutil.rmtree(model_dir, ignore_errors=True)
        print(f"one span on the event loop: {emit_cost(endpoint):.1f} us (median of 5 x 400)")
    finally:
        receiver.kill()
        receiver.wait()
        port_file.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
