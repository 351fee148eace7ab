"""A JSON body whose text is not valid Unicode is refused before any route reads it.

JSON can spell a lone surrogate (``"\\ud800"``), which Python decodes into a ``str``
that no UTF-8 encoder takes: a response, a log line, a header or a tokenizer meeting
it would fail. So no such string enters: ``lone_surrogate_field`` finds the first one
(in a key or a value) and the request gets a 400 naming the field. Finding none costs
one regular-expression scan of the body; only a body with a candidate is decoded here.
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["LARGE_BODY_BYTES", "body_problem", "lone_surrogate_field"]

#: A body this large is checked in a worker thread: decoding it (a list of 300,000 stop
#: strings, say) costs the event loop tens of milliseconds.
LARGE_BODY_BYTES = 64 * 1024
#: Fields whose size the server bounds and a client can inflate cheaply: a large body
#: that breaks the bound is refused before FastAPI decodes and validates it on the loop.
_BOUNDED_LISTS = ("stop", "bad_words")

# A high surrogate escape not followed by a low one, or a low one not preceded by a
# high one. A properly paired escape (an emoji as ASCII JSON spells it) does not match;
# an escaped backslash before "ud800" may, and the decoded body then says.
_CANDIDATE = re.compile(
    rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])"
    rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}")


def lone_surrogate_field(body: bytes) -> str | None:
    """The path (``messages[0].content``) of the first JSON key or string holding a lone
    surrogate, ``"body"`` for a bare string; None when there is none or the body is not
    JSON (FastAPI answers that)."""
    # bytes.find is a fast scan; the regular expression (which holds the GIL) runs only
    # on a body that has a surrogate escape at all
    if (body.find(b"\\ud") < 0 and body.find(b"\\uD") < 0) or _CANDIDATE.search(body) is None:
        return None
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return _find(document)


def body_problem(body: bytes) -> tuple[str, str] | None:
    """(field, message) of what makes ``body`` a 400 before any route reads it: a lone
    surrogate, or, in a body of ``LARGE_BODY_BYTES`` or more, a ``stop`` or
    ``bad_words`` list past the server's bound. None when neither; a body that is not
    JSON is left to FastAPI."""
    field = lone_surrogate_field(body)
    if field is not None:
        return field, f"{field}: is not valid Unicode text (a lone surrogate)"
    if len(body) < LARGE_BODY_BYTES:
        return None
    from triollm.server.protocol.sampling import string_list_problem

    try:
        document = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(document, dict):
        return None
    for name in _BOUNDED_LISTS:
        problem = string_list_problem(document.get(name))
        if problem is not None:
            return name, f"{name}: {problem}"
    return None


def _find(document: Any) -> str | None:
    stack: list[tuple[Any, str]] = [(document, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not _encodable(value):
                return path or "body"
        elif isinstance(value, dict):
            children = []
            for key, item in value.items():
                child = f"{path}.{key}" if path else str(key)
                if not _encodable(key):
                    return _printable(child)
                children.append((item, child))
            stack.extend(reversed(children))
        elif isinstance(value, list):
            stack.extend(reversed([(item, f"{path}[{i}]") for i, item in enumerate(value)]))
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _printable(path: str) -> str:
    return path.encode("utf-8", "backslashreplace").decode("utf-8")
