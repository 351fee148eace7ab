"""vLLM's environment variables (``VLLM_*``) under ``triollm serve`` and ``triollm generate``.

A vLLM deployment moved over keeps its environment, so a variable set there is never
dropped without a word. Each one in ``VLLM_VARIABLES`` is

- ``honoured``: mapped onto the flag or setting that does the same here (the command
  line, ``--config`` included, wins over the environment);
- ``refused``: the start stops with the reason, unless the value asks for what triollm
  does anyway (``VLLM_USE_V1=1``), as ``refused_flags`` does for flags;
- ``noted``: accepted with a logged note, for a variable that only steers a part of vLLM
  triollm does not have (its processes' ports, multimodal fetches), so ignoring it
  changes nothing a user relies on.

A ``VLLM_*`` variable the table does not know is accepted with a warning naming it. A
variable set to the empty string counts as unset. docs/serving.md has the table.
"""

from __future__ import annotations

import json
import logging
import logging.config
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["VLLM_VARIABLES", "VllmEnvironment", "VllmVariable", "apply_cpu_binding",
           "configure_logging", "rank_cpu_lists", "read_vllm_environment"]

logger = logging.getLogger(__name__)

_OFF = ("0", "false")
_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_LOG_FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"


@dataclass(frozen=True)
class VllmVariable:
    """How triollm takes a ``VLLM_*`` variable: ``honoured`` (``reason`` says onto
    what), ``refused`` unless its value (lower case) is one of ``neutral``, or ``noted``
    (accepted; ``reason`` is logged)."""

    kind: Literal["honoured", "refused", "noted"]
    reason: str
    neutral: tuple[str, ...] = ()


def _honoured(reason: str) -> VllmVariable:
    return VllmVariable("honoured", reason)


def _refused(reason: str, neutral: tuple[str, ...] = ()) -> VllmVariable:
    return VllmVariable("refused", reason, neutral)


def _noted(reason: str, *names: str) -> dict[str, VllmVariable]:
    return {name: VllmVariable("noted", reason) for name in names}


_ONE_PROCESS = ("triollm's engine processes talk to the server over socket pairs of their "
                "own (no addresses, ports, RPC paths or serialization settings to choose)")
_TEXT_ONLY = "it only steers multimodal inputs, which triollm refuses (text-only models)"
_NO_STATS = "triollm sends no usage statistics"

