"""The engines a server serves: ``AsyncLLMEngine`` in its process, or ``EngineClient``
over engine processes (engine/process/client.py). Both have the surface the routes use."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    from triollm.engine.async_engine import AsyncLLMEngine
    from triollm.engine.process.client import EngineClient

__all__ = ["ServedEngine"]

ServedEngine: TypeAlias = "AsyncLLMEngine | EngineClient"
