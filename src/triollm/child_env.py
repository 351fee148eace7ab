"""The environment of the processes triollm starts to compute in: engine processes,
tensor-parallel ranks (as subprocesses or Ray actors).

* **Its own code first on the path:** a child must import the same triollm as its
  parent, wherever that was imported from.
* **OpenMP threads that stop spinning soon** (``GOMP_SPINCOUNT``): torch's libgomp lets
  a thread that waits for the rest of its team, at a barrier or for the next parallel
  region, spin 300,000 times before it sleeps, some 10 ms on a CPU whose ``pause``
  takes 100+ cycles. While another process holds one of the cores (the server's own
  event loop answering a burst of new connections, for one), two threads of a team
  share the other core, and each spins out its slice waiting for the other one, which
  cannot run: a 4 ms decode step took 130-180 ms. At ``OPENMP_SPIN_COUNT`` a waiting
  thread sleeps within a fraction of a millisecond (vLLM sets Intel OpenMP's
  ``KMP_BLOCKTIME`` to 1 ms for the same reason), longer than the gaps between the ops
  of one step, so a quiet machine computes as before. A ``GOMP_SPINCOUNT`` or
  ``OMP_WAIT_POLICY`` already in the environment is left as it is.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["OPENMP_SPIN_COUNT", "child_environment", "child_environment_settings"]

#: ``GOMP_SPINCOUNT`` in a child that was not given one.
OPENMP_SPIN_COUNT = 10_000

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[1])


def child_environment_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """What a child's environment adds to (or changes in) ``environ``."""
    path = environ.get("PYTHONPATH")
    settings = {"PYTHONPATH": _PACKAGE_ROOT + (os.pathsep + path if path else "")}
    if "GOMP_SPINCOUNT" not in environ and "OMP_WAIT_POLICY" not in environ:
        settings["GOMP_SPINCOUNT"] = str(OPENMP_SPIN_COUNT)
    return settings


def child_environment() -> dict[str, str]:
    """This process's environment as a child of it gets it."""
    return {**os.environ, **child_environment_settings(os.environ)}
