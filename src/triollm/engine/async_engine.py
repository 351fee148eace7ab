"""The async engine: structured concurrency around the synchronous ``EngineCore``.

``run`` owns the model thread (engine/worker.py) and the step loop; nothing starts
implicitly and nothing outlives it. The loop sleeps on an event while there is no
work, schedules and processes on the event loop, and runs the model step in the
model thread. With asynchronous scheduling (``async_scheduling``; on CUDA by default) it
schedules the next step and hands it to the thread before it processes the step that
just ended, so the thread goes from one step to the next without waiting for the loop.
Outputs go to one ``RequestChannel`` per request (engine/channel.py),
which never blocks the loop. Aborts take effect in the core at once; a failed step
fails every stream with ``EngineDeadError`` before ``run`` re-raises; on shutdown,
open streams get ``EngineClosedError``. The full contract is in docs/concurrency.md.
"""

from __future__ import annotations

import gc
import logging
import sys
from collections import deque
from collections.abc import AsyncGenerator, Callable, Iterable, Mapping
from contextlib import aclosing, suppress
from types import TracebackType
from typing import TYPE_CHECKING, NoReturn

import anyio
import anyio.abc

from triollm.config import DecodingConfig, ParallelConfig
from triollm.engine.channel import RequestChannel, RequestChannels, wakeup_factory
from triollm.engine.core import EngineCore
from triollm.engine.inputs import PromptType
from triollm.engine.stats import (
    EngineStatistics,
    LoggingStatLogger,
    StatLogger,
    StatLoggers,
    stat_logger_list,
)
from triollm.engine.tracing import RequestTracer
from triollm.engine.worker import ModelJob, ModelWorker, open_model_worker
from triollm.errors import EngineClosedError, EngineDeadError, RequestFailedError
from triollm.lora.request import LoRARequest
from triollm.outputs import EngineOutput, PoolingOutput, PoolingRequestOutput, RequestOutput
from triollm.pooling_params import PoolingParams
from triollm.sampling_params import SamplingParams
from triollm.step import LoRAModelRunner, RunnerOutput, SchedulerOutput, fill_pending_tokens

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from triollm.config import EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig
    from triollm.engine.args import AsyncEngineArgs
    from triollm.step import ModelRunner

__all__ = ["AsyncLLMEngine"]

logger = logging.getLogger(__name__)

RunnerFactory = Callable[[], "ModelRunner"]
_DEFAULT_STREAM_BUFFER = 1


def _raise_unwrapped(group: BaseExceptionGroup[BaseException]) -> NoReturn:
    """Re-raise the one exception inside nested single-exception groups (task groups
    wrap), as itself; a group of several is raised as it is."""
    error: BaseException = group
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    if error is group:
        raise group
    raise error from error.__cause__


def _shown_prompt(prompt: PromptType, max_log_len: int | None) -> object:
    """A prompt as request logs show it: its text and token ids cut to ``max_log_len``."""
    if max_log_len is None:
        return prompt
    if isinstance(prompt, str | list):
        return prompt[:max_log_len]
    if isinstance(prompt, Mapping):
        return {key: value[:max_log_len] if key in ("prompt", "prompt_token_ids")
                and isinstance(value, str | list) else value
                for key, value in prompt.items()}
    return prompt


