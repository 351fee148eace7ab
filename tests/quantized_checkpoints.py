"""Quantized checkpoints made offline, as the public tools write them: a random-weight
model's linear layers quantized and packed by each format's specification (written
here independently of triollm's unpacking), saved with the format's tensor names and
``quantization_config``; beside it, the same model with the quantized layers'
weights dequantized, in fp32, for transformers to run as the reference."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from triollm.testing import build_tiny_model

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: Large enough for every group size the formats use (32, 64, 128).
SHAPE = {"hidden_size": 128, "intermediate_size": 256, "head_dim": 32}


@dataclass(frozen=True)
class Quantized:
    """One layer: its checkpoint tensors (suffix → tensor) and the weight they stand for."""

    tensors: dict[str, torch.Tensor]
    weight: torch.Tensor


def _pack_words(values: list[torch.Tensor], bits: int) -> torch.Tensor:
    """int32 words holding ``values[j]`` at bits ``j * bits`` up (two's complement)."""
    word = torch.zeros_like(values[0], dtype=torch.int64)
    for j, value in enumerate(values):
        word += value.to(torch.int64) << (bits * j)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def _groups(in_features: int, group_size: int, desc_act: bool,
            generator: torch.Generator) -> torch.Tensor:
    """Each input column's group: in order, or (act-order) by a random column order."""
    size = in_features if group_size == -1 else group_size
    if not desc_act:
        return torch.arange(in_features) // size
    order = torch.randperm(in_features, generator=generator)
    groups = torch.empty(in_features, dtype=torch.long)
    groups[order] = torch.arange(in_features) // size
    return groups


def _minmax(weight: torch.Tensor, groups: torch.Tensor, num_groups: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    lows = torch.stack([weight[:, groups == g].amin(dim=1) for g in range(num_groups)], 1)
    highs = torch.stack([weight[:, groups == g].amax(dim=1) for g in range(num_groups)], 1)
    return lows, highs


def _integer_grid(weight: torch.Tensor, groups: torch.Tensor, bits: int, sym: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unsigned ``q`` [N, K], fp16-exact ``scales`` and integer ``zeros`` [N, G] such
    that ``weight ~ (q - zeros[:, groups]) * scales[:, groups]``."""
    maxq = 2**bits - 1
    num_groups = int(groups.max()) + 1
    lows, highs = _minmax(weight, groups, num_groups)
    if sym:
        top = torch.maximum(lows.abs(), highs.abs())
        scales = (2 * top / maxq).half().float()
        zeros = torch.full_like(scales, float(2 ** (bits - 1)))
    else:
        scales = ((highs - lows) / maxq).half().float()
        zeros = torch.round(-lows / scales).clamp(1, maxq)
    q = torch.round(weight / scales[:, groups] + zeros[:, groups]).clamp(0, maxq)
    return q.long(), scales, zeros.long()


def gptq_layer(weight: torch.Tensor, *, bits: int, group_size: int, sym: bool,
               desc_act: bool, checkpoint_format: str, generator: torch.Generator
               ) -> Quantized:
    """AutoGPTQ's layout: qweight [K/pack, N] along K, qzeros [G, N/pack] along N (the
    zero minus one in the original format), scales [G, N], g_idx [K]."""
    in_features = weight.shape[1]
    groups = _groups(in_features, group_size, desc_act, generator)
    q, scales, zeros = _integer_grid(weight, groups, bits, sym)
    pack = 32 // bits
    columns = q.t()  # [K, N]
    qweight = _pack_words([columns[j::pack] for j in range(pack)], bits)
    stored = zeros.t() - (1 if checkpoint_format == "gptq" else 0)  # [G, N]
    qzeros = _pack_words([stored[:, j::pack] for j in range(pack)], bits)
    dequantized = (q - zeros[:, groups]).float() * scales[:, groups]
    return Quantized({"qweight": qweight, "qzeros": qzeros, "scales": scales.t().half(),
                      "g_idx": groups.to(torch.int32)}, dequantized)


def awq_layer(weight: torch.Tensor, *, group_size: int, generator: torch.Generator
              ) -> Quantized:
    """AutoAWQ's GEMM layout: qweight [K, N/8] and qzeros [G, N/8] along N in AWQ's
    order (nibble i of a word holds column AWQ_ORDER[i]), scales [G, N]."""
    groups = _groups(weight.shape[1], group_size, False, generator)
    q, scales, zeros = _integer_grid(weight, groups, 4, sym=False)

    def pack(values: torch.Tensor) -> torch.Tensor:  # values [rows, N]
        return _pack_words([values[:, AWQ_ORDER[i]::8] for i in range(8)], 4)

    dequantized = (q - zeros[:, groups]).float() * scales[:, groups]
    return Quantized({"qweight": pack(q.t()), "qzeros": pack(zeros.t()),
                      "scales": scales.t().half()}, dequantized)


def compressed_layer(weight: torch.Tensor, *, bits: int, group_size: int | None,
                     sym: bool, actorder: bool, generator: torch.Generator) -> Quantized:
    """compressed-tensors' pack-quantized layout: signed values offset by 2**(bits-1),
    weight_packed [N, K/pack] along K, weight_scale [N, G], weight_zero_point
    [N/pack, G] along N (asymmetric), weight_shape, weight_g_idx (actorder)."""
    out_features, in_features = weight.shape
    groups = _groups(in_features, group_size or -1, actorder, generator)
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    lows, highs = _minmax(weight, groups, int(groups.max()) + 1)
    if sym:
        scales = (torch.maximum(lows.abs(), highs.abs()) / ((qmax - qmin) / 2)).half().float()
        zero_points = torch.zeros_like(scales, dtype=torch.long)
    else:
        scales = ((highs - lows) / (qmax - qmin)).half().float()
        zero_points = torch.round(qmin - lows / scales).clamp(qmin, qmax).long()
    signed = torch.round(weight / scales[:, groups] + zero_points[:, groups]).clamp(qmin, qmax)
    signed = signed.long()
    offset = 2 ** (bits - 1)
    pack = 32 // bits
    tensors = {
        "weight_packed": _pack_words([(signed + offset)[:, j::pack] for j in range(pack)],
                                     bits),
        "weight_scale": scales.half(),
        "weight_shape": torch.tensor([out_features, in_features], dtype=torch.int64),
    }
    if not sym:
        shifted = zero_points + offset
        tensors["weight_zero_point"] = _pack_words([shifted[j::pack] for j in range(pack)],
                                                   bits)
    if actorder:
        tensors["weight_g_idx"] = groups.to(torch.int32)
    dequantized = (signed - zero_points[:, groups]).float() * scales[:, groups]
    return Quantized(tensors, dequantized)


def gptq_config(*, bits: int, group_size: int, sym: bool, desc_act: bool,
                checkpoint_format: str) -> dict[str, Any]:
    return {"quant_method": "gptq", "bits": bits, "group_size": group_size,
            "desc_act": desc_act, "sym": sym, "damp_percent": 0.01, "true_sequential": True,
            "static_groups": False, "lm_head": False, "checkpoint_format": checkpoint_format,
            "model_name_or_path": None, "model_file_base_name": None}


def awq_config(*, group_size: int) -> dict[str, Any]:
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
            "version": "gemm", "modules_to_not_convert": None}


def compressed_config(*, bits: int, group_size: int | None, sym: bool,
                      actorder: bool) -> dict[str, Any]:
    weights = {"num_bits": bits, "type": "int", "symmetric": sym,
               "strategy": "channel" if group_size is None else "group",
               "group_size": group_size, "dynamic": False, "observer": "minmax",
               "observer_kwargs": {}, "actorder": "group" if actorder else None,
               "block_structure": None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "kv_cache_scheme": None, "sparsity_config": {}, "global_compression_ratio": None,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None,
                                          "output_activations": None,
                                          "format": "pack-quantized"}}}


def quantize_layer(method: str, weight: torch.Tensor, settings: dict[str, Any],
                   generator: torch.Generator) -> Quantized:
    if method == "gptq":
        return gptq_layer(weight, generator=generator, **settings)
    if method == "awq":
        return awq_layer(weight, generator=generator, **settings)
    return compressed_layer(weight, generator=generator, **settings)


def quantization_config(method: str, settings: dict[str, Any]) -> dict[str, Any]:
    if method == "gptq":
        return gptq_config(**settings)
    if method == "awq":
        return awq_config(**settings)
    return compressed_config(**settings)


def build_quantized_checkpoint(family: str, directory: Path, tokenizer: Any, method: str,
                               settings: dict[str, Any], *, seed: int = 0,
                               shards: int = 1, **overrides: Any) -> tuple[Path, Path]:
    """``(checkpoint, reference)``: the quantized checkpoint, and the same model with
    its quantized layers dequantized, saved in fp32. ``overrides`` go to the model's
    config (``tie_word_embeddings``: the checkpoint has no LM head of its own)."""
    from transformers import AutoModelForCausalLM

    full = build_tiny_model(family, directory / "full", tokenizer, seed=seed,
                            **SHAPE, **overrides)
    model = AutoModelForCausalLM.from_pretrained(full, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    quantized: set[str] = set()
    with torch.no_grad():
        for parameter in model.parameters():  # the checkpoint stores fp16
            parameter.copy_(parameter.half().float())
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and name.rpartition(".")[2] in LINEAR_NAMES:
                layer = quantize_layer(method, module.weight.detach(), settings, generator)
                module.weight.copy_(layer.weight)
                quantized.add(name)
                state.update({f"{name}.{suffix}": tensor.contiguous()
                              for suffix, tensor in layer.tensors.items()})
    reference = directory / "reference"
    model.save_pretrained(reference)
    tokenizer.save_pretrained(reference)
    tied = model.config.tie_word_embeddings
    for key, tensor in model.state_dict().items():
        if tied and key == "lm_head.weight":
            continue
        if key.removesuffix(".weight") not in quantized:
            state[key] = tensor.half().contiguous()
    checkpoint = directory / "checkpoint"
    checkpoint.mkdir(parents=True)
    _save(state, checkpoint, shards)
    config = model.config.to_dict()
    config["torch_dtype"] = "float16"
    config["quantization_config"] = quantization_config(method, settings)
    (checkpoint / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(checkpoint)
    return checkpoint, reference


def _save(state: dict[str, torch.Tensor], directory: Path, shards: int) -> None:
    names = sorted(state)
    if shards == 1:
        save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for shard in range(shards):
        file = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: state[name] for name in names[shard::shards]}
        save_file(part, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size()
                                            for t in state.values())},
             "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
