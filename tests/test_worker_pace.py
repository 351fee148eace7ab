"""A worker process's call past its client's allowance runs at the client's share of a
core (server/worker_pace.py): measured on real busy processes, one or two of a client's
at once, and through ``Offload``, whose paced call leaves its place in the pool to
others. A pace that ends leaves its process running."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial

import anyio
import pytest

from triollm.server.client_budget import ALLOWANCE_SECONDS, ClientBudget, RequestWork, track_work
from triollm.server.offload import Offload
from triollm.server.tokenizer_process import cpu_seconds
from triollm.server.worker_pace import CallAbandoned, WorkerPace
from triollm.testing import train_test_tokenizer

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/stat"),
                                reason="reads a process's CPU time from /proc")


def state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


@pytest.fixture
def busy() -> Iterator[list[int]]:
    """Two processes that compute for ever."""
    processes = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                 for _ in range(2)]
    yield [process.pid for process in processes]
    for process in processes:
        process.kill()
        process.wait()


def past_allowance(share: float) -> RequestWork:
    budget = ClientBudget(share)
    budget.charge("a", share * ALLOWANCE_SECONDS)
    return RequestWork(budget=budget, client="a")


def answered_after(seconds: float) -> Callable[[float], bool]:
    """An ``answered`` that says no (after waiting as asked) until ``seconds`` pass."""
    deadline = time.monotonic() + seconds

    def answered(timeout: float) -> bool:
        time.sleep(max(0.0, min(timeout, deadline - time.monotonic())))
        return time.monotonic() >= deadline
    return answered


def pace_for(pace: WorkerPace, seconds: float, *calls: tuple[int, RequestWork | None]
             ) -> list[float]:
    """Pace each (pid, work) in a thread of its own until an answer comes after
    ``seconds``; the CPU each process used meanwhile."""
    before = [cpu_seconds(pid) for pid, _ in calls]
    threads = [threading.Thread(target=pace.wait, args=(pid, answered_after(seconds), work),
                                kwargs={"abandoned": threading.Event()})
               for pid, work in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [cpu_seconds(pid) - used for (pid, _), used in zip(calls, before, strict=True)]


def test_a_call_past_its_allowance_runs_at_its_clients_share(busy: list[int]) -> None:
    work = past_allowance(0.2)
    [used] = pace_for(WorkerPace(), 2.0, (busy[0], work))
    assert used < 0.2 * 2.0 + 0.15
    assert work.paced_seconds == pytest.approx(used, abs=0.2)
    assert state(busy[0]) != "T"  # left running
    before = cpu_seconds(busy[0])
    time.sleep(0.5)
    assert cpu_seconds(busy[0]) - before > 0.1


def test_a_clients_calls_at_once_share_its_share(busy: list[int]) -> None:
    budget = ClientBudget(0.2)
    budget.charge("a", 0.2 * ALLOWANCE_SECONDS)
    used = pace_for(WorkerPace(), 2.0, *[(pid, RequestWork(budget=budget, client="a"))
                                         for pid in busy])
    assert sum(used) < 0.2 * 2.0 + 0.15
    assert all(state(pid) != "T" for pid in busy)


def test_a_call_within_its_allowance_runs_at_full_speed_for_what_is_left(
        busy: list[int]) -> None:
    """A client that owes nothing has the allowance's CPU (2 s at 0.25 of a core: 0.5 s)
    at full speed, then its share."""
    work = RequestWork(budget=ClientBudget(0.25), client="b")
    [used] = pace_for(WorkerPace(), 1.5, (busy[0], work))
    # it ran freely for a while before its pace began (how much CPU that was depends on
    # what else shares the cores): paced from the start, this would be about 0
    assert used - work.paced_seconds > 0.05
    assert used < 0.5 + 0.25 * 1.0 + 0.15


def test_outside_a_request_nothing_is_paced(busy: list[int]) -> None:
    used = pace_for(WorkerPace(), 1.0, (busy[0], None), (busy[1], RequestWork()))
    assert sum(used) > 0.5  # neither was stopped (the cores may be shared)


def test_an_abandoned_wait_raises_and_leaves_the_process_running(busy: list[int]) -> None:
    abandoned = threading.Event()
    raised: list[BaseException] = []

    def wait() -> None:
        try:
            WorkerPace().wait(busy[0], answered_after(60), past_allowance(0.01),
                              abandoned=abandoned)
        except CallAbandoned as error:
            raised.append(error)

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.5)  # well into its pace: stopped most of the time
    abandoned.set()
    thread.join(5)
    assert not thread.is_alive() and raised
    assert state(busy[0]) != "T"


@pytest.mark.anyio
async def test_a_paced_call_leaves_its_place_in_the_pool_to_others() -> None:
    """With one worker process, a slow client's long text paced at a tenth of a core
    does not keep another request's long text waiting behind it."""
    offload = Offload(train_test_tokenizer(), processes=1, long_text=1000)
    slow = past_allowance(0.1)
    long_text = "hello world " * 40_000
    finished: list[str] = []

    async def encode(name: str, work: RequestWork | None, text: str) -> None:
        if work is not None:
            track_work(work)
        await offload.encode_json(text, False)
        finished.append(name)

    with anyio.fail_after(120):
        await offload.encode_json("warm " * 300, False)  # the process is started
        async with anyio.create_task_group() as group:
            group.start_soon(encode, "slow", slow, long_text)
            await anyio.sleep(0.2)
            group.start_soon(encode, "other", None, "hello " * 300)
    assert finished == ["other", "slow"]
    assert slow.paced_seconds > 0
    assert slow.worker_seconds > 0


