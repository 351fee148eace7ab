"""OpenTelemetry spans for finished requests, as vLLM emits them.

With ``otlp_traces_endpoint`` set, every finished request becomes one ``llm_request``
span (kind SERVER) from its arrival to its end, a child of the caller's W3C trace
context when its ``trace_headers`` carry one, with vLLM's ``gen_ai.*`` attributes.
``RequestTracer`` is a ``StatLogger``: the engine hands it each step's
``IterationStats`` on the event loop, where making a span only queues it; an
OpenTelemetry ``BatchSpanProcessor`` thread exports the queue, so a slow or dead
collector never holds up a step. The tracer's owner (the async engine's ``run``, or an
``LLM``) shuts it down, which flushes what is queued for a bounded time.

The OpenTelemetry SDK and OTLP exporters are an optional extra
(``pip install 'triollm[tracing]'``); without them only ``otlp_traces_endpoint`` is
refused. No torch, no event loop.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from triollm.engine.stats import FinishedParentStats, IterationStats

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

__all__ = ["TRACE_HEADERS", "RequestTracer", "SpanAttributes", "trace_headers_from",
           "tracing_unavailable_reason"]

logger = logging.getLogger(__name__)

#: The W3C trace-context headers a request's span is parented by.
TRACE_HEADERS = ("traceparent", "tracestate")
#: The OTLP exporter protocol (OpenTelemetry's standard variable) and vLLM's default.
PROTOCOL_VARIABLE = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
DEFAULT_PROTOCOL = "grpc"
SPAN_NAME = "llm_request"
#: How long a tracer's owner waits, when it stops, for queued spans to reach the collector.
SHUTDOWN_SECONDS = 2.0


class SpanAttributes:
    """vLLM's span attribute names (its ``vllm.tracing.SpanAttributes``)."""

    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"
    GEN_AI_LATENCY_TIME_IN_MODEL_FORWARD = "gen_ai.latency.time_in_model_forward"
    GEN_AI_LATENCY_TIME_IN_MODEL_EXECUTE = "gen_ai.latency.time_in_model_execute"


def tracing_unavailable_reason() -> str | None:
    """Why spans cannot be exported here (the SDK or an exporter is missing), or None."""
    try:
        import opentelemetry.exporter.otlp.proto.grpc.trace_exporter
        import opentelemetry.exporter.otlp.proto.http.trace_exporter
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as error:
        return (f"OpenTelemetry is not installed ({error}); install it with "
                f"pip install 'triollm[tracing]'")
    return None


def trace_headers_from(headers: Mapping[str, str]) -> dict[str, str] | None:
    """The W3C trace-context headers among ``headers`` (names in lower case, as HTTP
    servers give them), or None when there are none."""
    found = {name: headers[name] for name in TRACE_HEADERS if name in headers}
    return found or None


def _nanoseconds(seconds: float) -> int:
    return int(seconds * 1e9)


def span_attributes(finished: FinishedParentStats) -> dict[str, Any]:
    """vLLM's attributes of one finished request (those it reached)."""
    names = SpanAttributes
    arrival = finished.arrival_time
    scheduled, first, last = (finished.first_scheduled_time, finished.first_token_time,
                              finished.last_token_time)
    values: dict[str, Any] = {
        names.GEN_AI_REQUEST_ID: finished.request_id,
        names.GEN_AI_RESPONSE_MODEL: finished.model_name,
        names.GEN_AI_USAGE_PROMPT_TOKENS: finished.num_prompt_tokens,
        names.GEN_AI_USAGE_COMPLETION_TOKENS: finished.num_generation_tokens,
        names.GEN_AI_USAGE_NUM_SEQUENCES: finished.n,
        names.GEN_AI_REQUEST_N: finished.n,
        names.GEN_AI_REQUEST_MAX_TOKENS: finished.max_tokens,
        names.GEN_AI_REQUEST_TEMPERATURE: finished.temperature,
        names.GEN_AI_REQUEST_TOP_P: finished.top_p,
        names.GEN_AI_LATENCY_E2E: finished.finished_time - arrival,
        names.GEN_AI_LATENCY_TIME_IN_QUEUE: None if scheduled is None else scheduled - arrival,
        names.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: None if first is None else first - arrival,
        names.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL:
            None if first is None or scheduled is None else first - scheduled,
        names.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE:
            None if first is None or last is None else last - first,
        names.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE:
            None if last is None or scheduled is None else last - scheduled,
        names.GEN_AI_LATENCY_TIME_IN_MODEL_FORWARD: finished.model_forward_time,
        names.GEN_AI_LATENCY_TIME_IN_MODEL_EXECUTE: finished.model_execute_time,
    }
    return {name: value for name, value in values.items() if value is not None}


