"""Building the C kernels from ``triollm/csrc``: every source compiles without a warning
(the AVX-512 paths too, on any x86 CPU), a kernel the CPU supports that fails to build or
to agree with torch is an error in strict mode and a warning naming the slower path
otherwise, the process holds one helper pool and one OpenMP runtime, and the hand-run
build step reports every kernel."""

from __future__ import annotations

import ctypes
import logging
import platform
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from triollm.model.cpu import build as native_build
from triollm.model.cpu import decode as cpu_decode
from triollm.model.cpu import gemm as cpu_gemm
from triollm.model.cpu import gemm_avx2 as cpu_gemm_avx2
from triollm.model.cpu import varlen as cpu_varlen

AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16"]
on_x86 = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                            reason="the AVX-512 paths are x86 code")


def _compile(stem: str, flags: list[str]) -> None:
    try:
        native_build.compile_only(stem, [*flags, "-Werror"])
    except subprocess.CalledProcessError as error:
        pytest.fail(f"{stem}.c with {' '.join(flags)}:\n{error.stderr}")


@pytest.mark.parametrize(("stem", "variant"), [
    *((stem, []) for stem in ["pool", *native_build.KERNELS]),
    ("decode", ["-DTRIOLLM_PORTABLE"])])  # the path CPUs without AVX-512 run
def test_every_source_compiles_without_a_warning(stem: str, variant: list[str]) -> None:
    _compile(stem, [*native_build.FLAGS, *variant])


@on_x86
@pytest.mark.parametrize("stem", ["pool", *native_build.KERNELS])
def test_the_avx512_paths_compile_without_a_warning_on_any_x86(stem: str) -> None:
    """This CPU may lack AVX-512: compiled for it anyway (and not run), the vector paths
    are checked too."""
    _compile(stem, [*native_build.FLAGS, *AVX512])


