"""compressed-tensors checkpoints (llm-compressor) with weight-only integer schemes:
W4A16 / W8A16.

``pack-quantized``: ``weight_packed`` int32 ``[N, K / pack]`` packed along the input
dimension, the signed values offset by ``2**(bits - 1)``; ``weight_scale`` ``[N,
groups]``; ``weight_zero_point`` (asymmetric schemes) int32 ``[N / pack, groups]``
packed along the output dimension with the same offset; ``weight_shape`` ``[N, K]``;
``weight_g_idx`` ``[K]`` (``actorder: group``). ``int-quantized``: ``weight`` int8
``[N, K]`` signed, ``weight_scale``, ``weight_zero_point`` unpacked. A scheme that also
quantizes activations (W8A8) needs an int8 activation GEMM on CPU, which triollm does
not have: it is refused."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from triollm.model.quantization.checkpoint_format import TensorGetter
from triollm.model.quantization.packing import unpack_int32
from triollm.model.quantization.weights import QuantizedWeight

__all__ = ["CompressedTensorsFormat"]

_FORMATS = ("pack-quantized", "int-quantized")
_BITS = (4, 8)


@dataclass(frozen=True)
class _Scheme:
    targets: tuple[str, ...]
    bits: int
    group_size: int | None  # None: per-channel
    symmetric: bool
    format: str


class CompressedTensorsFormat:
    """A compressed-tensors checkpoint's layers, by its ``quantization_config``."""

    method = "compressed-tensors"
    marker = "weight_scale"
    tensor_suffixes = ("weight_packed", "weight", "weight_scale", "weight_zero_point",
                       "weight_shape", "weight_g_idx")

    def __init__(self, config: Mapping[str, Any]) -> None:
        default_format = config.get("format", "pack-quantized")
        self.ignore = tuple(config.get("ignore") or ())
        self.schemes = [_scheme(name, group, default_format)
                        for name, group in (config.get("config_groups") or {}).items()]
        if not self.schemes:
            raise ValueError("compressed-tensors checkpoint without config_groups: nothing "
                             "is quantized")
        if config.get("kv_cache_scheme"):
            raise ValueError("compressed-tensors kv_cache_scheme (a quantized KV cache in "
                             "the checkpoint) is not supported")
        sparsity = config.get("sparsity_config") or {}
        if sparsity.get("format") not in (None, "dense"):
            raise ValueError(f"compressed-tensors sparsity format {sparsity['format']!r} is "
                             f"not supported")

    def read_layer(self, prefix: str, get: TensorGetter) -> QuantizedWeight:
        scheme = self._scheme_for(prefix)
        bits = scheme.bits
        offset = 1 << (bits - 1)
        scales = get(f"{prefix}.weight_scale").float()  # [N, groups]
        if scheme.format == "pack-quantized":
            out_features, in_features = (int(d) for d in get(f"{prefix}.weight_shape").tolist())
            qweight = unpack_int32(get(f"{prefix}.weight_packed"), bits, dim=1)[:, :in_features]
        else:
            qweight = get(f"{prefix}.weight").to(torch.int32) + offset
            out_features, in_features = qweight.shape
        if scheme.symmetric:
            zeros = torch.full_like(scales, float(offset))
        elif scheme.format == "pack-quantized":
            packed = get(f"{prefix}.weight_zero_point")
            zeros = unpack_int32(packed, bits, dim=0)[:out_features].float()
        else:
            zeros = get(f"{prefix}.weight_zero_point").float() + offset
        if scales.dim() == 1:
            scales, zeros = scales[:, None], zeros.reshape(out_features, -1)
        group_size = scheme.group_size or in_features
        try:
            group_index = get(f"{prefix}.weight_g_idx").to(torch.int32)
        except KeyError:
            group_index = None
        return QuantizedWeight(qweight=qweight.contiguous(), scales=scales.contiguous(),
                               zeros=zeros.contiguous(), bits=bits,
                               group_size=min(group_size, in_features), group_index=group_index)

    def _scheme_for(self, prefix: str) -> _Scheme:
        # a layer's name or regex wins over the class name every linear layer matches
        for scheme in self.schemes:
            if any(_matches(target, prefix) for target in scheme.targets):
                return scheme
        for scheme in self.schemes:
            if "Linear" in scheme.targets:
                return scheme
        raise ValueError(f"compressed-tensors: no config group targets {prefix}")


def _matches(target: str, name: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return name == target or name.endswith(f".{target}")


def _scheme(name: str, group: Mapping[str, Any], default_format: str) -> _Scheme:
    weights = group.get("weights") or {}
    fmt = group.get("format") or default_format
    if group.get("input_activations"):
        raise ValueError(f"compressed-tensors config group {name!r} quantizes activations "
                         f"(W8A8-style, format {fmt!r}): that needs an int8 activation GEMM, "
                         f"which triollm does not have on CPU; weight-only schemes (W4A16, "
                         f"W8A16) are supported")
    if fmt not in _FORMATS:
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported (supported: "
                         f"{', '.join(_FORMATS)})")
    kind, bits = weights.get("type", "int"), int(weights.get("num_bits", 0))
    if kind != "int" or bits not in _BITS:
        raise ValueError(f"compressed-tensors weights of type {kind!r} with {bits} bits are "
                         f"not supported (supported: int, {' or '.join(map(str, _BITS))} bits)")
    strategy = weights.get("strategy", "group" if weights.get("group_size") else "channel")
    if strategy not in ("group", "channel"):
        raise ValueError(f"compressed-tensors weight strategy {strategy!r} is not supported "
                         f"(supported: group, channel)")
    if weights.get("dynamic"):
        raise ValueError("compressed-tensors dynamic weight quantization is not supported")
    group_size = int(weights["group_size"]) if strategy == "group" else None
    return _Scheme(targets=tuple(group.get("targets") or ("Linear",)), bits=bits,
                   group_size=group_size, symmetric=bool(weights.get("symmetric", True)),
                   format=fmt)
