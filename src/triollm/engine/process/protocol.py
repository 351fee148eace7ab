"""The messages between the server and an engine process, and their framing.

Both ends are our own processes started from the same interpreter and source, so a
message is a pickle behind a 4-byte length. What crosses:

* to the engine: ``AddRequest`` (one request, under the server's ``seq``), ``Abort``
  (by ``seq``), ``Call`` (a LoRA change, a prefix-cache reset, answered by ``Reply``);
* from the engine: ``Ready`` once the model is loaded, then one ``StepOutputs`` per
  engine step carrying every request's new outputs, failures and the step's stats,
  ``AddFailed`` for a request refused at the door, ``Reply``, ``EngineFailed`` before it
  exits on a failed step. While no step runs a ``StepOutputs`` with only the engine's
  statistics is its heartbeat: a silent engine is a hung one.
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from triollm.engine.args import AsyncEngineArgs
    from triollm.engine.inputs import PromptType
    from triollm.engine.stats import EngineStatistics, IterationStats
    from triollm.lora.request import LoRARequest
    from triollm.outputs import EngineOutput
    from triollm.pooling_params import PoolingParams
    from triollm.sampling_params import SamplingParams

__all__ = [
    "HEADER",
    "Abort",
    "AddFailed",
    "AddRequest",
    "Call",
    "EngineFailed",
    "EngineSetup",
    "FrameReader",
    "Ready",
    "Reply",
    "StepOutputs",
    "frame",
]

#: A frame's length, big-endian, before its pickle.
HEADER = struct.Struct(">I")


@dataclass(frozen=True)
class EngineSetup:
    """The first frame to an engine process: what it builds and how it logs."""

    args: AsyncEngineArgs
    #: This replica's index (vLLM's data-parallel rank, the ``engine`` label).
    index: int
    #: The cores it computes on (None: the process's own affinity).
    cores: frozenset[int] | None
    log_level: int
    log_format: str | None
    log_config: Mapping[str, Any] | None
    #: Whether the engine feeds stat loggers (the server's metrics and stats line).
    log_stats: bool
    stream_buffer_size: int


@dataclass(frozen=True)
class AddRequest:
    seq: int
    request_id: str
    prompt: PromptType
    params: SamplingParams | PoolingParams
    priority: int = 0
    lora_request: LoRARequest | None = None
    trace_headers: Mapping[str, str] | None = None
    is_latency_sensitive: bool = False
    slo: float | None = None
    ttft_slo: float | None = None


@dataclass(frozen=True)
class Abort:
    seq: int


@dataclass(frozen=True)
class Call:
    """An engine method called by name (one of ``CALLS``), answered by ``Reply``."""

    call_id: int
    method: str
    args: tuple[object, ...] = ()


@dataclass(frozen=True)
class Reply:
    call_id: int
    value: object = None
    error: BaseException | None = None


@dataclass(frozen=True)
class Ready:
    statistics: EngineStatistics


@dataclass(frozen=True)
class EngineFailed:
    """The engine's step failed: the process exits after this (the error as text)."""

    message: str


@dataclass(frozen=True)
class AddFailed:
    """A request refused before it entered the engine (bad input: ``ValueError``)."""

    seq: int
    error: BaseException


@dataclass
class StepOutputs:
    """What one engine step (or an abort) produced, for every request at once."""

    #: ``(seq, output)``, in the order the engine delivered them.
    outputs: list[tuple[int, EngineOutput]] = field(default_factory=list)
    #: ``(seq, message)`` of requests whose own part of the step failed.
    failures: list[tuple[int, str]] = field(default_factory=list)
    stats: list[IterationStats] = field(default_factory=list)
    statistics: EngineStatistics | None = None

    def __bool__(self) -> bool:
        return bool(self.outputs or self.failures or self.stats)


def frame(message: object) -> bytes:
    """One message as the bytes that cross the socket."""
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(body)) + body


class FrameReader:
    """Bytes as they arrive → whole messages."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> Iterator[object]:
        buffer = self._buffer
        buffer += data
        start = 0
        while len(buffer) - start >= HEADER.size:
            (size,) = HEADER.unpack_from(buffer, start)
            end = start + HEADER.size + size
            if len(buffer) < end:
                break
            yield pickle.loads(buffer[start + HEADER.size:end])
            start = end
        del buffer[:start]
