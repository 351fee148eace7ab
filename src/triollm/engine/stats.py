"""What the engine reports about itself.

* ``IterationStats``: what happened since the stats were last taken, handed to every
  ``StatLogger`` after each step (the raw material of metrics).
* ``EngineStatistics``: a snapshot of the engine at any moment (trio's
  ``statistics()`` convention).

No torch, no event loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from triollm.engine.speculative.speculator import SpecDecodingStatistics

__all__ = ["EngineStatistics", "FinishedParentStats", "FinishedRequestStats", "IterationStats",
           "LoggingStatLogger", "StatLogger", "StatLoggers", "stat_logger_list"]


@dataclass(frozen=True, slots=True)
class FinishedRequestStats:
    """One finished sequence (a sample of a request; vLLM counts these), with the
    phases of its life in seconds, as vLLM measures them: queued (arrival to first
    scheduled), prefill (first scheduled to first token), decode (first to last token),
    inference (first scheduled to last token). A phase it never reached is 0."""

    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    #: Whether a request with an SLO kept to it (None for requests without one).
    slo_attained: bool | None = None
    queued_time: float = 0.0
    prefill_time: float = 0.0
    decode_time: float = 0.0
    inference_time: float = 0.0
    #: Decode time over the tokens after the first (0 with fewer than two tokens).
    mean_time_per_output_token: float = 0.0
    num_preemptions: int = 0
    #: The request's ``max_tokens`` (None for pooling requests).
    max_tokens_param: int | None = None


@dataclass(frozen=True, slots=True)
class FinishedParentStats:
    """One finished user request (all of its ``n`` sequences): what a trace span and
    vLLM's per-request parameter histograms describe. Times are ``time.time()``
    seconds; ``first_*`` are None for a request that ended before reaching them."""

    request_id: str
    model_name: str
    trace_headers: Mapping[str, str] | None
    arrival_time: float
    finished_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    num_prompt_tokens: int
    #: Tokens generated over all sequences, and the most any one sequence generated.
    num_generation_tokens: int
    max_num_generation_tokens: int
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    #: Seconds in the model forward and in the runner's ``execute_model`` over the
    #: steps it was part of (only with ``collect_detailed_traces``).
    model_forward_time: float | None = None
    model_execute_time: float | None = None


@dataclass
class IterationStats:
    """What happened since the stats were last taken: the raw material of metrics and
    traces (vLLM's names: prompt / generation tokens, TTFT, inter-token latency,
    finished sequences and requests, tokens per engine step)."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_token: list[float] = field(default_factory=list)
    inter_token_latency: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    finished_requests: list[FinishedParentStats] = field(default_factory=list)
    #: Tokens computed by each engine step taken (prompt chunks and decodes).
    iteration_tokens: list[int] = field(default_factory=list)


class StatLogger(Protocol):
    """Receives what each step did (see ``IterationStats``), on the event loop. For the
    engine's state at any moment, read ``engine.statistics()``."""

    def record(self, stats: IterationStats) -> None: ...


#: vLLM's forms: a list of loggers or logger factories, or a dict of loggers by name.
StatLoggers = Sequence[Any] | Mapping[str, Any]


def stat_logger_list(loggers: StatLoggers | None, config: Any) -> list[StatLogger]:
    """Loggers from any of vLLM's forms: a dict's values, and factories (classes, and
    callables without a ``record`` method) called as ``factory(config, 0)``, as vLLM
    calls them with its config and the engine's index. Raises ``ValueError`` for
    anything that is not a logger."""
    if loggers is None:
        return []
    items = list(loggers.values()) if isinstance(loggers, Mapping) else list(loggers)
    result: list[StatLogger] = []
    for item in items:
        if isinstance(item, type) or (callable(item)
                                      and not callable(getattr(item, "record", None))):
            factory: Callable[[Any, int], Any] = item
            item = factory(config, 0)
        if not callable(getattr(item, "record", None)):
            raise ValueError(f"stat_loggers: {item!r} has no record(stats) method")
        result.append(item)
    return result


