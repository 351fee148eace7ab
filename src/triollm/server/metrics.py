"""Prometheus metrics under vLLM's names, types, buckets and labels, so that vLLM's
Grafana dashboard reads a triollm server unchanged.

Counters and histograms are fed by the engine after every step (``StatLogger``); the
gauges (running, waiting, KV-cache usage) and the engine's own running totals
(preemptions, prefix-cache queries and hits, compiled-grammar cache hits and misses,
speculative decoding's drafts and accepted tokens) are read from
``engine.statistics_by_engine()`` when ``/metrics`` is scraped, as is
``vllm:cache_config_info`` (the KV cache's settings as labels: its dtype, block size and
blocks). Every engine series is labelled ``model_name`` and ``engine`` (the replica's
index: "0" for one engine, "0" to "N-1" with ``--data-parallel-size N``), as vLLM labels
them (the info gauge, as vLLM's, ``engine`` only). What the server's per-client CPU share
held (``triollm:client_*``, unlabelled) is read at scrape time too. Metrics vLLM does not
have carry a ``triollm:`` prefix. Each server has its own registry, so several can live in one
process (tests do).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from triollm.engine.stats import EngineStatistics, IterationStats

if TYPE_CHECKING:
    from triollm.server.client_budget import ClientBudget
    from triollm.server.engine_kind import ServedEngine

__all__ = ["CONTENT_TYPE", "FINISH_REASONS", "PrometheusStatLogger", "request_token_buckets"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

disable_created_metrics()  # as vLLM: no *_created series next to every counter

#: vLLM's bucket families (vllm/v1/metrics/buckets.py).
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                               0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
                               640.0, 2560.0)
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                               0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
#: vLLM's finish reasons: each ``vllm:request_success`` series exists from the start
#: ("error": a request whose own part of a step failed).
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")


#: vLLM's histograms: (name, help, buckets; None: the token-count buckets), keyed by the
#: ``IterationStats`` field each observes.
_HISTOGRAMS: dict[str, tuple[str, str, tuple[float, ...] | None]] = {
    "time_to_first_token": ("vllm:time_to_first_token_seconds",
                            "Histogram of time to first token in seconds.",
                            TIME_TO_FIRST_TOKEN_BUCKETS),
    "inter_token_latency": ("vllm:inter_token_latency_seconds",
                            "Histogram of inter-token latency in seconds.",
                            INTER_TOKEN_LATENCY_BUCKETS),
    "mean_time_per_output_token": ("vllm:request_time_per_output_token_seconds",
                                   "Histogram of time_per_output_token_seconds per request.",
                                   INTER_TOKEN_LATENCY_BUCKETS),
    "e2e_latency": ("vllm:e2e_request_latency_seconds",
                    "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS),
    "queued_time": ("vllm:request_queue_time_seconds",
                    "Histogram of time spent in WAITING phase for request.",
                    REQUEST_LATENCY_BUCKETS),
    "inference_time": ("vllm:request_inference_time_seconds",
                       "Histogram of time spent in RUNNING phase for request.",
                       REQUEST_LATENCY_BUCKETS),
    "prefill_time": ("vllm:request_prefill_time_seconds",
                     "Histogram of time spent in PREFILL phase for request.",
                     REQUEST_LATENCY_BUCKETS),
    "decode_time": ("vllm:request_decode_time_seconds",
                    "Histogram of time spent in DECODE phase for request.",
                    REQUEST_LATENCY_BUCKETS),
    "num_preemptions": ("vllm:request_num_preemptions",
                        "Histogram of the number of times a request was preempted.",
                        REQUEST_NUM_PREEMPTIONS_BUCKETS),
    "num_prompt_tokens": ("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                          None),
    "num_generation_tokens": ("vllm:request_generation_tokens",
                              "Number of generation tokens processed.", None),
    "max_tokens_param": ("vllm:request_params_max_tokens",
                         "Histogram of the max_tokens request parameter.", None),
    "iteration_tokens": ("vllm:iteration_tokens_total",
                         "Histogram of number of tokens per engine_step.",
                         ITERATION_TOKENS_BUCKETS),
    "max_num_generation_tokens": ("vllm:request_max_num_generation_tokens",
                                  "Histogram of maximum number of requested generation "
                                  "tokens.", None),
    "n": ("vllm:request_params_n", "Histogram of the n request parameter.",
          REQUEST_PARAMS_N_BUCKETS),
}
#: The ``FinishedRequestStats`` fields observed for every finished sequence.
_PER_SEQUENCE = ("e2e_latency", "queued_time", "prefill_time", "inference_time",
                 "decode_time", "num_preemptions", "num_prompt_tokens",
                 "num_generation_tokens", "mean_time_per_output_token")


def request_token_buckets(max_model_len: int) -> list[float]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to ``max_model_len``."""
    buckets: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class _EngineState(Collector):
    """What ``engine.statistics_by_engine()`` says at scrape time: gauges, and running
    totals, one series per engine."""

    def __init__(self, engine: ServedEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        each = list(enumerate(self.engine.statistics_by_engine()))
        labels = ["model_name", "engine"]

        def family(kind: type[GaugeMetricFamily] | type[CounterMetricFamily], name: str,
                   documentation: str, value: Callable[[EngineStatistics], float]
                   ) -> GaugeMetricFamily | CounterMetricFamily:
            metric = kind(name, documentation, labels=labels)
            for index, stats in each:
                metric.add_metric([self.model_name, str(index)], float(value(stats)))
            return metric

        for name, documentation, gauge in (
            ("num_requests_running", "Number of requests in model execution batches.",
             lambda s: s.num_running),
            ("num_requests_waiting", "Number of requests waiting to be processed.",
             lambda s: s.num_waiting),
            ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
             lambda s: s.kv_cache_usage),
        ):
            yield family(GaugeMetricFamily, f"vllm:{name}", documentation, gauge)
        for name, documentation, count in (
            ("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
             lambda s: s.num_preemptions),
            ("vllm:prefix_cache_queries",
             "Prefix cache queries, in terms of number of queried tokens.",
             lambda s: s.prefix_cache_queries),
            ("vllm:prefix_cache_hits",
             "Prefix cache hits, in terms of number of cached tokens.",
             lambda s: s.prefix_cache_hits),
            ("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).",
             lambda s: s.prefix_cache_hits),
            ("triollm:structured_outputs_grammar_cache_hits",
             "Structured-output constraints whose compiled grammar came from the cache.",
             lambda s: s.grammar_cache_hits),
            ("triollm:structured_outputs_grammar_cache_misses",
             "Structured-output constraints compiled (not found in the grammar cache).",
             lambda s: s.grammar_cache_misses),
        ):
            yield family(CounterMetricFamily, name, documentation, count)
        yield self._cache_config_info(each)
        specs = [(index, stats.spec_decoding) for index, stats in each
                 if stats.spec_decoding is not None]
        if not specs:
            return
        for name, documentation, field_name in (
            ("num_drafts", "Number of spec decoding drafts.", "num_drafts"),
            ("num_draft_tokens", "Number of draft tokens.", "num_draft_tokens"),
            ("num_accepted_tokens", "Number of accepted tokens.", "num_accepted_tokens"),
        ):
            counter = CounterMetricFamily(f"vllm:spec_decode_{name}", documentation,
                                          labels=labels)
            for index, spec in specs:
                counter.add_metric([self.model_name, str(index)],
                                   float(getattr(spec, field_name)))
            yield counter
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position.",
                                      labels=[*labels, "position"])
        for index, spec in specs:
            for position, accepted in enumerate(spec.num_accepted_tokens_per_pos):
                per_pos.add_metric([self.model_name, str(index), str(position)],
                                   float(accepted))
        yield per_pos

    def _cache_config_info(self, each: list[tuple[int, EngineStatistics]]
                           ) -> GaugeMetricFamily:
        """vLLM's info gauge: the cache config's fields as labels, value 1."""
        cache = self.engine.config.cache
        names = ["block_size", "cache_dtype", "enable_prefix_caching",
                 "gpu_memory_utilization", "num_gpu_blocks", "num_gpu_blocks_override",
                 "engine"]
        gauge = GaugeMetricFamily("vllm:cache_config_info",
                                  "Information of the LLMEngine CacheConfig", labels=names)
        for index, stats in each:
            gauge.add_metric([str(cache.block_size), cache.cache_dtype,
                              str(cache.enable_prefix_caching),
                              str(cache.gpu_memory_utilization), str(stats.num_total_blocks),
                              str(cache.num_gpu_blocks_override), str(index)], 1.0)
        return gauge


