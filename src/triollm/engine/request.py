"""One request's state inside the engine: its tokens, how many have their KV computed,
and where it is in its life. No torch, no event loop."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from triollm.outputs import PromptLogprobs, RequestMetrics, SampleLogprobs
from triollm.pooling_params import PoolingParams
from triollm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from triollm.engine.detokenizer import IncrementalDetokenizer
    from triollm.lora.request import LoRARequest
    from triollm.structured_output.grammar import StructuredOutputRequest

__all__ = ["FinishReason", "Request", "RequestStatus"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH_CAPPED = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        # Identity tests: Enum hashing is a Python-level call, and this runs per token.
        return (self is RequestStatus.FINISHED_STOPPED
                or self is RequestStatus.FINISHED_LENGTH_CAPPED
                or self is RequestStatus.FINISHED_ABORTED)

FinishReason = str


class Request:
    """A single sequence being generated (one sample of a user request), or a prompt
    to pool (``pooling_params`` set, ``sampling_params`` None).

    ``num_computed_tokens`` catches up with ``num_tokens`` step by step; when they meet,
    the next step samples a token. Preemption resets it to zero (recompute).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None,
        arrival_time: float,
        *,
        pooling_params: PoolingParams | None = None,
        priority: int = 0,
        index: int = 0,
        is_latency_sensitive: bool = False,
        slo: float | None = None,
        ttft_slo: float | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        lora_version: int = 0,
        structured_output: StructuredOutputRequest | None = None,
    ) -> None:
        self.request_id = request_id
        #: Prefix-cache blocks are shared only between requests with the same salt.
        self.cache_salt = cache_salt
        #: The LoRA adapter it runs with (None: the base model), and that adapter's id
        #: and weights version, which also key its prefix-cache blocks.
        self.lora_request = lora_request
        self.adapter_key: tuple[int, int] | None = (
            None if lora_request is None else (lora_request.lora_int_id, lora_version))
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.pooling_params = pooling_params
        #: The compiled constraint its output follows (structured outputs), if any.
        self.structured_output = structured_output
        self.priority = priority
        self.index = index
        #: Co-serving: a latency-sensitive request, its target seconds per output token
        #: and, optionally, to its first token.
        self.is_latency_sensitive = is_latency_sensitive
        self.slo = slo
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.metrics = RequestMetrics(arrival_time=arrival_time, slo=slo, ttft_slo=ttft_slo)
        self.detokenizer: IncrementalDetokenizer | None = None
        wants_logprobs = sampling_params is not None and sampling_params.logprobs is not None
        self.logprobs: SampleLogprobs | None = [] if wants_logprobs else None
        self.prompt_logprobs: PromptLogprobs | None = (
            [None] if sampling_params is not None
            and sampling_params.prompt_logprobs is not None else None
        )
        self.cumulative_logprob: float | None = 0.0 if wants_logprobs else None
        self.num_delivered_tokens = 0
        self.num_delivered_chars = 0
        #: Whether an output carrying its finish reason has been made: a finished
        #: sample is reported once, not in every later output of its request.
        self.finish_delivered = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.status.value if self.status.is_finished else None

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.value}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")
