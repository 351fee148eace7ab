"""Starting an engine process and ending it: the OS side of a replica.

The process is ``python -m triollm.engine.process.child FD PARENT_PID [CORES]`` (started
by ``subprocess``: no fork of a process that runs torch's threads), given one end of a
socket pair. It leads a process group of its own, so that ending it ends what it
started (its compile process), and it dies with the server (``PR_SET_PDEATHSIG``, set by
the child). It imports the model code as soon as it starts, then waits for its setup.

``triollm serve`` starts its engine processes before it imports its own server
(``PrestartedEngines``), so that the seconds both spend importing torch and
transformers overlap; each replica then takes its process instead of starting one.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from types import TracebackType

from triollm.child_env import child_environment
from triollm.model.runners.compile_process import end_group

__all__ = ["CHILD_MODULE", "STOP_SECONDS", "PrestartedEngines", "start_engine_process",
           "stop_engine_process"]

CHILD_MODULE = "triollm.engine.process.child"
#: How long an engine process gets to finish its step and shut down once the server
#: closes its socket, before its group is ended (SIGTERM, then SIGKILL).
STOP_SECONDS = 5.0


def start_engine_process(cores: frozenset[int] | None = None
                         ) -> tuple[subprocess.Popen[bytes], socket.socket]:
    """Start an engine process, computing on ``cores`` (None: this process's
    affinity); it and the server's end of its socket. Call it from the thread that
    lives as long as the process should (the event loop's, or the main thread)."""
    ours, theirs = socket.socketpair()
    command = [sys.executable, "-m", CHILD_MODULE, str(theirs.fileno()), str(os.getpid())]
    if cores is not None:
        command.append(",".join(map(str, sorted(cores))))
    try:
        process = subprocess.Popen(
            command,
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=child_environment(),
            start_new_session=True)
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return process, ours


def stop_engine_process(process: subprocess.Popen[bytes], wait: float = STOP_SECONDS) -> None:
    """Give the process ``wait`` seconds to exit (its socket is closed: it is stopping),
    then end its group; reaps it either way (blocking: run it in a thread)."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(wait)
    end_group(process)


class PrestartedEngines:
    """Engine processes started ahead of the server that will run them, one per
    replica, each computing on its share of the cores; a replica ``take``s its own.
    Closing stops and reaps those never taken (theirs is then the replica's)."""

    def __init__(self, cores: Sequence[frozenset[int] | None]) -> None:
        self._started: dict[int, tuple[subprocess.Popen[bytes], socket.socket]] = {}
        try:
            for index, share in enumerate(cores):
                self._started[index] = start_engine_process(share)
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> dict[int, int]:
        """Each replica's process id, of the processes not yet taken."""
        return {index: process.pid for index, (process, _) in self._started.items()}

    def take(self, index: int) -> tuple[subprocess.Popen[bytes], socket.socket] | None:
        """Replica ``index``'s process and socket, now the caller's to stop (None if
        there is none, or it was taken)."""
        return self._started.pop(index, None)

    def close(self) -> None:
        """End and reap every process not taken (blocking): with no setup yet, it has
        nothing to finish."""
        started, self._started = self._started, {}
        for process, sock in started.values():
            sock.close()
            stop_engine_process(process, wait=0)

    def __enter__(self) -> PrestartedEngines:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()
