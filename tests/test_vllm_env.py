"""vLLM's ``VLLM_*`` environment variables: each is honoured, refused at start with the
reason, or noted; ``VLLM_API_KEY`` guards a real server as ``--api-key`` does."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import httpx
import pytest
import trio
from fastapi import FastAPI

from server_helpers import server_process
from triollm import cli
from triollm.connection_flags import connection_options
from triollm.server.app import build_app
from triollm.server.middleware import OPEN_PATHS
from triollm.server.routes import lora
from triollm.server.state import ServerSettings, ServerState
from triollm.vllm_env import VLLM_VARIABLES, configure_logging, read_vllm_environment

ENV_KEY = "sk-from-the-environment"
CLI_KEY = "sk-from-the-command-line"


@pytest.fixture(autouse=True)
def no_vllm_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts from an environment without VLLM_* variables, and a test that
    gets as far as loading a model in this process fails."""
    for name in list(os.environ):
        if name.startswith("VLLM_"):
            monkeypatch.delenv(name)

    def load_nothing(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the model began to load")

    monkeypatch.setattr("triollm.engine.async_engine.AsyncLLMEngine.from_engine_args",
                        load_nothing)


def served_routes() -> list[tuple[str, str]]:
    """(method, path) of every route the app serves under this process's environment,
    read from the app itself, path parameters filled in."""
    async def build() -> Any:
        engine = cast(Any, SimpleNamespace(tokenizer=None))  # routes only: nothing runs
        state = ServerState(engine, ServerSettings(served_model_names=("m",)), None)
        return build_app(state)

    def flatten(routes: list[Any], prefix: str = "") -> Iterator[tuple[str, str]]:
        for route in routes:
            if hasattr(route, "original_router"):  # FastAPI's lazily included router
                context = getattr(route, "include_context", None)
                yield from flatten(route.original_router.routes,
                                   prefix + (getattr(context, "prefix", "") or ""))
                continue
            path = re.sub(r"\{[^}]*\}", "x", prefix + route.path)
            yield from ((method, path) for method in sorted(route.methods or ()))

    app = trio.run(build)
    while not isinstance(app, FastAPI):  # CORS, then RequestLifetime, then FastAPI
        app = app.app
    return list(flatten(app.routes))


def test_vllm_api_key_alone_guards_every_route_but_health_ping_and_metrics(
        llama_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"VLLM_API_KEY": ENV_KEY, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)  # so that the LoRA routes are enumerated too
    routes = served_routes()
    assert ("POST", "/v1/load_lora_adapter") in routes and ("GET", "/health") in routes
    assert len(routes) > 20
    with server_process(str(llama_path), "--enable-lora", "--max-model-len", "128",
                        "--num-gpu-blocks-override", "64", env=env) as (_, url), \
            httpx.Client(base_url=url, timeout=30) as client:
        for method, path in [*routes, ("GET", "/not-a-route"), ("POST", "/v1/nothing")]:
            def call(headers: dict[str, str], method: str = method, path: str = path
                     ) -> httpx.Response:
                return client.request(method, path, headers=headers)

            anonymous = call({})
            if path in OPEN_PATHS:
                assert anonymous.status_code == 200, (method, path)
                continue
            assert anonymous.status_code == 401, (method, path, anonymous.text)
            if method != "HEAD":
                assert anonymous.json()["error"]["code"] == 401
            assert call({"Authorization": "Bearer wrong"}).status_code == 401, path
            assert call({"Authorization": ENV_KEY}).status_code == 401, path
            for scheme in ("Bearer", "bearer"):
                response = call({"Authorization": f"{scheme} {ENV_KEY}"})
                assert response.status_code != 401, (method, path, scheme)
                assert response.status_code < 500, (method, path, response.text)
    assert OPEN_PATHS == {"/health", "/ping", "/metrics"}


def test_the_api_key_flag_wins_over_vllm_api_key(llama_path: Path) -> None:
    env = {"VLLM_API_KEY": ENV_KEY}
    with server_process(str(llama_path), "--api-key", CLI_KEY, "--max-model-len", "128",
                        "--num-gpu-blocks-override", "64", env=env) as (_, url):
        def models(key: str) -> int:
            return httpx.get(url + "/v1/models", timeout=30,
                             headers={"Authorization": f"Bearer {key}"}).status_code

        assert models(CLI_KEY) == 200
        assert models(ENV_KEY) == 401


def parse(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], *argv: str) -> Any:
    """``triollm serve ARGV`` parsed as main() parses it, under ``env``."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    environment = read_vllm_environment(os.environ)
    namespace = cli.build_parser(environment.defaults).parse_args(
        cli.normalize_argv(["serve", *argv]))
    namespace.vllm_environment = environment
    return namespace


def test_the_command_line_and_its_config_file_win_over_the_environment(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    env = {"VLLM_API_KEY": ENV_KEY, "VLLM_CPU_KVCACHE_SPACE": "7",
           "VLLM_LOGGING_LEVEL": "WARNING"}
    alone = parse(monkeypatch, env)
    assert cli.server_options_from_namespace(alone).api_key == (ENV_KEY,)
    assert alone.kv_cache_space_gb == 7.0
    assert cli.server_options_from_namespace(alone).log_level == "warning"
    flags = parse(monkeypatch, env, "--api-key", CLI_KEY, "--kv-cache-space-gb", "2",
                  "--log-level", "debug")
    assert cli.server_options_from_namespace(flags).api_key == (CLI_KEY,)
    assert flags.kv_cache_space_gb == 2.0
    assert cli.server_options_from_namespace(flags).log_level == "debug"
    config = tmp_path / "serve.yaml"
    config.write_text(f"api-key: {CLI_KEY}\n")
    assert cli.server_options_from_namespace(
        parse(monkeypatch, env, "--config", str(config))).api_key == (CLI_KEY,)
    monkeypatch.delenv("VLLM_API_KEY")
    assert cli.server_options_from_namespace(parse(monkeypatch, {})).api_key is None


#: How each honoured variable shows: a value, and a check of the parsed command line.
HONOURED: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "VLLM_API_KEY": ("k", lambda ns: ns.api_key == ["k"]),
    "VLLM_CPU_KVCACHE_SPACE": ("6", lambda ns: ns.kv_cache_space_gb == 6.0),
    "VLLM_CPU_OMP_THREADS_BIND": (
        f"{min(os.sched_getaffinity(0))}",
        lambda ns: ns.cpu_threads == 1
        and ns.vllm_environment.cpu_binding == {min(os.sched_getaffinity(0))}),
    "VLLM_CPU_NUM_OF_RESERVED_CPU": (
        "1", lambda ns: ns.cpu_threads == len(os.sched_getaffinity(0)) - 1
        if len(os.sched_getaffinity(0)) > 1 else True),
    "VLLM_LOGGING_LEVEL": ("Error", lambda ns: ns.uvicorn_log_level == "error"),
    "VLLM_LOGGING_PREFIX": ("[x] ", lambda ns: ns.vllm_environment.logging_prefix == "[x] "),
    "VLLM_LOG_STATS_INTERVAL": (
        "2.5", lambda ns: cli.server_options_from_namespace(ns).log_stats_interval == 2.5),
    "VLLM_CONFIGURE_LOGGING": ("0", lambda ns: not ns.vllm_environment.configure_logging),
    "VLLM_LOGGING_CONFIG_PATH": ("", lambda ns: ns.vllm_environment.logging_config
                                 == {"version": 1}),
    "VLLM_TARGET_DEVICE": ("CPU", lambda ns: ns.device == "cpu"),
    "VLLM_ENABLE_V1_MULTIPROCESSING": (
        "0", lambda ns: ns.vllm_environment.engine_process is False),
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": ("true", lambda ns: lora.runtime_updates_allowed()),
    "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": (
        "7", lambda ns: connection_options(ns)["keep_alive_timeout"] == 7.0),
    # triollm sends no statistics: accepted without a note or a warning
    "VLLM_NO_USAGE_STATS": ("1", lambda ns: not ns.vllm_environment.notes
                            and not ns.vllm_environment.unknown),
    "VLLM_DO_NOT_TRACK": ("1", lambda ns: not ns.vllm_environment.notes
                          and not ns.vllm_environment.unknown),
}


@pytest.mark.parametrize("name", sorted(VLLM_VARIABLES))
def test_each_vllm_variable_is_honoured_refused_or_noted(
        name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    variable = VLLM_VARIABLES[name]
    assert variable.reason
    if variable.kind == "honoured":
        value, check = HONOURED[name]
        if name == "VLLM_LOGGING_CONFIG_PATH":
            value = str(tmp_path / "logging.json")
            Path(value).write_text('{"version": 1}')
        if name == "VLLM_CPU_NUM_OF_RESERVED_CPU" and len(os.sched_getaffinity(0)) < 2:
            value = "0"
        assert check(parse(monkeypatch, {name: value}))
    elif variable.kind == "noted":
        monkeypatch.setenv(name, "1")
        environment = read_vllm_environment(os.environ)
        with caplog.at_level(logging.INFO, logger="triollm.vllm_env"):
            configure_logging(environment, "info")
        assert any(name in r.message and variable.reason in r.message
                   for r in caplog.records)
    else:
        for neutral in variable.neutral:
            monkeypatch.setenv(name, neutral.upper())
            read_vllm_environment(os.environ)  # accepted
        monkeypatch.setenv(name, "something-else")
        assert cli.main(["serve", "--optimization-level", "0"]) == 2
        error = capsys.readouterr().err
        assert f"{name}=something-else" in error and variable.reason in error


def test_every_honoured_variable_has_a_check() -> None:
    honoured = {name for name, v in VLLM_VARIABLES.items() if v.kind == "honoured"}
    assert honoured == set(HONOURED)


def test_docs_have_a_row_for_every_variable() -> None:
    guide = (Path(__file__).parents[1] / "docs" / "serving.md").read_text()
    rows = dict(re.findall(r"^\| `(VLLM_\w+)` \| (\w+)", guide, re.MULTILINE))
    assert rows == {name: v.kind for name, v in VLLM_VARIABLES.items()}


def test_an_unknown_vllm_variable_is_accepted_with_a_warning_naming_it(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("VLLM_NOT_A_VARIABLE", "secret-value")
    monkeypatch.setenv("VLLM_EMPTY_ONE", "")  # empty counts as unset
    environment = read_vllm_environment(os.environ)
    assert environment.unknown == ("VLLM_NOT_A_VARIABLE",)
    with caplog.at_level(logging.WARNING, logger="triollm.vllm_env"):
        configure_logging(environment, "info")
    warnings = [r.message for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "VLLM_NOT_A_VARIABLE" in warnings[0]
    assert "secret-value" not in warnings[0]


@pytest.mark.parametrize(("env", "message"), [
    ({"VLLM_CPU_KVCACHE_SPACE": "lots"}, "VLLM_CPU_KVCACHE_SPACE=lots: expected a number"),
    ({"VLLM_CPU_KVCACHE_SPACE": "-1"}, "not negative"),
    ({"VLLM_CPU_KVCACHE_SPACE": "inf"}, "must be a finite number"),
    ({"VLLM_LOGGING_LEVEL": "loud"}, "VLLM_LOGGING_LEVEL=loud"),
    ({"VLLM_TARGET_DEVICE": "tpu"}, "VLLM_TARGET_DEVICE=tpu"),
    ({"VLLM_CPU_OMP_THREADS_BIND": "0|100000"}, "not usable by this process"),
    ({"VLLM_CPU_OMP_THREADS_BIND": "zero"}, "expected auto, nobind or a core list"),
    ({"VLLM_CPU_OMP_THREADS_BIND": "100000"}, "not usable by this process"),
    ({"VLLM_CPU_NUM_OF_RESERVED_CPU": str(len(os.sched_getaffinity(0)))}, "leaves no core"),
    ({"VLLM_LOGGING_CONFIG_PATH": "/nonexistent.json"}, "VLLM_LOGGING_CONFIG_PATH"),
    ({"VLLM_LOGGING_CONFIG_PATH": "/x.json", "VLLM_CONFIGURE_LOGGING": "0"},
     "VLLM_CONFIGURE_LOGGING=0"),
    ({"VLLM_USE_V1": "0", "VLLM_ATTENTION_BACKEND": "FLASH_ATTN"},
     "VLLM_ATTENTION_BACKEND=FLASH_ATTN"),  # every refusal is named at once
])
def test_a_bad_value_stops_the_start_naming_the_variable(
        env: dict[str, str], message: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cli.main(["serve", "--optimization-level", "0"]) == 2
    error = capsys.readouterr().err
    assert message in error
    assert all(name in error for name in env if name != "VLLM_CONFIGURE_LOGGING")


@pytest.fixture
def restore_affinity() -> Iterator[None]:
    cores = os.sched_getaffinity(0)
    yield
    os.sched_setaffinity(0, cores)


def test_a_core_list_binds_the_process(monkeypatch: pytest.MonkeyPatch,
                                       restore_affinity: None) -> None:
    from triollm.vllm_env import apply_cpu_binding

    core = max(os.sched_getaffinity(0))
    namespace = parse(monkeypatch, {"VLLM_CPU_OMP_THREADS_BIND": str(core)})
    apply_cpu_binding(namespace.vllm_environment)
    assert os.sched_getaffinity(0) == {core}


@pytest.mark.parametrize(("path", "root_path", "authorization", "passes"), [
    ("/api/health", "/api", b"", True),
    ("/health", "/api", b"", True),
    ("/api/v1/models", "/api", b"", False),
    ("/api/v1/models", "/api", b"bearer k2", True),
    ("/v1/models", "", b"BEARER k1", True),
    ("/v1/models", "", b"Basic k1", False),
    ("/v1/models", "", b"Bearer k1 ", False),
    ("/healthz", "", b"", False),
])
def test_the_key_check_reads_open_paths_below_the_root_path_and_any_scheme_case(
        path: str, root_path: str, authorization: bytes, passes: bool) -> None:
    from types import SimpleNamespace

    from triollm.server.middleware import RequestLifetime

    state = SimpleNamespace(settings=ServerSettings(("m",), api_keys=("k1", "k2")))
    lifetime = RequestLifetime(cast(Any, None), cast(Any, state))
    scope = {"type": "http", "path": path, "root_path": root_path,
             "headers": [(b"authorization", authorization)] if authorization else []}
    assert lifetime._authorized(scope) is passes


def test_one_core_list_per_rank_binds_the_process_to_all_and_each_rank_to_its_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from triollm.vllm_env import rank_cpu_lists

    core = min(os.sched_getaffinity(0))
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"{core}|{core}"}
    namespace = parse(monkeypatch, env)
    assert namespace.vllm_environment.cpu_binding == {core}
    assert namespace.cpu_threads == 1
    assert rank_cpu_lists(env) == ((core,), (core,))
    assert rank_cpu_lists({"VLLM_CPU_OMP_THREADS_BIND": str(core)}) is None
