"""CPU linear layers over weights pre-packed once: bf16 weights into gemm.py's layout
where the CPU has AVX512-BF16 (its kernel reads them faster still than oneDNN), or
where it has AVX2 and FMA but oneDNN cannot pack bf16 (gemm_avx2.py's kernel reads the
same layout), everything else into oneDNN's blocked layout.

A decode step multiplies a few rows by every weight of the model, so on CPU its time
is the time to read the weights. aten's ``linear`` reads a row-major weight well below
the memory bandwidth; oneDNN, given the weight reordered once into its own blocked
layout, runs the same product faster for a few rows and about as fast for
prefill-sized ones (``benchmarks/packed_linear.py``). This is what inductor's freezing
pass does for compiled CPU models; doing it to the loaded modules gets the same kernels
without compiling the model.

Only plain ``nn.Linear`` and GPT-2's ``Conv1D`` are packed, only on CPU, and only a
weight that no other module shares: a tied LM head keeps its embedding's weight as an
``nn.Linear``, except where bf16 runs on gemm_avx2.py's kernel, where it runs on a
packed copy (its size again in memory, logged; measured in docs/benchmarks.md), and
on CPUs with AMX-BF16, where it runs on tiles over the shared weight (tied_head.py).
Each packed layer is checked against the unpacked product before it replaces the
original; a layer that fails the check, or a torch without the oneDNN ops, keeps the
plain module.

oneDNN builds (JIT-compiles) one primitive per input row count and caches up to 1,024 of
them, each with buffers of its own. A server sees a new row count at almost every step
(decode batch sizes, prefill chunks), so unbounded, the cache fills with one-off
primitives and holds hundreds of MiB after a few thousand requests
(``benchmarks/memory_soak.py``). Row counts above 32 are therefore padded up to
one of 16 sizes per power of two (at most 6.25% more rows, 3% on average): a linear layer
shape then needs at most 32 + 16 per doubling primitives, about 160 up to 8,192 rows.

Layers that read the same input (a Llama layer's q, k and v projections; its gate and
up ones) are multiplied in one call where the model is compiled: ``group_weights_of_shared_inputs``
watches a forward, finds the runs of layers called on one tensor, and moves each run's
weights (in gemm.py's layout) into one tensor of which each layer's is a view, so
nothing is stored twice; ``fuse_shared_input_calls``, run on the graph ``torch.compile``
traces, replaces each run's calls by one over the group's weights and slices of its
result: a Llama layer makes 4 calls instead of 7, and each call saved is the op's
overhead besides the kernel.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from collections.abc import Iterator

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from triollm.model.cpu.gemm import CpuGemm, load_gemm
from triollm.model.cpu.gemm_avx2 import load_avx2_gemm
from triollm.model.cpu.helpers import drain_pools
from triollm.model.cpu.tied_head import tied_head_on_tiles
from triollm.model.ops import define_op
from triollm.model.shared_input import fuse_grouped_calls, runs_on_one_input

__all__ = [
    "PackedLinear",
    "PackedWeights",
    "fuse_shared_input_calls",
    "group_weights_of_shared_inputs",
    "pack_linear_layers",
    "packed_linear",
    "packed_weights",
    "packed_weights_of",
    "padded_rows",
    "pads_rows",
]

logger = logging.getLogger(__name__)


class PackedLinear(nn.Module):
    """``y = x @ weight.T + bias`` with ``weight`` held packed (gemm.py's layout or
    oneDNN's).

    The packed tensor is an attribute, not a parameter: in oneDNN's layout it is an
    opaque ``_mkldnn`` tensor that only oneDNN's linear reads; in gemm.py's it is a
    plain ``[out/16, in/2, 16, 2]`` tensor that only the C kernel reads the right way.
    Neither is something ``torch.compile`` should trace, so a compiled model calls the
    custom op ``triollm::packed_linear`` with the layer's ``handle``, its index in its
    model's ``PackedWeights`` (``weights``): the same in every process that packs the
    same model, so compiled code saved by one runs in another."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 weights: PackedWeights | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        gemm = _gemm_for(weight)
        if gemm is not None:  # gemm.py's layout, fp32 bias
            self.packed_weight = gemm.pack(weight)
            self.bias = None if bias is None else bias.detach().float()
        else:
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
            self.bias = None if bias is None else bias.detach()
        self.weights = PackedWeights() if weights is None else weights
        self.handle = self.weights.add(self.packed_weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # not is_compiling(): that is true on every thread while one compiles
        if torch.compiler.is_dynamo_compiling():
            return packed_linear(x, self.handle, self.out_features)
        return _linear(x, self.packed_weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")


def _linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None
            ) -> torch.Tensor:
    if not packed_weight.is_mkldnn:
        gemm = load_gemm() or load_avx2_gemm()
        assert gemm is not None  # a weight is packed this way only where one loaded
        return gemm(x, packed_weight, bias)
    in_features = x.shape[-1]
    rows = x.numel() // in_features
    padded = padded_rows(rows)
    if padded == rows:
        return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")
    # rather than F.pad, which zero-fills all of the new tensor before copying into it
    flat = x.new_empty((padded, in_features))
    flat[:rows].copy_(x.reshape(rows, in_features))
    flat[rows:].zero_()
    out = torch.ops.mkldnn._linear_pointwise(flat, packed_weight, bias, "none", [], "")
    return out[:rows].view(*x.shape[:-1], out.shape[-1])


class PackedWeights:
    """One model's packed weights by handle: its ``PackedLinear`` layers' and its groups'
    (``group_weights_of_shared_inputs``). A compiled forward finds them through
    ``packed_weights``, set on its thread while it runs."""

    def __init__(self) -> None:
        #: handle -> (packed weight, bias)
        self.by_handle: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        #: (member handles, in call order) -> (the group's handle, each member's
        #: out_features)
        self.groups: dict[tuple[int, ...], tuple[int, tuple[int, ...]]] = {}

    def add(self, weight: torch.Tensor, bias: torch.Tensor | None) -> int:
        """Register a packed weight and its bias; returns its handle."""
        self.by_handle.append((weight, bias))
        return len(self.by_handle) - 1

    def adopt(self, layer: PackedLinear) -> None:
        """Move ``layer`` (packed on weights of its own) onto these, under a new handle."""
        layer.weights = self
        layer.handle = self.add(layer.packed_weight, layer.bias)


_current = threading.local()


@contextlib.contextmanager
def packed_weights(weights: PackedWeights | None) -> Iterator[None]:
    """The packed weights the ``packed_linear`` op reads on this thread within the block:
    those of the model whose compiled forward runs."""
    previous = getattr(_current, "weights", None)
    _current.weights = weights
    try:
        yield
    finally:
        _current.weights = previous


def packed_weights_of(model: nn.Module) -> PackedWeights | None:
    """The packed weights of ``model``'s ``PackedLinear`` layers; None: it has none."""
    return next((module.weights for module in model.modules()
                 if isinstance(module, PackedLinear)), None)


def _current_weights() -> PackedWeights:
    weights: PackedWeights | None = getattr(_current, "weights", None)
    if weights is None:
        raise RuntimeError("triollm::packed_linear called outside packed_weights")
    return weights


def _packed_linear(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    packed_weight, bias = _current_weights().by_handle[handle]
    return _linear(x, packed_weight, bias)


def _packed_linear_fake(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


#: The product of the layer ``handle`` of the model whose forward runs (``packed_weights``),
#: as an op a compiled graph can call.
packed_linear = define_op("packed_linear(Tensor x, int handle, int out_features) -> Tensor",
                          _packed_linear, _packed_linear_fake)


@torch.no_grad()
def group_weights_of_shared_inputs(calls: list[tuple[torch.Tensor, PackedLinear]]) -> int:
    """Group the layers ``calls`` (``recording_calls``) shows called one after another on
    the same input tensor: each run of two or more, all on gemm.py's layout with the
    same input size and all with or all without a bias, gets its weights moved into one
    tensor (each layer's packed weight becomes a view of it) registered as one more
    handle of their model's weights. Returns how many groups were made."""
    grouped = 0
    seen: set[int] = set()
    drain_pools()  # no pool helper still reads a weight about to be moved
    for run in runs_on_one_input(calls):
        handles = tuple(layer.handle for layer in run)
        weights = run[0].weights
        if (handles in weights.groups or seen & set(handles)
                or any(layer.weights is not weights for layer in run)
                or any(layer.packed_weight.is_mkldnn for layer in run)
                or len({layer.bias is None for layer in run}) > 1):
            continue
        seen.update(handles)
        weight = torch.cat([layer.packed_weight for layer in run])
        bias = None if run[0].bias is None else torch.cat(
            [layer.bias for layer in run if layer.bias is not None])
        blocks = 0
        for layer in run:
            count = layer.packed_weight.shape[0]
            layer.packed_weight = weight[blocks:blocks + count]
            if bias is not None:
                layer.bias = bias[16 * blocks:16 * (blocks + count)]
            weights.by_handle[layer.handle] = (layer.packed_weight, layer.bias)
            blocks += count
        weights.groups[handles] = (weights.add(weight, bias),
                                   tuple(layer.out_features for layer in run))
        grouped += 1
    return grouped


def fuse_shared_input_calls(graph: torch.fx.Graph, weights: PackedWeights | None = None
                            ) -> int:
    """In a graph traced by ``torch.compile``, replace the ``packed_linear`` calls of each
    group ``group_weights_of_shared_inputs`` made, where all of its members are called on one input,
    by one call over the group's weights and a slice of its result for each member.
    ``weights``: the model's (default: the ones ``packed_weights`` set on this thread,
    if any). Returns how many groups were fused."""
    if weights is None:
        weights = getattr(_current, "weights", None)
        if weights is None:
            return 0
    return fuse_grouped_calls(graph, packed_linear, weights.groups)


def padded_rows(rows: int) -> int:
    """``rows`` itself up to 32; above, the next multiple of 1/16 of its power of two."""
    if rows <= 32:
        return rows
    step = 1 << (rows.bit_length() - 5)
    return -(-rows // step) * step


def pads_rows(model: nn.Module) -> bool:
    """Whether any of ``model``'s packed layers runs on oneDNN, and so copies inputs whose
    row count ``padded_rows`` would change into a padded buffer."""
    return any(isinstance(module, PackedLinear) and module.packed_weight.is_mkldnn
               for module in model.modules())


def _onednn_supports(dtype: torch.dtype) -> bool:
    if not (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


def _bf16_gemm() -> CpuGemm | None:
    """The C kernel for bf16 weights: gemm.py's (AVX512-BF16), else, where oneDNN cannot
    pack bf16, gemm_avx2.py's (AVX2 and FMA); None: oneDNN's (or aten's) linear."""
    gemm = load_gemm()
    if gemm is None and not _onednn_supports(torch.bfloat16):
        return load_avx2_gemm()
    return gemm


def _gemm_for(weight: torch.Tensor) -> CpuGemm | None:
    """The C kernel where it takes ``weight`` (bf16, see ``_bf16_gemm``); none is built
    at all for other dtypes."""
    if weight.dtype != torch.bfloat16:
        return None
    gemm = _bf16_gemm()
    return gemm if gemm is not None and gemm.fits(weight) else None


def _copies_tied_head(head: nn.Module) -> bool:
    """Whether a tied LM head gets a packed copy of its weight: where it would otherwise
    run aten's bf16 linear, as gemm_avx2.py's kernel is the bf16 one (a copy there ran
    1.3-2.7x faster than that kernel over the weight as it is, docs/benchmarks.md)."""
    weight = head.weight
    return (type(head) is nn.Linear and weight.device.type == "cpu"
            and _gemm_for(weight) is not None and load_gemm() is None)


def _packable(weight: torch.Tensor) -> bool:
    return _gemm_for(weight) is not None or _onednn_supports(weight.dtype)


def _weight_and_bias(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``[out, in]`` weight and the bias of a packable module."""
    if isinstance(module, Conv1D):  # GPT-2 keeps its weight as [in, out]
        return module.weight.detach().t().contiguous(), module.bias
    assert isinstance(module, nn.Linear)
    return module.weight.detach(), module.bias


def _packed_if_equal(weight: torch.Tensor, bias: torch.Tensor | None) -> PackedLinear | None:
    """A ``PackedLinear`` (on weights of its own) that gives what ``F.linear`` gives on a
    random input, else None."""
    try:
        packed = PackedLinear(weight, bias)
        probe = torch.randn(3, weight.shape[1], dtype=weight.dtype,
                            generator=torch.Generator().manual_seed(0))
        expected = nn.functional.linear(probe, weight, bias).float()
        got = packed(probe).float()
    except RuntimeError as error:
        logger.warning("could not pack a %s linear weight (%s); keeping aten's "
                       "linear", weight.dtype, error)
        return None
    tolerance = 1e-2 if weight.dtype == torch.bfloat16 else 1e-4
    if not torch.allclose(got, expected, rtol=tolerance, atol=tolerance):
        logger.warning("the packed linear disagrees with aten's for a %s weight of "
                       "shape %s; keeping aten's linear", weight.dtype, tuple(weight.shape))
        return None
    return packed


@torch.no_grad()
def pack_linear_layers(model: nn.Module) -> int:
    """Replace the model's packable CPU linear layers by ``PackedLinear``, in place.

    Returns how many were replaced. They share one ``PackedWeights``, their handles
    numbered from 0 in the order they are packed (the same for the same model)."""
    weights = PackedWeights()
    uses = Counter(id(parameter) for _, parameter in
                   model.named_parameters(remove_duplicate=False))
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) not in (nn.Linear, Conv1D):
                continue
            weight = child.weight
            shared = uses[id(weight)] > 1
            if shared and child is head and not _copies_tied_head(child):
                tied = tied_head_on_tiles(child)
                if tied is not None:
                    logger.info("the tied LM head runs on AMX tiles over its embedding's "
                                "weight")
                    setattr(parent, name, tied)
                continue
            if (weight.device.type != "cpu" or not _packable(weight)
                    or (shared and child is not head)):
                continue
            packed = _packed_if_equal(*_weight_and_bias(child))
            if packed is not None and shared:
                logger.info("the tied LM head runs on a packed copy of its weight: "
                            "%.1f MiB more memory", weight.nbytes / 2**20)
            if packed is not None:
                weights.adopt(packed)
                setattr(parent, name, packed)
                replaced += 1
    return replaced
