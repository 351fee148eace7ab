"""Which requests run in the next step, and how many tokens each computes.

vLLM V1's rule: there are no prefill and decode phases. Each running request's
computed tokens catch up with its total tokens under a per-step token budget, so
prefill chunks and decodes share a step. When KV blocks run short, the newest
running request (the lowest-priority one under ``priority``) is preempted: its blocks
are freed and it recomputes later from its prompt and the tokens it already has.
No torch, no event loop.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from triollm.engine.block_manager import BlockManager
from triollm.engine.request import Request, RequestStatus
from triollm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from triollm.config import SchedulerConfig

__all__ = ["ScheduledRequest", "Scheduler", "SchedulerOutput", "SchedulerStatistics"]


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's share of a step: compute ``token_ids`` at positions
    ``start_position ...``; if ``sample``, a token is sampled after the last of them."""

    request_id: str
    token_ids: list[int]
    start_position: int
    block_table: list[int]
    sample: bool
    prompt_token_ids: list[int]
    sampling_params: SamplingParams

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        return (self.sampling_params.prompt_logprobs is not None
                and self.start_position < len(self.prompt_token_ids) - 1)


@dataclass(frozen=True)
class SchedulerOutput:
    """Everything the model runner needs for one step."""

    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    #: Requests that finished or were aborted since the previous step: the runner
    #: drops whatever per-request state it keeps for them.
    finished_request_ids: list[str] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class SchedulerStatistics:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._finished_since_last_step: list[str] = []
        self._num_preemptions = 0
        #: Every request in ``running`` or ``waiting``, by id.
        self._queued: dict[str, Request] = {}
        #: Finished requests still in ``running`` / ``waiting`` (dropped lazily).
        self._num_stale = 0

    # -- requests in and out -------------------------------------------------------

    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self._queued[request.request_id] = request
        self.waiting.append(request)
        if self.config.policy == "priority":
            self.waiting.sort(key=_priority_key)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Remove requests from the queues and free their blocks. Unknown ids are ignored.

        O(1) per request: the queues drop finished requests lazily, on their next use,
        so aborting thousands of requests one by one stays linear."""
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        removed = []
        for request_id in request_ids:
            request = self._queued.pop(request_id, None)
            if request is None:
                continue
            request.status = status
            self.block_manager.free(request_id)
            self._finished_since_last_step.append(request_id)
            removed.append(request)
        if removed:
            self._num_stale += len(removed)
        return removed

    def _drop_finished(self) -> None:
        if self._num_stale:
            self.running = [r for r in self.running if not r.is_finished]
            self.waiting = [r for r in self.waiting if not r.is_finished]
            self._num_stale = 0

    def has_unfinished_requests(self) -> bool:
        return bool(self._queued)

    # -- the step ------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self._drop_finished()
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:  # cannot happen for a running request; guards an endless loop
                raise RuntimeError(f"{request!r} is running with nothing to compute")
            while not self.block_manager.allocate(
                request.request_id, request.num_computed_tokens + num_new
            ):
                victim = self._pop_victim()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                scheduled.append(self._schedule(request, num_new))
                budget -= num_new
                index += 1
                continue
            break

        # Like vLLM: admit nothing new in a step that had to preempt.
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[0]
            if request.num_computed_tokens == 0 and request.sampling_params.prompt_logprobs is None:
                # Reuse the KV of the longest cached prefix (prompt logprobs need every
                # position's logits, so those requests compute everything).
                request.num_computed_tokens = self.block_manager.attach_cached_prefix(
                    request.request_id, request.all_token_ids)
            num_new = request.num_tokens - request.num_computed_tokens
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    self._detach(request)
                    break
                num_new = budget
            if not self.block_manager.allocate(request.request_id,
                                               request.num_computed_tokens + num_new):
                self._detach(request)
                break
            self.waiting.pop(0)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(self._schedule(request, num_new))
            budget -= num_new

        finished, self._finished_since_last_step = self._finished_since_last_step, []
        return SchedulerOutput(
            scheduled=scheduled,
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            finished_request_ids=finished,
            preempted_request_ids=preempted,
        )

    def _schedule(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        end = start + num_new
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start:end],
            start_position=start,
            block_table=list(self.block_manager.block_table(request.request_id)),
            sample=end == request.num_tokens,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
        )

    def _detach(self, request: Request) -> None:
        """A waiting request that could not be admitted gives back its cached blocks."""
        if request.num_computed_tokens:
            self.block_manager.free(request.request_id)
            request.num_computed_tokens = 0

    def _pop_victim(self) -> Request:
        if self.config.policy == "priority":
            victim = max(self.running, key=_priority_key)
            self.running.remove(victim)
            return victim
        return self.running.pop()

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.metrics.num_preemptions += 1
        self._num_preemptions += 1
        self.waiting.insert(0, request)
        if self.config.policy == "priority":
            self.waiting.sort(key=_priority_key)

    def update_computed_tokens(self, output: SchedulerOutput) -> None:
        """After a step ran: the scheduled tokens now have their KV in the cache."""
        for item in output.scheduled:
            request = self._queued.get(item.request_id)
            if request is not None and request.status is RequestStatus.RUNNING:
                request.num_computed_tokens += item.num_tokens
                self.block_manager.cache_full_blocks(
                    request.request_id, request.all_token_ids, request.num_computed_tokens)

    def statistics(self) -> SchedulerStatistics:
        self._drop_finished()
        stats = self.block_manager.statistics()
        return SchedulerStatistics(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_free_blocks=stats.num_free_blocks,
            num_total_blocks=stats.num_blocks,
            num_preemptions=self._num_preemptions,
            prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits,
        )


def _priority_key(request: Request) -> tuple[int, float]:
    return (request.priority, request.metrics.arrival_time)
