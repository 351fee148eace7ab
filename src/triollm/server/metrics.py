"""Prometheus metrics with vLLM's names under a ``triollm:`` prefix.

Counters and histograms are fed by the engine after every step (``StatLogger``); the
gauges (running, waiting, KV-cache usage) are read from ``engine.statistics()`` when
``/metrics`` is scraped. Each server has its own registry, so several can live in one
process (tests do).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from triollm.engine.async_engine import AsyncLLMEngine
from triollm.engine.stats import IterationStats

__all__ = ["CONTENT_TYPE", "PrometheusStatLogger"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

disable_created_metrics()  # as vLLM: no *_created series next to every counter

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class _EngineGauges(Collector):
    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self.engine.statistics()
        used = stats.num_total_blocks - stats.num_free_blocks
        for name, documentation, value in (
            ("num_requests_running", "Requests in model execution batches.", stats.num_running),
            ("num_requests_waiting", "Requests waiting to be processed.", stats.num_waiting),
            ("kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.",
             used / stats.num_total_blocks if stats.num_total_blocks else 0.0),
            ("num_preemptions", "Preemptions since start.", stats.num_preemptions),
        ):
            family = GaugeMetricFamily(f"triollm:{name}", documentation,
                                       labels=["model_name"])
            family.add_metric([self.model_name], float(value))
            yield family
        for name, documentation, count in (
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             stats.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
             stats.prefix_cache_hits),
        ):
            counter = CounterMetricFamily(f"triollm:{name}", documentation,
                                          labels=["model_name"])
            counter.add_metric([self.model_name], float(count))
            yield counter


class PrometheusStatLogger:
    """The engine's ``StatLogger`` for ``/metrics``."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineGauges(engine, model_name))
        labels = ["model_name"]
        self.model_name = model_name
        registry = self.registry
        self.prompt_tokens = Counter("triollm:prompt_tokens", "Prefill tokens processed.",
                                     labels, registry=registry).labels(model_name)
        self.generation_tokens = Counter("triollm:generation_tokens",
                                         "Generation tokens processed.", labels,
                                         registry=registry).labels(model_name)
        self.request_success = Counter("triollm:request_success",
                                       "Finished requests, by finish reason.",
                                       [*labels, "finished_reason"], registry=registry)
        for reason in ("stop", "length", "abort"):  # every series exists from the start
            self.request_success.labels(model_name, reason)
        self.request_slo = Counter("triollm:request_slo",
                                   "Finished requests that had a latency target (slo or "
                                   "ttft_slo), by whether they met it.",
                                   [*labels, "outcome"], registry=registry)
        for outcome in ("attained", "missed"):
            self.request_slo.labels(model_name, outcome)
        self.time_to_first_token = Histogram(
            "triollm:time_to_first_token_seconds", "Time to first token.", labels,
            buckets=_TTFT_BUCKETS, registry=registry).labels(model_name)
        self.inter_token_latency = Histogram(
            "triollm:inter_token_latency_seconds", "Time between output tokens.", labels,
            buckets=_ITL_BUCKETS, registry=registry).labels(model_name)
        self.e2e_latency = Histogram(
            "triollm:e2e_request_latency_seconds", "End-to-end request latency.", labels,
            buckets=_E2E_BUCKETS, registry=registry).labels(model_name)
        self.prompt_tokens_per_request = Histogram(
            "triollm:request_prompt_tokens", "Prompt tokens per finished request.", labels,
            buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000),
            registry=registry).labels(model_name)
        self.generation_tokens_per_request = Histogram(
            "triollm:request_generation_tokens", "Generated tokens per finished request.",
            labels, buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000),
            registry=registry).labels(model_name)

    def record(self, stats: IterationStats) -> None:
        if stats.num_prompt_tokens:
            self.prompt_tokens.inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            self.generation_tokens.inc(stats.num_generation_tokens)
        for value in stats.time_to_first_token:
            self.time_to_first_token.observe(value)
        for value in stats.inter_token_latency:
            self.inter_token_latency.observe(value)
        for finished in stats.finished:
            self.request_success.labels(self.model_name, finished.finish_reason).inc()
            self.e2e_latency.observe(finished.e2e_latency)
            self.prompt_tokens_per_request.observe(finished.num_prompt_tokens)
            self.generation_tokens_per_request.observe(finished.num_generation_tokens)
            if finished.slo_attained is not None:
                outcome = "attained" if finished.slo_attained else "missed"
                self.request_slo.labels(self.model_name, outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
