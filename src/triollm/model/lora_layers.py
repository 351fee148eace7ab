"""LoRA in the forward pass: every adaptable linear layer of the model wrapped once, at
load, in a ``LoRALinear`` that holds the resident adapters' weights side by side.

A layer keeps ``max_loras`` slots of ``max_lora_rank`` columns each: ``A`` stacked as
``[slots * rank, in]`` and ``B^T`` (already scaled) as ``[slots * rank, out]``, zero
where an adapter's rank is lower or a slot is empty. One step may mix tokens of
different adapters and of the base model; the runner hands every layer the same
per-token mask (``LoRAStep``): row ``t`` is one on the columns of token ``t``'s slot and
zero elsewhere. Then, for the whole flattened batch at once,

    y = base(x) + ((x A^T) * mask) B^T

two matrix products of width ``slots_used * rank`` whatever the mix (the gathered
segment products of SGMV/BGMV, written as masked dense ones, which suit CPUs and
small adapter counts). Only the slots up to the highest one a step uses count, and a
step without adapter tokens skips all of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from triollm.model.packed_linear import PackedLinear

__all__ = ["LoRALinear", "LoRAStep", "LoRAStepBatch", "adaptable_layers"]


@dataclass(frozen=True)
class LoRAStepBatch:
    """Which columns of the slots each token of this step uses."""

    #: ``(highest slot used + 1) * max_lora_rank``
    columns: int
    #: ``[tokens, columns]`` in the LoRA dtype: one on the token's own slot's columns.
    mask: torch.Tensor


class LoRAStep:
    """The one object every ``LoRALinear`` of a model reads its step's batch from; the
    runner sets ``batch`` before a forward and clears it after (None: no adapter)."""

    def __init__(self) -> None:
        self.batch: LoRAStepBatch | None = None


class LoRALinear(nn.Module):
    """A linear layer (plain, oneDNN-packed or GPT-2's ``Conv1D``) plus the deltas of
    the adapters resident in its slots."""

    def __init__(self, base_layer: nn.Module, in_features: int, out_features: int, *,
                 max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device,
                 step: LoRAStep) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.in_features = in_features
        self.out_features = out_features
        self.max_rank = max_rank
        self.step = step
        # plain attributes, not buffers: they are not part of the model's state dict
        self.lora_a = torch.zeros(max_loras * max_rank, in_features, dtype=dtype,
                                  device=device)
        self.lora_b_t = torch.zeros(max_loras * max_rank, out_features, dtype=dtype,
                                    device=device)

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
        out = self.base_layer(x)
        batch = self.step.batch
        if batch is None:
            return out
        columns = batch.columns
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != self.lora_a.dtype:
            flat = flat.to(self.lora_a.dtype)
        hidden = nn.functional.linear(flat, self.lora_a[:columns])
        hidden.mul_(batch.mask)
        flat_out = out.view(-1, self.out_features)
        if flat_out.dtype == hidden.dtype:
            flat_out.addmm_(hidden, self.lora_b_t[:columns])
        else:
            flat_out.add_((hidden @ self.lora_b_t[:columns]).to(flat_out.dtype))
        return out

    def extra_repr(self) -> str:
        slots = self.lora_a.shape[0] // self.max_rank
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"slots={slots}, max_rank={self.max_rank}")


def _shape(module: nn.Module) -> tuple[int, int] | None:
    """``(in, out)`` of a linear module the wrapper can adapt, else None."""
    if isinstance(module, nn.Linear | PackedLinear):
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