class AsyncLLMEngine:
    """vLLM's ``AsyncLLMEngine`` API on anyio (trio or asyncio).

    ::

        async with AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=...)) as engine:
            async for output in engine.generate("Hello", SamplingParams(), "req-1"):
                print(output.outputs[0].text)
    """

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: PreTrainedTokenizerBase,
        runner_factory: RunnerFactory,
        *,
        log_requests: bool = False,
        max_log_len: int | None = None,
        stream_buffer_size: int = _DEFAULT_STREAM_BUFFER,
        stat_loggers: StatLoggers | None = None,
        log_stats: bool = False,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.log_requests = log_requests
        self.max_log_len = max_log_len
        self._runner_factory = runner_factory
        self._core: EngineCore | None = None
        self._worker: ModelWorker | None = None
        self._channels = RequestChannels(stream_buffer_size)
        self._work_available: anyio.Event | None = None
        self._dead_error: EngineDeadError | None = None
        self._started = False
        self._running = False
        self._num_steps = 0
        self._task_group: anyio.abc.TaskGroup | None = None
        self._stat_loggers: list[StatLogger] = stat_logger_list(stat_loggers, config)
        #: With ``log_stats``: vLLM's statistics line, written by ``do_log_stats``, and
        #: the server's Prometheus metrics.
        self.log_stats = log_stats
        self._stats_line: LoggingStatLogger | None = None
        if log_stats:
            device = config.model.device.type
            self._stats_line = LoggingStatLogger("GPU" if device == "cuda" else device.upper())
            self._stat_loggers.append(self._stats_line)
        self._warned_tracing = False
        #: Exports each finished request's span while the engine runs (None without
        #: ``otlp_traces_endpoint``); ``run`` opens and shuts it.
        self._tracer: RequestTracer | None = None

    @classmethod
    def from_engine_args(
        cls, engine_args: AsyncEngineArgs, *, runner_factory: RunnerFactory | None = None,
        stream_buffer_size: int = _DEFAULT_STREAM_BUFFER,
        stat_loggers: StatLoggers | None = None,
    ) -> AsyncLLMEngine:
        """Validate the arguments and load the tokenizer; the model loads in ``run``.
        ``stat_loggers`` takes vLLM's forms: a list of loggers or of factories called
        as ``factory(config, 0)``, or a dict of loggers by name."""
        from triollm.model.loader import load_tokenizer

        config = engine_args.create_engine_config()
        tokenizer = load_tokenizer(config.model.tokenizer,
                                   trust_remote_code=config.model.trust_remote_code,
                                   revision=config.model.tokenizer_revision,
                                   download_dir=config.model.download_dir)
        if runner_factory is None:
            def runner_factory() -> ModelRunner:
                from triollm.model.runners import create_runner

                return create_runner(config)

        return cls(config, tokenizer, runner_factory,
                   log_requests=(getattr(engine_args, "enable_log_requests", False)
                                 and not getattr(engine_args, "disable_log_requests", False)),
                   max_log_len=getattr(engine_args, "max_log_len", None),
                   stream_buffer_size=stream_buffer_size, stat_loggers=stat_loggers,
                   log_stats=not getattr(engine_args, "disable_log_stats", False))

    def add_stat_logger(self, stat_logger: StatLogger) -> None:
        """Have ``stat_logger.record`` called after every step (before ``run``)."""
        if self._started:
            raise RuntimeError("add stat loggers before the engine starts")
        self._stat_loggers.extend(stat_logger_list([stat_logger], self.config))

    # -- lifetime ------------------------------------------------------------------

    async def __aenter__(self) -> AsyncLLMEngine:
        task_group = anyio.create_task_group()
        await task_group.__aenter__()
        try:
            await task_group.start(self.run)
        except BaseException:
            await task_group.__aexit__(*sys.exc_info())
            raise
        self._task_group = task_group
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> bool | None:
        task_group, self._task_group = self._task_group, None
        if task_group is None:
            return None
        task_group.cancel_scope.cancel()
        try:
            return await task_group.__aexit__(exc_type, exc, tb)
        except BaseExceptionGroup as group:
            # The engine's own failure is the one exception worth surfacing as itself.
            _raise_unwrapped(group)

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                  ) -> None:
        """Load the model in the model thread, size the KV cache, report started, then
        run the step loop until cancelled (or until a step fails, which re-raises)."""
        if self._started:
            raise RuntimeError("this engine has already been started; make a new one")
        self._started = True
        self._channels.make_wakeup = wakeup_factory()
        try:
            await self._run(task_status)
        except BaseExceptionGroup as group:
            _raise_unwrapped(group)

    async def _run(self, task_status: anyio.abc.TaskStatus[None]) -> None:
        async with open_model_worker() as worker:
            self._worker = worker
            runner: ModelRunner | None = None
            heap_frozen = False
            try:
                runner = await worker.run_sync(self._runner_factory)
                self._core = EngineCore(self.config, runner, self.tokenizer)
                endpoint = self.config.observability.otlp_traces_endpoint
                if endpoint is not None:
                    self._tracer = RequestTracer(endpoint)
                    self._stat_loggers.append(self._tracer)
                self._core.collect_stats = bool(self._stat_loggers)
                # As vLLM does after start-up: the model, tokenizer and imports are
                # long-lived, so keep the cyclic GC from re-scanning them on every
                # oldest-generation collection (those pauses grow with the heap).
                # Undone when the engine stops, so whatever garbage is frozen with
                # them is collected then (no gc.collect() here: a full collection
                # costs 0.1-0.2 s with torch loaded).
                gc.freeze()
                heap_frozen = True
                self._running = True
                task_status.started()
                await self._step_loop(self._core, runner, worker)
            except BaseException as error:
                if isinstance(error, anyio.get_cancelled_exc_class()):
                    self._channels.fail_all(EngineClosedError("the engine shut down before this "
                                                     "request finished"))
                else:
                    dead = EngineDeadError(f"the engine's step failed: {error!r}")
                    dead.__cause__ = error
                    self._dead_error = dead
                    self._channels.fail_all(dead)
                    logger.error("engine step failed; failing every request", exc_info=error)
                raise
            finally:
                self._running = False
                if self._core is not None:
                    self._core.abort_requests(self._core.unfinished_request_ids())
                    self._record_stats()  # their spans and metrics too
                if runner is not None:
                    await worker.run_sync(runner.shutdown)
                if self._tracer is not None:
                    await self._shut_tracer(self._tracer)
                if heap_frozen:
                    gc.unfreeze()

    @staticmethod
    async def _shut_tracer(tracer: RequestTracer) -> None:
        """Send the spans still queued (for a bounded time when the collector does not
        answer), in a thread: the event loop goes on meanwhile."""
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(tracer.shutdown)

    async def _step_loop(self, core: EngineCore, runner: ModelRunner,
                         worker: ModelWorker) -> None:
        # Steps handed to the model thread and not processed yet, oldest first: one, or
        # with asynchronous scheduling two (the next is scheduled while one computes).
        depth = 2 if self.config.scheduler.async_scheduling else 1
        in_flight: deque[tuple[SchedulerOutput, ModelJob[RunnerOutput]]] = deque()
        # The tokens the last step sampled, for the next step's pending tokens. Only the
        # model thread reads and writes it, one step after the other.
        sampled: dict[str, int] = {}

        def execute(scheduler_output: SchedulerOutput) -> RunnerOutput:
            nonlocal sampled
            fill_pending_tokens(scheduler_output, sampled)
            runner_output = runner.execute_model(scheduler_output)
            sampled = runner_output.sampled_token_ids
            return runner_output

        try:
            while True:
                while len(in_flight) < depth:
                    scheduler_output = core.schedule()
                    if scheduler_output.is_empty:
                        break
                    in_flight.append(
                        (scheduler_output, worker.submit(execute, scheduler_output)))
                if not in_flight:  # nothing computes, and nothing could be scheduled
                    if core.has_unfinished_requests():
                        raise RuntimeError("the scheduler can make no progress")
                    if scheduler_output.finished_request_ids:  # the runner drops their state
                        await worker.run_sync(runner.execute_model, scheduler_output)
                    await self._wait_for_work(core)
                    continue
                scheduler_output, job = in_flight.popleft()
                runner_output = await job.wait()
                self._num_steps += 1
                for output in core.process(scheduler_output, runner_output):
                    self._deliver(output)
                for failure in core.take_failures():
                    logger.error("request %s failed: %s", failure.request_id, failure.error)
                    self._channels.fail(failure.request_id, failure.engine_id,
                                        RequestFailedError(f"request {failure.request_id!r} "
                                                           f"failed: {failure.error}"))
                self._record_stats()
                # Only a cancellation point, not a yield: the request tasks woken by this
                # step's outputs run while the next step computes, not before it starts.
                await anyio.lowlevel.checkpoint_if_cancelled()
        finally:
            # Never leave while the thread still computes a step of ours. After a failed
            # step the next one's error is the same story told twice: the first is raised.
            for _, job in in_flight:
                with suppress(Exception):
                    await job.wait()

    async def _wait_for_work(self, core: EngineCore) -> None:
        while not core.has_unfinished_requests():
            self._work_available = anyio.Event()
            await self._work_available.wait()

    def _record_stats(self) -> None:
        if self._stat_loggers and self._core is not None:
            stats = self._core.take_stats()
            for stat_logger in list(self._stat_loggers):
                try:
                    stat_logger.record(stats)
                except Exception:
                    # A broken logger costs its own metrics, never the engine.
                    logger.exception("stat logger %r failed; it gets no more stats",
                                     stat_logger)
                    self._stat_loggers.remove(stat_logger)

    def _wake(self) -> None:
        if self._work_available is not None:
            self._work_available.set()

    def _deliver(self, output: EngineOutput) -> None:
        if self._channels.deliver(output) and self.log_requests:
            reasons = ([c.finish_reason for c in output.outputs]
                       if isinstance(output, RequestOutput) else ["pooled"])
            logger.info("Finished request %s (%s).", output.request_id, reasons)

    # -- requests ------------------------------------------------------------------

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None,
        request_id: str,
        *,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        trace_headers: Mapping[str, str] | None = None,
        is_latency_sensitive: bool = False,
        slo: float | None = None,
        ttft_slo: float | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream the outputs of one request.

        The stream ends after the output with ``finished=True``. Leaving the loop early
        (break, cancellation) aborts the request; close the generator promptly with
        ``contextlib.aclosing`` when breaking out. Raises ``ValueError`` for bad input,
        ``EngineDeadError`` if the engine died and ``EngineClosedError`` if it shut down.
        ``priority`` (lower first) needs ``scheduling_policy="priority"``.
        ``is_latency_sensitive``, ``slo`` (target seconds per output token) and
        ``ttft_slo`` (target seconds to the first token) mark a request for SLO-aware
        co-serving under ``scheduling_policy="slo"``; whether it met them is in the final
        output's ``metrics.slo_attained``. ``sampling_params=None`` takes
        ``get_default_sampling_params()``. ``lora_request`` runs the request through a
        LoRA adapter (``enable_lora``), loaded on first use.
        """
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        trace_headers = self._trace_headers(trace_headers)
        if lora_request is not None:
            await self._ensure_lora(lora_request)
        channel = self._add_request(prompt, sampling_params, request_id, priority,
                                    is_latency_sensitive, slo, ttft_slo, lora_request,
                                    trace_headers)
        async with aclosing(self._stream(channel)) as stream:
            async for output in stream:
                assert isinstance(output, RequestOutput)
                yield output

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams | None,
        request_id: str,
        lora_request: LoRARequest | None = None,
        trace_headers: Mapping[str, str] | None = None,
        priority: int = 0,
        *,
        is_latency_sensitive: bool = False,
    ) -> AsyncGenerator[PoolingRequestOutput[PoolingOutput], None]:
        """Pool one prompt with a pooling model (``runner="pooling"``): yields one
        finished ``PoolingRequestOutput`` whose ``outputs.data`` is a 1-D float32
        tensor (an embedding, or a classifier's label scores). Leaving early aborts the
        request; an aborted request's stream ends without an output. Raises
        ``ValueError`` for bad input or a generation model (and for a ``lora_request``:
        LoRA adapters are served over generation models)."""
        trace_headers = self._trace_headers(trace_headers)
        channel = self._add_request(prompt, pooling_params or PoolingParams(), request_id,
                                    priority, is_latency_sensitive, lora_request=lora_request,
                                    trace_headers=trace_headers)
        async with aclosing(self._stream(channel)) as stream:
            async for output in stream:
                assert isinstance(output, PoolingRequestOutput)
                yield output

    def _trace_headers(self, trace_headers: Mapping[str, str] | None
                       ) -> Mapping[str, str] | None:
        """The headers to parent the request's span with; None without tracing."""
        if trace_headers is None:
            return None
        if not isinstance(trace_headers, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in trace_headers.items()):
            raise ValueError("trace_headers: must be a mapping of header names to strings")
        if self.config.observability.otlp_traces_endpoint is None:
            if trace_headers and not self._warned_tracing:
                # as vLLM when no OTLP endpoint is set: said once, the request goes on
                self._warned_tracing = True
                logger.warning("Received a request with trace context but tracing is "
                               "disabled (start the engine with otlp_traces_endpoint, "
                               "--otlp-traces-endpoint, to export spans)")
            return None
        return {name.lower(): value for name, value in trace_headers.items()}

    async def _stream(self, channel: RequestChannel) -> AsyncGenerator[EngineOutput, None]:
        """The outputs of one request; closing it before the end aborts the request
        (callers close it at once with ``aclosing``)."""
        finished = False
        try:
            while True:
                try:
                    output = await channel.get()
                except StopAsyncIteration:
                    finished = True
                    return
                finished = output.finished
                yield output
                if finished:
                    return
        finally:
            channel.receive.close()
            if not finished:
                self._abort_now(channel)

    def _add_request(self, prompt: PromptType, params: SamplingParams | PoolingParams,
                     request_id: str,
                     priority: int, is_latency_sensitive: bool = False,
                     slo: float | None = None,
                     ttft_slo: float | None = None,
                     lora_request: LoRARequest | None = None,
                     trace_headers: Mapping[str, str] | None = None) -> RequestChannel:
        self._raise_if_dead()
        core = self._core
        if not self._running or core is None:
            raise EngineClosedError("the engine is not running: use `async with engine` or "
                                    "`await task_group.start(engine.run)`")
        if request_id in self._channels:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        engine_id = core.add_request(request_id, prompt, params, priority=priority,
                                     is_latency_sensitive=is_latency_sensitive, slo=slo,
                                     ttft_slo=ttft_slo, lora_request=lora_request,
                                     trace_headers=trace_headers)
        channel = self._channels.open(request_id, params.output_kind, engine_id)
        if self.log_requests:
            self._log_request(request_id, prompt, params)
        self._wake()
        return channel

    def _log_request(self, request_id: str, prompt: PromptType,
                     params: SamplingParams | PoolingParams) -> None:
        logger.info("Received request %s: prompt: %r, params: %s.", request_id,
                    _shown_prompt(prompt, self.max_log_len), params)

    def _abort_now(self, channel: RequestChannel) -> None:
        """Abort the request behind ``channel`` (by its engine id: a request that reuses
        the caller's id since is not touched) and end its stream."""
        core = self._core
        outputs: list[EngineOutput] = []
        if core is not None:
            outputs.extend(core.abort_engine_requests([channel.engine_id]))
        self._channels.close(channel, outputs)
        if outputs:
            self._record_stats()
            if self.log_requests:
                logger.info("Aborted request %s.", channel.request_id)

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort one request or several: each stream ends with a final output whose
        finish_reason is ``"abort"``. Finished or unknown ids are ignored."""
        self._raise_if_dead()
        for one_id in [request_id] if isinstance(request_id, str) else request_id:
            channel = self._channels.get(one_id)
            if channel is not None:
                self._abort_now(channel)
        await anyio.lowlevel.checkpoint()

    # -- health and introspection ----------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self._running

    @property
    def errored(self) -> bool:
        return self._dead_error is not None

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead_error

    def _raise_if_dead(self) -> None:
        if self._dead_error is not None:
            raise EngineDeadError(str(self._dead_error)) from self._dead_error.__cause__

    async def check_health(self) -> None:
        """Raise ``EngineDeadError`` if a step failed, ``EngineClosedError`` if the
        engine is not running."""
        self._raise_if_dead()
        if not self._running:
            raise EngineClosedError("the engine is not running")
        await anyio.lowlevel.checkpoint()

    def statistics(self) -> EngineStatistics:
        core = self._core
        if core is None:
            return EngineStatistics(0, 0, 0, 0, len(self._channels), 0, self._num_steps)
        stats = core.statistics()
        return EngineStatistics(
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            num_free_blocks=stats.num_free_blocks,
            num_total_blocks=stats.num_total_blocks,
            num_open_streams=len(self._channels),
            num_preemptions=stats.num_preemptions,
            num_steps=self._num_steps,
            prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits,
        )

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (only while no request holds KV blocks; returns
        whether it did)."""
        await anyio.lowlevel.checkpoint()
        return self._core.reset_prefix_cache() if self._core is not None else False

    @property
    def worker_thread_id(self) -> int | None:
        return self._worker.thread_id if self._worker is not None else None

    async def get_model_config(self) -> ModelConfig:
        return self.config.model

    async def get_scheduler_config(self) -> SchedulerConfig:
        return self.config.scheduler

    async def get_tokenizer(self, lora_request: object = None) -> PreTrainedTokenizerBase:
        return self.tokenizer

    async def get_decoding_config(self) -> DecodingConfig:
        """vLLM's structured-output settings: this engine has no guided decoding."""
        return DecodingConfig()

    async def get_parallel_config(self) -> ParallelConfig:
        """One model on one device in one process."""
        return ParallelConfig()

    async def get_lora_config(self) -> LoRAConfig | None:
        """The LoRA settings; None without ``enable_lora``, as vLLM answers."""
        return self.config.lora

    # -- LoRA adapters -------------------------------------------------------------

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter now, in the model thread. Raises ``ValueError`` naming what
        does not fit (LoRA not enabled, a rank above ``max_lora_rank``, modules the
        model lacks, an id already used by another adapter). False if it was added
        already (``load_inplace=True`` reads it again)."""
        core, worker, runner = self._lora_parts()
        if not core.lora_to_load(lora_request):
            return False
        await worker.run_sync(runner.add_lora, lora_request)
        core.register_lora(lora_request)
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        """Forget an adapter; requests already running with it finish with it. False if
        it was not added."""
        core, worker, runner = self._lora_parts()
        removed = core.forget_lora(lora_id)
        await worker.run_sync(runner.remove_lora, lora_id)
        return removed

    async def list_loras(self) -> set[int]:
        """The ids of the adapters added (and not removed)."""
        core, _, _ = self._lora_parts()
        await anyio.lowlevel.checkpoint()
        return core.list_loras()

    async def _ensure_lora(self, lora_request: LoRARequest) -> None:
        core, _, _ = self._lora_parts()
        if not core.has_lora(lora_request):
            await self.add_lora(lora_request)

    def _lora_parts(self) -> tuple[EngineCore, ModelWorker, LoRAModelRunner]:
        self._raise_if_dead()
        core, worker = self._core, self._worker
        if not self._running or core is None or worker is None:
            raise EngineClosedError("the engine is not running")
        return core, worker, core.lora_runner()

    async def is_tracing_enabled(self) -> bool:
        """Whether finished requests' spans are exported (``otlp_traces_endpoint``)."""
        await anyio.lowlevel.checkpoint()
        return self.config.observability.otlp_traces_endpoint is not None

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's sampling defaults with the model's generation config on top (what the
        server applies to fields a request leaves out)."""
        return SamplingParams(**self.config.model.generation_defaults)

    async def do_log_stats(self, *args: object, **kwargs: object) -> None:
        """Log vLLM's statistics line (throughput since the last line, requests running
        and waiting, KV-cache usage); nothing unless the engine logs stats
        (``disable_log_stats`` not set)."""
        if self._stats_line is not None:
            self._stats_line.log(self.statistics())
        await anyio.lowlevel.checkpoint()

    def __repr__(self) -> str:
        state = "dead" if self.errored else "running" if self._running else "stopped"
        return f"<AsyncLLMEngine {self.config.model.model!r} {state}>"

