"""What the engine hands back: ``RequestOutput`` with one ``CompletionOutput`` per sample;
for pooling models, ``PoolingRequestOutput`` and its embedding, classification and score
views.

Shapes and names follow vLLM so code written against vLLM's outputs keeps working.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    import torch

__all__ = [
    "ClassificationOutput",
    "ClassificationRequestOutput",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "EngineOutput",
    "Logprob",
    "PoolingOutput",
    "PoolingRequestOutput",
    "RequestMetrics",
    "RequestOutput",
    "SampleLogprobs",
    "ScoringOutput",
    "ScoringRequestOutput",
]


@dataclass
class Logprob:
    """The log-probability of one token, its 1-based rank, and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


#: One dict per position: token id -> Logprob (the chosen token and the top-k).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class RequestMetrics:
    """Timestamps (``time.time()`` seconds) of one request's life, and how it did
    against its latency targets."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    #: The request's targets: seconds per output token, seconds to the first token.
    slo: float | None = None
    ttft_slo: float | None = None
    #: Mean seconds between output tokens after the first (set when it finishes with at
    #: least two tokens).
    time_per_output_token: float | None = None
    #: Whether it met every target it had (set when it finishes without abort; None if
    #: it had no target).
    slo_attained: bool | None = None
    #: Seconds in the model forward and in the model runner over the steps it took part
    #: in (vLLM's names; measured only with ``collect_detailed_traces`` "model" and
    #: "worker", else None).
    model_forward_time: float | None = None
    model_execute_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    def judge_slo(self) -> bool | None:
        """Whether the targets are met by what has been measured (None without targets)."""
        if self.slo is None and self.ttft_slo is None:
            return None
        ttft = self.time_to_first_token
        if self.ttft_slo is not None and (ttft is None or ttft > self.ttft_slo):
            return False
        tpot = self.time_per_output_token
        return not (self.slo is not None and tpot is not None and tpot > self.slo)


@dataclass
class CompletionOutput:
    """One sample of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  #: "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  #: the stop string or token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request as delivered to its caller.

    With ``n > 1``, as in vLLM: a streamed output (DELTA, CUMULATIVE) carries only the
    samples that changed since the last one (matched by ``CompletionOutput.index``),
    each sample's finish exactly once; a FINAL_ONLY output carries all of them.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    extra: dict[str, object] = field(default_factory=dict, repr=False)


@dataclass
class PoolingOutput:
    """A pooling model's result for one prompt: a 1-D float32 tensor (an embedding, or
    a classifier's label scores)."""

    data: torch.Tensor


_O = TypeVar("_O")


@dataclass
class PoolingRequestOutput(Generic[_O]):
    """One pooling request's result (a pooling request has a single, final output)."""

    request_id: str
    outputs: _O
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    finished: bool = True
    metrics: RequestMetrics | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @classmethod
    def from_base(cls, output: PoolingOutput) -> EmbeddingOutput:
        if output.data.ndim != 1:
            raise ValueError("an embedding is a 1-D tensor")
        return cls(output.data.tolist())

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    """Label probabilities (or logits, with ``use_activation=False``), by label index."""

    probs: list[float]

    @classmethod
    def from_base(cls, output: PoolingOutput) -> ClassificationOutput:
        if output.data.ndim != 1:
            raise ValueError("classification scores are a 1-D tensor")
        return cls(output.data.tolist())

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    """The relevance score of one text pair: a cross-encoder's probability, or the
    cosine similarity of two embeddings."""

    score: float

    @classmethod
    def from_base(cls, output: PoolingOutput) -> ScoringOutput:
        if output.data.numel() != 1:
            raise ValueError("a score is a single value")
        return cls(float(output.data.reshape(-1)[0]))


def _view(output: PoolingRequestOutput[Any], outputs: _O) -> PoolingRequestOutput[_O]:
    return PoolingRequestOutput(output.request_id, outputs, output.prompt_token_ids,
                                output.num_cached_tokens, output.finished, output.metrics)


class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    @classmethod
    def from_base(cls, output: PoolingRequestOutput[PoolingOutput]) -> EmbeddingRequestOutput:
        view = _view(output, EmbeddingOutput.from_base(output.outputs))
        return cls(**vars(view))


class ClassificationRequestOutput(PoolingRequestOutput[ClassificationOutput]):
    @classmethod
    def from_base(cls, output: PoolingRequestOutput[PoolingOutput]
                  ) -> ClassificationRequestOutput:
        view = _view(output, ClassificationOutput.from_base(output.outputs))
        return cls(**vars(view))


class ScoringRequestOutput(PoolingRequestOutput[ScoringOutput]):
    @classmethod
    def from_base(cls, output: PoolingRequestOutput[PoolingOutput]) -> ScoringRequestOutput:
        view = _view(output, ScoringOutput.from_base(output.outputs))
        return cls(**vars(view))


#: What a step delivers: generated text and tokens, or a pooling model's result.
EngineOutput = RequestOutput | PoolingRequestOutput[PoolingOutput]
