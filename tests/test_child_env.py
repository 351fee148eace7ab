"""The environment triollm's own compute processes start with (triollm/child_env.py)."""

from __future__ import annotations

import os
import time

import psutil
import pytest

import triollm
from triollm.child_env import OPENMP_SPIN_COUNT, child_environment_settings
from triollm.engine.process.launch import PrestartedEngines


def test_a_child_spins_briefly_and_imports_this_triollm() -> None:
    settings = child_environment_settings({"PYTHONPATH": "/elsewhere"})
    assert settings["GOMP_SPINCOUNT"] == str(OPENMP_SPIN_COUNT)
    first, rest = settings["PYTHONPATH"].split(os.pathsep)
    assert os.path.dirname(triollm.__file__) == os.path.join(first, "triollm")
    assert rest == "/elsewhere"


@pytest.mark.parametrize("given", [{"GOMP_SPINCOUNT": "300000"},
                                   {"OMP_WAIT_POLICY": "ACTIVE"}])
def test_a_users_own_openmp_wait_setting_is_kept(given: dict[str, str]) -> None:
    assert "GOMP_SPINCOUNT" not in child_environment_settings(given)


def test_an_engine_process_starts_with_the_child_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    with PrestartedEngines([None]) as prestarted:
        environ = _environment_once_exec_has_set_it(prestarted.pids[0])
    assert environ["GOMP_SPINCOUNT"] == str(OPENMP_SPIN_COUNT)


def _environment_once_exec_has_set_it(pid: int) -> dict[str, str]:
    # Popen returns once the kernel has swapped the child's memory for the new
    # program's, a moment before exec writes its environment: /proc reads empty then.
    deadline = time.monotonic() + 30
    while not (environ := psutil.Process(pid).environ()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return environ
