"""Request ids, made here and nowhere else.

A request has two ids. The client's (``random_request_id``: ``cmpl-…``, ``chatcmpl-…``,
or the one the client sent) names it in replies, logs and traces. The engine's
(``engine_request_id``) is the client's with a suffix unique in this process, so two
clients that send the same id never meet inside the engine. Inside, each ``EngineCore``
keys its requests and their samples by ids from an ``IdSequence`` of its own, so that
two engines given the same requests make the same ids.
"""

from __future__ import annotations

import itertools
import uuid

__all__ = ["IdSequence", "engine_request_id", "random_request_id"]


class IdSequence:
    """Ids ``request_id-N`` with N counting up from 0: no two of one sequence are equal,
    even against ids chosen to look like them (two results with different numbers
    differ after their last ``-``)."""

    def __init__(self) -> None:
        self._numbers = itertools.count()

    def next_id(self, request_id: str) -> str:
        """``request_id`` with this sequence's next number."""
        return f"{request_id}-{next(self._numbers)}"


_process_ids = IdSequence()


def random_request_id(prefix: str) -> str:
    """A fresh client-facing id: ``prefix-`` and 32 random hex digits."""
    return f"{prefix}-{uuid.uuid4().hex}"


def engine_request_id(request_id: str) -> str:
    """The id the engine knows a request by: ``request_id-N``, N a number this process
    never hands out twice. Unique even against ids chosen to look like ours: two results
    with different numbers differ after their last ``-``."""
    return _process_ids.next_id(request_id)
