"""A quantized checkpoint loaded into a transformers model: the model is built with
its parameters on the meta device (the full-precision model is never in memory), the
unquantized tensors (embeddings, norms, biases, unquantized layers) are read from the
safetensors files into it, and each quantized linear layer's tensors become a
``QuantizedWeight`` handed to ``install``, one layer at a time."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from triollm.model.quantization.checkpoint_files import CheckpointTensors, checkpoint_directory
from triollm.model.quantization.checkpoint_format import CheckpointFormat
from triollm.model.quantization.replace import replace_linear_layers
from triollm.model.quantization.weights import QuantizedWeight

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

__all__ = ["InstallWeights", "load_quantized_model"]

#: Puts quantized weights into a loaded model, by linear module name.
InstallWeights = Callable[[nn.Module, Mapping[str, QuantizedWeight]], object]


def load_quantized_model(auto: Any, model: str, hf_config: PretrainedConfig,
                         fmt: CheckpointFormat, kwargs: dict[str, Any], *,
                         install: InstallWeights | None = None,
                         trust_remote_code: bool = False, revision: str | None = None,
                         download_dir: str | None = None) -> PreTrainedModel:
    """``auto``'s model for ``model``'s quantized checkpoint in ``fmt``, on the CPU;
    ``install`` puts the quantized weights in (default: ``replace_linear_layers``, the
    quantized layers)."""
    dtype: torch.dtype = kwargs["dtype"]
    with _parameters_on_meta():
        loaded = auto.from_config(_without_quantization(hf_config),
                                  trust_remote_code=trust_remote_code, **kwargs)
    directory = checkpoint_directory(model, revision=revision, download_dir=download_dir)
    with CheckpointTensors(directory) as tensors:
        names = tensors.names()
        quantized = {name.rpartition(".")[0] for name in names
                     if name.endswith(f".{fmt.marker}")}
        keys = _KeyMap(loaded)
        state: dict[str, torch.Tensor] = {}
        for name in names:
            prefix, _, suffix = name.rpartition(".")
            if prefix in quantized and suffix in fmt.tensor_suffixes:
                continue
            key = keys.model_key(name)
            if key is not None:
                tensor = tensors.get(name)
                state[key] = tensor.to(dtype) if tensor.is_floating_point() else tensor
        loaded.load_state_dict(state, strict=False, assign=True)
        prefixes: dict[str, str] = {}
        for prefix in sorted(quantized):
            if (key := keys.model_key(f"{prefix}.weight")) is not None:
                prefixes[key.removesuffix(".weight")] = prefix
        weights = _LayersRead(prefixes, fmt, tensors)
        if install is None:
            replace_linear_layers(loaded, weights, method=f"{fmt.method} checkpoint")
        else:
            install(loaded, weights)
    loaded.tie_weights()
    missing = [name for name, param in loaded.named_parameters() if param.is_meta]
    if missing:
        raise ValueError(f"{model}: the checkpoint has no weights for {', '.join(missing[:8])}"
                         f"{' ...' if len(missing) > 8 else ''}")
    return loaded


def _without_quantization(hf_config: PretrainedConfig) -> PretrainedConfig:
    config = copy.deepcopy(hf_config)
    for owner in (config, getattr(config, "text_config", None)):
        for name in ("quantization_config", "compression_config"):
            if owner is not None and hasattr(owner, name):
                delattr(owner, name)
    return config


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside is moved to the meta device (buffers, such as
    rotary frequencies, stay real)."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            kind = type(param)
            module._parameters[name] = kind(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


class _KeyMap:
    """Checkpoint tensor names → the model's state-dict keys: the same, or without or
    with the base model's prefix (a causal LM's checkpoint loaded as a bare model)."""

    def __init__(self, model: nn.Module) -> None:
        self.keys = set(model.state_dict(keep_vars=True))
        self.prefix = f"{getattr(model, 'base_model_prefix', '')}."

    def model_key(self, name: str) -> str | None:
        for key in (name, name.removeprefix(self.prefix), self.prefix + name):
            if key in self.keys:
                return key
        return None


class _LayersRead(Mapping[str, QuantizedWeight]):
    """The quantized layers by module name, each read from the checkpoint when looked
    up and not kept: one layer's unpacked integers are in memory at a time."""

    def __init__(self, prefixes: dict[str, str], fmt: CheckpointFormat,
                 tensors: CheckpointTensors) -> None:
        self.prefixes = prefixes
        self.fmt = fmt
        self.tensors = tensors

    def __getitem__(self, name: str) -> QuantizedWeight:
        return self.fmt.read_layer(self.prefixes[name], self.tensors.get)

    def __iter__(self) -> Iterator[str]:
        return iter(self.prefixes)

    def __len__(self) -> int:
        return len(self.prefixes)
