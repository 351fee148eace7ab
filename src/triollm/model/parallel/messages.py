"""A step as the other ranks receive it: one small message per step.

The driver sends the requests its forward runs, after its own checks (so every rank
runs the same batch): per request only what the forward reads, its new tokens, first
position, the blocks they touch, which logits it keeps and whether only their argmax
is wanted (for the LM head: quantization/rescored_head.py). Each rank rebuilds the
step's inputs from it with the driver's own ``prepare_batch``. No sampling state,
prompt, parameters or grammar crosses: only the driver samples. On a pipe a message is
framed by its length; an empty message tells a rank to stop.
"""

from __future__ import annotations

import pickle
import struct
from typing import BinaryIO

from triollm.sampling_params import SamplingParams
from triollm.step import ScheduledRequest

__all__ = ["STOP", "decode_step", "encode_step", "read_frame", "write_frame"]

#: The message that ends a rank's loop.
STOP = b""
_LENGTH = struct.Struct("<Q")
#: Which logits a request keeps: none, after its last token, after every token.
_KEEP_NONE, _KEEP_LAST, _KEEP_ALL = 0, 1, 2
#: The parameters a rank's request carries where the driver's wants only the argmax.
_ARGMAX_ONLY = SamplingParams(temperature=0)


def encode_step(items: list[ScheduledRequest], block_size: int) -> bytes:
    """The message for a forward over ``items`` (in their order)."""
    rows = []
    for item in items:
        if item.wants_prompt_logprobs or item.num_draft_tokens:
            keep = _KEEP_ALL
        else:
            keep = _KEEP_LAST if item.sample else _KEEP_NONE
        used = -(-(item.start_position + item.num_tokens) // block_size)
        rows.append((item.token_ids, item.start_position, item.block_table[:used], keep,
                     item.wants_only_the_argmax))
    return pickle.dumps(rows, protocol=pickle.HIGHEST_PROTOCOL)


def decode_step(message: bytes) -> list[ScheduledRequest]:
    """The requests of ``encode_step``'s message, as ``prepare_batch`` reads them."""
    items = []
    for token_ids, start, table, keep, argmax_only in pickle.loads(message):
        items.append(ScheduledRequest(
            request_id="", token_ids=token_ids, start_position=start, block_table=table,
            sample=keep != _KEEP_NONE, prompt_token_ids=[],
            sampling_params=_ARGMAX_ONLY if argmax_only else None,
            num_draft_tokens=len(token_ids) if keep == _KEEP_ALL else 0))
    return items


def write_frame(stream: BinaryIO, message: bytes) -> None:
    """``message`` on ``stream``, after its length."""
    stream.write(_LENGTH.pack(len(message)) + message)
    stream.flush()


def read_frame(stream: BinaryIO) -> bytes | None:
    """The next message on ``stream``; None at its end."""
    header = stream.read(_LENGTH.size)
    if len(header) < _LENGTH.size:
        return None
    (length,) = _LENGTH.unpack(header)
    message = stream.read(length)
    return message if len(message) == length else None
