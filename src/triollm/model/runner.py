"""The boundary between the engine and whatever computes tokens.

``ModelRunner`` is a small protocol: the engine hands it a ``SchedulerOutput`` and gets
a ``RunnerOutput`` back. ``TorchModelRunner`` (``triollm.model.torch_runner``) runs a
transformers model; ``triollm.testing.FakeModelRunner`` is a deterministic stand-in for
testing applications without a model. This module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from triollm.engine.scheduler import SchedulerOutput

__all__ = ["ModelRunner", "RunnerOutput", "TokenLogprobs"]


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Log-probabilities at one position: the chosen token first, then the top-k."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


@dataclass(frozen=True)
class RunnerOutput:
    """What one step produced, keyed by request id."""

    #: One token for every scheduled request whose ``sample`` flag was set.
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    #: For requests that asked for prompt logprobs: one entry per prompt position whose
    #: next prompt token was scored in this step, in order (the chosen token is that
    #: next prompt token).
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


@runtime_checkable
class ModelRunner(Protocol):
    """Computes one engine step. Called from a single thread, one step at a time."""

    #: How many KV-cache blocks (of the engine's block size) the runner holds.
    num_kv_blocks: int

    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """Compute the scheduled tokens and sample where asked."""
        ...

    def shutdown(self) -> None:
        """Release the model and its cache. Called once, from the same thread."""
        ...
