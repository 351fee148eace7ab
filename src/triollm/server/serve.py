"""The server's root task group: the engine, hypercorn, and the signals that stop them.

::

    root task group (a trio nursery)
    ├── engine.run                    EngineClient: its engine processes (triollm serve);
    │                                 AsyncLLMEngine: the step loop and its model thread
    ├── hypercorn.trio.serve(app)     connections → handlers → engine.generate()
    └── signal watcher                SIGINT / SIGTERM → graceful shutdown

* SIGINT/SIGTERM (or ``ServerHandle.shutdown()``): stop accepting connections, let the
  requests in flight finish for up to ``shutdown_grace`` seconds. Then stop the engine:
  every stream still open ends with an error event and ``[DONE]``, every other request
  with a 503. After at most ``FINAL_WORDS_SECONDS`` for those to go out, cancel
  everything left. ``serve`` returns normally: exit status 0.
* Where the server owns its process (``owns_process``, as ``triollm serve``): a second
  stop signal ends the process at once, and so does a connection still stuck
  ``STUCK_EXIT_SECONDS`` after that cancellation. (hypercorn writes to a socket under a
  shielded cancel scope, so a client that never reads would otherwise keep the process
  alive for as long as it stays connected.)
* The engine dies: every open stream gets a final error event (the engine delivers the
  error before anything is cancelled), ``/health`` answers 503, and after
  ``engine_death_grace`` seconds for those events to go out, the engine's exception
  leaves ``serve``: the process exits non-zero.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import anyio
import anyio.abc
import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve

from triollm.entrypoints.chat_utils import ContentFormat
from triollm.server import protocol_errors
from triollm.server.access_log import AccessLog, HypercornLog
from triollm.server.admission import Admission, AdmissionLimits
from triollm.server.app import build_app
from triollm.server.chat_parsing import check_tool_flags
from triollm.server.client_budget import ClientBudget
from triollm.server.engine_kind import ServedEngine
from triollm.server.errors import OpenAIError
from triollm.server.limits import (
    DEFAULT_BACKLOG,
    DEFAULT_BODY_READ_TIMEOUT,
    DEFAULT_CLIENT_CPU_SHARE,
    DEFAULT_H11_MAX_HEADER_COUNT,
    DEFAULT_H11_MAX_INCOMPLETE_EVENT_SIZE,
    DEFAULT_KEEP_ALIVE_TIMEOUT,
    DEFAULT_LIMIT_CONCURRENCY,
    DEFAULT_MAX_LOGPROB_ENTRIES,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
)
from triollm.server.listen import listen_address, listen_error
from triollm.server.metrics import PrometheusStatLogger
from triollm.server.middleware import ASGIApp
from triollm.server.routes.lora import LoRAModulePath, load_adapter
from triollm.server.state import CorsSettings, ServerSettings, ServerState

__all__ = ["CorsSettings", "ServerHandle", "ServerOptions", "run_server"]

logger = logging.getLogger(__name__)

#: After the grace, how long streams get to write their final error event and [DONE].
FINAL_WORDS_SECONDS = 1.0
#: After everything is cancelled, how long a connection may stay stuck before a process
#: the server owns exits anyway.
STUCK_EXIT_SECONDS = 2.0


@dataclass
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    #: Listen on this Unix domain socket instead of host and port (vLLM's --uds).
    uds: str | None = None
    #: Sockets already bound to the address (``triollm serve`` binds them before the
    #: model loads: server/listen.py), served on instead of binding host, port or uds.
    listen_fds: tuple[int, ...] = ()
    #: One key or several; a request must present one of them.
    api_key: str | Sequence[str] | None = None
    served_model_names: tuple[str, ...] = ()
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    shutdown_grace: float = 30.0
    engine_death_grace: float = 2.0
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    max_logprob_entries: int = DEFAULT_MAX_LOGPROB_ENTRIES
    #: HTTP requests served at once, /health, /ping and /metrics not counted; one more
    #: gets 503 (uvicorn's --limit-concurrency). None: no limit.
    limit_concurrency: int | None = DEFAULT_LIMIT_CONCURRENCY
    #: Seconds a request's body may take to arrive after its headers (else 408).
    body_read_timeout: float | None = DEFAULT_BODY_READ_TIMEOUT
    #: The share of one core the server's own work for one client address may take
    #: (server/client_budget.py); None: no limit.
    client_cpu_share: float | None = DEFAULT_CLIENT_CPU_SHARE
    #: Seconds an idle connection stays open (uvicorn's --timeout-keep-alive).
    keep_alive_timeout: float = DEFAULT_KEEP_ALIVE_TIMEOUT
    #: Connections the kernel queues before they are accepted (listen's backlog).
    backlog: int = DEFAULT_BACKLOG
    #: vLLM's --h11-max-incomplete-event-size: the bytes of a request line and headers.
    h11_max_incomplete_event_size: int = DEFAULT_H11_MAX_INCOMPLETE_EVENT_SIZE
    #: vLLM's --h11-max-header-count: more headers get 431.
    h11_max_header_count: int = DEFAULT_H11_MAX_HEADER_COUNT
    chat_template: str | None = None
    chat_template_content_format: ContentFormat = "auto"
    trust_request_chat_template: bool = False
    return_tokens_as_token_ids: bool = False
    cors: CorsSettings = field(default_factory=CorsSettings)
    log_level: str = "info"
    #: One line per HTTP request, written at its end (server/access_log.py).
    access_log: bool = False
    #: Paths the access log leaves out (vLLM's --disable-access-log-for-endpoints).
    access_log_excluded_paths: tuple[str, ...] = ()
    #: The path prefix a proxy serves the app under (ASGI ``root_path``).
    root_path: str = ""
    #: Serve /docs, /redoc and /openapi.json (vLLM's --disable-fastapi-docs turns off).
    api_docs: bool = True
    handle_signals: bool = True
    #: Seconds between engine statistics log lines (vLLM: 10); None turns them off. An
    #: engine made with ``disable_log_stats`` logs none and feeds no metrics.
    log_stats_interval: float | None = 10.0
    #: The server may end its process: on a second stop signal, or when connections are
    #: still stuck after the shutdown (``triollm serve``; never for an embedded server).
    owns_process: bool = False
    #: LoRA adapters served under their own names from the start (``--lora-modules``).
    lora_modules: tuple[LoRAModulePath, ...] = ()
    #: vLLM's --enable-auto-tool-choice: tool_choice "auto" (and tools without a
    #: tool_choice) read tool calls out of the text with ``tool_call_parser``.
    enable_auto_tool_choice: bool = False
    #: vLLM's --tool-call-parser: a name in ``ToolParserManager``.
    tool_call_parser: str | None = None


@dataclass
class ServerHandle:
    """Given to ``task_status.started``: where the server listens and how to stop it."""

    urls: list[str]
    engine: ServedEngine
    state: ServerState
    #: Paces each client's answers (``--client-cpu-share``); None: not paced.
    client_budget: ClientBudget | None = None
    _stop: anyio.Event = field(default_factory=anyio.Event)

    @property
    def url(self) -> str:
        return self.urls[0]

    def shutdown(self) -> None:
        """Begin a graceful shutdown (what SIGINT and SIGTERM do)."""
        self._stop.set()


async def run_server(engine: ServedEngine, options: ServerOptions, *,
                     task_status: anyio.abc.TaskStatus[ServerHandle] = anyio.TASK_STATUS_IGNORED
                     ) -> None:
    """Load the model, serve until shut down, then stop everything; reports a
    ``ServerHandle`` once listening. Must run under trio (hypercorn's trio worker)."""
    check_tool_flags(options.enable_auto_tool_choice, options.tool_call_parser)
    names = options.served_model_names or (engine.config.model.model,)
    metrics = None
    if engine.log_stats:  # as vLLM: --disable-log-stats turns off the metrics too
        metrics = PrometheusStatLogger(engine, names[0])
        engine.add_stat_logger(metrics)
    keys = options.api_key
    state = ServerState(engine, ServerSettings(
        served_model_names=tuple(names),
        api_keys=(keys,) if isinstance(keys, str) else tuple(keys or ()),
        max_request_body_bytes=options.max_request_body_bytes,
        max_logprob_entries=options.max_logprob_entries,
        chat_template=options.chat_template,
        chat_template_content_format=options.chat_template_content_format,
        trust_request_chat_template=options.trust_request_chat_template,
        return_tokens_as_token_ids=options.return_tokens_as_token_ids,
        cors=options.cors, enable_auto_tool_choice=options.enable_auto_tool_choice,
        tool_call_parser=options.tool_call_parser), metrics)
    budget = ClientBudget(options.client_cpu_share) if options.client_cpu_share else None
    if metrics is not None and budget is not None:
        metrics.watch_client_budget(budget)
    app: ASGIApp = Admission(build_app(state, api_docs=options.api_docs), AdmissionLimits(
        limit_concurrency=options.limit_concurrency,
        body_read_timeout=options.body_read_timeout,
        max_header_count=options.h11_max_header_count), budget)
    if options.access_log:
        app = AccessLog(app, excluded_paths=options.access_log_excluded_paths)
    protocol_errors.install()  # hypercorn's 400 and 431 in OpenAI's shape
    config = Config()
    config.bind = ([f"fd://{fd}" for fd in options.listen_fds] if options.listen_fds
                   else [listen_address(options.host, options.port, options.uds)])
    config.root_path = options.root_path
    config.keyfile = options.ssl_keyfile
    config.certfile = options.ssl_certfile
    # hypercorn cancels its handlers at its own deadline: keep it past ours, so that
    # streams still open at the end of the grace get to write their last events.
    config.graceful_timeout = options.shutdown_grace + FINAL_WORDS_SECONDS + 1.0
    config.loglevel = options.log_level.upper()
    config.logger_class = HypercornLog  # through Python's logging, in one format
    config.keep_alive_timeout = options.keep_alive_timeout
    config.backlog = options.backlog
    config.h11_max_incomplete_size = options.h11_max_incomplete_event_size

    stop_serving = trio.Event()
    engine_scope = trio.CancelScope()
    async with trio.open_nursery() as root:
        await root.start(_run_engine, engine, state, options, engine_scope)
        for module in options.lora_modules:  # a bad one stops the start-up, naming it
            try:
                await load_adapter(state, module.name, module.path,
                                   base_model_name=module.base_model_name)
            except OpenAIError as error:
                raise ValueError(f"--lora-modules {module.name}={module.path}: "
                                 f"{error.message}") from None
        urls = await root.start(lambda task_status: hypercorn_serve(
            app, config, shutdown_trigger=stop_serving.wait,  # type: ignore[arg-type]
            task_status=task_status))
        handle = ServerHandle(urls=list(urls), engine=engine, state=state,
                              client_budget=budget)
        if options.handle_signals:
            root.start_soon(_watch_signals, handle, options.owns_process)
        root.start_soon(_shutdown_when_asked, handle, state, stop_serving, engine_scope,
                        root.cancel_scope, options)
        if options.log_stats_interval is not None and engine.log_stats:
            root.start_soon(_log_stats, engine, options.log_stats_interval)
        logger.info("triollm serving %s at %s", ", ".join(names), ", ".join(handle.urls))
        task_status.started(handle)


async def _run_engine(engine: ServedEngine, state: ServerState, options: ServerOptions,
                      engine_scope: trio.CancelScope, *,
                      task_status: anyio.abc.TaskStatus[None]) -> None:
    try:
        with engine_scope:  # cancelled when a shutdown's grace is over
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
                               stop_serving: trio.Event, engine_scope: trio.CancelScope,
                               root_scope: trio.CancelScope, options: ServerOptions) -> None:
    await handle._stop.wait()
    grace = options.shutdown_grace
    logger.info("shutting down: no new connections; waiting up to %.0f s for %d "
                "request(s)", grace, state.open_requests)
    state.shutting_down = True
    stop_serving.set()
    with anyio.move_on_after(grace if math.isfinite(grace) else None):
        await state.wait_idle()
    if state.open_requests:
        # Stopping the engine ends every open stream with EngineClosedError: a stream
        # writes its error event and [DONE], any other request answers 503.
        logger.warning("the grace is over: ending %d request(s)", state.open_requests)
        engine_scope.cancel()
        with anyio.move_on_after(FINAL_WORDS_SECONDS):
            await state.wait_idle()
    if state.open_requests and options.owns_process:
        _exit_if_still_running_after(STUCK_EXIT_SECONDS, state)
    root_scope.cancel()  # hypercorn has stopped listening; this ends the rest


