"""``triollm serve``'s flags for what connections may hold (server/admission.py and
hypercorn's config): uvicorn's ``--limit-concurrency`` and ``--timeout-keep-alive``
(``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, as vLLM), vLLM's ``--h11-*`` flags,
``--body-read-timeout`` and ``--client-cpu-share``."""

from __future__ import annotations

import argparse
import os
from typing import Any

from triollm.server.limits import (
    DEFAULT_BODY_READ_TIMEOUT,
    DEFAULT_CLIENT_CPU_SHARE,
    DEFAULT_H11_MAX_HEADER_COUNT,
    DEFAULT_H11_MAX_INCOMPLETE_EVENT_SIZE,
    DEFAULT_KEEP_ALIVE_TIMEOUT,
    DEFAULT_LIMIT_CONCURRENCY,
)

__all__ = ["add_connection_arguments", "connection_options"]


def add_connection_arguments(group: argparse._ArgumentGroup) -> None:
    """Add the connection flags to ``triollm serve``'s server group."""
    group.add_argument("--limit-concurrency", type=_count, default=DEFAULT_LIMIT_CONCURRENCY,
                       help="HTTP requests served at once (/health, /ping and /metrics "
                            "not counted); one more gets 503; 0: no limit (default: "
                            f"{DEFAULT_LIMIT_CONCURRENCY})")
    group.add_argument("--body-read-timeout", type=float, default=DEFAULT_BODY_READ_TIMEOUT,
                       help="seconds a request's body may take to arrive after its "
                            "headers, else 408 and the connection closed; 0: no limit "
                            f"(default: {DEFAULT_BODY_READ_TIMEOUT:g})")
    group.add_argument("--client-cpu-share", type=_share, default=DEFAULT_CLIENT_CPU_SHARE,
                       help="the share of one core that the server's own work for one "
                            "client address may take (answers the engine does not serve, "
                            "and tokenizer-worker time); its answers past it are held; "
                            "0: no limit "
                            f"(default: {DEFAULT_CLIENT_CPU_SHARE:g})")
    group.add_argument("--timeout-keep-alive", type=float, default=None,
                       help="seconds an idle connection (or one still sending its "
                            "headers) stays open (default: VLLM_HTTP_TIMEOUT_KEEP_ALIVE, "
                            f"else {DEFAULT_KEEP_ALIVE_TIMEOUT:g})")
    group.add_argument("--h11-max-incomplete-event-size", type=int,
                       default=DEFAULT_H11_MAX_INCOMPLETE_EVENT_SIZE,
                       help="the most bytes of a request line and its headers (default: "
                            f"{DEFAULT_H11_MAX_INCOMPLETE_EVENT_SIZE}, as vLLM)")
    group.add_argument("--h11-max-header-count", type=int,
                       default=DEFAULT_H11_MAX_HEADER_COUNT,
                       help="a request with more headers gets 431 (default: "
                            f"{DEFAULT_H11_MAX_HEADER_COUNT}, as vLLM)")


def connection_options(namespace: argparse.Namespace) -> dict[str, Any]:
    """The ``ServerOptions`` fields the connection flags set."""
    return {"limit_concurrency": namespace.limit_concurrency or None,
            "body_read_timeout": namespace.body_read_timeout or None,
            "client_cpu_share": namespace.client_cpu_share or None,
            "keep_alive_timeout": _keep_alive_timeout(namespace.timeout_keep_alive),
            "h11_max_incomplete_event_size": namespace.h11_max_incomplete_event_size,
            "h11_max_header_count": namespace.h11_max_header_count}


def _keep_alive_timeout(flag: float | None) -> float:
    """``--timeout-keep-alive``, else vLLM's ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, else 5 s."""
    if flag is not None:
        return flag
    value = os.environ.get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE")
    if value is None:
        return DEFAULT_KEEP_ALIVE_TIMEOUT
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"VLLM_HTTP_TIMEOUT_KEEP_ALIVE={value!r}: expected seconds") from None


def _share(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1024:
        raise argparse.ArgumentTypeError(f"expected a share of a core, 0 (no limit) or "
                                         f"more, got {text}")
    return value


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 (no limit) or more, got {value}")
    return value
