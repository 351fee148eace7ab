"""Compiling the model in a thread of its own while the runner serves eagerly.

The async engine's runner (``ModelConfig.compile_in_background``) starts serving at
once; this thread, which the runner owns, compiles the forward meanwhile, and the model
thread switches to it at a step boundary once it is compiled and checked
(``TorchModelRunner.execute_model``). It is safe beside the serving model thread because:

- it runs its dummy forwards on a scratch KV cache of its own: the compiled attention
  reads the cache through the thread-local ``forward_metadata``, so the live cache,
  whose blocks hold requests' keys, is never written;
- the compiled decoder's calls go to the compiled code only on a thread inside a
  compiled forward (compile.py's dispatcher); the model thread runs it eagerly until it
  switches;
- torch's intra-op thread count and dynamo's frame hook are per thread, so it compiles
  for each thread count without changing the model thread's;
- it runs at a lower OS priority (Linux ``nice`` is per thread, and the OpenMP threads
  and compiler processes it starts inherit it), so the model thread keeps its cores;
  what it still costs the serving thread is the GIL while dynamo traces in Python.

Lifetime: the runner's ``shutdown`` sets a stop flag, which the compile checks between
compiles (and before each inductor compile), then joins the thread, at most
``JOIN_SECONDS``. An error in the thread is logged as a warning and leaves the model
eager; it never reaches the engine.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

__all__ = ["JOIN_SECONDS", "NICENESS", "BackgroundCompile"]

logger = logging.getLogger(__name__)

#: How long closing waits for a compile to reach a point where it can stop.
JOIN_SECONDS = 60.0
#: The compile thread's nice value (0: the model thread's; 19: the lowest priority).
NICENESS = 10


class BackgroundCompile:
    """One thread running ``build(stop)``, which returns whether the model compiled and
    gives up once ``stop()`` is true. Started by the constructor; ``close`` it."""

    def __init__(self, build: Callable[[Callable[[], bool]], bool],
                 name: str = "triollm-compile") -> None:
        self._build = build
        self._stop = threading.Event()
        self._done = threading.Event()
        self._compiled = False
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICENESS)
        except (AttributeError, OSError):  # not Linux, or not allowed: compile anyway
            pass
        try:
            self._compiled = self._build(self._stop.is_set)
        except BaseException as error:  # the thread's end: the engine must not see it
            logger.warning("compiling the model failed (%s: %s); it runs eagerly",
                           type(error).__name__, error)
        finally:
            self._done.set()

    @property
    def done(self) -> bool:
        """Whether the compile has ended (compiled, failed or stopped)."""
        return self._done.is_set()

    @property
    def compiled(self) -> bool:
        """Whether it ended with the model compiled and checked."""
        return self._done.is_set() and self._compiled

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the compile has ended, at most ``timeout`` seconds; returns
        whether it has."""
        return self._done.wait(timeout)

    @property
    def alive(self) -> bool:
        """Whether the thread still runs."""
        return self._thread.is_alive()

    def close(self, timeout: float = JOIN_SECONDS) -> bool:
        """Ask the compile to stop and wait for the thread, at most ``timeout`` seconds;
        returns whether it is gone (a thread that is not is left to finish on its own:
        it writes nothing the runner still uses)."""
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("the model's compile thread did not stop within %.0f s; it is "
                           "left to finish", timeout)
            return False
        return True