VLLM_VARIABLES: dict[str, VllmVariable] = {
    "VLLM_API_KEY": _honoured("the API key, as --api-key (which wins when both are "
                              "given)"),
    "VLLM_CPU_KVCACHE_SPACE": _honoured("KV-cache GiB on CPU, as --kv-cache-space-gb (0: "
                                        "the default)"),
    "VLLM_CPU_OMP_THREADS_BIND": _honoured(
        "a CPU list (0-31,40) runs the process on those cores, one compute thread per "
        "core (--cpu-threads); one list per tensor-parallel rank (0-1|2-3) binds each "
        "rank to its list; auto and nobind keep triollm's default (every usable core, "
        "unbound)"),
    "VLLM_CPU_NUM_OF_RESERVED_CPU": _honoured("--cpu-threads is the usable cores less "
                                              "this many"),
    "VLLM_LOGGING_LEVEL": _honoured("the log level, as --uvicorn-log-level (--log-level "
                                    "or --uvicorn-log-level on the command line wins)"),
    "VLLM_LOGGING_PREFIX": _honoured("put in front of every log line"),
    "VLLM_LOG_STATS_INTERVAL": _honoured("seconds between statistics lines (a positive "
                                         "number; --disable-log-stats still turns them "
                                         "off)"),
    "VLLM_CONFIGURE_LOGGING": _honoured("0: triollm serve leaves Python's logging as it "
                                        "is"),
    "VLLM_LOGGING_CONFIG_PATH": _honoured("a JSON file of logging.config.dictConfig, "
                                          "applied instead of triollm's format, by the "
                                          "engine processes too"),
    "VLLM_TARGET_DEVICE": _honoured("cpu or cuda: the default of --device"),
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": _honoured(
        "true or 1 serves /v1/load_lora_adapter and /v1/unload_lora_adapter"),
    "VLLM_NO_USAGE_STATS": _honoured(_NO_STATS),
    "VLLM_DO_NOT_TRACK": _honoured(_NO_STATS),
    "VLLM_USE_MODELSCOPE": _refused("models load from the Hugging Face Hub or a local "
                                    "directory, not from ModelScope", _OFF),
    "VLLM_ATTENTION_BACKEND": _refused("attention runs triollm's own paged kernels "
                                       "(--enforce-eager turns the compiled ones off)"),
    "VLLM_USE_V1": _refused("triollm's engine is vLLM V1's design; the V0 engine has no "
                            "counterpart", ("1", "true")),
    "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH": _refused(
        "when the engine dies the server answers 503 for a short grace, then exits "
        "non-zero so that a supervisor restarts it", _OFF),
    "VLLM_DEBUG_LOG_API_SERVER_RESPONSE": _refused("responses are not logged", _OFF),
    "VLLM_SERVER_DEV_MODE": _refused(
        "/reset_prefix_cache is always served (behind the API key); vLLM's other "
        "development routes (/sleep, /wake_up, /collective_rpc, /server_info) are not "
        "implemented", _OFF),
    "VLLM_ENABLE_V1_MULTIPROCESSING": _honoured(
        "1 (the default): triollm serve runs its engine in a process of its own "
        "(engine/process/); 0: in the server's process (with --data-parallel-size above "
        "1 every replica has its own process whatever it says)"),
    "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": _honoured("seconds an idle connection stays open, as "
                                              "--timeout-keep-alive (the flag wins; "
                                              "connection_flags.py reads it)"),
    "VLLM_TORCH_PROFILER_DIR": _refused("the profiler routes (/start_profile, "
                                        "/stop_profile) are not implemented"),
    "VLLM_PLUGINS": _refused("vLLM's plugins do not exist in triollm"),
    "VLLM_LORA_RESOLVER_CACHE_DIR": _refused(
        "LoRA resolvers are not implemented: load adapters with --lora-modules or "
        "/v1/load_lora_adapter"),
    "VLLM_TRACE_FUNCTION": _refused("function tracing is not implemented", ("0",)),
    "VLLM_LOG_BATCHSIZE_INTERVAL": _refused("batch sizes are not logged (the statistics "
                                            "line and /metrics count requests)",
                                            ("-1",)),
    "VLLM_CPU_SGL_KERNEL": _refused("triollm runs its own CPU kernels", _OFF),
    "VLLM_USE_FLASHINFER_SAMPLER": _refused("sampling runs triollm's own sampler", _OFF),
    **_noted("it is vLLM's address and port for its own processes (the API's are --host "
             "and --port); " + _ONE_PROCESS, "VLLM_HOST_IP", "VLLM_PORT",
             "VLLM_LOOPBACK_IP"),
    **_noted(_ONE_PROCESS, "VLLM_RPC_TIMEOUT", "VLLM_RPC_BASE_PATH",
             "VLLM_WORKER_MULTIPROC_METHOD",
             "VLLM_ALLOW_INSECURE_SERIALIZATION"),
    **_noted("triollm has no step watchdog: a step runs to its end, as with the large "
             "values this is set to; a step that fails ends the server at once",
             "VLLM_ENGINE_ITERATION_TIMEOUT_S", "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"),
    **_noted("a --max-model-len over the model's context is still an error naming it",
             "VLLM_ALLOW_LONG_MAX_MODEL_LEN"),
    **_noted("it places vLLM's own caches; triollm's is $TRIOLLM_CACHE",
             "VLLM_CACHE_ROOT", "VLLM_CONFIG_ROOT", "VLLM_ASSETS_CACHE",
             "VLLM_XLA_CACHE_PATH"),
    **_noted("it labels vLLM's usage statistics; " + _NO_STATS, "VLLM_USAGE_SOURCE",
             "VLLM_USAGE_STATS_SERVER"),
    **_noted(_TEXT_ONLY, "VLLM_IMAGE_FETCH_TIMEOUT", "VLLM_VIDEO_FETCH_TIMEOUT",
             "VLLM_AUDIO_FETCH_TIMEOUT", "VLLM_MM_INPUT_CACHE_GIB",
             "VLLM_VIDEO_LOADER_BACKEND", "VLLM_MEDIA_URL_ALLOW_REDIRECTS"),
    **_noted("it selects vLLM's IPEX MoE packing; triollm does not use IPEX",
             "VLLM_CPU_MOE_PREPACK"),
    **_noted("it only silences vLLM's deprecation warnings", "VLLM_NO_DEPRECATION_WARNING"),
    **_noted("it is read when vLLM is built from source", "VLLM_USE_PRECOMPILED"),
}


