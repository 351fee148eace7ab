"""``PoolingParams``: what one embedding or classification request asks of a pooling
model (vLLM's class, ``vllm.pooling_params``). No torch, no event loop."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from triollm.config import POOLING_TASKS, PoolerConfig, PoolingTask
from triollm.sampling_params import RequestOutputKind

#: ``PoolingTask`` is defined with ``PoolerConfig`` (triollm.config) and exported here
#: too, where vLLM's users look for it.
__all__ = ["POOLING_TASKS", "PoolingParams", "PoolingTask"]


def _fail(field_name: str, message: str) -> ValueError:
    return ValueError(f"{field_name}: {message}")


@dataclass
class PoolingParams:
    """Parameters of one pooling request.

    ``use_activation`` normalizes embeddings (``embed``) or turns a classifier's logits
    into probabilities (``classify``: sigmoid for one label, softmax for several);
    None takes the model's default (True unless ``pooler_config`` says otherwise).
    ``normalize`` is older vLLM's name for it on embeddings. ``dimensions`` keeps the
    first ``dimensions`` values of a Matryoshka embedding (then normalizes).
    ``truncate_prompt_tokens`` keeps the last k prompt tokens (-1: as many as the
    model takes). ``task`` defaults to the model's own task.
    """

    use_activation: bool | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    task: PoolingTask | None = None
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY
    #: Set by the engine for text pairs of cross-encoders that have segment embeddings
    #: (BERT's ``token_type_ids``): one per prompt token.
    token_type_ids: list[int] | None = None

    def __post_init__(self) -> None:
        for name in ("use_activation", "normalize"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise _fail(name, f"must be true, false or null, got {value!r}")
        if self.dimensions is not None and (
                not isinstance(self.dimensions, int) or isinstance(self.dimensions, bool)
                or self.dimensions < 1):
            raise _fail("dimensions", f"must be an integer >= 1, got {self.dimensions!r}")
        truncate = self.truncate_prompt_tokens
        if truncate is not None and (not isinstance(truncate, int) or isinstance(truncate, bool)
                                     or (truncate < 1 and truncate != -1)):
            raise _fail("truncate_prompt_tokens", f"must be an integer >= 1, or -1 for the "
                        f"model's limit, got {truncate!r}")
        if self.task is not None and self.task not in POOLING_TASKS:
            raise _fail("task", f"must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")
        if (self.normalize is not None and self.use_activation is not None
                and self.normalize != self.use_activation):
            raise _fail("normalize", "contradicts use_activation (normalize is its older name)")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise _fail("output_kind", f"must be a RequestOutputKind, got {self.output_kind!r}")

    def clone(self) -> PoolingParams:
        return replace(self, token_type_ids=None if self.token_type_ids is None
                       else list(self.token_type_ids))

    def resolved(self, pooler: PoolerConfig, model_name: str) -> PoolingParams:
        """A copy with the model's defaults filled in, checked against what the model
        can do. Raises ``ValueError`` naming the field."""
        task = self.task or pooler.task
        if task != pooler.task:
            raise _fail("task", f"{model_name!r} is a {pooler.task} model; it cannot serve "
                        f"{task!r} requests")
        use_activation = self.use_activation
        if use_activation is None:
            use_activation = self.normalize
        if self.normalize is not None and task != "embed":
            raise _fail("normalize", "applies to embeddings only; use use_activation")
        if use_activation is None:
            use_activation = pooler.use_activation
        dimensions = self.dimensions if self.dimensions is not None else pooler.dimensions
        if self.dimensions is not None:
            if task != "embed":
                raise _fail("dimensions", "applies to embeddings only")
            if not pooler.is_matryoshka:
                raise _fail("dimensions", f"{model_name!r} does not support Matryoshka "
                            f"embeddings; leave dimensions unset (got {self.dimensions})")
            if self.dimensions > pooler.embedding_size:
                raise _fail("dimensions", f"must be in [1, {pooler.embedding_size}] for "
                            f"{model_name!r}, got {self.dimensions}")
            allowed = pooler.matryoshka_dimensions
            if allowed and self.dimensions not in allowed:
                raise _fail("dimensions", f"{model_name!r} supports the Matryoshka "
                            f"dimensions {list(allowed)}, got {self.dimensions}")
        return replace(self.clone(), task=task, use_activation=use_activation,
                       normalize=None, dimensions=dimensions)

    def __repr__(self) -> str:
        shown = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                 if f.name != "token_type_ids" and getattr(self, f.name) is not None]
        return f"PoolingParams({', '.join(shown)})"
