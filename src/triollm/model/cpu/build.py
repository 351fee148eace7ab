"""Building the engine's small C kernels: compiled on first use with the machine's C
compiler (``$CC``, else ``cc``), ``-O3 -march=native``, into a cache directory
(``$TRIOLLM_CACHE/kernels``, else ``~/.cache/triollm/kernels``). A library's file name
is keyed by its source, flags, the compiler's version and the CPU's model and feature
flags, so a cache carried to another machine is never reused there. ``load_checked``
is how each kernel module loads its library: what its answers are checked against is
the module's own business (cpu_decode.py, cpu_gemm.py, cpu_varlen.py)."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

__all__ = ["AVX512_EXP16", "FLAGS", "build", "cpu_flags", "cpu_signature", "load_checked",
           "load_library"]

logger = logging.getLogger(__name__)

Kernel = TypeVar("Kernel")

#: C source of ``exp16``, e^x of 16 floats at once, for the kernels' AVX-512 paths (it
#: needs immintrin.h included first).
AVX512_EXP16 = r"""
/* e^x for x <= 0: x = n ln2 + r with |r| <= ln2/2, a degree-6 polynomial in r, scaled by
   2^n; within 2 ulp of expf on [-87, 0], and 0 below (where expf is below 2^-125). */
static inline __m512 exp16(__m512 x) {
    const __m512 floor_ = _mm512_set1_ps(-87.0f);
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, floor_, _CMP_LT_OQ);
    x = _mm512_max_ps(x, floor_);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps((__mmask16)~tiny, _mm512_scalef_ps(p, n));
}
"""

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


def load_checked(stem: str, source: str, what: str, wrap: Callable[[ctypes.CDLL], Kernel],
                 agrees: Callable[[Kernel], bool], supported: str | None = None
                 ) -> Kernel | None:
    """``load_library``; then, where ``supported`` names a C function of the library that
    returns 0 (this CPU lacks what the kernel needs), None without a warning; else
    ``wrap(library)``, or None with a warning where ``agrees`` rejects its answers."""
    library = load_library(stem, source, what)
    if library is None or (supported is not None and not getattr(library, supported)()):
        return None
    kernel = wrap(library)
    if not agrees(kernel):
        logger.warning("the %s disagrees with torch here; not using it", what)
        return None
    return kernel
