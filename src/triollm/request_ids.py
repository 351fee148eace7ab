"""Request ids, made here and nowhere else.

A request has two ids. The client's (``random_request_id``: ``cmpl-…``, ``chatcmpl-…``,
or the one the client sent) names it in replies, logs and traces. The engine's
(``engine_request_id``) is the client's with a suffix unique in this process, so two
clients that send the same id never meet inside the engine.
"""

from __future__ import annotations

import itertools
import uuid

__all__ = ["engine_request_id", "random_request_id"]

_numbers = itertools.count()


def random_request_id(prefix: str) -> str:
    """A fresh client-facing id: ``prefix-`` and 32 random hex digits."""
    return f"{prefix}-{uuid.uuid4().hex}"


def engine_request_id(request_id: str) -> str:
    """The id the engine knows a request by: ``request_id-N``, N a number this process
    never hands out twice. Unique even against ids chosen to look like ours: two results
    with different numbers differ after their last ``-``."""
    return f"{request_id}-{next(_numbers)}"
