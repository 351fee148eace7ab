"""The synchronous engine step: schedule, execute, process.

``EngineCore`` owns the scheduler and the requests; it does not own a thread or an
event loop. ``step()`` is the whole loop body; the async engine calls its three parts
separately so that ``execute`` can run in the model thread.

Request ids: callers name their requests, and a name may not be reused while its
request is in flight. Inside, everything is keyed by ids the engine makes,
``"<request_id>-<n>"`` with ``n`` unique to this engine: one for the request and one
for each of its ``n`` samples. So no name a client chooses can collide with another
request's samples, and an abort by engine id reaches only its own request.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from triollm.config import EngineConfig
from triollm.engine.block_manager import BlockManager
from triollm.engine.detokenizer import Tokenizer
from triollm.engine.inputs import PromptType, bad_words_token_ids, process_prompt
from triollm.engine.output_processor import OutputProcessor, ParentRequest
from triollm.engine.request import Request, RequestStatus
from triollm.engine.scheduler import Scheduler, SchedulerStatistics
from triollm.engine.stats import FinishedParentStats, FinishedRequestStats, IterationStats
from triollm.lora.request import LoRARequest
from triollm.outputs import EngineOutput, PoolingOutput, PoolingRequestOutput, RequestOutput
from triollm.pooling_params import PoolingParams
from triollm.sampling_params import RequestOutputKind, SamplingParams
from triollm.step import (
    LoRAModelRunner,
    ModelRunner,
    RunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)

__all__ = ["EngineCore", "RequestFailure"]


@dataclass(frozen=True)
class RequestFailure:
    """A request whose own part of a step failed: it has ended, without an output."""

    request_id: str
    engine_id: str
    error: str


class EngineCore:
    """Adds requests, runs steps, and turns the runner's tokens into ``RequestOutput``."""

    def __init__(self, config: EngineConfig, runner: ModelRunner, tokenizer: Tokenizer | None, *,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        #: Wall-clock seconds for request timestamps and step times (a test can pass a
        #: simulated clock).
        self.clock = clock
        self.runner = runner
        self.tokenizer = tokenizer
        self.block_manager = BlockManager(
            runner.num_kv_blocks, config.cache.block_size,
            enable_prefix_caching=config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.vocab_size = int(config.model.hf_config.vocab_size)
        self.max_model_len = config.model.max_model_len
        self.eos_token_ids = _eos_token_ids(config, tokenizer)
        self.output_processor = OutputProcessor(tokenizer, eos_token_ids=self.eos_token_ids,
                                                max_model_len=self.max_model_len)
        self.max_logprobs = (self.vocab_size if config.model.max_logprobs == -1
                             else min(config.model.max_logprobs, self.vocab_size))
        #: In-flight requests by engine id, and the engine id of each caller's id.
        self._parents: dict[str, ParentRequest] = {}
        self._engine_ids: dict[str, str] = {}
        #: Each sample by engine id, and the request it belongs to.
        self._requests: dict[str, Request] = {}
        self._parent_of: dict[str, ParentRequest] = {}
        self._sequence_numbers = itertools.count()
        self._failures: list[RequestFailure] = []
        #: Gather ``IterationStats`` for ``take_stats()`` (off unless someone takes them,
        #: so an offline run does not accumulate per-token latencies).
        self.collect_stats = False
        #: Add each step's model forward and ``execute_model`` seconds to the metrics of
        #: the requests in it (``collect_detailed_traces``: "model", "worker").
        self.collect_forward_time = "model" in config.observability.collect_detailed_traces
        self.collect_execute_time = "worker" in config.observability.collect_detailed_traces
        self._stats = IterationStats()
        self._step_started = 0.0
        #: When the previous step's tokens were taken, if work was left to run straight
        #: after it (None when the engine went idle).
        self._previous_step_end: float | None = None
        #: LoRA adapters added, by id, and the version of each one's weights (bumped by
        #: a ``load_inplace`` reload, so its old prefix-cache blocks are not reused).
        self._loras: dict[int, LoRARequest] = {}
        self._lora_versions: dict[int, int] = {}

    # -- LoRA adapters ---------------------------------------------------------------

    def lora_runner(self) -> LoRAModelRunner:
        """The runner, which serves LoRA adapters; ``ValueError`` without ``enable_lora``."""
        if self.config.lora is None or not isinstance(self.runner, LoRAModelRunner):
            raise ValueError("lora_request: LoRA is not enabled; start the engine with "
                             "enable_lora=True (--enable-lora)")
        return self.runner

    def lora_to_load(self, lora_request: LoRARequest) -> bool:
        """Check ``lora_request`` against this engine (``ValueError``); True if the
        runner must load it before ``register_lora``."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request: must be a LoRARequest, got "
                             f"{type(lora_request).__name__}")
        self.lora_runner()
        known = self._loras.get(lora_request.lora_int_id)
        if known is None or lora_request.load_inplace:
            return True
        if (known.lora_name, known.lora_path) != (lora_request.lora_name,
                                                  lora_request.lora_path):
            raise ValueError(
                f"lora_request: lora_int_id {lora_request.lora_int_id} is adapter "
                f"{known.lora_name!r} ({known.lora_path}); one id names one adapter (pass "
                f"load_inplace=True to replace it)")
        return False

    def register_lora(self, lora_request: LoRARequest) -> None:
        """Record an adapter the runner has loaded."""
        lora_id = lora_request.lora_int_id
        if lora_id in self._loras and lora_request.load_inplace:
            self._lora_versions[lora_id] += 1
        else:
            self._lora_versions.setdefault(lora_id, 0)
        self._loras[lora_id] = lora_request

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter (``ValueError`` if it does not fit the model); False if it
        was added already. In the async engine the load runs in the model thread."""
        if not self.lora_to_load(lora_request):
            return False
        self.lora_runner().add_lora(lora_request)
        self.register_lora(lora_request)
        return True

    def forget_lora(self, lora_id: int) -> bool:
        """Drop an adapter from the engine's list (the caller also tells the runner);
        requests in flight with it finish with it. False if it was not added."""
        self._lora_versions.pop(lora_id, None)
        return self._loras.pop(lora_id, None) is not None

    def remove_lora(self, lora_id: int) -> bool:
        removed = self.forget_lora(lora_id)
        if isinstance(self.runner, LoRAModelRunner):
            self.runner.remove_lora(lora_id)
        return removed

    def list_loras(self) -> set[int]:
        return set(self._loras)

    def has_lora(self, lora_request: LoRARequest) -> bool:
        """Whether a request may name this adapter without adding it first (it was
        added, under the same id, name and path)."""
        self.lora_to_load(lora_request)
        known = self._loras.get(lora_request.lora_int_id)
        return known is not None and (known.lora_name, known.lora_path) == (
            lora_request.lora_name, lora_request.lora_path)

    # -- requests ------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        is_latency_sensitive: bool = False,
        slo: float | None = None,
        ttft_slo: float | None = None,
        lora_request: LoRARequest | None = None,
        trace_headers: Mapping[str, str] | None = None,
    ) -> str:
        """Validate and queue a request; returns its engine id. Raises ``ValueError``
        (and changes nothing) for a bad prompt, bad parameters or an id in flight.

        ``slo`` is a latency target in seconds per output token and ``ttft_slo`` one for
        the first token; ``is_latency_sensitive`` requests are served first under the
        ``slo`` scheduling policy, which also sizes steps to keep to their ``slo``.
        ``PoolingParams`` make a pooling request (a pooling model only): its whole
        prompt runs in one step and its one output is the pooled result.
        ``lora_request`` runs it through a LoRA adapter, which ``add_lora`` loads first
        (the front-ends do it). ``trace_headers`` (W3C ``traceparent``/``tracestate``)
        travel with the request to its finished statistics, for its trace span."""
        if not isinstance(request_id, str):
            raise ValueError(f"request_id: must be a string, got {request_id!r}")
        if request_id in self._engine_ids:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        if lora_request is not None and not self.has_lora(lora_request):
            raise ValueError(f"lora_request: adapter {lora_request.lora_name!r} is not "
                             f"loaded; add_lora() it first")
        if isinstance(params, PoolingParams):
            self._check_scheduling(priority, slo, ttft_slo)
            return self._add_pooling_request(request_id, prompt, params, arrival_time,
                                             priority, is_latency_sensitive, trace_headers)
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling_params: must be a SamplingParams")
        pooler = self.config.model.pooler
        if pooler is not None:
            raise ValueError(f"sampling_params: {self.config.model.served_model_name!r} is "
                             f"loaded with runner='pooling' ({pooler.task}); it does not "
                             f"generate text")
        params = params.clone()  # the caller's object is theirs; the engine fills in ours
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise ValueError(f"{name}: {value} is more than this engine allows "
                                 f"(max_logprobs={self.max_logprobs})")
        self._check_scheduling(priority, slo, ttft_slo)
        params.check_token_ids(self.vocab_size)
        processed = process_prompt(prompt, self.tokenizer, max_model_len=self.max_model_len,
                                   vocab_size=self.vocab_size,
                                   truncate_to=params.truncate_prompt_tokens)
        arrival = self.clock() if arrival_time is None else arrival_time
        params.all_stop_token_ids = set(params.stop_token_ids or ())
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words: this engine has no tokenizer to encode them")
            params.bad_words_token_ids = bad_words_token_ids(params.bad_words, self.tokenizer)
        if not params.ignore_eos:
            params.all_stop_token_ids |= self.eos_token_ids
        lora = None if lora_request is None else self._loras[lora_request.lora_int_id]
        lora_version = 0 if lora is None else self._lora_versions[lora.lora_int_id]
        engine_id = self._new_engine_id(request_id)
        children = []
        for index in range(params.n):
            child_params = params if params.n == 1 else params.child(index)
            child_id = engine_id if params.n == 1 else self._new_engine_id(request_id)
            child = Request(child_id, processed.token_ids, child_params, arrival,
                            priority=priority, index=index,
                            is_latency_sensitive=is_latency_sensitive, slo=slo,
                            ttft_slo=ttft_slo, cache_salt=processed.cache_salt,
                            lora_request=lora, lora_version=lora_version)
            child.detokenizer = self.output_processor.make_detokenizer(child_params,
                                                                       processed.token_ids)
            children.append(child)
        return self._register(ParentRequest(request_id, engine_id, processed.text,
                                            processed.token_ids, params.output_kind, children,
                                            trace_headers=trace_headers))

    def _register(self, parent: ParentRequest) -> str:
        """Track a new request and queue its sequences; returns its engine id."""
        self._parents[parent.engine_id] = parent
        self._engine_ids[parent.request_id] = parent.engine_id
        for child in parent.children:
            self._requests[child.request_id] = child
            self._parent_of[child.request_id] = parent
            self.scheduler.add_request(child)
        return parent.engine_id

    def _check_scheduling(self, priority: int, slo: float | None,
                          ttft_slo: float | None) -> None:
        if priority != 0 and self.config.scheduler.policy != "priority":
            raise ValueError("priority: a non-zero priority needs scheduling_policy='priority'")
        for name, value in (("slo", slo), ("ttft_slo", ttft_slo)):
            if value is not None and not (isinstance(value, int | float) and value > 0):
                raise ValueError(f"{name}: must be a number of seconds > 0, got {value!r}")

    def _add_pooling_request(self, request_id: str, prompt: PromptType, params: PoolingParams,
                             arrival_time: float | None, priority: int,
                             is_latency_sensitive: bool,
                             trace_headers: Mapping[str, str] | None) -> str:
        model = self.config.model
        if model.pooler is None:
            raise ValueError(f"pooling_params: {model.served_model_name!r} is loaded with "
                             f"runner='generate'; load it with runner='pooling' to embed, "
                             f"classify or score")
        params = params.resolved(model.pooler, model.served_model_name)
        truncate = params.truncate_prompt_tokens
        processed = process_prompt(
            prompt, self.tokenizer, max_model_len=self.max_model_len,
            vocab_size=self.vocab_size, generating=False,
            truncate_to=self.max_model_len if truncate == -1 else truncate)
        params.token_type_ids = processed.token_type_ids
        engine_id = self._new_engine_id(request_id)
        request = Request(engine_id, processed.token_ids, None,
                          self.clock() if arrival_time is None else arrival_time,
                          pooling_params=params, priority=priority,
                          is_latency_sensitive=is_latency_sensitive)
        return self._register(ParentRequest(request_id, engine_id, processed.text,
                                            processed.token_ids, RequestOutputKind.FINAL_ONLY,
                                            [request], pooling=True,
                                            trace_headers=trace_headers))

    def _new_engine_id(self, request_id: str) -> str:
        return f"{request_id}-{next(self._sequence_numbers)}"

    def abort_requests(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """Abort requests by the callers' ids now; unknown or finished ids are ignored.
        Returns each aborted generation request's final output (finish_reason
        ``"abort"``); an aborted pooling request has none."""
        return self.abort_engine_requests(
            [self._engine_ids[i] for i in request_ids if i in self._engine_ids])

    def abort_engine_requests(self, engine_ids: Iterable[str]) -> list[RequestOutput]:
        """Abort requests by the engine ids ``add_request`` returned (so a caller's id
        reused since then is not touched); unknown or finished ids are ignored."""
        parents = {}
        for engine_id in engine_ids:
            parent = self._parents.get(engine_id)
            if parent is not None:
                parents[engine_id] = parent
        running = [child for parent in parents.values() for child in parent.children
                   if not child.is_finished]
        # One call for all of them: the scheduler's removal scans its queues once.
        self.scheduler.finish_requests([c.request_id for c in running],
                                       RequestStatus.FINISHED_ABORTED)
        now = self.clock()
        for child in running:
            self._finish(child, RequestStatus.FINISHED_ABORTED, now)
        outputs = []
        for parent in parents.values():
            output = None if parent.pooling else self.output_processor.make_output(parent, True)
            if output is not None:
                outputs.append(output)
            self._forget(parent)
        return outputs

    def abort_request(self, request_id: str | Iterable[str]) -> list[RequestOutput]:
        """vLLM's name: abort one request id or several (see ``abort_requests``)."""
        return self.abort_requests([request_id] if isinstance(request_id, str) else request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    def unfinished_request_ids(self) -> list[str]:
        """The callers' ids of the requests in flight."""
        return list(self._engine_ids)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._parents)

    # -- the step ------------------------------------------------------------------

    def step(self) -> list[EngineOutput]:
        scheduler_output = self.schedule()
        try:
            runner_output = self.runner.execute_model(scheduler_output)
        except BaseException:
            self.scheduler.discard_in_flight(scheduler_output)
            raise
        return self.process(scheduler_output, runner_output)

    def schedule(self) -> SchedulerOutput:
        self._step_started = now = self.clock()
        output = self.scheduler.schedule()
        for item in output.scheduled:
            metrics = self._requests[item.request_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
        return output

    def process(self, scheduler_output: SchedulerOutput,
                runner_output: RunnerOutput) -> list[EngineOutput]:
        """Apply a finished step: advance computed tokens, append the sampled tokens,
        detect stops, free what finished and build the outputs."""
        self.scheduler.update_computed_tokens(scheduler_output)
        now = self.clock()
        # The time a step costs its users is the time between consecutive steps' tokens:
        # the model forward and the engine's own work on both sides of it (scheduling,
        # output processing, delivery to the consumers). Only after an idle engine is
        # it measured from this step's start.
        started = self._previous_step_end
        self.scheduler.observe_step_time(
            scheduler_output, now - (self._step_started if started is None else started))
        if self.collect_stats:
            self._stats.iteration_tokens.append(scheduler_output.num_batched_tokens)
        if self.collect_forward_time or self.collect_execute_time:
            self._add_model_times(scheduler_output, runner_output)
        touched: dict[str, ParentRequest] = {}
        finished: dict[RequestStatus, list[str]] = {}
        failed: dict[str, tuple[ParentRequest, str]] = {}
        pooled: list[PoolingRequestOutput[PoolingOutput]] = []
        for item in scheduler_output.scheduled:
            request = self._requests.get(item.request_id)
            if request is None or request.is_finished:
                continue  # aborted while the step ran
            parent = self._parent_of[request.request_id]
            error = runner_output.failed.get(item.request_id)
            if error is None and parent.pooling:
                data = runner_output.pooled.get(item.request_id)
                if data is None:
                    error = "the runner returned no pooled output"
                else:
                    self._finish_pooled(request, now)
                    finished.setdefault(RequestStatus.FINISHED_STOPPED, []).append(
                        request.request_id)
                    pooled.append(PoolingRequestOutput(
                        parent.request_id, PoolingOutput(data), parent.prompt_token_ids,
                        finished=True, metrics=request.metrics))
                    self._forget(parent)
                    continue
            if error is None:
                try:
                    sampled, status = self._apply(item, request, runner_output, now)
                except Exception as exception:  # detokenizing or logprobs of this request
                    error = f"output processing: {exception!r}"
            if error is not None:
                failed.setdefault(parent.engine_id, (parent, error))
                continue
            if status is not None:
                self._finish(request, status, now)  # the scheduler frees it below
                finished.setdefault(status, []).append(request.request_id)
            if sampled:
                touched[parent.engine_id] = parent
        for status, ids in finished.items():
            self.scheduler.finish_requests(ids, status)
        for engine_id, (parent, error) in failed.items():
            touched.pop(engine_id, None)
            self._fail(parent, error, now)

        outputs: list[EngineOutput] = list(pooled)
        for parent in touched.values():
            finished_now = parent.finished
            output = self.output_processor.make_output(parent, finished_now)
            if output is not None:
                outputs.append(output)
            if finished_now:
                self._forget(parent)
        self._previous_step_end = now if self.scheduler.has_unfinished_requests() else None
        return outputs

    def _apply(self, item: ScheduledRequest, request: Request, runner_output: RunnerOutput,
               now: float) -> tuple[bool, RequestStatus | None]:
        """One request's share of the step's results: whether it got a token, and the
        status that token ends it with (if any)."""
        prompt_lps = runner_output.prompt_logprobs.get(item.request_id)
        if prompt_lps:
            self.output_processor.append_prompt_logprobs(
                request, prompt_lps, first_position=item.start_position + 1)
        token = runner_output.sampled_token_ids.get(item.request_id)
        if token is None:
            return False, None
        request.append_output_token(token)
        metrics = request.metrics
        if self.collect_stats:
            self._record_token(request, now)
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        token_lp = runner_output.logprobs.get(item.request_id)
        if token_lp is not None:
            self.output_processor.append_logprobs(request, token_lp)
        return True, self.output_processor.check_stop(request, token)

    def _finish_pooled(self, request: Request, now: float) -> None:
        request.metrics.first_token_time = request.metrics.last_token_time = now
        if self.collect_stats:
            self._stats.num_prompt_tokens += request.num_prompt_tokens
            self._stats.time_to_first_token.append(now - request.metrics.arrival_time)
        self._finish(request, RequestStatus.FINISHED_STOPPED, now)

    def _fail(self, parent: ParentRequest, error: str, now: float) -> None:
        """End a request whose own part of a step failed; its caller learns why from
        ``take_failures``. The engine and every other request carry on."""
        running = [child for child in parent.children if not child.is_finished]
        self.scheduler.finish_requests([c.request_id for c in running],
                                       RequestStatus.FINISHED_ABORTED)
        for child in running:
            self._finish(child, RequestStatus.FINISHED_ABORTED, now, failed=True)
        self._forget(parent)
        self._failures.append(RequestFailure(parent.request_id, parent.engine_id, error))

    def take_failures(self) -> list[RequestFailure]:
        """The requests that failed since the last call (and start afresh)."""
        failures, self._failures = self._failures, []
        return failures

    def _forget(self, parent: ParentRequest) -> None:
        if self.collect_stats and parent.engine_id in self._parents:
            self._stats.finished_requests.append(self._finished_parent_stats(parent))
        self._parents.pop(parent.engine_id, None)
        if self._engine_ids.get(parent.request_id) == parent.engine_id:
            del self._engine_ids[parent.request_id]
        for child in parent.children:
            self._requests.pop(child.request_id, None)
            self._parent_of.pop(child.request_id, None)

    # -- introspection -------------------------------------------------------------

    def _record_token(self, request: Request, now: float) -> None:
        stats, metrics = self._stats, request.metrics
        stats.num_generation_tokens += 1
        if metrics.first_token_time is None:
            stats.num_prompt_tokens += request.num_prompt_tokens
            stats.time_to_first_token.append(now - metrics.arrival_time)
        elif metrics.last_token_time is not None:
            stats.inter_token_latency.append(now - metrics.last_token_time)

    def _finish(self, request: Request, status: RequestStatus, now: float, *,
                failed: bool = False) -> None:
        """Mark a request finished, judge its SLO and record its statistics (those of a
        ``failed`` request under vLLM's finish reason "error")."""
        request.status = status
        metrics = request.metrics
        metrics.finished_time = now
        if request.num_output_tokens >= 2:
            assert metrics.first_token_time is not None and metrics.last_token_time is not None
            metrics.time_per_output_token = (
                (metrics.last_token_time - metrics.first_token_time)
                / (request.num_output_tokens - 1))
        if status is not RequestStatus.FINISHED_ABORTED:
            metrics.slo_attained = metrics.judge_slo()
        if self.collect_stats:
            self._stats.finished.append(_finished_request_stats(
                request, "error" if failed else status.value, now))

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
            model_name=self.config.model.served_model_name,
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

    def _add_model_times(self, scheduler_output: SchedulerOutput,
                         runner_output: RunnerOutput) -> None:
        forward = runner_output.forward_seconds if self.collect_forward_time else None
        execute = runner_output.execute_seconds if self.collect_execute_time else None
        for item in scheduler_output.scheduled:
            request = self._requests.get(item.request_id)
            if request is None:
                continue
            metrics = request.metrics
            if forward is not None:
                metrics.model_forward_time = (metrics.model_forward_time or 0.0) + forward
            if execute is not None:
                metrics.model_execute_time = (metrics.model_execute_time or 0.0) + execute

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; only while no request holds blocks (returns
        whether it did)."""
        return self.block_manager.reset_prefix_cache()

    def take_stats(self) -> IterationStats:
        """The stats gathered since the last call (and start afresh)."""
        stats, self._stats = self._stats, IterationStats()
        return stats

    def statistics(self) -> SchedulerStatistics:
        return self.scheduler.statistics()

    def shutdown(self) -> None:
        self.runner.shutdown()


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


def _eos_token_ids(config: EngineConfig, tokenizer: Tokenizer | None) -> set[int]:
    ids: set[int] = set()
    for source in (config.model.hf_config, getattr(tokenizer, "eos_token_id", None)):
        value = getattr(source, "eos_token_id", source) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    return ids
