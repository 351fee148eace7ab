"""The compile process's lifetime (runners/compile_process.py), with stand-in children:
stopping ends its whole process group and reaps it; a failed child, or one that built
another key, is a warning with its last lines; a child outlives neither its parent's
crash nor the engine (closed mid-compile, or dead after a failed step)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import anyio
import pytest
import torch

from triollm import AsyncEngineArgs, AsyncLLMEngine, SamplingParams
from triollm.config import EngineConfig
from triollm.errors import EngineDeadError
from triollm.model.runners import background_compile, compile_process, torch_runner

JOB = compile_process.CompileJob(cast(EngineConfig, None), [1], torch.float32, "the-key")


def sleeper(pids: Path) -> list[str]:
    """A stand-in child: reads its job, starts a grandchild, writes both pids to ``pids``
    and sleeps."""
    script = f"""
        import os, subprocess, sys, time
        sys.stdin.buffer.read()
        grandchild = subprocess.Popen(["sleep", "60"])
        with open({str(pids)!r} + ".part", "w") as file:
            file.write(f"{{os.getpid()}} {{grandchild.pid}}")
        os.rename({str(pids)!r} + ".part", {str(pids)!r})
        time.sleep(60)
    """
    return [sys.executable, "-c", textwrap.dedent(script)]


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def eventually(condition: Callable[[], bool], seconds: float = 20.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def read_pids(path: Path) -> list[int]:
    assert eventually(path.exists)
    return [int(pid) for pid in path.read_text().split()]


def test_stopping_ends_the_child_and_what_it_started(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    assert not compile_process.run_compile_process(JOB, pids.exists, sleeper(pids))
    child, grandchild = read_pids(pids)
    assert gone(child)
    assert eventually(lambda: gone(grandchild))


@pytest.mark.parametrize(("script", "message"), [
    ("import sys; sys.stdin.buffer.read(); print('WARNING\\tx\\tno compiler here'); "
     "sys.exit(4)", "exit code 4"),
    ("import sys; sys.stdin.buffer.read(); "
     f"print({compile_process.RESULT_PREFIX!r} + '{{\"key\": \"other\", \"compiled\": true}}')",
     "built another model (key other, not the-key)"),
])
def test_a_child_that_fails_or_built_another_key_is_a_warning(
        script: str, message: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=compile_process.__name__):
        assert not compile_process.run_compile_process(
            JOB, lambda: False, [sys.executable, "-c", script])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(message in text for text in warnings), warnings
    if "no compiler" in script:  # its line came at its level, and closes the warning
        assert "compile process: no compiler here" in warnings
        assert warnings[-1].endswith("no compiler here")


_CRASHING_PARENT = """
import sys, torch
from triollm.model.runners import compile_process
job = compile_process.CompileJob(None, [1], torch.float32, "key")
child = ("import os, sys, time; from triollm.model.runners.compile_process import "
         "die_with_parent; sys.stdin.buffer.read(); die_with_parent(os.getppid()); "
         f"open({sys.argv[1]!r} + '.part', 'w').write(str(os.getpid())); "
         f"os.rename({sys.argv[1]!r} + '.part', {sys.argv[1]!r}); time.sleep(60)")
compile_process.run_compile_process(job, lambda: False, [sys.executable, "-c", child])
"""


def test_a_child_dies_with_its_parent(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    parent = subprocess.Popen([sys.executable, "-c", _CRASHING_PARENT, str(pids)])
    try:
        [child] = read_pids(pids)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        assert eventually(lambda: gone(child))
    finally:
        parent.kill()
        parent.wait()


@pytest.mark.anyio
@pytest.mark.parametrize("end", ["close", "crash"])
async def test_the_engine_leaves_no_compile_process(
        end: str, llama_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pids = tmp_path / "pids"
    monkeypatch.setattr(background_compile, "has_artifacts", lambda directory, counts: False)
    monkeypatch.setattr(compile_process, "child_command", lambda: sleeper(pids))
    if end == "crash":
        def broken(*args: Any) -> Any:
            raise RuntimeError("the step broke")
        monkeypatch.setattr(torch_runner.TorchModelRunner, "execute_model", broken)
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(
        model=str(llama_path), dtype="float32", max_model_len=128,
        num_gpu_blocks_override=256, optimization_level=2, cpu_threads=1))
    with (pytest.raises(RuntimeError, match="the step broke") if end == "crash"
          else contextlib.nullcontext()):
        async with engine:
            child, grandchild = await anyio.to_thread.run_sync(read_pids, pids)
            if end == "crash":
                with pytest.raises(EngineDeadError):
                    async for _ in engine.generate("Hello", SamplingParams(max_tokens=2),
                                                   "r"):
                        pass
                await anyio.sleep_forever()
    assert gone(child)
    assert eventually(lambda: gone(grandchild))