def _exit_if_still_running_after(seconds: float, state: ServerState) -> None:
    """A daemon thread that ends the process if it is still running in ``seconds``: a
    connection whose client stopped reading can hold a handler inside hypercorn's
    shielded write, beyond any cancellation."""
    def exit_now() -> None:
        logger.warning("%d connection(s) still stuck %.0f s after the shutdown (clients "
                       "that stopped reading); exiting", state.open_requests, seconds)
        logging.shutdown()
        os._exit(0)

    timer = threading.Timer(seconds, exit_now)
    timer.daemon = True
    timer.start()


async def _log_stats(engine: ServedEngine, interval: float) -> None:
    while True:
        await anyio.sleep(interval)
        await engine.do_log_stats()


async def _watch_signals(handle: ServerHandle, owns_process: bool) -> None:
    """The first SIGINT/SIGTERM starts a graceful shutdown; a second one, where the
    server owns its process, ends it at once (128 + the signal's number, as a shell
    reports a process killed by it)."""
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            name = signal.Signals(signum).name
            if handle._stop.is_set() and owns_process:
                logger.warning("received %s again: exiting now", name)
                logging.shutdown()
                os._exit(128 + signum)
            logger.info("received %s", name)
            handle.shutdown()


def serve_blocking(engine: ServedEngine, options: ServerOptions) -> int:
    """Run the server under trio until it stops, as the owner of this process; the exit
    status. Raises ``ListenError`` when it cannot listen on its address."""
    try:
        trio.run(run_server, engine, dataclasses.replace(options, owns_process=True))
    except KeyboardInterrupt:
        return 0
    except BaseException as error:
        if (cannot_listen := listen_error(error)) is not None:
            raise cannot_listen from None
        logger.error("server stopped: %r", error)
        return 1
    return 0
