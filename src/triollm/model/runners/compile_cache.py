"""Where torch keeps what it compiles: under triollm's cache root, persistent and private.

torch's inductor caches compiled graphs (its FX graph cache and AOTAutograd's cache,
keyed by the graph, the inputs' shapes, the torch version and the machine) in
``TORCHINDUCTOR_CACHE_DIR``, by default ``/tmp/torchinductor_<user>``: lost on reboot,
in a directory others share, and the Python it writes there is imported. So unless the
user set ``TORCHINDUCTOR_CACHE_DIR``, a runner about to compile points it at
``$TRIOLLM_CACHE/torch`` (else ``~/.cache/triollm/torch``), checked and made private the
way the C kernels' cache is (model/cpu/build.py): a restart then reuses every graph an
earlier start compiled, and skips the C++ compiler.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from triollm.model.cpu.build import trusted_cache_dir

__all__ = ["ENVIRONMENT_VARIABLE", "use_private_compile_cache"]

logger = logging.getLogger(__name__)

ENVIRONMENT_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"


def use_private_compile_cache() -> Path:
    """Point torch's compile caches at triollm's cache root unless the user (or an
    earlier call) already chose a directory; returns the directory in use. Call before
    torch compiles anything: torch reads the variable when it first writes its cache."""
    chosen = os.environ.get(ENVIRONMENT_VARIABLE)
    if chosen:
        return Path(chosen)
    directory = trusted_cache_dir("torch")
    os.environ[ENVIRONMENT_VARIABLE] = str(directory)
    logger.debug("torch's compile caches: %s", directory)
    return directory
