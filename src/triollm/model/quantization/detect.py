"""Which quantized checkpoint format a model is in, from its config's
``quantization_config`` as vLLM reads it, and ``--quantization`` to force one: a
forced method must be the checkpoint's own, and a method triollm cannot read is
refused with its name."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from triollm.model.quantization.awq import AWQFormat
from triollm.model.quantization.checkpoint_format import CheckpointFormat
from triollm.model.quantization.compressed_tensors import CompressedTensorsFormat
from triollm.model.quantization.gptq import GPTQFormat
from triollm.model.quantization.methods import CHECKPOINT_METHODS

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["checkpoint_format", "quantization_config"]

#: Where older GPTQ and AWQ checkpoints keep their settings instead of config.json's
#: ``quantization_config``; read only when ``--quantization`` names the method, as vLLM.
_CONFIG_FILES = {"gptq": ("quantize_config.json",),
                 "awq": ("quantize_config.json", "quant_config.json")}

_FORMATS: dict[str, Callable[[Mapping[str, Any]], CheckpointFormat]] = {
    "gptq": GPTQFormat,
    "awq": AWQFormat,
    "compressed-tensors": CompressedTensorsFormat,
}


def quantization_config(hf_config: PretrainedConfig) -> dict[str, Any] | None:
    """The checkpoint's quantization config (compressed-tensors' older checkpoints call
    it ``compression_config``); None for a checkpoint in full precision."""
    for owner in (hf_config, getattr(hf_config, "text_config", None)):
        for name in ("quantization_config", "compression_config"):
            found = getattr(owner, name, None) if owner is not None else None
            if found is not None:
                return dict(found if isinstance(found, Mapping) else found.to_dict())
    return None


def checkpoint_format(hf_config: PretrainedConfig, requested: str | None = None,
                      directory: Callable[[], Path] | None = None) -> CheckpointFormat | None:
    """The format of the model's quantized checkpoint; None where the checkpoint is not
    quantized and ``requested`` (``--quantization``) asks for no checkpoint format.
    ``directory`` gives the checkpoint's files, where a GPTQ or AWQ checkpoint named by
    ``requested`` may keep its settings in ``quantize_config.json``.

    Raises ``ValueError`` naming the method for a method triollm does not read, a
    ``requested`` method that is not the checkpoint's, or a checkpoint format asked
    for on a checkpoint that has none.
    """
    config = quantization_config(hf_config)
    wanted = _method_named(requested)
    if config is None and wanted in _CONFIG_FILES and directory is not None:
        config = _config_file(directory(), wanted)
    if config is None:
        if wanted is not None:
            raise ValueError(f"--quantization {requested} reads a {wanted} checkpoint, but the "
                             f"model's config has no quantization_config: it is not quantized")
        return None
    method = str(config.get("quant_method", "")).lower()
    if method not in _FORMATS:
        raise ValueError(
            f"the checkpoint is quantized with {method or 'an unnamed method'!r}, which "
            f"triollm cannot load (it loads {', '.join(_FORMATS)} checkpoints)")
    if requested is not None and requested not in CHECKPOINT_METHODS[method]:
        raise ValueError(
            f"--quantization {requested} does not match the checkpoint's quantization "
            f"method ({method}); leave --quantization out or pass "
            f"--quantization {method}")
    return _FORMATS[method](config)


def _method_named(requested: str | None) -> str | None:
    for method, names in CHECKPOINT_METHODS.items():
        if requested in names:
            return method
    return None


def _config_file(directory: Path, method: str) -> dict[str, Any] | None:
    for name in _CONFIG_FILES[method]:
        path = directory / name
        if path.is_file():
            return {"quant_method": method, **json.loads(path.read_text("utf-8"))}
    return None
