"""ruff (with the ASYNC rules) and mypy stay clean, and every module fits on a screen;
CI runs them through this suite."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "triollm"

#: The most lines one module under src/ may have: one concept, readable in one sitting.
MAX_MODULE_LINES = 450


#: Every source file under src/: the Python modules and the C kernels' sources.
SOURCES = sorted(p.relative_to(SRC).as_posix() for pattern in ("*.py", "*.c", "*.h")
                 for p in SRC.rglob(pattern))


def test_the_size_check_sees_the_sources() -> None:
    assert len(SOURCES) > 100 and "csrc/decode.c" in SOURCES


@pytest.mark.parametrize("path", SOURCES)
def test_no_module_is_over_the_size_limit(path: str) -> None:
    """Each file is checked on its own, so a failure names the file to split."""
    lines = len((SRC / path).read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, (
        f"src/triollm/{path} has {lines} lines (limit {MAX_MODULE_LINES}): split it along "
        f"its seams")


def test_the_module_map_names_every_module() -> None:
    """docs/architecture.md's module map stays true to the code: each module is named
    there (packages' ``__init__.py`` files that only re-export are exempt)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    missing = [path for path in SOURCES
               if path.endswith(".py") and f"`{path}`" not in text
               and not (path.endswith("__init__.py") and path != "__init__.py")]
    assert missing == []


def test_ruff_is_clean() -> None:
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "src", "tests",
                             "benchmarks", "scripts"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_is_clean() -> None:
    result = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr
