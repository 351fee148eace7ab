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

This module holds the lifetime and the step loop; the class's other parts are its bases:
requests (``generate``, ``encode``, ``abort``) in engine/async_requests.py, and health,
statistics, vLLM's getters and LoRA adapters in engine/async_api.py. The parts it runs
are put together by engine/assembly.py, as ``LLM``'s are.
"""

from __future__ import annotations

import gc
import logging
import sys
from collections import deque
from collections.abc import Callable
from contextlib import suppress
from functools import partial
from types import TracebackType
from typing import TYPE_CHECKING, NoReturn

import anyio
import anyio.abc

from triollm.engine.assembly import assemble_core, create_model_runner, load_engine_tokenizer
from triollm.engine.async_requests import AsyncEngineRequests
from triollm.engine.channel import RequestChannels, wakeup_factory
from triollm.engine.core import EngineCore
from triollm.engine.stats import LoggingStatLogger, StatLogger, StatLoggers, stat_logger_list
from triollm.engine.tracing import RequestTracer
from triollm.engine.worker import ModelJob, ModelWorker, open_model_worker
from triollm.errors import EngineClosedError, EngineDeadError, RequestFailedError
from triollm.log_text import MAX_LOGGED_ERROR_CHARS, clipped
from triollm.outputs import EngineOutput, RequestOutput
from triollm.step import RunnerOutput, SchedulerOutput, fill_pending_tokens

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from triollm.config import EngineConfig
    from triollm.engine.args import AsyncEngineArgs
    from triollm.step import ModelRunner

__all__ = ["AsyncLLMEngine"]

logger = logging.getLogger(__name__)

RunnerFactory = Callable[[], "ModelRunner"]
_DEFAULT_STREAM_BUFFER = 1
#: While idle with a background compile pending, how often the engine lets the runner
#: switch to the compiled forward (which it otherwise does at the next step).
_COMPILE_POLL_SECONDS = 0.5


def _raise_unwrapped(group: BaseExceptionGroup[BaseException]) -> NoReturn:
    """Re-raise the one exception inside nested single-exception groups (task groups
    wrap), as itself; a group of several is raised as it is."""
    error: BaseException = group
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    if error is group:
        raise group
    raise error from error.__cause__


class AsyncLLMEngine(AsyncEngineRequests):
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
        self._compile_threads = None
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
        if getattr(engine_args, "data_parallel_size", 1) != 1:
            raise ValueError("data_parallel_size: AsyncLLMEngine runs one engine in this "
                             "process; EngineClient.from_engine_args (triollm.engine."
                             "process.client) runs each replica in its own")
        config = engine_args.create_engine_config()
        return cls(config, load_engine_tokenizer(config),
                   runner_factory or partial(create_model_runner, config),
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
                parts = assemble_core(self.config, runner, self.tokenizer,
                                      collect_stats=bool(self._stat_loggers))
                self._core, self._tracer = parts.core, parts.tracer
                if self._tracer is not None:
                    self._stat_loggers.append(self._tracer)
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
                    await self._wait_for_work(core, runner, worker)
                    continue
                scheduler_output, job = in_flight.popleft()
                runner_output = await job.wait()
                self._num_steps += 1
                for output in core.process(scheduler_output, runner_output):
                    self._deliver(output)
                for failure in core.take_failures():
                    logger.error("request %s failed: %s", clipped(failure.request_id),
                                 clipped(failure.error, MAX_LOGGED_ERROR_CHARS))
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

    async def _wait_for_work(self, core: EngineCore, runner: ModelRunner,
                             worker: ModelWorker) -> None:
        while not core.has_unfinished_requests():
            self._work_available = anyio.Event()
            if not getattr(runner, "switch_pending", False):
                await self._work_available.wait()
                continue
            with anyio.move_on_after(_COMPILE_POLL_SECONDS):
                await self._work_available.wait()
            switch = getattr(runner, "switch_when_compiled", None)
            if switch is not None and not getattr(runner, "compiling", True):
                await worker.run_sync(switch)

    def _deliver(self, output: EngineOutput) -> None:
        if self._channels.deliver(output) and self.log_requests:
            reasons = ([c.finish_reason for c in output.outputs]
                       if isinstance(output, RequestOutput) else ["pooled"])
            logger.info("Finished request %s (%s).", clipped(output.request_id),
                        clipped(reasons))

    def __repr__(self) -> str:
        state = "dead" if self.errored else "running" if self._running else "stopped"
        return f"<AsyncLLMEngine {self.config.model.model!r} {state}>"

