"""``triollm::paged_attention``: the paged attention as one opaque op, for a compiled model.

``torch.compile`` traces the model's modules, not the step's Python metadata, so a
compiled model calls this op with the layer's index in the KV cache; the op finds the
metadata in ``forward_metadata``, set on the model thread for the length of the forward.

Where the decode steps run on the C kernel's one-call step and the C++ ops load
(cpu/kernel_ops.py), a compiled graph calls ``triollm::decode_attention`` instead
(``call_attention_from_cpp``, run by the compile backend), and
``forward_metadata`` begins a step of decodes only in it whenever the step is one the C
decode kernel takes in one call per layer (the same steps ``write_and_attend`` gives
it): each layer's call then costs the kernel and the dispatcher, not a Python function
and ctypes. Any other step's calls reach this op through the C++ one.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from triollm.model.attention.compute import write_and_attend
from triollm.model.attention.metadata import PagedAttentionMetadata
from triollm.model.cpu.decode import CpuDecodeKernel
from triollm.model.cpu.kernel_ops import (
    begin_decode_step,
    decode_attention_op,
    end_decode_step,
    kernel_ops_loaded,
    load_kernel_ops,
)
from triollm.model.ops import define_op

__all__ = ["call_attention_from_cpp", "forward_metadata", "in_compiled_forward",
           "paged_attention"]

_forward = threading.local()


@contextlib.contextmanager
def forward_metadata(metadata: PagedAttentionMetadata) -> Iterator[None]:
    """The step's metadata for a compiled forward, which cannot take it as a keyword:
    ``paged_attention`` (the custom op) reads it on this thread while the forward runs,
    and a step of decodes only begins in the C++ op (``decode_attention``)."""
    _forward.metadata = metadata
    begun = False
    try:
        # where the C++ ops are loaded, a compiled graph may call them (compiled here, or
        # loaded from artifacts compiled elsewhere)
        begun = kernel_ops_loaded() and _begin_in_cpp(metadata)
        yield
    finally:
        _forward.metadata = None
        if begun:
            end_decode_step()


def _begin_in_cpp(meta: PagedAttentionMetadata) -> bool:
    """Begin ``meta``'s step in the C++ op where ``write_and_attend`` would give each
    layer's call to the C kernel's one-call step."""
    kernel = meta.decode_kernel
    group = meta.one_call_group()
    if (group is None or meta.kv_cache is None or not isinstance(kernel, CpuDecodeKernel)
            or meta.decode_step != kernel.decode_step
            or group.start != 0 or group.end != meta.slot_mapping.numel()):
        return False
    return begin_decode_step(meta.kv_cache.keys, meta.kv_cache.values, meta.slot_mapping,
                             group.block_tables, group.context_lens, kernel.native_step)


def call_attention_from_cpp(graph: torch.fx.Graph) -> int:
    """In a graph traced by ``torch.compile``, make each ``paged_attention`` call a call
    of the C++ op ``triollm::decode_attention``, where the C++ ops load; returns how
    many."""
    calls = [node for node in graph.nodes
             if node.op == "call_function" and node.target is paged_attention]
    if not calls or not load_kernel_ops():
        return 0
    for node in calls:
        node.target = decode_attention_op()
    return len(calls)


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