@dataclass(frozen=True)
class VllmEnvironment:
    """What the ``VLLM_*`` variables ask of ``triollm serve``/``generate``."""

    #: Defaults for the command line's flags, by argparse ``dest`` (the command line wins).
    defaults: dict[str, Any] = field(default_factory=dict)
    #: Run on these cores only (``VLLM_CPU_OMP_THREADS_BIND``).
    cpu_binding: frozenset[int] | None = None
    configure_logging: bool = True
    logging_prefix: str = ""
    #: Seconds between statistics lines (``VLLM_LOG_STATS_INTERVAL``).
    log_stats_interval: float = 10.0
    #: ``VLLM_LOGGING_CONFIG_PATH``'s ``dictConfig``.
    logging_config: dict[str, Any] | None = None
    #: ``VLLM_ENABLE_V1_MULTIPROCESSING``: the engine in a process of its own (None:
    #: triollm's default).
    engine_process: bool | None = None
    #: Logged at start: the noted variables, and the unknown ones (as warnings).
    notes: tuple[str, ...] = ()
    unknown: tuple[str, ...] = ()


def read_vllm_environment(environ: Mapping[str, str]) -> VllmEnvironment:
    """Read every ``VLLM_*`` variable of ``environ``; raises ``ValueError`` naming each
    refused one (or one whose value is invalid) and why."""
    given = {name: value.strip() for name, value in environ.items()
             if name.startswith("VLLM_") and value.strip()}
    problems: list[str] = []
    notes: list[str] = []
    unknown: list[str] = []
    for name in sorted(given):
        variable = VLLM_VARIABLES.get(name)
        value = given[name]
        if variable is None:
            unknown.append(name)
        elif variable.kind == "noted":
            notes.append(f"{name} has no effect in triollm: {variable.reason}")
        elif variable.kind == "refused" and value.lower() not in variable.neutral:
            allowed = (f" (only {' or '.join(variable.neutral)} is accepted)"
                       if variable.neutral else "")
            problems.append(f"{name}={value[:100]}: not supported by triollm: "
                            f"{variable.reason}{allowed}")
    try:
        environment = _honoured_settings(given, environ.get("VLLM_LOGGING_PREFIX", ""),
                                         tuple(notes), tuple(unknown))
    except ValueError as error:
        problems.append(str(error))
        environment = VllmEnvironment()
    if problems:
        raise ValueError("; ".join(problems))
    return environment


def _honoured_settings(given: Mapping[str, str], prefix: str, notes: tuple[str, ...],
                       unknown: tuple[str, ...]) -> VllmEnvironment:
    defaults: dict[str, Any] = {}
    if "VLLM_API_KEY" in given:
        defaults["api_key"] = [given["VLLM_API_KEY"]]
    if "VLLM_CPU_KVCACHE_SPACE" in given:
        space = _number("VLLM_CPU_KVCACHE_SPACE", given["VLLM_CPU_KVCACHE_SPACE"], float)
        if space > 0:
            defaults["kv_cache_space_gb"] = space
    if "VLLM_LOGGING_LEVEL" in given:
        level = given["VLLM_LOGGING_LEVEL"].lower()
        level = "warning" if level == "warn" else level
        if level not in _LOG_LEVELS:
            raise ValueError(f"VLLM_LOGGING_LEVEL={given['VLLM_LOGGING_LEVEL'][:100]}: "
                             f"expected one of {', '.join(_LOG_LEVELS)} (any case)")
        defaults["uvicorn_log_level"] = level
    if "VLLM_TARGET_DEVICE" in given:
        device = given["VLLM_TARGET_DEVICE"].lower()
        if device not in ("cpu", "cuda"):
            raise ValueError(f"VLLM_TARGET_DEVICE={device[:100]}: not supported by "
                             f"triollm: it runs on cpu or cuda")
        defaults["device"] = device
    bind = given.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    ranks = [_cpu_binding(part) for part in bind.split("|")] if "|" in bind else []
    binding = (frozenset().union(*(r or () for r in ranks)) if ranks
               else _cpu_binding(bind))
    usable = len(binding) if binding is not None else len(_usable_cores())
    if binding is not None:
        # one list per rank: each rank computes on its own list's cores
        defaults["cpu_threads"] = min(len(r or ()) for r in ranks) if ranks else usable
    if "VLLM_CPU_NUM_OF_RESERVED_CPU" in given:
        reserved = _number("VLLM_CPU_NUM_OF_RESERVED_CPU",
                           given["VLLM_CPU_NUM_OF_RESERVED_CPU"], int)
        if reserved >= usable:
            raise ValueError(f"VLLM_CPU_NUM_OF_RESERVED_CPU={reserved}: leaves no core of "
                             f"the {usable} usable to compute on")
        if reserved:
            defaults["cpu_threads"] = usable - reserved
    interval = _number("VLLM_LOG_STATS_INTERVAL",
                       given.get("VLLM_LOG_STATS_INTERVAL", "10"), float)
    if not interval > 0:
        raise ValueError(f"VLLM_LOG_STATS_INTERVAL={interval}: expected a positive number "
                         f"of seconds")
    configure = _number("VLLM_CONFIGURE_LOGGING", given.get("VLLM_CONFIGURE_LOGGING", "1"),
                        int) != 0
    config_path = given.get("VLLM_LOGGING_CONFIG_PATH")
    if config_path is not None and not configure:
        raise ValueError("VLLM_LOGGING_CONFIG_PATH is given but VLLM_CONFIGURE_LOGGING=0 "
                         "says not to configure logging (as vLLM, triollm refuses both)")
    engine_process = None
    if "VLLM_ENABLE_V1_MULTIPROCESSING" in given:
        engine_process = _number("VLLM_ENABLE_V1_MULTIPROCESSING",
                                 given["VLLM_ENABLE_V1_MULTIPROCESSING"], int) != 0
    return VllmEnvironment(
        engine_process=engine_process, defaults=defaults, cpu_binding=binding,
        configure_logging=configure, logging_prefix=prefix, log_stats_interval=interval,
        logging_config=_logging_config(config_path) if config_path else None,
        notes=notes, unknown=unknown)


