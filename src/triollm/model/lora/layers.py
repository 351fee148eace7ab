"""LoRA in the forward pass: every adaptable linear layer of the model wrapped once, at
load, in a ``LoRALinear`` that holds the resident adapters' weights side by side.

A layer keeps ``max_loras`` slots of ``max_lora_rank`` columns each: ``A`` stacked as
``[slots * rank, in]`` and ``B^T`` (already scaled) as ``[slots * rank, out]``, zero
where an adapter's rank is lower or a slot is empty. One step may mix tokens of
different adapters and of the base model; the runner hands every layer the same
per-token mask (``LoRAStep``): row ``t`` is one on the columns of token ``t``'s slot and
zero elsewhere. Then, for the whole flattened batch at once,

    y = base(x) + ((x A^T) * mask) B^T

two matrix products of width ``slots * rank`` whatever the mix (the gathered segment
products of SGMV/BGMV, written as masked dense ones, which suit CPUs and small adapter
counts). Layers that read the same input (q, k, v; gate, up) share one pair of products
(``LoRAGroup``; a layer alone is a group of one), found by watching one forward at
start-up. A step without adapter tokens skips all of it.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from triollm.model.cpu.packed_linear import PackedLinear
from triollm.model.quantization.linear import QuantizedLinear
from triollm.model.shared_input import runs_on_one_input

__all__ = ["LoRAGroup", "LoRALinear", "LoRAStep", "adaptable_layers", "group_shared_inputs"]


class LoRAStep:
    """The one object every ``LoRALinear`` of a model reads its step from. The runner
    sets ``mask`` before a forward and clears it after (None: no adapter token):
    ``[tokens, max_loras * max_lora_rank]`` in the LoRA dtype, one on the columns of each
    token's own slot, zero elsewhere (all zero for a base-model token). While
    ``recording`` is a list, each layer appends ``(input, layer)`` when called."""

    def __init__(self) -> None:
        self.mask: torch.Tensor | None = None
        self.recording: list[tuple[torch.Tensor, LoRALinear]] | None = None


class LoRALinear(nn.Module):
    """A linear layer (plain, packed, quantized or GPT-2's ``Conv1D``) plus the deltas of
    the adapters resident in its slots, which its ``LoRAGroup`` computes (a group of
    its own until ``group_shared_inputs`` joins it to the layers sharing its input)."""

    def __init__(self, base_layer: nn.Module, in_features: int, out_features: int, *,
                 max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device,
                 step: LoRAStep) -> None:
        super().__init__()
        self.base_layer = base_layer
        # called directly: a second nn.Module.__call__ per layer costs more than it does
        self._base_forward = base_layer.forward
        self.in_features = in_features
        self.out_features = out_features
        self.max_rank = max_rank
        self.step = step
        # Plain attributes, not buffers (they are not part of the model's state dict);
        # views into the group's tensors once the group exists.
        self.lora_a = torch.zeros(max_loras * max_rank, in_features, dtype=dtype,
                                  device=device)
        self.lora_b_t = torch.zeros(max_loras * max_rank, out_features, dtype=dtype,
                                    device=device)
        #: Where this layer's columns start in its group's joint output.
        self.group_offset = 0
        self.group = LoRAGroup([self])

    def set_slot(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Put an adapter's ``A`` ``[r, in]`` and scaled ``B`` ``[out, r]`` in ``slot``
        (None: the adapter leaves this layer alone)."""
        start = slot * self.max_rank
        end = start + self.max_rank
        self.lora_a[start:end].zero_()
        self.lora_b_t[start:end].zero_()
        if a is not None and b is not None:
            rank = a.shape[0]
            self.lora_a[start:start + rank].copy_(a)
            self.lora_b_t[start:start + rank].copy_(b.t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._base_forward(x)
        step = self.step
        if step.recording is not None:
            step.recording.append((x, self))
        if step.mask is None:
            return out
        delta = self.group.delta(x, step.mask)
        delta = delta[:, self.group_offset:self.group_offset + self.out_features]
        flat_out = out.view(-1, self.out_features)
        flat_out.add_(delta if delta.dtype == flat_out.dtype else delta.to(flat_out.dtype))
        return out

    def extra_repr(self) -> str:
        slots = self.lora_a.shape[0] // self.max_rank
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"slots={slots}, max_rank={self.max_rank}")


class LoRAGroup:
    """Layers that read the same input tensor (a decoder's q, k and v projections; its
    gate and up projections), or one layer alone: their A's stacked and their B's
    block-diagonal, so that one pair of products serves all of them, computed when the
    first is called and taken from by the others. On CPU a small product costs mostly
    its fixed overhead, so fewer, wider products are what makes mixed-adapter steps
    cheap.

    The members' ``lora_a`` / ``lora_b_t`` become views into the group's tensors (their
    contents copied), so loading a slot writes through to them."""

    def __init__(self, members: list[LoRALinear]) -> None:
        columns = members[0].lora_a.shape[0]
        self.columns = columns
        self.in_features = members[0].in_features
        outs = [member.out_features for member in members]
        first = members[0].lora_a
        self.a = torch.cat([member.lora_a for member in members])
        self.b = torch.zeros(len(members) * columns, sum(outs), dtype=first.dtype,
                             device=first.device)
        offset = 0
        for index, member in enumerate(members):
            rows = slice(index * columns, (index + 1) * columns)
            self.b[rows, offset:offset + member.out_features].copy_(member.lora_b_t)
            member.lora_a = self.a[rows]
            member.lora_b_t = self.b[rows, offset:offset + member.out_features]
            member.group = self
            member.group_offset = offset
            offset += member.out_features
        self.members = members
        self._input: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None
        self._delta: torch.Tensor | None = None

    def delta(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``[tokens, sum of the members' outputs]``: every member's LoRA delta for
        input ``x`` (computed once per input)."""
        # The group holds its input, so no other tensor can be this object; the models
        # do not modify a projection's input in place between its projections.
        if x is self._input and mask is self._mask and self._delta is not None:
            return self._delta
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != self.a.dtype:
            flat = flat.to(self.a.dtype)
        hidden = nn.functional.linear(flat, self.a)
        hidden.view(flat.shape[0], len(self.members), self.columns).mul_(mask[:, None, :])
        self._delta = hidden @ self.b
        self._input, self._mask = x, mask
        return self._delta

    def clear(self) -> None:
        """Drop the step's input and delta."""
        self._input = self._mask = self._delta = None


def group_shared_inputs(recording: list[tuple[torch.Tensor, LoRALinear]]) -> list[LoRAGroup]:
    """Group the layers a recorded forward called one after another on the same input
    tensor (of the same size); returns the groups of more than one layer."""
    return [LoRAGroup(run) for run in runs_on_one_input(
        recording, joins=lambda layer: len(layer.group.members) == 1)]


def _shape(module: nn.Module) -> tuple[int, int] | None:
    """``(in, out)`` of a linear module the wrapper can adapt, else None."""
    if isinstance(module, nn.Linear | PackedLinear | QuantizedLinear):
        return module.in_features, module.out_features
    if isinstance(module, Conv1D):  # GPT-2 keeps its weight as [in, out]
        return int(module.weight.shape[0]), int(module.nf)
    return None


def adaptable_layers(model: nn.Module, target_modules: tuple[str, ...] | None
                     ) -> dict[str, tuple[nn.Module, int, int]]:
    """The model's linear layers an adapter may target, by module path, with their
    ``(module, in, out)``: all but the LM head (and, with ``target_modules``, only
    those whose last name is listed)."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    found = {}
    for name, module in model.named_modules():
        shape = _shape(module)
        if shape is None or module is head:
            continue
        if target_modules is not None and name.rsplit(".", 1)[-1] not in target_modules:
            continue
        found[name] = (module, *shape)
    return found
