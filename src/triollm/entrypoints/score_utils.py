"""Scoring text pairs: which pairs a score or rerank request means, and how a pair
becomes one prompt for a cross-encoder.

A cross-encoder (a sequence classifier with one label) reads both texts in one prompt,
tokenized as a pair (``[CLS] a [SEP] b [SEP]`` with BERT's segment ids); its score is
the sigmoid of its logit. An embedding model scores a pair by the cosine similarity of
the two embeddings. No torch, no event loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from triollm.engine.inputs import PromptType, TokensPrompt
from triollm.sampling_params import check_text

if TYPE_CHECKING:
    from triollm.config import PoolerConfig
    from triollm.pooling_params import PoolingTask

__all__ = ["PairTokenizer", "ScoringPlan", "cosine_similarity", "cross_encoder_prompt",
           "plan_scoring", "score_pairs"]


class PairTokenizer(Protocol):
    def __call__(self, text: str, text_pair: str, **kwargs: Any) -> Any: ...


def _texts(name: str, data: str | Sequence[str]) -> list[str]:
    texts = [data] if isinstance(data, str) else list(data)
    if not texts:
        raise ValueError(f"{name}: must not be empty")
    for index, text in enumerate(texts):
        if not isinstance(text, str) or not text:
            raise ValueError(f"{name}[{index}]: must be a non-empty string")
        check_text(f"{name}[{index}]", text)
    return texts


def score_pairs(data_1: str | Sequence[str], data_2: str | Sequence[str], *,
                names: tuple[str, str] = ("data_1", "data_2")) -> list[tuple[str, str]]:
    """vLLM's pairing: one text against each of the others, or two lists of the same
    length zipped."""
    first, second = _texts(names[0], data_1), _texts(names[1], data_2)
    if len(first) == 1:
        return [(first[0], text) for text in second]
    if len(first) != len(second):
        raise ValueError(f"{names[1]}: {len(second)} texts do not pair with the "
                         f"{len(first)} texts of {names[0]} (give one, or as many)")
    return list(zip(first, second, strict=True))


def cross_encoder_prompt(tokenizer: PairTokenizer, text_1: str, text_2: str, *,
                         max_length: int, truncate_prompt_tokens: int | None = None
                         ) -> TokensPrompt:
    """One pair as one prompt, with segment ids when the tokenizer makes them. A pair
    longer than ``max_length`` is truncated the way the tokenizer does for
    sentence-transformers' ``CrossEncoder`` (the longer text first)."""
    limit = max_length if truncate_prompt_tokens in (None, -1) else min(
        max_length, int(truncate_prompt_tokens))
    encoded = tokenizer(text_1, text_pair=text_2, truncation="longest_first",
                        max_length=limit)
    prompt = TokensPrompt(prompt_token_ids=list(encoded["input_ids"]))
    token_types = encoded.get("token_type_ids") if hasattr(encoded, "get") else None
    if token_types is not None:
        prompt["token_type_ids"] = list(token_types)
    return prompt


def cosine_similarity(a: Any, b: Any) -> float:
    """The cosine similarity of two 1-D tensors (duck-typed: no torch import here)."""
    denominator = float(a.norm()) * float(b.norm())
    return float(a.float() @ b.float()) / denominator if denominator else 0.0


@dataclass(frozen=True)
class ScoringPlan:
    """What a score request pools, and how the pooled vectors become one score per pair."""

    prompts: list[PromptType]
    #: An embedding model's plan: each pair's two indices into ``prompts`` (each text is
    #: embedded once). None for a cross-encoder, whose prompt ``i`` is pair ``i``.
    pair_indices: list[tuple[int, int]] | None

    @property
    def task(self) -> PoolingTask:
        return "classify" if self.pair_indices is None else "embed"

    def scores(self, vectors: Sequence[Any]) -> list[float]:
        """One score per pair from the pooled vectors, in ``prompts`` order."""
        if self.pair_indices is None:
            return [float(vector.reshape(-1)[0]) for vector in vectors]
        return [cosine_similarity(vectors[a], vectors[b]) for a, b in self.pair_indices]


def plan_scoring(pooler: PoolerConfig, tokenizer: PairTokenizer,
                 pairs: list[tuple[str, str]], *, max_length: int,
                 truncate_prompt_tokens: int | None = None) -> ScoringPlan:
    """A cross-encoder (a classifier with one label) pools each pair as one prompt; an
    embedding model embeds each distinct text. ``ValueError`` for a classifier with
    several labels."""
    if pooler.task == "classify":
        if pooler.embedding_size != 1:
            raise ValueError(f"model: a classifier with {pooler.embedding_size} labels is not "
                             f"a cross-encoder (one label); scoring needs a cross-encoder or "
                             f"an embedding model (use classify for label scores)")
        return ScoringPlan([cross_encoder_prompt(
            tokenizer, a, b, max_length=max_length,
            truncate_prompt_tokens=truncate_prompt_tokens) for a, b in pairs], None)
    texts = list(dict.fromkeys(text for pair in pairs for text in pair))
    index = {text: i for i, text in enumerate(texts)}
    return ScoringPlan(list(texts), [(index[a], index[b]) for a, b in pairs])
