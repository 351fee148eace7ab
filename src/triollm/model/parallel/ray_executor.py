"""The ``ray`` executor: ranks 1... as Ray actors, placed by a placement group.

Ray (``pip install 'triollm[ray]'``) places the actors: on the local machine after a
``ray.init()`` of the executor's own (none was running), or on the cluster a running
``ray.init`` or ``RAY_ADDRESS`` names. Each actor holds a ``RankWorker``
(rank_worker.py): it meets the driver on the driver's ``TCPStore`` (at the driver
node's address) and torch.distributed's groups join them as with the ``mp`` executor.
Each step's message is one actor call per rank, in order (an actor runs its calls one
at a time); the driver does not wait for them, its collectives do. ``check`` surfaces a
failed call or a dead actor as ``RankFailedError``; ``shutdown`` kills the actors,
removes the placement group, and ends the Ray instance the executor started.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

from triollm.child_env import child_environment_settings
from triollm.config import EngineConfig
from triollm.model.parallel.group import RankGroup, connect_store, join_group
from triollm.model.parallel.mp_executor import RankFailedError
from triollm.model.parallel.rank_worker import RankJob, RankWorker

__all__ = ["RAY_MISSING", "RankActor", "RayExecutor"]

logger = logging.getLogger(__name__)

RAY_MISSING = ("distributed_executor_backend 'ray' needs Ray: pip install 'triollm[ray]'")
#: Seconds the placement group may take to be placed.
_PLACEMENT_TIMEOUT_S = 120.0


class RankActor:
    """A Ray actor's body: one rank, set up by ``setup``, then stepped."""

    def __init__(self) -> None:
        self.worker: RankWorker | None = None

    def setup(self, job: RankJob) -> int:
        logging.basicConfig(level=job.log_level,
                            format=f"%(levelname)s rank {job.rank} %(name)s: %(message)s")
        self.worker = RankWorker(job)
        return os.getpid()

    def run_step(self, message: bytes) -> None:
        assert self.worker is not None
        self.worker.run_step(message)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()


class RayExecutor:
    """Starts, feeds and ends the Ray actors of ranks 1... ."""

    def __init__(self, config: EngineConfig, rank_cpus: list[tuple[int, ...] | None]) -> None:
        try:
            import ray
        except ImportError:
            raise RuntimeError(RAY_MISSING) from None
        self.ray: Any = ray
        self.config = config
        self.rank_cpus = rank_cpus
        self.actors: list[Any] = []
        self.pending: list[Any] = []
        self.placement: Any = None
        self.started_ray = False

    def start(self) -> RankGroup:
        """Place the actors and meet them: the driver's (rank 0's) group."""
        ray = self.ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            ray.init(include_dashboard=False, log_to_driver=True)  # RAY_ADDRESS, if set
            self.started_ray = True
        world_size = self.config.parallel.tensor_parallel_size
        threads = self.config.model.cpu_threads or 1
        self.placement = placement_group([{"CPU": threads}] * (world_size - 1),
                                         strategy="PACK")
        ray.get(self.placement.ready(), timeout=_PLACEMENT_TIMEOUT_S)
        host = ray.util.get_node_ip_address()
        store = connect_store(host, 0, world_size, driver=True)
        actor_class = ray.remote(RankActor)
        level = logging.getLogger("triollm").getEffectiveLevel()
        setups = []
        for rank in range(1, world_size):
            actor = actor_class.options(
                num_cpus=threads,
                runtime_env={"env_vars": child_environment_settings(os.environ)},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement, placement_group_bundle_index=rank - 1),
            ).remote()
            self.actors.append(actor)
            setups.append(actor.setup.remote(RankJob(
                self.config, rank, host, store.port, self.rank_cpus[rank], level)))
        self.pending = setups
        group = join_group(0, world_size, store, self.config.parallel.worker_timeout_s,
                           self.config.model.device)
        logger.info("tensor parallelism: %d Ray actors placed", world_size - 1)
        return group

    def check(self) -> None:
        """``RankFailedError`` for an actor call that failed (or an actor that died)."""
        done, self.pending = self.ray.wait(self.pending, num_returns=len(self.pending),
                                           timeout=0)
        for ref in done:
            try:
                self.ray.get(ref)
            except Exception as error:
                raise RankFailedError(f"a tensor-parallel Ray actor failed: {error}"
                                      ) from error

    def send(self, message: bytes) -> None:
        """One step's message to every actor."""
        self.check()
        self.pending.extend(actor.run_step.remote(message) for actor in self.actors)

    def shutdown(self) -> None:
        """Kill the actors, remove the placement group, end a Ray this executor started."""
        ray = self.ray
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor)
        self.actors.clear()
        self.pending.clear()
        if self.placement is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self.placement)
            self.placement = None
        if self.started_ray:
            ray.shutdown()
            self.started_ray = False