def exporter_protocol() -> str:
    """The OTLP protocol ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` asks for (default grpc);
    ``ValueError`` naming the variable for any other value."""
    protocol = os.environ.get(PROTOCOL_VARIABLE, DEFAULT_PROTOCOL).strip()
    if protocol not in ("grpc", "http/protobuf"):
        raise ValueError(f"{PROTOCOL_VARIABLE}: expected grpc or http/protobuf, got "
                         f"{protocol!r}")
    return protocol


def _span_exporter(endpoint: str) -> SpanExporter:
    protocol = exporter_protocol()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        return GrpcExporter(endpoint=endpoint, insecure=True)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )

    return HttpExporter(endpoint=endpoint)


#: The OTLP exporters' loggers: one message per retry and per failed batch.
_EXPORTER_LOGGERS = ("opentelemetry.exporter.otlp.proto.grpc.exporter",
                     "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
                     "opentelemetry.exporter.otlp.proto.http.trace_exporter",
                     "opentelemetry.exporter.otlp.common.http")


def _quiet_exporter(exporter: SpanExporter, endpoint: str) -> SpanExporter:
    """``exporter`` saying one line when exports start failing and one when they work
    again, instead of the OTLP exporters' own message per retry and per batch."""
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    for name in _EXPORTER_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL)

    class QuietExporter(SpanExporter):
        def __init__(self) -> None:
            self.failing = False
            self.stopped = False

        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            if self.stopped:
                return SpanExportResult.FAILURE
            try:
                result = exporter.export(spans)
            except Exception as error:  # an exporter bug must not end the export thread
                logger.debug("span export raised", exc_info=error)
                result = SpanExportResult.FAILURE
            if result is SpanExportResult.SUCCESS:
                if self.failing:
                    logger.info("spans reach %s again", endpoint)
                self.failing = False
            elif not self.failing and not self.stopped:
                self.failing = True
                logger.warning("could not send %d span(s) to the OTLP collector at %s; "
                               "spans are dropped until it answers", len(spans), endpoint)
            return result

        def shutdown(self) -> None:
            """Stop now: an export waiting to retry gives up (idempotent)."""
            if not self.stopped:
                self.stopped = True
                exporter.shutdown()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return exporter.force_flush(timeout_millis)

    return QuietExporter()


class RequestTracer:
    """Sends one span per finished request to an OTLP collector (a ``StatLogger``).

    The export thread sends what is queued every ``OTEL_BSP_SCHEDULE_DELAY`` ms
    (OpenTelemetry's variable; 5000 by default) or as soon as 512 spans wait."""

    def __init__(self, endpoint: str) -> None:
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import (
            TraceContextTextMapPropagator,
        )

        attributes: dict[str, Any] = {"triollm.process_id": os.getpid()}
        if "OTEL_SERVICE_NAME" not in os.environ:
            attributes[SERVICE_NAME] = "triollm"
        self.endpoint = endpoint
        # Owned here, not installed as the process's global provider: each engine's spans
        # go to its own endpoint, and shutting one engine down touches no other.
        self._provider = TracerProvider(resource=Resource.create(attributes),
                                        shutdown_on_exit=False)
        self._exporter = _quiet_exporter(_span_exporter(endpoint), endpoint)
        self._provider.add_span_processor(BatchSpanProcessor(self._exporter))
        self._tracer = self._provider.get_tracer("triollm.engine")
        self._propagator = TraceContextTextMapPropagator()
        self._kind = SpanKind.SERVER
        self._shut_down = threading.Event()

    def record(self, stats: IterationStats) -> None:
        for finished in stats.finished_requests:
            self.emit(finished)

    def emit(self, finished: FinishedParentStats) -> None:
        """Queue the span of one finished request (it is exported in the background)."""
        headers = finished.trace_headers
        context = self._propagator.extract(dict(headers)) if headers else None
        span = self._tracer.start_span(
            SPAN_NAME, context=context, kind=self._kind,
            start_time=_nanoseconds(finished.arrival_time),
            attributes=span_attributes(finished))
        span.end(end_time=_nanoseconds(finished.finished_time))

    def force_flush(self) -> None:
        """Export what is queued now, in this thread (blocks until the exporter returns)."""
        self._provider.force_flush()

    def shutdown(self, timeout: float = SHUTDOWN_SECONDS) -> None:
        """Export what is queued and stop the export thread, waiting at most about
        ``timeout`` seconds: past it, an export still waiting on the collector gives up
        and its spans are dropped. Blocks: an async owner calls it in a worker thread."""
        if self._shut_down.is_set():
            return
        self._shut_down.set()
        stopping = threading.Thread(target=self._provider.shutdown, daemon=True,
                                    name="triollm-tracer-shutdown")
        stopping.start()
        stopping.join(timeout)
        if stopping.is_alive():
            logger.warning("spans still queued after %.1f s were dropped (the OTLP "
                           "collector at %s did not take them)", timeout, self.endpoint)
            # The exporter stops retrying at once; a request already on the wire ends at
            # its own timeout, in the export thread (a daemon), which then exits.
            self._exporter.shutdown()
            stopping.join(1.0)
