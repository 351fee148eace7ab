"""The requests in flight in one ``EngineCore``, by the callers' ids and the engine's.

A caller names its request; inside, everything is keyed by the ids the engine makes
(``request_ids.IdSequence``): one for the request (a ``ParentRequest``) and one for
each of its samples (a ``Request``). A caller's id maps to the engine id of its request
in flight, so a name may not be reused while that request runs, and an abort by engine
id reaches only its own request.
"""

from __future__ import annotations

from collections.abc import Iterable

from triollm.engine.output_processor import ParentRequest
from triollm.engine.request import Request

__all__ = ["RequestRegistry"]


class RequestRegistry:
    """Requests by engine id, samples by engine id, and each caller's id."""

    def __init__(self) -> None:
        self._parents: dict[str, ParentRequest] = {}
        self._engine_ids: dict[str, str] = {}
        self._requests: dict[str, Request] = {}
        self._parent_of: dict[str, ParentRequest] = {}

    def __len__(self) -> int:
        return len(self._parents)

    def in_flight(self, request_id: str) -> bool:
        """Whether a request under this caller's id is in flight."""
        return request_id in self._engine_ids

    def add(self, parent: ParentRequest) -> None:
        self._parents[parent.engine_id] = parent
        self._engine_ids[parent.request_id] = parent.engine_id
        for child in parent.children:
            self._requests[child.request_id] = child
            self._parent_of[child.request_id] = parent

    def forget(self, parent: ParentRequest) -> bool:
        """Stop tracking a request and its samples; False if it was not tracked."""
        tracked = self._parents.pop(parent.engine_id, None) is not None
        if self._engine_ids.get(parent.request_id) == parent.engine_id:
            del self._engine_ids[parent.request_id]
        for child in parent.children:
            self._requests.pop(child.request_id, None)
            self._parent_of.pop(child.request_id, None)
        return tracked

    def sample(self, engine_id: str) -> Request | None:
        """The sample under an engine id (None once its request is forgotten)."""
        return self._requests.get(engine_id)

    def parent_of(self, engine_id: str) -> ParentRequest:
        """The request a tracked sample belongs to."""
        return self._parent_of[engine_id]

    def engine_ids(self, request_ids: Iterable[str]) -> list[str]:
        """The engine ids of the callers' ids in flight (the others are skipped)."""
        return [self._engine_ids[i] for i in request_ids if i in self._engine_ids]

    def parents(self, engine_ids: Iterable[str]) -> list[ParentRequest]:
        """The requests in flight under these engine ids, each once (unknown ids are
        skipped)."""
        found: dict[str, ParentRequest] = {}
        for engine_id in engine_ids:
            parent = self._parents.get(engine_id)
            if parent is not None:
                found[engine_id] = parent
        return list(found.values())

    def request_ids(self) -> list[str]:
        """The callers' ids of the requests in flight."""
        return list(self._engine_ids)