@dataclass(frozen=True)
class EngineStatistics:
    """A snapshot of the engine (trio's ``statistics()`` convention)."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    num_open_streams: int
    num_preemptions: int
    num_steps: int
    #: Prompt tokens looked up in the prefix cache since start, and how many were found.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    #: Structured outputs: constraints whose compiled grammar came from the cache, and
    #: constraints compiled, since start.
    grammar_cache_hits: int = 0
    grammar_cache_misses: int = 0
    #: Whether steps run the compiled forward, and whether the runner is still
    #: compiling it in the background (the first step after that switches to it).
    compiled_forward: bool = False
    compiling: bool = False
    #: Speculative decoding's counters since start (None: it is off).
    spec_decoding: SpecDecodingStatistics | None = None

    @property
    def kv_cache_usage(self) -> float:
        """The fraction of KV-cache blocks in use (0 before the cache exists)."""
        total = self.num_total_blocks
        return (total - self.num_free_blocks) / total if total else 0.0


class LoggingStatLogger:
    """vLLM's periodic statistics line: throughput since the previous line, requests
    running and waiting, preemptions, KV-cache usage and prefix-cache hit rate. A
    ``StatLogger`` (``record`` after every step) whose ``log`` the owner calls on its
    interval. The line is at info level while there is work (requests running or
    waiting, or tokens since the previous line), and once more after it, with the
    throughput falling to zero; an idle engine's line goes out at debug level (vLLM's
    rule, which counts the tokens only)."""

    def __init__(self, kv_cache_device: str, *, clock: Callable[[], float] = time.monotonic,
                 logger: logging.Logger | None = None) -> None:
        self.kv_cache_device = kv_cache_device
        self.clock = clock
        self.logger = logger or logging.getLogger("triollm.engine.stats")
        self._last_log = clock()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._last_preemptions = 0
        self._last_throughputs = (0.0, 0.0)
        self._last_spec = SpecDecodingStatistics()

    def record(self, stats: IterationStats) -> None:
        self._prompt_tokens += stats.num_prompt_tokens
        self._generation_tokens += stats.num_generation_tokens

    def log(self, statistics: EngineStatistics) -> None:
        now = self.clock()
        elapsed = now - self._last_log
        prompt = self._prompt_tokens / elapsed if elapsed > 0 else 0.0
        generation = self._generation_tokens / elapsed if elapsed > 0 else 0.0
        idle = not any((prompt, generation, *self._last_throughputs,
                        statistics.num_running, statistics.num_waiting))
        self._last_log, self._prompt_tokens, self._generation_tokens = now, 0, 0
        self._last_throughputs = (prompt, generation)
        parts = ["Avg prompt throughput: %.1f tokens/s", "Avg generation throughput: %.1f "
                 "tokens/s", "Running: %d reqs", "Waiting: %d reqs"]
        values: list[object] = [prompt, generation, statistics.num_running,
                                statistics.num_waiting]
        preemptions = statistics.num_preemptions - self._last_preemptions
        self._last_preemptions = statistics.num_preemptions
        if preemptions > 0:
            parts.append("Preemptions: %d")
            values.append(preemptions)
        parts.append("%s KV cache usage: %.1f%%")
        values += [self.kv_cache_device, 100 * statistics.kv_cache_usage]
        if statistics.prefix_cache_queries:
            parts.append("Prefix cache hit rate: %.1f%%")
            values.append(100 * statistics.prefix_cache_hits / statistics.prefix_cache_queries)
        spec = statistics.spec_decoding
        if spec is not None and spec.num_drafts > self._last_spec.num_drafts:
            drafts = spec.num_drafts - self._last_spec.num_drafts
            drafted = spec.num_draft_tokens - self._last_spec.num_draft_tokens
            accepted = spec.num_accepted_tokens - self._last_spec.num_accepted_tokens
            # vLLM's figures: the mean acceptance length counts the step's own token.
            parts += ["Draft acceptance rate: %.1f%%", "Mean acceptance length: %.2f"]
            values += [100 * accepted / drafted if drafted else 0.0, 1 + accepted / drafts]
            self._last_spec = spec
        self.logger.log(logging.DEBUG if idle else logging.INFO,
                        "Engine 000: " + ", ".join(parts), *values)
