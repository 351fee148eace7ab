"""Helpers shared by the async tests."""

from __future__ import annotations

import time

import anyio


async def run_ticker(lateness: list[float], period: float = 0.001) -> None:
    """Sleep ``period`` in a loop forever, recording how late each wake-up was."""
    while True:
        start = time.perf_counter()
        await anyio.sleep(period)
        lateness.append(time.perf_counter() - start - period)
