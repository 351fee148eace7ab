"""The engine process: ``python -m triollm.engine.process.child FD PARENT_PID [CORES]``.

It runs the ordinary ``AsyncLLMEngine`` (its step loop, its model thread) under trio,
with an ``Outbox`` (engine/process/outbox.py) in place of the request channels, and
talks to the server over the socket ``FD``: the first frame is its ``EngineSetup``;
requests, aborts and calls come in, and one ``StepOutputs`` goes out per step (or one a
``HEARTBEAT_SECONDS`` while idle). The server closing the socket is the stop: the
engine shuts down as on cancellation and the process exits 0. A failed step sends
``EngineFailed`` and exits 1. The kernel kills it if the server dies
(``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import logging
import logging.config
import os
import pickle
import socket
import sys
from functools import partial

import anyio
import anyio.abc

from triollm.engine.assembly import create_model_runner, load_engine_tokenizer
from triollm.engine.async_engine import AsyncLLMEngine
from triollm.engine.process.outbox import Outbox, StatsForwarder
from triollm.engine.process.protocol import (
    Abort,
    AddFailed,
    AddRequest,
    Call,
    EngineFailed,
    EngineSetup,
    FrameReader,
    Ready,
    Reply,
    frame,
)
from triollm.model.runners.compile_process import die_with_parent
from triollm.process_exit import exit_without_teardown
from triollm.sampling_params import SamplingParams
from triollm.structured_output.grammar import CompiledGrammar

__all__ = ["CALLS", "HEARTBEAT_SECONDS", "EngineProcess", "main"]

logger = logging.getLogger(__name__)

#: How often an idle engine tells the server it is alive.
HEARTBEAT_SECONDS = 1.0
#: The engine methods the server may call by name.
CALLS = frozenset({"add_lora", "remove_lora", "list_loras", "reset_prefix_cache"})


class EngineProcess:
    """One engine and its socket to the server."""

    def __init__(self, setup: EngineSetup, stream: anyio.abc.ByteStream,
                 reader: FrameReader) -> None:
        self.setup = setup
        self.stream = stream
        self.reader = reader
        self.outbox = Outbox(self._wake_writer)
        args = setup.args
        config = args.create_engine_config()
        self.engine = AsyncLLMEngine(
            config, load_engine_tokenizer(config), partial(create_model_runner, config),
            log_requests=args.enable_log_requests and not args.disable_log_requests,
            max_log_len=args.max_log_len, stream_buffer_size=setup.stream_buffer_size,
            stat_loggers=[StatsForwarder(self.outbox)] if setup.log_stats else None)
        self.engine._channels = self.outbox  # type: ignore[assignment]
        self._messages: list[object] = []
        self._send_lock = anyio.Lock()
        self._wake = anyio.Event()
        self._adding: set[int] = set()
        self._aborted_while_adding: set[int] = set()

    def _wake_writer(self) -> None:
        self._wake.set()

    def _queue(self, message: object) -> None:
        self._messages.append(message)
        self._wake.set()

    async def _send_pending(self) -> None:
        batch = self.outbox.take()
        batch.statistics = self.engine.statistics()
        messages, self._messages = self._messages, []
        data = b"".join([frame(batch), *map(frame, messages)])
        async with self._send_lock:
            await self.stream.send(data)

    async def serve(self) -> None:
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(self._write)
            await task_group.start(self._run_engine)
            self._queue(Ready(self.engine.statistics()))
            await self._read(task_group)
            task_group.cancel_scope.cancel()

    async def _run_engine(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        try:
            await self.engine.run(task_status=task_status)
        except Exception as error:
            dead = self.engine.dead_error
            self._queue(EngineFailed(str(dead if dead is not None else error)))
            with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                await self._send_pending()
            raise

    async def _write(self) -> None:
        while True:
            with anyio.move_on_after(HEARTBEAT_SECONDS):
                await self._wake.wait()
            self._wake = anyio.Event()
            await self._send_pending()

    async def _read(self, task_group: anyio.abc.TaskGroup) -> None:
        data = b""
        while True:
            for message in self.reader.feed(data):
                self._handle(message, task_group)
            try:
                data = await self.stream.receive(1 << 20)
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                return  # the server closed its end: stop

    def _handle(self, message: object, task_group: anyio.abc.TaskGroup) -> None:
        if isinstance(message, AddRequest):
            params = message.params
            if message.lora_request is None and not (
                    isinstance(params, SamplingParams) and params.structured_outputs):
                self._add(message, None)
            else:
                self._adding.add(message.seq)
                task_group.start_soon(self._prepare_and_add, message)
        elif isinstance(message, Abort):
            entry = self.outbox.by_seq(message.seq)
            if entry is not None:
                self.engine._abort_now(entry)  # type: ignore[arg-type]
            elif message.seq in self._adding:
                self._aborted_while_adding.add(message.seq)
        elif isinstance(message, Call):
            task_group.start_soon(self._call, message)
        else:
            raise TypeError(f"unexpected message {type(message).__name__}")

    def _add(self, message: AddRequest, grammar: CompiledGrammar | None) -> None:
        engine = self.engine
        self.outbox.next_seq = message.seq
        try:
            engine._add_request(message.prompt, message.params, message.request_id,
                                message.priority, message.is_latency_sensitive, message.slo,
                                message.ttft_slo, message.lora_request,
                                engine._trace_headers(message.trace_headers), grammar)
        except Exception as error:
            self._queue(AddFailed(message.seq, _sendable(error)))

    async def _prepare_and_add(self, message: AddRequest) -> None:
        """A request that waits for its adapter or its grammar first (off this loop)."""
        try:
            if message.lora_request is not None:
                await self.engine._ensure_lora(message.lora_request)
            params = message.params
            grammar = (await self.engine._compile_grammar(params, message.request_id)
                       if isinstance(params, SamplingParams) else None)
        except Exception as error:
            self._queue(AddFailed(message.seq, _sendable(error)))
            return
        finally:
            self._adding.discard(message.seq)
        if message.seq in self._aborted_while_adding:
            self._aborted_while_adding.discard(message.seq)
            return
        self._add(message, grammar)

    async def _call(self, message: Call) -> None:
        try:
            if message.method not in CALLS:
                raise ValueError(f"no engine call {message.method!r}")
            value = await getattr(self.engine, message.method)(*message.args)
            reply = Reply(message.call_id, value)
        except Exception as error:
            reply = Reply(message.call_id, error=_sendable(error))
        self._queue(reply)


def _sendable(error: BaseException) -> BaseException:
    """``error``, or its text as a ``RuntimeError`` where it does not pickle."""
    try:
        pickle.dumps(error)
    except Exception:
        return RuntimeError(str(error))
    return error


def _read_setup(sock: socket.socket) -> tuple[EngineSetup, FrameReader]:
    reader = FrameReader()
    while True:
        data = sock.recv(1 << 16)
        if not data:
            sys.exit(0)
        messages = list(reader.feed(data))
        if messages:
            # the server sends nothing else before the engine is ready
            if len(messages) > 1 or not isinstance(messages[0], EngineSetup):
                raise TypeError("the first message must be the engine's setup, alone")
            return messages[0], reader


def _configure(setup: EngineSetup) -> None:
    if setup.log_config is not None:
        logging.config.dictConfig(dict(setup.log_config))
    elif setup.log_format is not None:
        logging.basicConfig(level=setup.log_level, format=setup.log_format)
    else:
        logging.getLogger().setLevel(setup.log_level)
    if setup.cores is not None:
        logger.info("engine %d: computing on cores %s", setup.index,
                    ",".join(map(str, sorted(setup.cores))))


async def _serve(sock: socket.socket, setup: EngineSetup, reader: FrameReader) -> None:
    async with await anyio.abc.UNIXSocketStream.from_socket(sock) as stream:
        await EngineProcess(setup, stream, reader).serve()


def _import_model_code() -> None:
    """Import what building the engine imports (torch, transformers, the runner):
    seconds the server spends on its own imports meanwhile, before the setup comes."""
    import transformers.modeling_utils  # noqa: F401

    import triollm.model.runners.torch_runner  # noqa: F401


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    die_with_parent(int(sys.argv[2]))
    if len(sys.argv) > 3 and hasattr(os, "sched_setaffinity"):
        # before torch loads: OpenMP sizes its pool by the affinity it starts with
        os.sched_setaffinity(0, {int(core) for core in sys.argv[3].split(",")})
    _import_model_code()
    setup, reader = _read_setup(sock)
    _configure(setup)
    status = 0
    try:
        anyio.run(_serve, sock, setup, reader, backend="trio")
    except BaseException:  # the server reads the exit status
        logger.exception("engine %d stopped", setup.index)
        status = 1
    # The engine has shut down (its threads joined, its runner freed).
    exit_without_teardown(status)


if __name__ == "__main__":
    main()
