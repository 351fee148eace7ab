"""Pooling as the model folder says: hidden states of a prompt → one vector.

``resolve_pooler`` reads sentence-transformers' ``modules.json`` (its ``Pooling``,
``Dense`` and ``Normalize`` modules, new and legacy spellings) or falls back to the
architecture's default (CLS for encoders, the last token for decoders), then applies
``pooler_config`` overrides, once at start-up. ``Pooler`` is the torch side: it pools
a packed step's hidden states per prompt, applies the ``Dense`` layers, and each
request's Matryoshka truncation and normalization (in that order, as vLLM does).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from transformers.utils import cached_file

from triollm.config import DEMO_MODEL_NAME, DenseLayer, PoolerConfig, PoolingType
from triollm.errors import UnsupportedModelError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from triollm.pooling_params import PoolingParams, PoolingTask

__all__ = ["ENCODER_MODEL_TYPES", "Pooler", "find_file", "max_seq_length", "resolve_pooler",
           "sentence_transformers_modules"]

logger = logging.getLogger(__name__)

#: Bidirectional encoders (no causal mask, CLS pooling by default).
ENCODER_MODEL_TYPES = frozenset({
    "bert", "roberta", "xlm-roberta", "camembert", "distilbert", "electra", "mpnet",
    "modernbert", "nomic_bert", "new", "gte", "ernie",
})
_ST_POOLING_MODES: dict[str, PoolingType] = {"mean": "MEAN", "cls": "CLS", "lasttoken": "LAST"}
_LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens":
    "mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
_ACTIVATIONS = {"Identity": "identity", "Tanh": "tanh", "ReLU": "relu", "GELU": "gelu",
                "Sigmoid": "sigmoid"}
#: ``pooler_config`` keys (vLLM's names; ``normalize`` is older vLLM's).
POOLER_CONFIG_KEYS = ("pooling_type", "seq_pooling_type", "use_activation", "normalize",
                      "dimensions", "task")


def find_file(model: str, name: str, *, revision: str | None = None,
              download_dir: str | None = None) -> str | None:
    """The local path of ``name`` in a model directory or hub repo; None if it has none."""
    if model == DEMO_MODEL_NAME:
        return None
    kwargs: dict[str, Any] = {"_raise_exceptions_for_missing_entries": False,
                              "_raise_exceptions_for_connection_errors": False}
    if revision is not None:
        kwargs["revision"] = revision
    if download_dir is not None:
        kwargs["cache_dir"] = download_dir
    try:
        path = cached_file(model, name, **kwargs)
    except OSError:
        return None
    return str(path) if path is not None else None


def _read_json(model: str, name: str, **hub: Any) -> Any:
    path = find_file(model, name, **hub)
    if path is None:
        return None
    with open(path, encoding="utf-8") as file:
        return json.load(file)


def sentence_transformers_modules(model: str, **hub: Any) -> list[dict[str, Any]] | None:
    """The model's ``modules.json`` (a sentence-transformers folder), or None."""
    modules = _read_json(model, "modules.json", **hub)
    if modules is None:
        return None
    if not isinstance(modules, list):
        raise UnsupportedModelError(f"{model}: modules.json is not a list of modules")
    return modules


def max_seq_length(model: str, **hub: Any) -> int | None:
    """sentence-transformers' ``max_seq_length`` (what it truncates inputs to), if set."""
    for name in ("sentence_bert_config.json", "sentence_roberta_config.json",
                 "sentence_xlm-roberta_config.json", "sentence_distilbert_config.json"):
        found = _read_json(model, name, **hub)
        if isinstance(found, dict) and isinstance(found.get("max_seq_length"), int):
            return int(found["max_seq_length"])
    return None


def _kind(module: Mapping[str, Any]) -> str:
    return str(module.get("type", "")).rsplit(".", 1)[-1]


