"""``EngineClient``: the async engine's surface in the server's process, over engine
processes (vLLM's ``AsyncLLM`` with its ``EngineCoreClient``).

Each engine runs in a process of its own (engine/process/child.py), so the server's
event loop, its HTTP handling and its interpreter lock are apart from the engine's
scheduling, output processing and model thread. ``data_parallel_size`` engines
(replicas) run side by side, each on its own share of the cores; a request goes to the
one with the fewest requests in flight (engine/process/balance.py). Outputs come back
one message per engine step and are handed to the same ``RequestChannel`` as the
in-process engine uses (engine/channel.py), under the contract of docs/concurrency.md:
a replica that dies or hangs fails every open stream with ``EngineDeadError`` and
``run`` raises it; leaving ``run`` (cancelled) ends every stream with
``EngineClosedError`` and stops and reaps every process.

Health, statistics, LoRA adapters and the getters are in engine/process/client_api.py.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
from collections.abc import AsyncGenerator, Callable, Iterable, Mapping, Sequence
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc

from triollm.engine.assembly import load_engine_tokenizer
from triollm.engine.channel import RequestChannel, Wakeup, wakeup_factory
from triollm.engine.process.balance import choose_replica
from triollm.engine.process.client_api import EngineClientAPI
from triollm.engine.process.launch import PrestartedEngines
from triollm.engine.process.protocol import Abort, AddRequest, EngineSetup, StepOutputs
from triollm.engine.process.replica import DEFAULT_HEARTBEAT_TIMEOUT, EngineReplica
from triollm.engine.stats import LoggingStatLogger, StatLoggers, stat_logger_list
from triollm.errors import EngineClosedError, EngineDeadError, RequestFailedError
from triollm.outputs import EngineOutput, PoolingOutput, PoolingRequestOutput, RequestOutput
from triollm.pooling_params import PoolingParams
from triollm.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from triollm.engine.args import AsyncEngineArgs
    from triollm.engine.inputs import PromptType
    from triollm.lora.request import LoRARequest

__all__ = ["EngineClient", "replica_cores"]

logger = logging.getLogger(__name__)


def replica_cores(count: int, cores: Iterable[int] | None = None
                  ) -> list[frozenset[int] | None]:
    """Each replica's cores: the usable ones split into ``count`` contiguous shares
    (as vLLM binds each data-parallel rank's threads); one replica keeps the process's
    own. With fewer cores than replicas, replicas share them in turn."""
    if count == 1:
        return [None]
    usable = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if len(usable) < count:
        return [frozenset({usable[i % len(usable)]}) for i in range(count)]
    share, extra = divmod(len(usable), count)
    shares: list[frozenset[int] | None] = []
    start = 0
    for index in range(count):
        end = start + share + (index < extra)
        shares.append(frozenset(usable[start:end]))
        start = end
    return shares


class _Request:
    __slots__ = ("channel", "replica")

    def __init__(self, channel: RequestChannel, replica: int) -> None:
        self.channel = channel
        self.replica = replica


class EngineClient(EngineClientAPI):
    """vLLM's ``AsyncLLMEngine`` API, its engines in processes of their own.

    ::

        async with EngineClient.from_engine_args(AsyncEngineArgs(model=...,
                                                 data_parallel_size=2)) as engine:
            async for output in engine.generate("Hello", SamplingParams(), "req-1"):
                print(output.outputs[0].text)
    """

    def __init__(self, args: AsyncEngineArgs, *, stream_buffer_size: int = 1,
                 stat_loggers: StatLoggers | None = None,
                 heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
                 prestarted: PrestartedEngines | None = None,
                 log_config: Mapping[str, Any] | None = None) -> None:
        """``prestarted``: engine processes started ahead of this client (``triollm
        serve``'s), taken instead of starting new ones. ``log_config``: a
        ``logging.config.dictConfig`` the engine processes apply (as the server applied
        ``VLLM_LOGGING_CONFIG_PATH``'s) instead of the server's log format."""
        self._prestarted = prestarted
        self._log_config = log_config
        self.config = args.create_engine_config()
        self.tokenizer = load_engine_tokenizer(self.config)
        self.log_stats = not args.disable_log_stats
        self.data_parallel_size = args.data_parallel_size
        self._stat_loggers = stat_logger_list(stat_loggers, self.config)
        self._stats_line: LoggingStatLogger | None = None
        if self.log_stats:
            device = self.config.model.device.type
            self._stats_line = LoggingStatLogger("GPU" if device == "cuda" else device.upper())
            self._stat_loggers.append(self._stats_line)
        if stream_buffer_size < 1:
            raise ValueError("stream_buffer_size: must be >= 1")
        self._buffer_size = stream_buffer_size
        self._args = args
        self._heartbeat_timeout = heartbeat_timeout
        self._replicas: list[EngineReplica] = []
        self._requests: dict[int, _Request] = {}
        self._by_id: dict[str, int] = {}
        self._loads = [0] * self.data_parallel_size
        self._last_choice = -1
        self._seqs = itertools.count()
        self._make_wakeup: Callable[[], Wakeup] = anyio.Event
        self._started = False
        self._running = False
        self._dead_error: EngineDeadError | None = None

    @classmethod
    def from_engine_args(cls, engine_args: AsyncEngineArgs, **options: Any) -> EngineClient:
        """Validate the arguments and load the tokenizer; the engines start in ``run``."""
        return cls(engine_args, **options)

    def add_stat_logger(self, stat_logger: Any) -> None:
        """Have ``stat_logger.record`` called with each step's stats (before ``run``);
        with several replicas as ``record(stats, engine_idx=i)``, as vLLM's loggers."""
        if self._started:
            raise RuntimeError("add stat loggers before the engine starts")
        self._stat_loggers.extend(stat_logger_list([stat_logger], self.config))

    # -- lifetime ------------------------------------------------------------------

    async def __aenter__(self) -> EngineClient:
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        try:
            await self._task_group.start(self.run)
        except BaseException as error:
            await self._task_group.__aexit__(type(error), error, error.__traceback__)
            raise
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        self._task_group.cancel_scope.cancel()
        try:
            return await self._task_group.__aexit__(*exc_info)
        except BaseExceptionGroup as group:
            # an engine's death is the one exception worth surfacing as itself
            dead = _engine_dead_in(group)
            if dead is not None:
                raise dead from None
            raise

    def _setups(self) -> list[EngineSetup]:
        root = logging.getLogger()
        formats = [h.formatter._fmt for h in root.handlers if h.formatter is not None]
        args = dataclasses.replace(self._args, data_parallel_size=1)
        setups = []
        for index, cores in enumerate(replica_cores(self.data_parallel_size)):
            threads = args.cpu_threads
            if cores is not None and threads is not None:
                threads = min(threads, len(cores))
            setups.append(EngineSetup(
                args=dataclasses.replace(args, cpu_threads=threads), index=index,
                cores=cores, log_level=root.getEffectiveLevel(),
                log_format=formats[0] if formats else None, log_config=self._log_config,
                log_stats=bool(self._stat_loggers), stream_buffer_size=self._buffer_size))
        return setups

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                  ) -> None:
        """Start every engine process, report started once all have loaded their
        model, then serve until cancelled (or until one dies: ``EngineDeadError``)."""
        if self._started:
            raise RuntimeError("this engine has already been started; make a new one")
        self._started = True
        self._make_wakeup = wakeup_factory()
        prestarted = self._prestarted
        self._prestarted = None
        self._replicas = [EngineReplica(setup, self, self._heartbeat_timeout,
                                        prestarted.take(setup.index) if prestarted else None)
                          for setup in self._setups()]
        try:
            async with anyio.create_task_group() as task_group:
                loading = len(self._replicas)
                loaded = anyio.Event()

                async def start(replica: EngineReplica) -> None:
                    nonlocal loading
                    await task_group.start(replica.run)
                    loading -= 1
                    if not loading:
                        loaded.set()

                for replica in self._replicas:  # they load their models side by side
                    task_group.start_soon(start, replica)
                await loaded.wait()
                self._running = True
                task_status.started()
                try:
                    await anyio.sleep_forever()
                finally:
                    # Cancelled: every stream ends now, before the processes stop
                    # (which may take their step and a shutdown).
                    self._running = False
                    if self._dead_error is None:
                        self._fail_all(EngineClosedError("the engine shut down before "
                                                         "this request finished"))
        except BaseException as error:
            if self._dead_error is None:
                self._fail_all(EngineClosedError("the engine shut down before this "
                                                 "request finished"))
            dead = _engine_dead_in(error)
            if dead is not None:
                raise dead from None
            raise
        finally:
            self._running = False

    # -- what the replicas hand over (ReplicaSink) ------------------------------------

    def step(self, index: int, outputs: StepOutputs) -> None:
        requests = self._requests
        for seq, output in outputs.outputs:
            request = requests.get(seq)
            if request is not None:
                request.channel.put(output)
                if output.finished:
                    self._forget(seq)
        for seq, message in outputs.failures:
            request = self._forget(seq)
            if request is not None:
                request.channel.fail(RequestFailedError(
                    f"request {request.channel.request_id!r} failed: {message}"))
        for stats in outputs.stats:
            self._record(index, stats)

    def add_failed(self, seq: int, error: BaseException) -> None:
        request = self._forget(seq)
        if request is not None:
            request.channel.fail(error)

    def replica_died(self, index: int, error: EngineDeadError) -> None:
        logger.error("%s; failing every request", error)
        if self._dead_error is None:
            self._dead_error = error
        self._fail_all(error)

    def _fail_all(self, error: BaseException) -> None:
        requests, self._requests = self._requests, {}
        self._by_id.clear()
        self._loads = [0] * self.data_parallel_size
        for request in requests.values():
            request.channel.fail(error)

    def _forget(self, seq: int) -> _Request | None:
        request = self._requests.pop(seq, None)
        if request is not None:
            self._loads[request.replica] -= 1
            if self._by_id.get(request.channel.request_id) == seq:
                del self._by_id[request.channel.request_id]
        return request

    # -- requests ------------------------------------------------------------------

    async def generate(
        self, prompt: PromptType, sampling_params: SamplingParams | None, request_id: str,
        *, priority: int = 0, lora_request: LoRARequest | None = None,
        trace_headers: Mapping[str, str] | None = None, is_latency_sensitive: bool = False,
        slo: float | None = None, ttft_slo: float | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """``AsyncLLMEngine.generate``: stream one request's outputs."""
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        seq, channel = self._add(
            request_id, sampling_params.output_kind, prompt=prompt, params=sampling_params,
            priority=priority, lora_request=lora_request, trace_headers=trace_headers,
            is_latency_sensitive=is_latency_sensitive, slo=slo, ttft_slo=ttft_slo)
        async with aclosing(self._stream(seq, channel)) as stream:
            async for output in stream:
                assert isinstance(output, RequestOutput)
                yield output

    async def encode(
        self, prompt: PromptType, pooling_params: PoolingParams | None, request_id: str,
        lora_request: LoRARequest | None = None,
        trace_headers: Mapping[str, str] | None = None, priority: int = 0, *,
        is_latency_sensitive: bool = False,
    ) -> AsyncGenerator[PoolingRequestOutput[PoolingOutput], None]:
        """``AsyncLLMEngine.encode``: one pooling request's output."""
        params = pooling_params or PoolingParams()
        seq, channel = self._add(
            request_id, params.output_kind, prompt=prompt, params=params, priority=priority,
            lora_request=lora_request, trace_headers=trace_headers,
            is_latency_sensitive=is_latency_sensitive)
        async with aclosing(self._stream(seq, channel)) as stream:
            async for output in stream:
                assert isinstance(output, PoolingRequestOutput)
                yield output

    def _add(self, request_id: str, output_kind: RequestOutputKind, **fields: Any
             ) -> tuple[int, RequestChannel]:
        self._raise_if_dead()
        if not self._running:
            raise EngineClosedError("the engine is not running: use `async with engine` or "
                                    "`await task_group.start(engine.run)`")
        if request_id in self._by_id:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        if not isinstance(request_id, str):
            raise ValueError(f"request_id: must be a string, got {request_id!r}")
        replica = self._last_choice = choose_replica(self._loads, self._last_choice)
        seq = next(self._seqs)
        channel = RequestChannel(request_id, output_kind, self._buffer_size,
                                 self._make_wakeup, str(seq))
        self._requests[seq] = _Request(channel, replica)
        self._by_id[request_id] = seq
        self._loads[replica] += 1
        self._replicas[replica].send(AddRequest(seq=seq, request_id=request_id, **fields))
        return seq, channel

    def _stream(self, seq: int, channel: RequestChannel
                ) -> AsyncGenerator[EngineOutput, None]:
        return channel.outputs(lambda: self._abort_seq(seq))

    def _abort_seq(self, seq: int) -> None:
        request = self._forget(seq)
        if request is not None:
            self._replicas[request.replica].send(Abort(seq))
            request.channel.close()

    async def abort(self, request_id: str | Sequence[str]) -> None:
        """Abort one request or several: each stream ends with a final output whose
        finish_reason is ``"abort"`` (sent by its engine). Unknown ids are ignored."""
        self._raise_if_dead()
        for one_id in [request_id] if isinstance(request_id, str) else request_id:
            seq = self._by_id.get(one_id)
            if seq is not None:
                self._replicas[self._requests[seq].replica].send(Abort(seq))
        await anyio.lowlevel.checkpoint()

    def __repr__(self) -> str:
        state = "dead" if self.errored else "running" if self._running else "stopped"
        return (f"<EngineClient {self.config.model.model!r} "
                f"x{self.data_parallel_size} {state}>")


def _engine_dead_in(error: BaseException) -> EngineDeadError | None:
    """The ``EngineDeadError`` inside (nested) exception groups, if any."""
    if isinstance(error, EngineDeadError):
        return error
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            if (found := _engine_dead_in(inner)) is not None:
                return found
    return None
