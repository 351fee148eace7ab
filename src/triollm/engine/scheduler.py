"""Which requests run in the next step, and how many tokens each computes.

vLLM V1's rule: there are no prefill and decode phases. Each running request's
computed tokens catch up with its total tokens under a per-step token budget, so
prefill chunks and decodes share a step. When KV blocks run short, the last running
request in policy order is preempted: its blocks are freed and it recomputes later
from its prompt and the tokens it already has.

Policies (docs/scheduling.md):

- ``fcfs``: arrival order; a preempted request goes back to the head of the queue.
- ``priority``: lower ``priority`` first, arrival time breaks ties. A waiting request
  that outranks a running one preempts it when batch slots or blocks are short.
- ``slo``: latency-sensitive requests first, then the rest in arrival order, with
  ``priority``'s preemption. While latency-sensitive requests with an SLO run, each
  step is sized so that its predicted time (``StepTimeModel``, fitted online from
  the measured steps) stays under the tightest of their SLOs; other requests fill
  what is left. Without latency-sensitive requests it schedules as ``fcfs``.

Asynchronous scheduling (vLLM's ``async_scheduling``): the engine may schedule the next
step while the previous one still computes. The scheduler counts the tokens of steps
scheduled but not yet applied (``update_computed_tokens``) as computed, and a token such
a step samples as already there (``PENDING_TOKEN`` in the new step, filled in before it
runs). A request whose pending token reaches its length limit is not scheduled again;
one that a stop token or string ends wastes that one token's work, which is discarded.
Preemption only happens with nothing in flight: where it would be needed, the scheduler
schedules nothing more until the steps in flight are applied, then preempts as usual.

Speculative decoding (``speculator``): a decode may carry draft tokens (looked up, or
proposed by a draft model after the request's previous step), budgeted and
given KV slots like any token. Once verified, only its accepted drafts count as
computed: the rejected positions' blocks are freed, and never hashed.

No torch, no event loop.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from triollm.engine.block_manager import BlockManager
from triollm.engine.request import Request, RequestStatus
from triollm.engine.speculative.speculator import SpecDecodingStatistics, Speculator
from triollm.engine.step_budget import SLO_HEADROOM, StepBudget
from triollm.engine.step_time import StepShape, StepTimeModel, attention_pairs
from triollm.step import PENDING_TOKEN, RunnerOutput, ScheduledRequest, SchedulerOutput

if TYPE_CHECKING:
    from triollm.config import SchedulerConfig

__all__ = ["Scheduler", "SchedulerStatistics"]


@dataclass(frozen=True)
class SchedulerStatistics:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    #: Speculative decoding's counters (None: it is off).
    spec_decoding: SpecDecodingStatistics | None = None


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 speculator: Speculator | None = None) -> None:
        self.config = config
        self.block_manager = block_manager
        self.speculator = speculator
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._finished_since_last_step: list[str] = []
        self._num_preemptions = 0
        #: Every request in ``running`` or ``waiting``, by id.
        self._queued: dict[str, Request] = {}
        #: Finished requests still in ``running`` / ``waiting`` (dropped lazily).
        self._num_stale = 0
        #: Under ``priority`` and ``slo`` both queues are kept sorted by ``_rank``.
        self._ranked = config.policy != "fcfs"
        self.step_time_model: StepTimeModel | None = (
            StepTimeModel() if config.policy == "slo" else None)
        #: Per request, the tokens of steps scheduled but not yet applied, and how many
        #: of those steps sample a token for it (0 or 1 when one step is scheduled ahead).
        self._in_flight: dict[str, list[int]] = {}
        #: Set when a step scheduled ahead found it would have to preempt: nothing more
        #: is scheduled until the steps in flight are applied.
        self._must_drain = False

    def _rank(self, request: Request) -> tuple[int, int, float]:
        sensitive = self.config.policy == "slo" and request.is_latency_sensitive
        return (0 if sensitive else 1, request.priority, request.metrics.arrival_time)

    # -- requests in and out -------------------------------------------------------

    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self._queued[request.request_id] = request
        if self._ranked:
            bisect.insort_right(self.waiting, request, key=self._rank)
        else:
            self.waiting.append(request)

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
            if self.speculator is not None:
                self.speculator.forget(request_id)
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

    def has_steps_in_flight(self) -> bool:
        """Whether a scheduled step's results have not been applied yet."""
        return bool(self._in_flight)

    # -- the step ------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """The next step. While earlier steps are in flight (asynchronous scheduling) it
        starts where they end, and may be empty where the engine must first apply
        them."""
        self._drop_finished()
        ahead = bool(self._in_flight)
        if not ahead:
            self._must_drain = False
        elif self._must_drain or (self._ranked and self._would_displace()):
            self._must_drain = True
            # Finished ids stay for the next step that runs.
            return SchedulerOutput(scheduled=[], num_batched_tokens=0)
        max_tokens = self.config.max_num_batched_tokens
        budget = StepBudget(max_tokens, self._step_time_limit(), self.step_time_model,
                             chunked_prefill=self.config.enable_chunked_prefill)
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        displaced = self._make_room_for_waiting() if self._ranked and not ahead else []

        # Running requests, in policy order. Victims come from the end of the list, so
        # a victim has never been scheduled in this step (or is the request itself).
        index = 0
        while index < len(self.running) and budget.tokens_left > 0:
            request = self.running[index]
            start, total = request.num_computed_tokens, request.num_tokens
            flight = self._in_flight.get(request.request_id)
            if flight is not None:
                start += flight[0]
                if flight[1]:
                    if not self._continues_after(request, flight[1]):
                        index += 1
                        continue
                    total += flight[1]
            wanted = total - start
            if wanted <= 0:
                if flight is not None:  # all of it is in flight already
                    index += 1
                    continue
                # Cannot happen for a running request; guards an endless loop.
                raise RuntimeError(f"{request!r} is running with nothing to compute")
            drafts = (self.speculator.propose(request, len(self.running))
                      if self.speculator is not None and wanted == 1 and flight is None
                      else [])
            num_new = budget.grant(request, start, wanted + len(drafts))
            if num_new == 0:  # no time left for it in this step; it waits one step
                index += 1
                continue
            del drafts[max(0, num_new - wanted):]
            allocated = self.block_manager.allocate(request.request_id, start + num_new)
            if not allocated and drafts:  # drafts never cost a preemption
                num_new -= len(drafts)
                drafts.clear()
                allocated = self.block_manager.allocate(request.request_id, start + num_new)
            while not allocated and not ahead:
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
                allocated = self.block_manager.allocate(request.request_id, start + num_new)
            if not allocated:
                self._must_drain = ahead
                break
            scheduled.append(self._schedule(request, start, num_new, total, drafts))
            budget.take(request, start, num_new)
            index += 1

        # Like vLLM: admit nothing new in a step that had to preempt.
        adapters = self._running_adapters()
        max_loras = self.config.max_loras
        # Once a waiting request is held back because max_loras adapters are running,
        # no later request with an adapter passes it: the running adapters drain and
        # it gets a slot, instead of waiting for as long as theirs keep arriving.
        # Requests for the base model still go ahead.
        adapter_blocked = False
        index = 0
        while (not preempted and not self._must_drain and index < len(self.waiting)
               and budget.tokens_left > 0 and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[index]
            adapter = request.adapter_key
            if adapter is not None and max_loras is not None and (
                    adapter_blocked
                    or (adapter[0] not in adapters and len(adapters) >= max_loras)):
                adapter_blocked = True
                index += 1
                continue
            if request.num_computed_tokens == 0 and request.prompt_logprobs is None:
                # Reuse the KV of the longest cached prefix (prompt logprobs need every
                # position's logits, so those requests compute everything).
                request.num_computed_tokens = self.block_manager.attach_cached_prefix(
                    request.request_id, request.all_token_ids, salt=request.cache_salt,
                    adapter=adapter)
            wanted = request.num_tokens - request.num_computed_tokens
            num_new = budget.grant(request, request.num_computed_tokens, wanted)
            if num_new < wanted and (num_new == 0 or not self.config.enable_chunked_prefill):
                self._detach(request)
                break
            if not self.block_manager.allocate(request.request_id,
                                               request.num_computed_tokens + num_new):
                self._detach(request)
                break
            self.waiting.pop(index)
            if adapter is not None:
                adapters.add(adapter[0])
            request.status = RequestStatus.RUNNING
            if self._ranked:
                bisect.insort_right(self.running, request, key=self._rank)
            else:
                self.running.append(request)
            scheduled.append(self._schedule(request, request.num_computed_tokens, num_new,
                                            request.num_tokens))
            budget.take(request, request.num_computed_tokens, num_new)

        if ahead and not scheduled:
            return SchedulerOutput(scheduled=[], num_batched_tokens=0)
        finished, self._finished_since_last_step = self._finished_since_last_step, []
        return SchedulerOutput(
            scheduled=scheduled,
            num_batched_tokens=max_tokens - budget.tokens_left,
            finished_request_ids=finished,
            preempted_request_ids=displaced + preempted,
        )

    def _running_adapters(self) -> set[int]:
        """The LoRA adapter ids of the running requests (at most ``max_loras``)."""
        if self.config.max_loras is None:
            return set()
        return {r.adapter_key[0] for r in self.running if r.adapter_key is not None}

    def _step_time_limit(self) -> float | None:
        """Under ``slo``: the time a step may take so that the latency-sensitive requests
        (running, or waiting to be admitted first) keep to their SLO; None while none of
        them has one."""
        if self.step_time_model is None:
            return None
        tightest = None
        for queue in (self.running, self.waiting):
            for request in queue:
                if not request.is_latency_sensitive:
                    break  # both queues are in rank order: sensitive requests come first
                if request.slo is not None and (tightest is None or request.slo < tightest):
                    tightest = request.slo
        return None if tightest is None else tightest * SLO_HEADROOM

    def _continues_after(self, request: Request, num_pending: int) -> bool:
        """Whether ``request`` may still need a step once the ``num_pending`` tokens
        sampled for it in flight are appended: not where they reach its length limits
        (the checks ``OutputProcessor.check_stop`` makes), nor for a pooling request,
        which is done once its prompt is pooled."""
        params = request.sampling_params
        if params is None:
            return False
        if (params.max_tokens is not None
                and request.num_output_tokens + num_pending >= params.max_tokens):
            return False
        return request.num_tokens + num_pending < self.config.max_model_len

    def _would_displace(self) -> bool:
        """Whether the head of the waiting queue outranks the last running request while
        batch slots or blocks are too short to admit it."""
        if not self.waiting or not self.running:
            return False
        head, victim = self.waiting[0], self.running[-1]
        if not self._rank(head) < self._rank(victim):
            return False
        first_chunk = min(head.num_tokens, self.config.max_num_batched_tokens)
        return not (len(self.running) < self.config.max_num_seqs
                    and self.block_manager.can_allocate(head.request_id, first_chunk))

    def _make_room_for_waiting(self) -> list[str]:
        """A waiting request that outranks the last running one preempts it while batch
        slots or blocks are too short to admit the waiting one."""
        displaced: list[str] = []
        while self._would_displace():
            victim = self.running.pop()
            self._preempt(victim)
            displaced.append(victim.request_id)
        return displaced

    def observe_step_time(self, output: SchedulerOutput, seconds: float) -> None:
        """Feed a finished step's measured time to the step-time model (``slo`` only)."""
        if self.step_time_model is None or not output.scheduled:
            return
        attention = sum(attention_pairs(item.start_position, item.num_tokens)
                        for item in output.scheduled)
        self.step_time_model.observe(
            StepShape(output.num_batched_tokens, len(output.scheduled), attention), seconds)

    def _schedule(self, request: Request, start: int, num_new: int, total: int,
                  drafts: list[int] | None = None) -> ScheduledRequest:
        """``num_new`` tokens of ``request`` from position ``start``, of ``total`` (its
        tokens with those sampled in flight), recorded as in flight; ``drafts`` end
        them."""
        num_drafts = len(drafts) if drafts else 0
        end = start + num_new - num_drafts
        token_ids = request.all_token_ids[start:end]
        if end > request.num_tokens:  # tokens the steps in flight sample
            token_ids.extend([PENDING_TOKEN] * (end - max(start, request.num_tokens)))
        if drafts:
            token_ids.extend(drafts)
        sample = end == total
        flight = self._in_flight.get(request.request_id)
        if flight is None:
            self._in_flight[request.request_id] = [num_new, int(sample)]
        else:
            flight[0] += num_new
            flight[1] += sample
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=token_ids,
            start_position=start,
            block_table=list(self.block_manager.block_table(request.request_id)),
            sample=sample,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            pooling_params=request.pooling_params,
            lora_request=request.lora_request,
            structured_output=request.structured_output,
            num_draft_tokens=num_drafts,
            num_proposals=(self.speculator.num_proposals(request, len(self.running))
                           if self.speculator is not None and sample else 0),
        )

    def _detach(self, request: Request) -> None:
        """A waiting request that could not be admitted gives back its cached blocks."""
        if request.num_computed_tokens:
            self.block_manager.free(request.request_id)
            request.num_computed_tokens = 0

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.metrics.num_preemptions += 1
        self._num_preemptions += 1
        if self._ranked:
            bisect.insort_left(self.waiting, request, key=self._rank)
        else:
            self.waiting.insert(0, request)

    def discard_in_flight(self, output: SchedulerOutput) -> None:
        """A step that will never be applied (its runner raised): its tokens stop
        counting as in flight, and are scheduled again."""
        self._land(output)

    def _land(self, output: SchedulerOutput) -> None:
        """``output``'s tokens stop counting as in flight."""
        for item in output.scheduled:
            flight = self._in_flight.get(item.request_id)
            if flight is not None:
                flight[0] -= item.num_tokens
                flight[1] -= item.sample
                if flight[0] <= 0:
                    del self._in_flight[item.request_id]

    def update_computed_tokens(self, output: SchedulerOutput,
                               runner_output: RunnerOutput | None = None) -> None:
        """After a step ran (the oldest in flight): the scheduled tokens now have their
        KV in the cache, less the drafts ``runner_output`` rejected, whose blocks go."""
        self._land(output)
        if self.speculator is not None and runner_output is not None:
            self.speculator.receive(output, runner_output)
        for item in output.scheduled:
            request = self._queued.get(item.request_id)
            if request is not None and request.status is RequestStatus.RUNNING:
                token_ids, computed = request.all_token_ids, item.num_tokens
                if item.num_draft_tokens and self.speculator is not None:
                    accepted = self.speculator.observe(item, runner_output)
                    computed -= item.num_draft_tokens - accepted
                    # The accepted drafts are appended to the request after this.
                    token_ids = token_ids + item.token_ids[-item.num_draft_tokens:][:accepted]
                request.num_computed_tokens += computed
                if item.num_draft_tokens:
                    # Keep a slot for the token this step sampled last.
                    self.block_manager.truncate(request.request_id,
                                                request.num_computed_tokens + 1)
                self.block_manager.cache_full_blocks(
                    request.request_id, token_ids, request.num_computed_tokens,
                    salt=request.cache_salt, adapter=request.adapter_key)

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
            spec_decoding=None if self.speculator is None else self.speculator.statistics(),
        )