@pytest.mark.anyio
async def test_a_paced_tokenizer_process_gets_its_share_while_every_core_is_busy(
        busy: list[int]) -> None:
    """Paced, the worker is what holds it back: beside processes that keep every core
    busy (as the model does), it still gets about its share of one (a worker at a lower
    priority would get next to nothing in its slices)."""
    offload = Offload(train_test_tokenizer(), long_text=1000)
    with anyio.fail_after(60):
        await offload.encode_json("warm " * 300, False)  # the process is started
    [worker] = offload._workers

    work = past_allowance(0.2)

    async def encode() -> None:
        track_work(work)  # in this task's own context
        await offload.encode_json("hello world " * 100_000, False)

    before = cpu_seconds(worker.pid)
    with anyio.fail_after(120):
        async with anyio.create_task_group() as group:
            group.start_soon(encode)
            await anyio.sleep(3.0)
            used = cpu_seconds(worker.pid) - before
            group.cancel_scope.cancel()
    # at least a fifth of the share, with other tests' processes on the cores too
    assert 0.2 * 3.0 * 0.2 < used < 0.2 * 3.0 + 0.3


@pytest.mark.anyio
async def test_a_cancelled_call_ends_its_process_at_once_and_its_client_pays() -> None:
    """A request cancelled (its client gone) while a worker process computes for it
    does not wait for it: the process is killed, and the CPU it used is charged."""
    offload = Offload(train_test_tokenizer(), long_text=1000)
    with anyio.fail_after(60):
        await offload.encode_json("warm " * 300, False)  # the process is started
    [worker] = offload._workers
    work = RequestWork(budget=ClientBudget(0.5), client="c")  # 1 s of CPU at full speed

    async def encode() -> None:
        track_work(work)
        await offload.encode_json("hello world " * 2_000_000, False)  # about 10 s

    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            group.start_soon(encode)
            await anyio.sleep(1.0)
            group.cancel_scope.cancel()
    # the thread, which the cancelled call did not wait for, kills it and gives it up
    for _ in range(100):
        if worker not in offload._workers:
            break
        await anyio.sleep(0.05)
    assert worker.broken
    assert worker._process.poll() is not None
    assert work.budget is not None and work.budget.behind("c") > 0.5
    # the next call starts a process of its own
    with anyio.fail_after(60):
        assert (await offload.encode_json("hello " * 300, False))[0] > 0


def test_a_worker_stopped_when_its_server_dies_is_ended() -> None:
    """A server killed while its worker is stopped leaves no stopped process behind:
    the worker's own process group is orphaned, and the kernel hangs it up."""
    script = (
        "import os, pickle, signal, time\n"
        "from triollm.server.tokenizer_process import TokenizerProcess\n"
        "from triollm.testing import train_test_tokenizer\n"
        "worker = TokenizerProcess(pickle.dumps(train_test_tokenizer()))\n"
        "print(worker.pid, flush=True)\n"
        "os.kill(worker.pid, signal.SIGSTOP)\n"
        "time.sleep(0.2)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    pid = int(done.stdout.split()[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if state(pid) in ("Z", "X"):
                return
        except FileNotFoundError:
            return
        time.sleep(0.1)
    os.kill(pid, 9)
    raise AssertionError(f"the worker {pid} outlived its server, state {state(pid)}")


@pytest.mark.anyio
async def test_a_clients_calls_beyond_its_turns_wait_and_nothing_is_left_after_cancel(
        ) -> None:
    """A client's third long text at once waits for one of its two turns (paced calls
    give up their pool places, so without turns one client could start a process per
    connection); cancelled, every call ends and no turn or paced call is left over."""
    from triollm.server.limits import MOST_CALLS_PER_CLIENT

    offload = Offload(train_test_tokenizer(), processes=4, long_text=1000)
    work = past_allowance(0.02)

    async def encode() -> None:
        track_work(work)
        await offload.encode_json("hello world " * 400_000, False)

    with anyio.fail_after(90):
        async with anyio.create_task_group() as group:
            for _ in range(MOST_CALLS_PER_CLIENT + 1):
                group.start_soon(encode)
            most = 0
            for _ in range(300):  # until the processes have started and are paced
                most = max(most, offload._pace.paced_now)
                if most == MOST_CALLS_PER_CLIENT:
                    break
                await anyio.sleep(0.1)
            await anyio.sleep(0.5)
            most = max(most, offload._pace.paced_now)
            assert offload._turns["a"].users == MOST_CALLS_PER_CLIENT + 1
            assert most == MOST_CALLS_PER_CLIENT  # the third waits for a turn
            group.cancel_scope.cancel()
    assert offload._turns == {}
    for _ in range(100):  # the calls' threads end their processes as they notice
        if not offload._pace.paced_now and all(w.broken for w in offload._workers):
            break
        await anyio.sleep(0.05)
    assert offload._pace.paced_now == 0


def test_a_call_is_waited_for_on_a_pipe_past_selects_limit() -> None:
    """With the server's descriptors past 1023 (a thousand connections open), waiting
    for a worker's answer still works (``select`` cannot watch such a descriptor)."""
    import pickle
    import resource

    from triollm.server.tokenizer_process import TokenizerProcess

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip("cannot open 1200 files here")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        worker = TokenizerProcess(pickle.dumps(train_test_tokenizer()))
        try:
            assert worker._process.stdout is not None
            assert worker._process.stdout.fileno() > 1023
            wait = partial(WorkerPace().wait, work=None, abandoned=threading.Event())
            count, _ = worker.call("encode_json", "hello world " * 100, False, wait=wait)
            assert count > 0
        finally:
            worker.close()
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
