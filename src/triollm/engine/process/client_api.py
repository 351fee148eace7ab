"""``EngineClient``'s health, statistics, stat loggers, LoRA adapters and vLLM's
getters: what ``AsyncEngineAPI`` (engine/async_api.py) is to ``AsyncLLMEngine``.

Statistics are each engine process's last snapshot (sent with every step and every
heartbeat), summed over the replicas; a LoRA change or a prefix-cache reset is a call
into every replica.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, cast

import anyio

from triollm.config import ParallelConfig
from triollm.engine.async_api import EngineFrontAPI
from triollm.engine.stats import EngineStatistics, IterationStats
from triollm.errors import EngineClosedError, EngineDeadError
from triollm.lora.request import LoRARequest

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from triollm.config import EngineConfig
    from triollm.engine.process.replica import EngineReplica
    from triollm.engine.stats import LoggingStatLogger

__all__ = ["EngineClientAPI"]

logger = logging.getLogger(__name__)

_SUMMED = ("num_running", "num_waiting", "num_free_blocks", "num_total_blocks",
           "num_preemptions", "num_steps", "prefix_cache_queries", "prefix_cache_hits",
           "grammar_cache_hits", "grammar_cache_misses")


class EngineClientAPI(EngineFrontAPI):
    """Health, statistics, getters and LoRA adapters over the engine processes."""

    config: EngineConfig
    tokenizer: PreTrainedTokenizerBase
    log_stats: bool
    data_parallel_size: int
    _replicas: list[EngineReplica]
    _requests: dict[int, Any]
    _running: bool
    _dead_error: EngineDeadError | None
    _stat_loggers: list[Any]
    _stats_line: LoggingStatLogger | None

    # -- health --------------------------------------------------------------------

    @property
    def engine_pids(self) -> list[int | None]:
        """Each replica's process id (None before it started)."""
        return [replica.pid for replica in self._replicas]

    def _raise_if_dead(self) -> None:
        if self._dead_error is not None:
            raise EngineDeadError(str(self._dead_error))

    async def check_health(self) -> None:
        """Raise ``EngineDeadError`` if an engine process died or hung,
        ``EngineClosedError`` if the engines are not running."""
        self._raise_if_dead()
        if not self._running:
            raise EngineClosedError("the engine is not running")
        await anyio.lowlevel.checkpoint()

    # -- statistics ----------------------------------------------------------------

    def statistics_by_engine(self) -> list[EngineStatistics]:
        """Each replica's last snapshot, in replica order (the ``engine`` label)."""
        empty = EngineStatistics(0, 0, 0, 0, 0, 0, 0)
        return [replica.statistics or empty for replica in self._replicas] or [empty]

    def statistics(self) -> EngineStatistics:
        """The replicas' snapshots summed; ``num_open_streams`` counts this process's."""
        each = self.statistics_by_engine()
        summed = {name: sum(getattr(stats, name) for stats in each) for name in _SUMMED}
        return dataclasses.replace(
            each[0], **summed, num_open_streams=len(self._requests),
            compiled_forward=all(stats.compiled_forward for stats in each),
            compiling=any(stats.compiling for stats in each),
            spec_decoding=each[0].spec_decoding if len(each) == 1 else None)

    def _record(self, index: int, stats: IterationStats) -> None:
        for stat_logger in list(self._stat_loggers):
            try:
                if self.data_parallel_size == 1 or stat_logger is self._stats_line:
                    stat_logger.record(stats)
                else:
                    stat_logger.record(stats, engine_idx=index)
            except Exception:
                logger.exception("stat logger %r failed; it gets no more stats",
                                 stat_logger)
                self._stat_loggers.remove(stat_logger)

    async def do_log_stats(self, *args: object, **kwargs: object) -> None:
        """vLLM's statistics line over every replica (with ``log_stats``)."""
        if self._stats_line is not None:
            self._stats_line.log(self.statistics())
        await anyio.lowlevel.checkpoint()

    async def _call_all(self, method: str, *args: object) -> list[object]:
        self._raise_if_dead()
        if not self._running:
            raise EngineClosedError("the engine is not running")
        results: list[object] = [None] * len(self._replicas)

        async def one(index: int) -> None:
            results[index] = await self._replicas[index].call(method, *args)

        async with anyio.create_task_group() as task_group:
            for index in range(len(self._replicas)):
                task_group.start_soon(one, index)
        return results

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix in every replica (only while no request holds KV
        blocks; returns whether every replica did)."""
        return all(await self._call_all("reset_prefix_cache"))

    # -- LoRA adapters: every replica serves every adapter ----------------------------

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """``AsyncLLMEngine.add_lora``, in every replica."""
        return bool((await self._call_all("add_lora", lora_request))[0])

    async def remove_lora(self, lora_id: int) -> bool:
        """``AsyncLLMEngine.remove_lora``, in every replica."""
        return bool((await self._call_all("remove_lora", lora_id))[0])

    async def list_loras(self) -> set[int]:
        return cast(set[int], (await self._call_all("list_loras"))[0])

    # -- vLLM's getters --------------------------------------------------------------

    async def get_parallel_config(self) -> ParallelConfig:
        """Each replica's tensor-parallel settings, with ``data_parallel_size``."""
        return dataclasses.replace(self.config.parallel,
                                   data_parallel_size=self.data_parallel_size)
