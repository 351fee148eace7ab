"""Observability as vLLM users run it: OpenTelemetry spans sent to a real OTLP receiver
in this process (HTTP and gRPC), vLLM's Prometheus metrics after a known workload, and
request logs."""

from __future__ import annotations

import concurrent.futures
import gc
import logging
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

from server_helpers import ThreadedServer, server_in_thread
from triollm import LLM, AsyncEngineArgs, AsyncLLMEngine, SamplingParams
from triollm.engine.args import EngineArgs

MODEL = "tiny"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"


# -- an OTLP receiver ---------------------------------------------------------------------


@dataclass
class Receiver:
    """What an OTLP collector received: every span, decoded."""

    endpoint: str
    spans: list[trace_pb2.Span] = field(default_factory=list)
    resources: list[dict[str, Any]] = field(default_factory=list)
    arrived: threading.Condition = field(default_factory=threading.Condition)

    def take(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        with self.arrived:
            for resource_spans in request.resource_spans:
                self.resources.append(attributes(resource_spans.resource.attributes))
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend(scope_spans.spans)
            self.arrived.notify_all()

    def wait_for(self, count: int, timeout: float = 20.0) -> list[trace_pb2.Span]:
        with self.arrived:
            assert self.arrived.wait_for(lambda: len(self.spans) >= count, timeout), (
                f"{len(self.spans)} span(s) arrived, expected {count}")
            return list(self.spans)


def attributes(values: Any) -> dict[str, Any]:
    decoded = {}
    for item in values:
        kind = item.value.WhichOneof("value")
        decoded[item.key] = getattr(item.value, kind)
    return decoded


@pytest.fixture
def http_receiver() -> Iterator[Receiver]:
    """OTLP/HTTP on 127.0.0.1: POST /v1/traces with an ExportTraceServiceRequest."""
    received: list[Receiver] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            request = trace_service_pb2.ExportTraceServiceRequest()
            request.ParseFromString(body)
            received[0].take(request)
            reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200 if self.path == "/v1/traces" else 404)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args: Any) -> None:
            pass

    http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    received.append(Receiver(f"http://127.0.0.1:{http.server_address[1]}/v1/traces"))
    thread = threading.Thread(target=http.serve_forever, daemon=True)
    thread.start()
    try:
        yield received[0]
    finally:
        http.shutdown()
        http.server_close()
        thread.join(10)


