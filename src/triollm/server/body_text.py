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

__all__ = ["LARGE_BODY_BYTES", "body_problem", "lone_surrogate_field", "string_list_problem"]

#: A body this large is checked in the tokenizer worker process: decoding it (a list of
#: 300,000 stop strings, say) holds the GIL for tens of milliseconds, in any thread.
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
    if not _may_hold_a_lone_surrogate(body):
        return None
    document = _decoded(body)
    return None if document is _NOT_JSON else _find(document)


def body_problem(body: bytes, max_items: int, max_chars: int) -> tuple[str, str] | None:
    """(field, message) of what makes ``body`` a 400 before any route reads it: a lone
    surrogate, or a ``stop`` or ``bad_words`` list of more than ``max_items`` strings
    or ``max_chars`` characters. None when neither; a body that is not JSON is left to
    FastAPI. Standard library only: the tokenizer worker process runs it on a large
    body (server/tokenizer_process.py), so that decoding it takes no GIL from the
    server."""
    if _may_hold_a_lone_surrogate(body):
        document = _decoded(body)
        field = None if document is _NOT_JSON else _find(document)
        if field is not None:
            return field, f"{field}: is not valid Unicode text (a lone surrogate)"
    elif len(body) >= LARGE_BODY_BYTES:
        document = _decoded(body)
    else:
        return None
    if not isinstance(document, dict):
        return None
    for name in _BOUNDED_LISTS:
        problem = string_list_problem(document.get(name), max_items, max_chars)
        if problem is not None:
            return name, f"{name}: {problem}"
    return None


def string_list_problem(value: object, max_items: int, max_chars: int) -> str | None:
    """What is wrong with a ``stop`` or ``bad_words`` value past ``max_items`` strings
    or ``max_chars`` characters in all (None: nothing)."""
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list):
        return None
    bound = f"at most {max_items} strings of {max_chars} characters in all"
    if len(values) > max_items:
        return f"{bound}; got {len(values)} strings"
    chars = sum(len(v) for v in values if isinstance(v, str))
    if chars <= max_chars:
        return None
    return f"{bound}; got {chars} characters"


_NOT_JSON = object()


def _may_hold_a_lone_surrogate(body: bytes) -> bool:
    # bytes.find is a fast scan; the regular expression (slower, and holding the GIL)
    # runs only on a body with a surrogate escape at all
    return ((body.find(b"\\ud") >= 0 or body.find(b"\\uD") >= 0)
            and _CANDIDATE.search(body) is not None)


def _decoded(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return _NOT_JSON


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
