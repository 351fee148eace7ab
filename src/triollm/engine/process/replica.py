"""One engine process, seen from the server: ``EngineReplica``.

``run`` starts the process (or takes the one started for it), sends its
``EngineSetup``, waits for ``Ready``, reports started, then reads its messages until it
ends, handing each step's outputs to the client (``ReplicaSink``). Messages to it are
queued without waiting (``send``) and written by one task, in order. The replica is
dead, and ``run`` raises ``EngineDeadError``, when the process exits, or sends nothing
for ``heartbeat_timeout`` seconds once ready (it is then killed: a hung engine); the
sink hears of it first, so every open stream fails before anything is cancelled. On
every way out the socket is closed and the process stopped and reaped
(engine/process/launch.py)."""

from __future__ import annotations

import itertools
import math
import socket
import subprocess
from typing import NoReturn, Protocol

import anyio
import anyio.abc

from triollm.engine.process.launch import start_engine_process, stop_engine_process
from triollm.engine.process.protocol import (
    AddFailed,
    Call,
    EngineFailed,
    EngineSetup,
    FrameReader,
    Ready,
    Reply,
    StepOutputs,
    frame,
)
from triollm.engine.stats import EngineStatistics
from triollm.errors import EngineDeadError

__all__ = ["DEFAULT_HEARTBEAT_TIMEOUT", "EngineReplica", "ReplicaSink"]

#: Seconds without a message from a ready engine process before it counts as hung.
DEFAULT_HEARTBEAT_TIMEOUT = 10.0


class ReplicaSink(Protocol):
    """Where a replica hands what its process sends."""

    def step(self, index: int, outputs: StepOutputs) -> None: ...

    def add_failed(self, seq: int, error: BaseException) -> None: ...

    def replica_died(self, index: int, error: EngineDeadError) -> None: ...


class _PendingCall:
    __slots__ = ("done", "reply")

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.reply: Reply | None = None


class EngineReplica:
    """The server's handle on one engine process."""

    def __init__(self, setup: EngineSetup, sink: ReplicaSink,
                 heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
                 started: tuple[subprocess.Popen[bytes], socket.socket] | None = None
                 ) -> None:
        self.setup = setup
        self._started = started
        self.index = setup.index
        self.sink = sink
        self.heartbeat_timeout = heartbeat_timeout
        #: The process's last snapshot (every step, and every heartbeat while idle).
        self.statistics: EngineStatistics | None = None
        self.pid: int | None = None
        self._outgoing = bytearray()
        self._has_outgoing: anyio.Event | None = None
        self._calls: dict[int, _PendingCall] = {}
        self._call_ids = itertools.count()
        self._failure: str | None = None

    def send(self, message: object) -> None:
        """Queue ``message`` for the process (never waits)."""
        self._outgoing += frame(message)
        if self._has_outgoing is not None:
            self._has_outgoing.set()

    async def call(self, method: str, *args: object) -> object:
        """Call an engine method in the process and return its result (its exception
        raised here)."""
        call_id = next(self._call_ids)
        pending = self._calls[call_id] = _PendingCall()
        self.send(Call(call_id, method, args))
        try:
            await pending.done.wait()
        finally:
            self._calls.pop(call_id, None)
        reply = pending.reply
        if reply is None:
            raise EngineDeadError(f"engine {self.index} died during {method}")
        if reply.error is not None:
            raise reply.error
        return reply.value

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                  ) -> None:
        # Started from the event loop's thread, not a worker thread: the kernel kills
        # the process when the thread that started it ends (PR_SET_PDEATHSIG).
        process, sock = self._started or start_engine_process(self.setup.cores)
        self._started = None
        self.pid = process.pid
        try:
            stream = await anyio.abc.UNIXSocketStream.from_socket(sock)
        except BaseException:
            sock.close()
            await self._stop(process)
            raise
        try:
            self.send(self.setup)
            async with anyio.create_task_group() as task_group:
                task_group.start_soon(self._write, stream)
                await self._read(stream, process, task_status)
        finally:
            with anyio.CancelScope(shield=True):
                await stream.aclose()
                await self._stop(process)
            for pending in self._calls.values():
                pending.done.set()

    @staticmethod
    async def _stop(process: subprocess.Popen[bytes]) -> None:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(stop_engine_process, process)

    async def _write(self, stream: anyio.abc.ByteStream) -> None:
        while True:
            if not self._outgoing:
                self._has_outgoing = anyio.Event()
                await self._has_outgoing.wait()
            data, self._outgoing = bytes(self._outgoing), bytearray()
            await stream.send(data)

    async def _read(self, stream: anyio.abc.ByteStream, process: subprocess.Popen[bytes],
                    task_status: anyio.abc.TaskStatus[None]) -> None:
        reader = FrameReader()
        ready = False
        while True:
            timeout = self.heartbeat_timeout if ready else math.inf
            try:
                with anyio.fail_after(timeout):
                    data = await stream.receive(1 << 20)
            except TimeoutError:
                process.kill()
                self._die(f"engine {self.index} (pid {process.pid}) sent nothing for "
                          f"{timeout:.0f} s: hung, killed")
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                code = await anyio.to_thread.run_sync(process.wait)
                self._die(self._failure or f"engine {self.index} (pid {process.pid}) "
                                           f"exited with status {code}")
            for message in reader.feed(data):
                if isinstance(message, StepOutputs):
                    if message.statistics is not None:
                        self.statistics = message.statistics
                    if message:
                        self.sink.step(self.index, message)
                elif isinstance(message, Reply):
                    pending = self._calls.get(message.call_id)
                    if pending is not None:
                        pending.reply = message
                        pending.done.set()
                elif isinstance(message, AddFailed):
                    self.sink.add_failed(message.seq, message.error)
                elif isinstance(message, EngineFailed):
                    self._failure = message.message
                elif isinstance(message, Ready) and not ready:
                    ready = True
                    self.statistics = message.statistics
                    task_status.started()

    def _die(self, reason: str) -> NoReturn:
        error = EngineDeadError(reason)
        self.sink.replica_died(self.index, error)
        raise error
