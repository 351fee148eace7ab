"""Reading a PEFT LoRA adapter: its config through PEFT's own ``LoraConfig``, its
weights through PEFT's ``load_peft_weights``, checked against the layers the model
can adapt.

An adapter becomes one ``(A, B)`` pair per adapted layer, with PEFT's scaling
(``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA; ``rank_pattern`` and
``alpha_pattern`` per layer) folded into ``B``: ``y = base(x) + x A^T B^T``.

Anything of the adapter that triollm would not apply is refused, naming it, rather than
dropped: DoRA, LoRA biases, ``modules_to_save``, embedding or LM-head adapters,
modules the model lacks, ranks above ``max_lora_rank``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from triollm.errors import LoRAAdapterError, LoRAAdapterNotFoundError

if TYPE_CHECKING:
    from triollm.lora.request import LoRARequest

__all__ = ["LayerShape", "LoRAAdapter", "load_adapter"]

_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LayerShape:
    in_features: int
    out_features: int


@dataclass(frozen=True)
class LoRAAdapter:
    """One adapter's weights, ready for the runner's slots."""

    lora_int_id: int
    name: str
    path: str
    rank: int
    #: Per adapted layer (its module path in the model): ``A`` ``[r, in]`` and
    #: ``B * scaling`` ``[out, r]``.
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def _config(path: str) -> object:
    from peft import LoraConfig, PeftConfig

    if not os.path.isdir(path) and not _looks_like_hub_id(path):
        raise LoRAAdapterNotFoundError(f"no LoRA adapter at {path!r}: not a directory")
    try:
        config = PeftConfig.from_pretrained(path)
    except (OSError, ValueError, json.JSONDecodeError, TypeError) as error:
        if not os.path.isfile(os.path.join(path, "adapter_config.json")):
            raise LoRAAdapterNotFoundError(f"no LoRA adapter at {path!r}: {error}") from None
        raise LoRAAdapterError(f"{path!r}: adapter_config.json is not a PEFT config: "
                               f"{error}") from None
    if not isinstance(config, LoraConfig):
        raise LoRAAdapterError(f"{path!r} is a {type(config).__name__} adapter "
                               f"({getattr(config, 'peft_type', '?')}); only LoRA is served")
    return config


def _looks_like_hub_id(path: str) -> bool:
    """``owner/name``: ``from_pretrained`` may fetch it from the hub."""
    parts = path.split("/")
    return len(parts) == 2 and all(parts) and not path.startswith((".", "~"))


def _refuse_unsupported(config: object, path: str) -> None:
    checks = (
        ("use_dora", "DoRA adapters"),
        ("lora_bias", "LoRA biases (lora_bias)"),
        ("modules_to_save", "modules_to_save (fully trained extra modules)"),
        ("trainable_token_indices", "trainable_token_indices"),
    )
    for field_name, what in checks:
        if getattr(config, field_name, None):
            raise LoRAAdapterError(f"{path!r}: {what} are not supported")
    bias = getattr(config, "bias", "none")
    if bias != "none":
        raise LoRAAdapterError(f"{path!r}: bias={bias!r} is not supported (only 'none')")


def load_adapter(request: LoRARequest, layers: dict[str, LayerShape], *, max_rank: int,
                 dtype: torch.dtype) -> LoRAAdapter:
    """Read ``request``'s adapter for a model whose adaptable layers are ``layers`` (by
    module path). Raises ``LoRAAdapterError`` naming what does not fit."""
    from peft.utils import load_peft_weights
    from peft.utils.other import get_pattern_key

    path = request.lora_path
    config = _config(path)
    _refuse_unsupported(config, path)
    try:
        state = load_peft_weights(path, device="cpu")
    except (OSError, ValueError, RuntimeError) as error:
        raise LoRAAdapterError(f"{path!r}: its weights could not be read: {error}") from None

    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        name = key.removeprefix(_PREFIX)
        for part in ("lora_A", "lora_B"):
            suffix = f".{part}.weight"
            if name.endswith(suffix):
                pairs.setdefault(name[: -len(suffix)], {})[part] = tensor
                break
        else:
            raise LoRAAdapterError(f"{path!r}: weight {key!r} is not a LoRA A/B matrix "
                                   f"(embedding adapters and extra tensors are not supported)")
    if not pairs:
        raise LoRAAdapterError(f"{path!r}: the adapter has no LoRA weights")

    rank_pattern = dict(getattr(config, "rank_pattern", None) or {})
    alpha_pattern = dict(getattr(config, "alpha_pattern", None) or {})
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    top_rank = 0
    for module, pair in sorted(pairs.items()):
        shape = layers.get(module)
        if shape is None:
            raise LoRAAdapterError(
                f"{path!r}: target module {module!r} is not an adaptable layer of this model "
                f"(adaptable: {_summary(layers)})")
        if set(pair) != {"lora_A", "lora_B"}:
            raise LoRAAdapterError(f"{path!r}: {module!r} has only {sorted(pair)}")
        a, b = pair["lora_A"], pair["lora_B"]
        rank = a.shape[0]
        if (a.dim() != 2 or b.dim() != 2 or b.shape[1] != rank
                or a.shape[1] != shape.in_features or b.shape[0] != shape.out_features):
            raise LoRAAdapterError(
                f"{path!r}: {module!r} has A {tuple(a.shape)} and B {tuple(b.shape)}, which "
                f"do not fit a {shape.in_features} -> {shape.out_features} layer (an adapter "
                f"for another base model?)")
        if rank > max_rank:
            raise LoRAAdapterError(f"{path!r}: rank {rank} of {module!r} is above "
                                   f"max_lora_rank={max_rank}")
        r = rank_pattern.get(get_pattern_key(list(rank_pattern), module),
                             getattr(config, "r", rank))
        alpha = alpha_pattern.get(get_pattern_key(list(alpha_pattern), module),
                                  getattr(config, "lora_alpha", r))
        if r != rank:
            raise LoRAAdapterError(f"{path!r}: {module!r} has rank {rank} but the config "
                                   f"says r={r}")
        scaling = alpha / (r ** 0.5 if getattr(config, "use_rslora", False) else r)
        weights[module] = (a.to(dtype).contiguous(),
                           (b.float() * scaling).to(dtype).contiguous())
        top_rank = max(top_rank, rank)
    return LoRAAdapter(request.lora_int_id, request.lora_name, path, top_rank, weights)


def _summary(layers: dict[str, LayerShape]) -> str:
    names = sorted({name.rsplit(".", 1)[-1] for name in layers})
    return ", ".join(names) if names else "none"
