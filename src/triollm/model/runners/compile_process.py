"""The model's compile run in a child process at low priority, owned by the runner.

dynamo traces the decoder in Python and inductor generates its code in Python too, so a
compile thread of the serving process holds the GIL for much of a cold compile and the
model thread's steps wait for it (and a torch.fx trace patches ``nn.Module.__call__``
process-wide, which broke the model thread's eager forward). So where the compiled
decoder is saved as AOT artifacts (precompiled.py), a child process builds them into the
cache (``python -m triollm.model.runners.compile_child``, at ``nice`` ``NICENESS``,
started by ``subprocess``: no fork of a process with torch's threads), and the serving
process then loads them as a warm restart does.

The job crosses on the child's stdin as a pickle (``CompileJob``: the engine config, the
thread counts, and the key the parent expects: the child refuses to compile under any
other); the child's log lines come back on its stdout and stderr, one pipe, and are
logged here under this module's logger (``compile process: ...``), its level kept; its
last line says what it built (``RESULT_PREFIX``, then JSON).

Lifetime: the child leads a process group of its own (its compiler workers are in it);
``run_compile_process`` checks ``stop`` between reads and, once it is true, ends the
group (SIGTERM, then SIGKILL after ``TERMINATE_SECONDS``) and reaps the child. Should the
serving process die first, the child dies with it (``die_with_parent``:
``PR_SET_PDEATHSIG``, and a check of its parent's pid). A child that fails or is
killed is a warning, and the model stays eager.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import pickle
import selectors
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from triollm.config import EngineConfig

__all__ = ["CHILD_MODULE", "NICENESS", "RESULT_PREFIX", "TERMINATE_SECONDS", "CompileJob",
           "child_command", "die_with_parent", "end_group", "run_compile_process"]

logger = logging.getLogger(__name__)

CHILD_MODULE = "triollm.model.runners.compile_child"
#: The nice value of the compile process and of the compile thread (0: the serving
#: threads'; 19: the lowest priority).
NICENESS = 10
#: How long a child gets to end after SIGTERM before SIGKILL.
TERMINATE_SECONDS = 2.0
#: Starts the child's last stdout line, followed by its result as JSON.
RESULT_PREFIX = "triollm-compile-result "
#: How often the wait checks ``stop`` when the child is silent.
_POLL_SECONDS = 0.1
#: The child's last lines kept for the warning when it fails.
_TAIL_LINES = 5
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class CompileJob:
    """What the child needs to build the same compiled decoder as the parent: the
    engine config (the model, its dtype, the thread count, the quantization), the
    thread counts to compile for, the KV cache's dtype and the parent's cache key,
    which the child's own (``compile.compile_key``) must equal."""

    config: EngineConfig
    counts: list[int]
    cache_dtype: torch.dtype
    key: str
    parent_pid: int = field(default_factory=os.getpid)


def die_with_parent(parent_pid: int) -> None:
    """In the child: have the kernel kill this process when the thread that started it
    ends (``PR_SET_PDEATHSIG``, Linux: that thread waits for the child, so it ends only
    with the child or its process); exit now if ``parent_pid`` is already gone."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the parent's close still ends it
        pass
    if os.getppid() != parent_pid:
        os._exit(1)


def child_command() -> list[str]:
    """The command line that starts the child (the job comes on its stdin)."""
    return [sys.executable, "-m", CHILD_MODULE]


def _child_environment() -> dict[str, str]:
    """The parent's environment, with the parent's own triollm first on the path: the
    child must run the same model code (it is in the cache key)."""
    package_root = str(Path(__file__).resolve().parents[3])
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": package_root + (os.pathsep + path if path else "")}


def run_compile_process(job: CompileJob, stop: Callable[[], bool],
                        command: list[str] | None = None) -> bool:
    """Run the child on ``job`` to its end, logging its lines; returns whether it built
    the compiled decoder under ``job.key`` (False, with a warning, where it failed; False
    quietly where ``stop()`` became true, the child's group then ended and reaped)."""
    started = time.perf_counter()
    child = subprocess.Popen(command or child_command(), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             env=_child_environment(), start_new_session=True)
    try:
        assert child.stdin is not None
        with contextlib.suppress(BrokenPipeError):  # the child died early: its exit says why
            child.stdin.write(pickle.dumps(job))
            child.stdin.close()
        result, tail = _follow(child, stop)
        if not stop():
            with contextlib.suppress(subprocess.TimeoutExpired):  # its output closed: exiting
                child.wait(TERMINATE_SECONDS)
    finally:
        end_group(child)
    if stop():
        logger.info("the compile process stopped: the engine is shutting down")
        return False
    if result is not None and result.get("key") != job.key:
        logger.warning("the compile process built another model (key %s, not %s); the "
                       "model runs eagerly", result.get("key"), job.key)
        return False
    if result is None or child.returncode != 0:
        logger.warning("the compile process failed (exit code %s); the model runs eagerly%s",
                       child.returncode, "".join(f"\n  {line}" for line in tail))
        return False
    logger.info("the compile process built the compiled model in %.1f s",
                time.perf_counter() - started)
    return bool(result.get("compiled"))


def _follow(child: subprocess.Popen[bytes], stop: Callable[[], bool]
            ) -> tuple[dict[str, object] | None, deque[str]]:
    """Log ``child``'s lines until it closes its output or ``stop()``; its result (None:
    none came) and its last lines."""
    assert child.stdout is not None
    result: dict[str, object] | None = None
    tail: deque[str] = deque(maxlen=_TAIL_LINES)
    pending = b""
    with selectors.DefaultSelector() as selector:
        selector.register(child.stdout, selectors.EVENT_READ)
        while not stop():
            if not selector.select(_POLL_SECONDS):
                continue
            chunk = os.read(child.stdout.fileno(), 1 << 16)
            if not chunk:
                break
            *lines, pending = (pending + chunk).split(b"\n")
            for raw in lines:
                line = raw.decode(errors="replace").rstrip()
                if line.startswith(RESULT_PREFIX):
                    with contextlib.suppress(ValueError):
                        result = json.loads(line[len(RESULT_PREFIX):])
                elif line:
                    tail.append(_log_line(line))
    return result, tail


def _log_line(line: str) -> str:
    """Log one line of the child's: ``LEVEL<TAB>logger<TAB>message`` at its level,
    anything else (a traceback, torch's own prints) at INFO; returns what it logged."""
    level_name, _, rest = line.partition("\t")
    level = logging.getLevelName(level_name)
    if isinstance(level, int) and rest:
        line, level = rest.partition("\t")[2] or rest, level
    else:
        level = logging.INFO
    logger.log(level, "compile process: %s", line)
    return line


def end_group(child: subprocess.Popen[bytes], timeout: float = TERMINATE_SECONDS) -> None:
    """End ``child``'s process group (SIGTERM; SIGKILL after ``timeout``) and reap the
    child: nothing it started outlives it."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, sig)
        try:
            child.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    for stream in (child.stdin, child.stdout):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()
