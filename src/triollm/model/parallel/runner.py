"""The driver's runner under tensor parallelism: rank 0 in the engine's model thread.

``TensorParallelRunner`` is a ``ModelRunner``: it starts the other ranks through the
executor the config names (``mp``: child processes, ``ray``: Ray actors), sets up its
own ``TorchModelRunner`` over rank 0's shard in step with them, and then, each step,
sends the batch its forward is about to run (``on_batch``, one message) before running
it. Only the driver samples. A rank that dies or hangs makes the step raise
``RankFailedError`` (its collectives fail, or time out after
``worker_timeout_s``): the engine is then dead, and ``shutdown`` ends every rank.

Threads: each rank computes on its own cores. ``rank_cpus``, else
``VLLM_CPU_OMP_THREADS_BIND``'s ``|``-separated lists (as vLLM reads them), bind rank r
(the driver's model thread, a child process) to list r; otherwise each rank takes an
equal share of the usable cores as its thread count, unbound. The collectives run
eagerly: the compiled forward is off under tensor parallelism.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import weakref
from typing import Any, Protocol

from triollm.config import EngineConfig
from triollm.model.parallel.group import RankGroup
from triollm.model.parallel.messages import encode_step
from triollm.model.parallel.mp_executor import MultiprocessExecutor, RankFailedError
from triollm.model.parallel.rank_worker import place_rank
from triollm.model.runners.torch_runner import TorchModelRunner
from triollm.step import RunnerOutput, ScheduledRequest, SchedulerOutput
from triollm.vllm_env import rank_cpu_lists

__all__ = ["Executor", "RankFailedError", "TensorParallelRunner", "rank_placement"]

logger = logging.getLogger(__name__)


class Executor(Protocol):
    """Who runs ranks 1...: started once, fed each step's message, shut down once."""

    def start(self) -> RankGroup: ...

    def send(self, message: bytes) -> None: ...

    def check(self) -> None:
        """``RankFailedError`` naming a rank that is gone."""

    def shutdown(self) -> None: ...


def rank_placement(config: EngineConfig) -> tuple[EngineConfig, list[tuple[int, ...] | None]]:
    """The config with each rank's thread count, and each rank's cores (None: unbound)."""
    parallel = config.parallel
    size = parallel.tensor_parallel_size
    rank_cpus = parallel.rank_cpus or rank_cpu_lists(os.environ)
    if rank_cpus is not None and len(rank_cpus) != size:
        raise ValueError(f"VLLM_CPU_OMP_THREADS_BIND: {len(rank_cpus)} core lists for "
                         f"tensor_parallel_size={size} ranks")
    if rank_cpus is not None:
        cpus: list[tuple[int, ...] | None] = list(rank_cpus)
        threads = config.model.cpu_threads or min(len(c or ()) for c in cpus) or 1
    else:
        cpus = [None] * size
        usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
        threads = config.model.cpu_threads or max(1, usable // size)
    model = dataclasses.replace(config.model, cpu_threads=threads)
    return dataclasses.replace(config, model=model), cpus


def _executor(config: EngineConfig, cpus: list[tuple[int, ...] | None]) -> Executor:
    if config.parallel.distributed_executor_backend == "ray":
        from triollm.model.parallel.ray_executor import RayExecutor

        return RayExecutor(config, cpus)
    return MultiprocessExecutor(config, cpus)


class TensorParallelRunner:
    """Rank 0's ``TorchModelRunner`` and the executor of the other ranks."""

    def __init__(self, config: EngineConfig) -> None:
        config, cpus = rank_placement(config)
        place_rank(cpus[0])
        self.executor = _executor(config, cpus)
        try:
            self.group = self.executor.start()
            self.runner = TorchModelRunner(config, parallel=self.group)
        except BaseException:
            self.executor.shutdown()
            raise
        self.group.start_steps()
        # ``LLM`` never shuts its runner down: its ranks end when it is collected (or
        # at exit) at the latest
        weakref.finalize(self, self.executor.shutdown)
        self.block_size = config.cache.block_size
        self.runner.on_batch = self._send
        self.num_kv_blocks = self.runner.num_kv_blocks
        logger.info("tensor parallelism: %d ranks (%s executor), %d compute threads each; "
                    "the forward runs eagerly", config.parallel.tensor_parallel_size,
                    config.parallel.distributed_executor_backend, config.model.cpu_threads)

    def _send(self, items: list[ScheduledRequest]) -> None:
        self.executor.send(encode_step(items, self.block_size))

    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        try:
            return self.runner.execute_model(scheduler_output)
        except RankFailedError:
            raise
        except Exception:  # a collective failed: name the rank, if one exited
            self.executor.check()
            raise

    def shutdown(self) -> None:
        try:
            self.runner.shutdown()
        finally:
            self.executor.shutdown()

    def __getattr__(self, name: str) -> Any:
        # the rest of the runner's surface (compile state, the cache, the kernel)
        runner = self.__dict__.get("runner")
        if runner is None:
            raise AttributeError(name)
        return getattr(runner, name)
