"""The plain types that cross the boundary between the engine and the model.

One step is one round trip: the scheduler's ``SchedulerOutput`` goes to a
``ModelRunner``, whose ``RunnerOutput`` comes back to the engine core. Both sides
import this module and nothing of each other. ``TorchModelRunner``
(``triollm.model.runners.torch_runner``) runs a transformers model;
``triollm.testing.FakeModelRunner`` is a deterministic stand-in for testing
applications without a model. No torch, no event loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from triollm.lora.request import LoRARequest
from triollm.pooling_params import PoolingParams
from triollm.sampling_params import SamplingParams
from triollm.structured_output.grammar import StructuredOutputRequest

__all__ = ["PENDING_TOKEN", "LoRAModelRunner", "ModelRunner", "RunnerOutput", "ScheduledRequest",
           "SchedulerOutput", "TokenLogprobs", "fill_pending_tokens"]

#: With asynchronous scheduling a step is scheduled while the previous one computes, so
#: the token that step samples for a request is not known yet: the scheduler writes this
#: in its place, and ``fill_pending_tokens`` replaces it before a runner sees the step.
PENDING_TOKEN = -1


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's share of a step: compute ``token_ids`` at positions
    ``start_position ...``; if ``sample``, a token is sampled after the last of them
    (for a pooling request, whose whole prompt comes in one step: the prompt is
    pooled). With ``num_draft_tokens`` (speculative decoding), the last that many of
    ``token_ids`` are drafts: a token is sampled after each position from the first
    up to the first draft that differs from it (``RunnerOutput.more_token_ids``)."""

    request_id: str
    token_ids: list[int]
    start_position: int
    block_table: list[int]
    sample: bool
    prompt_token_ids: list[int]
    #: Exactly one of the two is set: a generation request's or a pooling request's.
    sampling_params: SamplingParams | None
    pooling_params: PoolingParams | None = None
    #: The LoRA adapter this request's tokens run through (None: the base model).
    lora_request: LoRARequest | None = None
    #: The compiled constraint the sampled tokens must follow (None: unconstrained).
    structured_output: StructuredOutputRequest | None = None
    #: Draft tokens ending ``token_ids``, to verify (0: none).
    num_draft_tokens: int = 0
    #: Speculative decoding with a draft model: how many draft tokens the runner
    #: proposes after this step's tokens (``RunnerOutput.draft_token_ids``; 0: none).
    num_proposals: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def sampling(self) -> SamplingParams:
        """A generation request's sampling parameters (``ValueError`` for a pooling
        request)."""
        if self.sampling_params is None:
            raise ValueError(f"{self.request_id} is a pooling request: it does not sample")
        return self.sampling_params

    @property
    def wants_prompt_logprobs(self) -> bool:
        return (self.sampling_params is not None
                and self.sampling_params.prompt_logprobs is not None
                and self.start_position < len(self.prompt_token_ids) - 1)

    @property
    def wants_only_the_argmax(self) -> bool:
        """Whether all its generation needs of its logits is their argmax: greedy, no
        logprobs, and nothing that changes the logits before the argmax (a grammar,
        allowed tokens, a bias, bad words, penalties, min_tokens)."""
        params = self.sampling_params
        return (params is not None and params.is_greedy and params.logprobs is None
                and params.prompt_logprobs is None and params.structured_outputs is None
                and params.allowed_token_ids is None and not params.logit_bias
                and not params.bad_words and not params.has_penalties
                and params.min_tokens == 0)


@dataclass(frozen=True)
class SchedulerOutput:
    """Everything the model runner needs for one step."""

    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    #: Requests that finished or were aborted since the previous step: the runner
    #: drops whatever per-request state it keeps for them.
    finished_request_ids: list[str] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


def fill_pending_tokens(output: SchedulerOutput, sampled_token_ids: dict[str, int]) -> None:
    """Replace the ``PENDING_TOKEN`` that ends a request's tokens in ``output`` with the
    token the previous step sampled for it (``sampled_token_ids``: that step's
    ``RunnerOutput.sampled_token_ids``), in place. A request has at most one: only one
    step is ever scheduled ahead of the one computing.

    A request the previous step did not sample for is one whose part of it failed; the
    engine fails it before this step's outputs are read, so its slot gets token 0 only to
    keep the batch well-formed, and what the step computes for it is discarded.
    """
    for item in output.scheduled:
        token_ids = item.token_ids
        if token_ids and token_ids[-1] == PENDING_TOKEN:
            token_ids[-1] = sampled_token_ids.get(item.request_id, 0)


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
    #: For a request verified with draft tokens: the tokens after its sampled one, in
    #: order (its accepted drafts, then the target's own token), and their logprobs.
    #: So ``len(more_token_ids[id])`` of its drafts were accepted.
    more_token_ids: dict[str, list[int]] = field(default_factory=dict)
    more_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    #: A draft model's proposals for the next step of the requests that asked for them
    #: (``ScheduledRequest.num_proposals``).
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    #: For requests that asked for prompt logprobs: one entry per prompt position whose
    #: next prompt token was scored in this step, in order (the chosen token is that
    #: next prompt token).
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    #: Requests whose own part of the step failed (their sampling state, sampling or
    #: logprobs), with what went wrong: the engine fails those requests alone.
    failed: dict[str, str] = field(default_factory=dict)
    #: A pooling runner's result for each pooled request: a 1-D float32 torch tensor
    #: (typed loosely: this module imports no torch).
    pooled: dict[str, Any] = field(default_factory=dict)
    #: Seconds the step spent in the model forward, and in ``execute_model`` as a whole
    #: (None where a runner does not measure them).
    forward_seconds: float | None = None
    execute_seconds: float | None = None


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


@runtime_checkable
class LoRAModelRunner(ModelRunner, Protocol):
    """A runner that serves LoRA adapters (``enable_lora``)."""

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter (``ValueError`` if it does not fit the model); False if it
        was loaded already."""
        ...

    def remove_lora(self, lora_id: int) -> bool:
        ...

    def list_loras(self) -> set[int]:
        ...
