"""What a tokenizer worker process runs: long texts encoded away from the server.

Encoding a long text in a thread of the server's own process would still stall the
event loop: the tokenizer releases the GIL while it encodes, but freeing its result
(an object per token) and making Python lists of it hold the GIL in proportion to the
text. A worker process does all that on its own interpreter and sends back bytes, and
only as much as the caller can use: the count and the last ``keep`` ids, or the ids as
JSON. Each worker keeps the tokenizers it was sent, by key.
"""

from __future__ import annotations

import json
import pickle
from array import array
from collections import OrderedDict
from typing import Any

__all__ = ["encode_json", "encode_tail"]

#: Tokenizers by their key, the most recently used last.
_TOKENIZERS: OrderedDict[str, Any] = OrderedDict()
_KEEP_TOKENIZERS = 4


def _tokenizer(key: str, pickled: bytes | None) -> Any | None:
    tokenizer = _TOKENIZERS.get(key)
    if tokenizer is None and pickled is not None:
        tokenizer = _TOKENIZERS[key] = pickle.loads(pickled)  # our own bytes
        while len(_TOKENIZERS) > _KEEP_TOKENIZERS:
            _TOKENIZERS.popitem(last=False)
    if tokenizer is not None:
        _TOKENIZERS.move_to_end(key)
    return tokenizer


def encode_tail(key: str, pickled: bytes | None, text: str, add_special_tokens: bool,
                keep: int) -> tuple[int, bytes] | None:
    """The number of tokens of ``text`` and its last ``keep`` ids (int64 bytes); None
    when this process has no tokenizer ``key`` and ``pickled`` is None (ask again with
    the tokenizer)."""
    tokenizer = _tokenizer(key, pickled)
    if tokenizer is None:
        return None
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return len(ids), array("q", ids[-keep:]).tobytes()


def encode_json(key: str, pickled: bytes | None, text: str, add_special_tokens: bool
                ) -> tuple[int, bytes] | None:
    """The number of tokens of ``text`` and its ids as a JSON list; None as
    ``encode_tail``."""
    tokenizer = _tokenizer(key, pickled)
    if tokenizer is None:
        return None
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return len(ids), json.dumps(ids, separators=(",", ":")).encode()
