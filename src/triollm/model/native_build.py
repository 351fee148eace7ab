"""Building the engine's small C kernels: compiled on first use with the machine's C
compiler (``$CC``, else ``cc``), ``-O3 -march=native``, into a cache directory
(``$TRIOLLM_CACHE/kernels``, else ``~/.cache/triollm/kernels``). A library's file name
is keyed by its source, flags, the compiler's version and the CPU's model and feature
flags, so a cache carried to another machine is never reused there. Checking a loaded
library's answers is each kernel module's own business (cpu_decode.py, cpu_gemm.py)."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path

__all__ = ["FLAGS", "build", "cpu_flags", "cpu_signature", "load_library"]

logger = logging.getLogger(__name__)

FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]


def cpu_signature() -> str:
    """What compiled code depends on: the CPU's model and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return os.uname().machine
    lines = [line for line in text.splitlines()
             if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(lines)))


def cpu_flags() -> set[str]:
    """The CPU's feature flags (``avx512_bf16``, ...); empty where /proc is not there."""
    flags: set[str] = set()
    for line in cpu_signature().splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.partition(":")[2].split())
    return flags


def _cache_dir() -> Path:
    base = os.environ.get("TRIOLLM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "triollm")
    return Path(base) / "kernels"


def build(stem: str, source: str, flags: list[str] | None = None) -> Path:
    """The shared library built from ``source`` (built now unless cached); raises
    ``OSError`` or ``subprocess.SubprocessError`` where it cannot be built."""
    compiler = os.environ.get("CC", "cc")
    flags = FLAGS if flags is None else flags
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             check=True, timeout=60).stdout
    key = hashlib.sha256("\0".join([source, " ".join(flags), version,
                                    cpu_signature()]).encode()).hexdigest()[:20]
    target = _cache_dir() / f"{stem}_{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        source_file = Path(work) / f"{stem}.c"
        source_file.write_text(source)
        built = Path(work) / f"{stem}.so"
        subprocess.run([compiler, *flags, str(source_file), "-o", str(built), "-lm"],
                       check=True, capture_output=True, text=True, timeout=300)
        os.replace(built, target)  # atomic: concurrent builders each install a whole file
    return target


def load_library(stem: str, source: str, what: str,
                 flags: list[str] | None = None) -> ctypes.CDLL | None:
    """``build`` and load; None where that fails (no C compiler, say), with the reason
    logged as "building the ``what`` failed"."""
    try:
        return ctypes.CDLL(str(build(stem, source, flags)))
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", "") or ""
        logger.warning("building the %s failed (%s: %s %s)", what, type(error).__name__,
                       error, detail.strip()[:500])
        return None
