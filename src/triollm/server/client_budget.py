"""``ClientBudget``: how much of the server's CPU one client's answers may take.

A request the engine serves costs the model's time, which the scheduler shares between
requests. Every other answer (``/health``, ``/v1/models``, ``/tokenize``, any error)
costs the server's own CPU alone, and one client that sends such requests in a loop, as
fast as they come back, takes that CPU from the model on a small machine: its threads
compute on fewer cores while anything else runs (model/cpu/threads.py).

So each client address may spend ``share`` of one core. Each answer is charged its
estimated CPU time when its response starts (``estimated_cost``): the seconds its work
took in the server's worker processes (``charge_work``: a long text's tokenization, a
request's own chat template, a large body's check), and for an answer the engine did not
serve, a fixed cost and its body's bytes too. An address that runs more than
``ALLOWANCE_SECONDS`` ahead of its share has the start of each charged answer held until
it is back within it, so a client that sends one request after another gets ``share``
of a core. One answer's charge is capped at ``ONE_ANSWER_SECONDS`` of holding, and a
request that arrives while its address is further behind than one client in series can
be (several connections at once) waits before its body is read. An answer the engine
served with no worker time costs nothing here, so an honest client at the same address
keeps its pace. A worker call that runs past the client's allowance is paced to its
share as it runs (server/worker_pace.py), and that time is not charged again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, MutableMapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

__all__ = ["ALLOWANCE_SECONDS", "BODY_SECONDS_PER_BYTE", "ONE_ANSWER_SECONDS",
           "REQUEST_SECONDS", "BudgetStatistics", "ClientBudget", "RequestWork",
           "charge_work", "client_of", "current_work", "estimated_cost", "note_engine_work",
           "served_by_engine", "track_work"]

#: Estimated server CPU seconds of one request (measured: 1.3-1.9 ms for /health,
#: /v1/models and a refused chat request on a 2-core Xeon), and of each body byte
#: (reading and parsing an 8 MB body took 55 ms).
REQUEST_SECONDS = 0.002
BODY_SECONDS_PER_BYTE = 7e-9
#: How far (in seconds of holding) a client may run ahead of its share before answers
#: are held, and the most one answer may add.
ALLOWANCE_SECONDS = 2.0
ONE_ANSWER_SECONDS = 30.0
#: How far behind an address may fall in all (several answers at once).
MOST_BEHIND_SECONDS = 4 * ONE_ANSWER_SECONDS
#: Addresses kept before those that owe nothing are forgotten.
_PRUNE_AT = 1024
_ENGINE_WORK = "triollm.engine_work"
_ROUNDING_SECONDS = 1e-9


@dataclass(frozen=True)
class BudgetStatistics:
    """What ``ClientBudget`` has done so far."""

    #: Addresses it remembers (those that owe time, and recent ones).
    clients: int
    #: Answers it held, and their seconds held in all.
    answers_held: int
    seconds_held: float


class ClientBudget:
    """Per client address, the server CPU its answers took, against ``share`` of a core.

    ``charge`` records an answer and says how long it must be held; ``start_wait`` says
    how long a new request must wait before it is read. Plain arithmetic on a clock:
    the caller does the waiting."""

    def __init__(self, share: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        if not share > 0:
            raise ValueError(f"share: expected a fraction of a core above 0, got {share}")
        self.share = share
        self._clock = clock
        self._lock = threading.Lock()
        #: Per address, the time at which its answers so far are paid for.
        self._paid_until: dict[str, float] = {}
        self._prune_at = _PRUNE_AT
        self._answers_held = 0
        self._seconds_held = 0.0

    def charge(self, client: str, cpu_seconds: float) -> float:
        """Charge ``client`` one answer's ``cpu_seconds``; returns the seconds its start
        is to be held (0 within the allowance). Thread-safe: a worker thread charges the
        work of a call its request abandoned."""
        with self._lock:
            return self._charge(client, cpu_seconds)

    def _charge(self, client: str, cpu_seconds: float) -> float:
        now = self._clock()
        owed = min(cpu_seconds / self.share, ONE_ANSWER_SECONDS)
        paid_until = min(max(now, self._paid_until.get(client, now)) + owed,
                         now + MOST_BEHIND_SECONDS)
        self._paid_until[client] = paid_until
        self._forget_settled(now)
        hold = paid_until - now - ALLOWANCE_SECONDS
        return hold if hold > _ROUNDING_SECONDS else 0.0  # not a float sum's last bits

    def note_held(self, seconds: float) -> None:
        """Count an answer that was held ``seconds``."""
        self._answers_held += 1
        self._seconds_held += seconds

    def behind(self, client: str) -> float:
        """Seconds until ``client``'s answers so far are paid for at its share."""
        with self._lock:
            return max(0.0, self._paid_until.get(client, 0.0) - self._clock())

    def start_wait(self, client: str) -> float:
        """Seconds a new request from ``client`` waits before it is read: how far its
        address is behind beyond what one client in series can be."""
        return max(0.0, self.behind(client) - ALLOWANCE_SECONDS - ONE_ANSWER_SECONDS)

    def statistics(self) -> BudgetStatistics:
        return BudgetStatistics(clients=len(self._paid_until),
                                answers_held=self._answers_held,
                                seconds_held=self._seconds_held)

    def _forget_settled(self, now: float) -> None:
        if len(self._paid_until) < self._prune_at:
            return
        self._paid_until = {client: until for client, until in self._paid_until.items()
                            if until > now}
        self._prune_at = max(_PRUNE_AT, 2 * len(self._paid_until))


@dataclass
class RequestWork:
    """What one request made the server's worker processes do, in seconds, and whose
    budget it is charged to."""

    worker_seconds: float = 0.0
    #: Of those, the seconds its calls were paced to the client's share for
    #: (server/worker_pace.py): paid for as they ran.
    paced_seconds: float = 0.0
    budget: ClientBudget | None = None
    client: str = ""


_current_work: ContextVar[RequestWork | None] = ContextVar("triollm_request_work",
                                                           default=None)


def track_work(work: RequestWork) -> None:
    """Make ``charge_work`` in this task (and those it starts) count into ``work``."""
    _current_work.set(work)


def current_work() -> RequestWork | None:
    """The request being served's ``RequestWork`` (None outside a tracked request)."""
    return _current_work.get()


def charge_work(seconds: float) -> None:
    """Count ``seconds`` of a worker process's time to the request being served (if the
    server tracks one: nothing outside a request)."""
    work = _current_work.get()
    if work is not None:
        work.worker_seconds += seconds


def estimated_cost(*, served_by_engine: bool, failed: bool, body_bytes: int,
                   worker_seconds: float) -> float:
    """An answer's estimated server CPU seconds. One the engine served is the model's
    work, which the scheduler shares: only its time in worker processes is charged (a
    long prompt's tokenization, a request's own chat template). Any other: a fixed cost,
    its body's bytes and its time in worker processes."""
    if served_by_engine and not failed:
        return worker_seconds
    return REQUEST_SECONDS + body_bytes * BODY_SECONDS_PER_BYTE + worker_seconds


def client_of(scope: MutableMapping[str, Any]) -> str:
    """The address a request came from (one key for a Unix socket's clients)."""
    client = scope.get("client")
    return str(client[0]) if client else ""


def note_engine_work(scope: MutableMapping[str, Any]) -> None:
    """Mark a request as handed to the engine (its answer is the engine's work)."""
    scope[_ENGINE_WORK] = True


def served_by_engine(scope: MutableMapping[str, Any]) -> bool:
    return bool(scope.get(_ENGINE_WORK))
