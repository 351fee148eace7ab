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

__all__ = ["lone_surrogate_field"]

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
    if _CANDIDATE.search(body) is None:
        return None
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return _find(document)


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
