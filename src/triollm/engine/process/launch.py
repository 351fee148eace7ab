"""Starting an engine process and ending it: the OS side of a replica.

The process is ``python -m triollm.engine.process.child FD`` (started by ``subprocess``:
no fork of a process that runs torch's threads), given one end of a socket pair. It
leads a process group of its own, so that ending it ends what it started (its compile
process), and it dies with the server (``PR_SET_PDEATHSIG``, set by the child).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from pathlib import Path

from triollm.model.runners.compile_process import end_group

__all__ = ["CHILD_MODULE", "STOP_SECONDS", "start_engine_process", "stop_engine_process"]

CHILD_MODULE = "triollm.engine.process.child"
#: How long an engine process gets to finish its step and shut down once the server
#: closes its socket, before its group is ended (SIGTERM, then SIGKILL).
STOP_SECONDS = 5.0


def _environment() -> dict[str, str]:
    """The server's environment with the server's own triollm first on the path: the
    engine must run the same code."""
    package_root = str(Path(__file__).resolve().parents[3])
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": package_root + (os.pathsep + path if path else "")}


def start_engine_process() -> tuple[subprocess.Popen[bytes], socket.socket]:
    """Start an engine process; it and the server's end of its socket."""
    ours, theirs = socket.socketpair()
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", CHILD_MODULE, str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=_environment(),
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
