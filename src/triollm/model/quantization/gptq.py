"""GPTQ checkpoints (AutoGPTQ, GPTQModel, optimum): ``qweight`` int32 ``[K / pack, N]``
packed along the input dimension, ``qzeros`` int32 ``[groups, N / pack]`` packed along
the output dimension, ``scales`` ``[groups, N]``, ``g_idx`` ``[K]`` (``desc_act``).

The original format (``checkpoint_format`` ``gptq``, the default) stores each zero
point minus one and its kernels add the one back; ``gptq_v2`` stores the zero point
itself. A symmetric checkpoint's zero point is ``2**(bits - 1)`` whatever ``qzeros``
holds, as vLLM reads it."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from triollm.model.quantization.checkpoint_format import TensorGetter
from triollm.model.quantization.packing import unpack_int32
from triollm.model.quantization.weights import QuantizedWeight

__all__ = ["GPTQFormat"]

_BITS = (4, 8)
_CHECKPOINT_FORMATS = ("gptq", "gptq_v2")


@dataclass(frozen=True)
class _Settings:
    bits: int
    group_size: int
    desc_act: bool
    sym: bool


class GPTQFormat:
    """A GPTQ checkpoint's layers, by its ``quantization_config``."""

    method = "gptq"
    marker = "qweight"
    tensor_suffixes = ("qweight", "qzeros", "scales", "g_idx")

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.settings = _Settings(bits=int(config.get("bits", 4)),
                                  group_size=int(config.get("group_size", 128)),
                                  desc_act=bool(config.get("desc_act", False)),
                                  sym=bool(config.get("sym", True)))
        checkpoint_format = config.get("checkpoint_format") or config.get("format") or "gptq"
        if checkpoint_format not in _CHECKPOINT_FORMATS:
            raise ValueError(f"GPTQ checkpoint_format {checkpoint_format!r} is not supported "
                             f"(supported: {', '.join(_CHECKPOINT_FORMATS)})")
        self.zeros_minus_one = checkpoint_format == "gptq"
        #: GPTQModel's per-module overrides: ``{"+:regex" or "regex": {field: value}}``;
        #: ``-:`` rules leave modules unquantized, which their tensors show anyway.
        self.dynamic: dict[str, dict[str, Any]] = {
            pattern.removeprefix("+:"): dict(fields)
            for pattern, fields in (config.get("dynamic") or {}).items()
            if not pattern.startswith("-:")}
        for settings in [self.settings, *(self._override(self.settings, fields)
                                          for fields in self.dynamic.values())]:
            _check(settings)

    def read_layer(self, prefix: str, get: TensorGetter) -> QuantizedWeight:
        settings = self._settings_for(prefix)
        bits = settings.bits
        qweight = unpack_int32(get(f"{prefix}.qweight"), bits, dim=0, transpose=True)
        out_features, in_features = qweight.shape
        scales = get(f"{prefix}.scales").t().float().contiguous()  # [N, groups]
        if settings.sym:
            zeros = torch.full_like(scales, float(1 << (bits - 1)))
        else:
            zeros = unpack_int32(get(f"{prefix}.qzeros"), bits, dim=1, transpose=True)
            zeros = zeros[:out_features].float()
            if self.zeros_minus_one:
                zeros = zeros + 1
        per_channel = settings.group_size == -1 or settings.group_size >= in_features
        group_size = in_features if per_channel else settings.group_size
        group_index = None
        if settings.desc_act and not per_channel:
            group_index = get(f"{prefix}.g_idx").to(torch.int32)
        return QuantizedWeight(qweight=qweight, scales=scales, zeros=zeros.contiguous(),
                               bits=bits, group_size=group_size, group_index=group_index)

    def _settings_for(self, prefix: str) -> _Settings:
        for pattern, fields in self.dynamic.items():
            if re.match(pattern, prefix):
                return self._override(self.settings, fields)
        return self.settings

    @staticmethod
    def _override(settings: _Settings, fields: Mapping[str, Any]) -> _Settings:
        known = {key: type(getattr(settings, key))(value) for key, value in fields.items()
                 if key in ("bits", "group_size", "desc_act", "sym")}
        return replace(settings, **known)


def _check(settings: _Settings) -> None:
    if settings.bits not in _BITS:
        raise ValueError(f"GPTQ with bits={settings.bits} is not supported (supported: "
                         f"{', '.join(map(str, _BITS))})")
    if settings.group_size != -1 and settings.group_size <= 0:
        raise ValueError(f"GPTQ group_size={settings.group_size} is not valid")