@pytest.fixture
def grpc_receiver() -> Iterator[Receiver]:
    """OTLP/gRPC on 127.0.0.1: the TraceService's Export."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)
    server = grpc.server(pool)
    port = server.add_insecure_port("127.0.0.1:0")
    receiver = Receiver(f"http://127.0.0.1:{port}")

    class TraceService(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:
            receiver.take(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceService(), server)
    server.start()
    try:
        yield receiver
    finally:
        server.stop(grace=None).wait(10)
        pool.shutdown(wait=True)


@pytest.fixture(autouse=True)
def quick_export(monkeypatch: pytest.MonkeyPatch) -> None:
    # OpenTelemetry's own variable: the export thread sends every 50 ms, not every 5 s.
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")


def tracing_engine(model: Path, endpoint: str, **kwargs: Any) -> AsyncLLMEngine:
    return AsyncLLMEngine.from_engine_args(AsyncEngineArgs(
        model=str(model), served_model_name=MODEL, dtype="float32", max_model_len=256,
        num_gpu_blocks_override=128, otlp_traces_endpoint=endpoint, **kwargs))


# -- tracing ------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_a_request_span_is_a_child_of_the_callers_trace_with_vllms_attributes(
        protocol: str, llama_path: Path, monkeypatch: pytest.MonkeyPatch,
        http_receiver: Receiver, grpc_receiver: Receiver) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", protocol)
    receiver = http_receiver if protocol == "http/protobuf" else grpc_receiver
    detailed = protocol == "http/protobuf"  # one run with --collect-detailed-traces all
    engine = tracing_engine(llama_path, receiver.endpoint,
                            collect_detailed_traces="all" if detailed else None)
    started = time.time()
    with server_in_thread(engine, served_model_names=(MODEL,)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        reply = client.completions.create(
            model=MODEL, prompt="the quick brown fox", max_tokens=5, temperature=0.7,
            top_p=0.9, extra_body={"ignore_eos": True},
            extra_headers={"traceparent": TRACEPARENT, "tracestate": "vendor=1",
                           "X-Request-Id": "traced-1"})
        client.completions.create(model=MODEL, prompt="no caller trace", max_tokens=2)
        [traced, untraced] = sorted(receiver.wait_for(2), key=lambda s: s.start_time_unix_nano)
        assert anyio_run_is_tracing(server)
        assert export_threads()
    ended = time.time()
    assert not export_threads()  # the engine's run owned the export thread and stopped it

    assert traced.name == "llm_request" and traced.kind == trace_pb2.Span.SPAN_KIND_SERVER
    assert traced.trace_id.hex() == TRACE_ID
    assert traced.parent_span_id.hex() == PARENT_SPAN_ID
    assert traced.trace_state == "vendor=1"
    assert untraced.trace_id.hex() != TRACE_ID and not untraced.parent_span_id

    found = attributes(traced.attributes)
    assert found["gen_ai.request.id"].startswith("traced-1")
    assert found["gen_ai.response.model"] == MODEL
    assert found["gen_ai.request.temperature"] == pytest.approx(0.7)
    assert found["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert found["gen_ai.request.max_tokens"] == 5
    assert found["gen_ai.request.n"] == 1
    assert found["gen_ai.usage.prompt_tokens"] == reply.usage.prompt_tokens
    assert found["gen_ai.usage.completion_tokens"] == reply.usage.completion_tokens == 5
    # The span runs from the request's arrival to its end, and its latencies agree.
    start, end = traced.start_time_unix_nano / 1e9, traced.end_time_unix_nano / 1e9
    assert started <= start < end <= ended
    e2e, ttft, queued = (found["gen_ai.latency.e2e"], found["gen_ai.latency.time_to_first_token"],
                         found["gen_ai.latency.time_in_queue"])
    assert e2e == pytest.approx(end - start, abs=1e-6)
    assert 0 <= queued <= ttft <= e2e
    prefill, decode = (found["gen_ai.latency.time_in_model_prefill"],
                       found["gen_ai.latency.time_in_model_decode"])
    assert queued + prefill == pytest.approx(ttft, abs=1e-6)
    assert found["gen_ai.latency.time_in_model_inference"] == pytest.approx(prefill + decode,
                                                                            abs=1e-6)
    if detailed:
        forward = found["gen_ai.latency.time_in_model_forward"]
        execute = found["gen_ai.latency.time_in_model_execute"]
        assert 0 < forward <= execute <= e2e
    else:
        assert "gen_ai.latency.time_in_model_forward" not in found
    assert receiver.resources[0]["service.name"] == "triollm"


def export_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("OtelBatch")]


def anyio_run_is_tracing(server: ThreadedServer) -> bool:
    import trio

    return bool(trio.from_thread.run(server.handle.engine.is_tracing_enabled,
                                     trio_token=server.token))


def test_offline_llm_sends_a_span_per_request(llama_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              http_receiver: Receiver) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    llm = LLM(str(llama_path), dtype="float32", max_model_len=256, num_gpu_blocks_override=64,
              otlp_traces_endpoint=http_receiver.endpoint)
    outputs = llm.generate(["one", "two"], SamplingParams(max_tokens=3, n=2, ignore_eos=True),
                           use_tqdm=False)
    spans = http_receiver.wait_for(2)
    by_id = {attributes(s.attributes)["gen_ai.request.id"]: attributes(s.attributes)
             for s in spans}
    for output in outputs:
        found = by_id[output.request_id]
        assert found["gen_ai.request.n"] == 2
        assert found["gen_ai.usage.completion_tokens"] == 6
        assert found["gen_ai.usage.prompt_tokens"] == len(output.prompt_token_ids)
    assert export_threads()
    del llm  # its tracer is shut down when it is collected
    gc.collect()
    assert not export_threads()


def test_an_embedding_request_has_its_span_too(pooling_models: dict[str, Path],
                                               monkeypatch: pytest.MonkeyPatch,
                                               http_receiver: Receiver) -> None:
    import trio

    from triollm import PoolingParams

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(
        model=str(pooling_models["bert"]), served_model_name=MODEL, dtype="float32",
        otlp_traces_endpoint=http_receiver.endpoint))

    async def main() -> int:
        async with engine:
            [output] = [o async for o in engine.encode(
                "an embedded sentence", PoolingParams(), "embed-1",
                trace_headers={"Traceparent": TRACEPARENT})]
            return len(output.prompt_token_ids)

    prompt_tokens = trio.run(main)
    [span] = http_receiver.wait_for(1)
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_SPAN_ID
    found = attributes(span.attributes)
    assert found["gen_ai.request.id"] == "embed-1"
    assert found["gen_ai.usage.prompt_tokens"] == prompt_tokens
    assert found["gen_ai.usage.completion_tokens"] == 0
    assert "gen_ai.request.temperature" not in found  # no sampling parameters


def test_a_dead_collector_costs_one_log_line_and_never_holds_up_a_request(
        llama_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    import trio

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    engine = tracing_engine(llama_path, "http://127.0.0.1:9/v1/traces")  # nothing listens
    caplog.set_level(logging.DEBUG)

    async def main() -> float:
        async with engine:
            for index in range(4):
                started = time.monotonic()
                outputs = [o async for o in engine.generate(
                    "hello", SamplingParams(max_tokens=4, ignore_eos=True), f"r{index}")]
                assert outputs[-1].finished
                assert time.monotonic() - started < 5
                await trio.sleep(0.2)  # let the export thread try (and fail) meanwhile
            stopping = time.monotonic()
        return time.monotonic() - stopping

    shutdown = trio.run(main)
    assert shutdown < 5  # the bounded flush (2 s), not the exporter's retries
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len([r for r in warnings if r.name == "triollm.engine.tracing"]) <= 2
    assert not [r for r in warnings if r.name.startswith("opentelemetry")]


def test_tracing_arguments_are_checked_by_name(llama_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="collect_detailed_traces: needs otlp_traces_endpoint"):
        EngineArgs(model=str(llama_path), collect_detailed_traces="all").create_engine_config()
    with pytest.raises(ValueError, match="collect_detailed_traces: expected model, worker or all"):
        EngineArgs(model=str(llama_path), otlp_traces_endpoint="http://c:4318",
                   collect_detailed_traces="model,gpu").create_engine_config()
    config = EngineArgs(model=str(llama_path), otlp_traces_endpoint="http://c:4318",
                        collect_detailed_traces=["worker"]).create_engine_config()
    assert config.observability.collect_detailed_traces == ("worker",)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: expected grpc"):
        EngineArgs(model=str(llama_path),
                   otlp_traces_endpoint="http://c:4318").create_engine_config()


# -- metrics ------------------------------------------------------------------------------


def scrape(server: ThreadedServer) -> tuple[dict[str, str], dict[tuple[str, str], float]]:
    """/metrics as {name: type} and {(series name, labels): value}."""
    types: dict[str, str] = {}
    values: dict[tuple[str, str], float] = {}
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            types[name] = kind
        elif line and not line.startswith("#"):
            match = re.fullmatch(r"([^{ ]+)(\{[^}]*\})? (\S+)", line)
            assert match, line
            values[(match.group(1), match.group(2) or "")] = float(match.group(3))
    return types, values


#: vLLM's time-to-first-token buckets, as its Grafana dashboard reads them.
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                     2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


def value(values: dict[tuple[str, str], float], name: str, **labels: str) -> float:
    """The one series of ``name`` with ``labels`` (and vLLM's model_name and engine)."""
    wanted = {"model_name": MODEL, "engine": "0", **labels}
    found = [v for (series, label_text), v in values.items() if series == name and all(
        f'{k}="{w}"' in label_text for k, w in wanted.items())]
    assert len(found) == 1, (name, labels, found)
    return found[0]


#: Every series vLLM's Grafana dashboard queries
#: (examples/observability/prometheus_grafana/grafana.json), each by model_name.
DASHBOARD_SERIES = (
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total", "vllm:inter_token_latency_seconds_bucket",
    "vllm:inter_token_latency_seconds_sum", "vllm:inter_token_latency_seconds_count",
    "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count", "vllm:kv_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total", "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
)


def test_metrics_after_a_known_workload_carry_vllms_names_types_and_values(
        llama_path: Path) -> None:
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(
        model=str(llama_path), dtype="float32", max_model_len=256, num_gpu_blocks_override=128,
        block_size=4, kv_cache_dtype="fp8_e5m2"))
    with server_in_thread(engine, served_model_names=(MODEL,)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        shared = "one two three four five six seven eight nine ten"
        replies = [
            client.completions.create(model=MODEL, prompt=shared, max_tokens=4,
                                      extra_body={"ignore_eos": True}),
            client.completions.create(model=MODEL, prompt=shared, max_tokens=3,
                                      extra_body={"ignore_eos": True}),  # a prefix hit
            client.completions.create(model=MODEL, prompt="other words", max_tokens=3, n=2,
                                      extra_body={"ignore_eos": True}),
        ]
        stats = server.handle.engine.statistics()
        types, values = scrape(server)

    # n=2 is two sequences, each counted as vLLM counts them.
    sequences = [(r.usage.prompt_tokens, len(r.choices), max_tokens)
                 for r, max_tokens in zip(replies, (4, 3, 3), strict=True)]
    prompt_total = sum(p * n for p, n, _ in sequences)
    generated = sum(n * m for _, n, m in sequences)
    finished = sum(n for _, n, _ in sequences)
    assert generated == sum(r.usage.completion_tokens for r in replies) == 13

    # prometheus_client (vLLM's too) names a counter's TYPE line after its _total series.
    expected_types = {
        "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
    } | {name + "_total": "counter" for name in (
        "vllm:num_preemptions", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
        "vllm:prompt_tokens_cached", "vllm:prompt_tokens", "vllm:generation_tokens",
        "vllm:request_success", "triollm:request_slo")
    } | {name: "histogram" for name in (
        "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
        "vllm:request_time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds", "vllm:request_inference_time_seconds",
        "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
        "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
        "vllm:iteration_tokens_total", "vllm:request_max_num_generation_tokens",
        "vllm:request_params_n", "vllm:request_params_max_tokens",
        "vllm:request_num_preemptions")}
    for name, kind in expected_types.items():
        assert types.get(name) == kind, (name, types.get(name))
    for series in DASHBOARD_SERIES:
        assert any(name == series and f'model_name="{MODEL}"' in labels
                   for name, labels in values), series

    assert value(values, "vllm:num_requests_running") == 0
    assert value(values, "vllm:num_requests_waiting") == 0
    assert types.get("vllm:cache_config_info") == "gauge"
    [(_, info)] = [key for key in values if key[0] == "vllm:cache_config_info"]
    for label in ('cache_dtype="fp8_e5m2"', 'block_size="4"', 'num_gpu_blocks="128"',
                  'engine="0"'):
        assert label in info
    used = stats.num_total_blocks - stats.num_free_blocks
    assert value(values, "vllm:kv_cache_usage_perc") == pytest.approx(
        used / stats.num_total_blocks)
    assert value(values, "vllm:prompt_tokens_total") == prompt_total
    assert value(values, "vllm:generation_tokens_total") == generated
    assert value(values, "vllm:request_success_total", finished_reason="length") == finished
    for reason in ("stop", "abort", "error"):
        assert value(values, "vllm:request_success_total", finished_reason=reason) == 0
    hits = value(values, "vllm:prefix_cache_hits_total")
    assert hits == stats.prefix_cache_hits > 0
    assert value(values, "vllm:prefix_cache_queries_total") == stats.prefix_cache_queries
    assert value(values, "vllm:num_preemptions_total") == 0
    # Per finished sequence: every histogram counts each one once.
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
                 "vllm:request_time_per_output_token_seconds", "vllm:request_prompt_tokens",
                 "vllm:request_generation_tokens", "vllm:request_params_max_tokens",
                 "vllm:request_num_preemptions"):
        assert value(values, name + "_count") == finished, name
    assert value(values, "vllm:request_prompt_tokens_sum") == prompt_total
    assert value(values, "vllm:request_generation_tokens_sum") == generated
    assert value(values, "vllm:request_params_max_tokens_sum") == 4 + 3 + 3 + 3
    # Every token after a sequence's first is one inter-token interval.
    assert value(values, "vllm:inter_token_latency_seconds_count") == generated - finished
    # Per request: n and the longest sequence.
    assert value(values, "vllm:request_params_n_count") == 3
    assert value(values, "vllm:request_params_n_sum") == 4
    assert value(values, "vllm:request_max_num_generation_tokens_sum") == 4 + 3 + 3
    # Each step computes the prompt tokens not found in the cache and one token per
    # decode; a sequence's first token comes with its last prompt chunk.
    assert value(values, "vllm:iteration_tokens_total_sum") == (
        prompt_total - hits + generated - finished)
    # vLLM's buckets (vllm/v1/metrics/buckets.py), cumulative: each counts the sequences
    # at or under its bound, the last one every finished sequence; and the latency phases
    # add up to the end-to-end latency.
    ttft = [value(values, "vllm:time_to_first_token_seconds_bucket", le=str(bound))
            for bound in VLLM_TTFT_BUCKETS]
    assert ttft == sorted(ttft) and ttft[-1] == finished
    assert ("vllm:time_to_first_token_seconds_bucket",
            f'{{engine="0",le="2560.0",model_name="{MODEL}"}}') in values
    queue = value(values, "vllm:request_queue_time_seconds_sum")
    inference = value(values, "vllm:request_inference_time_seconds_sum")
    assert queue + inference <= value(values, "vllm:e2e_request_latency_seconds_sum") + 1e-6


