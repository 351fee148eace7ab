"""The synchronous engine step: schedule, execute, process.

``EngineCore`` owns the scheduler, the requests in flight (engine/request_registry.py),
the LoRA adapters (engine/lora_registry.py) and the stats it gathers
(engine/stats_collector.py); it does not own a thread or an event loop. ``step()`` is
the whole loop body; the async engine calls its three parts separately so that
``execute`` can run in the model thread.

Request ids: callers name their requests, and a name may not be reused while its
request is in flight. Inside, everything is keyed by ids the engine makes,
``"<request_id>-<n>"`` with ``n`` unique to this engine (an ``IdSequence`` of
request_ids.py): one for the request and one for each of its ``n`` samples. So no
name a client chooses can collide with another request's samples, and an abort by
engine id reaches only its own request.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from triollm.config import EngineConfig
from triollm.engine.block_manager import BlockManager
from triollm.engine.detokenizer import Tokenizer
from triollm.engine.inputs import PromptType
from triollm.engine.intake import RequestIntake
from triollm.engine.lora_registry import LoRARegistry
from triollm.engine.output_processor import OutputProcessor, ParentRequest
from triollm.engine.request import Request, RequestStatus
from triollm.engine.request_registry import RequestRegistry
from triollm.engine.scheduler import Scheduler, SchedulerStatistics
from triollm.engine.speculative.speculator import Speculator
from triollm.engine.stats import IterationStats
from triollm.engine.stats_collector import StatsCollector
from triollm.lora.request import LoRARequest
from triollm.outputs import EngineOutput, PoolingOutput, PoolingRequestOutput, RequestOutput
from triollm.pooling_params import PoolingParams
from triollm.request_ids import IdSequence
from triollm.sampling_params import SamplingParams
from triollm.step import ModelRunner, RunnerOutput, ScheduledRequest, SchedulerOutput
from triollm.structured_output.compiler import GrammarCacheStatistics
from triollm.structured_output.grammar import CompiledGrammar
from triollm.structured_output.manager import StructuredOutputManager

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
        self.scheduler = Scheduler(
            config.scheduler, self.block_manager,
            None if config.speculative is None
            else Speculator(config.speculative, config.model.max_model_len))
        self.output_processor = OutputProcessor(
            tokenizer, eos_token_ids=_eos_token_ids(config, tokenizer),
            max_model_len=config.model.max_model_len)
        self.intake = RequestIntake(config, tokenizer, self.output_processor, clock)
        self.vocab_size = self.intake.vocab_size
        self.max_model_len = self.intake.max_model_len
        self.max_logprobs = self.intake.max_logprobs
        self.eos_token_ids = self.output_processor.eos_token_ids
        runner_vocab = getattr(runner, "vocab_size", None)
        #: Structured outputs: compiles constraints (thread-safe), counts its cache.
        self.structured_outputs = StructuredOutputManager(
            config.structured_outputs, tokenizer,
            runner_vocab if isinstance(runner_vocab, int) else self.vocab_size,
            self.eos_token_ids)
        self.requests = RequestRegistry()
        self._ids = IdSequence()
        self._failures: list[RequestFailure] = []
        self.stats = StatsCollector(config.model.served_model_name,
                                    config.observability.collect_detailed_traces)
        self.loras = LoRARegistry(config.lora is not None, runner)
        self._step_started = 0.0
        #: When the previous step's tokens were taken, if work was left to run straight
        #: after it (None when the engine went idle).
        self._previous_step_end: float | None = None

    @property
    def collect_stats(self) -> bool:
        """Gather ``IterationStats`` for ``take_stats()`` (off unless someone takes them,
        so an offline run does not accumulate per-token latencies)."""
        return self.stats.enabled

    @collect_stats.setter
    def collect_stats(self, enabled: bool) -> None:
        self.stats.enabled = enabled

    # -- LoRA adapters: one registry, one call each ------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter (``ValueError`` if it does not fit the model); False if it
        was added already. In the async engine this call runs in the model thread."""
        return self.loras.add(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Forget an adapter; requests in flight with it finish with it. False if it was
        not added."""
        return self.loras.remove(lora_id)

    def list_loras(self) -> set[int]:
        return self.loras.ids()

    def has_lora(self, lora_request: LoRARequest) -> bool:
        """Whether a request may name this adapter without adding it first."""
        return self.loras.has(lora_request)

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
        grammar: CompiledGrammar | None = None,
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
        travel with the request to its finished statistics, for its trace span.
        A constraint (``structured_outputs``) is compiled here unless ``grammar`` is
        its compiled form already (``compile_structured_outputs``, which the async
        engine calls in a worker thread)."""
        if not isinstance(request_id, str):
            raise ValueError(f"request_id: must be a string, got {request_id!r}")
        if self.requests.in_flight(request_id):
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        lora = None if lora_request is None else self.loras.lookup(lora_request)
        if grammar is None and isinstance(params, SamplingParams):
            grammar = self.compile_structured_outputs(params, request_id)
        parser = None if grammar is None else self.structured_outputs.reasoning_parser()
        parent = self.intake.build(
            request_id, lambda: self._ids.next_id(request_id), prompt, params,
            arrival_time=arrival_time, priority=priority,
            is_latency_sensitive=is_latency_sensitive, slo=slo, ttft_slo=ttft_slo,
            lora=lora, trace_headers=trace_headers, grammar=grammar, reasoning_parser=parser)
        self.requests.add(parent)
        for child in parent.children:
            self.scheduler.add_request(child)
        return parent.engine_id

    def compile_structured_outputs(self, params: SamplingParams,
                                   request_id: str = "") -> CompiledGrammar | None:
        """The compiled constraint of ``params`` (None without one), from the cache or
        compiled now; ``ValueError`` naming the field if it is invalid. Thread-safe."""
        if not isinstance(params, SamplingParams):
            return None
        return self.structured_outputs.compile(params, request_id)

    def grammar_cache_statistics(self) -> GrammarCacheStatistics:
        """Compiled-grammar cache hits and misses since the engine started."""
        return self.structured_outputs.statistics()

    def abort_requests(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """Abort requests by the callers' ids now; unknown or finished ids are ignored.
        Returns each aborted generation request's final output (finish_reason
        ``"abort"``); an aborted pooling request has none."""
        return self.abort_engine_requests(self.requests.engine_ids(request_ids))

    def abort_engine_requests(self, engine_ids: Iterable[str]) -> list[RequestOutput]:
        """Abort requests by the engine ids ``add_request`` returned (so a caller's id
        reused since then is not touched); unknown or finished ids are ignored."""
        parents = self.requests.parents(engine_ids)
        running = [child for parent in parents for child in parent.children
                   if not child.is_finished]
        # One call for all of them: the scheduler's removal scans its queues once.
        self.scheduler.finish_requests([c.request_id for c in running],
                                       RequestStatus.FINISHED_ABORTED)
        now = self.clock()
        for child in running:
            self._finish(child, RequestStatus.FINISHED_ABORTED, now)
        outputs = []
        for parent in parents:
            output = None if parent.pooling else self.output_processor.make_output(parent, True)
            if output is not None:
                outputs.append(output)
            self._forget(parent)
        return outputs

    def abort_request(self, request_id: str | Iterable[str]) -> list[RequestOutput]:
        """vLLM's name: abort one request id or several (see ``abort_requests``)."""
        return self.abort_requests([request_id] if isinstance(request_id, str) else request_id)

    def has_unfinished_requests(self) -> bool:
        return len(self.requests) > 0

    def unfinished_request_ids(self) -> list[str]:
        """The callers' ids of the requests in flight."""
        return self.requests.request_ids()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

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
        sample_of = self.requests.sample
        for item in output.scheduled:
            sample = sample_of(item.request_id)
            assert sample is not None
            metrics = sample.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
        return output

    def process(self, scheduler_output: SchedulerOutput,
                runner_output: RunnerOutput) -> list[EngineOutput]:
        """Apply a finished step: advance computed tokens, append the sampled tokens,
        detect stops, free what finished and build the outputs."""
        self.scheduler.update_computed_tokens(scheduler_output, runner_output)
        now = self.clock()
        # The time a step costs its users is the time between consecutive steps' tokens:
        # the model forward and the engine's own work on both sides of it (scheduling,
        # output processing, delivery to the consumers). Only after an idle engine is
        # it measured from this step's start.
        started = self._previous_step_end
        self.scheduler.observe_step_time(
            scheduler_output, now - (self._step_started if started is None else started))
        self.stats.step(scheduler_output, runner_output, self.requests)
        touched: dict[str, ParentRequest] = {}
        finished: dict[RequestStatus, list[str]] = {}
        failed: dict[str, tuple[ParentRequest, str]] = {}
        pooled: list[PoolingRequestOutput[PoolingOutput]] = []
        sample_of, parent_of = self.requests.sample, self.requests.parent_of
        for item in scheduler_output.scheduled:
            request = sample_of(item.request_id)
            if request is None or request.is_finished:
                continue  # aborted while the step ran
            parent = parent_of(request.request_id)
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
        tokens = [token]
        token_lps = [runner_output.logprobs.get(item.request_id)]
        if item.num_draft_tokens:  # speculative: the step's further tokens
            tokens += runner_output.more_token_ids.get(item.request_id, [])
            token_lps += runner_output.more_logprobs.get(item.request_id, [])
        status = None
        count = 0
        # Each token as if it came alone: a stop ends the run there.
        for token, token_lp in zip(tokens, token_lps + [None] * len(tokens), strict=False):
            request.append_output_token(token)
            count += 1
            if token_lp is not None:
                self.output_processor.append_logprobs(request, token_lp)
            status = self.output_processor.check_stop(request, token)
            if status is not None:
                break
        metrics = request.metrics
        if self.stats.enabled:
            self.stats.token(request, now, count)
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        return True, status

    def _finish_pooled(self, request: Request, now: float) -> None:
        request.metrics.first_token_time = request.metrics.last_token_time = now
        self.stats.pooled(request, now)
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
        if self.requests.forget(parent):
            self.stats.finished_request(parent)

    # -- introspection -------------------------------------------------------------

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
        self.stats.finished_sample(request, "error" if failed else status.value, now)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; only while no request holds blocks (returns
        whether it did)."""
        return self.block_manager.reset_prefix_cache()

    def take_stats(self) -> IterationStats:
        """The stats gathered since the last call (and start afresh)."""
        return self.stats.take()

    def statistics(self) -> SchedulerStatistics:
        return self.scheduler.statistics()

    def shutdown(self) -> None:
        self.runner.shutdown()


def _eos_token_ids(config: EngineConfig, tokenizer: Tokenizer | None) -> set[int]:
    ids: set[int] = set()
    for source in (config.model.hf_config, getattr(tokenizer, "eos_token_id", None)):
        value = getattr(source, "eos_token_id", source) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    return ids
