"""A compiled model's quantized layers on triollm's own kernels, called through the C++
op ``triollm::kernel_linear`` (cpu/kernel_ops.py) instead of the Python op
``triollm::quantized_linear``.

``call_kernels_from_cpp`` runs on the graph ``torch.compile`` traces, after the calls of
grouped layers are fused (grouping.py): each ``quantized_linear`` call whose layer the
C++ op computes exactly as the Python op would is registered with the op (its packed
tensors as they are now, grouped or not) and calls it instead. That is a layer on the
AVX2, AVX-512 or VNNI kernel, its columns in order, on a CPU where the Python op would
take the same kernel at every row count: with AMX, inputs a multiple of 32 wide (which
go to the AMX tiles from ``tiles_from`` rows rather than to torch's ``linear``). The row
threshold is the kernel's when the graph is compiled: tests that move it call layers
eagerly.
"""

from __future__ import annotations

import logging

import torch

from triollm.model.cpu.build import KernelBuildError
from triollm.model.cpu.kernel_ops import NativeProducts, kernel_linear_op, register_linear
from triollm.model.quantization.avx2_kernels import Avx2Int4Kernel, Avx2Int8Kernel
from triollm.model.quantization.avx512_kernels import Avx512Gemm
from triollm.model.quantization.kernels import QuantizedKernel
from triollm.model.quantization.linear import _registered, quantized_linear, registered_in_cpp

__all__ = ["call_kernels_from_cpp"]

logger = logging.getLogger(__name__)


def _in_features(kernel: Avx2Int4Kernel | Avx2Int8Kernel) -> int:
    # int4: [blocks, in / 8, 16] words of 8 nibbles; int8: [blocks, in, 16] bytes
    width = int(kernel.weight.shape[1])
    return 8 * width if isinstance(kernel, Avx2Int4Kernel) else width


def _products(kernel: QuantizedKernel) -> NativeProducts | None:
    """The C functions the C++ op runs for ``kernel``, or None where it would not compute
    what the Python op does at some row count."""
    if not isinstance(kernel, Avx2Int4Kernel | Avx2Int8Kernel):
        return None
    if isinstance(kernel, Avx2Int4Kernel) and kernel.permutation is not None:
        return None
    gemm = kernel.gemm
    product, pooled = gemm.product.entry_points()
    if not isinstance(gemm, Avx512Gemm):
        return NativeProducts(product, pooled)
    if _in_features(kernel) % 32:
        return None
    if gemm.tiles_from is not None:
        return NativeProducts(product, pooled, gemm.tiles, gemm.tiles_from)
    if gemm.dequantize_int4_from is None and gemm.dequantize_int8_from is None:
        return NativeProducts(product, pooled)
    return None


def _registers(handle: int) -> bool:
    """Whether ``handle``'s layer is registered with the C++ op (registering it now with
    its current tensors)."""
    entry = _registered.get(handle)
    if entry is None:
        return False
    kernel, bias = entry
    products = _products(kernel)
    if products is None:
        return False
    assert isinstance(kernel, Avx2Int4Kernel | Avx2Int8Kernel)
    group_size = kernel.group_size if isinstance(kernel, Avx2Int4Kernel) else 0
    try:
        if not register_linear(handle, kernel.weight, kernel.scales, bias,
                               _in_features(kernel), kernel.out_features, group_size,
                               products):
            return False
    except KernelBuildError:
        raise
    except RuntimeError as error:  # the op refused the layer: it keeps the Python op
        logger.warning("a quantized layer of shape (%d, %d) stays on the Python op: %s",
                       kernel.out_features, _in_features(kernel), error)
        return False
    registered_in_cpp.add(handle)
    return True


def call_kernels_from_cpp(graph: torch.fx.Graph) -> int:
    """In a graph traced by ``torch.compile``, make each ``quantized_linear`` call whose
    layer the C++ op takes call ``triollm::kernel_linear`` instead; returns how many."""
    swapped = 0
    for node in graph.nodes:
        if (node.op == "call_function" and node.target is quantized_linear
                and not node.kwargs and isinstance(node.args[1], int)
                and _registers(node.args[1])):
            node.target = kernel_linear_op()
            swapped += 1
    return swapped
