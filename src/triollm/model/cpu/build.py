"""Building the engine's C kernels from their sources in ``triollm/csrc/`` (shipped as
package data): compiled on first use with the machine's C compiler (``$CC``, else
``cc``), ``-O3 -march=native -Wall -Wextra``, into a cache directory
(``$TRIOLLM_CACHE/kernels``, else ``~/.cache/triollm/kernels``). A library's file name is
keyed by its source and the headers, the flags, the compiler's version and the CPU's
model and feature flags, so a cache carried to another machine is never reused there.
A library is built in a private (0700) scratch directory beside its final place and
renamed into it whole. The cache is only loaded from while nobody else could have
written it (private_cache.py): a directory or library another user owns or may write
raises ``KernelBuildError`` in strict mode; otherwise a warning names it, and a library
in a trusted directory is built again, while an untrusted directory gives way to a
private temporary one for this process.
``python -m triollm.model.cpu.build`` builds every kernel by hand and says which this
CPU runs.

- The helper pool (``pool.c``, see helpers.py) is a library of its own that the kernel
  libraries link (found beside them through ``$ORIGIN``), so a process has one pool.
- OpenMP regions run on the runtime torch loaded: where torch ships its ``libgomp`` in
  ``torch/lib``, the kernels link that file, not the compiler's.
- A compiler warning, a failed build or a kernel that disagrees with torch when it loads
  is logged as a warning naming the slower path used instead; with
  ``TRIOLLM_STRICT_KERNELS=1`` (the test suite sets it) each raises ``KernelBuildError``.
  A kernel the CPU lacks the instructions for is skipped silently.

The kernels are plain C behind ctypes rather than torch ops built with
torch.utils.cpp_extension: ATen's headers make even a one-op extension take minutes to
build on a 2-core machine, against about a second for a kernel here, and a build on
first use runs again for every new compiler, CPU or torch version, on the engine's
start. Where a call's Python costs too much (a compiled model's quantized layers), a
C++ op on torch's stable ABI, which builds in seconds, calls the same C functions
(kernel_ops.py).
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TypeVar

from triollm.model.cpu.private_cache import (
    make_private_directory,
    untrusted_directory,
    untrusted_library,
)

__all__ = ["CSRC", "FLAGS", "KERNELS", "KernelBuildError", "KernelSource", "build",
           "build_failed", "cache_key", "cache_root", "compile_only", "cpu_flags",
           "cpu_signature", "install", "load_checked", "load_library", "load_pool",
           "pool_name", "run_compiler", "strict", "trusted_cache_dir"]

logger = logging.getLogger(__name__)

Kernel = TypeVar("Kernel")

#: The C sources: a kernel per ``.c`` file, shared parts in headers.
CSRC = Path(__file__).resolve().parents[2] / "csrc"

FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-std=c11", "-Wall", "-Wextra"]


@dataclass(frozen=True)
class KernelSource:
    """A kernel library: ``csrc/<stem>.c``, whether it links the helper pool, and the C
    function (if any) that returns 0 where this CPU lacks what it needs (``needs``, the
    /proc/cpuinfo flags ``cpu_flag``, space-separated: a CPU known to lack one does not
    build it at all)."""

    stem: str
    pooled: bool
    supported: str | None = None
    needs: str = ""
    cpu_flag: str = ""


KERNELS = {
    "decode": KernelSource("decode", pooled=True),
    "gemm": KernelSource("gemm", pooled=True, supported="triollm_gemm_supported",
                         needs="AVX512-BF16", cpu_flag="avx512_bf16"),
    "gemm_avx2": KernelSource("gemm_avx2", pooled=True,
                              supported="triollm_gemm_avx2_supported", needs="AVX2 and FMA",
                              cpu_flag="avx2 fma"),
    "qgemm_avx2": KernelSource("qgemm_avx2", pooled=True,
                               supported="triollm_qgemm_avx2_supported",
                               needs="AVX2, FMA and F16C", cpu_flag="avx2 fma f16c"),
    "qgemm_avx512": KernelSource("qgemm_avx512", pooled=True,
                                 supported="triollm_qgemm_avx512_supported",
                                 needs="AVX-512 F and BW", cpu_flag="avx512f avx512bw"),
    "qgemm_vnni": KernelSource("qgemm_vnni", pooled=True,
                               supported="triollm_qgemm_vnni_supported",
                               needs="AVX-512 F, BW, VL, VBMI and VNNI",
                               cpu_flag="avx512f avx512bw avx512vl avx512vbmi avx512_vnni"),
    "varlen": KernelSource("varlen", pooled=False, supported="triollm_varlen_supported",
                           needs="AVX-512", cpu_flag="avx512f"),
}


class KernelBuildError(RuntimeError):
    """A kernel failed to build or to pass its load-time check, or the cache is not to
    be trusted (strict mode only)."""


def strict() -> bool:
    """Whether build and check failures raise (``TRIOLLM_STRICT_KERNELS=1``)."""
    return os.environ.get("TRIOLLM_STRICT_KERNELS", "") not in ("", "0")


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


def cache_root() -> Path:
    """triollm's cache directory: ``$TRIOLLM_CACHE``, else ``~/.cache/triollm``."""
    base = os.environ.get("TRIOLLM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "triollm")
    return Path(base)


def _compiler() -> str:
    return os.environ.get("CC", "cc")


@cache
def _compiler_version(compiler: str) -> str:
    return subprocess.run([compiler, "--version"], capture_output=True, text=True,
                          check=True, timeout=60).stdout


def _openmp_link() -> list[str]:
    """Link flags for the OpenMP runtime: torch's own ``libgomp`` where it ships one."""
    spec = importlib.util.find_spec("torch")
    if spec is not None and spec.origin is not None and sys.platform == "linux":
        runtimes = sorted((Path(spec.origin).parent / "lib").glob("libgomp*.so*"))
        if runtimes:
            return [str(runtimes[0]), f"-Wl,-rpath,{runtimes[0].parent}"]
    return ["-fopenmp"]


def run_compiler(command: list[str]) -> None:
    """Runs a compiler; a warning it prints is logged, or raised in strict mode."""
    done = subprocess.run(command, check=True, capture_output=True, text=True, timeout=300)
    if done.stderr.strip():
        if strict():
            raise KernelBuildError(f"the compiler warned: {done.stderr.strip()[:2000]}")
        logger.warning("the compiler warned building a kernel: %s", done.stderr.strip()[:500])


def cache_key(*parts: str, compiler: str | None = None) -> str:
    """A library's key: ``parts`` (its source, flags...), the headers, the compiler's
    version (``compiler``, default the C one) and the CPU's signature."""
    headers = [path.read_text() for path in sorted(CSRC.glob("*.h"))]
    version = _compiler_version(compiler or _compiler())
    text = "\0".join([*parts, *headers, version, cpu_signature()])
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _distrust(message: str) -> None:
    """Strict mode: raise ``message``; otherwise the caller works around it."""
    if strict():
        raise KernelBuildError(message)


@cache
def _private_fallback(wanted: str, name: str) -> Path:
    directory = Path(tempfile.mkdtemp(prefix=f"triollm-{name}-"))  # 0700
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    logger.warning("%s are cached in %s for this process instead of %s", name, directory,
                   wanted)
    return directory


def trusted_cache_dir(name: str = "kernels") -> Path:
    """``cache_root() / name``, made private where missing; one not to be trusted raises
    ``KernelBuildError`` (strict mode) or gives way to a private temporary directory."""
    wanted = cache_root() / name
    make_private_directory(wanted)
    reason = untrusted_directory(wanted)
    if reason is None:
        return wanted
    message = f"the {name} cache {wanted} is not safe to load code from: {reason}"
    _distrust(message)
    logger.warning("%s", message)
    return _private_fallback(str(wanted), name)


def install(name: str, make: Callable[[Path], None]) -> Path:
    """``name`` in the cache, made by ``make(path)`` in a private scratch directory
    (0700) beside it unless a trusted file is there already."""
    directory = trusted_cache_dir()
    target = directory / name
    if os.path.lexists(target):
        reason = untrusted_library(target)
        if reason is None:
            return target
        _distrust(f"the kernel library {target} is not safe to load: {reason}")
        logger.warning("the kernel library %s is not safe to load (%s); building it again",
                       target, reason)
    logger.info("building the C kernel %s...", name)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=directory) as work:
        built = Path(work) / name
        make(built)
        os.chmod(built, 0o700)
        os.replace(built, target)  # atomic: concurrent builders each install a whole file
    logger.info("built the C kernel %s in %.1f s", name, time.perf_counter() - started)
    return target


