"""The ``mp`` executor: ranks 1... as child processes of the driver's model thread.

Each child is ``python -m triollm.model.parallel.rank_worker`` started by
``subprocess`` (a fresh interpreter, as multiprocessing's spawn: no fork of a process
with torch's threads), leading its own process group, killed by the kernel if the
thread that started it ends (``PR_SET_PDEATHSIG``, set by the child). Its stdin is the
one pipe the driver writes to: the job first, then one framed message per step
(messages.py); its log lines go to the driver's stderr, marked with its rank.

Liveness: before each step the driver checks that every child still runs; during a
step, a child that died closes its sockets and the driver's collective fails at once,
and one that hangs makes it time out after ``worker_timeout_s``. Either way the step
raises ``RankFailedError`` and the engine is dead. ``shutdown`` sends the stop
message, gives each child ``TERMINATE_SECONDS`` to exit, then ends its process group
(SIGTERM, SIGKILL) and reaps it: nothing outlives the engine.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import subprocess
import sys
import time

from triollm.child_env import child_environment
from triollm.config import EngineConfig
from triollm.model.parallel.group import RankGroup, connect_store, join_group
from triollm.model.parallel.messages import STOP, write_frame
from triollm.model.parallel.rank_worker import RankJob
from triollm.model.runners.compile_process import TERMINATE_SECONDS, end_group

__all__ = ["MultiprocessExecutor", "RankFailedError"]

logger = logging.getLogger(__name__)

WORKER_MODULE = "triollm.model.parallel.rank_worker"


class RankFailedError(RuntimeError):
    """A tensor-parallel rank died or stopped answering."""


class MultiprocessExecutor:
    """Starts, feeds and ends the child processes of ranks 1... ."""

    def __init__(self, config: EngineConfig, rank_cpus: list[tuple[int, ...] | None]) -> None:
        self.config = config
        self.rank_cpus = rank_cpus
        self.children: list[subprocess.Popen[bytes]] = []

    def start(self) -> RankGroup:
        """Start the children and meet them: the driver's (rank 0's) group."""
        world_size = self.config.parallel.tensor_parallel_size
        host = "127.0.0.1"
        store = connect_store(host, 0, world_size, driver=True)
        level = logging.getLogger("triollm").getEffectiveLevel()
        for rank in range(1, world_size):
            child = subprocess.Popen([sys.executable, "-m", WORKER_MODULE],
                                     stdin=subprocess.PIPE, env=child_environment(),
                                     start_new_session=True)
            self.children.append(child)
            job = RankJob(self.config, rank, host, store.port, self.rank_cpus[rank], level)
            assert child.stdin is not None
            with contextlib.suppress(BrokenPipeError):  # died at once: start() says so
                child.stdin.write(pickle.dumps(job))
                child.stdin.flush()
        logger.info("tensor parallelism: %d rank processes started (pids %s)",
                    world_size - 1, ", ".join(str(c.pid) for c in self.children))
        return join_group(0, world_size, store, self.config.parallel.worker_timeout_s,
                          self.config.model.device)

    def check(self) -> None:
        """``RankFailedError`` naming a child that has exited."""
        for rank, child in enumerate(self.children, start=1):
            if child.poll() is not None:
                raise RankFailedError(f"tensor-parallel rank {rank} (pid {child.pid}) "
                                      f"exited with code {child.returncode}")

    def send(self, message: bytes) -> None:
        """One step's message to every child."""
        self.check()
        for rank, child in enumerate(self.children, start=1):
            assert child.stdin is not None
            try:
                write_frame(child.stdin, message)  # type: ignore[arg-type]
            except (BrokenPipeError, ValueError) as error:
                raise RankFailedError(f"tensor-parallel rank {rank} (pid {child.pid}) "
                                      f"stopped reading its steps") from error

    def shutdown(self) -> None:
        """Stop every child and reap it (SIGTERM, then SIGKILL, for one that lingers)."""
        for child in self.children:
            if child.stdin is not None:
                with contextlib.suppress(OSError, ValueError):
                    write_frame(child.stdin, STOP)  # type: ignore[arg-type]
                    child.stdin.close()
        deadline = time.monotonic() + TERMINATE_SECONDS
        for child in self.children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(max(0.0, deadline - time.monotonic()))
            end_group(child)
        self.children.clear()

