"""``triollm::paged_attention``: the paged attention as one opaque op, for a compiled model.

``torch.compile`` traces the model's modules, not the step's Python metadata, so a
compiled model calls this op with the layer's index in the KV cache; the op finds the
metadata in ``forward_metadata``, set on the model thread for the length of the forward.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from triollm.model.attention.compute import write_and_attend
from triollm.model.attention.metadata import PagedAttentionMetadata
from triollm.model.ops import define_op

__all__ = ["forward_metadata", "in_compiled_forward", "paged_attention"]

_forward = threading.local()


@contextlib.contextmanager
def forward_metadata(metadata: PagedAttentionMetadata) -> Iterator[None]:
    """The step's metadata for a compiled forward, which cannot take it as a keyword:
    ``paged_attention`` (the custom op) reads it on this thread while the forward runs."""
    _forward.metadata = metadata
    try:
        yield
    finally:
        _forward.metadata = None


def in_compiled_forward() -> bool:
    """Whether a compiled forward runs on this thread (``forward_metadata`` is set): a
    compiled module's calls go to its compiled code only there (runners/compile.py)."""
    return getattr(_forward, "metadata", None) is not None


def _paged_attention_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer: int,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    meta: PagedAttentionMetadata | None = getattr(_forward, "metadata", None)
    if meta is None or meta.kv_cache is None:
        raise RuntimeError("triollm::paged_attention called outside forward_metadata")
    return write_and_attend(meta, meta.kv_cache.keys[layer], meta.kv_cache.values[layer],
                            query, key, value, scale, sliding_window, softcap)


def _paged_attention_fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          layer: int, scale: float, sliding_window: int | None,
                          softcap: float | None) -> torch.Tensor:
    return torch.empty_like(query)


#: The paged attention of the KV cache's layer ``layer`` as one opaque op, for a compiled
#: model (``torch.compile`` cannot trace the step's Python metadata): ``[H, T, D]`` in,
#: ``[Hq, T, D]`` out. It writes the layer's cache, which is not an argument: the cache
#: is the runner's, found through ``forward_metadata``.
paged_attention = define_op(
    "paged_attention(Tensor query, Tensor key, Tensor value, int layer, float scale, "
    "int? sliding_window, float? softcap) -> Tensor", _paged_attention_op,
    _paged_attention_fake)
