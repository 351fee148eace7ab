"""The CPU thread policy: all usable cores on a quiet machine, fewer at once while other
processes keep cores busy, back only after the load has gone for two windows; a fixed
count or OMP_NUM_THREADS turns it off."""

from __future__ import annotations

import os
import time

import pytest

from triollm.model.cpu import helpers as cpu_helpers
from triollm.model.cpu import threads as cpu_threads
from triollm.model.cpu.threads import ComputeThreads, CpuTimes, read_cpu_times


class FakeMachine:
    """Two cores; ``others`` and ``ours`` are the cores each side keeps busy."""

    def __init__(self) -> None:
        self.wall = 0.0
        self.cores_busy = 0.0
        self.process = 0.0
        self.others = 0.0
        self.ours = 1.0
        self.set_calls: list[int] = []
        self.reads = 0

    def read(self, cores: frozenset[int]) -> CpuTimes:
        self.reads += 1
        return CpuTimes(self.cores_busy, self.process, self.wall)

    def clock(self) -> float:
        return self.wall

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.cores_busy += (self.others + self.ours) * seconds
        self.process += self.ours * seconds


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch) -> FakeMachine:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(cpu_threads.torch, "get_num_threads", lambda: 2)
    return FakeMachine()


def _policy(machine: FakeMachine, fixed: int | None = None) -> ComputeThreads:
    return ComputeThreads(fixed, read=machine.read, set_threads=machine.set_calls.append,
                          clock=machine.clock)


def test_a_quiet_machine_keeps_every_thread(machine: FakeMachine) -> None:
    policy = _policy(machine)
    machine.others = 0.3  # a light neighbour, below half a core
    for _ in range(20):
        machine.advance(0.1)
        assert policy.adjust() == 2
    assert machine.set_calls == []


def test_a_busy_neighbour_takes_a_thread_at_once_and_gives_it_back_slowly(
        machine: FakeMachine) -> None:
    policy = _policy(machine)
    machine.others = 1.0
    machine.advance(0.1)
    assert policy.adjust() == 2, "decided only once a window has passed"
    machine.advance(0.2)
    assert policy.adjust() == 1
    assert machine.set_calls == [1]
    assert policy.others_cores == pytest.approx(1.0)

    machine.others = 0.0
    machine.advance(0.3)
    assert policy.adjust() == 1, "one quiet window is not enough"
    machine.others = 1.0  # the neighbour comes back: the vote starts again
    machine.advance(0.3)
    assert policy.adjust() == 1
    machine.others = 0.0
    machine.advance(0.3)
    assert policy.adjust() == 1
    machine.advance(0.3)
    assert policy.adjust() == 2
    assert machine.set_calls == [1, 2]


def test_on_one_thread_the_kernels_get_helpers_for_the_cores_given_up(
        machine: FakeMachine) -> None:
    """cpu_helpers.py: the C kernels share units with helper threads that run when the
    busy cores give them a slice, only while torch computes on one thread."""
    cpu_helpers.set_spare_threads(5)
    try:
        policy = _policy(machine)
        assert cpu_helpers.spare_threads() == 0, "a new policy starts on OpenMP"
        machine.others = 1.0
        machine.advance(0.3)
        assert policy.adjust() == 1
        assert cpu_helpers.spare_threads() == 1
        machine.others = 0.0
        for _ in range(2):
            machine.advance(0.3)
            policy.adjust()
        assert policy.threads == 2
        assert cpu_helpers.spare_threads() == 0
        fixed = _policy(machine, fixed=1)
        assert fixed.threads == 1 and cpu_helpers.spare_threads() == 0
    finally:
        cpu_helpers.set_spare_threads(0)


def test_the_machine_is_read_once_per_window_not_once_per_step(
        machine: FakeMachine) -> None:
    policy = _policy(machine)
    assert machine.reads == 1
    for _ in range(100):  # steps of 10 ms: 1 s, four windows
        machine.advance(0.01)
        policy.adjust()
    assert machine.reads == 1 + 4


def test_every_core_busy_still_leaves_one_thread(machine: FakeMachine) -> None:
    policy = _policy(machine)
    machine.others = 2.0
    machine.advance(0.5)
    assert policy.adjust() == 1


def test_a_fixed_count_is_set_once_and_kept(machine: FakeMachine) -> None:
    policy = _policy(machine, fixed=2)
    assert machine.set_calls == [2]
    machine.others = 2.0
    machine.advance(1.0)
    assert policy.adjust() == 2
    assert machine.set_calls == [2]


def test_omp_num_threads_in_the_environment_turns_adapting_off(
        machine: FakeMachine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    policy = _policy(machine)
    machine.others = 2.0
    machine.advance(1.0)
    assert policy.adjust() == 2
    assert not policy.adaptive


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="reads Linux's /proc")
def test_the_cpu_times_of_this_process_and_its_cores_are_read() -> None:
    cores = frozenset(os.sched_getaffinity(0))
    before = read_cpu_times(cores)
    assert before is not None
    end = time.process_time() + 0.2
    while time.process_time() < end:
        pass
    after = read_cpu_times(cores)
    assert after is not None
    assert after.process - before.process >= 0.15
    assert after.cores_busy - before.cores_busy >= 0.15
    assert after.wall > before.wall


def test_for_a_compiled_model_the_count_steps_along_a_ladder(
        machine: FakeMachine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiled model is compiled once per thread count, so the policy keeps to powers
    of two and the most, rounding down."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(12)))
    monkeypatch.setattr(cpu_threads.torch, "get_num_threads", lambda: 12)
    policy = _policy(machine)
    assert policy.thread_counts() == list(range(1, 13))
    assert policy.ladder() == [1, 2, 4, 8, 12]
    policy.keep_to(policy.ladder())
    assert policy.thread_counts() == [1, 2, 4, 8, 12]
    machine.others = 5.0  # seven cores left
    machine.advance(0.3)
    assert policy.adjust() == 4
    assert machine.set_calls == [4]
    assert _policy(machine, fixed=3).thread_counts() == [3]
