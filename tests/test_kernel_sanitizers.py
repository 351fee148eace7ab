"""The helper pool, the decode kernel and the int4/int8 kernels under ThreadSanitizer
and under AddressSanitizer with UndefinedBehaviorSanitizer: ``tests/csrc/pool_driver.c``
runs jobs on helpers (two callers at once, helpers that stall so the caller takes their
units back, drains) and decode attention on the pool against its OpenMP entry point;
``tests/csrc/qgemm_driver.c`` runs both quantized layouts of each int4/int8 kernel
(AVX2's, AVX-512's and VNNI's, where the CPU has it) on stalling helpers against
one OpenMP thread and an exact product. Each must give the right answers and the
sanitizer must report nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from triollm.model.cpu.build import CSRC

DRIVERS = Path(__file__).parent / "csrc"


def _compiler() -> str:
    return os.environ.get("CC", "cc")


def _has_runtime(sanitizer: str, work: Path) -> bool:
    """Whether the compiler links and runs a program with ``-fsanitize=sanitizer``."""
    probe = work / "probe.c"
    probe.write_text("int main(void) { return 0; }\n")
    try:
        built = subprocess.run([_compiler(), f"-fsanitize={sanitizer}", str(probe), "-o",
                                str(work / "probe")], capture_output=True, timeout=120)
    except FileNotFoundError:  # no compiler: the kernel build tests fail on that loudly
        return False
    return built.returncode == 0 and subprocess.run(
        [str(work / "probe")], capture_output=True, timeout=60).returncode == 0


@pytest.mark.skipif(sys.platform != "linux", reason="the pool has helpers on Linux only")
@pytest.mark.parametrize("sanitizer", ["thread", "address,undefined"])
@pytest.mark.parametrize(("driver", "kernel"), [
    ("pool_driver.c", "decode.c"), ("qgemm_driver.c", "qgemm_avx2.c"),
    ("qgemm_driver.c", "qgemm_avx512.c"), ("qgemm_driver.c", "qgemm_vnni.c")],
    ids=["decode", "qgemm_avx2", "qgemm_avx512", "qgemm_vnni"])
def test_the_pool_and_a_kernel_run_clean_under_a_sanitizer(
        sanitizer: str, driver: str, kernel: str, tmp_path: Path) -> None:
    if not _has_runtime(sanitizer, tmp_path):
        pytest.skip(f"the C compiler has no -fsanitize={sanitizer} runtime here")
    program = tmp_path / "driver"
    subprocess.run(
        [_compiler(), "-O1", "-g", "-march=native", "-fno-omit-frame-pointer",
         f"-fsanitize={sanitizer}", "-fno-sanitize-recover=all", "-fopenmp", "-std=c11",
         "-Wall", "-Wextra", "-Werror", f"-I{CSRC}", f"-DQGEMM=triollm_{Path(kernel).stem}",
         f"-DINT8_WIDTHS={8 if kernel == 'qgemm_vnni.c' else 2}", str(DRIVERS / driver),
         str(CSRC / "pool.c"), str(CSRC / kernel), "-lm", "-o", str(program)],
        check=True, capture_output=True, text=True, timeout=300)
    environment = {**os.environ, "TSAN_OPTIONS": "halt_on_error=1 exitcode=66",
                   "ASAN_OPTIONS": "detect_leaks=1 exitcode=66"}
    done = subprocess.run([str(program)], capture_output=True, text=True, timeout=120,
                          env=environment)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr
    assert "Sanitizer" not in done.stderr and "runtime error" not in done.stderr, done.stderr
