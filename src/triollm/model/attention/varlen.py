"""Attention over whole prompts packed into one row, for pooling models.

A pooling step holds complete prompts one after another in a ``[1, T]`` batch (no
padding, no KV cache). Each prompt attends only to itself: bidirectionally in encoders
(BERT, RoBERTa), causally in decoders used as embedders (the module's ``is_causal``
says which). Registered with transformers' ``AttentionInterface`` as
``triollm_varlen``; the spans travel as the ``triollm_metadata`` keyword, as the paged
attention's metadata does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from triollm.errors import UnsupportedModelError
from triollm.model.cpu.varlen import VarlenKernel

__all__ = ["VARLEN_ATTENTION_NAME", "VarlenMetadata", "varlen_attention_forward"]

VARLEN_ATTENTION_NAME = "triollm_varlen"


@dataclass
class VarlenMetadata:
    """``[start, end)`` of each prompt in the packed row; runs of prompts of equal length
    are attended in one batched call."""

    spans: list[tuple[int, int]]
    #: ``(start, count, length)``: ``count`` consecutive prompts of ``length`` tokens.
    runs: list[tuple[int, int, int]]
    #: The C kernel to attend with where it takes the inputs (model/cpu/varlen.py), or
    #: None for SDPA; the runner decides (none under ``enforce_eager``).
    kernel: VarlenKernel | None = None
    #: Attention calls made with it (the runner checks its attention is the one used).
    num_calls: int = 0
    #: ``spans`` as int64 ``(starts, lengths)`` tensors, made on first use by the kernel.
    _span_tensors: tuple[torch.Tensor, torch.Tensor] | None = None

    def span_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each prompt's start and length, as int64 CPU tensors."""
        if self._span_tensors is None:
            self._span_tensors = (
                torch.tensor([start for start, _ in self.spans], dtype=torch.int64),
                torch.tensor([end - start for start, end in self.spans], dtype=torch.int64))
        return self._span_tensors

    @classmethod
    def from_lengths(cls, lengths: list[int], kernel: VarlenKernel | None = None
                     ) -> VarlenMetadata:
        spans: list[tuple[int, int]] = []
        runs: list[tuple[int, int, int]] = []
        start = 0
        for length in lengths:
            spans.append((start, start + length))
            if runs and runs[-1][2] == length:
                first, count, _ = runs[-1]
                runs[-1] = (first, count + 1, length)
            else:
                runs.append((start, 1, length))
            start += length
        return cls(spans, runs, kernel)


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    triollm_metadata: VarlenMetadata | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``query`` is ``[1, heads, T, dim]`` (keys and values may have fewer heads);
    returns ``[1, T, heads, dim]`` as transformers expects. A causal sliding window and
    Gemma-style logit softcapping are honoured; a bidirectional sliding window is
    refused (the runner's load-time check raises it)."""
    if triollm_metadata is None:
        raise RuntimeError("triollm_varlen attention needs the step's VarlenMetadata")
    triollm_metadata.num_calls += 1
    causal = bool(getattr(module, "is_causal", False))
    if sliding_window is not None and not causal:
        raise UnsupportedModelError(
            f"{type(module).__name__} attends bidirectionally within a sliding window "
            f"of {sliding_window} tokens, which triollm's pooling runner does not "
            f"support yet")
    heads, kv_heads = query.shape[1], key.shape[1]
    out_dtype = query.dtype
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    kernel = triollm_metadata.kernel
    if (query.device.type == "cpu" and sliding_window is None and softcap is None
            and kernel is not None and kernel.takes(query, key, value)):
        starts, lengths = triollm_metadata.span_tensors()
        return kernel(query, key, value, starts, lengths, scale, causal), None
    if query.device.type == "cpu" and query.dtype != torch.float32:
        # CPU SDPA runs several times faster in fp32 than in bf16
        query, key, value = query.float(), key.float(), value.float()
    output = torch.empty_like(query)
    for start, count, length in triollm_metadata.runs:
        end = start + count * length
        # [1, h, count * length, d] -> [count, h, length, d], views
        q, k, v = (t[0, :, start:end].unflatten(1, (count, length)).transpose(0, 1)
                   for t in (query, key, value))
        allowed = None  # None: all keys (bidirectional) or plain causal
        if causal and (softcap is not None or (
                sliding_window is not None and length > sliding_window)):
            positions = torch.arange(length, device=query.device)
            distance = positions[:, None] - positions[None, :]
            allowed = distance >= 0
            if sliding_window is not None:
                allowed &= distance < sliding_window
        if softcap is None:
            result = F.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed, is_causal=causal and allowed is None,
                scale=scale, enable_gqa=heads != kv_heads)
        else:  # SDPA has no softcap: the same sums spelled out
            if heads != kv_heads:
                k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
            scores = torch.matmul(q, k.transpose(-1, -2)) * scale
            scores = softcap * torch.tanh(scores / softcap)
            if allowed is not None:
                scores = scores.masked_fill(~allowed, float("-inf"))
            result = torch.matmul(torch.softmax(scores, dim=-1), v)
        output[0, :, start:end] = result.transpose(0, 1).flatten(1, 2)
    return output.transpose(1, 2).to(out_dtype), None


AttentionInterface.register(VARLEN_ATTENTION_NAME, varlen_attention_forward)
