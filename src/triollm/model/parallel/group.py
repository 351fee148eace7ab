"""One rank's view of its tensor-parallel group: torch.distributed's process groups and
the few collectives the sharded layers call.

The groups are made directly on the driver's ``TCPStore`` (no ``init_process_group``):
no process-wide state, so several engines may live in one process, one after another or
side by side. Two groups join the same ranks. Set-up (the rendezvous, loading,
profiling, the kernels' checks) runs on the set-up group, whose timeout is long: ranks
load at their own pace. Steps run on the step group, whose timeout is
``worker_timeout_s``: a rank that died or hangs makes the driver's next collective
raise within it. gloo on CPU, NCCL on CUDA.
"""

from __future__ import annotations

import datetime
import logging
import time
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist

__all__ = ["SETUP_TIMEOUT_S", "RankGroup", "connect_store", "join_group"]

logger = logging.getLogger(__name__)

#: How long the rendezvous and set-up collectives wait for the slowest rank.
SETUP_TIMEOUT_S = 600.0


def _process_group(store: dist.Store, prefix: str, rank: int, world_size: int,
                   timeout_s: float, device: torch.device) -> dist.ProcessGroup:
    prefixed = dist.PrefixStore(prefix, store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group: Any = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    else:
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    return cast("dist.ProcessGroup", group)


@dataclass
class RankGroup:
    """This process's rank in a tensor-parallel group of ``world_size``."""

    rank: int
    world_size: int
    device: torch.device
    setup_group: dist.ProcessGroup
    step_group: dist.ProcessGroup
    #: The store the groups met on (the driver's owns the server socket).
    store: dist.Store
    #: Whether collectives run on the step group (after ``start_steps``).
    stepping: bool = False
    #: Seconds spent in the layers' collectives since ``take_comm_seconds``.
    comm_seconds: float = 0.0

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def start_steps(self) -> None:
        """From now on collectives time out after the step timeout."""
        self.stepping = True

    @property
    def _group(self) -> dist.ProcessGroup:
        return self.step_group if self.stepping else self.setup_group

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of ``tensor`` over the ranks, in place."""
        started = time.perf_counter()
        self._group.allreduce([tensor]).wait()
        self.comm_seconds += time.perf_counter() - started
        return tensor

    def all_gather_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` joined along its last dimension, in rank order."""
        started = time.perf_counter()
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._group.allgather([parts], [tensor]).wait()
        self.comm_seconds += time.perf_counter() - started
        return torch.cat(parts, dim=-1)

    def agree_min(self, value: int) -> int:
        """The smallest ``value`` of all ranks (every rank gets it)."""
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp(dist.ReduceOp.MIN)
        self._group.allreduce([tensor], options).wait()
        return int(tensor.item())

    def take_comm_seconds(self) -> float:
        """The seconds spent in collectives since the last call."""
        seconds, self.comm_seconds = self.comm_seconds, 0.0
        return seconds


def join_group(rank: int, world_size: int, store: dist.Store, step_timeout_s: float,
               device: torch.device) -> RankGroup:
    """Meet the other ranks on ``store`` (the driver's ``TCPStore``, or a client of it)
    and return this rank's ``RankGroup``, its collectives on the set-up group."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    setup = _process_group(store, "setup/", rank, world_size, SETUP_TIMEOUT_S, device)
    step = _process_group(store, "step/", rank, world_size, step_timeout_s, device)
    logger.debug("rank %d of %d joined", rank, world_size)
    return RankGroup(rank, world_size, device, setup, step, store)


def connect_store(host: str, port: int, world_size: int, *, driver: bool) -> dist.TCPStore:
    """The driver's store (``driver``: it listens, on ``port`` 0 a free one) or a client
    of it."""
    return dist.TCPStore(host, port, world_size, is_master=driver, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=SETUP_TIMEOUT_S))
