"""``triollm`` command line. Engine flags are generated from ``EngineArgs`` with vLLM's
spelling (``--max-model-len``), so every subcommand takes the same engine options.

As ``vllm serve``: flags may be spelled with underscores (``--max_num_seqs``), token
counts may be human-readable (``--max-model-len 32k``), ``--config FILE.yaml`` reads
flags from a YAML mapping (the command line wins), and vLLM's flags that triollm does
not implement fail with a message that says so (``triollm.refused_flags``) unless
they ask for what triollm does anyway. vLLM's ``VLLM_*`` environment variables are
honoured, refused or noted before anything loads (``triollm.vllm_env``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from triollm.argv_spelling import human_readable_int, normalize_argv
from triollm.connection_flags import add_connection_arguments, connection_options
from triollm.engine import args as engine_args
from triollm.engine.args import AsyncEngineArgs, EngineArgs
from triollm.entrypoints.chat_utils import CONTENT_FORMATS
from triollm.flag_help import engine_flag_help
from triollm.model.source import model_source_problem
from triollm.process_exit import exit_without_teardown
from triollm.refused_flags import add_refused_flags
from triollm.server.limits import DEFAULT_MAX_LOGPROB_ENTRIES, DEFAULT_MAX_REQUEST_BODY_BYTES
from triollm.tool_flags import add_tool_arguments, tool_options
from triollm.vllm_env import (
    VllmEnvironment,
    apply_cpu_binding,
    configure_logging,
    read_vllm_environment,
)

if TYPE_CHECKING:
    from triollm.engine.process.launch import PrestartedEngines
    from triollm.server.engine_kind import ServedEngine
    from triollm.server.routes.lora import LoRAModulePath
    from triollm.server.serve import ServerOptions

__all__ = [
    "add_engine_arguments",
    "build_parser",
    "engine_args_from_namespace",
    "human_readable_int",
    "main",
    "normalize_argv",
    "package_version",
    "run",
    "server_options_from_namespace",
]

#: Whether ``triollm serve`` runs a single engine in a process of its own
#: (``VLLM_ENABLE_V1_MULTIPROCESSING`` decides where set; docs/benchmarks.md measures both).
ENGINE_PROCESS_BY_DEFAULT = True

#: Engine flags that count tokens, so they take human-readable sizes as vLLM's do.
_TOKEN_COUNTS = ("max_model_len", "max_num_batched_tokens")


def add_engine_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                         args_class: type[EngineArgs] = EngineArgs) -> None:
    hints = typing.get_type_hints(args_class)
    for field in dataclasses.fields(args_class):
        flag = "--" + field.name.replace("_", "-")
        kind = hints[field.name]
        help_text = engine_flag_help(field.name, engine_args.DEFAULT_OPTIMIZATION_LEVEL
                                     if field.name == "optimization_level" else field.default)
        if field.name == "served_model_name":
            parser.add_argument(flag, nargs="+", default=None, help=help_text)
            continue
        if kind is bool or kind == bool | None:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction,
                                default=field.default, help=help_text)
            continue
        options = [a for a in typing.get_args(kind) if a is not type(None)]
        base: Any = options[0] if isinstance(kind, types.UnionType) and options else kind
        if typing.get_origin(base) is list:
            parser.add_argument(flag, nargs="+", default=field.default, help=help_text)
            continue
        if base not in (int, float, str):
            base = str
        if field.name in _TOKEN_COUNTS:
            base = human_readable_int
        parser.add_argument(flag, type=base, default=field.default, help=help_text)


def engine_args_from_namespace(namespace: argparse.Namespace,
                               args_class: type[EngineArgs] = EngineArgs) -> EngineArgs:
    names = {field.name for field in dataclasses.fields(args_class)}
    return args_class(**{k: v for k, v in vars(namespace).items() if k in names})


def _check_model_sources(args: EngineArgs) -> None:
    """Raise a one-line ``ValueError`` for a model or tokenizer that cannot load (a
    local path that does not exist, a hub id while offline and not cached, or one the
    hub does not have), before torch or the model loads."""
    for flag, name in (("model", args.model), ("tokenizer", args.tokenizer)):
        if name is None:
            continue
        problem = model_source_problem(name, revision=args.revision,
                                       download_dir=args.download_dir, probe_hub=True,
                                       tokenizer=flag == "tokenizer")
        if problem is not None:
            raise ValueError(f"{flag} {problem}")


def _generate(namespace: argparse.Namespace) -> int:
    apply_cpu_binding(_environment(namespace))
    args = engine_args_from_namespace(namespace)
    _check_model_sources(args)
    from triollm import LLM, SamplingParams

    llm = LLM(**dataclasses.asdict(args))
    params = SamplingParams(max_tokens=namespace.max_tokens, temperature=namespace.temperature,
                            seed=namespace.sampling_seed)
    for output in llm.generate(namespace.prompt, params, use_tqdm=len(namespace.prompt) > 1):
        print(f"{output.prompt!r} -> {output.outputs[0].text!r}")
    return 0


def _environment(namespace: argparse.Namespace) -> VllmEnvironment:
    environment = getattr(namespace, "vllm_environment", None)
    return environment if environment is not None else VllmEnvironment()


def _serve(namespace: argparse.Namespace) -> int:
    """Check what fails in a second (the arguments, the model's source, the address)
    before torch loads; start the engine processes, which import torch and load the
    model (seconds to minutes) while this process imports its server."""
    from triollm.server.listen import bind_listening_sockets

    if namespace.model_tag is not None:
        namespace.model = namespace.model_tag
    values = _server_option_values(namespace)
    args = engine_args_from_namespace(namespace, AsyncEngineArgs)
    assert isinstance(args, AsyncEngineArgs)
    _check_data_parallel(namespace, args)
    if namespace.lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    _check_model_sources(args)
    listen_fds = bind_listening_sockets(_host(namespace), namespace.port, namespace.uds)
    environment = _environment(namespace)
    configure_logging(environment, values["log_level"])
    apply_cpu_binding(environment)
    with _prestarted_engines(args, environment) as prestarted:
        options = _server_options(values, listen_fds)
        from triollm.server.serve import serve_blocking

        return serve_blocking(_engine(args, environment, prestarted), options)


def _check_data_parallel(namespace: argparse.Namespace, args: AsyncEngineArgs) -> None:
    local = namespace.data_parallel_size_local
    if local is not None and local != args.data_parallel_size:
        raise ValueError(f"--data-parallel-size-local {local}: every replica runs on this "
                         f"machine, so it must equal --data-parallel-size "
                         f"({args.data_parallel_size})")


def _engine_in_processes(args: AsyncEngineArgs, environment: VllmEnvironment) -> bool:
    """Whether ``triollm serve`` runs its engine in engine processes
    (``--data-parallel-size`` above 1, or ``VLLM_ENABLE_V1_MULTIPROCESSING``)."""
    own_process = environment.engine_process
    if own_process is None:
        own_process = ENGINE_PROCESS_BY_DEFAULT
    return args.data_parallel_size > 1 or own_process


def _prestarted_engines(args: AsyncEngineArgs, environment: VllmEnvironment
                        ) -> contextlib.AbstractContextManager[PrestartedEngines | None]:
    if not _engine_in_processes(args, environment):
        return contextlib.nullcontext()
    from triollm.engine.process.client import replica_cores
    from triollm.engine.process.launch import PrestartedEngines

    return PrestartedEngines(replica_cores(args.data_parallel_size))


def _engine(args: AsyncEngineArgs, environment: VllmEnvironment,
            prestarted: PrestartedEngines | None = None) -> ServedEngine:
    """The engine ``triollm serve`` runs: in this process, or in engine processes."""
    if _engine_in_processes(args, environment):
        from triollm.engine.process.client import EngineClient

        # validates the arguments first
        return EngineClient.from_engine_args(args, prestarted=prestarted,
                                             log_config=environment.logging_config)
    from triollm.engine.async_engine import AsyncLLMEngine

    return AsyncLLMEngine.from_engine_args(args)


def _host(namespace: argparse.Namespace) -> str:
    return namespace.host or "0.0.0.0"  # every interface, as vLLM


def server_options_from_namespace(namespace: argparse.Namespace,
                                  listen_fds: tuple[int, ...] = ()) -> ServerOptions:
    """The server half of ``triollm serve``'s flags (the engine half is
    ``engine_args_from_namespace``)."""
    return _server_options(_server_option_values(namespace), listen_fds)


def _server_options(values: dict[str, Any], listen_fds: tuple[int, ...]) -> ServerOptions:
    from triollm.server.serve import CorsSettings, ServerOptions

    return ServerOptions(**{**values, "cors": CorsSettings(**values["cors"])},
                         listen_fds=listen_fds)


def _server_option_values(namespace: argparse.Namespace) -> dict[str, Any]:
    """``ServerOptions``' fields from the flags, checked (a ``ValueError`` naming the
    flag), without importing the server, which imports torch."""
    chat_template = namespace.chat_template
    if chat_template is not None and "{" not in chat_template:
        with open(chat_template, encoding="utf-8") as file:
            chat_template = file.read()
    served = namespace.served_model_name
    level = namespace.log_level or namespace.uvicorn_log_level
    if level == "trace":  # uvicorn's level below debug; Python logging has none
        level = "debug"
    keys = namespace.api_key
    return dict(
        host=_host(namespace), port=namespace.port, uds=namespace.uds,
        api_key=tuple(keys) if keys else None,
        served_model_names=tuple([served] if isinstance(served, str) else served or []),
        ssl_keyfile=namespace.ssl_keyfile, ssl_certfile=namespace.ssl_certfile,
        shutdown_grace=namespace.shutdown_grace,
        max_request_body_bytes=namespace.max_request_body_bytes,
        max_logprob_entries=namespace.max_logprob_entries,
        chat_template=chat_template,
        chat_template_content_format=namespace.chat_template_content_format,
        trust_request_chat_template=namespace.trust_request_chat_template,
        return_tokens_as_token_ids=namespace.return_tokens_as_token_ids,
        root_path=namespace.root_path, access_log=not namespace.disable_uvicorn_access_log,
        access_log_excluded_paths=tuple(
            path.strip() for path in (namespace.disable_access_log_for_endpoints or "")
            .split(",") if path.strip()),
        api_docs=not namespace.disable_fastapi_docs, log_level=level.lower(),
        cors=dict(
            allowed_origins=tuple(namespace.allowed_origins),
            allow_credentials=namespace.allow_credentials,
            allowed_methods=tuple(namespace.allowed_methods),
            allowed_headers=tuple(namespace.allowed_headers)),
        log_stats_interval=None if namespace.disable_log_stats else (
            _environment(namespace).log_stats_interval),
        lora_modules=tuple(namespace.lora_modules), **tool_options(namespace),
        **connection_options(namespace))


def _json_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError(f'expected a JSON list of strings like ["*"], got '
                                         f"{text!r}")
    return value


def _lora_module(text: str) -> LoRAModulePath:
    from triollm.server.routes.lora import parse_lora_module

    try:
        return parse_lora_module(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _add_serve_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = commands.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (as `vllm serve`). "
                    "With no model it serves the built-in demo model (random weights).",
        epilog="vLLM's flags that triollm does not implement are accepted only with a value "
               "that asks for what triollm does anyway (--pipeline-parallel-size 1); any other "
               "use is an error saying why. docs/migration.md lists every flag.")
    serve.add_argument("model_tag", nargs="?", default=None,
                       help="model directory or hub id (same as --model)")
    server = serve.add_argument_group("server")
    server.add_argument("--host", default=None,
                        help="address to bind (default: every IPv4 interface, as vLLM; "
                             "127.0.0.1 for this machine only)")
    server.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    server.add_argument("--uds", default=None,
                        help="listen on this Unix domain socket instead of --host/--port")
    server.add_argument("--api-key", nargs="+", default=None,
                        help="require `Authorization: Bearer KEY` with one of these keys "
                             "on every route but /health, /ping and /metrics (default: "
                             "$VLLM_API_KEY, as vLLM)")
    server.add_argument("--root-path", default="",
                        help="the path prefix a proxy serves the API under (ASGI root_path)")
    server.add_argument("--disable-uvicorn-access-log", action=argparse.BooleanOptionalAction,
                        default=False,
                        help="do not log a line per HTTP request")
    server.add_argument("--disable-access-log-for-endpoints", default=None,
                        help="paths whose requests the access log leaves out, comma-"
                             "separated (as /health,/metrics,/ping)")
    server.add_argument("--disable-fastapi-docs", action=argparse.BooleanOptionalAction,
                        default=False,
                        help="do not serve /docs, /redoc and /openapi.json")
    server.add_argument("--ssl-keyfile", default=None, help="TLS private key file")
    server.add_argument("--ssl-certfile", default=None, help="TLS certificate file")
    server.add_argument("--chat-template", default=None,
                        help="a Jinja chat template, or a file holding one "
                             "(default: the tokenizer's)")
    server.add_argument("--chat-template-content-format", default="auto",
                        choices=CONTENT_FORMATS,
                        help="how message content reaches the template: string (text parts "
                             "joined by newlines), openai (a list of parts), or auto (read "
                             "the template; default)")
    server.add_argument("--trust-request-chat-template",
                        action=argparse.BooleanOptionalAction, default=False,
                        help="whether to trust the chat template a request provides "
                             "(its chat_template field); if not, a request that brings one "
                             "gets a 400, and the server always uses --chat-template or "
                             "the tokenizer's")
    server.add_argument("--return-tokens-as-token-ids", action=argparse.BooleanOptionalAction,
                        default=False,
                        help="write logprob tokens as 'token_id:N' (a request's "
                             "return_tokens_as_token_ids wins)")
    server.add_argument("--allowed-origins", type=_json_list, default=["*"],
                        help='CORS: origins allowed, a JSON list (default: ["*"])')
    server.add_argument("--allow-credentials", action=argparse.BooleanOptionalAction,
                        default=False,
                        help="CORS: allow credentials (cookies, Authorization)")
    server.add_argument("--allowed-methods", type=_json_list, default=["*"],
                        help='CORS: methods allowed, a JSON list (default: ["*"])')
    server.add_argument("--allowed-headers", type=_json_list, default=["*"],
                        help='CORS: headers allowed, a JSON list (default: ["*"])')
    server.add_argument("--data-parallel-size-local", type=int, default=None,
                        help="vLLM's replicas on this node: every --data-parallel-size "
                             "replica runs on this machine, so only that count is "
                             "accepted")
    server.add_argument("--shutdown-grace", "--shutdown-timeout", type=float, default=30.0,
                        help="seconds in-flight requests may run after SIGINT/SIGTERM "
                             "(default: 30)")
    server.add_argument("--max-request-body-bytes", type=int,
                        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                        help="larger request bodies get 413 (default: 8 MiB)")
    server.add_argument("--max-logprob-entries", type=int, default=DEFAULT_MAX_LOGPROB_ENTRIES,
                        help="a request whose reply could carry more logprob entries (n x "
                             "tokens x (logprobs + 1), echoed prompt included) gets 400 "
                             f"(default: {DEFAULT_MAX_LOGPROB_ENTRIES})")
    add_connection_arguments(server)
    server.add_argument("--uvicorn-log-level", default="info", type=str.lower,
                        choices=["trace", "debug", "info", "warning", "error", "critical"],
                        help="log level (vLLM's name for it; default: info)")
    server.add_argument("--log-level", default=None, type=str.lower,
                        choices=["debug", "info", "warning", "error", "critical"],
                        help="log level (overrides --uvicorn-log-level)")
    server.add_argument("--lora-modules", nargs="+", type=_lora_module, default=[],
                        help="LoRA adapters served under their own model names, each "
                             "name=path or JSON {\"name\": ..., \"path\": ..., "
                             "\"base_model_name\": ...} (needs --enable-lora)")
    server.add_argument("--config", default=None,
                        help="a YAML file of flags (keys are flag names without --); flags "
                             "on the command line win")
    add_tool_arguments(serve)
    add_engine_arguments(serve.add_argument_group("engine"), AsyncEngineArgs)
    add_refused_flags(serve)


def build_parser(defaults: Mapping[str, Any] | None = None) -> argparse.ArgumentParser:
    """The ``triollm`` argument parser (``serve`` and ``generate``); ``defaults`` (by
    ``dest``: ``VllmEnvironment.defaults``) replace the flags' own."""
    parser = argparse.ArgumentParser(prog="triollm", description="LLM serving engine")
    parser.add_argument("-v", "--version", action="version", version=package_version(),
                        help="print triollm's version and exit")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_serve_parser(commands)
    generate = commands.add_parser("generate", help="generate offline for a few prompts")
    generate.add_argument("prompt", nargs="+", help="one or more prompts")
    generate.add_argument("--max-tokens", type=int, default=32)
    generate.add_argument("--temperature", type=float, default=0.8)
    generate.add_argument("--sampling-seed", type=int, default=None)
    add_engine_arguments(generate)
    for command in commands.choices.values():
        known = {action.dest for action in command._actions}
        command.set_defaults(**{k: v for k, v in (defaults or {}).items() if k in known})
    return parser


def package_version() -> str:
    """The installed triollm's version (its package metadata)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("triollm")
    except PackageNotFoundError:  # run from a source tree that was never installed
        from triollm import __version__

        return __version__


def main(argv: Sequence[str] | None = None) -> int:
    try:
        environment = read_vllm_environment(os.environ)
    except ValueError as error:
        print(f"triollm: error: {error}", file=sys.stderr)
        return 2
    try:
        normalized = normalize_argv(sys.argv[1:] if argv is None else argv)
    except ValueError as error:
        print(f"triollm: error: {error}", file=sys.stderr)
        return 2
    namespace = build_parser(environment.defaults).parse_args(normalized)
    namespace.vllm_environment = environment
    try:
        handlers: dict[str, Callable[[argparse.Namespace], int]] = {
            "generate": _generate, "serve": _serve}
        return handlers[namespace.command](namespace)
    except ValueError as error:
        print(f"triollm {namespace.command}: error: {error}", file=sys.stderr)
        return 2


def run() -> NoReturn:
    """The ``triollm`` command and ``python -m triollm``: ``main``'s status as the
    process's, exiting without the interpreter's teardown once the command is done
    (``triollm.process_exit``)."""
    exit_without_teardown(main())


if __name__ == "__main__":
    run()