def test_disable_log_stats_turns_metrics_and_the_stats_line_off(llama_path: Path) -> None:
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(
        model=str(llama_path), dtype="float32", max_model_len=128, num_gpu_blocks_override=32,
        disable_log_stats=True))
    assert not engine.log_stats
    with server_in_thread(engine, served_model_names=(MODEL,)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert "vllm:" not in httpx.get(server.url + "/metrics").text


# -- logs ---------------------------------------------------------------------------------


def test_the_stats_line_reads_as_vllms(llama_path: Path, caplog: pytest.LogCaptureFixture
                                       ) -> None:
    import trio

    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(
        model=str(llama_path), dtype="float32", max_model_len=128, num_gpu_blocks_override=32))
    caplog.set_level(logging.INFO, logger="triollm.engine.stats")

    async def main() -> None:
        async with engine:
            [o async for o in engine.generate("hello", SamplingParams(max_tokens=6,
                                                                     ignore_eos=True), "s1")]
            await engine.do_log_stats()

    trio.run(main)
    [line] = [r.getMessage() for r in caplog.records if r.name == "triollm.engine.stats"]
    assert re.fullmatch(r"Engine 000: Avg prompt throughput: \d+\.\d tokens/s, Avg generation "
                        r"throughput: \d+\.\d tokens/s, Running: 0 reqs, Waiting: 0 reqs, "
                        r"CPU KV cache usage: 0\.0%, Prefix cache hit rate: 0\.0%", line), line


