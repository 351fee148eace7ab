"""What the engine reports about itself.

* ``IterationStats``: what happened since the stats were last taken, handed to every
  ``StatLogger`` after each step (the raw material of metrics).
* ``EngineStatistics``: a snapshot of the engine at any moment (trio's
  ``statistics()`` convention).

No torch, no event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["EngineStatistics", "FinishedRequestStats", "IterationStats", "StatLogger",
           "StatLoggers", "stat_logger_list"]


@dataclass(frozen=True, slots=True)
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    #: Whether a request with an SLO kept to it (None for requests without one).
    slo_attained: bool | None = None


@dataclass
class IterationStats:
    """What happened since the stats were last taken: the raw material of metrics
    (vLLM's names: prompt / generation tokens, TTFT, inter-token latency, finished)."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_token: list[float] = field(default_factory=list)
    inter_token_latency: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)


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