def _st_pooling_type(config: Mapping[str, Any], where: str) -> PoolingType:
    mode = config.get("pooling_mode")
    modes: list[str]
    if isinstance(mode, str):
        modes = [mode]
    elif isinstance(mode, list):
        modes = [str(m) for m in mode]
    else:
        modes = [name for key, name in _LEGACY_POOLING_KEYS.items() if config.get(key)]
    if len(modes) != 1 or modes[0] not in _ST_POOLING_MODES:
        raise UnsupportedModelError(
            f"{where}: pooling mode {modes or 'none'} is not supported; triollm pools with "
            f"one of {', '.join(_ST_POOLING_MODES)} (or set pooler_config's pooling_type)")
    return _ST_POOLING_MODES[modes[0]]


def _dense(config: Mapping[str, Any], folder: str, where: str) -> DenseLayer:
    activation = str(config.get("activation_function") or "torch.nn.modules.linear.Identity")
    name = activation.rsplit(".", 1)[-1]
    if name not in _ACTIVATIONS:
        raise UnsupportedModelError(f"{where}: Dense activation {activation!r} is not "
                                    f"supported (supported: {', '.join(_ACTIVATIONS)})")
    return DenseLayer(folder=folder, in_features=int(config["in_features"]),
                      out_features=int(config["out_features"]),
                      bias=bool(config.get("bias", True)), activation=_ACTIVATIONS[name])


def default_pooling_type(hf_config: PretrainedConfig) -> PoolingType:
    """CLS for bidirectional encoders, the last token for decoders (vLLM's defaults)."""
    return "CLS" if getattr(hf_config, "model_type", "") in ENCODER_MODEL_TYPES else "LAST"


def resolve_pooler(model: str, hf_config: PretrainedConfig, task: PoolingTask,
                   overrides: Mapping[str, Any], **hub: Any) -> PoolerConfig:
    """The model's pooling pipeline: sentence-transformers modules, else the
    architecture's defaults; ``overrides`` (``pooler_config``) on top."""
    for key in overrides:
        if key not in POOLER_CONFIG_KEYS:
            raise ValueError(f"pooler_config: unknown key {key!r}; expected some of "
                             f"{', '.join(POOLER_CONFIG_KEYS)}")
    hidden = int(getattr(hf_config, "hidden_size", 0) or 0)
    pooling_type = default_pooling_type(hf_config)
    dense: list[DenseLayer] = []
    use_activation = True
    source = "defaults"
    labels: tuple[str, ...] = ()
    size = hidden
    modules = sentence_transformers_modules(model, **hub) if task == "embed" else None
    if modules is not None:
        source = "sentence-transformers modules.json"
        use_activation = any(_kind(m) == "Normalize" for m in modules)
        for module in sorted(modules, key=lambda m: int(m.get("idx", 0))):
            kind, folder = _kind(module), str(module.get("path", ""))
            where = f"{model}/{folder or '.'}"
            if kind == "Pooling":
                config = _read_json(model, f"{folder}/config.json", **hub) or {}
                pooling_type = _st_pooling_type(config, where)
            elif kind == "Dense":
                config = _read_json(model, f"{folder}/config.json", **hub)
                if not isinstance(config, dict):
                    raise UnsupportedModelError(f"{where}: a Dense module without config.json")
                dense.append(_dense(config, folder, where))
            elif kind not in ("Transformer", "Normalize"):
                raise UnsupportedModelError(
                    f"{where}: the sentence-transformers module {module.get('type')!r} is "
                    f"not supported (supported: Transformer, Pooling, Dense, Normalize)")
        if dense:
            size = dense[-1].out_features
    if task == "classify":
        num_labels = int(getattr(hf_config, "num_labels", 1))
        id2label = getattr(hf_config, "id2label", None) or {}
        labels = tuple(str(id2label.get(i, f"LABEL_{i}")) for i in range(num_labels))
        size = num_labels
    pooling_override = overrides.get("pooling_type", overrides.get("seq_pooling_type"))
    if pooling_override is not None:
        name = str(pooling_override).upper()
        if name not in ("MEAN", "CLS", "LAST"):
            raise ValueError(f"pooler_config: pooling_type must be MEAN, CLS or LAST, got "
                             f"{pooling_override!r}")
        pooling_type = name  # type: ignore[assignment]
    for key in ("use_activation", "normalize"):
        if key in overrides:
            if not isinstance(overrides[key], bool):
                raise ValueError(f"pooler_config: {key} must be true or false")
            use_activation = overrides[key]
    if overrides.get("task") not in (None, task):
        raise ValueError(f"pooler_config: task {overrides['task']!r} does not match the "
                         f"model's task {task!r}")
    matryoshka = getattr(hf_config, "matryoshka_dimensions", None)
    is_matryoshka = bool(getattr(hf_config, "is_matryoshka", False) or matryoshka)
    dimensions = overrides.get("dimensions")
    if dimensions is not None and (not isinstance(dimensions, int) or not
                                   1 <= dimensions <= size or task != "embed"):
        raise ValueError(f"pooler_config: dimensions must be an integer in [1, {size}] for "
                         f"an embedding model, got {dimensions!r}")
    return PoolerConfig(
        task=task, pooling_type=pooling_type, use_activation=use_activation,
        embedding_size=size, dense_layers=tuple(dense), dimensions=dimensions,
        is_matryoshka=is_matryoshka or dimensions is not None,
        matryoshka_dimensions=tuple(matryoshka) if matryoshka else None,
        labels=labels, source=source)