def _number(name: str, text: str, kind: type[int] | type[float]) -> Any:
    try:
        value = kind(text)
    except ValueError:
        raise ValueError(f"{name}={text[:100]}: expected a number") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name}={text[:100]}: must be a finite number, not negative")
    return value


def _usable_cores() -> frozenset[int]:
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


def _cpu_binding(text: str) -> frozenset[int] | None:
    """``0-3,8`` → {0, 1, 2, 3, 8}; ``auto`` and ``nobind`` → None."""
    if text.lower() in ("auto", "nobind"):
        return None
    problem = f"VLLM_CPU_OMP_THREADS_BIND={text[:100]}: "
    cores: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            cores.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise ValueError(problem + "expected auto, nobind or a core list such as "
                                   "0-31,40") from None
    if not cores:
        raise ValueError(problem + "no core")
    missing = cores - _usable_cores()
    if missing:
        raise ValueError(problem + f"core(s) {sorted(missing)} are not usable by this "
                                   f"process")
    return frozenset(cores)


def rank_cpu_lists(environ: Mapping[str, str]) -> tuple[tuple[int, ...], ...] | None:
    """``VLLM_CPU_OMP_THREADS_BIND``'s core lists, one per tensor-parallel rank
    (``0-1|2-3``); None unless it holds several (``read_vllm_environment`` checked it)."""
    text = environ.get("VLLM_CPU_OMP_THREADS_BIND", "").strip()
    if "|" not in text:
        return None
    lists = [_cpu_binding(part) for part in text.split("|")]
    return tuple(tuple(sorted(cores or ())) for cores in lists)


def _logging_config(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as file:
            config = json.load(file)
    except (OSError, ValueError) as error:
        raise ValueError(f"VLLM_LOGGING_CONFIG_PATH={path[:200]}: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"VLLM_LOGGING_CONFIG_PATH={path[:200]}: expected a JSON object "
                         f"(logging.config.dictConfig's schema)")
    return config


def configure_logging(environment: VllmEnvironment, level: str) -> None:
    """Set up Python's logging as the environment asks (``VLLM_CONFIGURE_LOGGING``,
    ``VLLM_LOGGING_CONFIG_PATH``, ``VLLM_LOGGING_PREFIX``), then log its notes; raises
    ``ValueError`` where the logging configuration file does not apply."""
    if environment.logging_config is not None:
        try:
            logging.config.dictConfig(environment.logging_config)
        except (ValueError, TypeError, AttributeError, ImportError) as error:
            raise ValueError(f"VLLM_LOGGING_CONFIG_PATH: {error}") from None
    elif environment.configure_logging:
        logging.basicConfig(level=level.upper(),
                            format=environment.logging_prefix + _LOG_FORMAT)
    for note in environment.notes:
        logger.info("%s", note)
    for name in environment.unknown:
        logger.warning("%s is set but is not a vLLM variable triollm knows: it has no "
                       "effect", name)


def apply_cpu_binding(environment: VllmEnvironment) -> None:
    """Run this process (its threads to come) on ``VLLM_CPU_OMP_THREADS_BIND``'s cores."""
    if environment.cpu_binding is not None:
        os.sched_setaffinity(0, environment.cpu_binding)
        logger.info("VLLM_CPU_OMP_THREADS_BIND: running on cores %s",
                    ",".join(map(str, sorted(environment.cpu_binding))))