class _ClientBudgetState(Collector):
    """What the server's ``ClientBudget`` has held, at scrape time."""

    def __init__(self, budget: ClientBudget) -> None:
        self.budget = budget

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self.budget.statistics()
        yield CounterMetricFamily(
            "triollm:client_answers_held", "Answers held because their client address "
            "was past its share of the server's CPU (--client-cpu-share).",
            value=stats.answers_held)
        yield CounterMetricFamily("triollm:client_seconds_held",
                                  "Seconds those answers were held, in all.",
                                  value=stats.seconds_held)
        yield GaugeMetricFamily("triollm:client_addresses", "Client addresses the share "
                                "keeps account of (those behind, and recent ones).",
                                value=stats.clients)


class _EngineSeries:
    """One engine's counters and histograms (its ``engine`` label)."""

    def __init__(self, registry_metrics: dict[str, Any], labels: list[str]) -> None:
        self.prompt_tokens = registry_metrics["prompt_tokens"].labels(*labels)
        self.generation_tokens = registry_metrics["generation_tokens"].labels(*labels)
        self.request_success = {reason: registry_metrics["success"].labels(*labels, reason)
                                for reason in FINISH_REASONS}
        self.histograms = {key: registry_metrics[key].labels(*labels) for key in _HISTOGRAMS}
        self.request_slo = {outcome: registry_metrics["slo"].labels(*labels, outcome)
                            for outcome in ("attained", "missed")}


