"""The async engine's state, and vLLM's ``AsyncLLMEngine`` surface around requests:
health, statistics, the getters, LoRA adapters, and the stat loggers.

``AsyncEngineAPI`` is a base of ``AsyncLLMEngine`` (engine/async_engine.py), which sets
the state declared here and runs the lifetime and the step loop; requests are added,
streamed and aborted in engine/async_requests.py.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import anyio

from triollm.config import DecodingConfig, ParallelConfig
from triollm.errors import EngineClosedError, EngineDeadError
from triollm.lora.request import LoRARequest
from triollm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from triollm.config import EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig
    from triollm.engine.channel import RequestChannels
    from triollm.engine.core import EngineCore
    from triollm.engine.stats import EngineStatistics, LoggingStatLogger, StatLogger
    from triollm.engine.worker import ModelWorker

__all__ = ["AsyncEngineAPI", "EngineFrontAPI"]

logger = logging.getLogger(__name__)


class EngineFrontAPI:
    """What the in-process engine and ``EngineClient`` answer alike: health from
    ``_running``/``_dead_error``, and vLLM's getters from ``config`` and ``tokenizer``."""

    config: EngineConfig
    tokenizer: PreTrainedTokenizerBase
    _running: bool
    _dead_error: EngineDeadError | None

    # -- health --------------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self._running

    @property
    def errored(self) -> bool:
        return self._dead_error is not None

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead_error

    # -- vLLM's getters --------------------------------------------------------------

    async def get_model_config(self) -> ModelConfig:
        return self.config.model

    async def get_scheduler_config(self) -> SchedulerConfig:
        return self.config.scheduler

    async def get_tokenizer(self, lora_request: object = None) -> PreTrainedTokenizerBase:
        return self.tokenizer

    async def get_decoding_config(self) -> DecodingConfig:
        """vLLM's structured-output settings (``structured_outputs_config``)."""
        return self.config.structured_outputs

    async def get_parallel_config(self) -> ParallelConfig:
        """The tensor-parallel ranks and their executor (``tensor_parallel_size``)."""
        return self.config.parallel

    async def get_lora_config(self) -> LoRAConfig | None:
        """The LoRA settings; None without ``enable_lora``, as vLLM answers."""
        return self.config.lora

    async def is_tracing_enabled(self) -> bool:
        """Whether finished requests' spans are exported (``otlp_traces_endpoint``)."""
        await anyio.lowlevel.checkpoint()
        return self.config.observability.otlp_traces_endpoint is not None

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's sampling defaults with the model's generation config on top (what the
        server applies to fields a request leaves out)."""
        return SamplingParams(**self.config.model.generation_defaults)


class AsyncEngineAPI(EngineFrontAPI):
    """Health, statistics, getters and LoRA adapters of a running engine."""

    #: One engine, in this process (``EngineClient`` runs several in their own).
    data_parallel_size = 1

    config: EngineConfig
    tokenizer: PreTrainedTokenizerBase
    log_stats: bool
    _core: EngineCore | None
    _worker: ModelWorker | None
    _channels: RequestChannels
    _running: bool
    _dead_error: EngineDeadError | None
    _num_steps: int
    _stat_loggers: list[StatLogger]
    _stats_line: LoggingStatLogger | None

    # -- health --------------------------------------------------------------------

    def _raise_if_dead(self) -> None:
        if self._dead_error is not None:
            raise EngineDeadError(str(self._dead_error)) from self._dead_error.__cause__

    def _running_core(self) -> tuple[EngineCore, ModelWorker]:
        self._raise_if_dead()
        core, worker = self._core, self._worker
        if not self._running or core is None or worker is None:
            raise EngineClosedError("the engine is not running")
        return core, worker

    async def check_health(self) -> None:
        """Raise ``EngineDeadError`` if a step failed, ``EngineClosedError`` if the
        engine is not running."""
        self._raise_if_dead()
        if not self._running:
            raise EngineClosedError("the engine is not running")
        await anyio.lowlevel.checkpoint()

    # -- statistics ----------------------------------------------------------------

    def statistics(self) -> EngineStatistics:
        from triollm.engine.stats import EngineStatistics

        core = self._core
        if core is None:
            return EngineStatistics(0, 0, 0, 0, len(self._channels), 0, self._num_steps)
        stats = core.statistics()
        grammars = core.grammar_cache_statistics()
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
            grammar_cache_hits=grammars.hits,
            grammar_cache_misses=grammars.misses,
            compiled_forward=bool(getattr(core.runner, "compiled", False)),
            compiling=bool(getattr(core.runner, "compiling", False)),
            spec_decoding=stats.spec_decoding,
        )

    def statistics_by_engine(self) -> list[EngineStatistics]:
        """``[statistics()]``: one engine (the ``engine`` label "0")."""
        return [self.statistics()]

    def _record_stats(self) -> None:
        """Hand the stats gathered since the last call to every stat logger."""
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

    async def do_log_stats(self, *args: object, **kwargs: object) -> None:
        """Log vLLM's statistics line (throughput since the last line, requests running
        and waiting, KV-cache usage); nothing unless the engine logs stats
        (``disable_log_stats`` not set)."""
        if self._stats_line is not None:
            self._stats_line.log(self.statistics())
        await anyio.lowlevel.checkpoint()

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (only while no request holds KV blocks; returns
        whether it did)."""
        await anyio.lowlevel.checkpoint()
        return self._core.reset_prefix_cache() if self._core is not None else False

    @property
    def worker_thread_id(self) -> int | None:
        return self._worker.thread_id if self._worker is not None else None

    # -- LoRA adapters: each change is one call into the core, in the model thread ----

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter now, in the model thread. Raises ``ValueError`` naming what
        does not fit (LoRA not enabled, a rank above ``max_lora_rank``, modules the
        model lacks, an id already used by another adapter). False if it was added
        already (``load_inplace=True`` reads it again)."""
        core, worker = self._running_core()
        return await worker.run_sync(core.add_lora, lora_request)

    async def remove_lora(self, lora_id: int) -> bool:
        """Forget an adapter; requests already running with it finish with it. False if
        it was not added."""
        core, worker = self._running_core()
        core.loras.runner()  # ValueError without enable_lora
        removed = core.loras.forget(lora_id)
        await worker.run_sync(core.loras.unload, lora_id)
        return removed

    async def list_loras(self) -> set[int]:
        """The ids of the adapters added (and not removed)."""
        core, _ = self._running_core()
        core.loras.runner()
        await anyio.lowlevel.checkpoint()
        return core.list_loras()

    async def _ensure_lora(self, lora_request: LoRARequest) -> None:
        core, _ = self._running_core()
        if not core.has_lora(lora_request):
            await self.add_lora(lora_request)
