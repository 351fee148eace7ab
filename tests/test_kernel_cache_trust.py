"""A library planted in the kernel cache under the name build.py predicts is refused and
never loaded: the cache is trusted as ssh trusts its files (model/cpu/private_cache.py)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from triollm.model.cpu import build as native_build

FOREIGN_UID = 12345

PLANTED = """
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *marker = fopen(MARKER, "w");
    if (marker) { fputs("the planted library ran", marker); fclose(marker); }
}
"""

needs_cc = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None,
                              reason="needs a C compiler")


def plant(library: Path, marker: Path) -> None:
    """A library whose constructor writes ``marker`` when it is loaded."""
    source = library.parent.parent / "planted.c"
    source.write_text(PLANTED)
    subprocess.run([os.environ.get("CC", "cc"), "-shared", "-fPIC", f'-DMARKER="{marker}"',
                    str(source), "-o", str(library)], check=True, timeout=120)


def group_writable_directory(kernels: Path, library: Path) -> None:
    kernels.chmod(0o775)


def world_writable_directory(kernels: Path, library: Path) -> None:
    kernels.chmod(0o777)


def sticky_world_writable_directory(kernels: Path, library: Path) -> None:
    kernels.chmod(0o1777)  # others cannot rename our files, but can plant new ones


def world_writable_library(kernels: Path, library: Path) -> None:
    library.chmod(0o777)


def group_writable_cache_root(kernels: Path, library: Path) -> None:
    kernels.parent.chmod(0o775)  # $TRIOLLM_CACHE: others may swap kernels/ for theirs


def library_behind_a_link(kernels: Path, library: Path) -> None:
    elsewhere = kernels.parent / "elsewhere.so"
    library.rename(elsewhere)
    library.symlink_to(elsewhere)


def foreign_library(kernels: Path, library: Path) -> None:
    os.chown(library, FOREIGN_UID, FOREIGN_UID)


def foreign_directory(kernels: Path, library: Path) -> None:
    os.chown(kernels, FOREIGN_UID, FOREIGN_UID)


PLANTS: list[Callable[[Path, Path], None]] = [
    group_writable_directory, world_writable_directory, sticky_world_writable_directory,
    world_writable_library, group_writable_cache_root, library_behind_a_link,
    foreign_library, foreign_directory]
PLANTS_IN_THE_DIRECTORY = {world_writable_library, library_behind_a_link, foreign_library}


def planted_cache(tmp_path: Path, how: Callable[[Path, Path], None]) -> tuple[Path, Path]:
    """$TRIOLLM_CACHE with the helper pool's predicted library planted, made untrusted
    by ``how``; the cache and the marker its constructor would write."""
    if how in (foreign_library, foreign_directory) and os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    cache = tmp_path / "cache"
    kernels = cache / "kernels"
    kernels.mkdir(parents=True, mode=0o700)
    cache.chmod(0o700)
    marker = tmp_path / "marker"
    library = kernels / native_build.pool_name()
    plant(library, marker)
    library.chmod(0o700)
    how(kernels, library)
    return cache, marker


def load_in_a_process(cache: Path, strict: bool, code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TRIOLLM_CACHE": str(cache),
           "TRIOLLM_STRICT_KERNELS": "1" if strict else "0"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=600)


#: Builds and loads the decode kernel and the helper pool, as the engine does; prints
#: where the kernel came from, and the modes and owners of both libraries.
LOAD_DECODE = """
import ctypes, os
from pathlib import Path
from triollm.model.cpu import build
path = build.build("decode")
ctypes.CDLL(str(path))
pool = Path(build.load_pool()._name)
print(path, *(f"{os.stat(p).st_mode & 0o7777:o}:{os.stat(p).st_uid}" for p in (path, pool)))
"""


@needs_cc
@pytest.mark.parametrize("how", PLANTS, ids=lambda how: how.__name__)
def test_strict_mode_refuses_a_planted_library_naming_it(
        how: Callable[[Path, Path], None], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    cache, marker = planted_cache(tmp_path, how)
    monkeypatch.setenv("TRIOLLM_CACHE", str(cache))
    monkeypatch.setenv("TRIOLLM_STRICT_KERNELS", "1")
    with pytest.raises(native_build.KernelBuildError, match="not safe to load") as raised:
        native_build.build("decode")
    assert str(cache) in str(raised.value)
    assert not marker.exists()
    # The plant works: loaded, it runs.
    planted = cache / "kernels" / native_build.pool_name()
    proof = load_in_a_process(cache, True, f"import ctypes; ctypes.CDLL({str(planted)!r})")
    assert proof.returncode == 0, proof.stderr
    assert marker.read_text() == "the planted library ran"


@needs_cc
@pytest.mark.parametrize("how", [world_writable_directory, world_writable_library],
                         ids=lambda how: how.__name__)
def test_otherwise_a_warning_names_it_and_a_private_build_is_loaded(
        how: Callable[[Path, Path], None], tmp_path: Path) -> None:
    cache, marker = planted_cache(tmp_path, how)
    done = load_in_a_process(cache, False, LOAD_DECODE)
    assert done.returncode == 0, done.stderr
    assert "not safe to load" in done.stderr and str(cache) in done.stderr
    assert not marker.exists()
    path, *modes = done.stdout.split()
    loaded = Path(path)
    assert modes == [f"700:{os.geteuid()}"] * 2
    if how in PLANTS_IN_THE_DIRECTORY:  # the directory is ours: the library is replaced
        assert loaded.parent == cache / "kernels"
    else:  # nothing in that directory is used
        assert not loaded.is_relative_to(cache)


def test_a_new_cache_is_private(tmp_path: Path) -> None:
    from triollm.model.cpu.private_cache import make_private_directory, untrusted_directory

    previous = os.umask(0o002)  # a umask that would make directories group-writable
    try:
        make_private_directory(tmp_path / "a" / "b" / "kernels")
    finally:
        os.umask(previous)
    for directory in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "kernels"):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert untrusted_directory(tmp_path / "a" / "b" / "kernels") is None
