"""The engine process's side of its requests: where its step loop delivers.

In the engine process, ``AsyncLLMEngine``'s step loop delivers to an ``Outbox`` instead
of per-request channels: every output, failure and step's stats goes into one pending
``StepOutputs``, tagged with the server's ``seq`` of its request, and the process sends
that as one message per step. The engine itself is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from triollm.engine.process.protocol import StepOutputs
from triollm.engine.stats import IterationStats
from triollm.outputs import EngineOutput

__all__ = ["Outbox", "OutboxEntry", "StatsForwarder"]


@dataclass
class OutboxEntry:
    """One request in flight (what ``RequestChannels.open`` returns in the engine
    process: the engine reads ``request_id`` and ``engine_id``)."""

    request_id: str
    engine_id: str
    seq: int


class Outbox:
    """``RequestChannels``' interface, collecting into one ``StepOutputs``."""

    def __init__(self, on_pending: Callable[[], None]) -> None:
        self.pending = StepOutputs()
        #: The ``seq`` that the next ``open`` records (set just before the engine adds it).
        self.next_seq = -1
        self._by_request: dict[str, OutboxEntry] = {}
        self._by_seq: dict[int, OutboxEntry] = {}
        self._on_pending = on_pending

    def __len__(self) -> int:
        return len(self._by_request)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_request

    def take(self) -> StepOutputs:
        pending, self.pending = self.pending, StepOutputs()
        return pending

    def by_seq(self, seq: int) -> OutboxEntry | None:
        return self._by_seq.get(seq)

    def open(self, request_id: str, output_kind: object, engine_id: str) -> OutboxEntry:
        entry = OutboxEntry(request_id, engine_id, self.next_seq)
        self._by_request[request_id] = entry
        self._by_seq[entry.seq] = entry
        return entry

    def _drop(self, entry: OutboxEntry) -> None:
        self._by_request.pop(entry.request_id, None)
        self._by_seq.pop(entry.seq, None)

    def deliver(self, output: EngineOutput) -> bool:
        entry = self._by_request.get(output.request_id)
        if entry is None:
            return False
        self.pending.outputs.append((entry.seq, output))
        if output.finished:
            self._drop(entry)
        self._on_pending()
        return output.finished

    def close(self, channel: OutboxEntry, final_outputs: list[EngineOutput]) -> None:
        if self._by_request.get(channel.request_id) is channel:
            self._drop(channel)
            self.pending.outputs.extend((channel.seq, output) for output in final_outputs)
            self._on_pending()

    def fail(self, request_id: str, engine_id: str, error: BaseException) -> None:
        entry = self._by_request.get(request_id)
        if entry is not None and entry.engine_id == engine_id:
            self._drop(entry)
            self.pending.failures.append((entry.seq, str(error)))
            self._on_pending()

    def get(self, request_id: str) -> OutboxEntry | None:
        return self._by_request.get(request_id)

    def fail_all(self, error: BaseException) -> None:
        """The engine stopped: the server learns it from the process's end."""
        self._by_request.clear()
        self._by_seq.clear()


class StatsForwarder:
    """A stat logger in the engine process: each step's stats go to the server."""

    def __init__(self, outbox: Outbox) -> None:
        self._outbox = outbox

    def record(self, stats: IterationStats) -> None:
        self._outbox.pending.stats.append(stats)