def pool_name() -> str:
    """The helper pool library's file name in the cache."""
    flags = [flag for flag in FLAGS if flag != "-fopenmp"]
    return f"libtriollm_pool_{cache_key((CSRC / 'pool.c').read_text(), ' '.join(flags))}.so"


def _pool_path() -> Path:
    flags = [flag for flag in FLAGS if flag != "-fopenmp"]
    name = pool_name()

    def make(built: Path) -> None:
        run_compiler([_compiler(), *flags, "-shared", f"-Wl,-soname,{name}", f"-I{CSRC}",
              str(CSRC / "pool.c"), "-o", str(built)])
    return install(name, make)


def build(stem: str, flags: list[str] | None = None) -> Path:
    """The shared library of ``KERNELS[stem]`` (built now unless cached); raises
    ``OSError`` or ``subprocess.SubprocessError`` where it cannot be built."""
    kernel = KERNELS[stem]
    flags = FLAGS if flags is None else flags
    link = _openmp_link()
    pool = [str(_pool_path()), "-Wl,-rpath,$ORIGIN"] if kernel.pooled else []
    source = (CSRC / f"{stem}.c").read_text()
    name = f"{stem}_{cache_key(source, ' '.join(flags), ' '.join(link), *pool[:1])}.so"

    def make(built: Path) -> None:
        objects = built.with_suffix(".o")
        run_compiler([_compiler(), *flags, f"-I{CSRC}", "-c", str(CSRC / f"{stem}.c"),
                      "-o", str(objects)])
        run_compiler([_compiler(), "-shared", str(objects), *pool, *link, "-lm", "-o",
                      str(built)])
    return install(name, make)