_ACTIVATION_FNS = {"identity": lambda x: x, "tanh": torch.tanh, "relu": F.relu,
                   "gelu": F.gelu, "sigmoid": torch.sigmoid}


class Pooler:
    """Pools a packed step's hidden states (``[T, hidden]``, prompts one after another)
    into one float32 vector per prompt, then applies the Dense layers and each request's
    truncation and activation."""

    def __init__(self, config: PoolerConfig, model: str, device: torch.device,
                 **hub: Any) -> None:
        self.config = config
        self.dense: list[tuple[torch.nn.Linear, Any]] = []
        for layer in config.dense_layers:
            linear = torch.nn.Linear(layer.in_features, layer.out_features, bias=layer.bias)
            linear.load_state_dict(_dense_weights(model, layer.folder, **hub))
            self.dense.append((linear.to(device).eval(), _ACTIVATION_FNS[layer.activation]))

    def pool(self, hidden: torch.Tensor, spans: Sequence[tuple[int, int]]) -> torch.Tensor:
        """``[len(spans), hidden]`` float32: each prompt's tokens pooled."""
        kind = self.config.pooling_type
        if kind == "CLS":
            index = torch.tensor([start for start, _ in spans], device=hidden.device)
            return hidden.index_select(0, index).float()
        if kind == "LAST":
            index = torch.tensor([end - 1 for _, end in spans], device=hidden.device)
            return hidden.index_select(0, index).float()
        # MEAN: one segment sum over the packed rows
        lengths = torch.tensor([end - start for start, end in spans], device=hidden.device)
        segments = torch.repeat_interleave(torch.arange(len(spans), device=hidden.device),
                                           lengths)
        sums = torch.zeros(len(spans), hidden.shape[-1], dtype=torch.float32,
                           device=hidden.device)
        sums.index_add_(0, segments, hidden.float())
        return sums / lengths[:, None].to(torch.float32)

    def project(self, pooled: torch.Tensor) -> torch.Tensor:
        for linear, activation in self.dense:
            pooled = activation(linear(pooled))
        return pooled

    @staticmethod
    def finish_embedding(vector: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        if params.dimensions is not None:
            vector = vector[: params.dimensions]
        if params.use_activation:
            vector = F.normalize(vector, p=2, dim=-1)
        return vector

    @staticmethod
    def finish_scores(logits: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        if not params.use_activation:
            return logits
        return torch.sigmoid(logits) if logits.numel() == 1 else torch.softmax(logits, dim=-1)


def _dense_weights(model: str, folder: str, **hub: Any) -> dict[str, torch.Tensor]:
    path = find_file(model, f"{folder}/model.safetensors", **hub)
    if path is not None:
        from safetensors.torch import load_file

        weights = load_file(path)
    else:
        path = find_file(model, f"{folder}/pytorch_model.bin", **hub)
        if path is None:
            raise UnsupportedModelError(f"{model}/{folder}: a Dense module without weights "
                                        f"(model.safetensors or pytorch_model.bin)")
        weights = torch.load(path, map_location="cpu", weights_only=True)
    return {key.removeprefix("linear."): value.float() for key, value in weights.items()}
