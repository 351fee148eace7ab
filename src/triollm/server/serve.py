"""The server's root task group: the engine, hypercorn, and the signals that stop them.

::

    root task group (a trio nursery)
    ├── AsyncLLMEngine.run            the step loop and its model thread
    ├── hypercorn.trio.serve(app)     connections → handlers → engine.generate()
    └── signal watcher                SIGINT / SIGTERM → graceful shutdown

* SIGINT/SIGTERM (or ``ServerHandle.shutdown()``): stop accepting connections, let the
  requests in flight finish for up to ``shutdown_grace`` seconds, then cancel what is
  left (their clients get an error event, their requests are aborted) and stop the
  engine. ``serve`` returns normally: exit status 0.
* The engine dies: every open stream gets a final error event (the engine delivers the
  error before anything is cancelled), ``/health`` answers 503, and after
  ``engine_death_grace`` seconds for those events to go out, the engine's exception
  leaves ``serve``: the process exits non-zero.
"""

from __future__ import annotations

import logging
import math
import signal
from dataclasses import dataclass, field

import anyio
import anyio.abc
import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve

from triollm.engine.async_engine import AsyncLLMEngine
from triollm.server.app import build_app
from triollm.server.limits import DEFAULT_MAX_LOGPROB_ENTRIES, DEFAULT_MAX_REQUEST_BODY_BYTES
from triollm.server.metrics import PrometheusStatLogger
from triollm.server.state import CorsSettings, ServerSettings, ServerState

__all__ = ["CorsSettings", "ServerHandle", "ServerOptions", "run_server"]

logger = logging.getLogger(__name__)


@dataclass
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_names: tuple[str, ...] = ()
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    shutdown_grace: float = 30.0
    engine_death_grace: float = 2.0
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    max_logprob_entries: int = DEFAULT_MAX_LOGPROB_ENTRIES
    chat_template: str | None = None
    cors: CorsSettings = field(default_factory=CorsSettings)
    log_level: str = "info"
    handle_signals: bool = True
    #: Seconds between engine statistics log lines (vLLM: 10); None turns them off.
    log_stats_interval: float | None = 10.0


@dataclass
class ServerHandle:
    """Given to ``task_status.started``: where the server listens and how to stop it."""

    urls: list[str]
    engine: AsyncLLMEngine
    state: ServerState
    _stop: anyio.Event = field(default_factory=anyio.Event)

    @property
    def url(self) -> str:
        return self.urls[0]

    def shutdown(self) -> None:
        """Begin a graceful shutdown (what SIGINT and SIGTERM do)."""
        self._stop.set()


async def run_server(engine: AsyncLLMEngine, options: ServerOptions, *,
                     task_status: anyio.abc.TaskStatus[ServerHandle] = anyio.TASK_STATUS_IGNORED
                     ) -> None:
    """Load the model, serve until shut down, then stop everything; reports a
    ``ServerHandle`` once listening. Must run under trio (hypercorn's trio worker)."""
    names = options.served_model_names or (engine.config.model.model,)
    metrics = PrometheusStatLogger(engine, names[0])
    engine.add_stat_logger(metrics)
    state = ServerState(engine, ServerSettings(
        served_model_names=tuple(names), api_key=options.api_key,
        max_request_body_bytes=options.max_request_body_bytes,
        max_logprob_entries=options.max_logprob_entries,
        chat_template=options.chat_template, cors=options.cors), metrics)
    app = build_app(state)
    config = Config()
    config.bind = [f"{_bracket(options.host)}:{options.port}"]
    config.keyfile = options.ssl_keyfile
    config.certfile = options.ssl_certfile
    config.graceful_timeout = options.shutdown_grace
    config.loglevel = options.log_level.upper()
    config.accesslog = None

    stop_serving = trio.Event()
    async with trio.open_nursery() as root:
        await root.start(_run_engine, engine, state, options)
        urls = await root.start(lambda task_status: hypercorn_serve(
            app, config, shutdown_trigger=stop_serving.wait,  # type: ignore[arg-type]
            task_status=task_status))
        handle = ServerHandle(urls=list(urls), engine=engine, state=state)
        if options.handle_signals:
            root.start_soon(_watch_signals, handle)
        root.start_soon(_shutdown_when_asked, handle, state, stop_serving, root.cancel_scope,
                        options.shutdown_grace)
        if options.log_stats_interval is not None:
            root.start_soon(_log_stats, engine, options.log_stats_interval)
        logger.info("triollm serving %s at %s", ", ".join(names), ", ".join(handle.urls))
        task_status.started(handle)


async def _run_engine(engine: AsyncLLMEngine, state: ServerState, options: ServerOptions, *,
                      task_status: anyio.abc.TaskStatus[None]) -> None:
    try:
        await engine.run(task_status=task_status)
    except Exception:
        # Every stream already holds its EngineDeadError. For a short grace the server
        # keeps answering (handlers send their error events, /health says 503), then the
        # exception ends the server and the process exits non-zero.
        state.shutting_down = True
        logger.error("the engine died; the server stops in %.1f s",
                     options.engine_death_grace)
        with anyio.CancelScope(shield=True):
            await anyio.sleep(options.engine_death_grace)
        raise


async def _shutdown_when_asked(handle: ServerHandle, state: ServerState,
                               stop_serving: trio.Event, root_scope: trio.CancelScope,
                               grace: float) -> None:
    await handle._stop.wait()
    logger.info("shutting down: no new connections; waiting up to %.0f s for %d "
                "request(s)", grace, state.open_requests)
    state.shutting_down = True
    stop_serving.set()
    with anyio.move_on_after(grace if math.isfinite(grace) else None):
        await state.wait_idle()
    root_scope.cancel()  # hypercorn has stopped listening; this ends the rest


async def _log_stats(engine: AsyncLLMEngine, interval: float) -> None:
    while True:
        await anyio.sleep(interval)
        await engine.do_log_stats()


async def _watch_signals(handle: ServerHandle) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            logger.info("received %s", signal.Signals(signum).name)
            handle.shutdown()


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def serve_blocking(engine: AsyncLLMEngine, options: ServerOptions) -> int:
    """Run the server under trio until it stops; the exit status."""
    try:
        trio.run(run_server, engine, options)
    except KeyboardInterrupt:
        return 0
    except BaseException as error:
        logger.error("server stopped: %r", error)
        return 1
    return 0
