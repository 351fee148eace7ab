"""What a client sent, made fit for a log line: short, and encodable.

A request's values (its id, the names of fields nobody defines, an adapter's name) reach
log lines. Each one is cut to ``MAX_LOGGED_CHARS`` characters and a list to
``MAX_LOGGED_ITEMS`` entries, each saying how much was left out, so one request writes a
bounded amount to the log whatever it sends; a lone surrogate is written as its escape,
so any handler can encode the line.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection

__all__ = ["MAX_LOGGED_CHARS", "MAX_LOGGED_ERROR_CHARS", "MAX_LOGGED_ITEMS",
           "MAX_LOGGED_PARAMS_CHARS", "clipped", "clipped_names"]

#: The most characters of one client-given value a log line shows.
MAX_LOGGED_CHARS = 200
#: The most entries of one client-given list a log line shows.
MAX_LOGGED_ITEMS = 20
#: The most characters of a request's sampling parameters a request log line shows.
MAX_LOGGED_PARAMS_CHARS = 2000
#: The most characters of a request's failure a log line shows.
MAX_LOGGED_ERROR_CHARS = 1000


def clipped(value: object, limit: int = MAX_LOGGED_CHARS) -> str:
    """``value`` as a log line shows it: at most ``limit`` characters of its text, with
    how many there were when it is longer, lone surrogates as escapes."""
    text = value if isinstance(value, str) else str(value)
    shown = text[:limit]
    if len(text) > limit:
        shown += f"... ({len(text)} characters)"
    return shown.encode("utf-8", "backslashreplace").decode("utf-8")


def clipped_names(names: Collection[str], limit: int = MAX_LOGGED_ITEMS) -> str:
    """A set of names as a log line shows it: the first ``limit`` in sorted order, each
    ``clipped``, and how many more there are."""
    first = heapq.nsmallest(limit, names)
    shown = "[" + ", ".join(repr(clipped(name)) for name in first) + "]"
    if len(names) > limit:
        shown += f" and {len(names) - limit} more"
    return shown
