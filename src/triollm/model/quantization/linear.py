"""``QuantizedLinear``: a linear layer whose weight stays quantized, multiplied by the
first kernel that takes it: the VNNI kernel (vnni_kernels.py), the fp32 AVX-512 one
(avx512_kernels.py), the AVX2 one (avx2_kernels.py), torch's CPU kernels (kernels.py).

Like ``PackedLinear`` (model/cpu/packed_linear.py), its packed tensors are not something
``torch.compile`` should trace: a compiled model calls the custom op
``triollm::quantized_linear`` with the layer's ``handle``, under which the kernel is
registered for as long as the module lives; layers on one input are grouped into one
call in a compiled model by grouping.py.
"""

from __future__ import annotations

import itertools
import logging
import weakref

import torch
from torch import nn

from triollm.model.cpu.kernel_ops import unregister_linear
from triollm.model.ops import define_op
from triollm.model.quantization.avx2_kernels import avx2_kernel_for
from triollm.model.quantization.avx512_kernels import avx512_kernel_for
from triollm.model.quantization.kernels import QuantizedKernel, kernel_for
from triollm.model.quantization.vnni_kernels import vnni_kernel_for
from triollm.model.quantization.weights import QuantizedWeight

__all__ = ["QuantizedLinear", "quantized_linear", "quantized_or_plain", "register_kernel",
           "registered_in_cpp"]

logger = logging.getLogger(__name__)


class QuantizedLinear(nn.Module):
    """``y = x @ w.T + bias`` with ``w`` the weight a ``QuantizedWeight`` stands for,
    held packed for ``kernel``."""

    def __init__(self, weight: QuantizedWeight, kernel: QuantizedKernel,
                 bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = weight.in_features
        self.out_features = weight.out_features
        self.bits = weight.bits
        self.group_size = weight.group_size
        self.kernel = kernel
        self.bias = None if bias is None else bias.detach()
        self.handle = register_kernel(self, kernel, self.bias)

    @property
    def nbytes(self) -> int:
        """The bytes its packed weight, scales, zero points and bias take."""
        return self.kernel.nbytes + (0 if self.bias is None else self.bias.nbytes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return quantized_linear(x, self.handle, self.out_features)
        return _product(x, self.kernel, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, kernel={self.kernel.name}, "
                f"bits={self.bits}, group_size={self.group_size}")


def _product(x: torch.Tensor, kernel: QuantizedKernel, bias: torch.Tensor | None
             ) -> torch.Tensor:
    out = kernel(x)
    return out if bias is None else out + bias


_handles = itertools.count()
#: handle -> (kernel, bias) of every live ``QuantizedLinear``.
_registered: dict[int, tuple[QuantizedKernel, torch.Tensor | None]] = {}


def register_kernel(owner: object, kernel: QuantizedKernel, bias: torch.Tensor | None
                    ) -> int:
    """A new handle under which ``quantized_linear`` computes with ``kernel`` (and adds
    ``bias``) for as long as ``owner`` lives."""
    handle = next(_handles)
    _registered[handle] = (kernel, bias)
    weakref.finalize(owner, _forget, handle)
    return handle


#: handles also registered with the C++ op (kernel_calls.py)
registered_in_cpp: set[int] = set()


def _forget(handle: int) -> None:
    _registered.pop(handle, None)
    if handle in registered_in_cpp:
        registered_in_cpp.discard(handle)
        unregister_linear(handle)


def _quantized_linear(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    kernel, bias = _registered[handle]
    return _product(x, kernel, bias)


def _quantized_linear_fake(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


#: ``QuantizedLinear`` number ``handle``'s product, as an op a compiled graph can call.
quantized_linear = define_op(
    "quantized_linear(Tensor x, int handle, int out_features) -> Tensor",
    _quantized_linear, _quantized_linear_fake)


@torch.no_grad()
def quantized_or_plain(weight: QuantizedWeight, bias: torch.Tensor | None,
                       dtype: torch.dtype) -> QuantizedLinear | nn.Linear:
    """A ``QuantizedLinear`` over ``weight`` computing in ``dtype`` where a kernel takes it
    and gives what the dequantized weight gives on a random input; else an
    ``nn.Linear`` holding the dequantized weight in ``dtype`` (which the runner packs
    like any other)."""
    device = weight.qweight.device
    dequantized = weight.dequantize(dtype)
    kernel = (vnni_kernel_for(weight, dtype) or avx512_kernel_for(weight, dtype)
              or avx2_kernel_for(weight, dtype) or kernel_for(weight, dtype)
              if device.type == "cpu" else None)
    if kernel is not None:
        layer = QuantizedLinear(weight, kernel, None if bias is None else bias.to(dtype))
        probe = torch.randn(3, weight.in_features, generator=torch.Generator().manual_seed(0)
                            ).to(dtype)
        expected = nn.functional.linear(probe.float(), dequantized.float())
        try:
            got = layer(probe).float() - (0 if layer.bias is None else layer.bias.float())
        except RuntimeError as error:
            logger.warning("the %s kernel refused a %s weight (%s)", kernel.name,
                           tuple(dequantized.shape), error)
        else:
            tolerance = 1e-4 if dtype == torch.float32 else 5e-2
            scale = float(expected.abs().max()) + 1e-6
            if float((got - expected).abs().max()) <= tolerance * scale:
                return layer
            logger.warning("the %s kernel disagrees with the dequantized weight of shape "
                           "%s", kernel.name, tuple(dequantized.shape))
    plain = nn.Linear(weight.in_features, weight.out_features, bias=bias is not None,
                      device=device, dtype=dtype)
    plain.weight = nn.Parameter(dequantized, requires_grad=False)
    if bias is not None:
        plain.bias = nn.Parameter(bias.detach().to(dtype), requires_grad=False)
    return plain
