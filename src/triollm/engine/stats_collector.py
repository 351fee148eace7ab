"""What ``EngineCore`` records for the stat loggers as requests run: tokens per step,
per-token latencies, each finished sequence's phases and each finished request's
summary (``IterationStats``, engine/stats.py), and with ``collect_detailed_traces`` the
model's time in each request."""

from __future__ import annotations

from collections.abc import Iterable

from triollm.engine.output_processor import ParentRequest
from triollm.engine.request import Request
from triollm.engine.request_registry import RequestRegistry
from triollm.engine.stats import FinishedParentStats, FinishedRequestStats, IterationStats
from triollm.step import RunnerOutput, SchedulerOutput

__all__ = ["StatsCollector"]


class StatsCollector:
    """Gathers ``IterationStats`` until ``take()``."""

    def __init__(self, model_name: str, detailed_traces: Iterable[str]) -> None:
        self.model_name = model_name
        #: Off unless someone takes the stats, so an offline run does not accumulate
        #: per-token latencies.
        self.enabled = False
        #: Add each step's model forward and ``execute_model`` seconds to the metrics of
        #: the requests in it (``collect_detailed_traces``: "model", "worker").
        detailed = set(detailed_traces)
        self.forward_time = "model" in detailed
        self.execute_time = "worker" in detailed
        self._stats = IterationStats()

    def take(self) -> IterationStats:
        """The stats gathered since the last call (and start afresh)."""
        stats, self._stats = self._stats, IterationStats()
        return stats

    def step(self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput,
             requests: RequestRegistry) -> None:
        """A step ended: its tokens, and the model's time in each of its requests."""
        if self.enabled:
            self._stats.iteration_tokens.append(scheduler_output.num_batched_tokens)
        forward = runner_output.forward_seconds if self.forward_time else None
        execute = runner_output.execute_seconds if self.execute_time else None
        if forward is None and execute is None:
            return
        for item in scheduler_output.scheduled:
            request = requests.sample(item.request_id)
            if request is None:
                continue
            metrics = request.metrics
            if forward is not None:
                metrics.model_forward_time = (metrics.model_forward_time or 0.0) + forward
            if execute is not None:
                metrics.model_execute_time = (metrics.model_execute_time or 0.0) + execute

    def token(self, request: Request, now: float, count: int = 1) -> None:
        """A step's sampled tokens (``count``: several where drafts were accepted), before
        the request's metrics take them; one inter-token latency per step, as vLLM."""
        if not self.enabled:
            return
        stats, metrics = self._stats, request.metrics
        stats.num_generation_tokens += count
        if metrics.first_token_time is None:
            stats.num_prompt_tokens += request.num_prompt_tokens
            stats.time_to_first_token.append(now - metrics.arrival_time)
        elif metrics.last_token_time is not None:
            stats.inter_token_latency.append(now - metrics.last_token_time)

    def pooled(self, request: Request, now: float) -> None:
        """A pooling request's one output."""
        if self.enabled:
            self._stats.num_prompt_tokens += request.num_prompt_tokens
            self._stats.time_to_first_token.append(now - request.metrics.arrival_time)

    def finished_sample(self, request: Request, finish_reason: str, now: float) -> None:
        if self.enabled:
            self._stats.finished.append(_finished_request_stats(request, finish_reason, now))

    def finished_request(self, parent: ParentRequest) -> None:
        if self.enabled:
            self._stats.finished_requests.append(self._finished_parent_stats(parent))

    def _finished_parent_stats(self, parent: ParentRequest) -> FinishedParentStats:
        children = parent.children
        metrics = [child.metrics for child in children]
        params = children[0].sampling_params

        def earliest(times: Iterable[float | None]) -> float | None:
            return min((t for t in times if t is not None), default=None)

        forward = [m.model_forward_time for m in metrics if m.model_forward_time is not None]
        execute = [m.model_execute_time for m in metrics if m.model_execute_time is not None]
        return FinishedParentStats(
            request_id=parent.request_id,
            model_name=self.model_name,
            trace_headers=parent.trace_headers,
            arrival_time=metrics[0].arrival_time,
            finished_time=max(m.finished_time or m.arrival_time for m in metrics),
            first_scheduled_time=earliest(m.first_scheduled_time for m in metrics),
            first_token_time=earliest(m.first_token_time for m in metrics),
            last_token_time=max((m.last_token_time for m in metrics
                                 if m.last_token_time is not None), default=None),
            num_prompt_tokens=len(parent.prompt_token_ids),
            num_generation_tokens=sum(child.num_output_tokens for child in children),
            max_num_generation_tokens=max(child.num_output_tokens for child in children),
            n=len(children),
            max_tokens=None if params is None else params.max_tokens,
            temperature=None if params is None else params.temperature,
            top_p=None if params is None else params.top_p,
            # The sequences of one request run in the same steps: the longest is its time.
            model_forward_time=max(forward) if forward else None,
            model_execute_time=max(execute) if execute else None)


def _finished_request_stats(request: Request, finish_reason: str,
                            now: float) -> FinishedRequestStats:
    """vLLM's per-sequence statistics: its phases measured from its timestamps."""
    metrics = request.metrics
    scheduled = metrics.first_scheduled_time
    first, last = metrics.first_token_time, metrics.last_token_time
    decode = last - first if first is not None and last is not None else 0.0
    generated = request.num_output_tokens
    params = request.sampling_params
    return FinishedRequestStats(
        finish_reason=finish_reason, e2e_latency=now - metrics.arrival_time,
        num_prompt_tokens=request.num_prompt_tokens, num_generation_tokens=generated,
        slo_attained=metrics.slo_attained,
        queued_time=(scheduled if scheduled is not None else now) - metrics.arrival_time,
        prefill_time=first - scheduled if first is not None and scheduled is not None
        else 0.0,
        decode_time=decode,
        inference_time=last - scheduled if last is not None and scheduled is not None
        else 0.0,
        mean_time_per_output_token=decode / (generated - 1) if generated > 1 else 0.0,
        num_preemptions=metrics.num_preemptions,
        max_tokens_param=None if params is None else params.max_tokens)