def compile_only(stem: str, flags: list[str]) -> None:
    """Compiles ``csrc/<stem>.c`` (``pool`` included) with ``flags`` and nothing else,
    discarding the object: raises ``subprocess.CalledProcessError`` with the compiler's
    output where it fails (add ``-Werror`` to fail on a warning)."""
    with tempfile.TemporaryDirectory() as work:
        subprocess.run([_compiler(), *flags, f"-I{CSRC}", "-c", str(CSRC / f"{stem}.c"),
                        "-o", str(Path(work) / "out.o")],
                       check=True, capture_output=True, text=True, timeout=300)


@cache
def load_pool() -> ctypes.CDLL:
    """The helper pool's library (the one every pooled kernel links)."""
    return ctypes.CDLL(str(_pool_path()))


def load_library(stem: str, what: str, fallback: str) -> ctypes.CDLL | None:
    """``build`` and load; None where that fails (no C compiler, say), with a warning
    "building the ``what`` failed ... ``fallback`` runs instead" (strict mode: raises
    ``KernelBuildError``)."""
    try:
        return ctypes.CDLL(str(build(stem)))
    except (OSError, subprocess.SubprocessError) as error:
        build_failed(what, fallback, error)
        return None


def build_failed(what: str, fallback: str, error: OSError | subprocess.SubprocessError
                 ) -> None:
    """Report that building ``what`` failed with ``error``: ``KernelBuildError`` in strict
    mode, else a warning that ``fallback`` runs instead."""
    detail = (getattr(error, "stderr", "") or "").strip()[:500]
    if strict():
        raise KernelBuildError(f"building the {what} failed: {error} {detail}") from error
    logger.warning("building the %s failed (%s: %s %s); %s runs instead, slower",
                   what, type(error).__name__, error, detail, fallback)


def load_checked(stem: str, what: str, wrap: Callable[[ctypes.CDLL], Kernel],
                 agrees: Callable[[Kernel], bool], fallback: str) -> Kernel | None:
    """``load_library``; then None without a warning where the kernel's ``supported``
    function says this CPU lacks what it needs; else ``wrap(library)``, or None with a
    warning naming ``fallback`` where ``agrees`` rejects its answers (strict mode:
    raises ``KernelBuildError``). A CPU known to lack the kernel's instructions builds
    nothing."""
    source = KERNELS[stem]
    known = cpu_flags()
    if known and any(flag not in known for flag in source.cpu_flag.split()):
        return None
    library = load_library(stem, what, fallback)
    supported = source.supported
    if library is None or (supported is not None and not getattr(library, supported)()):
        return None
    kernel = wrap(library)
    if not agrees(kernel):
        if strict():
            raise KernelBuildError(f"the {what} disagrees with torch here")
        logger.warning("the %s disagrees with torch here; %s runs instead, slower",
                       what, fallback)
        return None
    return kernel


def main() -> int:
    """Builds every kernel and prints each library, or why this CPU skips it; returns 1
    where one failed to build."""
    failed = 0
    for kernel in KERNELS.values():
        try:
            path = build(kernel.stem)
        except (OSError, subprocess.SubprocessError, KernelBuildError) as error:
            detail = (getattr(error, "stderr", "") or "").strip()
            print(f"{kernel.stem}: FAILED ({error}) {detail}")
            failed = 1
            continue
        library = ctypes.CDLL(str(path))
        if kernel.supported is not None and not getattr(library, kernel.supported)():
            print(f"{kernel.stem}: skipped, this CPU lacks {kernel.needs} ({path})")
        else:
            print(f"{kernel.stem}: built {path}")
    return failed


if __name__ == "__main__":
    sys.exit(main())
