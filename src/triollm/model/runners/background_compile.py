"""Compiling the model in the background while the runner serves eagerly.

The async engine's runner (``ModelConfig.compile_in_background``) starts serving at
once; a thread the runner owns gets the compiled forward built meanwhile, and the model
thread switches to it at a step boundary once it is built and checked
(``TorchModelRunner.switch_when_compiled``: the next step, or, on an idle engine, within
half a second, the engine asking while it waits for work).

Where the compiled decoder is saved as AOT artifacts (precompiled.py: every model but
those with quantized layers), the thread does not compile: a compile process does
(compile_process.py, compile_child.py), at low priority, off the serving process's GIL
(dynamo traces and inductor generates code in Python: a compile thread of the serving
process held its GIL long enough to stall a step for seconds). The thread waits for the
process without holding the GIL, then loads the artifacts as a warm restart does and
checks the compiled forward against the eager logits.
Where they are not saved (quantized layers, or no private cache directory), the thread
compiles the model itself (dynamo's compile, compile.py). Either way it is safe beside
the serving model thread because:

- it runs its dummy forwards on a scratch KV cache of its own: the compiled attention
  reads the cache through the thread-local ``forward_metadata``, so the live cache,
  whose blocks hold requests' keys, is never written;
- the compiled decoder's calls go to the compiled code only on a thread inside a
  compiled forward (compile.py's dispatcher); the model thread runs it eagerly until it
  switches;
- torch's intra-op thread count and dynamo's frame hook are per thread, so it compiles
  (or loads) for each thread count without changing the model thread's;
- where it compiles, it runs at a lower OS priority (Linux ``nice`` is per thread, and
  the OpenMP threads and compiler processes it starts inherit it), so the model thread
  keeps its cores; what a compile in this thread still costs the serving thread is the
  GIL while dynamo traces in Python. Loading saved artifacts keeps the normal priority:
  it takes seconds, and niced under steady traffic it would starve, leaving the model
  eager (several times slower on a small model) for as long.

Lifetime: the runner's ``shutdown`` sets a stop flag, which the compile checks between
compiles (and before each inductor compile) and the wait for the compile process
between reads (it then ends the process's group and reaps it), then joins the thread,
at most ``JOIN_SECONDS``. An error in the thread or the process is logged as a warning
and leaves the model eager; it never reaches the engine.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import torch

from triollm.config import EngineConfig
from triollm.model.runners.batch import DecodeAttention
from triollm.model.runners.compile import (
    CompilePlan,
    DummyDecodes,
    build_compiled,
    compile_key,
    saves_artifacts,
)
from triollm.model.runners.compile_process import NICENESS, CompileJob, run_compile_process
from triollm.model.runners.precompiled import cache_directory, has_artifacts

__all__ = ["JOIN_SECONDS", "NICENESS", "BackgroundCompile", "background_build"]

logger = logging.getLogger(__name__)

#: How long closing waits for a compile to reach a point where it can stop: shutdown
#: must not wait out an inductor compile (the thread is a daemon: process exit ends it).
JOIN_SECONDS = 5.0


Build = Callable[[Callable[[], bool]], bool]


def background_build(dummy: DummyDecodes, attention: DecodeAttention, plan: CompilePlan,
                     config: EngineConfig, cache_dtype: torch.dtype) -> Build:
    """What the compile thread runs: where the compiled decoder is saved, load it if
    all of it is, else have a compile process build it, then load it; where it is not
    saved, compile it in the thread."""
    dtype = config.model.dtype
    key = compile_key(dummy, attention, dtype)
    directory = cache_directory(key) if saves_artifacts(dummy.model) else None
    shapes = 2 * len(plan.counts)
    if directory is None:
        logger.info("compiling the model in the background (%d shapes); serving eagerly "
                    "meanwhile", shapes)

        def compile_here(stop: Callable[[], bool]) -> bool:
            _lower_this_threads_priority()
            return build_compiled(dummy, attention, plan, dtype, stop)
        return compile_here
    job = CompileJob(config, plan.counts, cache_dtype, key)
    saved = has_artifacts(directory, plan.counts)
    logger.info("%s in the background (%d shapes%s); serving eagerly meanwhile",
                "loading the compiled model" if saved else "compiling the model", shapes,
                "" if saved else ", in a process of its own")

    def build(stop: Callable[[], bool]) -> bool:
        if saved and build_compiled(dummy, attention, plan, dtype, stop, load_only=True):
            return True
        return (not stop() and run_compile_process(job, stop)
                and build_compiled(dummy, attention, plan, dtype, stop, load_only=True))
    return build


def _lower_this_threads_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICENESS)
    except (AttributeError, OSError):  # not Linux, or not allowed: compile anyway
        pass


class BackgroundCompile:
    """One thread running ``build(stop)``, which returns whether the model compiled and
    gives up once ``stop()`` is true. Started by the constructor; ``close`` it."""

    def __init__(self, build: Build, name: str = "triollm-compile") -> None:
        self._build = build
        self._stop = threading.Event()
        self._done = threading.Event()
        self._compiled = False
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
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
