"""A tensor-parallel rank other than the driver: its share of the model, and its loop.

``RankWorker`` sets the rank up exactly as the driver sets itself up (a
``TorchModelRunner`` over its shard: every set-up forward is a collective the ranks
run together), then runs each step's forward from the driver's message
(messages.py) and drops the logits: only the driver samples. The ``mp`` executor
runs it in a child process (``python -m triollm.model.parallel.rank_worker``, its job
pickled on stdin, then the steps framed on the same pipe); the ``ray`` executor in an
actor.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
from dataclasses import dataclass, field

import torch

from triollm.config import EngineConfig
from triollm.model.parallel.group import RankGroup, connect_store, join_group
from triollm.model.parallel.messages import decode_step, read_frame
from triollm.model.runners.batch import prepare_batch, run_forward
from triollm.model.runners.torch_runner import TorchModelRunner

__all__ = ["RankJob", "RankWorker", "main", "place_rank"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankJob:
    """What a rank needs to join its group: the engine config (its thread count is
    the rank's), its rank, the driver's store and, where bound, its cores."""

    config: EngineConfig
    rank: int
    store_host: str
    store_port: int
    cpus: tuple[int, ...] | None = None
    log_level: int = logging.INFO
    parent_pid: int = field(default_factory=os.getpid)


def place_rank(cpus: tuple[int, ...] | None) -> None:
    """Run the calling thread (and the compute threads it starts) on ``cpus``."""
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)


class RankWorker:
    """One non-driver rank, set up and ready for steps."""

    def __init__(self, job: RankJob) -> None:
        place_rank(job.cpus)
        config = job.config
        world_size = config.parallel.tensor_parallel_size
        device = config.model.device
        if device.type == "cuda":
            device = torch.device("cuda", job.rank)
        store = connect_store(job.store_host, job.store_port, world_size, driver=False)
        self.group: RankGroup = join_group(job.rank, world_size, store,
                                           config.parallel.worker_timeout_s, device)
        self.runner = TorchModelRunner(config, parallel=self.group)
        self.group.start_steps()

    @torch.inference_mode()
    def run_step(self, message: bytes) -> None:
        """The forward of the driver's step ``message``; its logits are dropped."""
        runner = self.runner
        batch = prepare_batch(decode_step(message), runner.kv_cache, runner.decode_attention,
                              runner.device)
        run_forward(runner.model, batch.input_ids, batch.positions, batch.keep,
                    batch.metadata, compiled=False, argmax_only=batch.argmax_rows)

    def shutdown(self) -> None:
        self.runner.shutdown()


def main() -> None:
    """The ``mp`` executor's child: the job on stdin, then steps until a stop or EOF."""
    from triollm.model.runners.compile_process import die_with_parent
    from triollm.process_exit import exit_without_teardown

    stdin = sys.stdin.buffer
    job: RankJob = pickle.load(stdin)
    die_with_parent(job.parent_pid)
    logging.basicConfig(level=job.log_level,
                        format=f"%(levelname)s %(asctime)s rank {job.rank} %(name)s: "
                               f"%(message)s")
    worker = RankWorker(job)
    while message := read_frame(stdin):
        worker.run_step(message)
    worker.shutdown()
    exit_without_teardown(0)


if __name__ == "__main__":
    main()
