"""Which engine replica takes the next request: the one with the fewest requests
waiting and running (as vLLM's data-parallel load balancing), ties taken in turn."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["choose_replica"]


def choose_replica(loads: Sequence[int], after: int) -> int:
    """The index of the least loaded replica; among equals, the first after ``after``
    (the previous choice), so that equal replicas take requests in turn."""
    count = len(loads)
    if count == 0:
        raise ValueError("no replica to choose from")
    best = min(loads)
    for step in range(1, count + 1):
        index = (after + step) % count
        if loads[index] == best:
            return index
    raise AssertionError("unreachable")