class PrometheusStatLogger:
    """The engine's ``StatLogger`` for ``/metrics``: one series per engine (replica)."""

    def __init__(self, engine: ServedEngine, model_name: str) -> None:
        names = ["model_name", "engine"]
        self.registry = registry = CollectorRegistry(auto_describe=True)
        registry.register(_EngineState(engine, model_name))
        token_buckets = tuple(request_token_buckets(engine.config.model.max_model_len))
        metrics: dict[str, Any] = {
            "prompt_tokens": Counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                                     names, registry=registry),
            "generation_tokens": Counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.", names,
                                         registry=registry),
            "success": Counter("vllm:request_success",
                               "Count of successfully processed requests.",
                               [*names, "finished_reason"], registry=registry),
            # triollm's own: requests with a latency target, by whether they met it.
            "slo": Counter("triollm:request_slo", "Finished requests that had a latency "
                           "target (slo or ttft_slo), by whether they met it.",
                           [*names, "outcome"], registry=registry),
            **{key: Histogram(name, documentation, names, registry=registry,
                              buckets=token_buckets if buckets is None else buckets)
               for key, (name, documentation, buckets) in _HISTOGRAMS.items()}}
        self._engines = [_EngineSeries(metrics, [model_name, str(index)])
                         for index in range(engine.data_parallel_size)]

    def record(self, stats: IterationStats, engine_idx: int = 0) -> None:
        series = self._engines[engine_idx]
        if stats.num_prompt_tokens:
            series.prompt_tokens.inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            series.generation_tokens.inc(stats.num_generation_tokens)
        histograms = series.histograms
        for tokens in stats.iteration_tokens:
            histograms["iteration_tokens"].observe(tokens)
        for value in stats.time_to_first_token:
            histograms["time_to_first_token"].observe(value)
        for value in stats.inter_token_latency:
            histograms["inter_token_latency"].observe(value)
        for finished in stats.finished:
            series.request_success[finished.finish_reason].inc()
            for key in _PER_SEQUENCE:
                histograms[key].observe(getattr(finished, key))
            if finished.max_tokens_param:
                histograms["max_tokens_param"].observe(finished.max_tokens_param)
            if finished.slo_attained is not None:
                series.request_slo["attained" if finished.slo_attained else "missed"].inc()
        for request in stats.finished_requests:
            histograms["max_num_generation_tokens"].observe(request.max_num_generation_tokens)
            histograms["n"].observe(request.n)

    def watch_client_budget(self, budget: ClientBudget) -> None:
        """Report what ``budget`` held too (the ``triollm:client_*`` series)."""
        self.registry.register(_ClientBudgetState(budget))

    def render(self) -> bytes:
        return generate_latest(self.registry)
