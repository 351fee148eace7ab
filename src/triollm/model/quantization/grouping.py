"""Quantized layers that read one input (a Llama layer's q, k and v projections; its
gate and up ones), multiplied in one call where the model is compiled, as
cpu/packed_linear.py does for bf16 layers.

``group_quantized_layers`` watches a forward (model/shared_input.py) and, for each run
of layers on one input whose kernels are triollm's own (the AVX2, AVX-512 or VNNI
kernel: blocks of 16 outputs, so a group's weight is its members' one after another)
with the same layout, group size and input order, moves the members' packed weights
and scales into one tensor each, of which every member's become views: nothing is
stored twice. The group's kernel is registered under a handle of its own for as long
as its first member lives. ``fuse_quantized_calls``, run on the graph
``torch.compile`` traces, replaces the members' ``quantized_linear`` calls on one input
by one call over the group and a slice of its result for each: a Llama layer makes 4
calls instead of 7.
"""

from __future__ import annotations

import copy
import weakref

import torch

from triollm.model.cpu.helpers import drain_pools
from triollm.model.quantization.avx2_kernels import Avx2Int4Kernel, Avx2Int8Kernel
from triollm.model.quantization.linear import QuantizedLinear, quantized_linear, register_kernel
from triollm.model.shared_input import fuse_grouped_calls, runs_on_one_input

__all__ = ["fuse_quantized_calls", "group_quantized_layers"]

#: (member handles, in call order) -> (the group's handle, each member's out_features)
_groups: dict[tuple[int, ...], tuple[int, tuple[int, ...]]] = {}


def _groupable(layer: QuantizedLinear) -> bool:
    kernel = layer.kernel
    return (isinstance(kernel, Avx2Int8Kernel)
            or (isinstance(kernel, Avx2Int4Kernel) and kernel.permutation is None))


def _same_kind(run: list[QuantizedLinear]) -> bool:
    first = run[0].kernel
    return all(type(layer.kernel) is type(first)
               and layer.kernel.gemm is first.gemm  # type: ignore[attr-defined]
               and getattr(layer.kernel, "group_size", 0) == getattr(first, "group_size", 0)
               for layer in run) and len({layer.bias is None for layer in run}) == 1


@torch.no_grad()
def group_quantized_layers(calls: list[tuple[torch.Tensor, QuantizedLinear]]) -> int:
    """Group the runs of quantized layers ``calls`` (``recording_calls``) shows called
    one after another on one input, where their kernels allow (see the module's
    docstring); the model must not be serving. Returns how many groups were made."""
    grouped = 0
    seen: set[int] = set()
    drain_pools()  # no pool helper still reads a weight about to be moved
    for run in runs_on_one_input(calls, _groupable):
        handles = tuple(layer.handle for layer in run)
        if handles in _groups or seen & set(handles) or not _same_kind(run):
            continue
        seen.update(handles)
        kernels: list[Avx2Int4Kernel | Avx2Int8Kernel] = [
            layer.kernel for layer in run]  # type: ignore[misc]
        group = copy.copy(kernels[0])
        group.weight = torch.cat([kernel.weight for kernel in kernels])
        group.scales = torch.cat([kernel.scales for kernel in kernels])
        group.out_features = sum(kernel.out_features for kernel in kernels)
        group.nbytes = group.weight.nbytes + group.scales.nbytes
        blocks = 0
        for kernel in kernels:
            count = kernel.weight.shape[0]
            kernel.weight = group.weight[blocks:blocks + count]
            scales_per_block = kernel.scales.shape[0] // count
            kernel.scales = group.scales[scales_per_block * blocks:
                                         scales_per_block * (blocks + count)]
            blocks += count
        bias = None if run[0].bias is None else torch.cat(
            [layer.bias for layer in run if layer.bias is not None])
        sizes = tuple(layer.out_features for layer in run)
        _groups[handles] = (register_kernel(run[0], group, bias), sizes)
        weakref.finalize(run[0], _groups.pop, handles, None)
        grouped += 1
    return grouped


def fuse_quantized_calls(graph: torch.fx.Graph) -> int:
    """In a graph traced by ``torch.compile``, replace the ``quantized_linear`` calls of
    each group ``group_quantized_layers`` made, where all of its members are called on
    one input, by one call over the group and a slice of its result for each member.
    Returns how many groups were fused."""
    return fuse_grouped_calls(graph, quantized_linear, _groups)
