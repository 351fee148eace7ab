"""A process of triollm's own ends without the interpreter's teardown once its work is
shut down (the CLI, engine processes, tensor-parallel ranks): its exit handlers still
run and what it wrote still arrives."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent("""
    import atexit, sys
    from pathlib import Path
    from triollm.process_exit import exit_without_teardown

    class Teardown:
        def __del__(self):
            Path(sys.argv[1], "teardown").write_text("ran")

    kept = Teardown()  # a module global: finalized only by the interpreter's teardown
    atexit.register(lambda: Path(sys.argv[1], "atexit").write_text("ran"))
    print("buffered output", end="")  # a pipe: block-buffered until flushed
    sys.stderr.write("and its errors")
    exit_without_teardown(int(sys.argv[2]))
    print("never reached")
""")


def test_exit_runs_handlers_flushes_and_skips_the_teardown(tmp_path: Path) -> None:
    for status in (0, 3):
        done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), str(status)],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == status
        assert done.stdout == "buffered output"
        assert done.stderr == "and its errors"
        assert (tmp_path / "atexit").read_text() == "ran"
        assert not (tmp_path / "teardown").exists()
        (tmp_path / "atexit").unlink()


def test_the_command_line_ends_through_it() -> None:
    import tomllib

    from triollm.cli import run

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert project["project"]["scripts"]["triollm"] == "triollm.cli:run"
    assert run.__module__ == "triollm.cli"
