"""Run the real server on 127.0.0.1 (ephemeral port) in a thread, or as `triollm serve`."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import trio

from triollm import AsyncLLMEngine
from triollm.server.serve import ServerHandle, ServerOptions, run_server
from triollm.testing import served_url


@dataclass
class ThreadedServer:
    handle: ServerHandle
    token: trio.lowlevel.TrioToken
    errors: list[BaseException]

    @property
    def url(self) -> str:
        return self.handle.url

    def shutdown(self) -> None:
        trio.from_thread.run_sync(self.handle.shutdown, trio_token=self.token)


@contextmanager
def server_in_thread(engine: AsyncLLMEngine, **options: Any) -> Iterator[ThreadedServer]:
    """The server under trio in a background thread, as the root nursery would run it."""
    box: dict[str, Any] = {}
    errors: list[BaseException] = []
    ready = threading.Event()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            box["handle"] = await nursery.start(run_server, engine, ServerOptions(
                port=0, handle_signals=False, **options))
            box["token"] = trio.lowlevel.current_trio_token()
            ready.set()

    def run() -> None:
        try:
            trio.run(main)
        except BaseException as error:  # reported to the test
            errors.append(error)
        finally:
            ready.set()

    thread = threading.Thread(target=run, name="test-server", daemon=True)
    thread.start()
    ready.wait(120)
    if "handle" not in box:
        raise RuntimeError(f"the server did not start: {errors!r}")
    server = ThreadedServer(box["handle"], box["token"], errors)
    try:
        yield server
    finally:
        if thread.is_alive():
            server.shutdown()
        thread.join(60)
        assert not thread.is_alive(), "the server thread did not stop"


@contextmanager
def server_process(*args: str, env: dict[str, str] | None = None
                   ) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """``python -m triollm serve ARGS --host 127.0.0.1 --port 0`` (``env`` over this
    process's environment); yields the process and its URL."""
    env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    if "--optimization-level" not in args:  # see conftest.eager_models_by_default
        args = (*args, "--optimization-level", "0")
    process = subprocess.Popen(
        [sys.executable, "-m", "triollm", "serve", *args, "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    assert process.stdout is not None
    url = served_url(process.stdout, lines)
    if url is None:
        process.kill()
        raise RuntimeError("server did not start:\n" + "".join(lines))
    drain = threading.Thread(target=lambda: [lines.append(x) for x in process.stdout or []],
                             daemon=True)
    drain.start()
    try:
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(30)
        drain.join(5)
        process.output = "".join(lines)  # type: ignore[attr-defined]