@pytest.mark.parametrize("enabled", [False, True])
def test_prompts_are_logged_only_when_asked_and_cut_to_max_log_len(
        enabled: bool, llama_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(
        model=str(llama_path), dtype="float32", max_model_len=128, num_gpu_blocks_override=32,
        enable_log_requests=enabled, max_log_len=3))
    caplog.set_level(logging.INFO)
    with server_in_thread(engine, served_model_names=(MODEL,)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        client.completions.create(model=MODEL, prompt="secret words " * 8, max_tokens=2)
    received = [r.getMessage() for r in caplog.records
                if r.getMessage().startswith("Received request")]
    assert "secret" not in caplog.text or enabled
    if not enabled:
        assert received == []
        return
    [line] = received
    ids = re.search(r"'prompt_token_ids': \[([^\]]*)\]", line)
    assert ids is not None and len(ids.group(1).split(",")) == 3


def test_a_failing_route_logs_the_id_it_answers_under(
        llama_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    from triollm.server.routes import completions

    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug after the id was chosen")

    monkeypatch.setattr(completions, "respond", broken)
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(
        model=str(llama_path), dtype="float32", max_model_len=128, num_gpu_blocks_override=32))
    caplog.set_level(logging.ERROR)
    with server_in_thread(engine, served_model_names=(MODEL,)) as server:
        response = httpx.post(server.url + "/v1/completions",
                              json={"model": MODEL, "prompt": "x", "request_id": "body-id-7"})
        assert response.status_code == 500
        deadline = time.monotonic() + 10
        while "a bug after" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.01)
    assert "(request id body-id-7) failed" in caplog.text