def _failing_compiler(tmp_path: Path) -> Path:
    """A ``cc`` that answers ``--version`` and fails every build."""
    script = tmp_path / "broken-cc"
    script.write_text('#!/bin/sh\n[ "$1" = --version ] && { echo broken 1.0; exit 0; }\n'
                      'echo "error: this compiler builds nothing" >&2\nexit 1\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def _claim_every_instruction(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a CPU with AVX-512, AVX512-BF16, AVX2 and FMA, which builds every kernel."""
    flags = native_build.cpu_flags() | {"avx512f", "avx512_bf16", "avx2", "fma"}
    monkeypatch.setattr(native_build, "cpu_flags", lambda: flags)


def test_a_cpu_without_a_kernels_instructions_does_not_build_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not an error, even in strict mode with a compiler that fails: there is nothing
    this CPU could run."""
    flags = native_build.cpu_flags() - {"avx512f", "avx512_bf16", "fma"} | {"sse2"}
    monkeypatch.setattr(native_build, "cpu_flags", lambda: flags)
    monkeypatch.setenv("TRIOLLM_STRICT_KERNELS", "1")
    monkeypatch.setenv("TRIOLLM_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(_failing_compiler(tmp_path)))
    for load in (cpu_gemm.load_gemm, cpu_gemm_avx2.load_avx2_gemm,
                 cpu_varlen.load_varlen_kernel):
        load.cache_clear()
        try:
            assert load() is None
        finally:
            load.cache_clear()
    assert not list(tmp_path.rglob("*.so"))


@pytest.mark.parametrize("load", [cpu_decode.load_kernel, cpu_gemm.load_gemm,
                                  cpu_gemm_avx2.load_avx2_gemm,
                                  cpu_varlen.load_varlen_kernel],
                         ids=["decode", "gemm", "gemm_avx2", "varlen"])
def test_a_kernel_that_fails_to_build_is_an_error_in_strict_mode(
        load: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU that has what each kernel needs."""
    _claim_every_instruction(monkeypatch)
    monkeypatch.setenv("TRIOLLM_STRICT_KERNELS", "1")
    monkeypatch.setenv("TRIOLLM_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(_failing_compiler(tmp_path)))
    load.cache_clear()
    try:
        with pytest.raises(native_build.KernelBuildError, match="builds nothing"):
            load()
    finally:
        load.cache_clear()


def test_a_kernel_that_fails_to_build_warns_naming_the_slower_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    _claim_every_instruction(monkeypatch)
    monkeypatch.delenv("TRIOLLM_STRICT_KERNELS", raising=False)
    monkeypatch.setenv("TRIOLLM_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(_failing_compiler(tmp_path)))
    cpu_gemm.load_gemm.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=native_build.__name__):
            assert cpu_gemm.load_gemm() is None
    finally:
        cpu_gemm.load_gemm.cache_clear()
    assert "building the bf16 GEMM kernel failed" in caplog.text
    assert "oneDNN's packed bf16 linear runs instead" in caplog.text


def test_a_kernel_that_disagrees_with_torch_is_an_error_in_strict_mode_else_a_warning(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A corrupted answer (the load-time check rejects it) on the decode kernel, which
    every CPU with a compiler runs."""
    monkeypatch.setattr(cpu_decode, "_agrees_with_torch", lambda kernel: False)
    cpu_decode.load_kernel.cache_clear()
    try:
        monkeypatch.setenv("TRIOLLM_STRICT_KERNELS", "1")
        with pytest.raises(native_build.KernelBuildError, match="disagrees"):
            cpu_decode.load_kernel()
        monkeypatch.delenv("TRIOLLM_STRICT_KERNELS")
        with caplog.at_level(logging.WARNING, logger=native_build.__name__):
            assert cpu_decode.load_kernel() is None
    finally:
        cpu_decode.load_kernel.cache_clear()
    assert ("the CPU decode attention kernel disagrees with torch here; torch's decode "
            "attention (compiled, else gathering) runs instead") in caplog.text


def test_a_compiler_warning_is_an_error_in_strict_mode(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A build that succeeds but prints a warning."""
    script = tmp_path / "warning-cc"
    script.write_text('#!/bin/sh\n[ "$1" = --version ] && { echo warns 1.0; exit 0; }\n'
                      'echo "warning: unused variable" >&2\nexec cc "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("TRIOLLM_STRICT_KERNELS", "1")
    monkeypatch.setenv("TRIOLLM_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(script))
    with pytest.raises(native_build.KernelBuildError, match="unused variable"):
        native_build.build("varlen")


def _mapped(fragment: str) -> set[str]:
    """The files mapped into this process whose name holds ``fragment``."""
    lines = Path("/proc/self/maps").read_text().splitlines()
    return {line.split()[-1] for line in lines
            if len(line.split()) > 5 and fragment in Path(line.split()[-1]).name}


def _address(library: ctypes.CDLL, name: str) -> int | None:
    return ctypes.cast(getattr(library, name), ctypes.c_void_p).value


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/maps")
def test_the_kernels_share_one_pool_and_torchs_openmp_runtime() -> None:
    """The decode kernel as built and as built portable, and the GEMM library: one pool
    library, one pool to drain, and OpenMP from the runtime torch ships (what the
    kernels' ``GOMP_parallel`` resolves to is torch's; other libraries in the process,
    scikit-learn say, may bring their own)."""
    libraries = [ctypes.CDLL(str(cpu_decode._build(portable))) for portable in (False, True)]
    cpu_decode.CpuDecodeKernel(libraries[0])
    cpu_decode.CpuDecodeKernel(libraries[1])
    cpu_gemm.CpuGemm(ctypes.CDLL(str(native_build.build("gemm"))))
    assert len(_mapped("libtriollm_pool_")) == 1
    runtime = native_build._openmp_link()[0]
    if runtime == "-fopenmp":
        pytest.skip("torch ships no libgomp of its own here")
    torchs = _address(ctypes.CDLL(runtime), "GOMP_parallel")
    assert all(_address(library, "GOMP_parallel") == torchs for library in libraries)


def test_the_build_step_reports_every_kernel(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m triollm.model.cpu.build``: built, or skipped for the instructions
    this CPU lacks."""
    assert native_build.main() == 0
    lines = capsys.readouterr().out.splitlines()
    assert sorted(line.partition(":")[0] for line in lines) == sorted(native_build.KERNELS)
    flags = native_build.cpu_flags()
    runs = {"decode": True, "gemm": "avx512_bf16" in flags,
            "gemm_avx2": {"avx2", "fma"} <= flags, "varlen": "avx512f" in flags,
            "qgemm_avx2": {"avx2", "fma", "f16c"} <= flags,
            "qgemm_avx512": {"avx512f", "avx512bw"} <= flags,
            "qgemm_vnni": {"avx512f", "avx512bw", "avx512vl", "avx512vbmi",
                           "avx512_vnni"} <= flags}
    for line in lines:
        stem, _, said = line.partition(": ")
        assert said.startswith("built" if runs[stem] else "skipped, this CPU lacks"), line
